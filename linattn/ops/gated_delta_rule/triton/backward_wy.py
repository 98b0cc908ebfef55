"""Backward stage 3: back through the WY representation (dV, the rest of dK, dbeta, dg), organised so that few
[64, 64] fp32 tiles are live at a time and the kernel runs as one warpgroup (4 warps) with full-width 64x64 WGMMAs.
sm_90a, H16/HV32 K=V=128 bf16: 255 registers, no spill at HV = 2H (218 registers at HV = H). Two devices keep it
from spilling: the gate vectors are loaded one element per thread (common.load_vec_compact), and the tile addresses
are made per phase through an opaque zero z0.

Per chunk and value head (gdn-math.md, "Backward"; dU = dVnew, dW from the local stage):

  phase 1  X = dW K^T (one accumulator over K blocks);  rs_w = colsum(Tinv * X) = rowsum(K * Tinv^T dW)
           X = X diag(exp gam) + dU V^T (the same accumulator over V blocks);  dV = diag(beta) Tinv^T dU
           dbeta = colsum(Tinv * X) = exp(gam) rs_w + rowsum(V * Tinv^T dU);  dTinv = strict_lower(X diag(beta))
  phase 2  D = strict_lower( -(Tinv^T (dTinv Tinv^T)) * Gam )     two [64, 64] products on the fp32 Tinv (DOT_PREC)
           K K^T (one accumulator over K blocks);  rs_d = rowsum(D * K K^T);  M = diag(beta) D;  rs_m = colsum(M * K K^T)
           M stored to a [64, 64] scratch tile and read back transposed: S = M + M^T, rounded to k's dtype
           dbeta += rs_d;  d gam = beta (exp(gam) rs_w + rs_d) - rs_m + the local stage's partials;
           dg = the in-chunk reverse cumsum of d gam; dg and dbeta stored here, before phase 3
  phase 3  per K block, one accumulator: dK = dk_part + S K + diag(beta exp gam) Tinv^T dW

Masking dTinv to its strictly lower part before the chain changes nothing in exact arithmetic (the upper part only
reaches the upper part of Tinv^T X Tinv^T, which the mask of D drops).

Precision: 16-bit products take Tinv and S = M + M^T rounded to k's dtype (S per value head), the dA chain runs on
the fp32 Tinv at DOT_PREC (TF32 for 16-bit inputs), and the gate terms use the fp32 K K^T; exp(gam) and beta scale
the fp32 dTinv accumulator, and the V part of dbeta uses the fp32 Tinv (colsum(Tinv * dU V^T)).

Grid (chunk slot, query/key head): the program walks the HV // H value heads of its group, one at a time, nothing
live from one head to the next. The group's dK is summed in dk_part (fp32, the local stage's partial dK, updated IN
PLACE for every head but the last, whose phase 3 writes dk in k's dtype): deterministic, no [T, HV, K] buffer.

Hazard (Triton 3.4-3.7 on Hopper, FLA issues 640/984): no tl.trans of a dot result anywhere. M^T goes through
memory: M is stored to the scratch tile, a barrier, then loaded with transposed addresses. The scratch is dk's own
[64, K] rows of this chunk and head when K >= 64 (dk is written last, by the last head's phase 3, after the last
read of the scratch; only valid rows are touched), else a [slots, H, 64, 64] buffer (M_IN_DK=False).

FLA's options (constexpr, compiled out at their defaults): beta_ptr is then the activated beta that the forward's
stage 2a stored, and dbeta is taken on to the logit before it is stored (BETA_SCALE); dg is taken on to the raw gate
input, with each chunk's sums of the per-token terms of dA_log and d dt_bias written at its slot for the launcher's sum
over the slots (GATE_IN_KERNEL, common.gate_chain).
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import (chunk_span, gate_chain, load_tile, load_vec_compact, slot_chunk,
                                                         store_tile, tile)



@triton.jit
def chunk_wy_bwd_kernel(
    k_ptr, v_ptr, beta_ptr, gcum_ptr, tinv_ptr,      # k [T_tot, H, K], v [T_tot, HV, V], beta/gcum [T_tot, HV], tinv fp32 [T_tot, HV, BT]
    dvnew_ptr, dw_ptr, dk_part_ptr, dgam_ptr,        # dvnew [T_tot, HV, V], dw [T_tot, HV, K], dk fp32 [T_tot, H, K] (updated in place when HV > H), dgam fp32 [NK, T_tot, HV]
    dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,               # outputs in k's, v's, g's and beta's dtypes
    m_ptr,                                           # scratch [slots, H, BT, BT] in k's dtype (unused when M_IN_DK)
    cu_ptr, chunk_idx_ptr, N, T_tot,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, NKP: tl.constexpr,
    M_IN_DK: tl.constexpr, DOT_PREC: tl.constexpr,
    g_raw_ptr=None, A_log_ptr=None, dt_bias_ptr=None,   # use_gate_in_kernel: raw g [T_tot, HV], A_log / dt_bias [HV]
    dgate_ptr=None,                                  # fp32 [2, slots, HV]: per-chunk dA_log and d dt_bias sums
    beta_raw_ptr=None,                               # FLA's use_beta_sigmoid_in_kernel: the beta logits [T_tot, HV]
    GATE_IN_KERNEL: tl.constexpr = False, HAS_DT_BIAS: tl.constexpr = False, BETA_SCALE: tl.constexpr = 0,
):
    p = tl.program_id(0)
    hk = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    G: tl.constexpr = HV // H
    if n >= N:                                 # surplus slot of the varlen bound: zero gate sums
        if GATE_IN_KERNEL:
            for j in range(0, G):
                tl.store(dgate_ptr + p * HV + hk * G + j, 0.)
                if HAS_DT_BIAS:
                    tl.store(dgate_ptr + (tl.num_programs(0) + p) * HV + hk * G + j, 0.)
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    nt = (eos - t0).to(tl.int32)               # valid rows of this chunk
    rows = tl.arange(0, BT)
    dt_op = k_ptr.dtype.element_ty
    if M_IN_DK:
        m_base = dk_ptr + t0 * H * K + hk * K      # dk's rows of this chunk and head: [BT, K >= BT], row stride H*K
        m_row = H * K
    else:
        m_base = m_ptr + (p.to(tl.int64) * H + hk) * BT * BT
        m_row = BT

    for j in range(0, G):
        hv = hk * G + j
        # nt reloaded per head, so that no mask or tile address below is hoisted out of the head loop and kept live
        nt = (tl.load(cu_ptr + n + 1) - t0).to(tl.int32)
        valid = rows < nt
        # rows past the chunk's end read the last valid row's gate (finite exp(gam_i - gam_j)); no [BT, BT] validity
        # mask is needed: every tile loads zeros there, so dTinv, dA and D are exactly zero in those rows and columns
        r_gate = (t0 + tl.minimum(rows, nt - 1)) * HV

        # ---- phase 1: dTinv in one accumulator; the K part's colsum(Tinv * dW K^T) first; dV
        # z0 == 0 (cu[n + 1] is eos), reloaded per phase: the compiler cannot prove it, so every tile's [64, 64]
        # addresses and masks offset by it are computed in their phase, not hoisted out of the head loop or shared
        # between phases and kept live (the loop-invariant addresses were the rest of the spill)
        z0 = (tl.load(cu_ptr + n + 1) - eos).to(tl.int32)
        p_tinv, m_tinv = tile(tinv_ptr + (t0 * HV + hv) * BT, z0, 0, nt, BT, HV * BT, BT, BT, CHECK_COLS=False)
        dtinv = tl.zeros([BT, BT], dtype=tl.float32)
        for kb in range(0, NK):
            b_k = load_tile(k_ptr + t0 * H * K + hk * K, z0, kb * BK, nt, K, H * K, BT, BK)
            b_dw = load_tile(dw_ptr + t0 * HV * K + hv * K, z0, kb * BK, nt, K, HV * K, BT, BK)
            dtinv += tl.dot(b_dw, tl.trans(b_k), input_precision=DOT_PREC)
        rs_w = tl.sum(tl.load(p_tinv, mask=m_tinv, other=0.) * dtinv, axis=0)       # rowsum(K * Tinv^T dW)
        dtinv = dtinv * tl.exp(load_vec_compact(gcum_ptr + r_gate + hv, rows < BT, BT))[None, :]
        tinv_op = tl.load(p_tinv, mask=m_tinv, other=0.).to(dt_op)
        for vb in range(0, tl.cdiv(V, BV)):
            b_v = load_tile(v_ptr + t0 * HV * V + hv * V, z0, vb * BV, nt, V, HV * V, BT, BV)
            b_dvn = load_tile(dvnew_ptr + t0 * HV * V + hv * V, z0, vb * BV, nt, V, HV * V, BT, BV)
            dtinv += tl.dot(b_dvn, tl.trans(b_v), input_precision=DOT_PREC)
            tdu = tl.dot(tl.trans(tinv_op), b_dvn.to(dt_op), input_precision=DOT_PREC)      # Tinv^T dU
            beta_r = load_vec_compact(beta_ptr + (t0 + rows) * HV + hv, valid, BT).to(tl.float32)
            store_tile(dv_ptr + t0 * HV * V + hv * V, (tdu * beta_r[:, None]).to(dv_ptr.dtype.element_ty), z0, vb * BV,
                       nt, V, HV * V)
        # colsum(Tinv * (dW K^T diag(exp gam) + dU V^T)) = exp(gam) rowsum(K * Tinv^T dW) + rowsum(V * Tinv^T dU)
        dbeta = tl.sum(tl.load(p_tinv, mask=m_tinv, other=0.) * dtinv, axis=0)
        beta_c = load_vec_compact(beta_ptr + (t0 + rows) * HV + hv, valid, BT).to(tl.float32)
        dtinv = tl.where(rows[:, None] > (rows + z0)[None, :], dtinv * beta_c[None, :], 0.)

        z0 = (tl.load(cu_ptr + n + 1) - eos).to(tl.int32)
        p_tinv, m_tinv = tile(tinv_ptr + (t0 * HV + hv) * BT, z0, 0, nt, BT, HV * BT, BT, BT, CHECK_COLS=False)
        # ---- phase 2: D = -(Tinv^T dTinv Tinv^T) * Gam (fp32 Tinv, DOT_PREC); K K^T; M = diag(beta) D; S = M + M^T
        tinv = tl.load(p_tinv, mask=m_tinv, other=0.)
        z = tl.dot(dtinv, tl.trans(tinv), input_precision=DOT_PREC)                # dTinv Tinv^T
        da = tl.dot(tl.trans(tinv), z, input_precision=DOT_PREC)                   # Tinv^T dTinv Tinv^T
        gam_r = load_vec_compact(gcum_ptr + r_gate + hv, rows < BT, BT)
        gam_c = load_vec_compact(gcum_ptr + r_gate + hv, rows < BT, BT)
        # masked before exp: above the diagonal gam_i - gam_j > 0 could overflow for very negative g
        lower = rows[:, None] > (rows + z0)[None, :]
        d = tl.where(lower, -da * tl.exp(tl.where(lower, gam_r[:, None] - gam_c[None, :], 0.)), 0.)
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        for kb in range(0, NK):
            b_k = load_tile(k_ptr + t0 * H * K + hk * K, z0, kb * BK, nt, K, H * K, BT, BK)
            kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
        rs_d = tl.sum(d * kk, axis=1)                   # rowsum(D * K K^T)
        m = d * load_vec_compact(beta_ptr + (t0 + rows) * HV + hv, valid, BT).to(tl.float32)[:, None]
        rs_m = tl.sum(m * kk, axis=0)                   # colsum(M * K K^T)
        store_tile(m_base, m.to(dt_op), z0, 0, nt if M_IN_DK else BT, BT, m_row, CHECK_COLS=False)
        tl.debug_barrier()
        # M^T: element (i, j) is M_ji, read back with transposed addresses (a loaded tile, not a transposed dot result):
        # unit stride down the tile's rows, m_row across its columns, only the columns (M's rows) bounds-checked
        mc = (z0 + rows).to(tl.int64)
        m_t = tl.load(m_base + rows[:, None] + mc[None, :] * m_row, mask=mc[None, :] < (nt if M_IN_DK else BT),
                      other=0.)
        s_op = (m + m_t.to(tl.float32)).to(dt_op)
        tl.debug_barrier()           # every read of the scratch precedes phase 3's dk stores (M_IN_DK)

        # dg and dbeta are complete here: stored before phase 3, so no gate vector lives through it
        beta = load_vec_compact(beta_ptr + (t0 + rows) * HV + hv, valid, BT).to(tl.float32)
        dbeta += rs_d
        dgam = beta * (tl.exp(load_vec_compact(gcum_ptr + r_gate + hv, rows < BT, BT)) * rs_w + rs_d) - rs_m
        for kb in range(0, NKP):
            dgam += tl.load(dgam_ptr + (kb * T_tot + t0 + rows) * HV + hv, mask=valid, other=0.)
        # dg_i = sum_{j >= i in the chunk} d gam_j (gam is the in-chunk cumsum of g)
        dg = tl.sum(tl.where(rows[None, :] >= (rows + z0)[:, None], dgam[None, :], 0.), axis=1)
        if GATE_IN_KERNEL:
            dg = gate_chain(dg, g_raw_ptr, A_log_ptr, dt_bias_ptr, dgate_ptr, t0 + z0 + rows, valid, hv, p,
                            tl.num_programs(0), HV, BT, HAS_DT_BIAS)
        if BETA_SCALE != 0:
            # d/dx of BETA_SCALE * sigmoid(x) = BETA_SCALE sigmoid(x) sigmoid(-x), from the logit (no 1 - sigmoid
            # cancellation where the sigmoid is near 1)
            xb = load_vec_compact(beta_raw_ptr + (t0 + rows) * HV + hv, valid, BT).to(tl.float32)
            dbeta = dbeta * (BETA_SCALE * tl.sigmoid(xb) * tl.sigmoid(-xb))
        tl.store(dg_ptr + (t0 + z0 + rows) * HV + hv, dg.to(dg_ptr.dtype.element_ty), mask=valid)
        tl.store(dbeta_ptr + (t0 + z0 + rows) * HV + hv, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)

        z0 = (tl.load(cu_ptr + n + 1) - eos).to(tl.int32)
        p_tinv, m_tinv = tile(tinv_ptr + (t0 * HV + hv) * BT, z0, 0, nt, BT, HV * BT, BT, BT, CHECK_COLS=False)
        # ---- phase 3: dK = dk_part + S K + diag(beta exp gam) Tinv^T dW (group sum in dk_part)
        tinv_op = tl.load(p_tinv, mask=m_tinv, other=0.).to(dt_op)
        for kb in range(0, NK):
            p_dkp, m_dkp = tile(dk_part_ptr + t0 * H * K + hk * K, z0, kb * BK, nt, K, H * K, BT, BK)
            b_k = load_tile(k_ptr + t0 * H * K + hk * K, z0, kb * BK, nt, K, H * K, BT, BK)
            b_dw = load_tile(dw_ptr + t0 * HV * K + hv * K, z0, kb * BK, nt, K, HV * K, BT, BK)
            acc = tl.dot(s_op, b_k.to(dt_op), tl.load(p_dkp, mask=m_dkp, other=0.), input_precision=DOT_PREC)
            tdw = tl.dot(tl.trans(tinv_op), b_dw.to(dt_op), input_precision=DOT_PREC)      # Tinv^T dW
            bg = load_vec_compact(beta_ptr + (t0 + rows) * HV + hv, valid, BT).to(tl.float32) * tl.exp(
                load_vec_compact(gcum_ptr + r_gate + hv, rows < BT, BT))
            acc += tdw * bg[:, None]
            if j == G - 1:
                store_tile(dk_ptr + t0 * H * K + hk * K, acc.to(dk_ptr.dtype.element_ty), z0, kb * BK, nt, K, H * K)
            else:
                tl.store(p_dkp, acc, mask=m_dkp)

        tl.debug_barrier()           # dk_part of this head is visible to the next head's loads


WARPS_WY = 4          # one warpgroup: full-width 64x64 WGMMAs
STAGES_WY = 1         # sm_90a, H16/HV32 K=V=128 bf16: 1 stage no spill, 2 stages 236 B

