"""Stage 3 of the forward in Gluon, variant "literal": the Triton state pass (triton/chunk_state.py) written
out with explicit layouts, plain masked global loads and mma.sync (mma_v2, valid on sm_80 and sm_90).

Per chunk (gdn-math.md, chunk form), S the [K, BV] fp32 state at the chunk's start, in registers:
    h[chunk] = S                                            (operand dtype, for the output stage)
    Vnew     = U - W S                                      (product 1: [BT, K] x [K, BV])
    S        = exp(gam_C) S + (diag(exp(gam_C - gam)) K)^T Vnew   (product 2: [K, BT] x [BT, BV])
One program per (V block, sequence * value head), as the Triton kernel; same arguments and outputs.

Layouts (4 warps):
  * tiles read from global with 16-byte vectors along each tensor's contiguous dim: w, k [BT, K] rows of K
    (K contiguous), u/vnew/h [.., BV] rows of BV (V contiguous), the fp32 states rows of BV.
  * one mma.sync accumulator layout MMA (warps stacked along M, instr 16x8) for both products: vnew [BT, BV]
    (16 rows per warp) and the state [K, BV] (32 rows per warp). The operands are DotOperandLayouts of MMA
    with k_width=2 (ldmatrix after the compiler's shared-memory round trip in convert_layout).
Masks: rows past the sequence end load as zero (w, u, k), so they give vnew = 0 and add nothing to the state;
their vnew rows are not stored. K == V == 128 and BV | V are required by the launcher, so columns need no mask.
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import GLUON_OK, gl, gluon, mma_v2

if GLUON_OK:

    @gluon.constexpr_function
    def rows_layout(ncols, elem_bits, num_warps):
        """Blocked layout of a row-major [rows, ncols] tile: 16-byte vectors along the contiguous dim."""
        vec = min(128 // elem_bits, ncols)
        tpw_n = min(32, ncols // vec)
        return gl.BlockedLayout([1, vec], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def mma_layout(num_warps):
        # 4 warps along M (vnew's BT = 64 rows give each warp one 16-row instruction tile); more warps split N
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, 8])

    @gluon.jit
    def chunk_state_fwd_literal_kernel(
        k_ptr, w_ptr, u_ptr, gcum_ptr,         # k [T_tot, H, K], w [T_tot, HV, K], u [T_tot, HV, V], gcum [T_tot, HV]
        h_ptr, vnew_ptr,                       # h [slots, HV, K, V] (chunk-start states), vnew [T_tot, HV, V]
        h0_ptr, ht_ptr,                        # initial / final state [N, HV, K, V] fp32
        cu_ptr, chunk_off_ptr,                 # the chunk plan (triton/chunk_indices.py)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
        BT: gl.constexpr, BV: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
    ):
        NW: gl.constexpr = gl.num_warps()
        dt: gl.constexpr = w_ptr.dtype.element_ty
        LK: gl.constexpr = rows_layout(K, 16, NW)          # w, k tiles [BT, K]
        LV: gl.constexpr = rows_layout(BV, 16, NW)         # u, vnew [BT, BV]; h [K, BV] in the operand dtype
        LS: gl.constexpr = rows_layout(BV, 32, NW)         # fp32 states [K, BV]
        MMA: gl.constexpr = mma_layout(NW)
        OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)

        vb = gl.program_id(0)
        nh = gl.program_id(1)
        n = nh // HV
        hv = nh % HV
        hk = hv // (HV // H)
        # sequence_span (triton/common.py): token range, first chunk slot, number of chunks
        bos = gl.load(cu_ptr + n)
        eos = gl.load(cu_ptr + n + 1)
        slot0 = gl.load(chunk_off_ptr + n)
        nchunks = gl.cdiv(gl.maximum(eos - bos, 0), BT)

        # state_tile: the [K, BV] block vb of state [n, hv]
        sk = gl.arange(0, K, layout=gl.SliceLayout(1, LS))
        sv = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LS))
        state_off = (n.to(gl.int64) * HV + hv) * K * V + gl.expand_dims(sk, 1) * V + gl.expand_dims(sv, 0)
        if USE_H0:
            s = gl.convert_layout(gl.load(h0_ptr + state_off), MMA)
        else:
            s = gl.zeros([K, BV], gl.float32, MMA)

        rk_t = gl.arange(0, BT, layout=gl.SliceLayout(1, LK))      # chunk rows, for w/k tiles
        ck = gl.arange(0, K, layout=gl.SliceLayout(0, LK))
        rv_t = gl.arange(0, BT, layout=gl.SliceLayout(1, LV))      # chunk rows, for u/vnew tiles
        cv = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LV))
        hk_r = gl.arange(0, K, layout=gl.SliceLayout(1, LV))       # h tile rows
        h_in = gl.expand_dims(hk_r, 1) * V + gl.expand_dims(cv, 0)

        for c in range(0, nchunks):
            t0 = bos + c * BT
            slot = (slot0 + c).to(gl.int64)
            gl.store(h_ptr + (slot * HV + hv) * K * V + h_in, gl.convert_layout(s.to(dt), LV))

            rows_k = t0 + rk_t
            valid_k = gl.expand_dims(rows_k < eos, 1)
            wk_off = gl.expand_dims(rows_k, 1)
            b_w = gl.load(w_ptr + wk_off * (HV * K) + hv * K + gl.expand_dims(ck, 0), mask=valid_k, other=0.)
            b_k = gl.load(k_ptr + wk_off * (H * K) + hk * K + gl.expand_dims(ck, 0), mask=valid_k, other=0.)
            rows_v = t0 + rv_t
            valid_v = gl.expand_dims(rows_v < eos, 1)
            uv_off = gl.expand_dims(rows_v, 1) * (HV * V) + hv * V + gl.expand_dims(cv, 0)
            b_u = gl.load(u_ptr + uv_off, mask=valid_v, other=0.)
            gam = gl.load(gcum_ptr + rows_k * HV + hv, mask=rows_k < eos, other=0.)
            last = gl.minimum(eos - t0, BT) - 1
            gam_last = gl.load(gcum_ptr + (t0 + last) * HV + hv)

            # product 1: Vnew = U - W S (bf16 operands, fp32 accumulation)
            ws = mma_v2(gl.convert_layout(b_w, OPA), gl.convert_layout(s.to(dt), OPB),
                        gl.zeros([BT, BV], gl.float32, MMA))
            vnew = gl.convert_layout(b_u, MMA).to(gl.float32) - ws
            vnew_op = vnew.to(dt)
            gl.store(vnew_ptr + uv_off, gl.convert_layout(vnew_op, LV), mask=valid_v)
            # product 2: S = exp(gam_C) S + (diag(exp(gam_C - gam)) K)^T Vnew; rows past the end have k = 0
            kdec = (b_k.to(gl.float32) * gl.expand_dims(gl.exp(gam_last - gam), 1)).to(dt)
            kdec_t = gl.convert_layout(gl.permute(kdec, (1, 0)), OPA)
            s = mma_v2(kdec_t, gl.convert_layout(vnew_op, OPB), s * gl.exp(gam_last))

        if STORE_HT:
            gl.store(ht_ptr + state_off, gl.convert_layout(s, LS))
