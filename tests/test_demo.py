"""`linattn demo` is the README's first command: it must pass on a CPU machine from a plain shell, where
TRITON_INTERPRET is not set before Python starts."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the demo runs the real size; the gate covers it")
def test_demo_cpu_from_plain_environment():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "linattn.cli", "demo", "--T", "70"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "-> PASS" in p.stdout and "-> FAIL" not in p.stdout
    assert "relative RMS error o" in p.stdout
    if importlib.util.find_spec("transformers") is None:
        assert "skipped: transformers is not installed" in p.stdout
    else:   # the model line: the tiny Qwen3-Next with linattn against transformers' own computation
        line = next(x for x in p.stdout.splitlines() if "against transformers' own computation" in x)
        assert "greedy tokens equal" in line and "-> PASS" in line, line
