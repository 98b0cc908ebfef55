"""Stage 2 of the forward (gdn-math.md, "The chunk form") as two kernels, per chunk and value head:

    gam  = cumsum(g)                                 (stored as gcum: every later stage reads it)
    A    = strict_lower( diag(beta) K K^T * exp(gam_i - gam_j) )
    Tinv = (I + A)^-1
    W    = Tinv diag(beta exp(gam)) K,   U = Tinv diag(beta) V

  kkt_solve_kernel  one program per (chunk slot, value head): gam, K K^T as one [64, K] x [K, 64] product, A, and
                    Tinv by block substitution over the four 16-row blocks (_tinv_by_substitution). Stores Tinv
                    [T_tot, HV, 64]: fp32 when the caller keeps it for the backward (store_tinv; backward_wy.py reads
                    it in fp32), else in k's dtype, the precision wu_kernel multiplies it at.
  wu_kernel         one program per (chunk slot, value head): W and U as [64, 64] x [64, BK | BV] products.

Two kernels that each keep few registers live do their big products as [64, *] tiles, which Triton lowers to WGMMA
on Hopper: stage 2 1.32-1.47x faster than one kernel doing all of it (benchmarks/HISTORY.md).

Precision: the inverse's products run with bf16 operands where Tinv is stored in bf16 (the forward: its consumers
multiply Tinv at bf16 anyway; faster than TF32 products, benchmarks/RESULTS.md), else at DOT_PREC (TF32 for 16-bit
inputs, IEEE for fp32), which is what the backward's fp32 Tinv gets.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan
from linattn.ops.gated_delta_rule.triton.common import chunk_span, load_tile, slot_chunk, softplus, store_tile
from linattn.ops.gated_delta_rule.triton.host import launches
from linattn.runtime.alloc import empty
from linattn.runtime.host_path import next_power_of_2

CHUNK = 64


@triton.jit
def _dot_op(a, b, PREC: tl.constexpr, LOWP: tl.constexpr = False, acc=None):
    """acc + a @ b in fp32 (acc None: a @ b): TF32 / IEEE at PREC, or with bf16 operands when LOWP (for mma.sync the
    fp32 accumulator's registers are already a bf16 A operand's, so no shuffles convert it)."""
    if LOWP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc=acc)
    else:
        return tl.dot(a, b, acc=acc, input_precision=PREC)


@triton.jit
def _inv_unit_lower16(n, PREC: tl.constexpr, LOWP: tl.constexpr = False):
    """(I + n)^-1 for a strictly lower triangular 16x16 n: (I - n)(I + n^2)(I + n^4)(I + n^8), products by _dot_op."""
    r = tl.arange(0, 16)
    eye = tl.where(r[:, None] == r[None, :], 1., 0.)
    n2 = _dot_op(n, n, PREC, LOWP)
    n4 = _dot_op(n2, n2, PREC, LOWP)
    n8 = _dot_op(n4, n4, PREC, LOWP)
    x = _dot_op(eye - n, eye + n2, PREC, LOWP)
    x = _dot_op(x, eye + n4, PREC, LOWP)
    return _dot_op(x, eye + n8, PREC, LOWP)


@triton.jit
def _chunk_gates(g_ptr, beta_ptr, gcum_ptr, r, m, hv, HV: tl.constexpr, BT: tl.constexpr,
                 A_log_ptr, dt_bias_ptr, beta_out_ptr, GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                 BETA_SCALE: tl.constexpr):
    """gam (also stored as gcum) and beta of one chunk's rows r (mask m) for value head hv. gam: a cumsum inside each
    16-row block plus the sum of the earlier blocks (_gam_of); FLA's options applied to the loaded rows first."""
    g_rows = _gate_rows(tl.load(g_ptr + r * HV + hv, mask=m, other=0.), m, A_log_ptr, dt_bias_ptr, hv,
                        GATE_IN_KERNEL, HAS_DT_BIAS)
    gam = _gam_of(g_rows, BT)
    tl.store(gcum_ptr + r * HV + hv, gam, mask=m)
    beta = _beta_rows(tl.load(beta_ptr + r * HV + hv, mask=m, other=0.), r, m, hv, beta_out_ptr, HV, BETA_SCALE)
    return gam, beta


