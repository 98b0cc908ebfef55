"""KDA's stage 2a: per (chunk slot, value head), what its per-key-channel decays change in the chunk form.

With gam [64, K] the cumulative log decay of the chunk per key channel (gcum, fp32), the chunk form of KDA is GDN's
(shared/gdn-math.md) with every exp(gam_i - gam_j) taken per channel inside the K sums:

    Akk_ij = beta_i sum_d k_id k_jd exp(gam_id - gam_jd)     (i > j)        Tinv = (I + Akk)^-1
    Aqk_ij =        sum_d q_id k_jd exp(gam_id - gam_jd)     (i >= j)
    W = Tinv diag(beta) (K * exp(gam)),   U = Tinv diag(beta) V         (wu_kernel, DECAY "channel")
    Vnew = U - W S,   S_next = diag(exp(gam_C)) S + (K * exp(gam_C - gam))^T Vnew     (chunk_state, "channel")
    O = ((Q * exp(gam)) S + Aqk Vnew) * scale                           (chunk_output, "channel")

This kernel computes gcum (the gate first where it is fused), the effective beta, Akk -> Tinv (GDN's block
substitution, tinv_blocks), Aqk, and the decayed keys and queries that the shared GDN stages read: K * exp(gam_C -
gam) and Q * exp(gam), both <= 1 in their factors.

Numerical safety (FLA's approach): exp(gam_i - gam_j) is never formed from exp(+gam). Across 16-row blocks, row
block I's products go through the reference row r = 16 I: (k_i exp(gam_i - gam_r)) . (k_j exp(gam_r - gam_j)) with
both factors <= 1 (gam decreases along the chunk, j < r <= i), as [64, BK] x [BK, 64] products summed over the
key blocks. Inside a 16-row
block the pairs are formed token by token (16 columns, exp of the masked difference), so no factor can overflow
whatever the decay.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, exp2_fast, slot_chunk, softplus

LOG2E = tl.constexpr(1.4426950408889634)          # exp(x) = 2^(x log2 e)
from linattn.ops.gated_delta_rule.triton.intra_split import store_tinv_blocks, tinv_blocks


@triton.jit
def _kda_gate(x, A_log, dt_bias, hv, ck, mk, K: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
              LOWER_BOUND: tl.constexpr):
    """FLA's KDA gate on the raw input x [BT, BK] of value head hv ("" : x is the log decay already)."""
    if GATE == "":
        return x
    else:
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias + hv * K + ck, mask=mk, other=0.).to(tl.float32)[None, :]
        if GATE == "lower_bound_no_a":
            return LOWER_BOUND * tl.sigmoid(x)
        else:
            a = tl.exp(tl.load(A_log + hv).to(tl.float32))
            if GATE == "softplus":
                return -a * softplus(x)
            else:
                tl.static_assert(GATE == "lower_bound", "GATE: '', softplus, lower_bound, lower_bound_no_a")
                return LOWER_BOUND * tl.sigmoid(a * x)


