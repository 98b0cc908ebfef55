"""KDA's stage 2a: per (chunk slot, value head), what its per-key-channel decays change in the chunk form.

With gam [64, K] the cumulative log decay of the chunk per key channel (gcum, fp32), the chunk form of KDA is GDN's
(shared/gdn-math.md) with every exp(gam_i - gam_j) taken per channel inside the K sums:

    Akk_ij = beta_i sum_d k_id k_jd exp(gam_id - gam_jd)     (i > j)        Tinv = (I + Akk)^-1
    Aqk_ij =        sum_d q_id k_jd exp(gam_id - gam_jd)     (i >= j)
    W = Tinv diag(beta) (K * exp(gam)),   U = Tinv diag(beta) V         (wu_kernel, DECAY "channel")
    Vnew = U - W S,   S_next = diag(exp(gam_C)) S + (K * exp(gam_C - gam))^T Vnew     (chunk_state, "channel")
    O = ((Q * exp(gam)) S + Aqk Vnew) * scale                           (chunk_output, "channel")

Two kernels: kda_pairs_kernel, one program per 16-row block of a chunk (four times the programs of a chunk-wide
kernel, each with a quarter of the live registers), computes gcum (the gate first where it is fused), the effective
beta, Akk (fp32) and Aqk, and the decayed keys and queries that the shared GDN stages read: K * exp(gam_C - gam) and
Q * exp(gam), both <= 1 in their factors; kda_tinv_kernel turns Akk into Tinv (GDN's block substitution,
tinv_blocks).

Numerical safety (FLA's approach): exp(gam_i - gam_j) is never formed from exp(+gam). Across 16-row blocks, row
block I's products go through the reference row r = 16 I: (k_i exp(gam_i - gam_r)) . (k_j exp(gam_r - gam_j)) with
both factors <= 1 (gam decreases along the chunk, j < r <= i), as [16, BK] x [BK, 64] products summed over the
key blocks. Inside a 16-row block the pairs are formed token by token (16 columns, exp of the masked difference),
so no factor can overflow whatever the decay.
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
def kda_pairs_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, A_log, dt_bias,     # q, k [T_tot, H, K]; g [T_tot, HV, K]; beta [T_tot, HV]
    gcum_ptr, beta_out_ptr, akk_ptr, aqk_ptr,          # gcum [T_tot, HV, K], beta, akk fp32; aqk: [T_tot, HV, BT]
    kdec_ptr, qdec_ptr,                                # K * exp(gam_C - gam), Q * exp(gam): [T_tot, HV, K]
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
):
    """Grid (4 * chunk slots, HV): one 16-row block I = program_id(0) % 4 of a chunk per program, its rows of Akk
    (times beta, strict lower) and Aqk (lower incl.) as [16, BT], and its rows of gcum, the effective beta and the
    decayed keys and queries. The key row is walked in blocks of BK channels. Per key block: the chunk's cumsum of
    the gate as a [BT, BK] tile (the earlier rows' keys through the reference row 16 I, and gam_C), the block's own
    rows as [16, BK] tiles; in-block pairs token by token, step s pairing row i with row 16 I + s (read back from
    gcum after a barrier), kept as [16, 16] (row, step) and placed once after the walk."""
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    p = tl.program_id(0)
    hv = tl.program_id(1)
    blk = p % 4
    n, c = slot_chunk(chunk_idx_ptr, p // 4)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)
    i = tl.arange(0, BT)
    r = t0 + i
    m = r < eos
    last = tl.minimum(eos - t0, BT) - 1
    li = tl.arange(0, 16)
    rI = t0 + 16 * blk + li                    # the block's rows
    mI = rI < eos

    # ---- the effective beta of the block's rows
    beta = tl.load(beta_ptr + rI * HV + hv, mask=mI, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        beta = tl.sigmoid(beta)
        if NEG_EIGVAL:
            beta = beta * 2.
    beta = tl.where(mI, beta, 0.)
    tl.store(beta_out_ptr + rI * HV + hv, beta, mask=mI)

    akk = tl.zeros([16, BT], dtype=tl.float32)
    aqk = tl.zeros([16, BT], dtype=tl.float32)
    in_k = tl.zeros([16, 16], dtype=tl.float32)           # [l, s]: Akk's pair (16 I + l, 16 I + s)
    in_q = tl.zeros([16, 16], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ck = kb * BK + tl.arange(0, BK)
        mk = ck < K
        mrk = m[:, None] & mk[None, :]
        mIk = mI[:, None] & mk[None, :]
        # ---- gates: the decay per key channel (0 past the sequence end and past K), the chunk's cumsum
        x = tl.load(g_ptr + (r * HV + hv)[:, None] * K + ck[None, :], mask=mrk, other=0.).to(tl.float32)
        x = tl.where(mrk, _kda_gate(x, A_log, dt_bias, hv, ck, mk, K, GATE, HAS_DT_BIAS, LOWER_BOUND), 0.)
        gam = tl.cumsum(x, axis=0)                                                        # [BT, BK]
        gam_last = tl.sum(tl.where(i[:, None] == last, gam, 0.), axis=0)
        # the block's rows: the sum of the earlier rows plus the cumsum inside the block (gam_C past the end)
        off_I = (rI * HV + hv)[:, None] * K + ck[None, :]
        xI = tl.load(g_ptr + off_I, mask=mIk, other=0.).to(tl.float32)
        xI = tl.where(mIk, _kda_gate(xI, A_log, dt_bias, hv, ck, mk, K, GATE, HAS_DT_BIAS, LOWER_BOUND), 0.)
        before = tl.sum(tl.where((i < 16 * blk)[:, None], x, 0.), axis=0)
        gI = before[None, :] + tl.cumsum(xI, axis=0)                                      # [16, BK]
        tl.store(gcum_ptr + off_I, gI, mask=mIk)
        off_qI = (rI * H + hk)[:, None] * K + ck[None, :]
        kI = tl.load(k_ptr + off_qI, mask=mIk, other=0.).to(tl.float32)
        qI = tl.load(q_ptr + off_qI, mask=mIk, other=0.).to(tl.float32)
        # the decayed keys and queries of the state and output stages
        tl.store(kdec_ptr + off_I, (kI * tl.exp(gam_last[None, :] - gI)).to(kdec_ptr.dtype.element_ty), mask=mIk)
        tl.store(qdec_ptr + off_I, (qI * tl.exp(gI)).to(qdec_ptr.dtype.element_ty), mask=mIk)
        # ---- the earlier blocks' rows through the reference row 16 I, both factors <= 1
        if blk > 0:
            ref = tl.sum(tl.where(li[:, None] == 0, gI, 0.), axis=0)                      # [BK]
            el = tl.exp(gI - ref[None, :])
            kf = tl.load(k_ptr + (r * H + hk)[:, None] * K + ck[None, :], mask=mrk, other=0.).to(tl.float32)
            kr = kf * tl.exp(tl.where((i < 16 * blk)[:, None], ref[None, :] - gam, float("-inf")))
            akk += tl.dot(kI * el, tl.trans(kr), input_precision=DOT_PREC)
            aqk += tl.dot(qI * el, tl.trans(kr), input_precision=DOT_PREC)
        tl.debug_barrier()                                  # gcum's rows are read back below by other threads
        # ---- inside the block: the pair (16 I + l, 16 I + s), token by token
        for s in range(0, 16):
            rs = t0 + 16 * blk + s
            ms = (rs < eos) & mk
            gs = tl.where(ms, tl.load(gcum_ptr + (rs * HV + hv) * K + ck, mask=ms, other=0.), gam_last)
            ks = tl.load(k_ptr + (rs * H + hk) * K + ck, mask=ms, other=0.).to(tl.float32)
            e = ks[None, :] * tl.exp(tl.where((li >= s)[:, None], gI - gs[None, :], float("-inf")))
            in_k += tl.where(li[None, :] == s, tl.sum(kI * e, axis=1)[:, None], 0.)
            in_q += tl.where(li[None, :] == s, tl.sum(qI * e, axis=1)[:, None], 0.)
    # place the in-block sums: column 16 I + s of row l
    here = (tl.arange(0, 4) == blk)[None, :, None]
    akk += tl.reshape(tl.where(here & (li[None, None, :] < li[:, None, None]), in_k[:, None, :], 0.), [16, BT])
    aqk += tl.reshape(tl.where(here & (li[None, None, :] <= li[:, None, None]), in_q[:, None, :], 0.), [16, BT])
    akk = akk * beta[:, None]
    off_a = (rI * HV + hv)[:, None] * BT + i[None, :]
    tl.store(akk_ptr + off_a, akk, mask=mI[:, None])
    tl.store(aqk_ptr + off_a, aqk.to(aqk_ptr.dtype.element_ty), mask=mI[:, None])


@triton.jit
def kda_tinv_kernel(akk_ptr, tinv_ptr, cu_ptr, chunk_idx_ptr, N, HV: tl.constexpr, BT: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    """Grid (chunk slots, HV): Tinv = (I + Akk)^-1 of the chunk's Akk (kda_pairs_kernel's, fp32), by GDN's block
    substitution (tinv_blocks), stored as its four block diagonals."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    i = tl.arange(0, BT)
    r = t0 + i
    m = r < eos
    akk = tl.load(akk_ptr + (r * HV + hv)[:, None] * BT + i[None, :], mask=m[:, None] & m[None, :], other=0.)
    LOWP: tl.constexpr = tinv_ptr.dtype.element_ty == tl.bfloat16
    d, t1, t2, t3 = tinv_blocks(akk, DOT_PREC, LOWP)
    store_tinv_blocks(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT)
