"""The fused backward (gdn-math.md, "Backward"): one kernel replaces stages 1a, 1, 2 and 3 of backward.py.

One program per (sequence, value head, V block) walks the chunks of its sequence last to first with dS, the gradient
flowing into the chunk's S_next, in registers ([BK, BV] fp32; it starts at d final_state, or zero). Per chunk it reads
q, k [BT, K] (its query/key head), v, dO [BT, BV], gam, beta [BT], Tinv [BT, BT] (fp32, the recompute's) and S = h
[K, BV] (the recomputed chunk-start state) and writes only dv, the q/k gradients, dg and dbeta; dh0 after the first
chunk. With Qs = scale Q, eg = exp(gam), gam_C the chunk's last valid gam:

  X     = V - diag(eg) K S,   Vnew = Tinv diag(beta) X               (the gate-free form: no W, no U)
  dVnew = P^T dO + diag(exp(gam_C - gam)) K dS,   P = (Qs K^T) * Gam * lower_incl
  Y     = Tinv^T dVnew,  dV = diag(beta) Y                           (dX = diag(beta) Y)
  dQ    = scale (diag(eg) dO S^T + Pm K),   Pm = (dO Vnew^T) * Gam * lower_incl
  dK    = Pm^T Qs + diag(exp(gam_C - gam)) Vnew dS^T - diag(beta eg) Y S^T + (M + M^T) K
  dA    = -Tinv^T dTinv Tinv^T = -Y Vnew^T  (dTinv = dVnew (diag(beta) X)^T and Vnew = Tinv diag(beta) X),
          D = strict_lower(dA * Gam),  M = diag(beta) D
  dbeta = rowsum(Y * X) + rowsum(D * K K^T)
  dgam  = rowsum(Q * dQ) - rowsum(K * Pm^T Qs) - x + [last row] (sum(x) + exp(gam_C) sum(dS * S))
          - beta eg rowsum(K * Y S^T) + rowsum(M * K K^T) - colsum(M * K K^T),  x = rowsum(K * exp(gam_C - gam) Vnew dS^T)
  dS   <- exp(gam_C) dS + (diag(eg) Qs)^T dO - K^T diag(beta eg) Y
and dg is the in-chunk reverse cumsum of dgam. The Tinv chain of the WY stage (two [64, 64] fp32 products) collapses
to the single product Y Vnew^T.

V blocks: every line is column-separable in V except the sums over V (dQ, dK, dgam, dbeta), which are sums of
per-block terms. With NV = V / BV > 1, each V-block program writes its share of dg and dbeta to fp32 partial rows
[NV, T, HV] that the launcher sums (the gate and beta chain rules are linear in dg and dbeta, so they apply per
block). dQ and dK are per value head: with HV > H (GVA) or NV > 1 each program writes fp32 partials
[NV, T, HV, K] and the launcher sums the G = HV // H value heads and the V blocks (deterministic: a fixed-order
torch sum, no atomics); with H == HV and NV == 1 dQ and dK go straight to the outputs in q's and k's dtype.

Transposes through memory: Triton 3.4-3.7 on Hopper miscompiles tl.trans of a dot result fed to another tl.dot
(FLA issues 640/984), so Vnew, dS and M, which are dot results, reach their transposed uses through a per-program
scratch tile (rounded to the operand dtype, written, CTA barrier, read back with transposed addresses; L2-resident,
BT*BV + BK*BV + BT*BT elements per program, overwritten every chunk). Pm^T comes from a second product Vnew dO^T.

Rows past the end of a partial chunk: q, k, v and dO load as zeros, the gate index is clamped to the last valid row
(finite exp(gam_i - gam_j)), so every padded row and column of the products is zero.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import gate_chain, load_vec_compact, sequence_span, state_tile


@triton.jit
def chunk_bwd_fused_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,               # q, k [T_tot, H, K], v, do [T_tot, HV, V]
    gcum_ptr, beta_ptr, tinv_ptr, h_ptr,       # gcum, beta [T_tot, HV] (fp32 gcum), tinv fp32 [T_tot, HV, BT], h [slots, HV, K, V]
    dht_ptr, dh0_ptr,                          # d final_state (any float) / d initial_state (fp32) [N, HV, K, V]
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,  # see PART_QK / NV below
    scratch_ptr,                               # [N * HV * NV, BT * BV + BK * BV + BT * BT] in q's dtype
    cu_ptr, chunk_off_ptr, T_tot, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PART_QK: tl.constexpr, DOT_PREC: tl.constexpr,
    V_FIRST: tl.constexpr = False,             # dht / dh0 stored [N, HV, V, K] (FLA's state_v_first)
    g_raw_ptr=None, A_log_ptr=None, dt_bias_ptr=None,   # use_gate_in_kernel: raw g [T_tot, HV], A_log / dt_bias [HV]
    dgate_ptr=None,                            # fp32 [NV, 1 or 2, T_tot, HV]: per-token dA_log and d dt_bias terms
    beta_raw_ptr=None,                         # use_beta_sigmoid_in_kernel: the beta logits [T_tot, HV]
    GATE_IN_KERNEL: tl.constexpr = False, HAS_DT_BIAS: tl.constexpr = False, BETA_SCALE: tl.constexpr = 0,
):
    """Grid (NV * N * HV,): V blocks fastest. PART_QK: dq_ptr / dk_ptr are fp32 partials [NV, T_tot, HV, K], else
    the outputs [T_tot, H, K] (H == HV, NV == 1). dg_ptr / dbeta_ptr: fp32 partials [NV, T_tot, HV] when NV > 1,
    else the outputs [T_tot, HV]. dv_ptr [T_tot, HV, V] (each V block writes its own columns)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    vb = pid % NV
    nh = pid // NV
    n = nh // HV
    hv = nh % HV
    hk = hv // (HV // H)
    bos, eos, slot0, nchunks = sequence_span(cu_ptr, chunk_off_ptr, n, BT)
    dt_op = q_ptr.dtype.element_ty

    rk, rv, mkv, state_off = state_tile(n, hv, vb, HV, K, V, BK, BV, V_FIRST)
    if USE_DHT:
        ds = tl.load(dht_ptr + state_off, mask=mkv, other=0.).to(tl.float32)
    else:
        ds = tl.zeros([BK, BV], dtype=tl.float32)

    rows = tl.arange(0, BT)
    rvl = tl.arange(0, BV)
    # this program's scratch: Vnew [BT, BV], dS [BK, BV], M [BT, BT], row-major
    scr = scratch_ptr + pid.to(tl.int64) * (BT * BV + BK * BV + BT * BT)
    scr_ds = scr + BT * BV
    scr_m = scr_ds + BK * BV
    if PART_QK:
        qk_base = (vb.to(tl.int64) * T_tot) * HV * K + hv * K     # + t * HV * K
        qk_stride = HV * K
    else:
        qk_base = hk.to(tl.int64) * K
        qk_stride = H * K
    if NV > 1:
        gb_base = vb.to(tl.int64) * T_tot * HV                    # dg / dbeta partial rows of this V block
    else:
        gb_base = vb.to(tl.int64) * 0

    for cc in range(0, nchunks):
        c = nchunks - 1 - cc
        t0 = bos + c * BT
        slot = (slot0 + c).to(tl.int64)
        nt = eos - t0
        valid = rows < nt
        rc = tl.minimum(rows, tl.minimum(nt, BT) - 1)
        last = tl.minimum(nt, BT) - 1
        gam = tl.load(gcum_ptr + (t0 + rc) * HV + hv)
        gam_last = tl.load(gcum_ptr + (t0 + last) * HV + hv)
        beta = tl.load(beta_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.).to(tl.float32)
        eg = tl.exp(gam)
        lower = rows[:, None] >= rows[None, :]

        p_q = tl.make_block_ptr(q_ptr + t0 * H * K + hk * K, (nt, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (nt, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
        p_v = tl.make_block_ptr(v_ptr + t0 * HV * V + hv * V, (nt, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
        p_do = tl.make_block_ptr(do_ptr + t0 * HV * V + hv * V, (nt, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
        p_ti = tl.make_block_ptr(tinv_ptr + (t0 * HV + hv) * BT, (nt, BT), (HV * BT, 1), (0, 0), (BT, BT), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_v = tl.load(p_v, boundary_check=(0, 1))
        b_do = tl.load(p_do, boundary_check=(0, 1))
        tinv_op = tl.load(p_ti, boundary_check=(0,)).to(dt_op)
        b_h = tl.load(h_ptr + (slot * HV + hv) * K * V + rk[:, None] * V + rv[None, :], mask=mkv, other=0.)

        # ---- Vnew = Tinv diag(beta) (V - diag(eg) K S), and dS, to the scratch for their transposed uses
        ks = tl.dot(b_k, b_h, input_precision=DOT_PREC)
        xb = (b_v.to(tl.float32) - eg[:, None] * ks) * beta[:, None]
        vnew = tl.dot(tinv_op, xb.to(dt_op), input_precision=DOT_PREC).to(dt_op)
        tl.debug_barrier()                     # the previous chunk's reads of the scratch are done
        tl.store(scr + rows[:, None] * BV + rvl[None, :], vnew)
        tl.store(scr_ds + rk[:, None] * BV + rvl[None, :], ds.to(dt_op))
        tl.debug_barrier()
        vnew_t = tl.load(scr + rvl[:, None] + rows[None, :] * BV)             # [BV, BT]: Vnew^T
        ds_t = tl.load(scr_ds + rvl[:, None] + rk[None, :] * BV)              # [BV, BK]: dS^T

        # ---- dVnew = P^T dO + diag(exp(gam_C - gam)) K dS; P^T straight from the loaded tiles (K Q^T)
        upper = rows[:, None] <= rows[None, :]
        kq = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
        pt = tl.where(upper, kq * tl.exp(tl.where(upper, gam[None, :] - gam[:, None], 0.)) * scale, 0.)
        kdec = (b_k.to(tl.float32) * tl.exp(gam_last - gam)[:, None]).to(dt_op)
        dvnew = tl.dot(pt.to(dt_op), b_do, input_precision=DOT_PREC) \
            + tl.dot(kdec, ds.to(dt_op), input_precision=DOT_PREC)
        y = tl.dot(tl.trans(tinv_op), dvnew.to(dt_op), input_precision=DOT_PREC)      # Tinv^T dVnew
        p_dv = tl.make_block_ptr(dv_ptr + t0 * HV * V + hv * V, (nt, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
        tl.store(p_dv, (y * beta[:, None]).to(dv_ptr.dtype.element_ty), boundary_check=(0, 1))
        y_op = y.to(dt_op)
        # dS <- exp(gam_C) dS + (diag(eg) Qs)^T dO - K^T diag(beta eg) Y, here: the old dS is read from here on only
        # as dS^T (scratch) and through sum(dS * S), so one [BK, BV] accumulator stays live
        sds = tl.sum(tl.sum(ds * b_h.to(tl.float32), axis=1), axis=0)
        qg = (b_q.to(tl.float32) * (eg * scale)[:, None]).to(dt_op)
        ds = ds * tl.exp(gam_last) + tl.dot(tl.trans(qg), b_do, input_precision=DOT_PREC) \
            - tl.dot(tl.trans(b_k), (y * (beta * eg)[:, None]).to(dt_op), input_precision=DOT_PREC)

        # ---- dQ and its gate term rowsum(Q * dQ)
        dp = tl.dot(b_do, vnew_t, input_precision=DOT_PREC)                   # dO Vnew^T
        pm = tl.where(lower, dp * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.)), 0.)
        dqh = tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC) * (eg * scale)[:, None] \
            + tl.dot(pm.to(dt_op), b_k, input_precision=DOT_PREC) * scale
        dgam = tl.sum(dqh * b_q.to(tl.float32), axis=1)
        p_dq = tl.make_block_ptr(dq_ptr + qk_base + t0 * qk_stride, (nt, K), (qk_stride, 1), (0, 0), (BT, BK), (1, 0))
        tl.store(p_dq, dqh.to(dq_ptr.dtype.element_ty), boundary_check=(0, 1))

        # ---- dK: the intra-chunk term Pm^T Qs (Pm^T from Vnew dO^T), the S_next term, the X term
        dpt = tl.dot(vnew, tl.trans(b_do), input_precision=DOT_PREC)         # Vnew dO^T
        pmt = tl.where(upper, dpt * tl.exp(tl.where(upper, gam[None, :] - gam[:, None], 0.)), 0.)
        dkh = tl.dot(pmt.to(dt_op), b_q, input_precision=DOT_PREC) * scale
        dgam -= tl.sum(dkh * b_k.to(tl.float32), axis=1)
        dks = tl.dot(vnew, ds_t, input_precision=DOT_PREC) * tl.exp(gam_last - gam)[:, None]   # Vnew dS^T
        xs = tl.sum(dks * b_k.to(tl.float32), axis=1)
        dgam += tl.where(rows == last, tl.sum(xs, axis=0) + tl.exp(gam_last) * sds, 0.) - xs
        dkh += dks
        ysw = tl.dot(y_op, tl.trans(b_h), input_precision=DOT_PREC)           # Y S^T
        rs_w = tl.sum(ysw * b_k.to(tl.float32), axis=1)
        dkh -= ysw * (beta * eg)[:, None]
        dgam -= beta * eg * rs_w
        dbeta = tl.sum(y * b_v.to(tl.float32), axis=1) - eg * rs_w           # rowsum(Y * X)

        # ---- through A: D = strict_lower(-Y Vnew^T * Gam), M = diag(beta) D, dK += (M + M^T) K
        strict = rows[:, None] > rows[None, :]
        da = tl.dot(y_op, vnew_t, input_precision=DOT_PREC)
        dmat = tl.where(strict, -da * tl.exp(tl.where(strict, gam[:, None] - gam[None, :], 0.)), 0.)
        kk = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
        dbeta += tl.sum(dmat * kk, axis=1)
        mm = dmat * beta[:, None]
        mkk = mm * kk
        dgam += tl.sum(mkk, axis=1) - tl.sum(mkk, axis=0)
        tl.store(scr_m + rows[:, None] * BT + rows[None, :], mm.to(dt_op))
        tl.debug_barrier()
        m_t = tl.load(scr_m + rows[:, None] + rows[None, :] * BT).to(tl.float32)     # M^T
        dkh += tl.dot((mm + m_t).to(dt_op), b_k, input_precision=DOT_PREC)
        p_dk = tl.make_block_ptr(dk_ptr + qk_base + t0 * qk_stride, (nt, K), (qk_stride, 1), (0, 0), (BT, BK), (1, 0))
        tl.store(p_dk, dkh.to(dk_ptr.dtype.element_ty), boundary_check=(0, 1))

        # ---- dg = the in-chunk reverse cumsum of dgam; FLA's gate and beta chain rules (linear: per V block)
        dg = tl.sum(tl.where(rows[None, :] >= rows[:, None], dgam[None, :], 0.), axis=1)
        if GATE_IN_KERNEL:
            NG: tl.constexpr = 2 if HAS_DT_BIAS else 1
            dg = gate_chain(dg, g_raw_ptr, A_log_ptr, dt_bias_ptr, dgate_ptr + NG * gb_base, t0 + rows, valid, hv,
                            T_tot, HV, BT, HAS_DT_BIAS)
        if BETA_SCALE != 0:
            xb_raw = load_vec_compact(beta_raw_ptr + (t0 + rows) * HV + hv, valid, BT).to(tl.float32)
            dbeta = dbeta * (BETA_SCALE * tl.sigmoid(xb_raw) * tl.sigmoid(-xb_raw))
        tl.store(dg_ptr + gb_base + (t0 + rows) * HV + hv, dg.to(dg_ptr.dtype.element_ty), mask=valid)
        tl.store(dbeta_ptr + gb_base + (t0 + rows) * HV + hv, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)


    if STORE_DH0:
        tl.store(dh0_ptr + state_off, ds, mask=mkv)