@triton.jit
def _gate_rows(g_rows, m, A_log_ptr, dt_bias_ptr, hv, GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """The log decay of the loaded g rows: g itself, or with GATE_IN_KERNEL (FLA's use_gate_in_kernel, g the raw gate
    input) -exp(A_log[hv]) * softplus(g + dt_bias[hv]) in fp32, zero on rows past the chunk's end (mask m)."""
    if GATE_IN_KERNEL:
        x = g_rows.to(tl.float32)
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias_ptr + hv).to(tl.float32)
        g_rows = tl.where(m, -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32)) * softplus(x), 0.)
    return g_rows


@triton.jit
def _beta_rows(b_rows, r, m, hv, beta_out_ptr, HV: tl.constexpr, BETA_SCALE: tl.constexpr):
    """beta of the loaded rows in fp32: as given (BETA_SCALE 0), or FLA's use_beta_sigmoid_in_kernel, BETA_SCALE *
    sigmoid(beta) (2 with allow_neg_eigval), zero past the chunk's end. The activated beta is also stored to
    beta_out [T_tot, HV] fp32: wu_kernel and the backward's WY stage read it from there instead of applying the
    sigmoid again (this kernel is the first of the stages that read beta)."""
    beta = b_rows.to(tl.float32)
    if BETA_SCALE != 0:
        beta = tl.where(m, BETA_SCALE * tl.sigmoid(beta), 0.)
        tl.store(beta_out_ptr + r * HV + hv, beta, mask=m)
    return beta


@triton.jit
def _gam_of(g_rows, BT: tl.constexpr):
    """gam = cumsum(g) over one chunk's loaded g rows: a cumsum inside each 16-row block plus the sum of the earlier
    blocks."""
    g = tl.reshape(g_rows.to(tl.float32), [4, 16])
    sums = tl.sum(g, axis=1)
    b = tl.arange(0, 4)
    base = tl.sum(tl.where(b[None, :] < b[:, None], sums[None, :], 0.), axis=1)
    return tl.reshape(tl.cumsum(g, axis=1) + base[:, None], [BT])


@triton.jit
def _k_block(k_ptr, t0, eos, hk, kb, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The [BT, BK] block kb of one chunk's keys (key head hk); rows past the sequence end load as zeros."""
    return load_tile(k_ptr + t0 * H * K + hk * K, 0, kb * BK, eos - t0, K, H * K, BT, BK)


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
             EARLY_K: tl.constexpr, A_log_ptr, dt_bias_ptr, beta_out_ptr, GATE_IN_KERNEL: tl.constexpr,
             HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr):
    """The per-value-head prologue of kkt_solve_kernel for chunk c of sequence n: the chunk's span, its gates (gcum
    stored) and the gated A. Returns (t0, eos, r, m, a): r the chunk's token rows, m = r < eos. EARLY_K (K <= BK: one
    k tile): g, beta and the k tile are loaded before gam's cumsum, so the three loads are in flight together instead
    of k's being issued after the cumsum has waited for g (two dependent DRAM round trips per program). The same
    operations on the same values either way, so the same gcum and A bit for bit. GATE_IN_KERNEL, HAS_DT_BIAS and
    BETA_SCALE: FLA's gate and beta options, applied to the loaded rows before the cumsum (_gate_rows, _beta_rows)."""
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)                       # GVA: the query/key head this value head reads
    r = t0 + tl.arange(0, BT)
    m = r < eos
    if EARLY_K:
        tl.static_assert(K <= BK, "EARLY_K loads the whole k tile at once")
        g_rows = tl.load(g_ptr + r * HV + hv, mask=m, other=0.)
        b_rows = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.)
        b_k = _k_block(k_ptr, t0, eos, hk, 0, H, K, BT, BK)
        beta = _beta_rows(b_rows, r, m, hv, beta_out_ptr, HV, BETA_SCALE)
        gam = _gam_of(_gate_rows(g_rows, m, A_log_ptr, dt_bias_ptr, hv, GATE_IN_KERNEL, HAS_DT_BIAS), BT)
        tl.store(gcum_ptr + r * HV + hv, gam, mask=m)
        kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    else:
        gam, beta = _chunk_gates(g_ptr, beta_ptr, gcum_ptr, r, m, hv, HV, BT, A_log_ptr, dt_bias_ptr, beta_out_ptr,
                                 GATE_IN_KERNEL, HAS_DT_BIAS, BETA_SCALE)
        kk = _chunk_kkt(k_ptr, t0, eos, hk, H, K, BT, BK, DOT_PREC)
    a = _gated_a(kk, gam, beta, BT)
    return t0, eos, r, m, a


