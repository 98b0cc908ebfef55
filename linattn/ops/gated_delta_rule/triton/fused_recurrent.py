"""Gated DeltaNet decode: the step-by-step recurrence (shared/gdn-math.md, "The recurrence") fused over the T
tokens of each sequence, for serving (T = 1 decode, a few tokens for speculative decoding).

One program owns one (sequence, value head, V-block): the state block S[:, v0:v0+BV] ([BK, BV], fp32) lives in
registers for the whole call, so the state is read once and written once per call whatever T is. That state
traffic is the whole cost at large batch (q, k, v, g, beta are a few hundred bytes per head), so the launch
config below is about bandwidth: contiguous 16-byte (or wider) accesses along V, about 32 fp32 state elements
per thread so each thread has several vector loads in flight, and V split across programs so that a small batch
still fills every SM.

Serving mode: `state_indices[n]` names the pool slot of sequence n. A negative index, or one >= num_slots, is
a padded row: the program computes nothing that reaches memory except zeros in its output rows (and in its rows
of an out-of-place final state); it never touches the pool. The check is done here, in the kernel, so the host
never reads the indices (no synchronisation, CUDA-graph safe).
"""
import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from linattn.runtime.alloc import empty
from linattn.runtime.device import device_facts

# Programmatic dependent launch (PDL, sm_90+): Triton 3.6 has griddepcontrol as triton.language.extra.cuda's
# gdc_wait / gdc_launch_dependents and the `launch_pdl` launch option. Detected, not assumed: a Triton without them
# runs the kernels without PDL (pdl_refusal says why).
try:
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:                                    # pragma: no cover - a Triton without GDC
    _gdc_wait = _gdc_launch_dependents = None


def _triton_has_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:                                # pragma: no cover
        return False
    import dataclasses
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """PDL: wait until the grids this launch depends on (the stream's previous kernel) have completed and their
    writes are visible, before the first global access; then let the stream's next kernel be scheduled as soon as
    every program has passed this point (its programs take an SM only where one of ours has exited, and wait in
    their own _pdl_enter). Without PDL (constexpr False) nothing is emitted."""
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()

@triton.jit
def _gate_params(A_log, dt_bias, i_hv, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """-exp(A_log) and dt_bias of value head i_hv for the fused Qwen3-Next gate (zeros when unused)."""
    b_neg_a = 0.0
    b_dt = 0.0
    if FUSED_GATE:
        b_neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
    return b_neg_a, b_dt


@triton.jit
def _decode_token_prep(b_h, b_q, b_k, b_beta, b_g, b_neg_a, b_dt, scale,
                       USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                       BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr):
    """The token's inputs as the recurrence uses them (q, k normalised if asked, q scaled, beta and the gate
    formed) and the decayed state exp(g) S: (state, q, k, beta)."""
    if QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale
    if BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
    if USE_G:
        if FUSED_GATE:
            if HAS_DT_BIAS:
                b_g = b_g + b_dt
            # Qwen3-Next gate: g_eff = -exp(A_log) * softplus(g + dt_bias), per value head;
            # softplus(x) = max(x, 0) + log(1 + exp(-|x|)): no overflow for large x
            b_g = b_neg_a * (tl.maximum(b_g, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_g))))
        b_h = b_h * tl.exp(b_g)                         # S <- exp(g_t) S
    return b_h, b_q, b_k, b_beta


@triton.jit
def _decode_token(b_h, b_q, b_k, b_v, b_beta, b_g, b_neg_a, b_dt, scale,
                  USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                  BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr):
    """One token of the recurrence on a [BK, BV] fp32 state block: returns (new state, output row)."""
    b_h, b_q, b_k, b_beta = _decode_token_prep(b_h, b_q, b_k, b_beta, b_g, b_neg_a, b_dt, scale, USE_G, FUSED_GATE,
                                               HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM)
    # Both reductions read the decayed state, so they are independent and can overlap:
    #   u = beta (v - S^T k),  S' = S + k u^T,  o = S'^T q = S^T q + u (k . q)
    b_kS = tl.sum(b_h * b_k[:, None], 0)
    b_qS = tl.sum(b_h * b_q[:, None], 0)
    b_u = b_beta * (b_v - b_kS)
    b_o = b_qS + tl.sum(b_q * b_k) * b_u
    b_h = b_h + b_k[:, None] * b_u[None, :]
    return b_h, b_o


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _decode_token_fused_reduce(b_h, b_q, b_k, b_v, b_beta, b_g, b_neg_a, b_dt, scale,
                               USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                               BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr):
    """_decode_token with its three reductions over K (S^T k, S^T q and k . q) as one three-operand reduction:
    one cross-warp exchange through shared memory instead of three (fused_reduce, opt-in). k . q enters as a
    [BK, BV] broadcast whose columns are all equal; the state update is the same arithmetic as _decode_token's."""
    b_h, b_q, b_k, b_beta = _decode_token_prep(b_h, b_q, b_k, b_beta, b_g, b_neg_a, b_dt, scale, USE_G, FUSED_GATE,
                                               HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM)
    b_kS, b_qS, b_qk = tl.reduce((b_h * b_k[:, None], b_h * b_q[:, None],
                                  tl.broadcast_to((b_q * b_k)[:, None], b_h.shape)), 0, _add3)
    b_u = b_beta * (b_v - b_kS)
    b_o = b_qS + b_qk * b_u
    b_h = b_h + b_k[:, None] * b_u[None, :]
    return b_h, b_o


