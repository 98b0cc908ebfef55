"""Stage 1-2 of the forward (gdn-math.md, "The chunk form"): per chunk and value head,

    gam  = cumsum(g)                                 (stored: every later stage reads it)
    A    = strict_lower( diag(beta) K K^T * exp(gam_i - gam_j) )
    Tinv = (I + A)^-1                                (forward substitution, fp32)
    W    = Tinv diag(beta exp(gam)) K,   U = Tinv diag(beta) V

One program per (chunk slot, value head). K and V are walked in blocks of BK / BV so any head size up to 256
fits; the chunk's [BT, BT] matrices stay in registers.
"""
import triton
import triton.language as tl


@triton.jit
def intra_chunk_wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr,            # k [T_tot, H, K], v [T_tot, HV, V], g/beta [T_tot, HV]
    gcum_ptr, w_ptr, u_ptr, tinv_ptr,         # gcum fp32 [T_tot, HV], w [T_tot, HV, K], u [T_tot, HV, V], tinv [T_tot, HV, BT]
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_TINV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(chunk_idx_ptr + 2 * p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    c = tl.load(chunk_idx_ptr + 2 * p + 1)
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    t0 = bos + c.to(tl.int64) * BT            # int64: token offsets times head strides can pass 2^31
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos
    hk = hv // (HV // H)                       # GVA: the query/key head this value head reads

    g = tl.load(g_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.).to(tl.float32)
    gam = tl.cumsum(g, axis=0)
    tl.store(gcum_ptr + (t0 + rows) * HV + hv, gam, mask=valid)
    beta = tl.load(beta_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.).to(tl.float32)

    # A = K K^T over K in blocks
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    lower = rows[:, None] > rows[None, :]
    # mask before exp: above the diagonal gam_i - gam_j > 0 could overflow for very negative g
    diff = tl.where(lower, gam[:, None] - gam[None, :], 0.)
    a = tl.where(lower, beta[:, None] * kk * tl.exp(diff), 0.)

    # Tinv = (I + A)^-1 by forward substitution: row i of Tinv = e_i - sum_{j<i} A_ij Tinv_j
    tinv = tl.where(rows[:, None] == rows[None, :], 1., 0.)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(rows[:, None] == i, a, 0.), axis=0)          # row i of A, [BT] over columns j
        x_i = tl.sum(a_i[:, None] * tinv, axis=0)                          # sum_j A_ij Tinv[j, :]
        tinv = tl.where(rows[:, None] == i, tinv - x_i[None, :], tinv)
    if STORE_TINV:
        tl.store(tinv_ptr + ((t0 + rows) * HV + hv)[:, None] * BT + rows[None, :], tinv, mask=valid[:, None])

    tinv_op = tinv.to(k_ptr.dtype.element_ty)
    kscale = beta * tl.exp(gam)
    for kb in range(0, tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)
        b_w = tl.dot(tinv_op, (b_k * kscale[:, None]).to(k_ptr.dtype.element_ty), input_precision=DOT_PREC)
        p_w = tl.make_block_ptr(w_ptr + t0 * HV * K + hv * K, (eos - t0, K), (HV * K, 1), (0, kb * BK), (BT, BK), (1, 0))
        tl.store(p_w, b_w.to(w_ptr.dtype.element_ty), boundary_check=(0, 1))
    for vb in range(0, tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1)).to(tl.float32)
        b_u = tl.dot(tinv_op, (b_v * beta[:, None]).to(v_ptr.dtype.element_ty), input_precision=DOT_PREC)
        p_u = tl.make_block_ptr(u_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
        tl.store(p_u, b_u.to(u_ptr.dtype.element_ty), boundary_check=(0, 1))
