"""KDA's chunked backward on Triton.

Stages: (0) the forward recomputed (forward.py with keep=True: gcum, the effective beta, Tinv, Aqk, the decayed
keys and queries, W, the chunk-start states h and Vnew); (1a) the intra-chunk part of dVnew, scale Aqk^T dO
(GDN's chunk_dv_local_kernel, DECAY "channel"); (1) the reverse state pass (GDN's chunk_state_bwd_kernel, DECAY
"channel": dS per chunk, the state term of dVnew, d initial_state); (2) everything else per chunk in
the kernels below (kda_wy_bwd_kernel up to dAkk and dAqk, split from the rest so that each fits sm_90's shared
memory at K = V = 128; then the pairwise products' gradients, as the forward splits them: kda_pair_diag_bwd_kernel
inside 16-row blocks token by token for the chunks flagged pairwise, kda_pair_bwd_kernel across blocks and inside
the other chunks' blocks in products). Per chunk and value head, with dS the gradient into S_next (dh) and gam
[C, K]:

    dQdec = scale dO S^T,  dKdec = Vnew dS^T,  dgam_C += sum_v S * dS * exp(gam_C) + sum_rows dKdec * Kdec
    dW = -dVnew S^T,  dTinv = dW (beta K e^gam)^T + dVnew (beta V)^T,  dAkk = -Tinv^T dTinv Tinv^T (strict lower)
    dV = beta Tinv^T dVnew,  d(beta K e^gam) = Tinv^T dW,  dAqk = scale dO Vnew^T (lower incl)

then through the pairwise products Akk_ij = beta_i sum_d k_id k_jd e^(gam_id - gam_jd) and Aqk_ij (q for the
left k): for P_ij = sum_d a_id b_jd e^(gam_id - gam_jd) with upstream G, da_i = sum_j G_ij b_j e^(..),
db_j = sum_i G_ij a_i e^(..), dgam_i += a_i da_i, dgam_j -= b_j db_j (the forward's numerically safe form:
reference rows across 16-row blocks and inside them, or token pairs inside a flagged chunk's blocks). dg is the
reverse cumsum of dgam inside the chunk, then back through FLA's KDA gate (dA_log and dt_bias as per-chunk partial
sums reduced by the launcher) and the beta sigmoid.

Every tl.trans here is of a loaded tile or of an elementwise function of loaded tiles, never of a dot result fed to
another dot (miscompiled by Triton 3.4-3.7 on Hopper, FLA issues 640/984): Tinv^T, dAkk^T and dAqk^T are read
transposed from memory.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from linattn.ops.col_sum import col_sum
from linattn.ops.gated_delta_rule.triton.backward_dv_local import chunk_dv_local_kernel
from linattn.ops.gated_delta_rule.triton.backward_state import chunk_state_bwd_kernel
from linattn.ops.gated_delta_rule.triton.common import (LOG2E, chunk_span, dot_precision, exp2_fast, exp_fast,
                                                        ftz_exp2, slot_chunk, softplus)
from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _pow2
from linattn.ops.gated_delta_rule.triton.host import launches
from linattn.ops.kda.triton.forward import DIAG_BH, KdaIntermediates, chunk_kda_fwd
from linattn.ops.kda.triton.intra import chunk_rows, token_rows
from linattn.runtime.alloc import empty
from linattn.runtime.host_path import cdiv

# key channels per block of the local backward kernels' walks over the key row, and kda_wy_bwd_kernel's warps.
# At K = V = 128 on sm_90a (ptxas, Triton 3.6.0) the dg kernel spills nothing; the WY kernel at 32 channels spills
# 112 bytes (3 stages) but runs its key-side products at wgmma N = 16 instead of 8 and is faster than at 16 channels
# (4.07 against 4.75 ms at B1 T32768 H32 on an H200); the pair kernel at 64 channels spills 8 bytes (its k tile kept
# in k's dtype until each use) and is faster than at 32 (4.60 against 5.03 ms at B1 T32768 H32, 3.94 against 4.32 at
# B8 T4096 with every chunk flagged, H100).
PAIR_BK = 64
PAIR_WARPS = 4
PAIR_STAGES = 3          # software-pipelining stages of the key-block loops (Triton's default)
DG_BK = 32
WY_BK = 32
WY_WARPS = 8
WY_STAGES = 3
# value columns per program of the reverse state pass (GDN's chunk_state_bwd_kernel, DECAY "channel", 8 warps)
STATE_BV = 32
# (token, key head) rows per program of the GVA sum (kda_gva_sum_kernel: a memory-bound pass, 16 KB of fp32 read per
# program at G = 2, K = 128)
GVA_SUM_ROWS = 16


@triton.jit
def kda_wy_bwd_kernel(
    q_ptr, k_ptr, v_ptr,                                       # the op's inputs
    gcum_ptr, beta_eff_ptr, tinv_ptr, h_ptr, vnew_ptr,         # the recomputed forward
    do_ptr, dh_ptr, dvnew_ptr,                                 # dO, dS into each chunk's S_next, the whole dVnew
    dq_ptr, dk_ptr, dv_ptr, dgam_ptr, dbeta_ptr, dakk_ptr, daqk_ptr,
    cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (chunk slots, HV); BV >= V. The first half of the local backward: the output's and the state's direct
    terms and the way back through W and U, up to dAkk (strict lower) and dAqk (lower incl.), stored fp32
    [T_tot, HV, BT] for kda_pair_bwd_kernel with the partial dq, dk (fp32 [T_tot, HV, K] per value head), dgam
    (fp32, gam_C's terms on the last row) and dbeta (fp32); dv final. The value side (dv, dAqk, U's part of dTinv)
    is done once; the key side walks the key row in blocks of BK channels (the state's rows S[ck, :] and dS[ck, :]
    with them), summing W's part of dTinv and dbeta over the blocks."""
    live, n, c, t0, eos, hv, hk, i, r, m, last = chunk_rows(chunk_idx_ptr, cu_ptr, N, H, HV, BT)
    if not live:
        return
    slot = (tl.load(chunk_off_ptr + n) + c).to(tl.int64)
    cv = tl.arange(0, BV)
    mrv = m[:, None] & (cv < V)[None, :]
    off_v = (r * HV + hv)[:, None] * V + cv[None, :]

    beta = tl.load(beta_eff_ptr + r * HV + hv, mask=m, other=0.)
    vf = tl.load(v_ptr + off_v, mask=mrv, other=0.).to(tl.float32)
    b_dvn = tl.load(dvnew_ptr + off_v, mask=mrv, other=0.)
    off_a = (r * HV + hv)[:, None] * BT + i[None, :]
    off_at = (r * HV + hv)[None, :] * BT + i[:, None]          # [j, i] = the tile's [i, j]
    # Tinv^T read transposed from memory where it is an operand (rows past the end are zero columns); fp32 from the
    # Triton stage 2a, q's dtype from the Gluon one, fp32 here either way
    tinvt = tl.load(tinv_ptr + off_at, mask=m[None, :], other=0.).to(tl.float32)

    # ---- the value side: U = Tinv diag(beta) V, the output's pairs
    vb = (beta[:, None] * vf).to(b_dvn.dtype)
    dvb = tl.dot(tinvt.to(b_dvn.dtype), b_dvn, input_precision=DOT_PREC)
    tl.store(dv_ptr + off_v, (beta[:, None] * dvb).to(dv_ptr.dtype.element_ty), mask=mrv)
    dbeta = tl.sum(dvb * vf, axis=1)
    dtinv = tl.dot(b_dvn, tl.trans(vb), input_precision=DOT_PREC)
    # the V-side tiles stay in the operand dtype (their products' operands; half the shared memory of fp32 copies)
    b_do = tl.load(do_ptr + off_v, mask=mrv, other=0.).to(vnew_ptr.dtype.element_ty)
    b_vn = tl.load(vnew_ptr + off_v, mask=mrv, other=0.)
    incl = i[:, None] >= i[None, :]
    tl.store(daqk_ptr + off_a, tl.where(incl, scale * tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC), 0.),
             mask=m[:, None])

    # ---- the key side, per key block: the output's and the state's direct terms, W = Tinv diag(beta) (K e^gam)
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        mkv = mk[:, None] & (cv < V)[None, :]
        off_hk = (r * HV + hv)[:, None] * K + ck[None, :]
        off_q = (r * H + hk)[:, None] * K + ck[None, :]
        off_s = (slot * HV + hv) * K * V + ck[:, None] * V + cv[None, :]
        gam = tl.load(gcum_ptr + off_hk, mask=mrk, other=0.)
        kf = tl.load(k_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        qf = tl.load(q_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        b_h = tl.load(h_ptr + off_s, mask=mkv, other=0.)
        b_dh = tl.load(dh_ptr + off_s, mask=mkv, other=0.)
        gam_last = tl.sum(tl.where(i[:, None] == last, gam, 0.), axis=0)
        # rows past the sequence end carry gam_C, as the forward's cumsum left them
        gam = tl.where(m[:, None], gam, gam_last[None, :])
        eg = tl.exp(gam)
        ekd = tl.where(mrk, tl.exp(gam_last[None, :] - gam), 0.)

        dqdec = scale * tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        dq = dqdec * eg
        dgam = dqdec * qf * eg
        dkdec = tl.dot(b_vn, tl.trans(b_dh), input_precision=DOT_PREC)
        dk = dkdec * ekd
        dgam -= dkdec * kf * ekd
        dgl = tl.sum(dkdec * kf * ekd, axis=0) + tl.exp(gam_last) * tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32),
                                                                           axis=1)
        kbe = beta[:, None] * kf * eg
        dw = -tl.dot(b_dvn, tl.trans(b_h), input_precision=DOT_PREC)
        dtinv += tl.dot(dw, tl.trans(kbe), input_precision=DOT_PREC)
        dkb = tl.dot(tinvt, dw, input_precision=DOT_PREC)
        dbeta += tl.sum(dkb * kf * eg, axis=1)
        dk += beta[:, None] * dkb * eg
        dgam += beta[:, None] * dkb * kf * eg
        dgam = tl.where(mrk, dgam + tl.where(i[:, None] == last, dgl[None, :], 0.), 0.)
        tl.store(dq_ptr + off_hk, dq, mask=mrk)
        tl.store(dk_ptr + off_hk, dk, mask=mrk)
        tl.store(dgam_ptr + off_hk, dgam, mask=mrk)

    # ---- dAkk = -Tinv^T dTinv Tinv^T (strict lower)
    strict = i[:, None] > i[None, :]
    dakk = tl.where(strict, -tl.dot(tl.dot(tinvt, dtinv, input_precision=DOT_PREC), tinvt, input_precision=DOT_PREC),
                    0.)
    tl.store(dakk_ptr + off_a, dakk, mask=m[:, None])
    tl.store(dbeta_ptr + r * HV + hv, dbeta, mask=m)


