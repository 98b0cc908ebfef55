"""Shared by the GPU scripts: the environment line and JSON writing."""
import json
import os
import subprocess
import sys
import time


def env_line() -> dict:
    import torch
    import triton
    env = dict(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), python=sys.version.split()[0],
               torch=torch.__version__, triton=triton.__version__)
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(__file__)).stdout.strip() or os.environ.get("LINATTN_COMMIT", "")
    except OSError:
        env["commit"] = os.environ.get("LINATTN_COMMIT", "")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,driver_version",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
            env["nvidia_smi"] = q
        except (OSError, subprocess.TimeoutExpired):
            env["nvidia_smi"] = "unavailable"
    try:
        import fla
        env["fla"] = getattr(fla, "__version__", "unknown")
    except Exception:
        env["fla"] = None
    return env


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
