"""Backward stage 2 (gdn-math.md, "Backward"): the chunk-parallel local terms, per chunk,

    dQ  = scale ( diag(exp(gam)) dO S^T + (dP * Gam * lower_incl) K ),           dP = dO Vnew^T
    dK' = scale (dP * Gam * lower_incl)^T Q + diag(exp(gam_C - gam)) Vnew dS^T   (the WY stage adds the rest)
    dW  = -dVnew S^T
and the gate terms of O and S_next (d gam_i, before the in-chunk reverse cumsum):
    O's inter-chunk part    exp(gam_i) scale (dO S^T)_i . q_i
    P = scale QK^T * Gam    rowsum_i(dP * P) - colsum_i(dP * P)
    S_next                  -x_i, and x_sum + exp(gam_C) sum(dS * S) on the chunk's last row,
                            x_i = exp(gam_C - gam_i) k_i . (Vnew dS^T)_i
S is the chunk-start state h, dS the gradient into S_next (dh, from backward_state.py).

One program per (K block, chunk slot, query/key head). GVA: the program walks the HV // H value heads that read
its q/k head and sums their dQ, dK' in registers, so no [T, HV, K] intermediate is needed for them. Every gate
term is a sum over K, so each K block writes its own partial row of dgam ([NK, T_tot, HV], summed later).

Hazard (Triton 3.4-3.7 on Hopper, FLA issues 640/984): (dP * Gam)^T is needed for dK'. Instead of tl.trans of
the dot result dP, dP^T = Vnew dO^T is accumulated directly from loaded tiles.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, slot_chunk


@triton.jit
def chunk_local_bwd_kernel(
    q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr,   # q, k [T_tot, H, K], vnew [T_tot, HV, V], h [slots, HV, K, V], gcum [T_tot, HV]
    do_ptr, dvnew_ptr, dh_ptr,                 # do, dvnew [T_tot, HV, V], dh [slots, HV, K, V]
    dq_ptr, dk_ptr, dw_ptr, dgam_ptr,          # dq [T_tot, H, K] (q dtype), dk fp32 [T_tot, H, K], dw [T_tot, HV, K], dgam fp32 [NK, T_tot, HV]
    cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, T_tot, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    kb = tl.program_id(0)
    p = tl.program_id(1)
    hk = tl.program_id(2)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    slot = (tl.load(chunk_off_ptr + n) + c).to(tl.int64)
    G: tl.constexpr = HV // H
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos
    last = tl.minimum(eos - t0, BT) - 1

    p_q = tl.make_block_ptr(q_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)       # this K block's share of Q K^T
    lower = (rows[:, None] >= rows[None, :]) & valid[:, None] & valid[None, :]
    upper = (rows[:, None] <= rows[None, :]) & valid[:, None] & valid[None, :]

    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(0, G):
        hv = hk * G + j
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
        gam_last = tl.load(gcum_ptr + (t0 + last) * HV + hv)
        dp = tl.zeros([BT, BT], dtype=tl.float32)
        dpt = tl.zeros([BT, BT], dtype=tl.float32)
        dos = tl.zeros([BT, BK], dtype=tl.float32)
        dks = tl.zeros([BT, BK], dtype=tl.float32)
        dw = tl.zeros([BT, BK], dtype=tl.float32)
        sds = tl.zeros([BK], dtype=tl.float32)
        for vb in range(0, tl.cdiv(V, BV)):
            p_do = tl.make_block_ptr(do_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
            p_vn = tl.make_block_ptr(vnew_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
            p_dvn = tl.make_block_ptr(dvnew_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
            p_h = tl.make_block_ptr(h_ptr + (slot * HV + hv) * K * V, (K, V), (V, 1), (kb * BK, vb * BV), (BK, BV), (1, 0))
            p_dh = tl.make_block_ptr(dh_ptr + (slot * HV + hv) * K * V, (K, V), (V, 1), (kb * BK, vb * BV), (BK, BV), (1, 0))
            b_do = tl.load(p_do, boundary_check=(0, 1))
            b_vn = tl.load(p_vn, boundary_check=(0, 1))
            b_dvn = tl.load(p_dvn, boundary_check=(0, 1))
            b_h = tl.load(p_h, boundary_check=(0, 1))
            b_dh = tl.load(p_dh, boundary_check=(0, 1))
            dp += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
            dpt += tl.dot(b_vn, tl.trans(b_do), input_precision=DOT_PREC)
            dos += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
            dks += tl.dot(b_vn, tl.trans(b_dh), input_precision=DOT_PREC)
            dw += tl.dot(b_dvn, tl.trans(b_h), input_precision=DOT_PREC)
            sds += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), axis=1)
        # Gam and its transpose, masked before exp (gam is 0 on rows past the end; see intra_chunk.py)
        gl = tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.))
        gu = tl.exp(tl.where(upper, gam[None, :] - gam[:, None], 0.))
        pm = tl.where(lower, dp * gl, 0.)
        pmt = tl.where(upper, dpt * gu, 0.)
        dq_inter = dos * (tl.exp(gam) * scale)[:, None]
        dq += dq_inter + tl.dot(pm.to(b_k.dtype), b_k, input_precision=DOT_PREC) * scale
        dks = dks * tl.exp(gam_last - gam)[:, None]
        dk += tl.dot(pmt.to(b_q.dtype), b_q, input_precision=DOT_PREC) * scale + dks

        dpp = pm * qk * scale                                       # dP * P (this K block's share)
        x = tl.sum(dks * b_k.to(tl.float32), axis=1)
        dgam = tl.sum(dq_inter * b_q.to(tl.float32), axis=1) + tl.sum(dpp, axis=1) - tl.sum(dpp, axis=0) - x
        dgam += tl.where(rows == last, tl.sum(x, axis=0) + tl.exp(gam_last) * tl.sum(sds, axis=0), 0.)
        tl.store(dgam_ptr + (kb * T_tot + t0 + rows) * HV + hv, dgam, mask=valid)
        p_dw = tl.make_block_ptr(dw_ptr + t0 * HV * K + hv * K, (eos - t0, K), (HV * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        tl.store(p_dw, (-dw).to(dw_ptr.dtype.element_ty), boundary_check=(0, 1))

    p_dq = tl.make_block_ptr(dq_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
    tl.store(p_dq, dq.to(dq_ptr.dtype.element_ty), boundary_check=(0, 1))
    p_dk = tl.make_block_ptr(dk_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
    tl.store(p_dk, dk, boundary_check=(0, 1))
