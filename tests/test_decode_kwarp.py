"""The `kwarp` variant of the persistent decode kernel (benchmarks/DECODE_KWARP.md): the state tile held as two 4-D
halves [lanes along K, warps, rows per thread, columns per warp], so that Triton's layout puts the K rows inside one
warp and the warps along V, and both reductions over K need no shared-memory exchange or CTA barrier.

On the CPU (TRITON_INTERPRET=1): against the fp64 reference (`fused_recurrent_reference`) and against the default
persistent kernel (same pool, same inputs), fp32 and bf16 pools, GVA H16/HV32 and H32/HV32 at K = V = 128 and at
small K/V, padded (-1) and out-of-range slots, in place (unused slots bit-identical) and out of place, outputs
NaN-poisoned first, the index decompositions of several (BV, warps) pairs, fused gate + beta_sigmoid, in-kernel
L2 norm without a gate. Ahead of time for sm_90a (a child process without the interpreter): the layout in the
TTGIR, no spill, 16-byte state accesses, and the claim: no more than 3 CTA barriers and 4 scalar shared stores in
the tile loop against the default's 16 and 20."""
import json
import os

import pytest
import torch

from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
from linattn.ops.gated_delta_rule.triton.fused_recurrent import (PERSISTENT_REORDERING, PERSISTENT_VARIANTS,
                                                                 fused_recurrent_gdn_fwd, kwarp_flags,
                                                                 persistent_variant_flags)
from decode_aot import decode_aot_report                                   # tests/ is on sys.path
from test_fused_recurrent import BF16_STATE            # one bf16 rounding of the state plus the fp32 part
from linattn.testing import TOL, assert_close, make_gdn_inputs, poison_

F32 = TOL[torch.float32]
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernel needs TRITON_INTERPRET=1 on a CPU")


def _f64(d):
    return {n: (t.double() if t is not None and t.is_floating_point() else t) for n, t in d.items()}


def _run(x, pool, idx, cfg, inplace, fused, l2=False):
    """One launch; o (and ht out of place) NaN-poisoned first. Returns (o, ht)."""
    N, HV, K, V = idx.shape[0], x["v"].shape[2], x["q"].shape[-1], x["v"].shape[-1]
    o = poison_(torch.empty_like(x["v"]))
    ht = None if inplace else poison_(torch.empty(N, HV, K, V, dtype=pool.dtype))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx,
                            x.get("A_log") if fused else None, x.get("dt_bias") if fused else None, l2, fused,
                            not inplace, inplace, config=cfg, out=o, final_out=ht)
    return o, ht


def _case(N, H, HV, K, V, slots, state_dtype, fused=True, qkv_dtype=torch.float32):
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=qkv_dtype, initial_state=False)
    x.pop("initial_state", None)
    if fused:
        x.update(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV), beta=torch.randn_like(x["beta"]))
    pool = (torch.randn(slots, HV, K, V) * 0.5).to(state_dtype)
    return x, pool


# (N, H, HV, K, V, BV, warps): the serving shape (BV 64, 4 warps), GVA H16/HV32 and H32/HV32, and small K/V with
# other index decompositions (columns per warp 16 or 32 -> 8 or 4 lanes along K; bf16 pools 16 or 8)
SHAPES = [
    (3, 16, 32, 128, 128, 64, 4),
    (3, 32, 32, 128, 128, 64, 4),
    (6, 2, 4, 32, 32, 16, 1),
    (6, 4, 4, 64, 32, 32, 2),
    (5, 2, 4, 64, 64, 64, 2),
    (4, 1, 2, 100, 48, 16, 1),   # K, V not powers of 2 (BK 128: masked rows; V 48: a masked V block)
]