@triton.jit
def _store_decayed_qk(kdec_ptr, qdec_ptr, off_hk, kf, qf, gam, gam_last, mask):
    """The decayed keys and queries of the state and output stages: K * exp(gam_C - gam) and Q * exp(gam)."""
    tl.store(kdec_ptr + off_hk, (kf * tl.exp(gam_last[None, :] - gam)).to(kdec_ptr.dtype.element_ty), mask=mask)
    tl.store(qdec_ptr + off_hk, (qf * tl.exp(gam)).to(qdec_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kda_intra_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, A_log, dt_bias,     # q, k [T_tot, H, K]; g [T_tot, HV, K]; beta [T_tot, HV]
    gcum_ptr, beta_out_ptr, tinv_ptr, aqk_ptr,         # gcum [T_tot, HV, K] fp32, beta fp32, tinv / aqk [T_tot, HV, BT]
    kdec_ptr, qdec_ptr,                                # K * exp(gam_C - gam), Q * exp(gam): [T_tot, HV, K]
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, FTZ: tl.constexpr,
):
    """Grid (chunk slots, HV). FTZ: exponentials by exp2_fast's single instruction (the gate's cumsum is scaled
    to base 2 once per key block). Every quantity but Akk, Aqk and Tinv is per key channel, so the key row is walked in
    blocks of BK channels (the live set is a few [BT, BK] tiles and the two [BT, BT] sums). Inside a 16-row block,
    step s pairs row i with row 16 (i // 16) + s of its block, read back from memory (gcum after a barrier); the
    in-block sums are kept as [BT, 16] (row i, step s) and placed in Akk / Aqk once after the walk."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)
    i = tl.arange(0, BT)
    r = t0 + i
    m = r < eos
    last = tl.minimum(eos - t0, BT) - 1
    rb = t0 + 16 * (i // 16)                   # the first row of row i's 16-row block
    s16 = tl.arange(0, 16)

    # ---- the effective beta
    beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        beta = tl.sigmoid(beta)
        if NEG_EIGVAL:
            beta = beta * 2.
    beta = tl.where(m, beta, 0.)
    tl.store(beta_out_ptr + r * HV + hv, beta, mask=m)

    akk = tl.zeros([BT, BT], dtype=tl.float32)
    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    in_k = tl.zeros([BT, 16], dtype=tl.float32)           # [i, s]: Akk's pair (i, 16 (i // 16) + s)
    in_q = tl.zeros([BT, 16], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        off_hk = (r * HV + hv)[:, None] * K + ck[None, :]      # [T_tot, HV, K] offsets of the chunk's rows
        off_q = (r * H + hk)[:, None] * K + ck[None, :]
        # ---- gates: the decay per key channel (0 past the sequence end and past K), its cumsum
        x = tl.load(g_ptr + off_hk, mask=mrk, other=0.).to(tl.float32)
        x = tl.where(mrk, _kda_gate(x, A_log, dt_bias, hv, ck, mk, K, GATE, HAS_DT_BIAS, LOWER_BOUND), 0.)
        gam = tl.cumsum(x, axis=0)
        tl.store(gcum_ptr + off_hk, gam, mask=mrk)
        kf = tl.load(k_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        qf = tl.load(q_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        gam_last = tl.sum(tl.where(i[:, None] == last, gam, 0.), axis=0)
        _store_decayed_qk(kdec_ptr, qdec_ptr, off_hk, kf, qf, gam, gam_last, mrk)
        tl.debug_barrier()                                  # gcum's rows are read back below by other threads
        # rows past the sequence end read gam_C (the cumsum's value there): every factor stays <= 1
        mb = (rb < eos)[:, None] & mk[None, :]
        g0 = tl.where(mb, tl.load(gcum_ptr + (rb * HV + hv)[:, None] * K + ck[None, :], mask=mb, other=0.),
                      gam_last[None, :])
        # ---- across 16-row blocks: row block I through its reference row 16 I, both factors <= 1 (base 2 below)
        gam2 = gam * LOG2E
        el = exp2_fast(gam2 - g0 * LOG2E, FTZ)
        kl = kf * el
        ql = qf * el
        for blk in range(1, BT // 16):
            ref = tl.sum(tl.where(i[:, None] == 16 * blk, gam2, 0.), axis=0)              # [BK]
            kr = kf * exp2_fast(tl.where((i < 16 * blk)[:, None], ref[None, :] - gam2, float("-inf")), FTZ)
            rows_in = (i // 16 == blk)[:, None]
            akk += tl.dot(tl.where(rows_in, kl, 0.), tl.trans(kr), input_precision=DOT_PREC)
            aqk += tl.dot(tl.where(rows_in, ql, 0.), tl.trans(kr), input_precision=DOT_PREC)
        # ---- inside each 16-row block: the pair (i, 16 (i // 16) + s), token by token; each step's sums are
        # selected into place (every column is written once per key block) and added to the totals after the walk
        step_k = tl.zeros([BT, 16], dtype=tl.float32)
        step_q = tl.zeros([BT, 16], dtype=tl.float32)
        for s in range(0, 16):
            rs = rb + s
            ms = (rs < eos)[:, None] & mk[None, :]
            gs = tl.where(ms, tl.load(gcum_ptr + (rs * HV + hv)[:, None] * K + ck[None, :], mask=ms, other=0.),
                          gam_last[None, :])
            ks = tl.load(k_ptr + (rs * H + hk)[:, None] * K + ck[None, :], mask=ms, other=0.).to(tl.float32)
            e = ks * exp2_fast(tl.where((i % 16 >= s)[:, None], gam2 - gs * LOG2E, float("-inf")), FTZ)
            step_k = tl.where(s16[None, :] == s, tl.sum(kf * e, axis=1)[:, None], step_k)
            step_q = tl.where(s16[None, :] == s, tl.sum(qf * e, axis=1)[:, None], step_q)
        in_k += step_k
        in_q += step_q
    # place the in-block sums: column 16 (i // 16) + s of row i
    blk4 = (tl.arange(0, 4)[None, :, None] == (i // 16)[:, None, None])
    akk += tl.reshape(tl.where(blk4 & (s16[None, None, :] < (i % 16)[:, None, None]), in_k[:, None, :], 0.), [BT, BT])
    aqk += tl.reshape(tl.where(blk4 & (s16[None, None, :] <= (i % 16)[:, None, None]), in_q[:, None, :], 0.), [BT, BT])
    akk = akk * beta[:, None]

    LOWP: tl.constexpr = tinv_ptr.dtype.element_ty == tl.bfloat16
    d, t1, t2, t3 = tinv_blocks(akk, DOT_PREC, LOWP)
    store_tinv_blocks(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)
    tl.store(aqk_ptr + (r * HV + hv)[:, None] * BT + i[None, :], aqk.to(aqk_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def kda_decayed_qk_kernel(
    q_ptr, k_ptr, gcum_ptr, kdec_ptr, qdec_ptr,        # q, k [T_tot, H, K]; gcum [T_tot, HV, K] fp32; kdec, qdec
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    """Grid (chunk slots, HV): kda_intra_kernel's decayed keys and queries again from a saved gcum (the backward's
    recompute when the forward kept gcum, Tinv and Aqk)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)
    r = t0 + tl.arange(0, BT)
    m = r < eos
    last = tl.minimum(eos, t0 + BT) - 1
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        off_hk = (r * HV + hv)[:, None] * K + ck[None, :]
        off_q = (r * H + hk)[:, None] * K + ck[None, :]
        gam = tl.load(gcum_ptr + off_hk, mask=mrk, other=0.)
        gam_last = tl.load(gcum_ptr + (last * HV + hv) * K + ck, mask=mk, other=0.)
        kf = tl.load(k_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        qf = tl.load(q_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        _store_decayed_qk(kdec_ptr, qdec_ptr, off_hk, kf, qf, gam, gam_last, mrk)
