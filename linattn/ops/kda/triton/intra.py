"""KDA's stage 2a: per (chunk slot, value head), what its per-key-channel decays change in the chunk form.

With gam [64, K] the cumulative log decay of the chunk per key channel (gcum, fp32), the chunk form of KDA is GDN's
(shared/gdn-math.md) with every exp(gam_i - gam_j) taken per channel inside the K sums:

    Akk_ij = beta_i sum_d k_id k_jd exp(gam_id - gam_jd)     (i > j)        Tinv = (I + Akk)^-1
    Aqk_ij =        sum_d q_id k_jd exp(gam_id - gam_jd)     (i >= j)
    W = Tinv diag(beta) (K * exp(gam)),   U = Tinv diag(beta) V         (wu_kernel, DECAY "channel")
    Vnew = U - W S,   S_next = diag(exp(gam_C)) S + (K * exp(gam_C - gam))^T Vnew     (chunk_state, "channel")
    O = ((Q * exp(gam)) S + Aqk Vnew) * scale                           (chunk_output, "channel")

Three kernels compute it: kda_cumsum_kernel the gates' cumsum gcum (the gate first where it is fused), the
effective beta, the decayed keys and queries that the shared GDN stages read (K * exp(gam_C - gam) and
Q * exp(gam), both <= 1 in their factors) and the chunk's pairwise flag; kda_diag_kernel the pairs inside each
16-row block token by token, for the chunks flagged pairwise only (one token and a few value heads per program, the
head's key row in one warp; the other programs return at once); kda_inter_solve_kernel the pairs across blocks (and
inside them where the chunk is not flagged), Akk -> Tinv (GDN's block substitution, tinv_blocks) and Aqk.

Numerical safety. exp(gam_i - gam_j) is never formed from exp(+gam). Across 16-row blocks, row block I's products
go through its first row r = 16 I (FLA's approach): (k_i exp(gam_i - gam_r)) . (k_j exp(gam_r - gam_j)) with both
factors <= 1 (gam decreases along the chunk, j < r <= i), as [64, BK] x [BK, 64] products summed over the key
blocks. Inside a block the same product through r has a second factor >= 1, up to exp of the block's span of gam
(r's row against the block's last): where every such factor times the chunk's largest |k|, |q| squared stays within
2^SPAN_LOG2 (2^100: fp32 overflows past 2^128, and the 128-term sums and the TF32 operands keep their relative
precision far below it), kda_inter_solve_kernel takes the in-block pairs in the same products, masked to j < i
(Akk) and j <= i (Aqk) afterwards; otherwise (a decay steeper than e^-4.6 per token held over a block, say) the chunk
is flagged pairwise and kda_diag_kernel forms each in-block pair as exp of its own difference (<= 0), so no factor
can overflow whatever the decay.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import (LOG2E, chunk_span, exp2_fast, kda_gate_act, slot_chunk,
                                                        store_tile)
from linattn.ops.gated_delta_rule.triton.intra_split import store_tinv_blocks, tinv_blocks, u_tiles

# In-block pairs through the block's first row only where a factor times the largest |k|, |q| squared stays within
# 2 ** SPAN_LOG2 (the module's docstring)
SPAN_LOG2 = tl.constexpr(100.0)


@triton.jit
def _kda_gate(x, A_log, dt_bias, hv, ck, mk, K: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
              LOWER_BOUND: tl.constexpr):
    """FLA's KDA gate on the raw input x [BT, BK] of value head hv ("" : x is the log decay already)."""
    if GATE == "":
        return x
    else:
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias + hv * K + ck, mask=mk, other=0.).to(tl.float32)[None, :]
        return kda_gate_act(x, A_log, hv, GATE, LOWER_BOUND)


