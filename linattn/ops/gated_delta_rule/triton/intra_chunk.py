"""Stage 1-2 of the forward (gdn-math.md, "The chunk form"): per chunk and value head,

    gam  = cumsum(g)                                 (stored: every later stage reads it)
    A    = strict_lower( diag(beta) K K^T * exp(gam_i - gam_j) )
    Tinv = (I + A)^-1
    W    = Tinv diag(beta exp(gam)) K,   U = Tinv diag(beta) V

One program per (chunk slot, value head). The 64-row chunk is handled as four 16-row blocks, so every step is a
small matrix product instead of a 64-step row-by-row substitution (whose per-row cross-warp reductions made
the first version of this kernel the slowest stage of the forward):
  - diagonal blocks: D_i = (I + N)^-1 for the strictly lower 16x16 block N, by the exact nilpotent product
    (I - N)(I + N^2)(I + N^4)(I + N^8)   (N^16 = 0);
  - off-diagonal blocks of Tinv by block forward substitution: X_ij = -D_i sum_{j<=m<i} A_im X_mj.
These fp32 products run at DOT_PREC: TF32 for 16-bit inputs (Tinv is rounded to the 16-bit operand type right
after, which costs more than TF32's 10-bit mantissa), IEEE fp32 for fp32 inputs.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, slot_chunk


@triton.jit
def _k_rows(k_ptr, t0, eos, hk, i: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    p = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (i * 16, 0), (16, BK), (1, 0))
    return tl.load(p, boundary_check=(0, 1))


@triton.jit
def _gates(g_ptr, beta_ptr, gcum_ptr, t0, eos, hv, base, i: tl.constexpr, HV: tl.constexpr):
    """Block i's cumulative gate (continuing from `base`, the sum of the earlier blocks) and beta."""
    r = t0 + i * 16 + tl.arange(0, 16)
    m = r < eos
    g = tl.load(g_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    gam = tl.cumsum(g, axis=0) + base
    tl.store(gcum_ptr + r * HV + hv, gam, mask=m)
    beta = tl.load(beta_ptr + r * HV + hv, mask=m, other=0.).to(tl.float32)
    return gam, beta, base + tl.sum(g, axis=0)


@triton.jit
def _a_block(ki, kj, gi, gj, bi, DIAG: tl.constexpr, PREC: tl.constexpr):
    kk = tl.dot(ki, tl.trans(kj), input_precision=PREC)
    r = tl.arange(0, 16)
    if DIAG:
        # mask before exp: above the diagonal gam_i - gam_j > 0 could overflow for very negative g
        lower = r[:, None] > r[None, :]
        return tl.where(lower, bi[:, None] * kk * tl.exp(tl.where(lower, gi[:, None] - gj[None, :], 0.)), 0.)
    return bi[:, None] * kk * tl.exp(gi[:, None] - gj[None, :])


@triton.jit
def _dot_op(a, b, PREC: tl.constexpr, LOWP: tl.constexpr = False, acc=None):
    """acc + a @ b in fp32 (acc None: a @ b): TF32 / IEEE at PREC, or with bf16 operands when LOWP (for mma.sync the
    fp32 accumulator's registers are already a bf16 A operand's, so no shuffles convert it; intra_split's v4)."""
    if LOWP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc=acc)
    else:
        return tl.dot(a, b, acc=acc, input_precision=PREC)


@triton.jit
def _inv_unit_lower16(n, PREC: tl.constexpr, LOWP: tl.constexpr = False):
    """(I + n)^-1 for a strictly lower triangular 16x16 n: (I - n)(I + n^2)(I + n^4)(I + n^8), products by _dot_op."""
    r = tl.arange(0, 16)
    eye = tl.where(r[:, None] == r[None, :], 1., 0.)
    n2 = _dot_op(n, n, PREC, LOWP)
    n4 = _dot_op(n2, n2, PREC, LOWP)
    n8 = _dot_op(n4, n4, PREC, LOWP)
    x = _dot_op(eye - n, eye + n2, PREC, LOWP)
    x = _dot_op(x, eye + n4, PREC, LOWP)
    return _dot_op(x, eye + n8, PREC, LOWP)


@triton.jit
def _store_tinv_row(tinv_ptr, t0, eos, hv, i: tl.constexpr, x0, x1, x2, x3, HV: tl.constexpr, BT: tl.constexpr):
    r = t0 + i * 16 + tl.arange(0, 16)
    c = tl.arange(0, 16)
    base = tinv_ptr + (r * HV + hv)[:, None] * BT + c[None, :]
    m = (r < eos)[:, None]
    tl.store(base, x0, mask=m)
    tl.store(base + 16, x1, mask=m)
    tl.store(base + 32, x2, mask=m)
    tl.store(base + 48, x3, mask=m)


