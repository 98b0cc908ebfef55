"""Shared by the stage-2a tests (test_kkt_solve_gva.py, test_kkt_solve_v2.py, test_kkt_solve_v3.py,
test_kkt_solve_v4.py): chunk inputs, the Tinv accuracy cases, NaN-filled output buffers, kkt_solve_kernel launched as
the forward launches it (the reference the variants are held to), and the checks of a variant's sm_90a AOT build."""
import inspect

import pytest
import torch

from linattn.ops.gated_delta_rule.triton import intra_split as sm
from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
from linattn.testing import make_gdn_inputs


def kkt_inputs(B, T, H, HV, K, dtype, lens=None, seed=0, g_scale=1.0, device="cpu"):
    """(k, g * g_scale, beta, plan, B, T, cu): fresh random inputs (seeded), T = sum(lens) with cu_seqlens when lens
    is given."""
    cu = None
    if lens is not None:
        T = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=device)
    x = make_gdn_inputs(B, T, H, HV, K, K, dtype=dtype, device=device, initial_state=False,
                        generator=torch.Generator().manual_seed(seed))
    return x["k"], x["g"] * g_scale, x["beta"], make_chunk_plan(B, T, cu, 64, device), B, T, cu


def _varlen_five(plan, g):
    assert plan.N == 5


def _steep(plan, g):
    assert float(g.min()) * 63 < -100


_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The Tinv accuracy cases of the block-substitution variants (v2, v3), each its file's `_check` against fp64:
# (kkt_inputs args, kkt_inputs kwargs, HV, Tinv dtype or None for k's, a check of the inputs or None)
TINV_CASES = (
    # bf16 k (TF32 products), Tinv stored in fp32: the inverse's own error
    [pytest.param((1, T, H, HV, 128, torch.bfloat16), dict(seed=T * 10 + HV), HV, torch.float32, None,
                  id=f"dense_fp32_tinv-{name}-T{T}")
     for name, (H, HV) in (("H2HV2", (2, 2)), ("GVA_H1HV2", (1, 2))) for T in (1, 63, 64, 65, 200)]
    # varlen with 1-token sequences, every dtype, Tinv in fp32 or in k's dtype
    + [pytest.param((1, None, 1, 2, 128, _DT[dt]), dict(lens=[1, 63, 1, 65, 70], seed=2), 2,
                    torch.float32 if tinv == "fp32" else None, _varlen_five, id=f"varlen_one_token-{dt}-tinv_{tinv}")
       for tinv in ("fp32", "k") for dt in ("bf16", "fp16", "fp32")]
    + [pytest.param((2, 65, 2, 2, 128, torch.float16), dict(seed=3), 2, None, None, id="batch_t_not_multiple_of_64"),
       # K = 100: one K block of 128 with the boundary check (split_intra_config's BK_kkt)
       pytest.param((1, 130, 1, 2, 100, torch.bfloat16), dict(seed=5), 2, torch.float32, None,
                    id="k_not_a_power_of_two")]
    # g x 60: gam_i - gam_j reaches ~ +1000 above the diagonal, where exp overflows; masked before exp, every
    # output finite
    + [pytest.param((1, 130, 1, 2, 128, _DT[dt]), dict(seed=6, g_scale=60.0), 2, torch.float32, _steep,
                    id=f"steep_gates-{dt}") for dt in ("bf16", "fp32")])


def nan_bufs(plan, HV, tinv_dtype, device="cpu"):
    """gcum [T_tot, HV] fp32 and Tinv [T_tot, HV, 64] filled with NaN: a row a kernel does not write stays NaN."""
    return (torch.full((plan.T_total, HV), float("nan"), dtype=torch.float32, device=device),
            torch.full((plan.T_total, HV, 64), float("nan"), dtype=tinv_dtype, device=device))


def launch_kkt_solve(k, g, beta, plan, HV, tinv_dtype, kernel=None, **extra):
    """kkt_solve_kernel (or `kernel`, with its own constexpr arguments `extra`) as the forward launches it
    (split_intra_config's BK_kkt / warps_kkt) into NaN-filled buffers: (gcum, Tinv)."""
    H, K = k.shape[-2], k.shape[-1]
    cfg = sm.split_intra_config(K, K)
    gcum, tinv = nan_bufs(plan, HV, tinv_dtype, k.device)
    (kernel or sm.kkt_solve_kernel)[(plan.num_slots, HV)](
        k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N, H=H, HV=HV, K=K, BT=sm.CHUNK,
        BK=cfg.BK_kkt, DOT_PREC="ieee" if k.dtype == torch.float32 else "tf32", num_warps=cfg.warps_kkt, **extra)
    return gcum, tinv


AOT_REF = "gdn_fwd_triton_split_kkt_solve_w4"        # kkt_solve_kernel's AOT build (bf16 Tinv)


def assert_aot_build_is_the_launchers(name, kernel, extra=None):
    """The AOT registration `name` builds `kernel` with the launcher's signature, constants (H16/HV32 K=128 bf16,
    split_intra_config's BK_kkt, tf32, and `extra`: a variant's own constexpr arguments) and warps."""
    from linattn.runtime.aot import kernels
    fn, sig, const, opts = kernels()[name].build()
    params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    runtime = [n for n in sig if sig[n] != "constexpr"]
    assert sorted(sig) == sorted(params) and runtime == params[:len(runtime)]
    cfg = sm.split_intra_config(128, 128)
    assert const == dict(H=16, HV=32, K=128, BT=64, BK=cfg.BK_kkt, DOT_PREC="tf32", **(extra or {}))
    assert opts["num_warps"] == cfg.warps_kkt and sig["k_ptr"] == "*bf16" and sig["tinv_ptr"] == "*bf16"
    assert getattr(fn, "fn", fn) is getattr(kernel, "fn", kernel)


def aot_reports_no_spill(name):
    """sm_90a (ptxas) reports of kkt_solve_kernel's build and the variant `name`, each asserted: 0 spill, no local
    memory, the intended WGMMA, shared memory in budget, 4 warps. Returns {name: report}."""
    from linattn.runtime.aot import inspect_kernel, kernels
    reg = kernels()
    reps = {n: inspect_kernel(reg[n]) for n in (AOT_REF, name)}
    for n, rep in reps.items():
        print(f"{n}: {rep.regs} registers, {rep.spill_bytes} B spilled, {rep.smem} B shared, "
              f"{rep.num_warps} warps, {rep.families}")
        assert rep.spill_bytes == 0 and rep.families["LDL"] == 0 and rep.families["STL"] == 0, n
        assert not rep.missing and rep.families["HGMMA"] > 0, (n, rep.sass)
        assert 0 < rep.smem <= 232448 and rep.num_warps == 4, n
    return reps
