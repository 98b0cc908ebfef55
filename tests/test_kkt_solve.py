"""Stage 2a (triton/intra_split.py kkt_solve_kernel: gcum and Tinv = (I + A)^-1 by block substitution) on a CPU under
TRITON_INTERPRET=1:
1. gcum against the fp64 cumsum of g, and Tinv against torch.linalg.inv(I + A) with A built in float64 from the same
   k, g, beta, per chunk and value head, by relative RMS error (Frobenius). A 16-bit Tinv: the worst chunk within
   TINV_BOUND x the worst chunk's error of a plain fp32 inverse (torch.linalg.inv of the same I + A in float32)
   rounded to the storage dtype, plus a small absolute floor; an fp32 Tinv: within FP32_TINV_MAX. Every buffer NaN-filled (an unwritten element fails). T = 1, 63, 64, 65, 200; varlen with
   1-token sequences; GVA (H1 HV2) and H = HV = 2; k in bf16, fp16 and fp32; Tinv stored in fp32 (the backward's)
   and in k's dtype (the forward's; bf16 operands for the inverse's products there); K = 100; gates steep enough
   that exp(gam_i - gam_j) overflows above the diagonal without the mask, and slow gates.
2. HEADS_FAST: the head-fastest program order is bit-equal to the default order, and kkt_order passes it from
   KKT_HEADS_FAST_SLOTS chunk slots on, to the Triton forward's and the gluon forward's stage-2a launches.
3. The sm_90a AOT builds at H16/HV32 K=128 bf16: the launcher's configuration, 0 spill, bf16 mma (no TF32) for the
   bf16-Tinv builds' inverse, only TF32 mma for the fp32-Tinv build.
The whole forward and backward against fp64 are in test_chunk_forward.py / test_chunk_backward.py."""
import inspect
import random

import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.triton import intra_split as sm
from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
from linattn.testing import make_gdn_inputs

DEV = "cpu"
# A 16-bit Tinv's error against fp64 within TINV_BOUND x the error of a plain fp32 inverse stored in the same dtype,
# plus FLOOR (for chunks inverted exactly, e.g. a 1-token chunk: Tinv = I): 1.5x where the kernel's products run at
# TF32 (fp16), 2.5x where they take bf16 operands (bf16 Tinv; measured up to 1.75x, at slow gates). An fp32 Tinv
# (the block substitution's fp32 / TF32 products): measured 1.5e-8 - 7.4e-8 under the interpreter, the largest at
# steep gates; the bound is 1.5x the largest error of the 64x64 block inverse this kernel replaced (7e-8)
TINV_BOUND = {torch.float16: 1.5, torch.bfloat16: 2.5}
FLOOR = {torch.bfloat16: 1e-5, torch.float16: 1e-6}
FP32_TINV_MAX = 1.05e-7


def kkt_inputs(B, T, H, HV, K, dtype, lens=None, seed=0, g_scale=1.0):
    """(k, g * g_scale, beta, plan, B, T, cu): fresh random inputs (seeded), T = sum(lens) with cu_seqlens when lens
    is given."""
    cu = None
    if lens is not None:
        T = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=DEV)
    x = make_gdn_inputs(B, T, H, HV, K, K, dtype=dtype, device=DEV, initial_state=False,
                        generator=torch.Generator().manual_seed(seed))
    return x["k"], x["g"] * g_scale, x["beta"], make_chunk_plan(B, T, cu, 64, DEV), B, T, cu


def launch_kkt_solve(k, g, beta, plan, HV, tinv_dtype, **extra):
    """kkt_solve_kernel as the forward launches it (split_intra_config's BK_kkt / warps_kkt) into NaN-filled buffers,
    with extra constexpr arguments: (gcum, Tinv)."""
    H, K = k.shape[-2], k.shape[-1]
    cfg = sm.split_intra_config(K, K)
    gcum = torch.full((plan.T_total, HV), float("nan"), dtype=torch.float32, device=k.device)
    tinv = torch.full((plan.T_total, HV, 64), float("nan"), dtype=tinv_dtype, device=k.device)
    sm.kkt_solve_kernel[(plan.num_slots, HV)](
        k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N, H=H, HV=HV, K=K, BT=sm.CHUNK,
        BK=cfg.BK_kkt, DOT_PREC="ieee" if k.dtype == torch.float32 else "tf32", num_warps=cfg.warps_kkt, **extra)
    return gcum, tinv


