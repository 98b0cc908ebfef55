"""Backward stage 1 (gdn-math.md, "Backward"): the reverse state pass over the chunks of one sequence.

Per chunk, walked last to first, with dS the gradient flowing into this chunk's S_next (fp32, in registers;
it starts at d final_state, or zero):
    dh[chunk] = dS                                                  (stored for the local stage)
    dVnew     = P^T dO + diag(exp(gam_C - gam)) K dS,   P = (scale Q K^T) * Gam * lower_incl
    dS        = exp(gam_C) dS + (diag(exp(gam)) scale Q)^T dO - W^T dVnew
and dh0 = dS after the first chunk. P^T dO does not depend on dS: backward_dv_local.py writes it into dvnew
beforehand (in parallel), and this pass adds the state term in place. One program per (V block, sequence * value
head), numbered on grid axis 0 (V blocks fastest); every line above is column-separable in V, so splitting V across
programs is exact (as in the forward).
STORE_DH=False writes only dh0 (neither dh nor the state term of dvnew): the context-parallel boundary summary
(linattn/distributed/chunk.py), a pass whose incoming dS is not the true one yet.

Hazard (Triton 3.4-3.7 on Hopper, FLA issues 640/984): tl.trans of a dot result still in registers fed to
another tl.dot is miscompiled; every tl.trans below is of a loaded tile (Q scaled, W).
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import load_tile, sequence_span, state_program, state_tile, tile


@triton.jit
def chunk_state_bwd_kernel(
    q_ptr, k_ptr, w_ptr, gcum_ptr, do_ptr,     # q, k [T_tot, H, K], w [T_tot, HV, K], gcum [T_tot, HV], do [T_tot, HV, V]
    dh_ptr, dvnew_ptr,                         # dh [slots, HV, K, V] (gradient into each chunk's S_next), dvnew [T_tot, HV, V]
    dht_ptr, dh0_ptr,                          # d final_state (any float) / d initial_state (fp32) [N, HV, K, V]
    cu_ptr, chunk_off_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, STORE_DH: tl.constexpr, DOT_PREC: tl.constexpr,
    V_FIRST: tl.constexpr = False,       # dht / dh0 stored [N, HV, V, K] (FLA's state_v_first)
    DECAY: tl.constexpr = "scalar",
):
    """DECAY "channel" (KDA's per-key-channel decays): q_ptr and k_ptr hold Q * exp(gam) and K * exp(gam_C - gam)
    per value head (H = HV, KDA's intra kernel), gcum is [T_tot, HV, K], and dS decays by rows:
    dS <- diag(exp(gam_C)) dS + ..."""
    n, hv, vb = state_program(HV, V, BV)
    hk = hv // (HV // H)
    bos, eos, slot0, nchunks = sequence_span(cu_ptr, chunk_off_ptr, n, BT)

    rk, rv, mkv, state_off = state_tile(n, hv, vb, HV, K, V, BK, BV, V_FIRST)
    if USE_DHT:
        ds = tl.load(dht_ptr + state_off, mask=mkv, other=0.).to(tl.float32)
    else:
        ds = tl.zeros([BK, BV], dtype=tl.float32)

    rows = tl.arange(0, BT)
    for cc in range(0, nchunks):
        c = nchunks - 1 - cc
        t0 = bos + c * BT
        slot = (slot0 + c).to(tl.int64)
        if STORE_DH:
            tl.store(dh_ptr + (slot * HV + hv) * K * V + rk[:, None] * V + rv[None, :],
                     ds.to(dh_ptr.dtype.element_ty), mask=mkv)
        b_q = load_tile(q_ptr + t0 * H * K + hk * K, 0, 0, eos - t0, K, H * K, BT, BK)
        b_k = load_tile(k_ptr + t0 * H * K + hk * K, 0, 0, eos - t0, K, H * K, BT, BK)
        b_w = load_tile(w_ptr + t0 * HV * K + hv * K, 0, 0, eos - t0, K, HV * K, BT, BK)
        b_do = load_tile(do_ptr + t0 * HV * V + hv * V, 0, vb * BV, eos - t0, V, HV * V, BT, BV)
        if DECAY == "scalar":
            valid = (t0 + rows) < eos
            gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
            last = tl.minimum(eos - t0, BT) - 1
            gam_last = tl.load(gcum_ptr + (t0 + last) * HV + hv)
            # rows past the sequence end: k was zero-filled and gam is 0 there, so they stay zero
            kdec = (b_k.to(tl.float32) * tl.exp(gam_last - gam)[:, None]).to(b_k.dtype)
        else:
            last = tl.minimum(eos - t0, BT) - 1
            gam_last = tl.load(gcum_ptr + ((t0 + last) * HV + hv) * K + rk, mask=rk < K, other=0.)
            kdec = b_k
        p_dvn, m_dvn = tile(dvnew_ptr + t0 * HV * V + hv * V, 0, vb * BV, eos - t0, V, HV * V, BT, BV)
        # in place: this program alone reads and then writes this tile of dvnew (P^T dO from the dv_local stage)
        dvnew = tl.load(p_dvn, mask=m_dvn, other=0.).to(tl.float32) \
            + tl.dot(kdec, ds.to(b_k.dtype), input_precision=DOT_PREC)
        dvnew_op = dvnew.to(dvnew_ptr.dtype.element_ty)
        if STORE_DH:
            tl.store(p_dvn, dvnew_op, mask=m_dvn)

        if DECAY == "scalar":
            qg = (b_q.to(tl.float32) * (tl.exp(gam) * scale)[:, None]).to(b_q.dtype)
            ds = ds * tl.exp(gam_last) + tl.dot(tl.trans(qg), b_do, input_precision=DOT_PREC) \
                - tl.dot(tl.trans(b_w), dvnew_op.to(b_w.dtype), input_precision=DOT_PREC)
        else:
            qg = (b_q.to(tl.float32) * scale).to(b_q.dtype)
            ds = ds * tl.exp(gam_last)[:, None] + tl.dot(tl.trans(qg), b_do, input_precision=DOT_PREC) \
                - tl.dot(tl.trans(b_w), dvnew_op.to(b_w.dtype), input_precision=DOT_PREC)

    if STORE_DH0:
        tl.store(dh0_ptr + state_off, ds, mask=mkv)