@triton.jit
def _gam_row(gcum_ptr, t0, u, eos, hv, ck, mk, gam_last, HV: tl.constexpr, K: tl.constexpr):
    """gam's row u of the chunk on the key block ck ([BK]); gam_last (gam_C) for a row past the sequence end."""
    g = tl.load(gcum_ptr + ((t0 + u) * HV + hv) * K + ck, mask=mk & (t0 + u < eos), other=0.)
    return tl.where(t0 + u < eos, g, gam_last)


@triton.jit
def kda_pair_diag_bwd_kernel(
    k_ptr, q_ptr, gcum_ptr, beta_eff_ptr, dakk_ptr, daqk_ptr,
    pairwise_ptr,                                              # [slots, HV] int8: 1 for a chunk's pairs one by one
    dq_ptr, dk_ptr, dgam_ptr, dbeta_ptr,                       # fp32 partial sums, the in-block terms added in place
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
    FTZ: tl.constexpr,
):
    """Grid (chunk slots * BT, cdiv(HV, BH)): one token t of a chunk and BH value heads per program, for the heads
    whose chunk is flagged pairwise (a program with none returns at once: kda_pair_bwd_kernel takes the other chunks'
    in-block pairs in its products), the pairwise gradients of Akk and Aqk (kda_pair_bwd_kernel's da / db) over the
    pairs inside t's 16-row block, token by token: t's da from the rows j <= t of the block (G[t, j] b_j
    exp(gam_t - gam_j)), t's db from the rows j >= t (G[j, t] a_j exp(gam_j - gam_t)), every factor exp of a
    difference <= 0 (the diagonal's G is masked as P's pairs are: zero for Akk). They go into dq, dk, dgam and dbeta's
    partial sums in place (this program owns row t of its heads), before kda_pair_bwd_kernel adds the rest and
    stores the results."""
    slot = tl.program_id(0) // BT
    hvs_all = tl.program_id(1) * BH + tl.arange(0, BH)
    pw = tl.load(pairwise_ptr + slot * HV + hvs_all, mask=hvs_all < HV, other=0) != 0
    if tl.max(pw.to(tl.int32), axis=0) == 0:
        return
    live, t, t0, eos, s0, hvs, mh, mhk, off_g, off_k, gt, kt, qt = token_rows(
        chunk_idx_ptr, cu_ptr, gcum_ptr, k_ptr, q_ptr, N, tl.program_id(0) // BT, tl.program_id(0) % BT, H, HV, K,
        BT, BH, BK)
    if not live:
        return
    mh = mh & pw
    mhk = mhk & pw[:, None]
    s1 = tl.minimum(s0 + 16, eos)
    bt = tl.load(beta_eff_ptr + t * HV + hvs, mask=mh, other=0.)
    g_row = (t * HV + hvs) * BT - t0           # G[t, j] at g_row + j
    dak = tl.zeros([BH, BK], dtype=tl.float32)
    daq = tl.zeros([BH, BK], dtype=tl.float32)
    for j in range(s0, t + 1):
        gj = tl.load(gcum_ptr + j * HV * K + off_g, mask=mhk, other=0.)
        e = tl.load(k_ptr + j * H * K + off_k, mask=mhk, other=0.).to(tl.float32) * \
            exp2_fast(tl.where(mhk, gt - gj * LOG2E, float("-inf")), FTZ)
        dak += tl.load(dakk_ptr + g_row + j, mask=mh, other=0.)[:, None] * e
        daq += tl.load(daqk_ptr + g_row + j, mask=mh, other=0.)[:, None] * e
    dbk = tl.zeros([BH, BK], dtype=tl.float32)
    dbq = tl.zeros([BH, BK], dtype=tl.float32)
    for j in range(t, s1):
        gj = tl.load(gcum_ptr + j * HV * K + off_g, mask=mhk, other=0.)
        e = exp2_fast(tl.where(mhk, gj * LOG2E - gt, float("-inf")), FTZ)
        g_col = (j * HV + hvs) * BT + (t - t0)     # G[j, t]
        wk = tl.load(dakk_ptr + g_col, mask=mh, other=0.) * tl.load(beta_eff_ptr + j * HV + hvs, mask=mh, other=0.)
        wq = tl.load(daqk_ptr + g_col, mask=mh, other=0.)
        dbk += wk[:, None] * tl.load(k_ptr + j * H * K + off_k, mask=mhk, other=0.).to(tl.float32) * e
        dbq += wq[:, None] * tl.load(q_ptr + j * H * K + off_k, mask=mhk, other=0.).to(tl.float32) * e
    off_t = t * HV * K + off_g
    tl.store(dq_ptr + off_t, tl.load(dq_ptr + off_t, mask=mhk, other=0.) + daq, mask=mhk)
    tl.store(dk_ptr + off_t, tl.load(dk_ptr + off_t, mask=mhk, other=0.) + bt[:, None] * dak + dbk + dbq, mask=mhk)
    dgam = bt[:, None] * kt * dak - kt * dbk + qt * daq - kt * dbq
    tl.store(dgam_ptr + off_t, tl.load(dgam_ptr + off_t, mask=mhk, other=0.) + dgam, mask=mhk)
    db = tl.load(dbeta_ptr + t * HV + hvs, mask=mh, other=0.) + tl.sum(kt * dak, axis=1)
    tl.store(dbeta_ptr + t * HV + hvs, db, mask=mh)


