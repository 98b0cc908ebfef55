"""The `split_tail` variant of the persistent decode kernel (benchmarks/DECODE_TAIL.md): the first
floor(n_tiles / P) * P tiles walked as by the default, the R = n_tiles mod P tiles left as 2R half tiles (BV/2
columns each) spread over the programs as the last items of the same pipelined loop.

On the CPU (TRITON_INTERPRET=1), fresh random inputs, outputs NaN-poisoned first, compared by relative RMS error
against non-zero references: split_tail (alone, with prefetch_qk, store_cs and contiguous_tiles) against the
default persistent kernel and the one-tile kernel of the same BV (<= 1e-6: the same layout and summation order,
so in fact equal), and against the fp64 reference; fp32 and bf16 pools, GVA (HV = 2 H) and H = HV, padded (-1) and
out-of-range slots, in place (unused slots bit-identical) and out of place (pool untouched), program counts with
R = 0, with 2R <= P (one half tile at most per program) and with 2R > P (two), V not a multiple of BV (a half tile
entirely past V). Ahead of time for sm_90a (a child process without the interpreter): the split_tail builds keep
the default's 16-byte state copies and stores, its CTA barriers per tile, no spill, and fit 3 programs of 4 warps
per SM at 2 stages (fp32 and bf16 pools) and 2 per SM at 3 stages."""
import json
import os

import pytest
import torch

from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
from linattn.ops.gated_delta_rule.triton.fused_recurrent import (PERSISTENT_REORDERING, PERSISTENT_VARIANTS,
                                                                 fused_recurrent_gdn_fwd, persistent_variant_flags)
from decode_aot import decode_aot_report                                   # tests/ is on sys.path
from test_fused_recurrent import BF16_STATE            # one bf16 rounding of the state plus the fp32 part
from linattn.testing import TOL, assert_close, make_gdn_inputs, poison_

F32 = TOL[torch.float32]
SAME = 1e-6                # split_tail against the default / one-tile kernel: fp32 round-off at most
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernel needs TRITON_INTERPRET=1 on a CPU")


def _f64(d):
    return {n: (t.double() if t is not None and t.is_floating_point() else t) for n, t in d.items()}


def _case(N, H, HV, K, V, slots, state_dtype):
    """Fused-gate inputs (A_log, dt_bias, raw beta through the in-kernel sigmoid) and a pool of `slots` slots."""
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=torch.float32, initial_state=False)
    x.pop("initial_state", None)
    x.update(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV), beta=torch.randn_like(x["beta"]))
    pool = (torch.randn(slots, HV, K, V) * 0.5).to(state_dtype)
    return x, pool


def _run(x, pool0, idx, cfg, inplace):
    """One launch on a copy of the pool; o (and ht out of place) NaN-poisoned first. Returns (o, ht, pool)."""
    N, HV, K, V = idx.shape[0], x["v"].shape[2], x["q"].shape[-1], x["v"].shape[-1]
    pool = pool0.clone()
    o = poison_(torch.empty_like(x["v"]))
    ht = None if inplace else poison_(torch.empty(N, HV, K, V, dtype=pool.dtype))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx,
                            x["A_log"], x["dt_bias"], False, True, not inplace, inplace, config=cfg, out=o,
                            final_out=ht)
    return o, ht, pool


