"""What a new user on a CPU-only machine gets: `auto` runs the PyTorch reference when no kernel can run (and says so
with LINATTN_LOG=1), TRITON_INTERPRET=1 set after `import linattn` is refused by name, `verify` / `bench` /
`doctor` say plainly that nothing can run and exit non-zero, and `doctor` rejects unknown LINATTN_* variables.
The plain-environment checks run in child processes: this process imported Triton with the interpreter on."""
import os
import subprocess
import sys

import pytest
import torch

from linattn.cli import main

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def _plain_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("LINATTN_")}
    return dict(env, **extra)


def _child(code: str, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=_plain_env(**extra), capture_output=True, text=True,
                          timeout=300)


AUTO_FALLBACK = r"""
import os, torch, linattn
from linattn.backends import BackendError
from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
from linattn.ops.gated_delta_rule.reference import chunk_reference
from linattn.testing import make_gdn_inputs
x = make_gdn_inputs(1, 70, 1, 2, 16, 16)
o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True)
ro, rht = chunk_reference(**x, output_final_state=True)
assert torch.equal(o, ro) and torch.equal(ht, rht)
d = make_gdn_inputs(3, 1, 1, 2, 16, 16)
o, ht = linattn.fused_recurrent_gated_delta_rule(**d, output_final_state=True)
ro, rht = fused_recurrent_reference(**d, output_final_state=True)
assert torch.equal(o, ro) and torch.equal(ht, rht)
a, b = torch.randn(8, 16).bfloat16(), torch.randn(16, 24).bfloat16()
assert torch.equal(linattn.matmul(a, b), (a.float() @ b.float()).bfloat16())
os.environ["TRITON_INTERPRET"] = "1"                      # too late: Triton was imported without it
try:
    linattn.chunk_gated_delta_rule(**x, backend="triton")
except BackendError as e:
    print("LATE:", e)
o, _ = linattn.chunk_gated_delta_rule(**x)                 # auto still runs (the reference)
assert torch.equal(o, chunk_reference(**x)[0])
"""


@no_gpu
def test_auto_runs_the_reference_without_gpu_or_interpreter():
    p = _child(AUTO_FALLBACK, LINATTN_LOG="1")
    assert p.returncode == 0, p.stderr[-3000:]
    for op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "matmul"):
        assert f"[linattn] {op}: auto picks backend 'reference': CPU tensors and no Triton interpreter" in p.stderr
    late = next(line for line in p.stdout.splitlines() if line.startswith("LATE:"))
    assert "TRITON_INTERPRET=1 was set after triton was imported" in late
    assert "set TRITON_INTERPRET=1 before importing linattn" in late


def test_auto_keeps_triton_under_the_interpreter():
    from linattn.backends import op_backends
    from linattn.bench.ops import gdn_typical_call
    from linattn.runtime.device import triton_interprets
    if not triton_interprets():
        pytest.skip("Triton does not interpret in this process")
    call = gdn_typical_call("cpu")
    assert op_backends("chunk_gated_delta_rule").select("auto", **call).name == "triton"


COMMANDS = r"""
from linattn.cli import main
print("RC", main(["verify", "--modes", "fwd"]), main(["bench", "--modes", "fwd"]), main(["doctor"]))
"""


@no_gpu
def test_commands_say_nothing_can_run():
    p = _child(COMMANDS)
    assert p.returncode == 0, p.stderr[-3000:]
    rcs = next(line for line in p.stdout.splitlines() if line.startswith("RC")).split()[1:]
    assert rcs == ["2", "2", "1"], (rcs, p.stdout[-2000:], p.stderr[-2000:])
    assert "verify: backend 'triton' cannot run here, nothing was checked" in p.stderr
    assert "GATE RED" not in p.stdout + p.stderr
    assert "linattn bench: nothing to time" in p.stderr
    assert "No kernel can run here" in p.stdout
    assert all(len(line) <= 120 for line in p.stdout.splitlines())


def test_doctor_rejects_unknown_variables(monkeypatch, capsys):
    monkeypatch.setenv("LINATTN_GDN_SPLIT_STATE", "1")
    monkeypatch.setenv("LINATTN_BACKEND", "foo")
    assert main(["doctor"]) == 2
    out = capsys.readouterr().out
    assert "PROBLEM: LINATTN_GDN_SPLIT_STATE='1' is not a linattn variable and is ignored" in out
    assert "PROBLEM: LINATTN_BACKEND='foo' names no backend" in out
    assert "LINATTN_BACKEND=foo: raises" in out
    assert all(len(line) <= 120 for line in out.splitlines())


def test_environment_lines():
    from linattn.commands.doctor import environment_lines
    env = {"LINATTN_LOG": "1", "LINATTN_CHECK_INPUTS": "maybe", "LINATTN_BACKEND": "triton", "TRITON_INTERPRET": "1",
           "LINATTN_COMMIT": "abc", "PATH": "/bin"}
    lines, problems = environment_lines(env, ["gluon", "reference", "triton"])
    assert problems == ["LINATTN_CHECK_INPUTS='maybe': expected 0 or 1"]
    assert len(lines) == 5 and all("PATH" not in line for line in lines)
    _, problems = environment_lines({}, ["triton"])
    assert problems == []
