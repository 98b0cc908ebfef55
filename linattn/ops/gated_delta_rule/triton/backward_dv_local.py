"""Backward stage 1a (gdn-math.md, "Backward", first line): the intra-chunk part of dVnew, parallel over chunks,

    dVnew_local = P^T dO,   P = (scale Q K^T) * Gam * lower_incl

The reverse state pass (backward_state.py) then adds diag(exp(gam_C - gam)) K dS in place. Taking P^T dO out of
the sequential pass removes its largest product (the [C, C] Q K^T over all of K, otherwise recomputed by every
V-block program of the sequential chain) and about a third of its registers.

One program per (chunk slot, value head): P^T is built once over K blocks and applied to every V block.

Hazard (Triton 3.4-3.7 on Hopper, FLA issues 640/984): P^T is computed directly as dot(K, trans(Q)) of loaded
tiles, never as tl.trans of the dot result Q K^T.
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, load_tile, slot_chunk, store_tile


@triton.jit
def chunk_dv_local_kernel(
    q_ptr, k_ptr, gcum_ptr, do_ptr, dvnew_ptr,  # q, k [T_tot, H, K], gcum fp32 [T_tot, HV], do, dvnew [T_tot, HV, V]
    cu_ptr, chunk_idx_ptr, N, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
    DECAY: tl.constexpr = "scalar", aqk_ptr=None,
):
    """Grid (chunk slots, HV). DECAY "channel" (KDA's per-key-channel decays): P comes ready from aqk_ptr
    [T_tot, HV, BT] (KDA's intra kernel, unscaled), loaded transposed; q_ptr, k_ptr and gcum_ptr are not read."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    hk = hv // (HV // H)
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos

    if DECAY == "scalar":
        kq = tl.zeros([BT, BT], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            b_q = load_tile(q_ptr + t0 * H * K + hk * K, 0, kb * BK, eos - t0, K, H * K, BT, BK)
            b_k = load_tile(k_ptr + t0 * H * K + hk * K, 0, kb * BK, eos - t0, K, H * K, BT, BK)
            kq += tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
        # P^T[i, j] = scale k_i . q_j exp(gam_j - gam_i) for i <= j (both valid); masked before exp (gam is 0 past
        # the end of the sequence, so exp(gam_j - gam_i) could overflow there)
        upper = (rows[:, None] <= rows[None, :]) & valid[None, :]
        gmat = tl.exp(tl.where(upper, gam[None, :] - gam[:, None], 0.))
        pt = tl.where(upper, kq * gmat * scale, 0.).to(do_ptr.dtype.element_ty)
    else:                                      # P^T[i, j] = scale Aqk[j, i]: the stored tile read transposed
        pt = tl.load(aqk_ptr + (t0 + rows)[None, :] * HV * BT + hv * BT + rows[:, None], mask=valid[None, :],
                     other=0.).to(tl.float32)
        pt = (pt * scale).to(do_ptr.dtype.element_ty)
    for vb in range(0, tl.cdiv(V, BV)):
        b_do = load_tile(do_ptr + t0 * HV * V + hv * V, 0, vb * BV, eos - t0, V, HV * V, BT, BV)
        dv = tl.dot(pt, b_do, input_precision=DOT_PREC)
        store_tile(dvnew_ptr + t0 * HV * V + hv * V, dv.to(dvnew_ptr.dtype.element_ty), 0, vb * BV, eos - t0, V, HV * V)