@interpreter
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,HV,K,V,BV,warps", SHAPES)
@pytest.mark.parametrize("inplace", [True, False])
def test_kwarp_matches_fp64_and_default(state_dtype, N, H, HV, K, V, BV, warps, inplace):
    """Pool of N + 3 slots, every other row live: slots (N+2, -1, 0, N, -1(=num_slots: out of range), 3, ...).
    kwarp against fp64 (o: fp32 tolerance; pool: fp32 or one bf16 rounding) and against the default variant of the
    same launch config (o and state to fp32 round-off: only the summation order differs), padded rows: zero
    output, their slots untouched; unused slots bit-identical in place; the pool unchanged out of place."""
    if state_dtype == torch.bfloat16 and BV // warps < 8:
        pytest.skip("bf16 pools: 16-byte vectors are 8 columns; BV / warps must be a multiple of 8")
    slots = N + 3
    x, pool0 = _case(N, H, HV, K, V, slots, state_dtype)
    idx = torch.tensor([[N + 2, -1, 0, N, slots, 3][i % 6] for i in range(N)])
    live = [i for i in range(N) if 0 <= idx[i] < slots]
    padded = [i for i in range(N) if i not in live]
    programs = 5           # fewer programs than tiles, not a divisor: uneven walks
    res = {}
    for name, variant in (("kwarp", "kwarp"), ("default", "")):
        pool = pool0.clone()
        o, ht = _run(x, pool, idx, (BV, warps, 2, 1, programs, variant), inplace, True)
        res[name] = (o, ht, pool)
    o, ht, pool = res["kwarp"]
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True,
                                      beta_sigmoid=True)
    tol = F32 if state_dtype == torch.float32 else BF16_STATE
    assert_close("o vs fp64", o[live].double(), ro[live], F32)
    assert torch.equal(o[padded], torch.zeros_like(o[padded]))
    live_slots = idx[live]
    unused = [s for s in range(slots) if s not in live_slots.tolist()]
    if inplace:
        assert_close("pool vs fp64", pool[live_slots].double(), ref_pool[live_slots], tol)
        assert torch.equal(pool[unused], pool0[unused])
    else:
        assert torch.equal(pool, pool0)
        assert_close("final state vs fp64", ht[live].double(), ref_pool[live_slots], tol)
        assert torch.equal(ht[padded], torch.zeros_like(ht[padded]))
    # against the default kernel: same answer to fp32 round-off (a bf16 pool may differ by one rounding step)
    do, dht, dpool = res["default"]
    assert_close("o vs default", o.double(), do.double(), 1e-5)
    state, dstate = (pool, dpool) if inplace else (ht, dht)
    assert_close("state vs default", state.double(), dstate.double(), 1e-5 if state_dtype == torch.float32 else 2e-3)


@interpreter
@pytest.mark.parametrize("H,HV", [(16, 32), (32, 32)])
def test_kwarp_l2norm_no_gate_bf16_qkv(H, HV):
    """In-kernel L2 norm of q and k (summed over both halves), no gate (g=None), plain beta, bf16 q/k/v, at the
    serving head shapes with small K/V (BV 16, 1 warp)."""
    N, K, V, slots = 2, 32, 32, 4
    x, pool0 = _case(N, H, HV, K, V, slots, torch.float32, fused=False, qkv_dtype=torch.bfloat16)
    x["k"] = torch.randn_like(x["k"])                   # unnormalised: the in-kernel norm matters
    x["g"] = None
    idx = torch.tensor([3, 1])
    pool = pool0.clone()
    o, _ = _run(x, pool, idx, (16, 1, 2, 1, 3, "kwarp"), True, False, l2=True)
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True,
                                      use_qk_l2norm_in_kernel=True)
    assert_close("o", o, ro, TOL[torch.bfloat16])
    assert_close("pool", pool.double(), ref_pool, F32)
    assert torch.equal(pool[[0, 2]], pool0[[0, 2]])


def test_kwarp_config_checks():
    assert persistent_variant_flags("kwarp")["KWARP"] and not persistent_variant_flags("")["KWARP"]
    assert "kwarp" in PERSISTENT_VARIANTS and "kwarp" in PERSISTENT_REORDERING
    assert persistent_variant_flags("kwarp+store_cs")["STORE_CACHE"] == ".cs"
    with pytest.raises(ValueError, match="drop prefetch_qk"):
        persistent_variant_flags("kwarp+prefetch_qk")
    assert kwarp_flags(128, 64, 4, 4) == dict(KW_WARPS=4, KW_VEC=4)      # 16 columns per warp: 4 x 8 lanes
    assert kwarp_flags(128, 64, 4, 2) == dict(KW_WARPS=4, KW_VEC=8)      # bf16: 2 x 16 lanes
    for bad in [(128, 8, 4, 4),      # 2 columns per warp: no 16-byte vector
                (128, 48, 4, 4),     # 12 columns: 3 lanes along V
                (8, 16, 1, 4)]:      # 8 lanes along K need BK >= 16
        with pytest.raises(ValueError, match="kwarp needs"):
            kwarp_flags(*bad)


