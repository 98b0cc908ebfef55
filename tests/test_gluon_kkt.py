"""The Gluon stage 2a (gluon/kkt_solve.py, the gluon forward's stage 2a where kkt_gluon_supported takes the call) on a
CPU host: its sm_90a build (its tensor-core instruction counts and load order), its launch arguments against the AOT
signature, and fused_forward.kkt_solve's routing with its fallback to the Triton kernel. The kernel itself runs only
on a GPU (benchmarks/gpu/gate.py runs the whole forward)."""
import pytest
import torch

from linattn.runtime.gluon_compat import gluon_status

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
KKT = "gdn_fwd_kkt_solve_gluon_bf16_direct_r80"


def _plan_inputs(B, T, H, HV, lens=None, dtype=torch.bfloat16, K=128):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    cu = None
    if lens is not None:
        T = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype)     # l2-normalised, as models feed
    g = -torch.rand(B, T, HV)
    beta = torch.rand(B, T, HV)
    return k, g, beta, make_chunk_plan(B, T, cu, 64, "cpu")


def _sass_lines(name):
    from linattn.runtime.aot import kernel_asm
    return [ln for ln in kernel_asm(name, "sass").splitlines() if ln[:1] in "-0123456789abcdef" and ":" in ln[:3]]


def _first(lines, op):
    return next(i for i, ln in enumerate(lines) if op in ln)


@needs_gluon
def test_kkt_build_issues_no_load_before_the_key_tile():
    """The build the forward launches: 16 HGMMA 64x64x16 (K K^T) and 60 HMMA.16816 (the block substitution), no
    global load before the key tile's TMA (a fixed-length batch's chunk bounds by arithmetic) and every value head's
    g and beta loads before the wait on the key tile."""
    lines = _sass_lines(KKT)
    assert sum("HGMMA.64x64x16" in ln for ln in lines) == 16 and sum("HMMA.16816" in ln for ln in lines) == 60
    assert sum("LDG" in ln for ln in lines[:_first(lines, "UTMALDG")]) == 0
    assert sum("LDG" in ln for ln in lines[:_first(lines, "SYNCS.PHASECHK")]) >= 6


@needs_gluon
@pytest.mark.parametrize("B,T,lens", [(1, 8192, None), (2, 100, None), (3, 1, None), (1, 0, [1, 63, 1, 65, 70])])
def test_kkt_launch_matches_aot_signature(monkeypatch, B, T, lens):
    """kkt_solve_gluon's launch: its arguments mangle to the AOT signature, every constexpr of the kernel is passed
    (so the host path's key names the compiled kernel AOT checks), the register cap is 80, the key tile's box is
    [64, 128], and the grid has one program per (chunk slot, key head)."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import kkt_gluon_signature
    from linattn.ops.gated_delta_rule.gluon import host
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    from linattn.runtime import device as device_mod

    calls = []
    monkeypatch.setattr(host, "launches", lambda kernel, grid, args, kwargs: calls.append((kernel, grid, args,
                                                                                              kwargs)))
    monkeypatch.setattr(device_mod, "device_facts", lambda dev: type("F", (), {"num_sms": 132})())
    H, HV = 16, 32
    k, g, beta, plan = _plan_inputs(B, T, H, HV, lens)
    gcum, tinv = gk.kkt_solve_gluon(k, g, beta, plan, HV)
    assert gcum.shape == (plan.T_total, HV) and gcum.dtype == torch.float32
    assert tinv.shape == (plan.T_total, HV, 64) and tinv.dtype == torch.bfloat16
    (kernel, grid, args, kwargs), = calls
    sig = kkt_gluon_signature("bf16")
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert args[0].block_shape == [64, 128] and args[-2] == plan.num_slots * H
    # FIXED_LEN only where the plan says every sequence has one length of at least 2 tokens
    fixed = lens is None and T >= 2
    assert plan.seq_len == (T if lens is None else 0)
    assert args[-1] == (T if fixed else 2)
    assert kwargs == dict(H=H, HV=HV, K=128, BT=64, FIXED_LEN=fixed, num_warps=gk.KKT_WARPS, maxnreg=80)
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(
        n for n in kwargs if n not in ("num_warps", "maxnreg"))
    assert grid == (plan.num_slots * H,)


@pytest.mark.parametrize("dtype,K,why", [(torch.bfloat16, 128, "cpu"), (torch.float32, 128, "float32"),
                                         (torch.float16, 128, "float16"), (torch.bfloat16, 64, "K=64")])
def test_kkt_falls_back_with_reason(monkeypatch, dtype, K, why):
    """kkt_gluon_supported refuses, with its reason, k that is not bf16, K != 128, and k off a CUDA device (so the
    CPU tests' forward never launches a Gluon kernel); fused_forward.kkt_solve then runs the Triton kernel: gcum and a
    finite Tinv, the same on a second call."""
    from linattn.ops.gated_delta_rule.gluon import fused_forward
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    monkeypatch.setattr(gk, "kkt_solve_gluon", lambda *a, **kw: pytest.fail("the Gluon stage 2a was launched"))
    k, g, beta, plan = _plan_inputs(1, 70, 1, 2, dtype=dtype, K=K)
    ok, reason = gk.kkt_gluon_supported(k, 2, plan.T_total)
    assert not ok and why in reason, reason
    out = fused_forward.kkt_solve(k, g, beta, plan, 2)
    ref = fused_forward.kkt_solve(k, g, beta, plan, 2)
    assert out[1].shape == (70, 2, 64) and out[0].shape == (70, 2)
    assert all(torch.equal(a, b) for a, b in zip(out, ref)) and torch.isfinite(out[1].float()).all()


def test_kkt_routes_supported_calls():
    """Where kkt_gluon_supported accepts the call (stood in here: a CPU host has no CUDA device), kkt_solve hands it
    to kkt_solve_gluon."""
    import unittest.mock as um

    from linattn.ops.gated_delta_rule.gluon import fused_forward
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    seen = []
    k, g, beta, plan = _plan_inputs(1, 70, 1, 2)
    with um.patch.object(gk, "kkt_gluon_supported", lambda k, HV, T: (True, "")), \
            um.patch.object(gk, "kkt_solve_gluon", lambda k, g, beta, plan, HV: seen.append(HV) or (1, 2)):
        out = fused_forward.kkt_solve(k, g, beta, plan, 2)
    assert seen == [2] and out == (1, 2)


@pytest.mark.parametrize("B,T", [(1, 8192), (3, 100), (2, 64), (5, 1), (4, 65)])
def test_fixed_len_arithmetic_matches_the_plan(B, T):
    """FIXED_LEN computes a slot's (sequence, chunk) as (slot // cdiv(T, 64), slot % cdiv(T, 64)) and
    its first token as sequence * T instead of reading chunk_indices and cu: that holds only while a fixed-length
    plan lays its slots out sequence-major with no surplus slot, and carries seq_len = T (0 for varlen)."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import build_chunk_plan, make_chunk_plan
    plan = make_chunk_plan(B, T, None, 64, "cpu")
    nch = -(-T // 64)
    slots = torch.arange(plan.num_slots)
    assert plan.seq_len == T and plan.num_slots == B * nch
    assert torch.equal(plan.chunk_indices[:, 0].long(), slots // nch)
    assert torch.equal(plan.chunk_indices[:, 1].long(), slots % nch)
    assert torch.equal(plan.cu[:-1], torch.arange(B) * T) and int(plan.cu[-1]) == B * T
    cu = torch.tensor([0, 5, 70, 70, 200])
    assert build_chunk_plan(1, 200, cu, 64, "cpu").seq_len == 0
