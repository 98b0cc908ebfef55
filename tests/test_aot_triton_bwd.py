"""The Triton backward's kernels are registered for `linattn inspect` / AOT (linattn/ops/gated_delta_rule/aot.py,
names gdn_bwd_triton_*) at the configs backward._configs picks on an H200 (H16/HV32, K=V=128): each registration's
signature names exactly the kernel's parameters, and its block sizes and warps are the launcher's. The compile
itself (intended HGMMA, spill within the registered known spill, shared memory) is test_aot_gluon.py's generic
test; benchmarks/BWD_PROFILE.md has the numbers."""
import inspect

import pytest

from linattn.ops.gated_delta_rule import aot as gdn_aot
from linattn.runtime.aot import kernels
from linattn.runtime.device import DeviceFacts

REGISTRY = kernels()
BWD = {name: row for name, *row in ((r[0], *r[1:]) for r in gdn_aot.TRITON_BWD)}


def _params(fn):
    return list(inspect.signature(getattr(fn, "fn", fn)).parameters)


def test_every_backward_kernel_registered_with_its_parameters():
    from linattn.ops.gated_delta_rule.triton import backward
    launched = {backward.chunk_dv_local_kernel, backward.chunk_state_bwd_kernel, backward.chunk_local_bwd_kernel,
                backward.chunk_wy_bwd_kernel}
    seen = set()
    for name in BWD:
        fn, sig, const, opts = REGISTRY[name].build()
        runtime = [n for n in sig if sig[n] != "constexpr"]
        # same names; the run-time arguments in the kernel's order (compile_kernel places div16 by position)
        assert sorted(sig) == sorted(_params(fn)) and runtime == _params(fn)[:len(runtime)], (name, list(sig))
        assert sorted(const) == sorted(n for n in sig if sig[n] == "constexpr"), name
        seen.add(getattr(fn, "fn", fn))
    assert {getattr(k, "fn", k) for k in launched} <= seen


@pytest.mark.parametrize("B, T", [(1, 65536), (8, 4096)])
def test_registered_configs_are_the_launchers(monkeypatch, B, T):
    from linattn.ops.gated_delta_rule.triton import backward
    h200 = DeviceFacts("cuda", "NVIDIA H200", (9, 0), 132, 232448, 141 << 30)
    monkeypatch.setattr(backward, "device_facts", lambda device: h200)
    cfg = backward._configs(128, 128, B, 32, "cuda")
    state = f"gdn_bwd_triton_state_bv{cfg.BV_state}_w{cfg.warps_state}"
    assert state in BWD and tuple(BWD[state][1:5]) == (cfg.BK_state, cfg.BV_state, cfg.warps_state, cfg.stages_state)
    assert cfg.BV_state == (32 if B == 1 else 64)
    for which, warps in (("dv_local", cfg.warps_dv_local), ("local", cfg.warps_local), ("wy", cfg.warps_wy)):
        name = f"gdn_bwd_triton_{which}_w{warps}"
        assert name in BWD and tuple(BWD[name][1:4]) == (cfg.BK, cfg.BV, warps), (name, cfg)