def _tail(n_tiles, programs):
    """(full tiles per program, R, most half tiles of one program) of split_tail's walk."""
    q, r = divmod(n_tiles, programs)
    return q, r, -(-2 * r // programs)


# (N, H, HV, K, V, BV, warps, programs): n_tiles = N * HV * cdiv(V, BV)
CASES = [
    (6, 2, 4, 32, 32, 16, 1, 8),       # GVA, 48 tiles / 8: R = 0 (split_tail changes nothing)
    (6, 2, 4, 32, 32, 16, 1, 36),      # 48 / 36: R = 12, 24 halves <= 36 programs: one half at most
    (6, 2, 4, 32, 32, 16, 1, 7),       # 48 / 7: R = 6, 12 halves > 7 programs: two halves for programs 0-4
    (6, 4, 4, 32, 32, 16, 1, 5),       # H = HV, 48 / 5: R = 3, 6 halves > 5
    (5, 2, 4, 64, 64, 32, 2, 6),       # 40 tiles of BV 32 at 2 warps / 6: R = 4
    (4, 1, 2, 100, 48, 32, 1, 3),      # K, V not powers of 2: BK 128 (masked rows); V 48 in BV 32: the last
    #                                    block's upper half (columns 48-63) is entirely past V; 16 / 3: R = 1
    (3, 16, 32, 128, 128, 64, 4, 5),   # the serving head shape, GVA: 192 tiles of BV 64 / 5: R = 2
]


def _ids(c):
    N, H, HV, K, V, BV, w, P = c
    q, r, h = _tail(N * HV * -(-V // BV), P)
    return f"N{N}H{H}HV{HV}K{K}V{V}BV{BV}P{P}_R{r}"


@interpreter
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_split_tail_matches_default_one_tile_and_fp64(case, inplace, state_dtype):
    """Pool of N + 3 slots, slots (N+2, -1, 0, N, num_slots (out of range), 3, ...): split_tail+prefetch_qk (the
    sweep's row) against the default persistent kernel (prefetch_qk) and the one-tile kernel of the same BV: o and
    the written state within 1e-6 relative RMS (the same layout and summation order: equal in fact); against fp64
    within the fp32 tolerance (state: or one bf16 rounding); padded rows zero, their slots untouched; unused slots
    bit-identical in place; the pool unchanged out of place. An in-place half tile done twice, or a half skipped,
    would show in the pool (and a skipped output column as NaN)."""
    N, H, HV, K, V, BV, warps, programs = case
    slots = N + 3
    x, pool0 = _case(N, H, HV, K, V, slots, state_dtype)
    idx = torch.tensor([[N + 2, -1, 0, N, slots, 3][i % 6] for i in range(N)])
    live = [i for i in range(N) if 0 <= idx[i] < slots]
    padded = [i for i in range(N) if i not in live]
    res = {name: _run(x, pool0, idx, cfg, inplace) for name, cfg in (
        ("split", (BV, warps, 2, 1, programs, "prefetch_qk+split_tail")),
        ("default", (BV, warps, 2, 1, programs, "prefetch_qk")),
        ("one_tile", (BV, warps, 0, 0)))}
    o, ht, pool = res["split"]
    live_slots = idx[live]
    state = pool[live_slots] if inplace else ht[live]
    for name in ("default", "one_tile"):
        ro, rht, rpool = res[name]
        ref_state = rpool[live_slots] if inplace else rht[live]
        assert ro[live].abs().sum() > 0 and ref_state.float().abs().sum() > 0
        assert_close(f"o vs {name}", o[live], ro[live], SAME)
        assert_close(f"state vs {name}", state.float(), ref_state.float(), SAME)
    # against fp64
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True,
                                      beta_sigmoid=True)
    assert_close("o vs fp64", o[live].double(), ro[live], F32)
    assert torch.equal(o[padded], torch.zeros_like(o[padded]))
    tol = F32 if state_dtype == torch.float32 else BF16_STATE
    assert_close("state vs fp64", state.double(), ref_pool[live_slots], tol)
    unused = [s for s in range(slots) if s not in live_slots.tolist()]
    if inplace:
        assert torch.equal(pool[unused], pool0[unused])
    else:
        assert torch.equal(pool, pool0)
        assert torch.equal(ht[padded], torch.zeros_like(ht[padded]))


@interpreter
@pytest.mark.parametrize("variant", ["split_tail", "store_cs+split_tail", "contiguous_tiles+split_tail",
                                     "contiguous_tiles+prefetch_qk+split_tail+store_cs"])
@pytest.mark.parametrize("programs", [None, 8, 7, 36])
def test_split_tail_combinations(variant, programs):
    """split_tail with the other bit-exact variants (contiguous_tiles: program p's full tiles are the run
    [p q, (p + 1) q), then its halves) and the launcher's own program count (None: 1 per SM on this host), in
    place on a GVA pool with padded rows: o and pool within 1e-6 of the default persistent kernel's (48 tiles)."""
    N, H, HV, K, V, BV = 6, 2, 4, 32, 32, 16
    slots = 9
    x, pool0 = _case(N, H, HV, K, V, slots, torch.float32)
    idx = torch.tensor([7, -1, 0, 3, 11, 5])
    o, _, pool = _run(x, pool0, idx, (BV, 1, 2, 1, programs, variant), True)
    ro, _, rpool = _run(x, pool0, idx, (BV, 1, 2, 1, programs), True)
    live = [0, 2, 3, 5]
    assert ro[live].abs().sum() > 0
    assert_close("o", o[live], ro[live], SAME)
    assert torch.equal(o[[1, 4]], torch.zeros_like(o[[1, 4]]))
    assert_close("pool", pool, rpool, SAME)
    assert torch.equal(pool[[1, 2, 4, 6, 8]], pool0[[1, 2, 4, 6, 8]])


def test_split_tail_cases_cover_the_tail_shapes():
    """The program counts above give R = 0, 2R <= P and 2R > P, and the serving shape's arithmetic: 16384 tiles
    over 396 programs = 41 full tiles each and 296 halves (one for programs 0-295) instead of a 42nd tile for
    programs 0-147."""
    tails = [_tail(N * HV * -(-V // BV), P) + (P,) for N, H, HV, K, V, BV, w, P in CASES]
    assert any(r == 0 for q, r, h, P in tails)
    assert any(r and 2 * r <= P for q, r, h, P in tails)
    assert any(2 * r > P for q, r, h, P in tails)
    assert _tail(256 * 32 * 2, 3 * 132) == (41, 148, 1)


def test_split_tail_flags():
    assert "split_tail" in PERSISTENT_VARIANTS and "split_tail" not in PERSISTENT_REORDERING
    assert persistent_variant_flags("prefetch_qk+split_tail")["SPLIT_TAIL"]
    assert persistent_variant_flags("prefetch_qk+split_tail")["PREFETCH_QK"]
    assert not persistent_variant_flags("prefetch_qk")["SPLIT_TAIL"]
    with pytest.raises(ValueError, match="split_tail"):
        persistent_variant_flags("kwarp+split_tail")


# ---- ahead of time, sm_90a -------------------------------------------------------------------------------------

AOT_BUILDS = {"gdn_decode_persistent_fp32_bv64_w4_s2": "default",
              "gdn_decode_persistent_fp32_bv64_w4_s2_prefetch_qk_split_tail": "split",
              "gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk_split_tail": "split_s3",
              "gdn_decode_persistent_bf16_bv64_w4_s2_prefetch_qk_split_tail": "split_bf16",
              "gdn_decode_persistent_fp32_bv64_w4_s2_split_tail": "split_only"}


@pytest.fixture(scope="module")
def aot():
    return decode_aot_report(AOT_BUILDS)


def test_aot_split_tail_keeps_the_default_tile(aot):
    d = aot["default"]
    assert len(aot) == 5, sorted(aot)
    for name in ("split", "split_bf16", "split_only"):
        r = aot[name]
        # fits 3 programs of 4 warps per SM like the default (65536 / 384 -> 168 registers), no spill, no local
        # memory; the same shared memory (the pipeliner's buffers)
        assert r["regs"] <= 168 and r["spills"] == 0 and not any(o.startswith(("LDL", "STL")) for o in r["all"]), r
        # the same tile: the same CTA barriers per tile, the state in and out as 16-byte copies and stores (a half
        # tile is the full block with half its columns masked off, not another layout)
        assert r["loop"]["BAR.SYNC.DEFER_BLOCKING"] == d["loop"]["BAR.SYNC.DEFER_BLOCKING"] == 16, r["loop"]
    for name in ("split", "split_only"):
        assert aot[name]["smem"] == d["smem"]
        assert aot[name]["loop"].get("LDGSTS.E.BYPASS.128") == d["loop"].get("LDGSTS.E.BYPASS.128") == 16
        assert aot[name]["loop"].get("STG.E.128") == d["loop"].get("STG.E.128") == 16
    # prefetch_qk kept: q, k as 2-byte loads once before the loop and once in it
    assert aot["split"]["all"].get("LDG.E.U16") == d["all"].get("LDG.E.U16") == 4
    # 3 stages: two programs per SM (<= 255 registers, 2 x 66 KB of buffers), no spill
    s3 = aot["split_s3"]
    assert s3["spills"] == 0 and s3["regs"] <= 255 and 2 * s3["smem"] <= 227 * 1024
    assert not any(o.startswith(("LDL", "STL")) for o in s3["all"]), s3
    print(json.dumps({n: {k: r[k] for k in ("regs", "spills", "smem")} | {
        "loop_instrs": sum(r["loop"].values())} for n, r in aot.items()}))