@triton.jit
def _state_block(h0, state_indices, i_n, i_hv, i_v, num_slots, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, INDEXED: tl.constexpr,
                 col_keep, EVICT: tl.constexpr, slot_in):
    """The [BK, BV] state block of (sequence i_n, value head i_hv, V-block i_v), loaded as fp32 (zeros without an
    initial state), with what storing it back needs: (block, offsets in the pool, pool mask, full mask, valid,
    column offsets). With state_indices, slot = state_indices[i_n]; a negative or >= num_slots index is a padded
    row (valid False): nothing is read from or written to the pool, so the kernel never addresses outside it.
    col_keep ([BV] booleans, split_tail's half tiles): only those columns are read and, through the returned
    masks, written; None (every other caller) adds nothing to the code. Also returns the slot (int64; 0 for a padded
    row)."""
    o_k = tl.arange(0, BK)
    # BV-contiguous, BV-aligned columns: lets the compiler use 16-byte vector loads and stores along V
    o_v = tl.max_contiguous(tl.multiple_of(i_v * BV + tl.arange(0, BV), BV), BV)
    mask_h = (o_k < K)[:, None] & (o_v < V)[None, :]
    if col_keep is not None:
        mask_h = mask_h & col_keep[None, :]
    if INDEXED:
        if slot_in is None:
            idx = tl.load(state_indices + i_n).to(tl.int64)
        else:
            idx = slot_in                       # reg_prefetch: the index was loaded a tile ahead
        valid = (idx >= 0) & (idx < num_slots)
        slot = tl.where(valid, idx, 0)
        mask_io = mask_h & valid
    else:
        valid = i_n >= 0
        slot = i_n
        mask_io = mask_h
    state_off = (slot * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    if HAS_H0:
        b_h = tl.load(h0 + state_off, mask=mask_io, other=0.0, eviction_policy=EVICT).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    return b_h, state_off, mask_io, mask_h, valid, o_v, slot


@triton.jit
def _discard_state_lines(h0, slot, live, i_hv, i_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr):
    """discard_l2 (opt-in, GPU only): drop the [K, BV] state block's 128-byte lines from the L2 without writing them
    back (PTX `discard.global.L2`, sm_80+) between the block's read and its write-back in place, so that the
    write-back meets no copy of the line in the L2 (as an out-of-place final state does). Sound only because every
    discarded line is then overwritten entirely by this program (the launcher allows the variant in place, for full
    blocks of 128-byte-aligned rows) and nothing else reads it in this call; a discarded line reads as indeterminate
    until written. Skipping a discard is always safe.

    `live` (int32, 0 or 1) predicates the discards. The caller derives it from a value of this tile that arrives
    in shared memory with the state (beta: the pipeliner's copies of a tile are one wait), so the discards cannot
    issue before the block was read; and calls this before the reductions over K, whose cross-warp exchange puts
    CTA barriers between every thread's discards and every thread's stores. Triton offers no primitive for that
    order here (tl.debug_barrier stops the software pipeliner from pipelining the tile loop): the sm_90a AOT test
    checks it in the SASS."""
    ELEM: tl.constexpr = h0.dtype.element_ty.primitive_bitwidth // 8
    LINE: tl.constexpr = 128 // ELEM                  # state elements per 128-byte line
    LPR: tl.constexpr = BV // LINE                    # lines per row of the block
    tl.static_assert(BV % LINE == 0, "discard_l2 needs whole 128-byte lines per block row")
    lines = tl.arange(0, BK * LPR)
    row = lines // LPR
    off = (slot * HV + i_hv) * K * V + i_v * BV + row * V + (lines % LPR) * LINE
    keep = (row < K).to(tl.int32) * live
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p discard.global.L2 [$1], 128;"
                              "\n\tmov.u32 $0, 0;\n\t}", "=r,l,r", [(h0 + off).to(tl.int64), keep],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_o_asm(ptr, val, keep):
    """o_asm (opt-in, GPU only): the output row stored by inline PTX, one st.global per element in whatever layout
    `val` has (the reduction's: no layout conversion, so no shared-memory round trip and no CTA barriers for it).
    Threads holding a replica of an element store the same value to the same address. keep: the store mask."""
    BITS: tl.constexpr = val.dtype.primitive_bitwidth
    if BITS == 16:
        tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t@p st.global.b16 [$1], $2;"
                                  "\n\tmov.u32 $0, 0;\n\t}", "=r,l,h,r",
                                  [ptr.to(tl.int64), val.to(tl.int16, bitcast=True), keep.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.static_assert(BITS == 32, "o_asm stores 16- or 32-bit outputs")
        tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t@p st.global.b32 [$1], $2;"
                                  "\n\tmov.u32 $0, 0;\n\t}", "=r,l,r,r",
                                  [ptr.to(tl.int64), val.to(tl.int32, bitcast=True), keep.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, INPLACE: tl.constexpr, INDEXED: tl.constexpr,
                 STORE_CACHE: tl.constexpr):
    """The updated block back into its pool slot (in place; padded rows write nothing), or into row i_n of the
    out-of-place final state (padded rows get zeros)."""
    if INPLACE:
        tl.store(h0 + state_off, b_h.to(h0.dtype.element_ty), mask=mask_io, cache_modifier=STORE_CACHE)
    else:
        if INDEXED:
            b_h = tl.where(valid, b_h, 0.0)
        o_k = tl.arange(0, BK)
        p_ht = ht + (i_n * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=mask_h, cache_modifier=STORE_CACHE)


@triton.jit(do_not_specialize=["T", "num_slots"])
def fused_recurrent_gdn_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, state_indices,
    scale, T, num_slots,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    QK_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, INPLACE: tl.constexpr,
    IS_VARLEN: tl.constexpr, INDEXED: tl.constexpr, PDL: tl.constexpr = False,
):
    _pdl_enter(PDL)
    # int64 from the start: (slot * HV + head) * K * V overflows int32 for pools above 2^31 elements (8 GiB fp32)
    pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v = pid % NV
    i_nh = pid // NV
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)           # GVA: value head j reads query/key head j // (HV // H)

    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
        seq_len = T

    b_h, state_off, mask_io, mask_h, valid, o_v, _ = _state_block(h0, state_indices, i_n, i_hv, i_v, num_slots, HV, K,
                                                                 V, BK, BV, HAS_H0, INDEXED, None, "", None)
    o_k = tl.arange(0, BK)
    mask_k = o_k < K
    mask_v = o_v < V
    b_neg_a, b_dt = _gate_params(A_log, dt_bias, i_hv, FUSED_GATE, HAS_DT_BIAS)

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    p_beta = beta + bos * HV + i_hv
    if USE_G:
        p_g = g + bos * HV + i_hv
    for _ in range(0, seq_len):
        b_q = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)
        if USE_G:
            b_g = tl.load(p_g).to(tl.float32)
        else:
            b_g = 0.0
        b_h, b_o = _decode_token(b_h, b_q, b_k, b_v, b_beta, b_g, b_neg_a, b_dt, scale, USE_G, FUSED_GATE,
                                 HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM)
        if INDEXED:
            b_o = tl.where(valid, b_o, 0.0)                 # padded rows: zeros, never garbage
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_o += HV * V
        p_beta += HV
        if USE_G:
            p_g += HV

    if STORE_HT:
        _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV, K, V, BK, INPLACE, INDEXED,
                     "")



@triton.jit
def _kwarp_tile(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, state_indices, scale, num_slots, i_n, i_hv, i_h, i_v,
                HV: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, NW: tl.constexpr, VEC: tl.constexpr,
                USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                INPLACE: tl.constexpr, INDEXED: tl.constexpr, STORE_CACHE: tl.constexpr):
    """One tile of the persistent kernel with the state held as two 4-D halves [KL, NW, KA, KJ] (the `kwarp`
    variant, benchmarks/DECODE_KWARP.md): row k = half * BK/2 + l * KA + a, column v0 + w * KJ + j. Triton's
    coalescing pass gives this shape the layout sizePerThread [1, 1, 1, VEC], threadsPerWarp [KL, 1, 1, KJ/VEC],
    warpsPerCTA [1, NW, 1, 1]: VEC-wide (16-byte) vectors along V, the K rows on KL lanes and KA registers of ONE
    warp, the warps along V. Both reductions over K (S^T k, S^T q) are then in-thread sums plus log2(KL) shuffles,
    with no shared-memory exchange and no CTA barrier. q and k are loaded as two halves of BK/2 < 32 * NW
    elements, a size Triton treats as cheap to load directly in the layout that broadcasts them over the tile (a
    load of BK elements would be converted through shared memory with barriers); they are 16-byte rows per
    thread, so the pipeliner copies them with cp.async like the state. Same math as _decode_token."""
    KJ: tl.constexpr = BV // NW                 # columns per warp
    TJ: tl.constexpr = KJ // VEC                # lanes along V
    KL: tl.constexpr = 32 // TJ                 # lanes along K
    KA: tl.constexpr = BK // (2 * KL)           # rows per thread in each half
    HALF: tl.constexpr = BK // 2
    tl.static_assert(KJ % VEC == 0 and 32 % TJ == 0 and KA >= 1, "kwarp: BV / num_warps must be a multiple of "
                     "the 16-byte vector, and BK >= 2 x the lanes along K")
    kk = tl.arange(0, KL)[:, None] * KA + tl.arange(0, KA)[None, :]          # [KL, KA] row within a half
    vv = tl.arange(0, NW)[:, None] * KJ + tl.arange(0, KJ)[None, :]         # [NW, KJ] column within the block
    col = tl.max_contiguous(tl.multiple_of(i_v * BV + vv, [1, KJ]), [1, KJ])
    if INDEXED:
        idx = tl.load(state_indices + i_n).to(tl.int64)
        valid = (idx >= 0) & (idx < num_slots)
        slot = tl.where(valid, idx, 0)
    else:
        valid = i_n >= 0
        slot = i_n
    k0 = kk[:, None, :, None]
    k1 = k0 + HALF
    c4 = col[None, :, None, :]
    m0 = (k0 < K) & (c4 < V)
    m1 = (k1 < K) & (c4 < V)
    if INDEXED:
        m0_io = m0 & valid
        m1_io = m1 & valid
    else:
        m0_io = m0
        m1_io = m1
    base = (slot * HV + i_hv) * K * V
    if HAS_H0:
        h_lo = tl.load(h0 + base + k0 * V + c4, mask=m0_io, other=0.0).to(tl.float32)
        h_hi = tl.load(h0 + base + k1 * V + c4, mask=m1_io, other=0.0).to(tl.float32)
    else:
        h_lo = tl.zeros([KL, NW, KA, KJ], dtype=tl.float32)
        h_hi = tl.zeros([KL, NW, KA, KJ], dtype=tl.float32)
    p_q = q + (i_n * H + i_h) * K
    p_k = k + (i_n * H + i_h) * K
    q_lo = tl.load(p_q + kk, mask=kk < K, other=0.0).to(tl.float32)
    q_hi = tl.load(p_q + HALF + kk, mask=kk + HALF < K, other=0.0).to(tl.float32)
    k_lo = tl.load(p_k + kk, mask=kk < K, other=0.0).to(tl.float32)
    k_hi = tl.load(p_k + HALF + kk, mask=kk + HALF < K, other=0.0).to(tl.float32)
    b_v = tl.load(v + (i_n * HV + i_hv) * V + col, mask=col < V, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
    if QK_L2NORM:
        rq = tl.rsqrt(tl.sum(tl.sum(q_lo * q_lo + q_hi * q_hi, 1), 0) + 1e-6)
        rk = tl.rsqrt(tl.sum(tl.sum(k_lo * k_lo + k_hi * k_hi, 1), 0) + 1e-6)
        q_lo = q_lo * rq
        q_hi = q_hi * rq
        k_lo = k_lo * rk
        k_hi = k_hi * rk
    q_lo = q_lo * scale
    q_hi = q_hi * scale
    if BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
    if USE_G:
        b_g = tl.load(g + i_n * HV + i_hv).to(tl.float32)
        if FUSED_GATE:
            b_neg_a, b_dt = _gate_params(A_log, dt_bias, i_hv, FUSED_GATE, HAS_DT_BIAS)
            if HAS_DT_BIAS:
                b_g = b_g + b_dt
            b_g = b_neg_a * (tl.maximum(b_g, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_g))))
        b_a = tl.exp(b_g)
        h_lo = h_lo * b_a
        h_hi = h_hi * b_a
    kl4 = k_lo[:, None, :, None]
    kh4 = k_hi[:, None, :, None]
    ql4 = q_lo[:, None, :, None]
    qh4 = q_hi[:, None, :, None]
    # reduce the in-thread rows (axis 2) first, then the KL lanes (axis 0): [NW, KJ], all inside one warp
    b_kS = tl.sum(tl.sum(h_lo * kl4 + h_hi * kh4, 2), 0)
    b_qS = tl.sum(tl.sum(h_lo * ql4 + h_hi * qh4, 2), 0)
    b_qk = tl.sum(tl.sum(ql4 * kl4 + qh4 * kh4, 2), 0)              # [1, 1]: q . k, also warp-local
    b_u = b_beta * (b_v - b_kS)
    b_o = b_qS + b_qk * b_u
    u4 = b_u[None, :, None, :]
    h_lo = h_lo + kl4 * u4
    h_hi = h_hi + kh4 * u4
    if INDEXED:
        b_o = tl.where(valid, b_o, 0.0)
    tl.store(o + (i_n * HV + i_hv) * V + col, b_o.to(o.dtype.element_ty), mask=col < V)
    if STORE_HT:
        if INPLACE:
            tl.store(h0 + base + k0 * V + c4, h_lo.to(h0.dtype.element_ty), mask=m0_io, cache_modifier=STORE_CACHE)
            tl.store(h0 + base + k1 * V + c4, h_hi.to(h0.dtype.element_ty), mask=m1_io, cache_modifier=STORE_CACHE)
        else:
            if INDEXED:
                h_lo = tl.where(valid, h_lo, 0.0)
                h_hi = tl.where(valid, h_hi, 0.0)
            ht_base = (i_n * HV + i_hv) * K * V
            tl.store(ht + ht_base + k0 * V + c4, h_lo.to(ht.dtype.element_ty), mask=m0, cache_modifier=STORE_CACHE)
            tl.store(ht + ht_base + k1 * V + c4, h_hi.to(ht.dtype.element_ty), mask=m1, cache_modifier=STORE_CACHE)


