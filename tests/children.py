"""Child processes of the tests that compile for sm_90a on the CPU (the stand-in driver of linattn.runtime.hostsim):
the code runs without TRITON_INTERPRET, with the repository first on the path, and prints its result as JSON on its
last line."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json_child(code: str, timeout: int = 900):
    """Run `code` in a fresh Python without TRITON_INTERPRET; fail the test with its stderr's tail when it exits
    non-zero, else return the JSON of its last output line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
