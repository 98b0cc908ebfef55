"""Stage 3 of the forward (gdn-math.md): the sequential state pass over the chunks of one sequence.

Per chunk, with S the state at the chunk's start (fp32, in registers):
    h[chunk] = S                                   (stored in the operand dtype for the output stage)
    Vnew     = U - W S
    S        = exp(gam_C) S + K^T (diag(exp(gam_C - gam)) Vnew)
or, with DECAY "channel" (KDA's per-key-channel decays, gam [.., K]): S = diag(exp(gam_C)) S + (K * exp(gam_C -
gam))^T Vnew, the decayed keys precomputed by KDA's intra kernel.
One program per (V block, sequence * value head), numbered on grid axis 0 (V blocks fastest); the [K, BV] state
never leaves registers. Splitting V across
programs is exact (columns of S are independent) and fills more SMs when N * HV is small.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import (load_tile, sequence_span, state_program, state_tile,
                                                       store_tile)


@triton.jit
def state_chunk_inputs(k_ptr, w_ptr, u_ptr, gcum_ptr, t0, eos, hv, hk, vb,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr):
    """W [BT, BK], U [BT, BV] (fp32), K [BT, BK] of the chunk starting at token t0 (rows past eos zero), its gam [BT]
    (0 past eos) and gam_C (the last valid row's). DECAY "channel" (KDA): gcum is [T_tot, HV, K] and k_ptr holds
    the decayed keys K * exp(gam_C - gam) per value head (H = HV); gam_C is the last row's [BK] (and gam, unused)."""
    rows = tl.arange(0, BT)
    b_w = load_tile(w_ptr + t0 * HV * K + hv * K, 0, 0, eos - t0, K, HV * K, BT, BK)
    b_u = load_tile(u_ptr + t0 * HV * V + hv * V, 0, vb * BV, eos - t0, V, HV * V, BT, BV).to(tl.float32)
    b_k = load_tile(k_ptr + t0 * H * K + hk * K, 0, 0, eos - t0, K, H * K, BT, BK)
    if DECAY == "scalar":
        valid = (t0 + rows) < eos
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
        last = tl.minimum(eos - t0, BT) - 1
        gam_last = tl.load(gcum_ptr + (t0 + last) * HV + hv)
    else:
        last = tl.minimum(eos - t0, BT) - 1
        rk = tl.arange(0, BK)
        gam_last = tl.load(gcum_ptr + ((t0 + last) * HV + hv) * K + rk, mask=rk < K, other=0.)
        gam = gam_last                # unused by state_update's channel form (a None would not compile)
    return b_w, b_u, b_k, gam, gam_last


@triton.jit
def state_update(s, b_k, vnew, gam, gam_last, DOT_PREC: tl.constexpr, DECAY: tl.constexpr):
    """S_next = exp(gam_C) S + K^T (diag(exp(gam_C - gam)) Vnew), Vnew fp32 [BT, BV] rounded once to K's dtype after
    the scaling (FLA's and chunk_fused_wu_ws's form). The decay goes on Vnew's rows, not on K's: K^T then comes
    straight from the loaded tile (a transposed operand of the product) instead of a scaled [BK, BT] copy written to
    shared memory on every chunk (forward 1.03-1.14x, benchmarks/HISTORY.md). Rows past the sequence end: Vnew is 0
    there (U and W zero-filled) and so is K. DECAY "channel" (KDA): the keys come decayed (state_chunk_inputs) and
    the state's rows decay by exp(gam_C) [BK]: S_next = diag(exp(gam_C)) S + K_dec^T Vnew."""
    if DECAY == "scalar":
        vdec = (vnew * tl.exp(gam_last - gam)[:, None]).to(b_k.dtype)
        return s * tl.exp(gam_last) + tl.dot(tl.trans(b_k), vdec, input_precision=DOT_PREC)
    else:
        return s * tl.exp(gam_last)[:, None] + tl.dot(tl.trans(b_k), vnew.to(b_k.dtype), input_precision=DOT_PREC)


@triton.jit
def chunk_state_fwd_kernel(
    k_ptr, w_ptr, u_ptr, gcum_ptr,             # k [T_tot, H, K], w [T_tot, HV, K], u [T_tot, HV, V], gcum [T_tot, HV]
    h_ptr, vnew_ptr,                           # h [slots, HV, K, V] (chunk-start states), vnew [T_tot, HV, V]
    h0_ptr, ht_ptr,                            # initial / final state [N, HV, K, V] fp32
    cu_ptr, chunk_off_ptr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
    V_FIRST: tl.constexpr = False,       # h0 / ht stored [N, HV, V, K] (FLA's state_v_first)
    DECAY: tl.constexpr = "scalar",
):
    """DECAY: "scalar" (GDN) or "channel" (KDA: k_ptr the decayed keys [T_tot, HV, K] with H = HV, gcum
    [T_tot, HV, K]; state_chunk_inputs / state_update)."""
    n, hv, vb = state_program(HV, V, BV)
    hk = hv // (HV // H)
    bos, eos, slot0, nchunks = sequence_span(cu_ptr, chunk_off_ptr, n, BT)

    rk, rv, mkv, state_off = state_tile(n, hv, vb, HV, K, V, BK, BV, V_FIRST)
    if USE_H0:
        s = tl.load(h0_ptr + state_off, mask=mkv, other=0.).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)

    for c in range(0, nchunks):
        t0 = bos + c * BT
        slot = (slot0 + c).to(tl.int64)
        tl.store(h_ptr + (slot * HV + hv) * K * V + rk[:, None] * V + rv[None, :],
                 s.to(h_ptr.dtype.element_ty), mask=mkv)
        b_w, b_u, b_k, gam, gam_last = state_chunk_inputs(k_ptr, w_ptr, u_ptr, gcum_ptr, t0, eos, hv, hk, vb,
                                                          H, HV, K, V, BT, BK, BV, DECAY)
        vnew = b_u - tl.dot(b_w, s.to(b_w.dtype), input_precision=DOT_PREC)
        store_tile(vnew_ptr + t0 * HV * V + hv * V, vnew.to(vnew_ptr.dtype.element_ty), 0, vb * BV, eos - t0, V, HV * V)
        s = state_update(s, b_k, vnew, gam, gam_last, DOT_PREC, DECAY)

    if STORE_HT:
        tl.store(ht_ptr + state_off, s, mask=mkv)
