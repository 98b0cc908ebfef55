"""Backward stage 2: the chunk-parallel local terms (dQ, the first part of dK, dW, the gate terms of O and S_next),
organised in three phases that each keep at most three [64, 64] fp32 tiles live, so that it runs as one warpgroup
(4 warps, 1 stage) with full-width 64x64 WGMMAs and nothing spilled (sm_90a, H16/HV32 K=V=128 bf16: 255 registers,
0 B).

Per (K block, chunk, query/key head) (grid axis 0: K block fastest, then chunk slot; axis 1: the key head), walking
the HV // H value heads of the group in each phase:

  phase A  (live: dq, dp, dos)   one V loop: dP = dO Vnew^T, dOS = dO S^T
           Pm = (dP * Gam) masked i >= j;  dQ += scale (diag(exp gam) dOS + Pm K)
           M = scale Pm * (Q K^T) masked i > j  (the intra-chunk pairs of O's gate term, dP * P)
           dgam := scale rowsum(Q * diag(exp gam) dOS) + rowsum(M) - colsum(M);  dQ stored after the loop
  phase W  (live: dk, dw, dks)   one V loop: dW = -dVnew S^T (stored), Vnew dS^T, sum(dS * S)
           D = diag(exp(gam_C - gam)) Vnew dS^T;  dK += D;  x = rowsum(K * D)
           dgam -= x;  on the last row dgam += sum(x) + exp(gam_C) sum(dS * S)
  phase B  (live: dk, dpt, dk_h) one V loop: dP^T = Vnew dO^T
           dK += scale (dP^T * Gam^T masked i <= j) Q
           dK stored after the loop (fp32, the WY stage adds the rest)

Why the pairs go through M: each pair (i > j) of dP * P reaches dgam twice, +M_ij on row i and -M_ij on row j, and
dg (the reverse cumsum of dgam) keeps it only where the cumsum separates them. As one fp32 number (here, once per
K block) the two cancel exactly wherever they should; formed twice, as q_i . (Pm K)_i and k_j . (Pm^T Q)_j, the two
roundings (as large as the pair, times the cancellation of a near-orthogonal q_i . k_j) do not, and under strong
decay dg's true value is far below them. The diagonal pairs (dP_ii P_ii) cancel on their row and are left out.
Q K^T costs one [64, BK] x [BK, 64] product per head.

The dgam row of each (K block, head) is the program's own: phase A writes it, W read-modifies-writes it; a CTA
barrier between the two makes the writes of other threads visible (L2-resident, 2 x 256 B per head).

Costs of the phase split: dO is loaded in two phases, Vnew in all three, S in two, q and k once per
head and phase (issued bytes, L1/L2 hits right after the first read: DRAM bytes unchanged). dP is still computed
by each of the NK K-block programs.

Register notes (ptxas, sm_90a): q and k are reloaded inside each head loop, and the row count is reloaded from
cu_seqlens per head (`ntj`) for the masks and the tiles' row bounds: otherwise Triton hoists the loop-invariant
[64, 64] masks, the fp32 copies of q and k and the bounds masks out of the head loops and holds them across phases
(the spill went 152 -> 0 B through these and the phase split). Padded rows of a partial chunk take the last valid
row's gam (clamped index), so only the i >= j / i <= j masks are needed: every padded row and column of dP, dP^T
and Vnew dS^T is zero (their loads are bounds-masked, zero-filled).

Hazard (Triton 3.4-3.7 on Hopper, FLA issues 640/984): no tl.trans of a dot result; dP^T is accumulated from loaded
tiles.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, load_tile, slot_chunk, store_tile

WARPS_LOCAL = 4
STAGES_LOCAL = 1     # 2 stages: 255 registers and 4 B spilled, 56 KB; 1 stage: 0 B, 32 KB


@triton.jit
def chunk_local_bwd_kernel(
    q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr,   # q, k [T_tot, H, K], vnew [T_tot, HV, V], h [slots, HV, K, V], gcum [T_tot, HV]
    do_ptr, dvnew_ptr, dh_ptr,                 # do, dvnew [T_tot, HV, V], dh [slots, HV, K, V]
    dq_ptr, dk_ptr, dw_ptr, dgam_ptr,          # dq [T_tot, H, K] (q dtype), dk fp32 [T_tot, H, K], dw [T_tot, HV, K], dgam fp32 [NK, T_tot, HV]
    cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, T_tot, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # grid (K blocks * chunk slots, H): the K blocks of a chunk fastest, the slots on axis 0 (up to 2^31 - 1
    # programs; axis 1 stops at 65535)
    NK: tl.constexpr = (K + BK - 1) // BK
    kb = tl.program_id(0) % NK
    p = tl.program_id(0) // NK
    hk = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    slot = (tl.load(chunk_off_ptr + n) + c).to(tl.int64)
    G: tl.constexpr = HV // H
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos
    last = tl.minimum(eos - t0, BT) - 1
    nt = eos - t0

    # ---- phase A: dQ (group sum in registers), the gate terms of O
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(0, G):
        hv = hk * G + j
        ntj = tl.load(cu_ptr + n + 1) - t0     # reloaded per head: the masks below stay loop-variant
        # q, k reloaded per head and phase (L1/L2): never held across loops
        b_q = load_tile(q_ptr + t0 * H * K + hk * K, 0, kb * BK, ntj, K, H * K, BT, BK)
        b_k = load_tile(k_ptr + t0 * H * K + hk * K, 0, kb * BK, ntj, K, H * K, BT, BK)
        rc = tl.minimum(rows, tl.minimum(ntj, BT) - 1)
        lower = rc[:, None] >= rows[None, :]
        gam = tl.load(gcum_ptr + (t0 + rc) * HV + hv)
        dp = tl.zeros([BT, BT], dtype=tl.float32)
        dos = tl.zeros([BT, BK], dtype=tl.float32)
        for vb in range(0, tl.cdiv(V, BV)):
            b_do = load_tile(do_ptr + t0 * HV * V + hv * V, 0, vb * BV, ntj, V, HV * V, BT, BV)
            b_vn = load_tile(vnew_ptr + t0 * HV * V + hv * V, 0, vb * BV, ntj, V, HV * V, BT, BV)
            b_h = load_tile(h_ptr + (slot * HV + hv) * K * V, kb * BK, vb * BV, K, V, V, BK, BV)
            dp += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
            dos += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        pm = tl.where(lower, dp * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.)), 0.)
        dqh = dos * (tl.exp(gam) * scale)[:, None]
        a = tl.sum(dqh * b_q.to(tl.float32), axis=1)            # O's inter-chunk gate term
        # the intra-chunk pairs: M = Pm * P on this K block, each pair once, +M_ij on row i and -M_ij on row j
        mm = tl.where(rc[:, None] > rows[None, :], pm * tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC), 0.)
        a += (tl.sum(mm, axis=1) - tl.sum(mm, axis=0)) * scale
        tl.store(dgam_ptr + (kb * T_tot + t0 + rows) * HV + hv, a, mask=valid)
        dq += dqh + tl.dot(pm.to(b_k.dtype), b_k, input_precision=DOT_PREC) * scale

    store_tile(dq_ptr + t0 * H * K + hk * K, dq.to(dq_ptr.dtype.element_ty), 0, kb * BK, nt, K, H * K)
    tl.debug_barrier()                         # phase A's dgam rows, read back below by other threads

    # ---- phase W: dW and the state part of dK' (group sum in registers), the gate term x
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    for j in range(0, G):
        hv = hk * G + j
        ntj = tl.load(cu_ptr + n + 1) - t0     # reloaded per head: the masks below stay loop-variant
        rc = tl.minimum(rows, tl.minimum(ntj, BT) - 1)
        gam = tl.load(gcum_ptr + (t0 + rc) * HV + hv)
        gam_last = tl.load(gcum_ptr + (t0 + last) * HV + hv)
        dw = tl.zeros([BT, BK], dtype=tl.float32)
        dks = tl.zeros([BT, BK], dtype=tl.float32)
        sds = tl.zeros([BK], dtype=tl.float32)
        for vb in range(0, tl.cdiv(V, BV)):
            b_dvn = load_tile(dvnew_ptr + t0 * HV * V + hv * V, 0, vb * BV, ntj, V, HV * V, BT, BV)
            b_vn = load_tile(vnew_ptr + t0 * HV * V + hv * V, 0, vb * BV, ntj, V, HV * V, BT, BV)
            b_h = load_tile(h_ptr + (slot * HV + hv) * K * V, kb * BK, vb * BV, K, V, V, BK, BV)
            b_dh = load_tile(dh_ptr + (slot * HV + hv) * K * V, kb * BK, vb * BV, K, V, V, BK, BV)
            dw += tl.dot(b_dvn, tl.trans(b_h), input_precision=DOT_PREC)
            dks += tl.dot(b_vn, tl.trans(b_dh), input_precision=DOT_PREC)
            sds += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), axis=1)
        store_tile(dw_ptr + t0 * HV * K + hv * K, (-dw).to(dw_ptr.dtype.element_ty), 0, kb * BK, ntj, K, HV * K)
        b_k = load_tile(k_ptr + t0 * H * K + hk * K, 0, kb * BK, ntj, K, H * K, BT, BK)
        dks = dks * tl.exp(gam_last - gam)[:, None]
        x = tl.sum(dks * b_k.to(tl.float32), axis=1)
        a = tl.load(dgam_ptr + (kb * T_tot + t0 + rows) * HV + hv, mask=valid, other=0.)
        a = a - x + tl.where(rows == last, tl.sum(x, axis=0) + tl.exp(gam_last) * tl.sum(sds, axis=0), 0.)
        tl.store(dgam_ptr + (kb * T_tot + t0 + rows) * HV + hv, a, mask=valid)
        dk += dks

    # ---- phase B: the intra-chunk part of dK'
    for j in range(0, G):
        hv = hk * G + j
        ntj = tl.load(cu_ptr + n + 1) - t0     # reloaded per head: the masks below stay loop-variant
        rc = tl.minimum(rows, tl.minimum(ntj, BT) - 1)
        upper = rows[:, None] <= rc[None, :]
        gam = tl.load(gcum_ptr + (t0 + rc) * HV + hv)
        dpt = tl.zeros([BT, BT], dtype=tl.float32)
        for vb in range(0, tl.cdiv(V, BV)):
            b_do = load_tile(do_ptr + t0 * HV * V + hv * V, 0, vb * BV, ntj, V, HV * V, BT, BV)
            b_vn = load_tile(vnew_ptr + t0 * HV * V + hv * V, 0, vb * BV, ntj, V, HV * V, BT, BV)
            dpt += tl.dot(b_vn, tl.trans(b_do), input_precision=DOT_PREC)
        b_q = load_tile(q_ptr + t0 * H * K + hk * K, 0, kb * BK, ntj, K, H * K, BT, BK)
        pmt = tl.where(upper, dpt * tl.exp(tl.where(upper, gam[None, :] - gam[:, None], 0.)), 0.)
        dk += tl.dot(pmt.to(b_q.dtype), b_q, input_precision=DOT_PREC) * scale
    store_tile(dk_ptr + t0 * H * K + hk * K, dk, 0, kb * BK, nt, K, H * K)
