"""The environment line every result carries: GPU, clocks at the time of the run, driver, library versions and
the linattn commit. Each probe that fails says so instead of guessing."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import Dict

import torch


def _run(cmd, cwd=None) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
        return p.stdout.strip() if p.returncode == 0 else ""
    except Exception:
        return ""


def nvidia_smi() -> Dict:
    """Name, current SM and memory clocks, driver, via nvidia-smi (read only: no setting is touched)."""
    if shutil.which("nvidia-smi") is None:
        return {"nvidia_smi": "not found"}
    out = _run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version,temperature.gpu,"
                "power.draw", "--format=csv,noheader"])
    if not out:
        return {"nvidia_smi": "query failed"}
    first = [x.strip() for x in out.splitlines()[0].split(",")]
    keys = ("name", "sm_clock", "mem_clock", "max_sm_clock", "driver", "temperature", "power")
    return dict(zip(keys, first))


def package_version(module: str) -> str:
    """Version of an importable package, or why not. fla and flash_qla query the GPU at import, so a failure
    to import on a CPU machine is reported, not raised."""
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "unknown version"))
    except Exception as e:
        return f"not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def git_commit() -> str:
    # The device machine receives a copy of the work tree whose .git, when there is one, is not the commit
    # being run (it has named the session's first commit): the runner passes the commit in, and
    # that wins.
    given = os.environ.get("LINATTN_COMMIT", "").strip()
    if given:
        return f"{given} (LINATTN_COMMIT)"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sha = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root)
    if not sha:
        return "unknown (not a git checkout, LINATTN_COMMIT not set)"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return sha + ("+dirty" if dirty else "")


def collect_env(device) -> Dict:
    """The environment of a result: every bench and GPU script records this dict (and `env_line` of it)."""
    import time

    import triton
    dev = torch.device(device)
    env = dict(time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=str(dev), python=platform.python_version(), torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda or "none", linattn_commit=git_commit(),
               fla=package_version("fla"), flash_qla=package_version("flash_qla"),
               triton_interpret=os.environ.get("TRITON_INTERPRET", "0"),
               fla_env={k: os.environ[k] for k in ("FLA_FLASH_QLA", "FLA_TILELANG") if k in os.environ})
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gb=round(p.total_memory / 2 ** 30, 1))
        env.update(nvidia_smi())
    else:
        env.update(gpu="none (CPU run)", cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    return env


def env_line(env: Dict) -> str:
    if env.get("gpu", "").startswith("none"):
        head = f"CPU ({env.get('cores')} cores), TRITON_INTERPRET={env.get('triton_interpret')}"
    else:
        head = (f"{env.get('gpu')} sm_{env.get('capability', '?').replace('.', '')} {env.get('sms')} SMs, "
                f"SM clock {env.get('sm_clock', '?')} (max {env.get('max_sm_clock', '?')}), "
                f"mem clock {env.get('mem_clock', '?')}, driver {env.get('driver', '?')}")
    return (f"{head}; torch {env['torch']}, triton {env['triton']}, linattn {env['linattn_commit']}, "
            f"fla {env['fla']}, flash_qla {env['flash_qla']}")
