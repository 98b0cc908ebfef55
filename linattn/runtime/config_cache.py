"""Per-GPU launch-config cache written by `linattn tune` and read by launchers.

One JSON file per (GPU name, Triton version): {kernel: {source_hash: {shape_key: config_dict}}}. A kernel whose
source changed has a new hash, so stale entries are simply not found. Launchers never tune: they look up, and
fall back to their frozen heuristic on a miss.

Location: $XDG_CACHE_HOME/linattn/configs (default ~/.cache/linattn/configs).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

_MEMO: dict = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "linattn" / "configs"


def cache_path(gpu_name: str, triton_version: Optional[str] = None) -> Path:
    if triton_version is None:
        import triton
        triton_version = triton.__version__
    slug = re.sub(r"[^A-Za-z0-9]+", "_", gpu_name).strip("_") or "unknown"
    return cache_dir() / f"{slug}__triton-{triton_version}.json"


def _read(path: Path) -> dict:
    key = str(path)
    if key not in _MEMO:
        try:
            _MEMO[key] = json.loads(path.read_text())
        except (OSError, ValueError):
            _MEMO[key] = {}
    return _MEMO[key]


def lookup(kernel: str, source_hash: str, shape_key: str, facts) -> Optional[dict]:
    """The tuned config dict, or None. `facts` is a DeviceFacts; the CPU never has entries."""
    if getattr(facts, "kind", "cpu") != "cuda":
        return None
    data = _read(cache_path(facts.name))
    return data.get(kernel, {}).get(source_hash, {}).get(shape_key)


def store(kernel: str, source_hash: str, shape_key: str, config: dict, gpu_name: str, extra: dict = None) -> Path:
    """Record one tuned entry (merging with what the file holds) and return the file path."""
    path = cache_path(gpu_name)
    data = dict(_read(path))
    data.setdefault(kernel, {}).setdefault(source_hash, {})[shape_key] = dict(config)
    if extra:
        data.setdefault("_meta", {}).update(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)                       # atomic: a concurrent reader sees the old or the new file
    _MEMO[str(path)] = data
    return path


def fits_shared_memory(smem_bytes: int, facts) -> bool:
    """Prune configs that cannot launch: their shared memory exceeds the device's per-block opt-in budget."""
    budget = getattr(facts, "smem_per_block", 0)
    return budget == 0 or smem_bytes <= budget