@triton.jit
def _split_tail_item(j, main_end, tail_base, tail_mul, n_main):
    """split_tail: (tile, upper half?, is a half tile?) of a program's work item j. Items before main_end are the
    full tiles of the even part (tile = j); item main_end + m is half tile h = tail_base + m * tail_mul of the
    remainder, i.e. columns [0, BV/2) (h even) or [BV/2, BV) (h odd) of tile n_main + h // 2."""
    is_tail = j >= main_end
    h = tail_base + tl.maximum(j - main_end, 0) * tail_mul
    t = tl.where(is_tail, n_main + h // 2, j)
    return t, (h % 2) == 1, is_tail


@triton.jit
def _qk_rows(q, k, t, j, last, o_k, mask_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, NV: tl.constexpr,
             QK_JOIN: tl.constexpr = False):
    """prefetch_qk: the q and k rows of tile t (work item j; both masked off when j is past the program's last)."""
    i_h = ((t // NV) % HV) // (HV // H)
    i_n = (t // NV) // HV
    m = mask_k & (j < last)
    if QK_JOIN:
        off = (i_n * H + i_h) * K + o_k
        sel = (tl.arange(0, 2) == 0)[None, :]
        ptr = tl.where(sel, (q + off)[:, None], (k + off)[:, None])
        r_q = tl.load(ptr, mask=m[:, None] & (tl.arange(0, 2) < 2)[None, :], other=0.0)
        r_k = r_q
    else:
        r_q = tl.load(q + (i_n * H + i_h) * K + o_k, mask=m, other=0.0)
        r_k = tl.load(k + (i_n * H + i_h) * K + o_k, mask=m, other=0.0)
    return r_q, r_k


@triton.jit
def _tile_inputs(q, k, v, g, beta, t, live, o_k, mask_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, USE_G: tl.constexpr):
    """reg_prefetch: tile t's q, k rows (bf16 as stored), v columns, beta and g, all masked off unless `live`."""
    i_v = t % NV
    i_hv = (t // NV) % HV
    i_n = (t // NV) // HV
    i_h = i_hv // (HV // H)
    o_v = i_v * BV + tl.arange(0, BV)
    r_q = tl.load(q + (i_n * H + i_h) * K + o_k, mask=mask_k & live, other=0.0)
    r_k = tl.load(k + (i_n * H + i_h) * K + o_k, mask=mask_k & live, other=0.0)
    r_v = tl.load(v + (i_n * HV + i_hv) * V + o_v, mask=(o_v < V) & live, other=0.0)
    r_beta = tl.load(beta + i_n * HV + i_hv, mask=live, other=0.0)
    if USE_G:
        r_g = tl.load(g + i_n * HV + i_hv, mask=live, other=0.0)
    else:
        r_g = 0.0
    return r_q, r_k, r_v, r_beta, r_g


@triton.jit
def _reg_prefetch_loop(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, state_indices, scale, num_slots, n_tiles,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                       BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr, HAS_H0: tl.constexpr,
                       STORE_HT: tl.constexpr, INPLACE: tl.constexpr, INDEXED: tl.constexpr,
                       STORE_CACHE: tl.constexpr, EVICT: tl.constexpr):
    """reg_prefetch (round 30, opt-in): the persistent walk without Triton's software pipeliner (no cp.async, no
    shared-memory ring): the next tile's state block is loaded into registers by plain 16-byte loads at the top of
    each iteration, before the current tile's arithmetic and stores, with the load's L2 eviction policy EVICT
    (which the pipeliner's cp.async copies drop); its slot index one tile further ahead and its small inputs one
    tile ahead, so no dependent load waits inside an iteration. Same arithmetic as the default (_decode_token)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    o_k = tl.arange(0, BK)
    mask_k = o_k < K
    cols = tl.arange(0, BV)
    step = tl.num_programs(0)
    t = tl.full([], 0, tl.int64) + tl.program_id(0)
    live = t < n_tiles
    tc = tl.minimum(t, n_tiles - 1)
    b_h, state_off, mask_io, mask_h, valid, o_v, slot = _state_block(
        h0, state_indices, (tc // NV) // HV, (tc // NV) % HV, tc % NV, num_slots, HV, K, V, BK, BV, HAS_H0, INDEXED,
        (cols < BV) & live, EVICT, None)
    c_q, c_k, c_v, c_beta, c_g = _tile_inputs(q, k, v, g, beta, tc, live, o_k, mask_k, H, HV, K, V, BV, NV, USE_G)
    t1 = tl.minimum(t + step, n_tiles - 1)
    if INDEXED:
        nxt_slot = tl.load(state_indices + (t1 // NV) // HV).to(tl.int64)
    else:
        nxt_slot = (t1 // NV) // HV
    for tile in tl.range(tl.program_id(0), n_tiles, step, num_stages=1):
        t = tl.full([], 0, tl.int64) + tile
        # ---- the next tile: its state block (slot loaded last iteration), the slot after it, its small inputs
        tn = t + step
        live_n = tn < n_tiles
        tnc = tl.minimum(tn, n_tiles - 1)
        n_h, n_state_off, n_mask_io, n_mask_h, n_valid, n_o_v, _ = _state_block(
            h0, state_indices, (tnc // NV) // HV, (tnc // NV) % HV, tnc % NV, num_slots, HV, K, V, BK, BV, HAS_H0,
            INDEXED, (cols < BV) & live_n, EVICT, nxt_slot)
        t2 = tl.minimum(t + 2 * step, n_tiles - 1)
        if INDEXED:
            nxt_slot = tl.load(state_indices + (t2 // NV) // HV).to(tl.int64)
        else:
            nxt_slot = (t2 // NV) // HV
        n_q, n_k, n_v, n_beta, n_g = _tile_inputs(q, k, v, g, beta, tnc, live_n, o_k, mask_k, H, HV, K, V, BV, NV,
                                                  USE_G)
        # ---- the current tile
        i_v = t % NV
        i_nh = t // NV
        i_n = i_nh // HV
        i_hv = i_nh % HV
        b_neg_a, b_dt = _gate_params(A_log, dt_bias, i_hv, FUSED_GATE, HAS_DT_BIAS)
        b_h, b_o = _decode_token(b_h, c_q.to(tl.float32), c_k.to(tl.float32), c_v.to(tl.float32),
                                 c_beta.to(tl.float32), c_g.to(tl.float32) if USE_G else 0.0, b_neg_a, b_dt, scale,
                                 USE_G, FUSED_GATE, HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM)
        if INDEXED:
            b_o = tl.where(valid, b_o, 0.0)
        tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=o_v < V)
        if STORE_HT:
            _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV, K, V, BK, INPLACE,
                         INDEXED, STORE_CACHE)
        # ---- rotate
        b_h, state_off, mask_io, mask_h, valid, o_v = n_h, n_state_off, n_mask_io, n_mask_h, n_valid, n_o_v
        c_q, c_k, c_v, c_beta, c_g = n_q, n_k, n_v, n_beta, n_g


@triton.jit(do_not_specialize=["num_slots", "n_tiles"])
def fused_recurrent_gdn_fwd_persistent_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, state_indices,
    scale, num_slots, n_tiles,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    QK_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, INPLACE: tl.constexpr,
    INDEXED: tl.constexpr, NUM_STAGES: tl.constexpr,
    STORE_CACHE: tl.constexpr = "", PREFETCH_QK: tl.constexpr = False, CONTIGUOUS_TILES: tl.constexpr = False,
    KWARP: tl.constexpr = False, KW_WARPS: tl.constexpr = 4, KW_VEC: tl.constexpr = 4,
    SPLIT_TAIL: tl.constexpr = False, DISCARD_L2: tl.constexpr = False, STORE_FIRST: tl.constexpr = False,
    QK_EARLY: tl.constexpr = False, FUSED_REDUCE: tl.constexpr = False, QK_JOIN: tl.constexpr = False,
    O_ASM: tl.constexpr = False, PDL: tl.constexpr = False, REG_PREFETCH: tl.constexpr = False,
    LOAD_EVICT: tl.constexpr = "",
):
    """One token per sequence (the serving decode step), persistent: each program walks tiles (sequence, value
    head, V-block) with a stride of the grid size, and Triton's software pipeliner turns the loop's loads into
    cp.async copies into shared memory issued NUM_STAGES - 1 tiles ahead, so a program keeps the next states in
    flight while it updates the current one (the one-tile-per-program kernel above waits for its state, then
    computes, then stores). Same semantics as fused_recurrent_gdn_fwd_kernel with T = 1 and no cu_seqlens.
    Tiles never overlap (distinct slots are required with inplace), so prefetching tile i+1 while tile i is
    written back is safe.

    Opt-in variants (PERSISTENT_VARIANTS; the defaults compile to the same PTX as before they existed):
    STORE_CACHE is the state store's cache modifier (".cs": streaming, st.global.cs / STG.E.EF: the state is
    written once and not read again in this call); PREFETCH_QK loads the next tile's q and k rows at the end of
    the current tile (2 bytes per thread: too narrow for cp.async, so without it the pipeliner leaves them as
    plain loads issued after the wait for the state, a dependent L2 round trip inside every tile);
    CONTIGUOUS_TILES gives each program a contiguous run of tiles instead of a stride of the grid size. No load
    hint: the pipelined state load is a 16-byte cp.async.cg (L2 only) whatever tl.load's cache_modifier or
    eviction_policy say (Triton 3.6 drops both on async copies; sm_90a PTX checked). KWARP holds the tile in a
    layout with the K rows inside one warp and the warps along V (_kwarp_tile; KW_WARPS = num_warps, KW_VEC =
    the state elements per 16 bytes, both set by the launcher), so the reductions over K need no CTA barrier.
    SPLIT_TAIL (benchmarks/DECODE_TAIL.md) balances the last round: the first n_main = floor(n_tiles / P) * P tiles
    are walked as without it, and the R = n_tiles - n_main tiles left are 2R half tiles (BV/2 columns each) given
    to programs 0, 1, ..., P-1, 0, ... as the last items of the same pipelined loop: a half tile is the full [BK, BV]
    block with the other half's columns masked off (no bytes read or written for them; same layout, so the same
    summation order and bit-identical results), and its state copy is issued during the program's previous tile
    like any other. The slowest program then does floor(n_tiles / P) tiles and ceil(2R / P) halves instead of one
    more whole tile."""
    _pdl_enter(PDL)
    if REG_PREFETCH:
        tl.static_assert(not (SPLIT_TAIL or KWARP or CONTIGUOUS_TILES or DISCARD_L2 or STORE_FIRST or FUSED_REDUCE
                              or O_ASM), "reg_prefetch is written for the plain strided walk")
        _reg_prefetch_loop(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, state_indices, scale, num_slots, n_tiles, H,
                           HV, K, V, BK, BV, USE_G, FUSED_GATE, HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM, HAS_H0,
                           STORE_HT, INPLACE, INDEXED, STORE_CACHE, LOAD_EVICT)
        return
    NV: tl.constexpr = (V + BV - 1) // BV
    o_k = tl.arange(0, BK)
    mask_k = o_k < K
    if SPLIT_TAIL:
        tl.static_assert(BV % 2 == 0, "split_tail halves BV")
        tl.static_assert(not KWARP, "split_tail is not written for the kwarp tile")
        # work items: the full tiles of the even part, then this program's half tiles of the remainder
        # (half tile h is program h % P's); _split_tail_item maps an item to (tile, half). Item arithmetic in
        # int32 like the default's loop (fewer live registers; 2 x n_tiles < 2^31), the tile index in int64
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        n_main = (n_tiles // P) * P
        n_half = 2 * (n_tiles - n_main)
        if CONTIGUOUS_TILES:
            # program p: full tiles [p * q, (p + 1) * q), then halves p, p + P, ... (q = n_tiles // P)
            first = pid * (n_tiles // P)
            main_end = first + n_tiles // P
            last = main_end + tl.maximum(n_half - pid + P - 1, 0) // P
            step = 1
            tail_base = pid
            tail_mul = P
        else:
            # strided: items pid, pid + P, ... < n_main + 2R; item n_main + m is half tile m
            first = pid
            main_end = n_main
            last = n_main + n_half
            step = P
            tail_base = 0
            tail_mul = 1
    elif CONTIGUOUS_TILES:
        # balanced runs: program p takes [p * n / P, (p + 1) * n / P), 41 or 42 tiles at batch 256
        P = tl.num_programs(0).to(tl.int64)
        first = (tl.program_id(0).to(tl.int64) * n_tiles) // P
        last = ((tl.program_id(0).to(tl.int64) + 1) * n_tiles) // P
        step = 1
    else:
        first = tl.program_id(0)
        last = n_tiles
        step = tl.num_programs(0)
    if PREFETCH_QK:
        t0 = tl.full([], 0, tl.int64) + first
        j0 = t0                            # the item (split_tail: not the tile) for the bound check
        if SPLIT_TAIL:
            t0, _, _ = _split_tail_item(first, main_end, tail_base, tail_mul, n_main)
            t0 = tl.full([], 0, tl.int64) + t0
        nxt_q, nxt_k = _qk_rows(q, k, t0, j0, last, o_k, mask_k, H, HV, K, NV, QK_JOIN)
    for tile in tl.range(first, last, step, num_stages=NUM_STAGES):
        if SPLIT_TAIL:
            j = tile
            t, upper, is_tail = _split_tail_item(j, main_end, tail_base, tail_mul, n_main)
            t = tl.full([], 0, tl.int64) + t
            # a half tile keeps columns [0, BV/2) or [BV/2, BV) of its block; a full tile all of them
            col_keep = ((tl.arange(0, BV) >= BV // 2) == upper) | (j < main_end)
        else:
            t = tl.full([], 0, tl.int64) + tile  # int64: slot * HV * K * V passes 2^31 in large pools (and the
            #                                     interpreter yields plain ints, which have no .to)
            col_keep = None
        i_v = t % NV
        i_nh = t // NV
        i_n = i_nh // HV
        i_hv = i_nh % HV
        i_h = i_hv // (HV // H)
        if KWARP:
            _kwarp_tile(q, k, v, g, beta, A_log, dt_bias, o, h0, ht, state_indices, scale, num_slots, i_n, i_hv,
                        i_h, i_v, HV, H, K, V, BK, BV, KW_WARPS, KW_VEC, USE_G, FUSED_GATE, HAS_DT_BIAS,
                        BETA_SIGMOID, QK_L2NORM, HAS_H0, STORE_HT, INPLACE, INDEXED, STORE_CACHE)
        else:
            b_h, state_off, mask_io, mask_h, valid, o_v, slot = _state_block(h0, state_indices, i_n, i_hv, i_v,
                                                                            num_slots, HV, K, V, BK, BV, HAS_H0,
                                                                            INDEXED, col_keep, "", None)
            mask_v = o_v < V
            if SPLIT_TAIL:
                mask_v = mask_v & col_keep
            if PREFETCH_QK:
                if QK_JOIN:
                    b_q, b_k = tl.split(nxt_q.to(tl.float32))
                else:
                    b_q = nxt_q.to(tl.float32)
                    b_k = nxt_k.to(tl.float32)
                if QK_EARLY:
                    # prefetch_qk_early: the next tile's q, k issued here, before this tile's arithmetic and
                    # stores, instead of after them (round 29's ncu source view: 24.5% of the samples waited on
                    # those loads at the next tile's start)
                    t1e = t + step
                    j1e = t1e
                    if SPLIT_TAIL:
                        j1e = j + step
                        t1e, _, _ = _split_tail_item(j1e, main_end, tail_base, tail_mul, n_main)
                    nxt_q, nxt_k = _qk_rows(q, k, t1e, j1e, last, o_k, mask_k, H, HV, K, NV, QK_JOIN)
            else:
                b_q = tl.load(q + (i_n * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
                b_k = tl.load(k + (i_n * H + i_h) * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_n * HV + i_hv) * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
            if USE_G:
                b_g = tl.load(g + i_n * HV + i_hv).to(tl.float32)
            else:
                b_g = 0.0
            b_neg_a, b_dt = _gate_params(A_log, dt_bias, i_hv, FUSED_GATE, HAS_DT_BIAS)
            if DISCARD_L2:
                tl.static_assert(INPLACE and HAS_H0 and STORE_HT and not SPLIT_TAIL,
                                 "discard_l2 is for the in-place pool with full blocks")
                # beta came with the state (one wait per tile): a NaN beta skips the discards, which is harmless
                _discard_state_lines(h0, slot, (valid & (b_beta == b_beta)).to(tl.int32), i_hv, i_v, HV, K, V, BK,
                                     BV)
            if STORE_FIRST:
                # the new state first, then o = S'^T q from it (the same o as S^T q + u (k . q), rounded otherwise):
                # the block's stores issue before the second reduction over K instead of after both
                b_h, b_qs, b_ks, b_bs = _decode_token_prep(b_h, b_q, b_k, b_beta, b_g, b_neg_a, b_dt, scale, USE_G,
                                                           FUSED_GATE, HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM)
                b_u = b_bs * (b_v - tl.sum(b_h * b_ks[:, None], 0))
                b_h = b_h + b_ks[:, None] * b_u[None, :]
                if STORE_HT:
                    _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV, K, V, BK,
                                 INPLACE, INDEXED, STORE_CACHE)
                b_o = tl.sum(b_h * b_qs[:, None], 0)
            elif FUSED_REDUCE:
                b_h, b_o = _decode_token_fused_reduce(b_h, b_q, b_k, b_v, b_beta, b_g, b_neg_a, b_dt, scale, USE_G,
                                                      FUSED_GATE, HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM)
            else:
                b_h, b_o = _decode_token(b_h, b_q, b_k, b_v, b_beta, b_g, b_neg_a, b_dt, scale, USE_G, FUSED_GATE,
                                         HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM)
            if INDEXED:
                b_o = tl.where(valid, b_o, 0.0)
            if O_ASM:
                _store_o_asm(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask_v)
            else:
                tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
            if STORE_HT and not STORE_FIRST:
                _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV, K, V, BK, INPLACE,
                             INDEXED, STORE_CACHE)
        if PREFETCH_QK and not QK_EARLY:
            # the next tile's q, k rows (masked past the last tile): their latency overlaps the wait for its state
            t1 = t + step
            j1 = t1
            if SPLIT_TAIL:
                j1 = j + step
                t1, _, _ = _split_tail_item(j1, main_end, tail_base, tail_mul, n_main)
            nxt_q, nxt_k = _qk_rows(q, k, t1, j1, last, o_k, mask_k, H, HV, K, NV, QK_JOIN)


# Opt-in variants of the persistent kernel (round 13 sweep candidates, not chosen by any heuristic): name ->
# constexpr overrides; a config's 6th element names one or several joined by "+" ("store_cs+prefetch_qk").
# (store_evict_first, an L2::evict_first cache-policy store, compiles to the same STG.E.EF.128 as store_cs.)
PERSISTENT_VARIANTS = {
    "store_cs": dict(STORE_CACHE=".cs"),                   # state write: streaming (evict-first)
    "prefetch_qk": dict(PREFETCH_QK=True),                 # next tile's q, k loaded during the current tile
    "contiguous_tiles": dict(CONTIGUOUS_TILES=True),       # each program a contiguous run of tiles
    "kwarp": dict(KWARP=True),                             # K rows inside one warp, warps along V (no CTA barrier
    #                                                        in the reductions; benchmarks/DECODE_KWARP.md)
    "split_tail": dict(SPLIT_TAIL=True),                   # the n_tiles mod P tiles left after the even part as
    #                                                        2x as many half tiles (benchmarks/DECODE_TAIL.md)
    "discard_l2": dict(DISCARD_L2=True),                   # the block's L2 lines discarded between its read and its
    #                                                        in-place write-back (GPU only: inline PTX); round 29 on an
    #                                                        H200: 290.5 us against 281.7 for the default (OPT_LOG 29.1)
    "prefetch_qk_early": dict(PREFETCH_QK=True, QK_EARLY=True),  # the next tile's q, k issued at the current tile's
    #                                                        start, not after its stores (round 29's ncu source view);
    #                                                        round 29: 281.7 against 280.7 us (OPT_LOG 29.8)
    "store_first": dict(STORE_FIRST=True),                 # the new state stored before o's reduction, o = S'^T q;
    #                                                        round 29: 283.2 against 282.7 us (OPT_LOG 29.3)
    "qk_join": dict(PREFETCH_QK=True, QK_JOIN=True),
    "o_asm": dict(O_ASM=True),
    "reg_prefetch": dict(REG_PREFETCH=True),              # no pipeliner: the next tile loaded into registers
    "evict_first": dict(LOAD_EVICT="evict_first"),        # reg_prefetch's state load with L2::evict_first
    "evict_last": dict(LOAD_EVICT="evict_last"),
    "fused_reduce": dict(FUSED_REDUCE=True),               # S^T k, S^T q and k . q as one three-operand reduction
    #                                                        over K (one cross-warp exchange instead of three)
}
PERSISTENT_DEFAULTS = dict(STORE_CACHE="", PREFETCH_QK=False, CONTIGUOUS_TILES=False, KWARP=False, SPLIT_TAIL=False,
                           DISCARD_L2=False, STORE_FIRST=False, QK_EARLY=False,
                           FUSED_REDUCE=False, QK_JOIN=False, O_ASM=False, REG_PREFETCH=False,
                           LOAD_EVICT="")


def persistent_variant_flags(variant: Optional[str]) -> dict:
    """Every variant constexpr of the persistent kernel for a "+"-joined variant string ("" or None: defaults)."""
    flags = dict(PERSISTENT_DEFAULTS)
    for name in filter(None, (variant or "").split("+")):
        if name not in PERSISTENT_VARIANTS:
            raise ValueError(f"unknown persistent decode variant {name!r}; known: {sorted(PERSISTENT_VARIANTS)}")
        flags.update(PERSISTENT_VARIANTS[name])
    if flags["KWARP"] and flags["PREFETCH_QK"]:
        raise ValueError("decode variant kwarp loads q and k itself (as cp.async copies); drop prefetch_qk")
    if flags["KWARP"] and flags["SPLIT_TAIL"]:
        raise ValueError("decode variant split_tail is written for the default tile, not kwarp's")
    if flags["STORE_FIRST"] and flags["KWARP"]:
        raise ValueError("decode variant store_first is written for the default tile, not kwarp's")
    if flags["LOAD_EVICT"] and not flags["REG_PREFETCH"]:
        raise ValueError("decode variants evict_first / evict_last set reg_prefetch's load; add reg_prefetch")
    if flags["REG_PREFETCH"] and any(flags[n] for n in ("PREFETCH_QK", "SPLIT_TAIL", "KWARP", "CONTIGUOUS_TILES",
                                                         "DISCARD_L2", "STORE_FIRST", "FUSED_REDUCE", "O_ASM")):
        raise ValueError("decode variant reg_prefetch is the plain strided walk with its own prefetch: it combines "
                         "with store_cs and evict_first / evict_last only")
    if flags["DISCARD_L2"] and (flags["KWARP"] or flags["SPLIT_TAIL"]):
        raise ValueError("decode variant discard_l2 is written for the default tile, not kwarp's or split_tail's")
    return flags


# Opt-in variants the default persistent config adds ("+"-joined; LINATTN_GDN_DECODE_VARIANT overrides)
DECODE_EXTRA_VARIANT = ""


def _extra_variant() -> str:
    from linattn.runtime.settings import settings
    value = settings.gdn_decode_variant
    return DECODE_EXTRA_VARIANT if value is None else value


def discard_l2_refusal(inplace: bool, initial_state, K: int, BK: int, V: int, BV: int) -> Optional[str]:
    """Why the discard_l2 variant cannot run this call (None: it can). Every line it discards must then be
    overwritten whole by the same program: the state updated in place, blocks of whole 128-byte lines (V a multiple
    of BV, rows of whole lines, a 128-byte-aligned pool), and the GPU (inline PTX; the interpreter has no L2)."""
    from linattn.runtime.settings import settings
    if settings.interpret or initial_state is None or not initial_state.is_cuda:
        return "needs a CUDA device (inline PTX discard.global.L2), not the interpreter"
    es = initial_state.element_size()
    if not inplace:
        return "only for the state updated in place (inplace=True)"
    if K > BK or V % BV or (BV * es) % 128 or (V * es) % 128 or initial_state.data_ptr() % 128:
        return (f"needs blocks of whole 128-byte lines: V % BV == 0, BV and V rows of multiples of 128 bytes and a "
                f"128-byte-aligned pool (K={K}, BK={BK}, V={V}, BV={BV}, {es}-byte state)")
    if not initial_state.is_contiguous():
        return "needs a contiguous pool"
    return None


def pdl_refusal(q) -> Optional[str]:
    """Why the decode kernels launch without PDL here (None: they launch with it, unless LINATTN_GDN_DECODE_PDL=0)."""
    from linattn.runtime.settings import settings
    if settings.interpret or not q.is_cuda:
        return "needs a CUDA device, not the interpreter"
    if device_facts(q.device).capability[0] < 9:
        return f"needs sm_90 or newer (griddepcontrol), this GPU is sm_{''.join(map(str, device_facts(q.device).capability))}"
    if _gdc_wait is None or not _triton_has_launch_pdl():
        return f"this Triton ({triton.__version__}) has no gdc_wait / launch_pdl"
    return None


def decode_pdl(q) -> bool:
    """Whether this call's decode kernel is launched with PDL: with LINATTN_GDN_DECODE_PDL=1 (opt-in since round 30's
    measurement) where pdl_refusal allows."""
    from linattn.runtime.settings import settings
    return settings.gdn_decode_pdl and pdl_refusal(q) is None


def o_asm_refusal(q) -> Optional[str]:
    """Why the o_asm variant cannot run this call (None: it can): its store is inline PTX."""
    from linattn.runtime.settings import settings
    if settings.interpret or not q.is_cuda:
        return "needs a CUDA device (inline PTX st.global), not the interpreter"
    return None


# Variants whose results equal the default's to rounding but not bit for bit (they sum over K in another order)
PERSISTENT_REORDERING = frozenset({"kwarp", "store_first", "fused_reduce"})
# The reg_prefetch walk and its load hints: a walk of its own (no pipeliner), combined only with store_cs; bit-equal to
# the pipelined default (tests/test_decode_reg_prefetch.py)
PERSISTENT_OWN_WALK = frozenset({"reg_prefetch", "evict_first", "evict_last"})
# Variants that run on a GPU only (inline PTX): their checks are the sm_90a AOT tests and the GPU gate
PERSISTENT_GPU_ONLY = frozenset({"discard_l2", "o_asm"})


def kwarp_flags(BK: int, BV: int, num_warps: int, state_elem_bytes: int) -> dict:
    """KW_WARPS and KW_VEC of the kwarp variant (_kwarp_tile) for a launch, or ValueError when its layout does not
    exist: BV / num_warps columns per warp must be whole 16-byte vectors on a power-of-2 number of lanes <= 32,
    and the K rows (BK) must cover twice the remaining lanes (two halves of at least one row per lane)."""
    vec = 16 // state_elem_bytes
    kj = BV // num_warps
    ok = kj * num_warps == BV and kj % vec == 0 and kj // vec >= 1 and 32 % (kj // vec) == 0
    if not ok or BK < 2 * (32 // (kj // vec)):
        raise ValueError(f"decode variant kwarp needs BV / num_warps a multiple of {vec} state elements (16 bytes) "
                         f"on at most 32 lanes and BK >= 2 x (32 / lanes along V); got BK={BK}, BV={BV}, "
                         f"num_warps={num_warps}")
    return dict(KW_WARPS=num_warps, KW_VEC=vec)


def decode_launch_config(N: int, HV: int, K: int, V: int, state_dtype: torch.dtype, num_sms: int):
    """(BK, BV, num_warps) for N sequences.

    BV: start at 128-byte state rows (32 fp32 or 64 bf16 columns: BK * 128 bytes of state per program, 4 warps
    at K = 128), and halve it while the grid has fewer than 4 programs per SM, down to 64-byte rows (16 fp32 or
    32 bf16 columns). Measured on the H200 (round 3 sweep, H = HV = 32, K = V = 128, benchmarks/DECODE.md):
    bf16 at batch 256 ran 231 us with BV = 64 against 281 us with BV = 32 (the same bytes per program as fp32
    is what counts, not the same columns); fp32 at batch 1 ran 3.7-3.9 us with 16 columns against 4.2 us with 8
    and 5.3 us with 4 (rows narrower than 64 bytes waste half of each 64-byte fetch)."""
    BK = triton.next_power_of_2(K)
    elem = torch.empty((), dtype=state_dtype).element_size()
    vp2 = triton.next_power_of_2(V)
    bv_min = min(vp2, max(1, 64 // elem))
    BV = min(vp2, max(bv_min, 128 // elem))
    target = 4 * num_sms
    while BV > bv_min and N * HV * triton.cdiv(V, BV) < target:
        BV //= 2
    # about 32 state bytes x 4 per thread: 4 warps for a [128, 128-byte] block
    num_warps = max(1, min(8, BK * BV * elem // 4096))
    return BK, BV, num_warps


def decode_persistent_config(N: int, HV: int, K: int, V: int, T: int, varlen: bool, state_dtype: torch.dtype,
                             num_sms: int, inplace: bool = True):
    """(BV, num_warps, NUM_STAGES, programs per SM, programs, variant) for the persistent one-token kernel (the
    launcher's `config` form; programs None = programs per SM x SMs), or None for the one-tile kernel.

    From the round-9 sweep on the H200 (H = HV = 32, K = V = 128, T = 1, pool in place; benchmarks/DECODE.md):
    at batch 256 with an fp32 pool, persistent BV = 64 (256-byte rows), 4 warps, 2 stages, 3 programs per SM
    took 289.6 us (3.71 TB/s, 87.6% of the copy bandwidth) against 324.0 us for the one-tile kernel; the same
    kernel with BV = 32 and 4 programs per SM took 336.5 us, and with a bf16 pool no persistent config beat the
    one-tile kernel's 234.4 us (239.0 at best). At batch 32 (15 tiles of BV = 64 per SM) the one-tile kernel was
    fastest (44.8 us against 47.5). So: fp32 states, one token per sequence, no cu_seqlens (T > 1 loops over
    tokens inside the one-tile kernel), K <= 128 (64 state values per thread at 4 warps: the measured size;
    larger K would spill), and at least 32 tiles of BV = 64 per SM. Round 12 (same run, batch 256 fp32): the
    prefetch_qk variant (the next tile's q and k rows loaded during the current tile) took 284.1 us against 290.5
    and 290.8 us for the same config without it (store_cs 291.0, contiguous_tiles 293.2, both 286.1). Rounds 14 and
    15 (same sweeps, same inputs): prefetch_qk at 3 stages and 2 programs per SM took 282.6 (r14), 281.9 and 281.8
    us (r15) against 283.2 / 284.1 (r14) and 284.0 / 283.4 / 283.8 us (r15) at 2 stages and 3 per SM: the default
    since round 15 (results/2026-11-30_r15_decode.json; the gate re-run with it)."""
    if T != 1 or varlen or state_dtype != torch.float32 or K > 128:
        return None
    BV = min(64, triton.next_power_of_2(V))
    if N * HV * triton.cdiv(V, BV) < 32 * num_sms:
        return None
    # Round 30 (results/2026-12-02_r30*, OPT_LOG 30.4): the reg_prefetch walk (no software pipeliner: the next
    # tile's block loaded into registers ahead of the current tile's arithmetic) with the L2::evict_last hint on that
    # load, which the pipeliner's cp.async copies cannot carry, ran the batch-256 fp32 pool in place at 271.2 us
    # against 282.0 for the round-15 default (prefetch_qk, 3 stages) and 277.4 without the hint, alternated in one
    # run (L2::evict_first: 284.6). Out of place (the pool read, a new final state written) the written lines are
    # not read again: with store_cs (streaming stores) 270.6 us against 277.0 without it and 275.8 for the pipelined
    # walk; in place store_cs cost 2 us (272.6 against 270.5), so it is the out-of-place default only.
    # PIPELINED_BASE stays reachable through LINATTN_GDN_DECODE_VARIANT (below).
    return BV, 4, 1, 2, None, REG_PREFETCH_BASE if inplace else REG_PREFETCH_BASE + "+store_cs"


# The default persistent variant since round 30, and the one before it (round 15: prefetch_qk on the pipelined walk,
# 3 stages). LINATTN_GDN_DECODE_VARIANT naming a variant of the pipelined walk (PIPELINED_ONLY) runs it on
# PIPELINED_BASE instead.
REG_PREFETCH_BASE = "reg_prefetch+evict_last"
PIPELINED_BASE = (3, "prefetch_qk")
PIPELINED_ONLY = frozenset({"prefetch_qk", "contiguous_tiles", "kwarp", "split_tail", "discard_l2", "prefetch_qk_early",
                            "store_first", "qk_join", "fused_reduce", "o_asm"})


def fused_recurrent_gdn_fwd(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                            cu_seqlens: Optional[torch.Tensor], state_indices: Optional[torch.Tensor],
                            A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                            use_qk_l2norm: bool, beta_sigmoid: bool, output_final_state: bool, inplace: bool,
                            config: Optional[tuple] = None, out: Optional[torch.Tensor] = None,
                            final_out: Optional[torch.Tensor] = None):
    """Launcher. Returns (o, final_state); final_state is None when inplace (the pool was updated) or when not
    requested. The arguments are assumed checked (fused_recurrent.py validates them). `out` / `final_out`:
    optional preallocated contiguous outputs (tests pass NaN-poisoned ones); `config` = (BV, num_warps) overrides
    the heuristic (the GPU bench sweeps it); (BV, num_warps, NUM_STAGES, programs_per_SM) with NUM_STAGES >= 1
    selects the persistent one-token kernel (T = 1, no cu_seqlens), NUM_STAGES = 0 the one-tile kernel; a fifth
    element, when not None, sets the persistent grid's program count exactly (the sweep's tail experiment: a
    count that divides the tile count gives every program the same number of tiles); a sixth, when not empty,
    names opt-in variants of the persistent kernel ("+"-joined keys of PERSISTENT_VARIANTS)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if state_indices is not None:
        N = state_indices.shape[0]
    elif cu_seqlens is not None:
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    # decode inputs are tiny; .contiguous() is a no-op for the usual contiguous projections. Outputs come from
    # runtime.alloc.empty: NaN-filled inside poisoned_allocations(), so an unwritten element fails a check
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    if initial_state is not None and not inplace:
        initial_state = initial_state.contiguous()
    state_dtype = initial_state.dtype if initial_state is not None else torch.float32
    o = empty(*v.shape, dtype=v.dtype, device=v.device) if out is None else out
    ht = None
    if output_final_state and not inplace:
        ht = empty(N, HV, K, V, dtype=state_dtype, device=q.device) if final_out is None else final_out
    num_sms = device_facts(q.device).num_sms
    BK, BV, num_warps = decode_launch_config(N, HV, K, V, state_dtype, num_sms)
    if config is not None:
        BV, num_warps = config[:2]
    n_tiles = N * HV * triton.cdiv(V, BV)
    if n_tiles == 0:
        return o, ht
    programs = None
    variant = ""
    if config is not None:
        persistent = tuple(config[2:4]) if len(config) >= 4 and config[2] >= 1 else None
        programs = config[4] if len(config) >= 5 else None
        variant = config[5] if len(config) >= 6 else ""
        if variant and persistent is None:
            raise ValueError(f"decode variant {variant!r} needs the persistent kernel (NUM_STAGES >= 1)")
        if persistent is not None and (T != 1 or cu_seqlens is not None):
            raise ValueError("the persistent decode kernel takes one token per sequence and no cu_seqlens")
    else:
        chosen = decode_persistent_config(N, HV, K, V, T, cu_seqlens is not None, state_dtype, num_sms, inplace)
        persistent = None
        if chosen is not None:
            BV, num_warps = chosen[:2]
            persistent, programs, variant = chosen[2:4], chosen[4], chosen[5]
            n_tiles = N * HV * triton.cdiv(V, BV)
            extras = [e for e in _extra_variant().split("+") if e]
            if any(e in PIPELINED_ONLY for e in extras):
                # a variant of the pipelined walk: on the round-15 default (prefetch_qk, 3 stages)
                persistent, variant = (PIPELINED_BASE[0], persistent[1]), PIPELINED_BASE[1]
            for extra in extras:
                if extra == "discard_l2" and discard_l2_refusal(inplace, initial_state, K, BK, V, BV) is not None:
                    continue
                if extra == "o_asm" and o_asm_refusal(q) is not None:
                    continue
                variant = variant + "+" + extra
    num_slots = initial_state.shape[0] if state_indices is not None else 0
    flags = dict(USE_G=g is not None, FUSED_GATE=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
                 BETA_SIGMOID=beta_sigmoid, QK_L2NORM=use_qk_l2norm, HAS_H0=initial_state is not None,
                 STORE_HT=inplace or output_final_state, INPLACE=inplace, INDEXED=state_indices is not None)
    # PDL: the constexpr that emits griddepcontrol and the launch option that sets the attribute, together or not at all
    pdl = dict(PDL=True, launch_pdl=True) if decode_pdl(q) else {}
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        if persistent is not None:
            stages, per_sm = persistent
            grid = (min(n_tiles, programs or per_sm * num_sms),)
            vflags = persistent_variant_flags(variant)
            if vflags["DISCARD_L2"]:
                why = discard_l2_refusal(inplace, initial_state, K, BK, V, BV)
                if why:
                    raise ValueError(f"decode variant discard_l2: {why}")
            if vflags["O_ASM"] and o_asm_refusal(q):
                raise ValueError(f"decode variant o_asm: {o_asm_refusal(q)}")
            if vflags["KWARP"]:
                vflags.update(kwarp_flags(BK, BV, num_warps, torch.empty((), dtype=state_dtype).element_size()))
            fused_recurrent_gdn_fwd_persistent_kernel[grid](
                q, k, v, g, beta, A_log, dt_bias, o, initial_state, ht, state_indices,
                float(scale), num_slots, n_tiles, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, NUM_STAGES=stages,
                **flags, **vflags, **pdl, num_warps=num_warps, num_stages=1,
            )
            return o, ht
        grid = (n_tiles,)
        fused_recurrent_gdn_fwd_kernel[grid](
            q, k, v, g, beta, A_log, dt_bias, o, initial_state, ht, cu_seqlens, state_indices,
            float(scale), T, num_slots,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None,
            **flags, **pdl, num_warps=num_warps, num_stages=1,
        )
    return o, ht



def _aot_build(state, BV, warps, H=32, fused=False, varlen=False, inplace=True, stages=0, variant="", pdl=False):
    """(jit function, signature, constexprs, options) of one decode config at K = V = 128, HV = 32; stages >= 1:
    the persistent kernel, with the "+"-joined opt-in `variant` (PERSISTENT_VARIANTS)."""
    sp = {"fp32": "*fp32", "bf16": "*bf16"}[state]
    opt = dict(A_log="*fp32" if fused else None, dt_bias="*fp32" if fused else None,
               ht=None if inplace else sp, cu_seqlens="*i32" if varlen else None, state_indices="*i32")
    sig = dict(q="*bf16", k="*bf16", v="*bf16", g="*fp32", beta="*fp32", A_log=None, dt_bias=None,
               o="*bf16", h0=sp, ht=None, cu_seqlens=None, state_indices=None, scale="fp32", T="i32",
               num_slots="i32")
    sig.update(opt)
    const = dict(H=H, HV=32, K=128, V=128, BK=128, BV=BV, USE_G=True, FUSED_GATE=fused, HAS_DT_BIAS=fused,
                 BETA_SIGMOID=fused, QK_L2NORM=False, HAS_H0=True, STORE_HT=True, INPLACE=inplace,
                 IS_VARLEN=varlen, INDEXED=True)
    constexprs = {n: None for n, t in sig.items() if t is None}
    constexprs.update(const)
    signature = {n: ("constexpr" if t is None else t) for n, t in sig.items()}
    signature.update({n: "constexpr" for n in const})
    kernel = fused_recurrent_gdn_fwd_kernel
    if stages:                    # the persistent one-token kernel: no T, no cu_seqlens; n_tiles, NUM_STAGES
        kernel = fused_recurrent_gdn_fwd_persistent_kernel
        for n in ("T", "cu_seqlens", "IS_VARLEN"):
            signature.pop(n)
            constexprs.pop(n, None)
        signature = {**{n: t for n, t in signature.items() if n != "H" and n in
                        ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "o", "h0", "ht", "state_indices",
                         "scale", "num_slots")}, "n_tiles": "i32",
                     **{n: "constexpr" for n in const if n != "IS_VARLEN"}, "NUM_STAGES": "constexpr"}
        constexprs["NUM_STAGES"] = stages
        flags = persistent_variant_flags(variant)
        if flags["KWARP"]:
            flags.update(kwarp_flags(128, BV, warps, 4 if state == "fp32" else 2))
        signature.update({n: "constexpr" for n in flags})
        constexprs.update(flags)
    if pdl:                       # PDL: griddepcontrol in the kernel, the launch attribute in its metadata
        signature["PDL"] = "constexpr"
        constexprs["PDL"] = True
        return kernel, signature, constexprs, dict(num_warps=warps, num_stages=1, launch_pdl=True)
    return kernel, signature, constexprs, dict(num_warps=warps, num_stages=1)


def aot_specs(variants: bool = False):
    """AotKernel specs (linattn.runtime.aot) of the serving configs at K = V = 128: fp32 and bf16 pools, in
    place, at the batch-1 and large-batch block sizes, plus GVA with varlen, fused gate and an out-of-place
    state. Intended instructions: 16-byte state loads and stores (LDG.E.128 / STG.E.128). variants=True: the
    persistent serving config (fp32 BV=64, 4 warps, 2 stages) with each opt-in variant of PERSISTENT_VARIANTS
    instead (name suffix = the variant), and the round-13 candidate launch configs (BV=128 at 4 warps, 3 stages)."""
    from linattn.runtime.aot import AotKernel
    build = _aot_build
    div16 = ("q", "k", "v", "g", "beta", "o", "h0")
    cases = [("fp32_bv32_w4", dict(state="fp32", BV=32, warps=4)), ("fp32_bv8_w1", dict(state="fp32", BV=8, warps=1)),
             ("bf16_bv32_w4", dict(state="bf16", BV=32, warps=4)), ("bf16_bv16_w2", dict(state="bf16", BV=16, warps=2)),
             ("gva_varlen_gate_outofplace", dict(state="fp32", BV=32, warps=4, H=16, fused=True, varlen=True,
                                                  inplace=False))]
    # the persistent one-token kernel: its state loads become cp.async copies into shared memory (LDGSTS)
    persistent = [("persistent_fp32_bv64_w4_s3_prefetch_qk", dict(state="fp32", BV=64, warps=4, stages=3,
                                                                   variant="prefetch_qk")),  # batch-256 default
                  ("persistent_fp32_bv64_w4_s2", dict(state="fp32", BV=64, warps=4, stages=2,
                                                       variant="prefetch_qk")),   # the default of rounds 12-14
                  ("persistent_fp32_bv32_w4_s2", dict(state="fp32", BV=32, warps=4, stages=2)),
                  ("persistent_bf16_bv64_w4_s2", dict(state="bf16", BV=64, warps=4, stages=2)),
                  ("persistent_gva_gate_outofplace_s2", dict(state="fp32", BV=32, warps=4, H=16, fused=True,
                                                              inplace=False, stages=2)),
                  # with PDL, as the launcher runs them on sm_90+ (round 30): the batch-256 default, the one-tile
                  # kernel at the bf16 pool's block
                  ("persistent_fp32_bv64_w4_s3_prefetch_qk_pdl", dict(state="fp32", BV=64, warps=4, stages=3,
                                                                       variant="prefetch_qk", pdl=True))]
    cases = cases + [("bf16_bv32_w4_pdl", dict(state="bf16", BV=32, warps=4, pdl=True))] if not variants else cases
    if variants:
        cases = []
        persistent = [(f"persistent_fp32_bv64_w4_s2_{v}", dict(state="fp32", BV=64, warps=4, stages=2, variant=v))
                      for v in PERSISTENT_VARIANTS if v not in PERSISTENT_OWN_WALK]   # (own builds below, s1)
        persistent += [("persistent_fp32_bv64_w4_s2_novariant", dict(state="fp32", BV=64, warps=4, stages=2)),
                       ("persistent_fp32_bv128_w4_s2", dict(state="fp32", BV=128, warps=4, stages=2)),
                       ("persistent_fp32_bv64_w4_s3", dict(state="fp32", BV=64, warps=4, stages=3)),
                       # kwarp at the sweep's other launch configs (benchmarks/DECODE_KWARP.md)
                       ("persistent_fp32_bv64_w4_s3_kwarp", dict(state="fp32", BV=64, warps=4, stages=3,
                                                                 variant="kwarp")),
                       ("persistent_bf16_bv64_w4_s2_kwarp", dict(state="bf16", BV=64, warps=4, stages=2,
                                                                 variant="kwarp")),
                       # split_tail as the sweep runs it: on the default (prefetch_qk), at 2 and 3 stages, and on a
                       # bf16 pool (benchmarks/DECODE_TAIL.md)
                       ("persistent_fp32_bv64_w4_s2_prefetch_qk_split_tail",
                        dict(state="fp32", BV=64, warps=4, stages=2, variant="prefetch_qk+split_tail")),
                       ("persistent_fp32_bv64_w4_s3_prefetch_qk_split_tail",
                        dict(state="fp32", BV=64, warps=4, stages=3, variant="prefetch_qk+split_tail")),
                       # discard_l2 and store_first on the serving default (round 29)
                       ("persistent_fp32_bv64_w4_s3_prefetch_qk_discard_l2",
                        dict(state="fp32", BV=64, warps=4, stages=3, variant="prefetch_qk+discard_l2")),
                       ("persistent_fp32_bv64_w4_s3_prefetch_qk_store_first",
                        dict(state="fp32", BV=64, warps=4, stages=3, variant="prefetch_qk+store_first")),
                       ("persistent_fp32_bv64_w4_s3_prefetch_qk_early",
                        dict(state="fp32", BV=64, warps=4, stages=3, variant="prefetch_qk_early")),
                       ("persistent_bf16_bv64_w4_s2_prefetch_qk_split_tail",
                        dict(state="bf16", BV=64, warps=4, stages=2, variant="prefetch_qk+split_tail"))]
        # round 30: the barrier-cutting variants on the pipelined default (3 stages) and the reg_prefetch walk with
        # its load hints (1 stage: no pipeliner); name = stages + the variant with "+" as "_"
        persistent += [(f"persistent_fp32_bv64_w4_s{st}_{v.replace('+', '_')}",
                        dict(state="fp32", BV=64, warps=4, stages=st, variant=v))
                       for st, v in ((3, "prefetch_qk+fused_reduce"), (3, "prefetch_qk+fused_reduce+qk_join"),
                                     (3, "prefetch_qk+fused_reduce+qk_join+o_asm"), (1, "reg_prefetch"),
                                     (1, "reg_prefetch+evict_first"), (1, "reg_prefetch+evict_last"))]
    return [AotKernel(f"gdn_decode_{name}", (lambda kw=kw: build(**kw)),
                      intended=("LDGSTS.E.BYPASS.128", "STG.E.128") if kw.get("stages") else ("LDG.E.128", "STG.E.128"),
                      language="triton", div16=div16 + (("ht",) if kw.get("inplace", True) is False else ()),
                      description="GDN decode, K = V = 128, HV = 32, pool in place") for name, kw in cases + persistent]