@triton.jit
def _apply_rows(x0, x1, x2, x3, s0, s1, s2, s3, PREC: tl.constexpr):
    """One 16-row block of Tinv @ S, with S given as four 16-row blocks (operand dtype)."""
    acc = tl.dot(x0.to(s0.dtype), s0, input_precision=PREC)
    acc += tl.dot(x1.to(s0.dtype), s1, input_precision=PREC)
    acc += tl.dot(x2.to(s0.dtype), s2, input_precision=PREC)
    acc += tl.dot(x3.to(s0.dtype), s3, input_precision=PREC)
    return acc


@triton.jit
def intra_chunk_wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr,            # k [T_tot, H, K], v [T_tot, HV, V], g/beta [T_tot, HV]
    gcum_ptr, w_ptr, u_ptr, tinv_ptr,         # gcum fp32 [T_tot, HV], w [T_tot, HV, K], u [T_tot, HV, V], tinv [T_tot, HV, BT]
    cu_ptr, chunk_idx_ptr, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_TINV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
    F32: tl.constexpr = DOT_PREC               # fp32 products of the inverse
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)                       # GVA: the query/key head this value head reads

    g0, b0, s = _gates(g_ptr, beta_ptr, gcum_ptr, t0, eos, hv, 0., 0, HV)
    g1, b1, s = _gates(g_ptr, beta_ptr, gcum_ptr, t0, eos, hv, s, 1, HV)
    g2, b2, s = _gates(g_ptr, beta_ptr, gcum_ptr, t0, eos, hv, s, 2, HV)
    g3, b3, s = _gates(g_ptr, beta_ptr, gcum_ptr, t0, eos, hv, s, 3, HV)

    # rows past the sequence end load as zeros: their A rows and columns vanish
    k0 = _k_rows(k_ptr, t0, eos, hk, 0, H, K, BK)
    k1 = _k_rows(k_ptr, t0, eos, hk, 1, H, K, BK)
    k2 = _k_rows(k_ptr, t0, eos, hk, 2, H, K, BK)
    k3 = _k_rows(k_ptr, t0, eos, hk, 3, H, K, BK)

    a10 = _a_block(k1, k0, g1, g0, b1, False, DOT_PREC)
    a20 = _a_block(k2, k0, g2, g0, b2, False, DOT_PREC)
    a21 = _a_block(k2, k1, g2, g1, b2, False, DOT_PREC)
    a30 = _a_block(k3, k0, g3, g0, b3, False, DOT_PREC)
    a31 = _a_block(k3, k1, g3, g1, b3, False, DOT_PREC)
    a32 = _a_block(k3, k2, g3, g2, b3, False, DOT_PREC)
    d0 = _inv_unit_lower16(_a_block(k0, k0, g0, g0, b0, True, DOT_PREC), F32)
    d1 = _inv_unit_lower16(_a_block(k1, k1, g1, g1, b1, True, DOT_PREC), F32)
    d2 = _inv_unit_lower16(_a_block(k2, k2, g2, g2, b2, True, DOT_PREC), F32)
    d3 = _inv_unit_lower16(_a_block(k3, k3, g3, g3, b3, True, DOT_PREC), F32)

    # block forward substitution for the strictly lower blocks of Tinv
    x10 = -tl.dot(d1, tl.dot(a10, d0, input_precision=F32), input_precision=F32)
    x21 = -tl.dot(d2, tl.dot(a21, d1, input_precision=F32), input_precision=F32)
    x20 = -tl.dot(d2, tl.dot(a20, d0, input_precision=F32) + tl.dot(a21, x10, input_precision=F32),
                  input_precision=F32)
    x32 = -tl.dot(d3, tl.dot(a32, d2, input_precision=F32), input_precision=F32)
    x31 = -tl.dot(d3, tl.dot(a31, d1, input_precision=F32) + tl.dot(a32, x21, input_precision=F32),
                  input_precision=F32)
    x30 = -tl.dot(d3, tl.dot(a30, d0, input_precision=F32) + tl.dot(a31, x10, input_precision=F32)
                  + tl.dot(a32, x20, input_precision=F32), input_precision=F32)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    if STORE_TINV:
        _store_tinv_row(tinv_ptr, t0, eos, hv, 0, d0, zero, zero, zero, HV, BT)
        _store_tinv_row(tinv_ptr, t0, eos, hv, 1, x10, d1, zero, zero, HV, BT)
        _store_tinv_row(tinv_ptr, t0, eos, hv, 2, x20, x21, d2, zero, HV, BT)
        _store_tinv_row(tinv_ptr, t0, eos, hv, 3, x30, x31, x32, d3, HV, BT)

    # W = Tinv diag(beta exp(gam)) K, over K in one block of BK (zero-padded past K)
    op = k_ptr.dtype.element_ty
    s0 = (k0.to(tl.float32) * (b0 * tl.exp(g0))[:, None]).to(op)
    s1 = (k1.to(tl.float32) * (b1 * tl.exp(g1))[:, None]).to(op)
    s2 = (k2.to(tl.float32) * (b2 * tl.exp(g2))[:, None]).to(op)
    s3 = (k3.to(tl.float32) * (b3 * tl.exp(g3))[:, None]).to(op)
    wb = w_ptr + t0 * HV * K + hv * K
    p_w = tl.make_block_ptr(wb, (eos - t0, K), (HV * K, 1), (0, 0), (16, BK), (1, 0))
    tl.store(p_w, _apply_rows(d0, zero, zero, zero, s0, s1, s2, s3, DOT_PREC).to(op), boundary_check=(0, 1))
    p_w = tl.make_block_ptr(wb, (eos - t0, K), (HV * K, 1), (16, 0), (16, BK), (1, 0))
    tl.store(p_w, _apply_rows(x10, d1, zero, zero, s0, s1, s2, s3, DOT_PREC).to(op), boundary_check=(0, 1))
    p_w = tl.make_block_ptr(wb, (eos - t0, K), (HV * K, 1), (32, 0), (16, BK), (1, 0))
    tl.store(p_w, _apply_rows(x20, x21, d2, zero, s0, s1, s2, s3, DOT_PREC).to(op), boundary_check=(0, 1))
    p_w = tl.make_block_ptr(wb, (eos - t0, K), (HV * K, 1), (48, 0), (16, BK), (1, 0))
    tl.store(p_w, _apply_rows(x30, x31, x32, d3, s0, s1, s2, s3, DOT_PREC).to(op), boundary_check=(0, 1))

    # U = Tinv diag(beta) V, over V in blocks of BV
    vb_ = v_ptr + t0 * HV * V + hv * V
    ub = u_ptr + t0 * HV * V + hv * V
    for vb in range(0, tl.cdiv(V, BV)):
        v0 = tl.load(tl.make_block_ptr(vb_, (eos - t0, V), (HV * V, 1), (0, vb * BV), (16, BV), (1, 0)),
                     boundary_check=(0, 1))
        v1 = tl.load(tl.make_block_ptr(vb_, (eos - t0, V), (HV * V, 1), (16, vb * BV), (16, BV), (1, 0)),
                     boundary_check=(0, 1))
        v2 = tl.load(tl.make_block_ptr(vb_, (eos - t0, V), (HV * V, 1), (32, vb * BV), (16, BV), (1, 0)),
                     boundary_check=(0, 1))
        v3 = tl.load(tl.make_block_ptr(vb_, (eos - t0, V), (HV * V, 1), (48, vb * BV), (16, BV), (1, 0)),
                     boundary_check=(0, 1))
        v0 = (v0.to(tl.float32) * b0[:, None]).to(op)
        v1 = (v1.to(tl.float32) * b1[:, None]).to(op)
        v2 = (v2.to(tl.float32) * b2[:, None]).to(op)
        v3 = (v3.to(tl.float32) * b3[:, None]).to(op)
        tl.store(tl.make_block_ptr(ub, (eos - t0, V), (HV * V, 1), (0, vb * BV), (16, BV), (1, 0)),
                 _apply_rows(d0, zero, zero, zero, v0, v1, v2, v3, DOT_PREC).to(op), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(ub, (eos - t0, V), (HV * V, 1), (16, vb * BV), (16, BV), (1, 0)),
                 _apply_rows(x10, d1, zero, zero, v0, v1, v2, v3, DOT_PREC).to(op), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(ub, (eos - t0, V), (HV * V, 1), (32, vb * BV), (16, BV), (1, 0)),
                 _apply_rows(x20, x21, d2, zero, v0, v1, v2, v3, DOT_PREC).to(op), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(ub, (eos - t0, V), (HV * V, 1), (48, vb * BV), (16, BV), (1, 0)),
                 _apply_rows(x30, x31, x32, d3, v0, v1, v2, v3, DOT_PREC).to(op), boundary_check=(0, 1))
