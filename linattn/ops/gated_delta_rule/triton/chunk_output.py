"""Stage 4 of the forward (gdn-math.md): the output, parallel over chunks,

    O = diag(exp(gam)) (scale Q) S + ((scale Q K^T) * Gam * lower_incl) Vnew

with S the chunk-start state h[chunk] from the state pass. The two K-sized products (q S and q k^T) are accumulated
over K blocks of BK inside a loop, so that Triton's pipeliner copies q, k and h straight to shared memory with
cp.async instead of staging them in registers first; BV 128 forms q k^T once per chunk and head at K = V = 128.
fp32 accumulators, att and Vnew in the operand dtype. Launch config (OUTPUT_BK / _BV / _WARPS / _STAGES): the
fastest of the configs timed on an H200 at the production rows (1.30-1.32x the one-block kernel at BV 64,
benchmarks/HISTORY.md).
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, load_tile, slot_chunk, store_tile
from linattn.ops.gated_delta_rule.triton.host import launches
from linattn.runtime.host_path import cdiv, next_power_of_2

OUTPUT_BK, OUTPUT_BV, OUTPUT_WARPS, OUTPUT_STAGES = 64, 128, 8, 2


@triton.jit
def chunk_attention_from_qk(qk, gam, nrows, BT: tl.constexpr, OP_DTYPE: tl.constexpr):
    """(Q K^T) * Gam * lower_incl from the fp32 q k^T [BT, BT] accumulated over the K blocks, in OP_DTYPE (the left
    operand of att Vnew); gam [BT] fp32 (0 past the sequence end), nrows the chunk's valid rows. Unscaled: the scale
    multiplies O."""
    rows = tl.arange(0, BT)
    lower = (rows[:, None] >= rows[None, :]) & (rows[:, None] < nrows)
    # mask before exp: above the diagonal, and on the rows past the sequence end (gam 0 there), gam_i - gam_j > 0
    # could overflow for very negative g
    gmat = tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.))
    return tl.where(lower, qk * gmat, 0.).to(OP_DTYPE)


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
    DECAY: tl.constexpr = "scalar", aqk_ptr=None,
):
    """Grid (slots * cdiv(V, BV) * (HV // H), H): program_id(0) walks the V blocks of each value head of key head
    program_id(1) fastest, then the chunk slots, so the programs that read one q and k tile run next to each other
    and all but the first find it in L2. The slots share axis 0 (up to 2^31 - 1 programs) instead of taking axis 1,
    whose CUDA limit is 65535. DECAY "channel" (KDA's per-key-channel decays): q_ptr holds Q * exp(gam) per value
    head (H = HV) and the intra-chunk attention comes ready from aqk_ptr [T_tot, HV, BT] (lower triangle incl. the
    diagonal, unscaled), so O = (Q_dec S + Aqk Vnew) * scale; k_ptr and gcum_ptr are not read."""
    NVB: tl.constexpr = (V + BV - 1) // BV
    NVG: tl.constexpr = NVB * (HV // H)
    hk = tl.program_id(1)
    j = tl.program_id(0) % NVG
    vb = j % NVB
    hv = hk * (HV // H) + j // NVB
    p = tl.program_id(0) // NVG
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    slot = (tl.load(chunk_off_ptr + n) + c).to(tl.int64)
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos

    # q and k tiles [BT, BK] and h tiles [BK, BV]: their corners step BK columns (h: BK rows) per K block, and the
    # column (h: row) bound counts from the corner
    q_base = q_ptr + t0 * H * K + hk * K
    k_base = k_ptr + t0 * H * K + hk * K
    h_base = h_ptr + (slot * HV + hv) * K * V
    acc_o = tl.zeros([BT, BV], dtype=tl.float32)
    acc_a = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        b_q = load_tile(q_base, 0, 0, eos - t0, K - kb * BK, H * K, BT, BK)
        if DECAY == "scalar":
            b_k = load_tile(k_base, 0, 0, eos - t0, K - kb * BK, H * K, BT, BK)
        b_h = load_tile(h_base, 0, vb * BV, K - kb * BK, V, V, BK, BV)
        acc_o = tl.dot(b_q, b_h, acc_o, input_precision=DOT_PREC)
        if DECAY == "scalar":
            acc_a = tl.dot(b_q, tl.trans(b_k), acc_a, input_precision=DOT_PREC)
        q_base += BK
        k_base += BK
        h_base += BK * V
    b_vn = load_tile(vnew_ptr + t0 * HV * V + hv * V, 0, vb * BV, eos - t0, V, HV * V, BT, BV)
    if DECAY == "scalar":
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
        o_inter = acc_o * tl.exp(gam)[:, None]
        att = chunk_attention_from_qk(acc_a, gam, eos - t0, BT, q_ptr.dtype.element_ty)
    else:
        o_inter = acc_o
        att = tl.load(aqk_ptr + (t0 + rows)[:, None] * HV * BT + hv * BT + rows[None, :], mask=valid[:, None],
                      other=0.).to(q_ptr.dtype.element_ty)
    o = chunk_output_combine(o_inter, att, b_vn, scale, DOT_PREC)
    store_tile(o_ptr + t0 * HV * V + hv * V, o.to(o_ptr.dtype.element_ty), 0, vb * BV, eos - t0, V, HV * V)


def chunk_output(q, k, vnew, h, gcum, o, plan, scale, *, H, HV, K, V, dot_prec, BT: int = 64, aqk=None):
    """Launch stage 4 into o. aqk: KDA's intra-chunk attention [T_tot, HV, BT] (DECAY "channel": q is then
    Q * exp(gam) [.., HV, K] and H = HV)."""
    BKp = max(16, next_power_of_2(K))
    BK = min(OUTPUT_BK, BKp)
    BV = min(OUTPUT_BV, max(16, next_power_of_2(V)))
    nvb = cdiv(V, BV)
    launches(chunk_output_kernel, (plan.num_slots * nvb * (HV // H), H),
             (q, k, vnew, h, gcum, o, plan.cu, plan.chunk_indices, plan.chunk_offsets, plan.N, scale),
             dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, DOT_PREC=dot_prec, num_warps=OUTPUT_WARPS,
                  num_stages=OUTPUT_STAGES, **({} if aqk is None else dict(DECAY="channel"))),
             tensors=None if aqk is None else dict(aqk_ptr=aqk))