@triton.jit
def kda_pair_bwd_kernel(
    k_ptr, q_ptr, gcum_ptr, beta_eff_ptr, beta_ptr,
    dakk_ptr, daqk_ptr, dbeta_in_ptr,                          # kda_wy_bwd_kernel's outputs (fp32)
    pairwise_ptr,                                              # [slots, HV] int8: 1 for a chunk's pairs one by one
    dq_ptr, dk_ptr, dgam_ptr, dbeta_ptr,                       # dq, dk, dgam: the partial sums (fp32); dgam completed
    dq_out_ptr, dk_out_ptr,                                    # in place, dq / dk stored complete here
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, FTZ: tl.constexpr,
):
    """Grid (4 * chunk slots, HV): one 16-row block I = program_id(0) % 4 of a chunk per program, the pairwise
    gradients of Akk and Aqk for its rows: dq and dk complete (from kda_wy_bwd_kernel's partial sums), dgam's per-row
    terms (kda_dg_kernel takes the reverse cumsum), dbeta complete (through the beta sigmoid).

    With P_ij = sum_d a_id b_jd exp(gam_id - gam_jd) and upstream G masked to P's pairs: da_i = sum_j G_ij b_j
    exp(gam_i - gam_j), db_j = sum_i G_ij a_i exp(gam_i - gam_j), for Akk (a = beta k, b = k, G = dAkk) and Aqk
    (a = q, b = k, G = dAqk). The key row is walked in blocks of BK channels. Pairs across blocks go through a
    reference row between the two tokens, so both factors are <= 1: row 16 I for the block's da (the earlier blocks'
    b), row 16 I + 15 for its db (the later blocks' a), each a [16, BT] x [BT, BK] product. The block's own pairs
    join those products (columns j <= i, factors exp(gam_r - gam_j) >= 1; rows i >= j, exp(gam_i - gam_e) >= 1)
    unless the chunk is flagged pairwise (pairwise_ptr: the forward's test, a factor times the largest |k|, |q| past
    2^SPAN_LOG2); kda_pair_diag_bwd_kernel has added a flagged chunk's in-block pairs to the partial sums first."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    blk = p % 4
    n, c = slot_chunk(chunk_idx_ptr, p // 4)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    if t0 + 16 * blk >= eos:                   # the block lies past the sequence end
        return
    inb = tl.load(pairwise_ptr + (p // 4) * HV + hv) == 0     # the block's own pairs in the products
    hk = hv // (HV // H)
    i = tl.arange(0, BT)
    r = t0 + i
    m = r < eos
    last = tl.minimum(eos - t0, BT) - 1
    li = tl.arange(0, 16)
    rI = t0 + 16 * blk + li
    mI = rI < eos
    first_b = 16 * blk                         # the block's first and last rows in the chunk
    last_b = 16 * blk + 15
    beta = tl.load(beta_eff_ptr + rI * HV + hv, mask=mI, other=0.)
    beta_all = tl.load(beta_eff_ptr + r * HV + hv, mask=m, other=0.)
    dbeta = tl.load(dbeta_in_ptr + rI * HV + hv, mask=mI, other=0.)
    # G's rows of the block (against the earlier and its own columns), and G^T: the rows at the block's columns
    off_g = (rI * HV + hv)[:, None] * BT + i[None, :]
    off_gt = (r * HV + hv)[None, :] * BT + (first_b + li)[:, None]            # [l, i] = G[i, 16 I + l]
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        mIk = mI[:, None] & mk[None, :]
        off_I = (rI * HV + hv)[:, None] * K + ck[None, :]
        off_qI = (rI * H + hk)[:, None] * K + ck[None, :]
        off_q = (r * H + hk)[:, None] * K + ck[None, :]
        gam_last = _gam_row(gcum_ptr, t0, last, eos, hv, ck, mk, 0., HV, K)
        # rows past the sequence end carry gam_C, as the forward's cumsum left them: every factor stays <= 1
        gI = tl.where(mI[:, None], tl.load(gcum_ptr + off_I, mask=mIk, other=0.), gam_last[None, :])
        gam = tl.where(m[:, None], tl.load(gcum_ptr + (r * HV + hv)[:, None] * K + ck[None, :], mask=mrk, other=0.),
                       gam_last[None, :])
        kI = tl.load(k_ptr + off_qI, mask=mIk, other=0.).to(tl.float32)
        qI = tl.load(q_ptr + off_qI, mask=mIk, other=0.).to(tl.float32)
        kf = tl.load(k_ptr + off_q, mask=mrk, other=0.)       # k's dtype until used: fewer registers live
        ref_a = _gam_row(gcum_ptr, t0, first_b, eos, hv, ck, mk, gam_last, HV, K)
        ref_b = _gam_row(gcum_ptr, t0, last_b, eos, hv, ck, mk, gam_last, HV, K)
        dak = tl.zeros([16, BK], dtype=tl.float32)
        daq = tl.zeros([16, BK], dtype=tl.float32)
        dbk = tl.zeros([16, BK], dtype=tl.float32)
        dbq = tl.zeros([16, BK], dtype=tl.float32)
        # ---- da through row 16 I: the earlier blocks' columns (factors <= 1 both), with inb the block's columns
        # j <= i too (exp(gam_r - gam_j) >= 1 there)
        if (blk > 0) | inb:
            col_a = (i < first_b) | (inb & (i <= last_b))
            kr = kf.to(tl.float32) * exp_fast(tl.where(col_a[:, None], ref_a[None, :] - gam, float("-inf")), FTZ)
            el = exp_fast(gI - ref_a[None, :], FTZ)
            m_g = mI[:, None] & ((i < first_b)[None, :] | (inb & (i >= first_b)[None, :]
                                                            & (i[None, :] <= first_b + li[:, None])))
            dak = el * tl.dot(tl.load(dakk_ptr + off_g, mask=m_g, other=0.), kr, input_precision=DOT_PREC)
            daq = el * tl.dot(tl.load(daqk_ptr + off_g, mask=m_g, other=0.), kr, input_precision=DOT_PREC)
        # ---- db through row 16 I + 15: the later blocks' rows, with inb the block's rows i >= j too
        if (blk < 3) | inb:
            row_b = (i > last_b) | (inb & (i >= first_b))
            el_b = exp_fast(tl.where(row_b[:, None], gam - ref_b[None, :], float("-inf")), FTZ)
            qf = tl.load(q_ptr + off_q, mask=mrk & row_b[:, None], other=0.).to(tl.float32)
            eb = exp_fast(ref_b[None, :] - gI, FTZ)
            m_gt = mI[:, None] & m[None, :] & ((i > last_b)[None, :] | (inb & (i[None, :] >= first_b + li[:, None])
                                                                        & (i <= last_b)[None, :]))
            dbk = eb * tl.dot(tl.load(dakk_ptr + off_gt, mask=m_gt, other=0.),
                              beta_all[:, None] * kf.to(tl.float32) * el_b, input_precision=DOT_PREC)
            dbq = eb * tl.dot(tl.load(daqk_ptr + off_gt, mask=m_gt, other=0.), qf * el_b, input_precision=DOT_PREC)
        dbeta += tl.sum(kI * dak, axis=1)
        dq = tl.load(dq_ptr + off_I, mask=mIk, other=0.) + daq
        dk = tl.load(dk_ptr + off_I, mask=mIk, other=0.) + beta[:, None] * dak + dbk + dbq
        dgam = tl.load(dgam_ptr + off_I, mask=mIk, other=0.)
        dgam += beta[:, None] * kI * dak - kI * dbk + qI * daq - kI * dbq
        tl.store(dq_out_ptr + off_I, dq.to(dq_out_ptr.dtype.element_ty), mask=mIk)
        tl.store(dk_out_ptr + off_I, dk.to(dk_out_ptr.dtype.element_ty), mask=mIk)
        tl.store(dgam_ptr + off_I, dgam, mask=mIk)
    if BETA_SIGMOID:
        sb = tl.sigmoid(tl.load(beta_ptr + rI * HV + hv, mask=mI, other=0.).to(tl.float32))
        dbeta = dbeta * sb * (1. - sb)
        if NEG_EIGVAL:
            dbeta = dbeta * 2.
    tl.store(dbeta_ptr + rI * HV + hv, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mI)


@triton.jit
def kda_dg_kernel(
    g_ptr, A_log, dt_bias, dgam_ptr, dg_ptr, dA_ptr, dbias_ptr, cu_ptr, chunk_idx_ptr, N,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, LOWER_BOUND: tl.constexpr,
):
    """Grid (chunk slots, HV): dg as the reverse cumsum of dgam inside the chunk (gam_C's terms are on the last row
    already), then back through FLA's KDA gate. dA [slots, HV] and dbias [slots, HV, K]: fp32 partial sums of the
    gate's parameters (zeros from surplus slots)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound: zero partial sums
        if GATE != "":
            for kb in range(0, tl.cdiv(K, BK)):
                ck = kb * BK + tl.arange(0, BK)
                tl.store(dbias_ptr + (p * HV + hv) * K + ck, tl.zeros([BK], dtype=tl.float32), mask=ck < K)
            tl.store(dA_ptr + p * HV + hv, 0.)
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    r = t0 + tl.arange(0, BT)
    m = r < eos
    d_a = tl.zeros([BT], dtype=tl.float32)                     # dA's partial sums per row
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        off_hk = (r * HV + hv)[:, None] * K + ck[None, :]
        dgam = tl.load(dgam_ptr + off_hk, mask=mrk, other=0.)
        dg = tl.sum(dgam, axis=0)[None, :] - tl.cumsum(dgam, axis=0) + dgam
        if GATE != "":
            x = tl.load(g_ptr + off_hk, mask=mrk, other=0.).to(tl.float32)
            if HAS_DT_BIAS:
                x = x + tl.load(dt_bias + hv * K + ck, mask=mk, other=0.).to(tl.float32)[None, :]
            if GATE == "softplus":
                a = tl.exp(tl.load(A_log + hv).to(tl.float32))
                d_a += tl.sum(tl.where(mrk, -a * softplus(x) * dg, 0.), axis=1)
                dg = dg * (-a * tl.sigmoid(x))
            elif GATE == "lower_bound":
                a = tl.exp(tl.load(A_log + hv).to(tl.float32))
                sg = tl.sigmoid(a * x)
                dz = dg * (LOWER_BOUND * sg * (1. - sg))
                d_a += tl.sum(tl.where(mrk, dz * a * x, 0.), axis=1)
                dg = dz * a
            else:
                sg = tl.sigmoid(x)
                dg = dg * (LOWER_BOUND * sg * (1. - sg))
            dg = tl.where(mrk, dg, 0.)
            tl.store(dbias_ptr + (p * HV + hv) * K + ck, tl.sum(dg, axis=0), mask=mk)
        tl.store(dg_ptr + off_hk, dg.to(dg_ptr.dtype.element_ty), mask=mrk)
    if GATE != "":
        tl.store(dA_ptr + p * HV + hv, tl.sum(d_a, axis=0))