@triton.jit
def _blocks_at(a4, s: tl.constexpr):
    """From A viewed as [4 row blocks, 16, 4 column blocks, 16]: the blocks A_{i, i-s} as a [4, 16, 16] tensor
    (row block i; zero where i < s). In the WGMMA accumulator layout a thread holds all four column blocks of its
    rows, so this sum is in-thread."""
    rb = tl.arange(0, 4)[:, None, None, None]
    cb = tl.arange(0, 4)[None, None, :, None]
    return tl.sum(tl.where(cb == rb - s, a4, 0.), axis=2)


@triton.jit
def store_tinv_blocks(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV: tl.constexpr, BT: tl.constexpr):
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
def _blocks_to_all_warps(x):
    """x [4, 16, 16] (row block j in warp j) -> [4 (row block i), 4 (j), 16, 16] with [i, j] = x[j]: x broadcast over
    a new leading axis. Triton lays the result out with i and j in registers and the 16 rows over the warps, so this
    is one cross-warp move of x through shared memory (4 KB stored, the blocks the selects use loaded back), after
    which every _select_above of it is in-thread."""
    return tl.broadcast_to(tl.expand_dims(x, 0), [4, 4, 16, 16])


@triton.jit
def _select_above(xa, s: tl.constexpr):
    """From _blocks_to_all_warps(x): y[i] = x[i - s] over the row-block axis, exact zeros where i < s (callers only
    multiply those with zero blocks of A)."""
    i = tl.arange(0, 4)[:, None, None, None]
    j = tl.arange(0, 4)[None, :, None, None]
    return tl.sum(tl.where(j == i - s, xa, 0.), axis=1)


@triton.jit
def _tinv_by_substitution(k_ptr, g_ptr, beta_ptr, gcum_ptr, tinv_ptr, tinv16_ptr, cu_ptr, chunk_idx_ptr, N, p, hv,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          DOT_PREC: tl.constexpr, LOWP: tl.constexpr, EARLY_K: tl.constexpr,
                          A_log_ptr, dt_bias_ptr, beta_out_ptr, GATE_IN_KERNEL: tl.constexpr,
                          HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr):
    """The program of kkt_solve_kernel for chunk slot p and value head hv: _chunk_a (gcum stored, the gated A), then
    Tinv = (I + A)^-1 (tinv_blocks) stored, to tinv16_ptr too where it is not None."""
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n < N:                                  # else a surplus slot of the varlen bound
        t0, eos, r, m, a = _chunk_a(k_ptr, g_ptr, beta_ptr, gcum_ptr, cu_ptr, n, c, hv, H, HV, K, BT, BK, DOT_PREC,
                                    EARLY_K, A_log_ptr, dt_bias_ptr, beta_out_ptr, GATE_IN_KERNEL, HAS_DT_BIAS,
                                    BETA_SCALE)
        d, t1, t2, t3 = tinv_blocks(a, DOT_PREC, LOWP)
        store_tinv_blocks(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)
        if tinv16_ptr is not None:
            store_tinv_blocks(tinv16_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)


