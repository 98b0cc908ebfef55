"""Stage 2 of the forward as two kernels (the default since round 12; LINATTN_GDN_SPLIT_INTRA=0 off): the same outputs
as intra_chunk_wy_kernel (gdn-math.md, "The chunk form"), in two passes that each keep few registers live and do their
big products as [64, *] tiles, which Triton lowers to WGMMA on Hopper (intra_chunk_wy_kernel's 16-row products are
mma.sync, replicated over its 4 warps, with every block live at once: 255 registers).

  kkt_solve  one program per (chunk slot, value head):
               gam  = cumsum(g)                   (stored to gcum; the one-kernel stage's summation order)
               A    = strict_lower( diag(beta) K K^T * exp(gam_i - gam_j) )   K K^T: one [64, K] x [K, 64] product
               Tinv = (I + A)^-1
             With A = N + L, N its four 16x16 diagonal blocks and L the strictly block-lower rest:
               D    = (I + N)^-1, the four blocks at once as one batched [4, 16, 16] tensor (one warp per block) by
                      intra_chunk's nilpotent product (I - N)(I + N^2)(I + N^4)(I + N^8)
               M    = D L  (strictly block lower over 4 blocks: M^4 = 0)
               Tinv = (I + M)^-1 D = (I - M)(I + M^2) D = Y - M Y,  Y = D + M^2 D    (four [64, 64] products)
             That is the one-kernel stage's block forward substitution, unrolled into whole-tile products.
             Stores Tinv [T_tot, HV, 64]: fp32 when the caller keeps it for the backward (store_tinv; backward_wy.py
             reads it in fp32), else in k's dtype, the precision W and U consume it at (the one-kernel stage rounds
             Tinv to k's dtype right before those products too), so the rounded store loses nothing.
  wu         one program per (chunk slot, value head):
               W = Tinv diag(beta exp(gam)) K,   U = Tinv diag(beta) V     as [64, 64] x [64, BK | BV] products.

The fp32 products of the inverse run at DOT_PREC like the one-kernel stage's (TF32 for 16-bit inputs, IEEE for
fp32). Only the association of the substitution and the accumulation order of the products differ from
intra_chunk_wy_kernel: in fp32 the two agree to ~1e-7 relative; with TF32 to TF32 round-off (2^-11) in Tinv, below
the 16-bit rounding that follows. Measured on the H200 from round 12: benchmarks/SPLIT_INTRA.md; stage 2a's later
kernels (kkt_solve_v2_kernel, the default of round 16, and v3, the default since round 17): benchmarks/KKT_SOLVE.md.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan
from linattn.ops.gated_delta_rule.triton.common import chunk_span, slot_chunk
from linattn.ops.gated_delta_rule.triton.intra_chunk import _dot_op, _inv_unit_lower16
from linattn.runtime.alloc import empty
from linattn.runtime.settings import settings

CHUNK = 64


@triton.jit
def _chunk_gates(g_ptr, beta_ptr, gcum_ptr, r, m, hv, HV: tl.constexpr, BT: tl.constexpr):
    """gam (also stored as gcum) and beta of one chunk's rows r (mask m) for value head hv. gam: a cumsum inside each
    16-row block plus the sum of the earlier blocks, the one-kernel stage's order."""
    gam = _gam_of(tl.load(g_ptr + r * HV + hv, mask=m, other=0.), BT)
    tl.store(gcum_ptr + r * HV + hv, gam, mask=m)
    beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    return gam, beta


@triton.jit
def _gam_of(g_rows, BT: tl.constexpr):
    """gam = cumsum(g) over one chunk's loaded g rows: a cumsum inside each 16-row block plus the sum of the earlier
    blocks, the one-kernel stage's order."""
    g = tl.reshape(g_rows.to(tl.float32), [4, 16])
    sums = tl.sum(g, axis=1)
    b = tl.arange(0, 4)
    base = tl.sum(tl.where(b[None, :] < b[:, None], sums[None, :], 0.), axis=1)
    return tl.reshape(tl.cumsum(g, axis=1) + base[:, None], [BT])


@triton.jit
def _k_block(k_ptr, t0, eos, hk, kb, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The [BT, BK] block kb of one chunk's keys (key head hk); rows past the sequence end load as zeros."""
    p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
    return tl.load(p_k, boundary_check=(0, 1))


@triton.jit
def _chunk_kkt(k_ptr, t0, eos, hk, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """K K^T of one chunk's keys (key head hk) over K in blocks of BK; rows past the sequence end load as zeros, so
    their A rows and columns vanish."""
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        b_k = _k_block(k_ptr, t0, eos, hk, kb, H, K, BT, BK)
        kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    return kk


@triton.jit
def _gated_a(kk, gam, beta, BT: tl.constexpr):
    """A = strictly lower (beta_i (K K^T)_ij exp(gam_i - gam_j)), masked before exp: above the diagonal
    gam_i - gam_j > 0 could overflow for very negative g."""
    i = tl.arange(0, BT)
    lower = i[:, None] > i[None, :]
    return tl.where(lower, beta[:, None] * kk * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.)), 0.)


