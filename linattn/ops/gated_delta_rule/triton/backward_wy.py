"""Backward stage 3 (gdn-math.md, "Backward", last paragraph): back through the WY representation, per chunk,

    W = Tinv diag(beta exp(gam)) K,   U = Tinv diag(beta) V,   Tinv = (I + A)^-1,
    A = strict_lower(diag(beta) K K^T * Gam)
with dU = dVnew (backward_state.py) and dW = -dVnew S^T (backward_local.py):
    dV     = diag(beta) Tinv^T dU                      dbeta += rowsum(V * Tinv^T dU)
    dK    += diag(beta exp(gam)) Tinv^T dW             dbeta, d gam += (1, beta) * exp(gam) rowsum(K * Tinv^T dW)
    dTinv  = dW (diag(beta exp gam) K)^T + dU (diag(beta) V)^T
    dA     = -Tinv^T dTinv Tinv^T, strictly lower      M = dA * Gam * beta_i
    dK    += M K + M^T K                               dbeta_i += rowsum(dA * KK^T * Gam)
    d gam += rowsum(dA * A) - colsum(dA * A)
then dg = the reverse cumulative sum of d gam inside the chunk (d gam also holds the local stage's partials).

rowsum(K * Tinv^T dW)_i = sum_m Tinv_mi (dW K^T)_mi, so dW K^T (needed for dTinv anyway) gives it without a
second pass over K.

One program per (chunk slot, query/key head), walking the HV // H value heads of the group: M + M^T of the group
is summed as a [C, C] matrix (K is shared), so dK leaves the program once, summed over the group, without a
[T, HV, K] intermediate.

Hazard (Triton 3.4-3.7 on Hopper, FLA issues 640/984): M^T must not be tl.trans(M) (M comes from dot results
in registers). dTinv^T = (diag(beta exp gam) K) dW^T + (diag(beta) V) dU^T is accumulated directly from loaded
tiles and dA^T = -Tinv dTinv^T Tinv computed with Tinv loaded from memory; every tl.trans is of a loaded tile.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, slot_chunk


@triton.jit
def chunk_wy_bwd_kernel(
    k_ptr, v_ptr, beta_ptr, gcum_ptr, tinv_ptr,      # k [T_tot, H, K], v [T_tot, HV, V], beta/gcum [T_tot, HV], tinv fp32 [T_tot, HV, BT]
    dvnew_ptr, dw_ptr, dk_part_ptr, dgam_ptr,        # dvnew [T_tot, HV, V], dw [T_tot, HV, K], dk fp32 [T_tot, H, K], dgam fp32 [NK, T_tot, HV]
    dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,               # outputs in k's, v's, g's and beta's dtypes
    cu_ptr, chunk_idx_ptr, N, T_tot,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    p = tl.program_id(0)
    hk = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    G: tl.constexpr = HV // H
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos
    both = valid[:, None] & valid[None, :]
    slower = (rows[:, None] > rows[None, :]) & both
    supper = (rows[:, None] < rows[None, :]) & both
    dt_op = k_ptr.dtype.element_ty

    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(0, NK):
        p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)

    msum = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(0, G):
        hv = hk * G + j
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
        beta = tl.load(beta_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.).to(tl.float32)
        tinv = tl.load(tinv_ptr + ((t0 + rows) * HV + hv)[:, None] * BT + rows[None, :], mask=valid[:, None], other=0.)
        tinv_op = tinv.to(dt_op)
        bg = beta * tl.exp(gam)

        # dTinv = dW (diag(bg) K)^T + dU (diag(beta) V)^T and its transpose, both accumulated from loaded tiles
        dtinv = tl.zeros([BT, BT], dtype=tl.float32)
        dtinvt = tl.zeros([BT, BT], dtype=tl.float32)
        tcol = tl.zeros([BT], dtype=tl.float32)           # sum_m Tinv_mi (dW K^T)_mi
        for kb in range(0, NK):
            p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
            p_dw = tl.make_block_ptr(dw_ptr + t0 * HV * K + hv * K, (eos - t0, K), (HV * K, 1), (0, kb * BK), (BT, BK), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_dw = tl.load(p_dw, boundary_check=(0, 1))
            dwk = tl.dot(b_dw, tl.trans(b_k), input_precision=DOT_PREC)
            tcol += tl.sum(tinv * dwk, axis=0)
            dtinv += dwk * bg[None, :]
            dtinvt += tl.dot(b_k, tl.trans(b_dw), input_precision=DOT_PREC) * bg[:, None]
        dbeta = tl.zeros([BT], dtype=tl.float32)
        for vb in range(0, tl.cdiv(V, BV)):
            p_v = tl.make_block_ptr(v_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
            p_dvn = tl.make_block_ptr(dvnew_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
            b_v = tl.load(p_v, boundary_check=(0, 1))
            b_dvn = tl.load(p_dvn, boundary_check=(0, 1))
            vbeta = (b_v.to(tl.float32) * beta[:, None]).to(b_v.dtype)
            dtinv += tl.dot(b_dvn, tl.trans(vbeta), input_precision=DOT_PREC)
            dtinvt += tl.dot(vbeta, tl.trans(b_dvn), input_precision=DOT_PREC)
            tdu = tl.dot(tl.trans(tinv_op), b_dvn.to(dt_op), input_precision=DOT_PREC)     # Tinv^T dU
            dbeta += tl.sum(b_v.to(tl.float32) * tdu, axis=1)
            p_dv = tl.make_block_ptr(dv_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
            tl.store(p_dv, (tdu * beta[:, None]).to(dv_ptr.dtype.element_ty), boundary_check=(0, 1))

        t = tl.exp(gam) * tcol                             # exp(gam_i) rowsum(K * Tinv^T dW)_i
        dbeta += t
        dgam = beta * t
        # dA = -Tinv^T dTinv Tinv^T and dA^T = -Tinv dTinv^T Tinv, each from Tinv as loaded (fp32 chain)
        da = -tl.dot(tl.dot(tl.trans(tinv), dtinv, input_precision=DOT_PREC), tl.trans(tinv), input_precision=DOT_PREC)
        dat = -tl.dot(tl.dot(tinv, dtinvt, input_precision=DOT_PREC), tinv, input_precision=DOT_PREC)
        # Gam masked before exp, strictly lower / strictly upper
        gl = tl.exp(tl.where(slower, gam[:, None] - gam[None, :], 0.))
        gu = tl.exp(tl.where(supper, gam[None, :] - gam[:, None], 0.))
        da = tl.where(slower, da * gl, 0.)                 # dA * Gam
        dat = tl.where(supper, dat * gu, 0.)               # (dA * Gam)^T
        m = da * beta[:, None]
        msum += m + dat * beta[None, :]
        dbeta += tl.sum(da * kk, axis=1)
        daa = m * kk                                       # dA * A
        dgam += tl.sum(daa, axis=1) - tl.sum(daa, axis=0)
        for kb in range(0, NK):
            dgam += tl.load(dgam_ptr + (kb * T_tot + t0 + rows) * HV + hv, mask=valid, other=0.)
        # dg_i = sum_{j >= i in the chunk} d gam_j (gam is the in-chunk cumsum of g)
        dg = tl.sum(tl.where(rows[None, :] >= rows[:, None], dgam[None, :], 0.), axis=1)
        tl.store(dg_ptr + (t0 + rows) * HV + hv, dg.to(dg_ptr.dtype.element_ty), mask=valid)
        tl.store(dbeta_ptr + (t0 + rows) * HV + hv, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)

    msum_op = msum.to(dt_op)
    for kb in range(0, NK):
        p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        p_dkp = tl.make_block_ptr(dk_part_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        acc = tl.load(p_dkp, boundary_check=(0, 1)) + tl.dot(msum_op, b_k, input_precision=DOT_PREC)
        for j in range(0, G):
            hv = hk * G + j
            gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
            beta = tl.load(beta_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.).to(tl.float32)
            tinv = tl.load(tinv_ptr + ((t0 + rows) * HV + hv)[:, None] * BT + rows[None, :], mask=valid[:, None], other=0.)
            p_dw = tl.make_block_ptr(dw_ptr + t0 * HV * K + hv * K, (eos - t0, K), (HV * K, 1), (0, kb * BK), (BT, BK), (1, 0))
            b_dw = tl.load(p_dw, boundary_check=(0, 1))
            tdw = tl.dot(tl.trans(tinv.to(dt_op)), b_dw.to(dt_op), input_precision=DOT_PREC)     # Tinv^T dW
            acc += tdw * (beta * tl.exp(gam))[:, None]
        p_dk = tl.make_block_ptr(dk_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        tl.store(p_dk, acc.to(dk_ptr.dtype.element_ty), boundary_check=(0, 1))