@triton.jit
def tinv_blocks(a, F32: tl.constexpr, LOWP: tl.constexpr):
    """Tinv = (I + A)^-1 of a strictly lower [64, 64] A by block substitution over the four 16-row blocks; returns
    its four block diagonals (d = T_ii, t1 = T_{i,i-1}, t2, t3 as [4, 16, 16], row block i) for store_tinv_blocks.
    From Tinv (I + A) = I, with D_i = (I + A_ii)^-1 and T_ij the 16x16 blocks of Tinv (i > j), by block diagonals
    s = i - j (T_ii = D_i):
        E_s[i] = A_{i,i-s} D_{i-s};  T_{i,i-s} = -(sum_{0 < u < s} T_{i,i-u} E_{s-u}[i-u] + D_i E_s[i])
    on [4, 16, 16] batched tensors (row block i in warp i, as the K K^T WGMMA accumulator holds it). What comes from
    other row blocks (D_{i-s}, E_s[i-u]) is broadcast to every warp once and its shifted copies are selected in
    registers (each broadcast's selects taken right after it: fewer live registers than selecting at the products'
    operands). LOWP: bf16 operands for every product of the inverse and for the broadcasts (mma.sync takes the fp32
    accumulator's registers as a bf16 operand as they are: no shuffles, half the bytes moved); F32 (TF32 / IEEE)
    otherwise. Shared by GDN's kkt_solve_kernel and KDA's intra kernel (linattn/ops/kda/triton/intra.py)."""
    a4 = tl.reshape(a, [4, 16, 4, 16])
    a1 = _blocks_at(a4, 1)
    a2 = _blocks_at(a4, 2)
    a3 = _blocks_at(a4, 3)
    d = _inv_unit_lower16(_blocks_at(a4, 0), F32, LOWP)
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
    return d, t1, t2, t3