@triton.jit
def _chunk_a(k_ptr, g_ptr, beta_ptr, gcum_ptr, cu_ptr, n, c, hv, H: tl.constexpr, HV: tl.constexpr,
             K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
             EARLY_K: tl.constexpr = False):
    """The per-value-head stage-2a prologue of chunk c of sequence n (kkt_solve_kernel and its v2 / v3 / v4): the
    chunk's span, its gates (gcum stored) and the gated A. Returns (t0, eos, r, m, a): r the chunk's token rows,
    m = r < eos. EARLY_K (v4, K <= BK: one k tile): g, beta and the k tile are loaded before gam's cumsum, so the
    three loads are in flight together instead of k's being issued after the cumsum has waited for g (round 21's
    source-level profile: two dependent DRAM round trips per program). The same operations on the same values, so
    the same gcum and A bit for bit."""
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)                       # GVA: the query/key head this value head reads
    r = t0 + tl.arange(0, BT)
    m = r < eos
    if EARLY_K:
        tl.static_assert(K <= BK, "EARLY_K loads the whole k tile at once")
        g_rows = tl.load(g_ptr + r * HV + hv, mask=m, other=0.)
        beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
        b_k = _k_block(k_ptr, t0, eos, hk, 0, H, K, BT, BK)
        gam = _gam_of(g_rows, BT)
        tl.store(gcum_ptr + r * HV + hv, gam, mask=m)
        kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    else:
        gam, beta = _chunk_gates(g_ptr, beta_ptr, gcum_ptr, r, m, hv, HV, BT)
        kk = _chunk_kkt(k_ptr, t0, eos, hk, H, K, BT, BK, DOT_PREC)
    a = _gated_a(kk, gam, beta, BT)
    return t0, eos, r, m, a


