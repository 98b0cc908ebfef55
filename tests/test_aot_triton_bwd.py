"""The Triton GDN stage kernels are registered for `linattn inspect` / AOT (triton/aot.py, names gdn_fwd_triton_* and
gdn_bwd_triton_*) at the configs the launchers pick on an H200 (H16/HV32, K=V=128): each registration's signature
names exactly the kernel's parameters, and its block sizes, warps and stages are the launcher's. The compile itself
(intended HGMMA, spill within the registered known spill, shared memory) is test_aot_gluon.py's generic test."""
import inspect

import pytest

from linattn.runtime.aot import kernels
from linattn.runtime.device import DeviceFacts

REGISTRY = kernels()
TRITON = sorted(n for n in REGISTRY if n.startswith(("gdn_fwd_triton_", "gdn_bwd_triton_")))
H200 = DeviceFacts("cuda", "NVIDIA H200", (9, 0), 132, 232448, 141 << 30)


def _params(fn):
    return list(inspect.signature(getattr(fn, "fn", fn)).parameters)


def test_every_stage_kernel_registered_with_its_parameters():
    from linattn.ops import col_sum
    from linattn.ops.gated_delta_rule.triton import backward, chunk_output, chunk_state, intra_split
    launched = {col_sum.col_sum_kernel, backward.chunk_dv_local_kernel, backward.chunk_state_bwd_kernel,
                backward.chunk_local_bwd_kernel, backward.chunk_wy_bwd_kernel, intra_split.kkt_solve_kernel,
                intra_split.wu_kernel,
                chunk_state.chunk_state_fwd_kernel, chunk_output.chunk_output_kernel}
    seen = set()
    for name in TRITON:
        fn, sig, const, opts = REGISTRY[name].build()
        runtime = [n for n in sig if sig[n] != "constexpr"]
        # same names; the run-time arguments in the kernel's order (compile_kernel places div16 by position)
        assert sorted(sig) == sorted(_params(fn)) and runtime == _params(fn)[:len(runtime)], (name, list(sig))
        assert sorted(const) == sorted(n for n in sig if sig[n] == "constexpr"), name
        seen.add(getattr(fn, "fn", fn))
    assert {getattr(k, "fn", k) for k in launched} == seen


@pytest.mark.parametrize("B, T", [(1, 65536), (8, 4096)])
def test_backward_registrations_are_the_launchers(monkeypatch, B, T):
    from linattn.ops.gated_delta_rule.triton import backward
    monkeypatch.setattr(backward, "device_facts", lambda device: H200)
    cfg = backward._configs(128, 128, B, 32, "cuda")
    assert cfg.BV_state == (32 if B == 1 else 64)
    for name, bk, bv, warps, stages in (
            (f"gdn_bwd_triton_state_bv{cfg.BV_state}_w{cfg.warps_state}", cfg.BK_state, cfg.BV_state,
             cfg.warps_state, cfg.stages_state),
            (f"gdn_bwd_triton_dv_local_w{cfg.warps_dv_local}", cfg.BK, cfg.BV, cfg.warps_dv_local, 2),
            (f"gdn_bwd_triton_local_w{backward.WARPS_LOCAL}", cfg.BK, cfg.BV, backward.WARPS_LOCAL,
             backward.STAGES_LOCAL),
            (f"gdn_bwd_triton_wy_w{backward.WARPS_WY}", cfg.BK, cfg.BV, backward.WARPS_WY, backward.STAGES_WY)):
        fn, sig, const, opts = REGISTRY[name].build()
        assert (const["BK"], const["BV"], opts["num_warps"], opts["num_stages"]) == (bk, bv, warps, stages), name
    assert REGISTRY["gdn_bwd_triton_wy_w4"].build()[2]["M_IN_DK"] is True          # K >= 64: M^T through dk


@pytest.mark.parametrize("B, HV", [(1, 32), (8, 32), (1, 8)])
def test_forward_registrations_are_the_launchers(monkeypatch, B, HV):
    from linattn.ops.gated_delta_rule.triton import chunk_output, forward, intra_split
    monkeypatch.setattr(forward, "device_facts", lambda device: H200)
    cfg = forward._configs(128, 128, B, HV, "cuda")
    assert cfg.BV_state == {(1, 32): 32, (8, 32): 64, (1, 8): 16}[(B, HV)]
    fn, sig, const, opts = REGISTRY[f"gdn_fwd_triton_state_bv{cfg.BV_state}_w{cfg.warps_state}"].build()
    assert (const["BK"], const["BV"], opts["num_stages"]) == (128, cfg.BV_state, cfg.stages)
    fn, sig, const, opts = REGISTRY["gdn_fwd_triton_output_bv128_w8"].build()
    assert (const["BK"], const["BV"], opts["num_warps"], opts["num_stages"]) == (
        chunk_output.OUTPUT_BK, chunk_output.OUTPUT_BV, chunk_output.OUTPUT_WARPS, chunk_output.OUTPUT_STAGES)
    split = intra_split.split_intra_config(128, 128)
    for name in ("gdn_fwd_triton_wu_bv64_w4", "gdn_fwd_triton_wu_f32_bv64_w4"):
        fn, sig, const, opts = REGISTRY[name].build()
        assert (const["BK"], const["BV"], opts["num_warps"]) == (split.BK, split.BV, split.warps_wu), name
