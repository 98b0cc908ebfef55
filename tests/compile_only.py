"""A stand-in Triton driver for the CPU tests that drive a Gluon launcher's real JIT path (binder, specialisation,
compile) for sm_90a: it reports an sm_90a target and device 0 and is never asked to launch (the tests call
kernel.warmup). Used by the `jit` child processes of the Gluon test files."""
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


class CompileOnlyDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def use_compile_only_sm90_driver():
    driver.set_active(CompileOnlyDriver())


def jit_child_rows(test_file: str, timeout: int = 900) -> list:
    """Runs `python test_file jit` (the file's compile-only child: the real JIT path under this driver) with the
    repository on PYTHONPATH and the interpreter off; returns the JSON lines it printed, failing on a non-zero exit."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(test_file), "jit"], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