# ---- ahead of time, sm_90a -------------------------------------------------------------------------------------

AOT_BUILDS = {"gdn_decode_persistent_fp32_bv64_w4_s2": "default",
              "gdn_decode_persistent_fp32_bv64_w4_s2_kwarp": "kwarp",
              "gdn_decode_persistent_fp32_bv64_w4_s3_kwarp": "kwarp_s3",
              "gdn_decode_persistent_bf16_bv64_w4_s2_kwarp": "kwarp_bf16"}


@pytest.fixture(scope="module")
def aot():
    return decode_aot_report(AOT_BUILDS)


def test_aot_kwarp_layout_and_barriers(aot):
    d, kw = aot["default"], aot["kwarp"]
    # the diagnosis: the default [128, 64] tile puts its 4 warps along K (warpsPerCTA [4, 1]) ...
    assert d["blocked"][0].startswith("#ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [2, 16], "
                                      "warpsPerCTA = [4, 1]"), d["blocked"]
    # ... kwarp's [8 lanes, 4 warps, 8 rows, 16 columns] halves put them along V, K on lanes and registers
    assert kw["blocked"][0].startswith("#ttg.blocked<{sizePerThread = [1, 1, 1, 4], threadsPerWarp = [8, 1, 1, 4], "
                                       "warpsPerCTA = [1, 4, 1, 1]"), kw["blocked"]
    # the claim: per tile (loop body), CTA barriers 16 -> <= 3 (the cp.async wait, the o row's layout change, the
    # buffer's reuse) and scalar shared stores 20 -> 4 (only o's bf16 row); the state still comes in as 16-byte
    # cp.async copies and leaves as 16-byte stores
    assert d["loop"]["BAR.SYNC.DEFER_BLOCKING"] == 16, d["loop"]
    assert kw["loop"]["BAR.SYNC.DEFER_BLOCKING"] <= 3, kw["loop"]
    n_sts = lambda r: sum(n for o, n in r["loop"].items() if o.startswith("STS"))
    assert n_sts(d) == 20 and n_sts(kw) <= 4, (d["loop"], kw["loop"])
    assert kw["loop"].get("LDGSTS.E.BYPASS.128", 0) == 16 + 4       # state (2 halves x 8) + q, k halves
    assert kw["loop"].get("STG.E.128") == 16 and kw["loop"].get("LDS.128") == 20
    assert kw["loop"].get("SHFL.BFLY", 0) >= 3 * 3                  # kS, qS, q.k: 3 butterfly steps over 8 lanes
    assert "LDG.E.U16" not in kw["loop"]                             # q, k no longer plain 2-byte loads
    # fits 3 programs of 4 warps per SM like the default (65536 / 384 -> 168 registers), no spill, no local memory
    for name in ("default", "kwarp", "kwarp_bf16"):
        r = aot[name]
        assert r["regs"] <= 168 and r["spills"] == 0 and not any(o.startswith(("LDL", "STL")) for o in r["all"]), r
    assert aot["kwarp_bf16"]["loop"]["BAR.SYNC.DEFER_BLOCKING"] <= 3
    # 3 stages: two programs per SM (<= 255 registers, 2 x 66 KB of buffers), no spill, same barrier count
    s3 = aot["kwarp_s3"]
    assert s3["spills"] == 0 and s3["regs"] <= 255 and 2 * s3["smem"] <= 227 * 1024
    assert s3["loop"]["BAR.SYNC.DEFER_BLOCKING"] <= 3
    print(json.dumps({n: {k: r[k] for k in ("regs", "spills", "smem")} | {
        "bar": r["loop"].get("BAR.SYNC.DEFER_BLOCKING"), "sts": n_sts(r)} for n, r in aot.items()}))