@triton.jit
def _store_decayed_qk(kdec_ptr, qdec_ptr, off_hk, kf, qf, gam, gam_last, mask):
    """The decayed keys and queries of the state and output stages: K * exp(gam_C - gam) and Q * exp(gam)."""
    tl.store(kdec_ptr + off_hk, (kf * tl.exp(gam_last[None, :] - gam)).to(kdec_ptr.dtype.element_ty), mask=mask)
    tl.store(qdec_ptr + off_hk, (qf * tl.exp(gam)).to(qdec_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_absmax(amax, kf, qf):
    """amax updated with the largest |k|, |q| of a key block ([BT, BK] tiles): the pairwise test's second factor."""
    return tl.maximum(amax, tl.maximum(tl.max(tl.max(tl.abs(kf), axis=1), axis=0),
                                       tl.max(tl.max(tl.abs(qf), axis=1), axis=0)))


@triton.jit
def _store_pairwise_flag(pairwise_ptr, span, amax, hv, HV: tl.constexpr):
    """The chunk's pairwise flag (the module's docstring): 0 where span (the largest |gam_i - gam_r|, r the first row
    of i's block) times amax squared stays within 2^SPAN_LOG2, else 1 (a NaN gives 1)."""
    safe = span * LOG2E + 2. * tl.log2(amax) <= SPAN_LOG2
    tl.store(pairwise_ptr + tl.program_id(0) * HV + hv, tl.where(safe, 0, 1).to(tl.int8))


@triton.jit
def chunk_rows(chunk_idx_ptr, cu_ptr, N, H: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr):
    """What a (chunk slot, value head) program of KDA's chunk kernels starts from: program (p, hv) takes chunk slot
    p of value head hv. Returns live (False for a surplus slot of the varlen bound: the program returns), the
    slot's sequence n and chunk c, t0, eos, hv, its key head hk, the row indices i, the tokens r = t0 + i, their
    mask m (r < eos) and the chunk's last row `last` (relative to t0)."""
    n, c = slot_chunk(chunk_idx_ptr, tl.program_id(0))
    live = n < N
    bos, eos, t0 = chunk_span(cu_ptr, tl.minimum(n, N - 1), c, BT)
    hv = tl.program_id(1)
    i = tl.arange(0, BT)
    r = t0 + i
    return live, n, c, t0, eos, hv, hv // (HV // H), i, r, r < eos, tl.minimum(eos - t0, BT) - 1


@triton.jit
def _segment_add(f1, v1, f2, v2):
    """The combine of a scan that restarts at every flagged row: (flag, running sum)."""
    return f1 | f2, tl.where(f2, v2, v1 + v2)


@triton.jit
def kda_cumsum_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, A_log, dt_bias,     # q, k [T_tot, H, K]; g [T_tot, HV, K]; beta [T_tot, HV]
    gcum_ptr, beta_out_ptr, kdec_ptr, qdec_ptr,        # gcum [T_tot, HV, K] fp32, beta fp32; kdec, qdec [T_tot, HV, K]
    pairwise_ptr,                                      # [slots, HV] int8: 1 where the in-block pairs go pair by pair
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
):
    """Grid (chunk slots, HV): the per-token part of stage 2a. The effective beta, the decay per key channel (the
    gate first where it is fused; 0 past the sequence end), its cumsum over the chunk (gcum), the decayed keys
    and queries of the state and output stages, and the chunk's pairwise flag: 0 where the in-block pairs may go
    through each block's first row (every |gam_i - gam_r| of a row i and its block's first row r within
    2^SPAN_LOG2 with the largest |k|, |q| of the chunk: see the module's docstring), else 1."""
    live, n, c, t0, eos, hv, hk, i, r, m, last = chunk_rows(chunk_idx_ptr, cu_ptr, N, H, HV, BT)
    if not live:
        return
    beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        beta = tl.sigmoid(beta)
        if NEG_EIGVAL:
            beta = beta * 2.
    tl.store(beta_out_ptr + r * HV + hv, tl.where(m, beta, 0.), mask=m)
    span = tl.full([], 0., tl.float32)         # the largest |gam_i - gam_r| over the chunk (r: i's block's first row)
    amax = tl.full([], 1., tl.float32)         # the largest |k|, |q| of the chunk, at least 1
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        off_hk = (r * HV + hv)[:, None] * K + ck[None, :]
        off_q = (r * H + hk)[:, None] * K + ck[None, :]
        x = tl.load(g_ptr + off_hk, mask=mrk, other=0.).to(tl.float32)
        x = tl.where(mrk, _kda_gate(x, A_log, dt_bias, hv, ck, mk, K, GATE, HAS_DT_BIAS, LOWER_BOUND), 0.)
        gam = tl.cumsum(x, axis=0)
        tl.store(gcum_ptr + off_hk, gam, mask=mrk)
        kf = tl.load(k_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        qf = tl.load(q_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        gam_last = tl.sum(tl.where(i[:, None] == last, gam, 0.), axis=0)
        _store_decayed_qk(kdec_ptr, qdec_ptr, off_hk, kf, qf, gam, gam_last, mrk)
        first = ((i % 16) == 0)[:, None] & mk[None, :]
        _, d = tl.associative_scan((first, tl.where(first, 0., x)), 0, _segment_add)   # gam_i - gam_(block start)
        span = tl.maximum(span, tl.max(tl.max(tl.abs(d), axis=1), axis=0))
        amax = _qk_absmax(amax, kf, qf)
    _store_pairwise_flag(pairwise_ptr, span, amax, hv, HV)


@triton.jit
def token_rows(chunk_idx_ptr, cu_ptr, gcum_ptr, k_ptr, q_ptr, N, slot, row, H: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    """What a token of the in-block pairs starts from (kda_diag_kernel): row `row` of chunk slot `slot` and BH value
    heads from program_id(1) * BH. Returns live (False for a surplus slot of the
    varlen bound or a row past its sequence: nothing to do), t, t0, eos, s0 (the first row of t's 16-row block), the
    heads (hvs, mh), the [BH, BK] mask and offsets of a token's gate row (off_g) and key / query row (off_k), and
    t's gate (times log2 e), key and query rows in fp32."""
    n, c = slot_chunk(chunk_idx_ptr, slot)
    live = n < N
    bos, eos, t0 = chunk_span(cu_ptr, tl.minimum(n, N - 1), c, BT)
    t = t0 + row
    live = live & (t < eos)
    s0 = t0 + 16 * (row // 16)
    hvs = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = hvs < HV
    hks = hvs // (HV // H)
    ck = tl.arange(0, BK)
    mhk = mh[:, None] & (ck < K)[None, :] & live
    off_g = hvs[:, None] * K + ck[None, :]     # within a token's [HV, K] row
    off_k = hks[:, None] * K + ck[None, :]
    gt = tl.load(gcum_ptr + t * HV * K + off_g, mask=mhk, other=0.) * LOG2E
    kt = tl.load(k_ptr + t * H * K + off_k, mask=mhk, other=0.).to(tl.float32)
    qt = tl.load(q_ptr + t * H * K + off_k, mask=mhk, other=0.).to(tl.float32)
    return live, t, t0, eos, s0, hvs, mh, mhk, off_g, off_k, gt, kt, qt


@triton.jit
def kda_diag_kernel(
    q_ptr, k_ptr, gcum_ptr, pairwise_ptr,              # q, k [T_tot, H, K]; gcum [T_tot, HV, K] fp32; [slots, HV] int8
    akkd_ptr, aqkd_ptr,                                # [T_tot, HV, 16] fp32: the in-block sums of row t
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
    FTZ: tl.constexpr,
):
    """Grid (chunk slots * BT / 16, cdiv(HV, BH)): one 16-row block of a chunk and BH value heads per program, the
    pairs of Akk / Aqk inside the block for the heads whose chunk is flagged pairwise (a program with none returns
    at once, so a call with no flagged chunk costs one small launch): token by token, for each earlier-or-same row j
    of the block, sum_d k_jd exp(gam_td - gam_jd) times k_td (Akk, column j < t) and q_td (Aqk, column j <= t), into
    column j - (the block's first row) of akkd / aqkd. Only the pairs that exist (no masked half), every factor exp
    of a difference <= 0. Columns after t, and the heads not flagged, are not written: kda_inter_solve_kernel does
    not read them."""
    slot = tl.program_id(0) // (BT // 16)
    hvs = tl.program_id(1) * BH + tl.arange(0, BH)
    pw = tl.load(pairwise_ptr + slot * HV + hvs, mask=hvs < HV, other=0) != 0
    if tl.max(pw.to(tl.int32), axis=0) == 0:
        return
    for row in range(16 * (tl.program_id(0) % (BT // 16)), 16 * (tl.program_id(0) % (BT // 16)) + 16):
        live, t, t0, eos, s0, hvs, mh, mhk, off_g, off_k, gt, kt, qt = token_rows(
            chunk_idx_ptr, cu_ptr, gcum_ptr, k_ptr, q_ptr, N, slot, row, H, HV, K, BT, BH, BK)
        mh = mh & pw & live
        mhk = mhk & pw[:, None]
        for j in range(s0, t + 1):
            gj = tl.load(gcum_ptr + j * HV * K + off_g, mask=mhk, other=0.)
            kj = tl.load(k_ptr + j * H * K + off_k, mask=mhk, other=0.).to(tl.float32)
            e = kj * exp2_fast(tl.where(mhk, gt - gj * LOG2E, float("-inf")), FTZ)
            col = (t * HV + hvs) * 16 + (j - s0)
            tl.store(akkd_ptr + col, tl.sum(kt * e, axis=1), mask=mh)
            tl.store(aqkd_ptr + col, tl.sum(qt * e, axis=1), mask=mh)


@triton.jit
def kda_inter_solve_kernel(
    q_ptr, k_ptr, gcum_ptr, beta_eff_ptr, pairwise_ptr, akkd_ptr, aqkd_ptr,
    tinv_ptr, aqk_ptr,                                 # tinv / aqk [T_tot, HV, BT]
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, FTZ: tl.constexpr,
):
    """Grid (chunk slots, HV): Akk and Aqk, then Tinv = (I + diag(beta) Akk)^-1 (GDN's block substitution) and Aqk
    stored. Row block I's products go through its first row r = 16 I: (x_i exp(gam_i - gam_r)) . (k_j exp(gam_r -
    gam_j)), as [64, BK] x [BK, 64] products over the key blocks: for the rows j of earlier blocks (both factors
    <= 1), and for block I's own rows too unless the chunk is flagged pairwise (then its in-block sums come from
    kda_diag_kernel)."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    live, n, c, t0, eos, hv, hk, i, r, m, last = chunk_rows(chunk_idx_ptr, cu_ptr, N, H, HV, BT)
    if not live:
        return
    rb = t0 + 16 * (i // 16)                   # the first row of row i's 16-row block
    s16 = tl.arange(0, 16)
    pairwise = tl.load(pairwise_ptr + tl.program_id(0) * HV + hv).to(tl.int32)
    own = 16 - 16 * pairwise                   # how many of block I's own rows its products take: 16 or 0
    akk = tl.zeros([BT, BT], dtype=tl.float32)
    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        gam_last = tl.load(gcum_ptr + ((t0 + last) * HV + hv) * K + ck, mask=mk, other=0.)
        # rows past the sequence end read gam_C (the cumsum's value there): every factor stays <= 1
        gam = tl.where(m[:, None], tl.load(gcum_ptr + (r * HV + hv)[:, None] * K + ck[None, :], mask=mrk, other=0.),
                       gam_last[None, :])
        mb = (rb < eos)[:, None] & mk[None, :]
        g0 = tl.where(mb, tl.load(gcum_ptr + (rb * HV + hv)[:, None] * K + ck[None, :], mask=mb, other=0.),
                      gam_last[None, :])
        off_q = (r * H + hk)[:, None] * K + ck[None, :]
        kf = tl.load(k_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        qf = tl.load(q_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
        gam2 = gam * LOG2E
        el = exp2_fast(gam2 - g0 * LOG2E, FTZ)
        kl = kf * el
        ql = qf * el
        for blk in range(pairwise, BT // 16):
            ref = tl.sum(tl.where(i[:, None] == 16 * blk, gam2, 0.), axis=0)              # [BK]
            kr = kf * exp2_fast(tl.where((i < 16 * blk + own)[:, None], ref[None, :] - gam2, float("-inf")), FTZ)
            rows_in = (i // 16 == blk)[:, None]
            akk += tl.dot(tl.where(rows_in, kl, 0.), tl.trans(kr), input_precision=DOT_PREC)
            aqk += tl.dot(tl.where(rows_in, ql, 0.), tl.trans(kr), input_precision=DOT_PREC)
    # pairwise: the in-block sums, column 16 (i // 16) + s of row i
    off_d = (r * HV + hv)[:, None] * 16 + s16[None, :]
    mp = m[:, None] & (pairwise != 0)
    in_k = tl.load(akkd_ptr + off_d, mask=mp & (s16[None, :] < (i % 16)[:, None]), other=0.)
    in_q = tl.load(aqkd_ptr + off_d, mask=mp & (s16[None, :] <= (i % 16)[:, None]), other=0.)
    blk4 = (tl.arange(0, 4)[None, :, None] == (i // 16)[:, None, None])
    akk += tl.reshape(tl.where(blk4, in_k[:, None, :], 0.), [BT, BT])
    aqk += tl.reshape(tl.where(blk4, in_q[:, None, :], 0.), [BT, BT])
    # the products took every pair of a block: keep j < i (Akk) and j <= i (Aqk)
    akk = tl.where(i[None, :] < i[:, None], akk, 0.)
    aqk = tl.where(i[None, :] <= i[:, None], aqk, 0.)
    beta = tl.load(beta_eff_ptr + r * HV + hv, mask=m, other=0.)
    akk = akk * beta[:, None]

    LOWP: tl.constexpr = tinv_ptr.dtype.element_ty == tl.bfloat16
    d, t1, t2, t3 = tinv_blocks(akk, DOT_PREC, LOWP)
    store_tinv_blocks(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)
    tl.store(aqk_ptr + (r * HV + hv)[:, None] * BT + i[None, :], aqk.to(aqk_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def kda_recompute_wu_kernel(
    q_ptr, k_ptr, v_ptr, gcum_ptr, beta_eff_ptr, tinv_ptr,   # the op's q, k, v; the forward's saved gcum, beta, Tinv
    kdec_ptr, qdec_ptr, w_ptr, u_ptr,                        # [T_tot, HV, K] x 3 and [T_tot, HV, V] in k's dtype
    pairwise_ptr,                                            # [slots, HV] int8: kda_cumsum_kernel's flag
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (chunk slots, HV): the backward's recompute from a saved gcum, effective beta and Tinv (the forward's
    stage 2a outputs) in one pass over the chunk's key row: kda_cumsum_kernel's decayed keys and queries and its
    pairwise flag, and wu_kernel's W = Tinv diag(beta) (K * exp(gam)) and U = Tinv diag(beta) V (DECAY "channel": the
    same operations, so the same values as the forward's). One read of k and gcum serves the decayed keys and W."""
    live, n, c, t0, eos, hv, hk, i, r, m, last = chunk_rows(chunk_idx_ptr, cu_ptr, N, H, HV, BT)
    if not live:
        return
    op = k_ptr.dtype.element_ty
    beta = tl.load(beta_eff_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    # Tinv rounded to the operand dtype, as wu_kernel reads it (rows past the end load as zeros)
    tinv = tl.load(tinv_ptr + (r * HV + hv)[:, None] * BT + i[None, :], mask=m[:, None], other=0.).to(op)
    last = t0 + last                           # absolute here
    span = tl.full([], 0., tl.float32)         # as kda_cumsum_kernel's
    amax = tl.full([], 1., tl.float32)
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
        ks = (kf * (beta[:, None] * tl.exp(gam))).to(op)
        store_tile(w_ptr + t0 * HV * K + hv * K, tl.dot(tinv, ks, input_precision=DOT_PREC).to(op), 0, kb * BK,
                   eos - t0, K, HV * K)
        # gam_i - gam_(i's block's first row); rows past the end hold gam_C, as the cumsum leaves them
        g3 = tl.reshape(tl.where(m[:, None], gam, gam_last[None, :]), [BT // 16, 16, BK])
        g0 = tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :, None], g3, 0.), axis=1)
        span = tl.maximum(span, tl.max(tl.max(tl.max(tl.abs(g3 - g0[:, None, :]), axis=2), axis=1), axis=0))
        amax = _qk_absmax(amax, kf, qf)
    u_tiles(v_ptr, u_ptr, tinv, beta, t0, eos, hv, HV, V, BT, BV, DOT_PREC)
    _store_pairwise_flag(pairwise_ptr, span, amax, hv, HV)
