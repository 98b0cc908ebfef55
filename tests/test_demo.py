"""`linattn demo` is the README's first command: it must pass on a CPU machine from a plain shell, where
TRITON_INTERPRET is not set before Python starts."""
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
    assert "-> PASS" in p.stdout
    assert "relative RMS error o" in p.stdout
