"""One bench run, as users run the code: every backend timed in its own fresh Python process
(linattn.bench.child), the processes alternated (A, B, C, A, B, C, ... for `procs` rounds) so that drift of clocks,
temperature or the machine hits every backend alike. The first round also checks every row's outputs (the anchor
scheme of linattn.bench.child). Rows, medians, spreads and ratios come from linattn.bench.aggregate; the roofline
floor from the ceilings' medians over the processes.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import torch

from linattn.bench.aggregate import COLUMNS, aggregate, median_ceilings
from linattn.bench import child
from linattn.bench.ops import get_bench_op
from linattn.bench.presets import get_preset
from linattn.bench.report import SCHEMA, fit
from linattn.bench.timing import child_env, cold_start, floor_ms, linattn_tree

CHILD_TIMEOUT_S = 3600


def _order(op, backends: List[str]) -> List[str]:
    """linattn's backends first (the first that runs a row is its anchor), then peers, each in the order given."""
    mine = [b for b in backends if b not in op.peers]
    return mine + [b for b in backends if b in op.peers]


def run_child(job: Dict, timeout_s: float = CHILD_TIMEOUT_S) -> Dict:
    """Run one job in a fresh process; its stderr is passed through live, its stdout (one JSON object) parsed.
    A process that dies or times out gives a record with status "error", the reason and its last stderr lines."""
    cmd = [sys.executable, "-m", "linattn.bench.child", json.dumps(job)]
    tail: collections.deque = collections.deque(maxlen=12)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env=child_env(), cwd=linattn_tree(), stdout=out, stderr=subprocess.PIPE,
                                text=True)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip())
            rc = proc.wait()
        finally:
            timer.cancel()
        out.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith("{")]
    wall = time.perf_counter() - t0
    base = dict(backend=job["backend"], round=job["round"], process_s=wall)
    if rc != 0 or not lines:
        why = f"timed out after {timeout_s:.0f} s" if wall >= timeout_s else f"exit status {rc}"
        return dict(base, status="error", reason=why, stderr_tail=list(tail), rows=[])
    return dict(json.loads(lines[-1]), status="ok", **base)


def _roofline(rows: List[Dict], op, shapes: List[Dict], ceilings: Dict):
    """Each row's shape, FLOPs, bytes and floor; per timing column TFLOP/s, GB/s and % of the floor."""
    for r in rows:
        r["shape"] = shapes[int(r["key"].split("-")[0])]
        if r["status"] != "ok" or not ceilings:
            continue
        flops, nbytes = op.flops(r["shape"], r["mode"], r["backend"]), op.bytes(r["shape"], r["mode"], r["backend"])
        fl = floor_ms(flops, nbytes, ceilings)
        r.update(flops=flops, bytes=nbytes, floor=fl)
        for name in COLUMNS:
            col = r[name]
            if col["status"] == "ok":
                ms = col["median_ms"]
                col.update(tflops=flops / (ms * 1e-3) / 1e12, gbps=nbytes / (ms * 1e-3) / 1e9,
                           pct_of_floor=100.0 * fl["floor_ms"] / ms)


def _refresh(result: Dict, op, shapes: List[Dict]):
    """Recompute the result's rows, ceilings and environment from the processes so far."""
    procs = result["processes"]
    ran = [p for p in procs if p.get("env")]
    if ran:
        result["env"], result["env_line"] = ran[0]["env"], ran[0]["env_line"]
    result["ceilings"] = median_ceilings(procs)
    result["rows"] = aggregate(procs, result["backends"], op.peers)
    _roofline(result["rows"], op, shapes, result["ceilings"])


def run_bench(op_name: str, preset: str, backends: List[str], modes: List[str], repeats: int, warmup: int = 3,
              procs: int = 3, device: Optional[str] = None, graph: bool = True, cold: bool = False,
              cold_only: bool = False, log=None, on_progress=None, timeout_s: float = CHILD_TIMEOUT_S) -> Dict:
    """on_progress(result): called after every cold start and every process (the CLI writes a partial JSON there,
    so a run cut short by a time limit still leaves its measurements)."""
    if procs < 1:
        raise ValueError(f"procs must be at least 1, got {procs}")
    log = log or (lambda line: print(fit(line), flush=True))
    op = get_bench_op(op_name)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = get_preset(preset)
    order = _order(op, backends)
    result = dict(schema=SCHEMA, op=op.name, preset=preset, device=str(dev), env={}, env_line="", ceilings={},
                  backends=order, peers=[b for b in order if b in op.peers], modes=modes, procs=procs,
                  repeats=repeats, warmup=warmup, bytes_model=op.bytes_model, flops_model=op.flops.__doc__.strip(),
                  rows=[], processes=[], cold=[], reference_limit=child.REFERENCE_LIMIT,
                  method=__doc__.strip().split("\n\n")[0].replace("\n", " "),
                  comparison=child.__doc__.strip().split("\n\n")[2].replace("\n", " "))
    log(f"[bench] {op.name} preset={preset} on {dev}: {len(order)} backends x {procs} fresh processes each, "
        f"alternated: {' '.join(order)}")
    if cold or cold_only:
        for mode in modes:
            for b in order:
                log(f"[bench] cold start {b} {mode} (fresh process, empty caches) ...")
                result["cold"].append(cold_start(op.name, b, mode, shapes[0], str(dev)))
                _log_cold(log, result["cold"][-1])
                if on_progress:
                    on_progress(result)
    if cold_only:
        return result
    with tempfile.TemporaryDirectory(prefix="linattn-bench-") as compare_dir:
        for rnd in range(procs):
            for b in order:
                job = dict(op=op.name, backend=b, shapes=shapes, modes=modes, device=str(dev), repeats=repeats,
                           warmup=warmup, round=rnd, graph=graph, compare_dir=compare_dir if rnd == 0 else None)
                p = run_child(job, timeout_s)
                result["processes"].append(p)
                _refresh(result, op, shapes)
                ok = sum(r["status"] == "ok" for r in p["rows"])
                log(f"[bench] process {len(result['processes'])}/{procs * len(order)} (round {rnd}, {b}): "
                    f"{p['status']}, {ok} of {len(p['rows'])} rows ran, {p['process_s']:.1f} s"
                    + (f": {p['reason']}: {' | '.join(p['stderr_tail'][-3:])}" if p["status"] != "ok" else ""))
                if on_progress:
                    on_progress(result)
    return result


def _log_cold(log, c):
    if c.get("status") == "ok":
        log(f"[bench] cold start {c['backend']} {c['mode']}: first call {c['first_call_s']:.2f} s, "
            f"fresh process {c['process_s']:.1f} s")
    else:
        log(f"[bench] cold start {c['backend']} {c['mode']}: {c.get('status')}: {c.get('reason')}")
