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
both factors <= 1 (gam decreases along the chunk, j < r <= i), as [64, K] x [K, 64] products. Inside a 16-row
block the pairs are formed token by token (16 columns, exp of the masked difference), so no factor can overflow
whatever the decay.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, slot_chunk, softplus
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
def _row_of_block(x, j, BT: tl.constexpr, BK: tl.constexpr):
    """[BT, BK] -> [BT, BK] whose row i is x's row 16 (i // 16) + j (row j of the 16-row block holding row i)."""
    x4 = tl.reshape(x, [BT // 16, 16, BK])
    r16 = tl.arange(0, 16)[None, :, None]
    rows = tl.sum(tl.where(r16 == j, x4, 0.), axis=1)                       # [BT // 16, BK]
    return tl.reshape(tl.broadcast_to(rows[:, None, :], [BT // 16, 16, BK]), [BT, BK])


@triton.jit
def kda_intra_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, A_log, dt_bias,     # q, k [T_tot, H, K]; g [T_tot, HV, K]; beta [T_tot, HV]
    gcum_ptr, beta_out_ptr, tinv_ptr, aqk_ptr,         # gcum [T_tot, HV, K] fp32, beta fp32, tinv / aqk [T_tot, HV, BT]
    kdec_ptr, qdec_ptr,                                # K * exp(gam_C - gam), Q * exp(gam): [T_tot, HV, K]
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
):
    """Grid (chunk slots, HV). BK >= K (the whole key row in one block)."""
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
    ck = tl.arange(0, BK)
    mk = ck < K
    mrk = m[:, None] & mk[None, :]
    off_hk = (r * HV + hv)[:, None] * K + ck[None, :]          # [T_tot, HV, K] offsets of the chunk's rows

    # ---- gates: the decay per key channel (0 past the sequence end and past K), its cumsum; the effective beta
    x = tl.load(g_ptr + off_hk, mask=mrk, other=0.).to(tl.float32)
    x = tl.where(mrk, _kda_gate(x, A_log, dt_bias, hv, ck, mk, K, GATE, HAS_DT_BIAS, LOWER_BOUND), 0.)
    gam = tl.cumsum(x, axis=0)
    tl.store(gcum_ptr + off_hk, gam, mask=mrk)
    beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        beta = tl.sigmoid(beta)
        if NEG_EIGVAL:
            beta = beta * 2.
    beta = tl.where(m, beta, 0.)
    tl.store(beta_out_ptr + r * HV + hv, beta, mask=m)

    off_q = (r * H + hk)[:, None] * K + ck[None, :]
    kf = tl.load(k_ptr + off_q, mask=mrk, other=0.).to(tl.float32)
    qf = tl.load(q_ptr + off_q, mask=mrk, other=0.).to(tl.float32)

    # ---- across 16-row blocks: row block I through its reference row 16 I, both factors <= 1
    el = tl.exp(gam - _row_of_block(gam, 0, BT, BK))
    kl = kf * el
    ql = qf * el
    akk = tl.zeros([BT, BT], dtype=tl.float32)
    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for blk in tl.static_range(1, BT // 16):
        ref = tl.sum(tl.where(i[:, None] == 16 * blk, gam, 0.), axis=0)                   # [BK]
        kr = kf * tl.exp(tl.where((i < 16 * blk)[:, None], ref[None, :] - gam, float("-inf")))
        rows_in = (i // 16 == blk)[:, None]
        akk += tl.where(rows_in, tl.dot(kl, tl.trans(kr), input_precision=DOT_PREC), 0.)
        aqk += tl.where(rows_in, tl.dot(ql, tl.trans(kr), input_precision=DOT_PREC), 0.)
    # ---- inside each 16-row block: column 16 (i // 16) + j of row i, token by token
    for j in tl.static_range(0, 16):
        kj = _row_of_block(kf, j, BT, BK)
        gj = _row_of_block(gam, j, BT, BK)
        keep = (i % 16 >= j)[:, None]
        e = kj * tl.exp(tl.where(keep, gam - gj, float("-inf")))
        col_k = tl.sum(kf * e, axis=1)
        col_q = tl.sum(qf * e, axis=1)
        hit = i[None, :] == (16 * (i // 16) + j)[:, None]
        akk += tl.where(hit & (i % 16 > j)[:, None], col_k[:, None], 0.)
        aqk += tl.where(hit, col_q[:, None], 0.)
    akk = akk * beta[:, None]

    LOWP: tl.constexpr = tinv_ptr.dtype.element_ty == tl.bfloat16
    d, t1, t2, t3 = tinv_blocks(akk, DOT_PREC, LOWP)
    store_tinv_blocks(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)
    tl.store(aqk_ptr + (r * HV + hv)[:, None] * BT + i[None, :], aqk.to(aqk_ptr.dtype.element_ty), mask=m[:, None])

    # ---- the decayed keys and queries of the state and output stages
    last = tl.minimum(eos - t0, BT) - 1
    gam_last = tl.sum(tl.where(i[:, None] == last, gam, 0.), axis=0)
    tl.store(kdec_ptr + off_hk, (kf * tl.exp(gam_last[None, :] - gam)).to(kdec_ptr.dtype.element_ty), mask=mrk)
    tl.store(qdec_ptr + off_hk, (qf * tl.exp(gam)).to(qdec_ptr.dtype.element_ty), mask=mrk)