@triton.jit
def kda_gva_sum_kernel(x_ptr, y_ptr, n_rows, G: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """GVA's gradient of a key head: y[r] = sum over j < G of x[r * G + j] (x [rows * G, K] fp32, the value heads of
    key head row r in order; y [rows, K] in its own dtype), the sum in fp32 and one rounding, as torch's fp32 sum and
    cast."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m = (rows < n_rows)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    for j in tl.static_range(G):
        acc += tl.load(x_ptr + (r64 * G + j) * K + cols[None, :], mask=m, other=0.)
    tl.store(y_ptr + r64 * K + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)


def _gva_sum(x_hv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """like's shape [B, T, H, K] and dtype from x_hv [B * T, H * G, K] fp32 (value head h * G + j reads key head h):
    the sum over each key head's G value heads, in one launch."""
    B, T, H, K = like.shape
    G = x_hv.shape[1] // H
    y = empty(B, T, H, K, dtype=like.dtype, device=like.device)
    n_rows = B * T * H
    if n_rows:
        launches(kda_gva_sum_kernel, (cdiv(n_rows, GVA_SUM_ROWS),), (x_hv, y, n_rows),
                 dict(G=G, K=K, BR=GVA_SUM_ROWS, BK=_pow2(K), num_warps=4))
    return y


def launch_kda_state_bwd(qdec, kdec, w, gcum, do, dh, dvnew, dht: Optional[torch.Tensor],
                         dh0: Optional[torch.Tensor], plan, scale: float, store_dh: bool = True,
                         state_v_first: bool = False):
    """KDA's reverse state pass (stage 1): GDN's chunk_state_bwd_kernel with DECAY "channel" on the decayed queries
    and keys, over the plan's sequences. store_dh=False writes only dh0 (the context-parallel pass's boundary
    gradient). state_v_first: dht and dh0 are [N, HV, V, K]."""
    HV, K = kdec.shape[-2], kdec.shape[-1]
    V = do.shape[-1]
    bv_state = min(_pow2(V), STATE_BV)
    launches(chunk_state_bwd_kernel, (cdiv(V, bv_state) * plan.N * HV,),
             (qdec, kdec, w, gcum, do, dh, dvnew, dht if dht is not None else gcum, dh0 if dh0 is not None else gcum,
              plan.cu, plan.chunk_offsets, scale),
             dict(H=HV, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=bv_state, USE_DHT=dht is not None,
                  STORE_DH0=dh0 is not None, STORE_DH=store_dh, DOT_PREC=dot_precision(qdec.dtype),
                  V_FIRST=state_v_first, DECAY="channel", num_warps=8, num_stages=1))


def launch_kda_wy_bwd(q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk, plan,
                      scale: float) -> None:
    """The backward's WY stage (kda_wy_bwd_kernel) over the plan's chunk slots and value heads."""
    K, HV, V = q.shape[-1], v.shape[-2], v.shape[-1]
    launches(kda_wy_bwd_kernel, (plan.num_slots, HV),
             (q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk, plan.cu,
              plan.chunk_indices, plan.chunk_offsets, plan.N, scale),
             dict(H=q.shape[-2], HV=HV, K=K, V=V, BT=CHUNK, BK=min(_pow2(K), WY_BK), BV=_pow2(V),
                  DOT_PREC=dot_precision(q.dtype), num_warps=WY_WARPS, num_stages=WY_STAGES))


def chunk_kda_bwd(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                  gate: str, lower_bound: float, beta_sigmoid: bool, neg_eigval: bool, do: torch.Tensor,
                  dht: Optional[torch.Tensor], state_v_first: bool = False, state_pass=None, state_bwd=None,
                  saved: Optional[KdaIntermediates] = None, wy_bwd=None):
    """The inputs as chunk_kda_fwd takes them, do [B, T, HV, V] and dht [N, HV, K, V] (or None), contiguous.
    Returns dq, dk, dv, dg, dbeta in their inputs' dtypes, d initial_state (fp32) or None, dA_log and ddt_bias
    (in their inputs' dtypes) or None. state_v_first: initial_state, dht and d initial_state are [N, HV, V, K].
    state_pass: the recomputed forward's stage 3 (chunk_kda_fwd's hook); state_bwd: replaces the reverse state pass,
    called as GDN's hook, state_bwd(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, scale) (the
    context-parallel pass's; launch_kda_state_bwd is the default). saved: the forward's intermediates where the
    caller kept or rebuilt them (chunk_kda_fwd(keep=True) or kda_recompute); otherwise the forward is recomputed.
    wy_bwd: replaces the WY stage, called with launch_kda_wy_bwd's arguments (the default)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    dt = q.dtype
    dot_prec = dot_precision(dt)
    fwd = saved
    if fwd is None:
        _, _, fwd = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, False, cu_seqlens, A_log, dt_bias, gate,
                                  lower_bound, beta_sigmoid, neg_eigval, keep=True, state_v_first=state_v_first,
                                  state_pass=state_pass)
    plan = fwd.plan
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    BK, BV = _pow2(K), _pow2(V)

    dvnew = empty(T_tot, HV, V, dtype=dt, device=dev)
    launches(chunk_dv_local_kernel, (slots, HV), (fwd.qdec, fwd.kdec, fwd.gcum, do, dvnew, plan.cu, plan.chunk_indices,
                                                  N, scale),
             dict(H=HV, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=min(BV, 64), DOT_PREC=dot_prec, DECAY="channel",
                  num_warps=4), tensors=dict(aqk_ptr=fwd.aqk))
    dh = empty(slots, HV, K, V, dtype=dt, device=dev)
    dh0 = empty(*initial_state.shape, dtype=torch.float32, device=dev) if initial_state is not None else None
    if state_bwd is None:
        launch_kda_state_bwd(fwd.qdec, fwd.kdec, fwd.w, fwd.gcum, do, dh, dvnew, dht, dh0, plan, scale,
                             state_v_first=state_v_first)
    else:
        state_bwd(fwd.qdec, fwd.kdec, fwd.w, fwd.gcum, do, dh, dvnew, dht, dh0, plan, scale)

    dq_hv = empty(T_tot, HV, K, dtype=torch.float32, device=dev)
    dk_hv = empty(T_tot, HV, K, dtype=torch.float32, device=dev)
    dgam = empty(T_tot, HV, K, dtype=torch.float32, device=dev)
    dbeta_part = empty(T_tot, HV, dtype=torch.float32, device=dev)
    dakk = empty(T_tot, HV, CHUNK, dtype=torch.float32, device=dev)
    daqk = empty(T_tot, HV, CHUNK, dtype=torch.float32, device=dev)
    dv = empty(B, T, HV, V, dtype=v.dtype, device=dev)
    (launch_kda_wy_bwd if wy_bwd is None else wy_bwd)(
        q, k, v, fwd.gcum, fwd.beta, fwd.tinv, fwd.h, fwd.vnew, do, dh, dvnew, dq_hv, dk_hv, dv, dgam, dbeta_part,
        dakk, daqk, plan, scale)
    dg = empty(B, T, HV, K, dtype=g.dtype, device=dev)
    dbeta = empty(B, T, HV, dtype=beta.dtype, device=dev)
    dA = empty(slots, HV, dtype=torch.float32, device=dev) if gate else None
    dbias = empty(slots, HV, K, dtype=torch.float32, device=dev) if gate else None
    # without GVA (HV = H) the pair kernel stores dq / dk complete in their inputs' dtypes; with it, in place in
    # fp32, and each key head's gradient sums those of the value heads that read it afterwards
    G = HV // H
    dq_out = dq_hv if G > 1 else empty(B, T, H, K, dtype=q.dtype, device=dev)
    dk_out = dk_hv if G > 1 else empty(B, T, H, K, dtype=k.dtype, device=dev)
    ftz = ftz_exp2(q)
    launches(kda_pair_diag_bwd_kernel, (slots * CHUNK, -(-HV // DIAG_BH)),
             (k, q, fwd.gcum, fwd.beta, dakk, daqk, fwd.pairwise, dq_hv, dk_hv, dgam, dbeta_part, plan.cu,
              plan.chunk_indices, N),
             dict(H=H, HV=HV, K=K, BT=CHUNK, BK=BK, BH=DIAG_BH, FTZ=ftz, num_warps=DIAG_BH))
    launches(kda_pair_bwd_kernel, (4 * slots, HV),
             (k, q, fwd.gcum, fwd.beta, beta, dakk, daqk, dbeta_part, fwd.pairwise, dq_hv, dk_hv, dgam, dbeta, dq_out,
              dk_out, plan.cu, plan.chunk_indices, N),
             dict(H=H, HV=HV, K=K, BT=CHUNK, BK=min(BK, PAIR_BK), DOT_PREC=dot_prec, BETA_SIGMOID=beta_sigmoid,
                  NEG_EIGVAL=neg_eigval, FTZ=ftz, num_warps=PAIR_WARPS, num_stages=PAIR_STAGES))
    launches(kda_dg_kernel, (slots, HV),
             (g, A_log, dt_bias, dgam, dg, dA, dbias, plan.cu, plan.chunk_indices, N),
             dict(HV=HV, K=K, BT=CHUNK, BK=min(BK, DG_BK), GATE=gate, HAS_DT_BIAS=dt_bias is not None,
                  LOWER_BOUND=float(lower_bound) if gate.startswith("lower_bound") else 0.0, num_warps=4))
    dq = _gva_sum(dq_hv, q) if G > 1 else dq_out
    dk = _gva_sum(dk_hv, k) if G > 1 else dk_out
    dA_log = col_sum(dA, A_log.shape, A_log.dtype, launches) if gate and A_log is not None else None
    ddt_bias = col_sum(dbias, dt_bias.shape, dt_bias.dtype, launches) if gate and dt_bias is not None else None
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias
