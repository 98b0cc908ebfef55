"""Stage 4 of the forward (gdn-math.md): the output, parallel over chunks,

    O = diag(exp(gam)) (scale Q) S + ((scale Q K^T) * Gam * lower_incl) Vnew

with S the chunk-start state h[chunk] from the state pass. One program per (V block, chunk slot, value head).
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, slot_chunk


# The three parts of O, one jit helper each, shared with the fused state+output kernel (chunk_fused_fwd.py) so that
# both round at the same points (each kernel orders the calls for its own register pressure).

@triton.jit
def chunk_output_inter(b_q, b_h, gam, DOT_PREC: tl.constexpr):
    """diag(exp(gam)) Q S, fp32 [BT, BV]: q [BT, BK] and the chunk-start state b_h [BK, BV] in the operand dtype."""
    return tl.dot(b_q, b_h, input_precision=DOT_PREC) * tl.exp(gam)[:, None]


@triton.jit
def chunk_attention(b_q, b_k, gam, BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """(Q K^T) * Gam * lower_incl in the operand dtype (the left operand of att Vnew); q, k [BT, BK] with rows past
    the sequence end zero, gam [BT] fp32 (0 past the end). Unscaled: the scale multiplies O."""
    rows = tl.arange(0, BT)
    qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    lower = rows[:, None] >= rows[None, :]
    # mask before exp (see intra_chunk.py)
    gmat = tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.))
    return tl.where(lower, qk * gmat, 0.).to(b_q.dtype)


@triton.jit
def chunk_output_combine(o_inter, att, b_vn, scale, DOT_PREC: tl.constexpr):
    """O = (o_inter + att Vnew) * scale, fp32; b_vn [BT, BV] in the operand dtype."""
    return (o_inter + tl.dot(att, b_vn, input_precision=DOT_PREC)) * scale


@triton.jit
def chunk_output_kernel(
    q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr, o_ptr,
    cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    vb = tl.program_id(0)
    p = tl.program_id(1)
    hv = tl.program_id(2)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    slot = (tl.load(chunk_off_ptr + n) + c).to(tl.int64)
    hk = hv // (HV // H)
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos

    p_q = tl.make_block_ptr(q_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
    p_h = tl.make_block_ptr(h_ptr + (slot * HV + hv) * K * V, (K, V), (V, 1), (0, vb * BV), (BK, BV), (1, 0))
    p_vn = tl.make_block_ptr(vnew_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    b_h = tl.load(p_h, boundary_check=(0, 1))
    b_vn = tl.load(p_vn, boundary_check=(0, 1))
    gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)

    o_inter = chunk_output_inter(b_q, b_h, gam, DOT_PREC)
    att = chunk_attention(b_q, b_k, gam, BT, DOT_PREC)
    o = chunk_output_combine(o_inter, att, b_vn, scale, DOT_PREC)
    p_o = tl.make_block_ptr(o_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
    tl.store(p_o, o.to(o_ptr.dtype.element_ty), boundary_check=(0, 1))