@triton.jit
def kkt_solve_kernel(
    k_ptr, g_ptr, beta_ptr,                   # k [T_tot, H, K], g/beta [T_tot, HV]
    gcum_ptr, tinv_ptr,                       # gcum fp32 [T_tot, HV], tinv [T_tot, HV, BT] (fp32 or k's dtype)
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    t0, eos, r, m, a = _chunk_a(k_ptr, g_ptr, beta_ptr, gcum_ptr, cu_ptr, n, c, hv, H, HV, K, BT, BK, DOT_PREC)
    i = tl.arange(0, BT)

    # Tinv = (I + A)^-1, A = N + L (N: the 16x16 diagonal blocks, L: the strictly block-lower rest):
    #   D = (I + N)^-1 blockwise, M = D L (M^4 = 0), Tinv = (I + M)^-1 D = (I - M)(I + M^2) D = Y - M Y
    F32: tl.constexpr = DOT_PREC
    a4 = tl.reshape(a, [4, 16, 4, 16])
    rb = tl.arange(0, 4)[:, None, None, None]
    cb = tl.arange(0, 4)[None, None, :, None]
    # the diagonal blocks as one [4, 16, 16] tensor: batched products, one warp per block
    d = _inv_unit_lower16(tl.sum(tl.where(rb == cb, a4, 0.), axis=2), F32)
    dd = tl.reshape(tl.where(rb == cb, tl.expand_dims(d, 2), 0.), [BT, BT])
    blk = i // 16
    l = tl.where(blk[:, None] > blk[None, :], a, 0.)
    mm = tl.dot(dd, l, input_precision=F32)
    y = dd + tl.dot(tl.dot(mm, mm, input_precision=F32), dd, input_precision=F32)
    tinv = y - tl.dot(mm, y, input_precision=F32)
    tl.store(tinv_ptr + (r * HV + hv)[:, None] * BT + i[None, :], tinv.to(tinv_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def kkt_solve_gva_kernel(
    k_ptr, g_ptr, beta_ptr,                   # k [T_tot, H, K], g/beta [T_tot, HV]
    gcum_ptr, tinv_ptr,                       # gcum fp32 [T_tot, HV], tinv [T_tot, HV, BT] (fp32 or k's dtype)
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Opt-in GVA form of kkt_solve_kernel (not launched by default; kkt_solve_gva below): one program per (chunk
    slot, KEY head hk), so k is loaded and K K^T formed once for the G = HV // H value heads hk*G .. hk*G+G-1 that
    read it, then a static loop over those heads does, per head, exactly kkt_solve_kernel's operations after
    K K^T (same cumsum order, mask before exp, same block inverse and dot precisions, same stores): its gcum and
    Tinv are meant bit-equal to kkt_solve_kernel's (tests/test_kkt_solve_gva.py under the interpreter;
    benchmarks/gpu/kkt_gva_round.py on a GPU). K K^T stays live across the loop, one value head at a time.
    sm_90a (ptxas, H16/HV32 K=128 bf16, AOT gdn_fwd_triton_split_kkt_solve_gva_w4): 225 registers, 0 spill, 48 KB
    shared, so 2 CTAs per SM where kkt_solve_kernel (122 registers) has 4: besides K K^T (32 registers) the
    compiler shares the address arithmetic of the unrolled heads and keeps it live across them (a dynamic loop
    hoists the same invariants: 220-241). H200, round 16: bit-equal to kkt_solve_kernel and 0.84-0.88x its speed
    (B1 T65536 0.642 -> 0.755 ms): not adopted (benchmarks/RESULTS.md)."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    tl.static_assert(HV % H == 0, "GVA: every key head serves the same number of value heads")
    G: tl.constexpr = HV // H
    p = tl.program_id(0)
    hk = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)

    kk = _chunk_kkt(k_ptr, t0, eos, hk, H, K, BT, BK, DOT_PREC)     # once per key head
    r = t0 + tl.arange(0, BT)
    m = r < eos
    i = tl.arange(0, BT)
    blk = i // 16
    rb = tl.arange(0, 4)[:, None, None, None]
    cb = tl.arange(0, 4)[None, None, :, None]
    F32: tl.constexpr = DOT_PREC
    for j in tl.static_range(G):
        hv = hk * G + j                        # the value heads of key head hk (kkt_solve_kernel: hk = hv // G)
        gam, beta = _chunk_gates(g_ptr, beta_ptr, gcum_ptr, r, m, hv, HV, BT)
        a = _gated_a(kk, gam, beta, BT)
        # Tinv = (I + A)^-1 exactly as kkt_solve_kernel: D = (I + N)^-1 blockwise, M = D L, Tinv = Y - M Y
        a4 = tl.reshape(a, [4, 16, 4, 16])
        d = _inv_unit_lower16(tl.sum(tl.where(rb == cb, a4, 0.), axis=2), F32)
        dd = tl.reshape(tl.where(rb == cb, tl.expand_dims(d, 2), 0.), [BT, BT])
        l = tl.where(blk[:, None] > blk[None, :], a, 0.)
        mm = tl.dot(dd, l, input_precision=F32)
        y = dd + tl.dot(tl.dot(mm, mm, input_precision=F32), dd, input_precision=F32)
        tinv = y - tl.dot(mm, y, input_precision=F32)
        tl.store(tinv_ptr + (r * HV + hv)[:, None] * BT + i[None, :], tinv.to(tinv_ptr.dtype.element_ty),
                 mask=m[:, None])


@triton.jit
def wu_kernel(
    k_ptr, v_ptr, beta_ptr, gcum_ptr, tinv_ptr,   # k [T_tot, H, K], v [T_tot, HV, V], beta/gcum [T_tot, HV], tinv [T_tot, HV, BT]
    w_ptr, u_ptr,                                 # w [T_tot, HV, K], u [T_tot, HV, V] in k's dtype
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)
    op = k_ptr.dtype.element_ty

    i = tl.arange(0, BT)
    r = t0 + i
    m = r < eos
    gam = tl.load(gcum_ptr + r * HV + hv, mask=m, other=0.)
    beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    # Tinv rounded to the operand dtype, as the one-kernel stage multiplies it (rows past the end load as zeros)
    tinv = tl.load(tinv_ptr + (r * HV + hv)[:, None] * BT + i[None, :], mask=m[:, None], other=0.).to(op)

    bg = beta * tl.exp(gam)
    for kb in range(0, tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        ks = (tl.load(p_k, boundary_check=(0, 1)).to(tl.float32) * bg[:, None]).to(op)
        p_w = tl.make_block_ptr(w_ptr + t0 * HV * K + hv * K, (eos - t0, K), (HV * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        tl.store(p_w, tl.dot(tinv, ks, input_precision=DOT_PREC).to(op), boundary_check=(0, 1))
    for vb in range(0, tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
        vs = (tl.load(p_v, boundary_check=(0, 1)).to(tl.float32) * beta[:, None]).to(op)
        p_u = tl.make_block_ptr(u_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
        tl.store(p_u, tl.dot(tinv, vs, input_precision=DOT_PREC).to(op), boundary_check=(0, 1))


@dataclass(frozen=True)
class SplitIntraConfig:
    BK_kkt: int          # K block of the K K^T product in kkt_solve
    BK: int              # K block of W in wu
    BV: int              # V block of U in wu
    warps_kkt: int
    warps_wu: int


@lru_cache(maxsize=None)
def split_intra_config(K: int, V: int) -> SplitIntraConfig:
    """Frozen launch config (no autotuning), one warpgroup each (WGMMA). At K = V = 128, bf16, sm_90a (ptxas):
    kkt_solve with K K^T in one K block of 128: 122 registers (64: 130, 32: 122 with twice the WGMMA waits), 48 KB
    shared, so 4 CTAs per SM; wu with W and U in 64-column blocks: 92 registers (BK = BV = 128: 126, fp32 Tinv 162),
    so memory traffic from up to 5 CTAs per SM."""
    return SplitIntraConfig(BK_kkt=max(16, min(128, triton.next_power_of_2(K))),
                            BK=max(16, min(64, triton.next_power_of_2(K))),
                            BV=max(16, min(64, triton.next_power_of_2(V))), warps_kkt=4, warps_wu=4)


def intra_split(k, v, g, beta, gcum, w, u, tinv: Optional[torch.Tensor], plan: ChunkPlan, *, H: int, HV: int,
                K: int, V: int, dot_prec: str) -> None:
    """Fills gcum, w, u (and tinv, fp32 [T_tot, HV, 64], when given) as intra_chunk_wy_kernel does. Without tinv,
    Tinv goes from kkt_solve to wu through a buffer in k's dtype."""
    cfg = split_intra_config(K, V)
    if tinv is None:
        tinv = empty(plan.T_total, HV, CHUNK, dtype=k.dtype, device=k.device)
    grid = (plan.num_slots, HV)
    kernel = kkt_kernel()
    kernel[grid](
        k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N,
        H=H, HV=HV, K=K, BT=CHUNK, BK=cfg.BK_kkt, DOT_PREC=dot_prec, num_warps=cfg.warps_kkt,
        **kkt_order(kernel, plan.num_slots))
    wu_kernel[grid](
        k, v, beta, gcum, tinv, w, u, plan.cu, plan.chunk_indices, plan.N,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, BV=cfg.BV, DOT_PREC=dot_prec, num_warps=cfg.warps_wu)


def kkt_kernel():
    """The stage-2a kernel the forward launches: kkt_solve_v4_kernel (default since round 20), kkt_solve_v3_kernel
    with LINATTN_GDN_KKT=v3 (rounds 17-19), kkt_solve_v2_kernel with LINATTN_GDN_KKT=v2 (round 16) or
    kkt_solve_kernel with LINATTN_GDN_KKT=v1 (same signature, grid and outputs; Tinv to rounding, v3's bit-equal to
    v2's, v4's fp32 Tinv bit-equal to v3's; benchmarks/KKT_SOLVE.md)."""
    return {"v1": kkt_solve_kernel, "v2": kkt_solve_v2_kernel, "v3": kkt_solve_v3_kernel}.get(settings.gdn_kkt,
                                                                                          kkt_solve_v4_kernel)


# chunk slots from which kkt_solve_v4_kernel numbers its programs head-fastest (HEADS_FAST). In the default order the
# two value heads of a key head read the same k tile num_slots programs apart (~24 KB of traffic each): H200, round 20
# (benchmarks/RESULTS.md; KKT_TIMING_ROUNDS=5, spread <= 0.3%): head-fastest 1.17x at 1024 slots (B1 T65536) and
# 1.11x at 957 (the varlen row), 0.992x at 512 (B8 T4096) and 0.97x at 128 (B1 T8192); the threshold sits between
# the two sides that were measured (512 and 957)
KKT_HEADS_FAST_SLOTS = 768


def kkt_order(kernel, num_slots: int) -> dict:
    """The schedule arguments of a stage-2a launch (kkt_solve_v4_kernel's only; the other kernels have none):
    HEADS_FAST on grids of at least KKT_HEADS_FAST_SLOTS chunk slots, and EARLY_K (default since round 21;
    LINATTN_GDN_KKT_EARLY_K=0 off). Neither changes an output bit."""
    if kernel is not kkt_solve_v4_kernel:
        return {}
    args = {"HEADS_FAST": True} if num_slots >= KKT_HEADS_FAST_SLOTS else {}
    if settings.gdn_kkt_early_k:
        args["EARLY_K"] = True
    return args


def kkt_solve_gva(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan: ChunkPlan, HV: int,
                  gcum: Optional[torch.Tensor] = None, tinv: Optional[torch.Tensor] = None,
                  dot_prec: Optional[str] = None):
    """Opt-in (nothing calls it by default): stage 2a as kkt_solve_gva_kernel, one program per (chunk slot, key
    head), returning (gcum fp32 [T_tot, HV], Tinv [T_tot, HV, 64]) as gluon/chunk_fused_wu_ws.py kkt_solve does
    with kkt_solve_kernel (same frozen config: split_intra_config(K, K).BK_kkt / warps_kkt; DOT_PREC ieee for fp32
    k, else tf32), meant bit-equal to it. gcum / tinv may be given (tinv fp32 for the backward's store_tinv, else
    k's dtype); they are allocated otherwise."""
    return _launch_kkt_variant(kkt_solve_gva_kernel, "kkt_solve_gva", k, g, beta, plan, HV, gcum, tinv, dot_prec,
                               per_key_head=True)


@triton.jit
def _blocks_at(a4, s: tl.constexpr):
    """From A viewed as [4 row blocks, 16, 4 column blocks, 16]: the blocks A_{i, i-s} as a [4, 16, 16] tensor
    (row block i; zero where i < s). In the WGMMA accumulator layout a thread holds all four column blocks of its
    rows, so this sum is in-thread."""
    rb = tl.arange(0, 4)[:, None, None, None]
    cb = tl.arange(0, 4)[None, None, :, None]
    return tl.sum(tl.where(cb == rb - s, a4, 0.), axis=2)


@triton.jit
def _from_block_above(x, s: tl.constexpr):
    """y[i] = x[i - s] over the leading (row block) axis of a [4, 16, 16] tensor, x[0] where i < s (callers only
    multiply those by zero blocks). The one cross-warp move of the substitution: a gather through 4 KB of shared
    memory."""
    i = tl.arange(0, 4)[:, None, None] + tl.zeros([4, 16, 16], dtype=tl.int32)
    return tl.gather(x, tl.maximum(i - s, 0), 0)


@triton.jit
def _store_diagonals(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV: tl.constexpr, BT: tl.constexpr):
    """Stores the four block diagonals of Tinv (d = T_ii, t1 = T_{i,i-1}, t2, t3 as [4, 16, 16], row block i):
    diagonal s at column block (i - s) mod 4, T_{i,i-s} below the diagonal and its exact zeros (i < s) above it, so
    the four stores write all of Tinv's rows t0 .. min(t0 + 64, eos)."""
    rr = t0 + tl.arange(0, 4)[:, None, None] * 16 + tl.arange(0, 16)[None, :, None]
    cc = tl.arange(0, 16)[None, None, :]
    rowm = (rr < eos) & (cc < 16)
    base_p = tinv_ptr + (rr * HV + hv) * BT + cc
    blk4 = tl.arange(0, 4)[:, None, None]
    ty = tinv_ptr.dtype.element_ty
    tl.store(base_p + blk4 * 16, d.to(ty), mask=rowm)
    tl.store(base_p + ((blk4 + 3) % 4) * 16, t1.to(ty), mask=rowm)
    tl.store(base_p + ((blk4 + 2) % 4) * 16, t2.to(ty), mask=rowm)
    tl.store(base_p + ((blk4 + 1) % 4) * 16, t3.to(ty), mask=rowm)


@triton.jit
def _diagonals_and_inverse(a, F32: tl.constexpr):
    """v2 / v3's start of the block substitution: the block diagonals of A as [4, 16, 16] (row block i holds
    A_{i,i-1}, A_{i,i-2}, A_{i,i-3}) and D_i = (I + A_ii)^-1 = T_ii."""
    a4 = tl.reshape(a, [4, 16, 4, 16])
    return (_blocks_at(a4, 1), _blocks_at(a4, 2), _blocks_at(a4, 3),
            _inv_unit_lower16(_blocks_at(a4, 0), F32))


@triton.jit
def kkt_solve_v2_kernel(
    k_ptr, g_ptr, beta_ptr,                   # k [T_tot, H, K], g/beta [T_tot, HV]
    gcum_ptr, tinv_ptr,                       # gcum fp32 [T_tot, HV], tinv [T_tot, HV, BT] (fp32 or k's dtype)
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Stage 2a's default kernel in round 16 (LINATTN_GDN_KKT=v2 since v3 took over in round 17): the same signature,
    grid, gcum (the same code) and A, with Tinv = (I + A)^-1 by block substitution over the four 16-row blocks on
    [4, 16, 16] batched tensors (row block i in warp i, as the K K^T WGMMA accumulator already holds it) instead of
    kkt_solve_kernel's four [64, 64] products, whose operands each went through 16 KB of shared memory.
    From Tinv (I + A) = I, with D_i = (I + A_ii)^-1 and T_ij the 16x16 blocks of Tinv (i > j):
        T_ij = -(sum_{j < m <= i} T_im A_mj) D_j
    by diagonals s = i - j (T_ii = D_i):
        T_{i,i-1} = -D_i A_{i,i-1} D_{i-1}
        T_{i,i-2} = -(T_{i,i-1} A_{i-1,i-2} + D_i A_{i,i-2}) D_{i-2}
        T_{i,i-3} = -(T_{i,i-1} A_{i-1,i-3} + T_{i,i-2} A_{i-2,i-3} + D_i A_{i,i-3}) D_{i-3}
    Everything on the left stays in warp i; what comes from other row blocks (D_{i-s}, A_{i-1,i-2}, A_{i-2,i-3},
    A_{i-1,i-3}) depends only on A and D, so six 4 KB gathers move it before the products, with no chain of
    cross-warp steps. The batched products are mma.sync at DOT_PREC with warp-local (shuffle) operand conversions.
    Diagonal s holds T_{i,i-s} for i >= s and exact zeros for i < s, which are the upper blocks (i, i - s + 4):
    the four diagonals stored at column block (i - s) mod 4 write all of Tinv. Rounding differs from
    kkt_solve_kernel (tests/test_kkt_solve_v2.py compares both against an fp64 inverse)."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    t0, eos, r, m, a = _chunk_a(k_ptr, g_ptr, beta_ptr, gcum_ptr, cu_ptr, n, c, hv, H, HV, K, BT, BK, DOT_PREC)

    F32: tl.constexpr = DOT_PREC
    a1, a2, a3, d = _diagonals_and_inverse(a, F32)
    # E_s[i] = A_{i,i-s} D_{i-s}; T_{i,i-s} = -(sum_{0 < u < s} T_{i,i-u} E_{s-u}[i-u] + D_i E_s[i])
    e1 = tl.dot(a1, _from_block_above(d, 1), input_precision=F32)
    e2 = tl.dot(a2, _from_block_above(d, 2), input_precision=F32)
    e3 = tl.dot(a3, _from_block_above(d, 3), input_precision=F32)
    t1 = -tl.dot(d, e1, input_precision=F32)
    t2 = -tl.dot(d, e2, acc=tl.dot(t1, _from_block_above(e1, 1), input_precision=F32), input_precision=F32)
    t3 = tl.dot(t1, _from_block_above(e2, 1), input_precision=F32)
    t3 = -tl.dot(d, e3, acc=tl.dot(t2, _from_block_above(e1, 2), acc=t3, input_precision=F32), input_precision=F32)

    _store_diagonals(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)


def kkt_solve_v2(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan: ChunkPlan, HV: int,
                 gcum: Optional[torch.Tensor] = None, tinv: Optional[torch.Tensor] = None,
                 dot_prec: Optional[str] = None):
    """Stage 2a as kkt_solve_v2_kernel alone (the forward launches it through kkt_kernel()), one program per (chunk slot, value
    head) like kkt_solve_kernel, returning (gcum fp32 [T_tot, HV], Tinv [T_tot, HV, 64]) as gluon/chunk_fused_wu_ws.py
    kkt_solve does (same frozen config: split_intra_config(K, K).BK_kkt / warps_kkt; DOT_PREC ieee for fp32 k, else
    tf32). gcum is bit-equal to kkt_solve_kernel's, Tinv agrees to rounding. gcum / tinv may be given (tinv fp32 for
    the backward's store_tinv, else k's dtype); they are allocated otherwise."""
    return _launch_kkt_variant(kkt_solve_v2_kernel, "kkt_solve_v2", k, g, beta, plan, HV, gcum, tinv, dot_prec)



@triton.jit
def _blocks_to_all_warps(x):
    """x [4, 16, 16] (row block j in warp j) -> [4 (row block i), 4 (j), 16, 16] with [i, j] = x[j]: x broadcast over
    a new leading axis. Triton lays the result out with i and j in registers and the 16 rows over the warps, so this
    is one cross-warp move of x through shared memory (4 KB stored, the blocks the selects use loaded back), after
    which every _select_above of it is in-thread."""
    return tl.broadcast_to(tl.expand_dims(x, 0), [4, 4, 16, 16])


@triton.jit
def _select_above(xa, s: tl.constexpr):
    """From _blocks_to_all_warps(x): y[i] = x[i - s] over the row-block axis, exact zeros where i < s (callers only
    multiply those with zero blocks, as with _from_block_above's x[0])."""
    i = tl.arange(0, 4)[:, None, None, None]
    j = tl.arange(0, 4)[None, :, None, None]
    return tl.sum(tl.where(j == i - s, xa, 0.), axis=1)


@triton.jit
def _tinv_by_substitution(k_ptr, g_ptr, beta_ptr, gcum_ptr, tinv_ptr, cu_ptr, chunk_idx_ptr, N, p, hv,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          DOT_PREC: tl.constexpr, LOWP: tl.constexpr, LD: tl.constexpr,
                          EARLY_K: tl.constexpr = False):
    """The program of kkt_solve_v3_kernel (LOWP = LD = False) and kkt_solve_v4_kernel for chunk slot p and value head
    hv: _chunk_a (gcum stored, the gated A), then v2's block recurrence
        E_s[i] = A_{i,i-s} D_{i-s};  T_{i,i-s} = -(sum_{0 < u < s} T_{i,i-u} E_{s-u}[i-u] + D_i E_s[i])
    with each moved tensor broadcast to every warp once and its shifted copies selected in registers (each
    broadcast's selects taken right after it: 85 registers in v3; selecting at the products' operands, 99), then the
    four block diagonals stored. LOWP: bf16 operands for the off-diagonal products and the broadcasts; LD: for the
    diagonal 16x16 inverses too; DOT_PREC (TF32 / IEEE) otherwise."""
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n < N:                                  # else a surplus slot of the varlen bound
        t0, eos, r, m, a = _chunk_a(k_ptr, g_ptr, beta_ptr, gcum_ptr, cu_ptr, n, c, hv, H, HV, K, BT, BK, DOT_PREC,
                                    EARLY_K)

        F32: tl.constexpr = DOT_PREC
        a4 = tl.reshape(a, [4, 16, 4, 16])
        a1 = _blocks_at(a4, 1)
        a2 = _blocks_at(a4, 2)
        a3 = _blocks_at(a4, 3)
        d = _inv_unit_lower16(_blocks_at(a4, 0), F32, LD)
        if LOWP:                                   # the moved blocks travel as the products' bf16 operands
            da = _blocks_to_all_warps(d.to(tl.bfloat16))
        else:
            da = _blocks_to_all_warps(d)
        d1 = _select_above(da, 1)                 # D_{i-1}
        d2 = _select_above(da, 2)
        d3 = _select_above(da, 3)
        e1 = _dot_op(a1, d1, F32, LOWP)
        e2 = _dot_op(a2, d2, F32, LOWP)
        e3 = _dot_op(a3, d3, F32, LOWP)
        t1 = -_dot_op(d, e1, F32, LOWP)
        if LOWP:
            e1a = _blocks_to_all_warps(e1.to(tl.bfloat16))
            e2a = _blocks_to_all_warps(e2.to(tl.bfloat16))
        else:
            e1a = _blocks_to_all_warps(e1)
            e2a = _blocks_to_all_warps(e2)
        e11 = _select_above(e1a, 1)               # E_1[i-1]
        e12 = _select_above(e1a, 2)               # E_1[i-2]
        e21 = _select_above(e2a, 1)               # E_2[i-1]
        t2 = -_dot_op(d, e2, F32, LOWP, acc=_dot_op(t1, e11, F32, LOWP))
        t3 = _dot_op(t1, e21, F32, LOWP)
        t3 = -_dot_op(d, e3, F32, LOWP, acc=_dot_op(t2, e12, F32, LOWP, acc=t3))
        _store_diagonals(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)


@triton.jit
def kkt_solve_v3_kernel(
    k_ptr, g_ptr, beta_ptr,                   # k [T_tot, H, K], g/beta [T_tot, HV]
    gcum_ptr, tinv_ptr,                       # gcum fp32 [T_tot, HV], tinv [T_tot, HV, BT] (fp32 or k's dtype)
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Stage 2a's default kernel since round 17 (kkt_solve_v3 below): kkt_solve_v2_kernel's block substitution, the same
    products in the same order at the same precision, with its cross-warp moves done differently. v2 moves D_{i-s} and
    E_s[i-u] to row block i with six tl.gather calls; each goes mma layout -> the gather's layout through shared memory,
    a warp-shuffle gather, then shared memory again in an unswizzled layout (row-block dimension fastest) whose TF32
    B-operand loads are 4-way bank conflicts (the lanes of one k row are 64 words apart). Here each moved tensor (d, e1,
    e2) is broadcast to every warp once (_blocks_to_all_warps) and the shifted copies are in-register selects
    (_select_above), which reach their product through the swizzled layout Triton picks for a dot operand (conflict-free
    for the same loads). For i < s the select gives exact zeros where v2's clamped gather gave x[0]; both only meet zero
    blocks of A, so Tinv is bit-equal to v2's (tests/test_kkt_solve_v3.py).
    sm_90a PTX per program against v2 (benchmarks/KKT_SOLVE.md, "v2 after round 16"; bank conflicts simulated from
    the PTX addresses by benchmarks/ptx_shared_traffic.py): L1/shared wavefronts 2400 -> 1608 (shared 1496 -> 896,
    of which v2's conflicts 576 -> 0; shuffles 904 -> 712); 85 registers (v2 95), 0 spill, 16 KB shared, so 5 CTAs
    per SM as v2. H200, round 16 (benchmarks/RESULTS.md part E): 0.441 ms against v2's 0.524 at B1 T65536, Tinv
    bit-equal to v2's; round 17: Gluon and Triton forward gates green with it, the default since then."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    _tinv_by_substitution(k_ptr, g_ptr, beta_ptr, gcum_ptr, tinv_ptr, cu_ptr, chunk_idx_ptr, N,
                          tl.program_id(0), tl.program_id(1),
                          H, HV, K, BT, BK, DOT_PREC, False, False)


@triton.jit
def kkt_solve_v4_kernel(
    k_ptr, g_ptr, beta_ptr,                   # k [T_tot, H, K], g/beta [T_tot, HV]
    gcum_ptr, tinv_ptr,                       # gcum fp32 [T_tot, HV], tinv [T_tot, HV, BT] (fp32 or k's dtype)
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, LOWP_DIAG: tl.constexpr = True, HEADS_FAST: tl.constexpr = False,
    EARLY_K: tl.constexpr = False,
):
    """Stage 2a's default kernel since round 20 (LINATTN_GDN_KKT=v3 restores v3): kkt_solve_v3_kernel with bf16
    operands for the inverse's products where Tinv is stored in bf16 (the forward; its consumers multiply Tinv at
    bf16), and exactly v3 elsewhere (fp32 Tinv for the backward's recompute, fp16 Tinv): the same signature, grid,
    gcum and K K^T. v3's shuffles (712 per program, 44% of its L1/shared wavefronts, benchmarks/KKT_SOLVE.md) are
    the fp32 accumulator -> TF32 operand conversions; for bf16 operands mma.sync takes the accumulator's registers
    as they are, and the broadcasts move half the bytes. LOWP_DIAG=False keeps the diagonal 16x16 inverses at
    DOT_PREC (bf16 only for the off-diagonal products). HEADS_FAST=True numbers the programs head-fastest (see
    below; same outputs): the launches pass it from KKT_HEADS_FAST_SLOTS chunk slots on (kkt_order). EARLY_K=True
    issues the loads of g, beta and the k tile before gam's cumsum (_chunk_a; same outputs; kkt_order passes it by
    default since round 21: stage 2a 1.08x on the H200, 72 registers without HEADS_FAST). Rounding: each
    product's operands at bf16 (2^-9) instead of TF32 (2^-11); Tinv is then stored at bf16 anyway
    (tests/test_kkt_solve_v4.py measures both against the fp64 inverse and the forward against fp64). H200, round 20
    (benchmarks/RESULTS.md, benchmarks/gpu/kkt_v4_round.py): 0.442 -> 0.371 ms at B1 T65536 and 0.215 -> 0.160 ms at
    B8 T4096 against v3 (v4o 0.373 / 0.181; 0.317 ms at B1 T65536 with HEADS_FAST), bf16 Tinv error vs fp64
    1.2-1.4x v3's, fp32 Tinv bit-equal to v3's; sm_90a 78 registers, 0 spill."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    LOWP: tl.constexpr = tinv_ptr.dtype.element_ty == tl.bfloat16
    LD: tl.constexpr = LOWP and LOWP_DIAG
    if HEADS_FAST:
        # the same (slot, head) pairs on the same (slots, HV) grid, renumbered so that consecutive programs (the
        # order CTAs are dispatched in) take the HV heads of one chunk: the value heads of a key head read one k tile
        # while it is in L2, and the heads' g / beta / gcum words share their sectors
        lin = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        p = lin // HV
        hv = lin % HV
    else:
        p = tl.program_id(0)
        hv = tl.program_id(1)
    _tinv_by_substitution(k_ptr, g_ptr, beta_ptr, gcum_ptr, tinv_ptr, cu_ptr, chunk_idx_ptr, N, p, hv,
                          H, HV, K, BT, BK, DOT_PREC, LOWP, LD, EARLY_K and K <= BK)


def kkt_solve_v3(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan: ChunkPlan, HV: int,
                 gcum: Optional[torch.Tensor] = None, tinv: Optional[torch.Tensor] = None,
                 dot_prec: Optional[str] = None):
    """Stage 2a as kkt_solve_v3_kernel, launched as kkt_solve_v2 launches v2 (same config and outputs); gcum bit-equal
    to kkt_solve_kernel's, Tinv bit-equal to kkt_solve_v2's."""
    return _launch_kkt_variant(kkt_solve_v3_kernel, "kkt_solve_v3", k, g, beta, plan, HV, gcum, tinv, dot_prec)


def _launch_kkt_variant(kernel, name: str, k, g, beta, plan: ChunkPlan, HV: int, gcum, tinv, dot_prec,
                        per_key_head: bool = False):
    """One launch of a stage-2a kernel with kkt_solve_kernel's signature at its frozen config (split_intra_config's
    BK_kkt / warps_kkt; DOT_PREC ieee for fp32 k, else tf32) on a grid (chunk slots, HV), or (chunk slots, H) with
    per_key_head; gcum fp32 and Tinv (k's dtype) allocated when not given. Returns (gcum, tinv)."""
    H, K = k.shape[-2], k.shape[-1]
    if HV % H:
        raise ValueError(f"{name}: HV={HV} is not a multiple of H={H}")
    cfg = split_intra_config(K, K)
    if gcum is None:
        gcum = empty(plan.T_total, HV, dtype=torch.float32, device=k.device)
    if tinv is None:
        tinv = empty(plan.T_total, HV, CHUNK, dtype=k.dtype, device=k.device)
    if dot_prec is None:
        dot_prec = "ieee" if k.dtype == torch.float32 else "tf32"
    kernel[(plan.num_slots, H if per_key_head else HV)](
        k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N,
        H=H, HV=HV, K=K, BT=CHUNK, BK=cfg.BK_kkt, DOT_PREC=dot_prec, num_warps=cfg.warps_kkt)
    return gcum, tinv