@triton.jit
def kkt_solve_kernel(
    k_ptr, g_ptr, beta_ptr,                   # k [T_tot, H, K], g/beta [T_tot, HV]
    gcum_ptr, tinv_ptr,                       # gcum fp32 [T_tot, HV], tinv [T_tot, HV, BT] (fp32 or k's dtype)
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, HEADS_FAST: tl.constexpr = False,
    A_log_ptr=None, dt_bias_ptr=None,         # FLA's gate parameters [HV] (GATE_IN_KERNEL; dt_bias with HAS_DT_BIAS)
    beta_out_ptr=None,                        # the activated beta, fp32 [T_tot, HV] (BETA_SCALE != 0)
    tinv16_ptr=None,                          # optional: Tinv again in k's dtype [T_tot, HV, BT] (the gluon
                                              # backward's recompute: fp32 for its WY stage, 16-bit for its chain)
    GATE_IN_KERNEL: tl.constexpr = False, HAS_DT_BIAS: tl.constexpr = False, BETA_SCALE: tl.constexpr = 0,
):
    """Stage 2a, grid (chunk slots, HV): gcum and Tinv (_tinv_by_substitution). The inverse's products take bf16
    operands where Tinv is stored in bf16 (the forward: each product's operands at bf16, 2^-9, instead of TF32, 2^-11;
    Tinv is stored at bf16 anyway), DOT_PREC where it is stored in fp32 (the backward's recompute) or fp16.
    HEADS_FAST=True numbers the programs head-fastest (same outputs): the launches pass it from KKT_HEADS_FAST_SLOTS
    chunk slots on (kkt_order). sm_90a (H16/HV32 K=128 bf16): 0 spill.
    FLA's options (defaults off: the arguments are then None and the code compiled out): GATE_IN_KERNEL, g is the raw
    gate input and the decay -exp(A_log) * softplus(g + dt_bias) is formed before the cumsum, so gcum holds its
    cumsum; BETA_SCALE 1 or 2, beta is a logit and BETA_SCALE * sigmoid(beta) is used and stored to beta_out."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    LOWP: tl.constexpr = tinv_ptr.dtype.element_ty == tl.bfloat16
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
    _tinv_by_substitution(k_ptr, g_ptr, beta_ptr, gcum_ptr, tinv_ptr, tinv16_ptr, cu_ptr, chunk_idx_ptr, N, p, hv,
                          H, HV, K, BT, BK, DOT_PREC, LOWP, K <= BK, A_log_ptr, dt_bias_ptr, beta_out_ptr,
                          GATE_IN_KERNEL, HAS_DT_BIAS, BETA_SCALE)


@triton.jit
def wu_kernel(
    k_ptr, v_ptr, beta_ptr, gcum_ptr, tinv_ptr,   # k [T_tot, H, K], v [T_tot, HV, V], beta/gcum [T_tot, HV], tinv [T_tot, HV, BT]
    w_ptr, u_ptr,                                 # w [T_tot, HV, K], u [T_tot, HV, V] (or None) in k's dtype
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
    DECAY: tl.constexpr = "scalar",
):
    """Stage 2b, grid (chunk slots, HV): W = Tinv diag(beta) (K * exp(gam)) and U = Tinv diag(beta) V. DECAY "scalar":
    gcum [T_tot, HV] (GDN); "channel": gcum [T_tot, HV, K], a decay per key channel (KDA, whose beta here is the
    effective beta its intra kernel stored). u_ptr None: W only (the gluon backward's recompute, whose chain forms
    Vnew without U)."""
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
    if DECAY == "scalar":
        gam = tl.load(gcum_ptr + r * HV + hv, mask=m, other=0.)
    beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    # Tinv rounded to the operand dtype (rows past the end load as zeros)
    tinv = tl.load(tinv_ptr + (r * HV + hv)[:, None] * BT + i[None, :], mask=m[:, None], other=0.).to(op)

    if DECAY == "scalar":
        bg = beta * tl.exp(gam)
    for kb in range(0, tl.cdiv(K, BK)):
        b_k = load_tile(k_ptr + t0 * H * K + hk * K, 0, kb * BK, eos - t0, K, H * K, BT, BK)
        if DECAY == "scalar":
            ks = (b_k.to(tl.float32) * bg[:, None]).to(op)
        else:
            ck = kb * BK + tl.arange(0, BK)
            gk = tl.load(gcum_ptr + (r * HV + hv)[:, None] * K + ck[None, :], mask=m[:, None] & (ck < K)[None, :],
                         other=0.)
            ks = (b_k.to(tl.float32) * (beta[:, None] * tl.exp(gk))).to(op)
        store_tile(w_ptr + t0 * HV * K + hv * K, tl.dot(tinv, ks, input_precision=DOT_PREC).to(op), 0, kb * BK,
                   eos - t0, K, HV * K)
    if u_ptr is not None:
        u_tiles(v_ptr, u_ptr, tinv, beta, t0, eos, hv, HV, V, BT, BV, DOT_PREC)


@triton.jit
def u_tiles(v_ptr, u_ptr, tinv, beta, t0, eos, hv, HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
            BV: tl.constexpr, DOT_PREC: tl.constexpr):
    """U = Tinv diag(beta) V of the chunk at token t0, stored in BV-column tiles (tinv [BT, BT] in the operand dtype,
    beta [BT] fp32, 0 on rows past eos)."""
    op = tinv.dtype
    for vb in range(0, tl.cdiv(V, BV)):
        b_v = load_tile(v_ptr + t0 * HV * V + hv * V, 0, vb * BV, eos - t0, V, HV * V, BT, BV)
        vs = (b_v.to(tl.float32) * beta[:, None]).to(op)
        store_tile(u_ptr + t0 * HV * V + hv * V, tl.dot(tinv, vs, input_precision=DOT_PREC).to(op), 0, vb * BV,
                   eos - t0, V, HV * V)


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
    kkt_solve_kernel with K K^T in one K block of 128 (one k tile: its loads issued with the gates', EARLY_K); wu
    with W and U in 64-column blocks: 92 registers (BK = BV = 128: 126, fp32 Tinv 162), so memory traffic from up to
    5 CTAs per SM."""
    return SplitIntraConfig(BK_kkt=max(16, min(128, next_power_of_2(K))),
                            BK=max(16, min(64, next_power_of_2(K))),
                            BV=max(16, min(64, next_power_of_2(V))), warps_kkt=4, warps_wu=4)