def _chunks(B, T, cu):
    """(bos, n) of every 64-token chunk of every sequence, in flattened token rows."""
    bounds = cu.tolist() if cu is not None else [b * T for b in range(B + 1)]
    return [(s + c, min(64, e - s - c)) for s, e in zip(bounds[:-1], bounds[1:]) for c in range(0, e - s, 64)]


def _gam64(g, bos, n, hv, HV):
    return g.reshape(-1, HV)[bos:bos + n, hv].to(torch.float64).cumsum(0)


def _tinv64(k, g, beta, bos, n, hv, HV):
    """torch.linalg.inv(I + A) in float64 for one chunk and value head, A from the same k, g, beta."""
    H = k.shape[-2]
    kf = k.reshape(-1, H, k.shape[-1])[bos:bos + n, hv // (HV // H)].to(torch.float64)
    gam = _gam64(g, bos, n, hv, HV)
    bt = beta.reshape(-1, HV)[bos:bos + n, hv].to(torch.float64)
    diff = torch.tril(gam[:, None] - gam[None, :], -1)              # masked before exp, as the kernel does
    a = torch.tril(bt[:, None] * (kf @ kf.T) * torch.exp(diff), -1)
    return torch.linalg.inv(torch.eye(n, dtype=torch.float64) + a)


def _check(k, g, beta, plan, B, T, cu, HV, tinv_dtype):
    gcum, tinv = launch_kkt_solve(k, g, beta, plan, HV, tinv_dtype, **sm.kkt_order(plan.num_slots))
    assert torch.isfinite(gcum).all() and torch.isfinite(tinv).all(), "NaN left (an unwritten element)"
    err, err_round = 0., 0.
    for bos, n in _chunks(B, T, cu):
        for hv in range(HV):
            gam = _gam64(g, bos, n, hv, HV)
            assert torch.allclose(gcum[bos:bos + n, hv].double(), gam, rtol=1e-5, atol=1e-5), (bos, hv)
            ref = torch.zeros(n, 64, dtype=torch.float64)
            ref[:, :n] = _tinv64(k, g, beta, bos, n, hv, HV)
            err = max(err, float((tinv[bos:bos + n, hv].double() - ref).norm() / ref.norm()))
            ref32 = torch.zeros(n, 64, dtype=torch.float64)
            ref32[:, :n] = torch.linalg.inv(torch.linalg.inv(ref[:, :n]).float()).to(tinv_dtype).double()
            err_round = max(err_round, float((ref32 - ref).norm() / ref.norm()))
    bound = FP32_TINV_MAX if tinv_dtype == torch.float32 else TINV_BOUND[tinv_dtype] * err_round + FLOOR[tinv_dtype]
    msg = (f"Tinv rel. RMS error vs fp64 (worst chunk): {err:.3e}, fp32 inverse in {tinv_dtype}: {err_round:.3e} "
           f"(ratio {err / max(err_round, 1e-30):.2f}), bound {bound:.3e} (k {k.dtype})")
    print(msg)
    assert err <= bound, msg


_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (kkt_inputs args, kkt_inputs kwargs, HV, Tinv dtype or None for k's)
TINV_CASES = (
    [pytest.param((1, T, H, HV, 128, torch.bfloat16), dict(seed=T * 10 + HV), HV, tinv,
                  id=f"dense-{name}-T{T}-tinv_{'fp32' if tinv else 'k'}")
     for name, (H, HV) in (("H2HV2", (2, 2)), ("GVA_H1HV2", (1, 2))) for T in (1, 63, 64, 65, 200)
     for tinv in (torch.float32, None)]
    + [pytest.param((1, None, 1, 2, 128, _DT[dt]), dict(lens=[1, 63, 1, 65, 70], seed=2), 2,
                    torch.float32 if tinv == "fp32" else None, id=f"varlen_one_token-{dt}-tinv_{tinv}")
       for tinv in ("fp32", "k") for dt in ("bf16", "fp16", "fp32")]
    + [pytest.param((2, 65, 2, 2, 128, torch.float16), dict(seed=3), 2, None, id="batch_t_not_multiple_of_64"),
       # K = 100: one K block of 128 with the boundary check (split_intra_config's BK_kkt)
       pytest.param((1, 130, 1, 2, 100, torch.bfloat16), dict(seed=5), 2, torch.float32, id="k_not_a_power_of_two"),
       pytest.param((1, 130, 1, 2, 100, torch.bfloat16), dict(seed=5), 2, None, id="k_not_a_power_of_two-tinv_k"),
       pytest.param((1, 200, 1, 2, 128, torch.bfloat16), dict(seed=8, g_scale=0.01), 2, None, id="slow_gates")]
    # g x 60: gam_i - gam_j reaches ~ +1000 above the diagonal, where exp overflows; masked before exp, every
    # output finite
    + [pytest.param((1, 130, 1, 2, 128, _DT[dt]), dict(seed=6, g_scale=60.0), 2, tinv, id=f"steep_gates-{dt}-{t}")
       for dt in ("bf16", "fp32") for t, tinv in (("fp32", torch.float32), ("k", None))])


@pytest.mark.parametrize("args, kwargs, HV, tinv_dtype", TINV_CASES)
def test_tinv_vs_fp64(args, kwargs, HV, tinv_dtype):
    k, g, beta, plan, B, T, cu = kkt_inputs(*args, **kwargs)
    if kwargs.get("g_scale", 1.0) > 1:
        assert float(g.min()) * 63 < -100
    _check(k, g, beta, plan, B, T, cu, HV, tinv_dtype or k.dtype)


# ---------------------------------------------------------------- program order (HEADS_FAST)

@pytest.mark.parametrize("args, kwargs", [((1, 200, 1, 2, 128, torch.bfloat16), {}),
                                          ((1, None, 2, 4, 64, torch.bfloat16), dict(lens=[1, 63, 1, 65, 70])),
                                          ((2, 65, 1, 3, 64, torch.float32), {})],
                         ids=["dense-gva", "varlen-gva", "fp32-hv3"])
def test_heads_fast_order_is_bit_equal(args, kwargs):
    """HEADS_FAST renumbers the programs over the same (slot, head) pairs: gcum and Tinv (bf16 and fp32) torch.equal
    to the default order's, every element written (NaN-filled buffers)."""
    k, g, beta, plan, B, T, cu = kkt_inputs(*args, seed=random.randrange(1000), **kwargs)
    HV = args[3]
    for tinv_dtype in (torch.bfloat16, torch.float32):
        (g0, t0), (g1, t1) = (launch_kkt_solve(k, g, beta, plan, HV, tinv_dtype, HEADS_FAST=heads_fast)
                              for heads_fast in (False, True))
        assert torch.isfinite(g1).all() and torch.isfinite(t1).all()
        assert torch.equal(g0, g1) and torch.equal(t0, t1), tinv_dtype


def test_heads_fast_from_the_slot_threshold(monkeypatch):
    """kkt_order: HEADS_FAST from KKT_HEADS_FAST_SLOTS chunk slots on, nothing below it; the Triton forward's and the
    gluon forward's stage-2a launches pass it (threshold lowered to the test's 5 slots)."""
    assert sm.kkt_order(sm.KKT_HEADS_FAST_SLOTS) == {"HEADS_FAST": True}
    assert sm.kkt_order(sm.KKT_HEADS_FAST_SLOTS - 1) == {}
    from linattn.ops.gated_delta_rule.gluon.fused_forward import kkt_solve
    real, seen = sm.kkt_solve_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw.get("HEADS_FAST"))
                return real[grid](*a, **kw)
            return launch
    monkeypatch.setattr(sm, "kkt_solve_kernel", Spy())
    monkeypatch.setattr(sm, "KKT_HEADS_FAST_SLOTS", 5)
    x = make_gdn_inputs(1, 300, 1, 2, 64, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")       # 5 slots
        k, g, beta, plan = kkt_inputs(1, 300, 1, 2, 64, torch.bfloat16, seed=4)[:4]
        kkt_solve(k, g, beta, plan, 2)
        k, g, beta, plan = kkt_inputs(1, 250, 1, 2, 64, torch.bfloat16, seed=4)[:4]          # 4 slots
        kkt_solve(k, g, beta, plan, 2)
    assert seen == [True, True, None], seen


# ---------------------------------------------------------------- sm_90a AOT builds

AOT = {"gdn_fwd_triton_kkt_solve_w4": ("*bf16", False), "gdn_fwd_triton_kkt_solve_hf_w4": ("*bf16", True),
       "gdn_fwd_triton_kkt_solve_f32_w4": ("*fp32", False)}


@pytest.mark.parametrize("name", sorted(AOT))
def test_aot_registration_is_the_launchers(name):
    """The AOT registration builds kkt_solve_kernel with the launcher's signature, constants (H16/HV32 K=128 bf16,
    split_intra_config's BK_kkt, tf32, HEADS_FAST) and warps."""
    from linattn.runtime.aot import kernels
    fn, sig, const, opts = kernels()[name].build()
    params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    runtime = [n for n in sig if sig[n] != "constexpr"]
    assert sorted(sig) == sorted(params) and runtime == params[:len(runtime)]
    cfg = sm.split_intra_config(128, 128)
    tinv, heads_fast = AOT[name]
    assert const == dict(H=16, HV=32, K=128, BT=64, BK=cfg.BK_kkt, DOT_PREC="tf32", HEADS_FAST=heads_fast,
                         A_log_ptr=None, dt_bias_ptr=None, beta_out_ptr=None, GATE_IN_KERNEL=False,
                         HAS_DT_BIAS=False, BETA_SCALE=0,      # FLA's options off: the default path's kernel
                         tinv16_ptr=None)                      # no 16-bit copy of Tinv (the gluon backward's)
    assert opts["num_warps"] == cfg.warps_kkt and sig["k_ptr"] == "*bf16" and sig["tinv_ptr"] == tinv
    assert getattr(fn, "fn", fn) is sm.kkt_solve_kernel.fn


def test_aot_sm90a_no_spill_bf16_mma():
    """sm_90a (ptxas): 0 spill, no local memory, WGMMA for K K^T, shared memory in budget, 4 warps; the bf16-Tinv
    builds' inverse all bf16 mma (no TF32 mma), the fp32-Tinv build (the backward's) only TF32 mma."""
    from linattn.runtime.aot import inspect_kernel, kernels
    reg = kernels()
    for name, (tinv, _) in AOT.items():
        rep = inspect_kernel(reg[name])
        print(f"{name}: {rep.regs} registers, {rep.spill_bytes} B spilled, {rep.smem} B shared, {rep.families}")
        assert rep.spill_bytes == 0 and rep.families["LDL"] == 0 and rep.families["STL"] == 0, name
        assert not rep.missing and rep.families["HGMMA"] > 0, (name, rep.sass)
        assert 0 < rep.smem <= 232448 and rep.num_warps == 4, name
        bf, tf = rep.sass.get("HMMA.16816.F32.BF16", 0), rep.sass.get("HMMA.1688.F32.TF32", 0)
        assert (bf > 0 and tf == 0) if tinv == "*bf16" else (bf == 0 and tf > 0), (name, bf, tf)