def fla_gate_args(A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], beta_scale: int,
                  beta_out: Optional[torch.Tensor]) -> tuple:
    """kkt_solve_kernel's keyword arguments for FLA's gate and beta options: (constexprs, pointers), both {} for the
    defaults (the launch is then the default path's, argument for argument)."""
    consts, ptrs = {}, {}
    if A_log is not None:
        consts.update(GATE_IN_KERNEL=True)
        ptrs.update(A_log_ptr=A_log)
        if dt_bias is not None:
            consts.update(HAS_DT_BIAS=True)
            ptrs.update(dt_bias_ptr=dt_bias)
    if beta_scale:
        consts.update(BETA_SCALE=beta_scale)
        ptrs.update(beta_out_ptr=beta_out)
    return consts, ptrs


def intra_split(k, v, g, beta, gcum, w, u, tinv: Optional[torch.Tensor], plan: ChunkPlan, *, H: int, HV: int,
                K: int, V: int, dot_prec: str, A_log: Optional[torch.Tensor] = None,
                dt_bias: Optional[torch.Tensor] = None, beta_scale: int = 0,
                beta_out: Optional[torch.Tensor] = None) -> None:
    """Fills gcum, w, u (and tinv, fp32 [T_tot, HV, 64], when given). Without tinv, Tinv goes from kkt_solve_kernel
    to wu_kernel through a buffer in k's dtype. A_log / dt_bias ([HV], FLA's use_gate_in_kernel: g is the raw gate
    input) and beta_scale (1 or 2, FLA's use_beta_sigmoid_in_kernel: beta is a logit) are applied by
    kkt_solve_kernel; with beta_scale it writes the activated beta to beta_out (fp32 [T_tot, HV]), which wu_kernel
    then reads."""
    cfg = split_intra_config(K, V)
    if tinv is None:
        tinv = empty(plan.T_total, HV, CHUNK, dtype=k.dtype, device=k.device)
    grid = (plan.num_slots, HV)
    gate, gate_tensors = fla_gate_args(A_log, dt_bias, beta_scale, beta_out)
    launches(kkt_solve_kernel, grid, (k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N),
             dict(H=H, HV=HV, K=K, BT=CHUNK, BK=cfg.BK_kkt, DOT_PREC=dot_prec, num_warps=cfg.warps_kkt,
                  **kkt_order(plan.num_slots), **gate), tensors=gate_tensors or None)
    launches(wu_kernel, grid, (k, v, beta_out if beta_scale else beta, gcum, tinv, w, u, plan.cu, plan.chunk_indices,
                               plan.N),
             dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, BV=cfg.BV, DOT_PREC=dot_prec, num_warps=cfg.warps_wu))


# chunk slots from which kkt_solve_kernel numbers its programs head-fastest (HEADS_FAST). In the default order the
# two value heads of a key head read the same k tile num_slots programs apart (~24 KB of traffic each): H200
# (benchmarks/RESULTS.md): head-fastest 1.17x at 1024 slots (B1 T65536) and 1.11x at 957 (the varlen row), 0.992x at
# 512 (B8 T4096) and 0.97x at 128 (B1 T8192); the threshold sits between the two sides that were measured
KKT_HEADS_FAST_SLOTS = 768


def kkt_order(num_slots: int) -> dict:
    """The schedule argument of a kkt_solve_kernel launch: HEADS_FAST on grids of at least KKT_HEADS_FAST_SLOTS chunk
    slots. It changes no output bit."""
    return {"HEADS_FAST": True} if num_slots >= KKT_HEADS_FAST_SLOTS else {}
