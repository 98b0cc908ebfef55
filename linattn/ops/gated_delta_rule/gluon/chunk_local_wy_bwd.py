"""Backward stages 2 and 3 in one Gluon kernel (sm_90a): the chunk-parallel local terms (triton/backward_local.py)
and the way back through the WY representation (triton/backward_wy.py), per (chunk slot, query/key head), walking
the HV // H value heads of the group. What the two Triton kernels pass through memory stays on chip: dW, the partial
dK (dk_part), the dgam partials and M^T; K K^T is formed once per key head instead of once per value head.

This is the literal step of the port: tiles come in by plain loads (masked: rows past the chunk's end read 0) and go
to shared memory, every product is a synchronous warpgroup_mma, 8 warps (two warpgroups, each takes half of every
product's columns). The formulas, rounding points and masks are the Triton kernels' (their docstrings derive them);
per value head hv of key head hk, with gam the chunk's cumulative gate (rows past the end take the last valid row's),
Gam_ij = exp(gam_i - gam_j), lower = i >= j, strict = i > j:

  local   dP = dO Vnew^T;  Pm = (dP * Gam) on lower, rounded to the operand dtype
          dQ_h = scale (diag(exp gam) dO S^T + Pm K);  dQ += dQ_h;  dgam = rowsum(Q * dQ_h)
          dW = -(dVnew S^T), rounded;  Dk = diag(exp(gam_C - gam)) Vnew dS^T;  dK += Dk;  x = rowsum(K * Dk)
          dgam += -x, and on the last valid row sum(x) + exp(gam_C) sum(dS * S)
          dK_h = scale Pm^T Q;  dK += dK_h;  dgam -= rowsum(K * dK_h)
  WY      X = dW K^T;  rs_w = colsum(Tinv * X);  X = X diag(exp gam) + dVnew V^T
          dV = diag(beta) Tinv^T dVnew (Tinv rounded);  dbeta = colsum(Tinv * X);  dTinv = (X diag(beta)) on strict
          D = -(Tinv^T (dTinv Tinv^T)) * Gam on strict (fp32 Tinv, TF32 products);  M = diag(beta) D
          dbeta += rowsum(D * K K^T);  dgam += beta (exp(gam) rs_w + rowsum(D * K K^T)) - colsum(M * K K^T)
          dg = the in-chunk reverse cumsum of dgam;  dK += (M + M^T) K + diag(beta exp gam) Tinv^T dW
where S = h[chunk] and dS = dh[chunk] (the state at the chunk's start and the gradient flowing into the chunk's
S_next, stage 1's output), dVnew the full gradient of Vnew (stage 1 added the state term). dQ and dK are summed over
the group in fp32 registers and stored once, in q's and k's dtype.

Transposed operands: a 16-bit tile is read transposed by wgmma through .permute of its shared buffer (MN-major A, or
K-major B); the TF32 products need both operands K-major, so Tinv^T and z^T are written to shared memory from
registers already transposed (gl.permute).

Shared memory: every buffer is allocated from registers where its tile is ready (allocate_shared_memory with a
value), then fence_async_shared and a CTA barrier before any wgmma reads it; the allocator reuses a buffer's space
once its last reader is done (every wgmma here is waited when it returns).

Only K = V = 128, BT = 64, bf16/fp16 q/k/v/dO, fp32 Tinv and gcum, FLA's default gate and beta: the gluon backend's
calls (its supports()); chunk_gated_delta_rule_bwd keeps FLA's options on the Triton kernels.
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import GLUON_OK, fence_async_shared, gl, gluon, warpgroup_mma

BT = 64
WARPS = 8

if GLUON_OK:
    @gluon.constexpr_function
    def _acc(n, k):
        """wgmma accumulator of a [64, n] product over k-wide steps: one warpgroup along M, the two split the n."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, k])

    @gluon.constexpr_function
    def _rows(ncols, elem_bits):
        """Blocked layout of a row-major [rows, ncols] tile over 8 warps, 16-byte vectors along the columns."""
        vec = min(128 // elem_bits, ncols)
        tpw_n = min(32, ncols // vec)
        return gl.BlockedLayout([1, vec], [32 // tpw_n, tpw_n], [8, 1], [1, 0])

    @gluon.jit
    def _offsets(zero_ptr, zero_ref, row_stride, R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        """(row index, offsets) of a row-major [R, C] tile with unit column stride. The rows start at
        z0 = load(zero_ptr) - zero_ref, which is 0, loaded here at each use: the compiler cannot prove it, so no
        tile's [R, C] offsets are hoisted out of the head loop or shared between tiles and held in registers."""
        z0 = (gl.load(zero_ptr) - zero_ref).to(gl.int32)
        r = z0 + gl.arange(0, R, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
        return r, gl.expand_dims(r * row_stride, 1) + gl.expand_dims(c, 0)

    @gluon.jit
    def _load_tile(base, row_stride, nrows, zero_ptr, zero_ref, R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        """The [R, C] tile at base (the tile's own offsets fit in int32; base carries the int64 part), rows >= nrows
        read as 0."""
        r, offs = _offsets(zero_ptr, zero_ref, row_stride, R, C, L)
        return gl.load(base + offs, mask=gl.expand_dims(r < nrows, 1), other=0.)

    @gluon.jit
    def _store_tile(base, x, row_stride, nrows, zero_ptr, zero_ref, R: gl.constexpr, C: gl.constexpr,
                    L: gl.constexpr):
        """Stores x [R, C] (layout L) at base, rows < nrows only."""
        r, offs = _offsets(zero_ptr, zero_ref, row_stride, R, C, L)
        gl.store(base + offs, x, mask=gl.expand_dims(r < nrows, 1))

    @gluon.jit
    def _smem(x, layout: gl.constexpr):
        """A shared buffer holding x, visible to the async proxy (wgmma) of every warp."""
        s = gl.allocate_shared_memory(x.dtype, x.shape, layout, x)
        fence_async_shared()
        gl.thread_barrier()
        return s

    @gluon.jit
    def chunk_local_wy_bwd_kernel(
        q_ptr, k_ptr, v_ptr, vnew_ptr,            # q, k [T_tot, H, K], v, vnew [T_tot, HV, V] (one 16-bit dtype)
        h_ptr, dh_ptr,                            # h, dh [slots, HV, K, V] (that dtype)
        gcum_ptr, beta_ptr, tinv_ptr,             # gcum fp32 / beta any float [T_tot, HV], tinv fp32 [T_tot, HV, BT]
        do_ptr, dvnew_ptr,                        # do, dvnew [T_tot, HV, V]
        dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr,   # dq, dk [T_tot, H, K], dv [T_tot, HV, V], dg / dbeta [T_tot, HV]
        cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, scale,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    ):
        dt: gl.constexpr = q_ptr.dtype.element_ty
        G: gl.constexpr = HV // H
        A_TK: gl.constexpr = _acc(K, 16)          # [BT, K] results (K == V)
        A_TT: gl.constexpr = _acc(BT, 16)         # [BT, BT] results of 16-bit products
        A_TF: gl.constexpr = _acc(BT, 8)          # [BT, BT] results of TF32 products
        RT: gl.constexpr = gl.SliceLayout(1, A_TT)    # a per-token vector along the rows of a [BT, BT] tile
        CT: gl.constexpr = gl.SliceLayout(0, A_TT)    # ... along its columns
        RK: gl.constexpr = gl.SliceLayout(1, A_TK)    # ... along the rows of a [BT, K] tile
        L16: gl.constexpr = _rows(K, 16)
        L32: gl.constexpr = _rows(BT, 32)
        S_TK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, K], dt)
        S_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, V], dt)
        S_TT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dt)
        S_TF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        S_ACC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

        p = gl.program_id(0)
        hk = gl.program_id(1)
        n = gl.load(chunk_idx_ptr + 2 * p)
        c = gl.load(chunk_idx_ptr + 2 * p + 1)
        if n < N:                                             # else a surplus slot of the varlen bound
            bos = gl.load(cu_ptr + n)
            zp = cu_ptr + n + 1                               # *zp == eos: _offsets' opaque zero
            eos = gl.load(zp)
            t0 = bos + c.to(gl.int64) * BT
            slot = gl.load(chunk_off_ptr + n) + c
            nt = (eos - t0).to(gl.int32)                      # valid rows (>= BT unless this is the last chunk)
            last = gl.minimum(nt, BT) - 1

            q_s = _smem(_load_tile(q_ptr + t0 * H * K + hk * K, H * K, nt, zp, eos, BT, K, L16), S_TK)
            k_s = _smem(_load_tile(k_ptr + t0 * H * K + hk * K, H * K, nt, zp, eos, BT, K, L16), S_TK)

            r_t = gl.arange(0, BT, layout=RT)
            c_t = gl.arange(0, BT, layout=CT)
            lower = gl.expand_dims(r_t, 1) >= gl.expand_dims(c_t, 0)
            strict = gl.expand_dims(r_t, 1) > gl.expand_dims(c_t, 0)
            r_k = gl.arange(0, BT, layout=RK)
            valid_t = r_t < nt

            # the group's dQ and dK sums (fp32) wait in shared memory between their updates
            dq_s = gl.allocate_shared_memory(gl.float32, [BT, K], S_ACC, gl.zeros([BT, K], gl.float32, A_TK))
            dk_s = gl.allocate_shared_memory(gl.float32, [BT, K], S_ACC, gl.zeros([BT, K], gl.float32, A_TK))
            for j in range(0, G):
                hv = hk * G + j
                gate_r = (t0 + gl.minimum(r_t, last)) * HV + hv
                gam_r = gl.load(gcum_ptr + gate_r)
                gam_c = gl.convert_layout(gam_r, CT)
                gam_k = gl.convert_layout(gam_r, RK)
                gam_last = gl.load(gcum_ptr + (t0 + last) * HV + hv)
                beta_r = gl.load(beta_ptr + (t0 + r_t) * HV + hv, mask=valid_t, other=0.).to(gl.float32)
                beta_c = gl.convert_layout(beta_r, CT)
                vrow = t0 * HV * V + hv * V
                state = (slot.to(gl.int64) * HV + hv) * K * V

                # ---- local terms: dP, dQ_h and its gate term
                do_s = _smem(_load_tile(do_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16), S_TK)
                vn_s = _smem(_load_tile(vnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16), S_TK)
                h_s = _smem(_load_tile(h_ptr + state, V, K, zp, eos, K, V, L16), S_KV)
                dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
                dos = warpgroup_mma(do_s, h_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                gdiff = gl.where(lower, gl.expand_dims(gam_r, 1) - gl.expand_dims(gam_c, 0), 0.)
                pm_s = _smem(gl.where(lower, dp * gl.exp(gdiff), 0.).to(dt), S_TT)
                dqh = warpgroup_mma(pm_s, k_s, dos * gl.expand_dims(gl.exp(gam_k), 1)) * scale
                dgam = gl.sum(dqh * q_s.load(A_TK).to(gl.float32), axis=1)
                dq_s.store(dq_s.load(A_TK) + dqh)

                # ---- dW, the state part of dK and its gate terms
                dvn_s = _smem(_load_tile(dvnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16), S_TK)
                dh_s = _smem(_load_tile(dh_ptr + state, V, K, zp, eos, K, V, L16), S_KV)
                sds = gl.sum(gl.sum(h_s.load(L16).to(gl.float32) * dh_s.load(L16).to(gl.float32), axis=1), axis=0)
                dw_s = _smem((-warpgroup_mma(dvn_s, h_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, A_TK),
                                             use_acc=False)).to(dt), S_TK)
                dks = warpgroup_mma(vn_s, dh_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dks = dks * gl.expand_dims(gl.exp(gam_last - gam_k), 1)
                x = gl.sum(dks * k_s.load(A_TK).to(gl.float32), axis=1)
                dgam = dgam - x + gl.where(r_k == last, gl.sum(x, axis=0) + gl.exp(gam_last) * sds, 0.)
                dk = dk_s.load(A_TK) + dks

                # ---- the intra-chunk part of dK: scale Pm^T Q
                dkh = warpgroup_mma(pm_s.permute((1, 0)), q_s, gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dkh = dkh * scale
                dgam -= gl.sum(dkh * k_s.load(A_TK).to(gl.float32), axis=1)
                dk_s.store(dk + dkh)

                # ---- WY phase 1: X, dV, dbeta, dTinv
                tinv = gl.convert_layout(_load_tile(tinv_ptr + (t0 * HV + hv) * BT, HV * BT, nt, zp, eos, BT, BT, L32),
                                         A_TT)
                xw = warpgroup_mma(dw_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
                rs_w = gl.sum(tinv * xw, axis=0)                               # rowsum(K * Tinv^T dW), per column
                v_s = _smem(_load_tile(v_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16), S_TK)
                xw = warpgroup_mma(dvn_s, v_s.permute((1, 0)), xw * gl.expand_dims(gl.exp(gam_c), 0))
                tinv_s = _smem(tinv.to(dt), S_TT)
                dvh = warpgroup_mma(tinv_s.permute((1, 0)), dvn_s, gl.zeros([BT, K], gl.float32, A_TK),
                                    use_acc=False)
                dvh = dvh * gl.expand_dims(gl.convert_layout(beta_r, RK), 1)
                _store_tile(dv_ptr + vrow, dvh.to(dv_ptr.dtype.element_ty), HV * V, nt, zp, eos, BT, V, A_TK)
                dbeta = gl.sum(tinv * xw, axis=0)
                dtinv = gl.where(strict, xw * gl.expand_dims(beta_c, 0), 0.)

                # ---- WY phase 2: D = -(Tinv^T dTinv Tinv^T) * Gam (TF32), M, the gate terms, dg, dbeta
                dti_s = _smem(gl.convert_layout(dtinv, L32), S_TF)
                tif_s = _smem(gl.convert_layout(tinv, L32), S_TF)
                z = warpgroup_mma(dti_s, tif_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
                tit_s = _smem(gl.convert_layout(gl.permute(tinv, (1, 0)), L32), S_TF)
                zt_s = _smem(gl.convert_layout(gl.permute(z, (1, 0)), L32), S_TF)
                da = warpgroup_mma(tit_s, zt_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
                da = gl.convert_layout(da, A_TT)
                gstrict = gl.where(strict, gl.expand_dims(gam_r, 1) - gl.expand_dims(gam_c, 0), 0.)
                d = gl.where(strict, -da * gl.exp(gstrict), 0.)
                kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
                rs_d = gl.sum(d * kk, axis=1)
                m = d * gl.expand_dims(beta_r, 1)
                rs_m = gl.sum(m * kk, axis=0)
                m_op = m.to(dt)
                s_s = _smem((m_op.to(gl.float32) + gl.convert_layout(gl.permute(m_op, (1, 0)), A_TT).to(gl.float32))
                            .to(dt), S_TT)
                dbeta = gl.convert_layout(dbeta, RT) + rs_d
                dgam_t = (beta_r * (gl.exp(gam_r) * gl.convert_layout(rs_w, RT) + rs_d) - gl.convert_layout(rs_m, RT)
                          + gl.convert_layout(dgam, RT))
                # dg_i = sum over j >= i in the chunk of dgam_j (gam is the in-chunk cumsum of g)
                dg = gl.sum(gl.where(gl.expand_dims(c_t, 0) >= gl.expand_dims(r_t, 1),
                                     gl.expand_dims(gl.convert_layout(dgam_t, CT), 0), 0.), axis=1)
                gl.store(dg_ptr + (t0 + r_t) * HV + hv, dg.to(dg_ptr.dtype.element_ty), mask=valid_t)
                gl.store(dbeta_ptr + (t0 + r_t) * HV + hv, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid_t)

                # ---- WY phase 3: dK += (M + M^T) K + diag(beta exp gam) Tinv^T dW
                tdw = warpgroup_mma(tinv_s.permute((1, 0)), dw_s, gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dk = tdw * gl.expand_dims(gl.convert_layout(beta_r, RK) * gl.exp(gam_k), 1) + dk_s.load(A_TK)
                dk_s.store(warpgroup_mma(s_s, k_s, dk))
                gl.thread_barrier()                           # this head's buffers are read by every warp

            gl.thread_barrier()
            _store_tile(dq_ptr + t0 * H * K + hk * K, dq_s.load(A_TK).to(dq_ptr.dtype.element_ty), H * K, nt, zp, eos, BT, K, A_TK)
            _store_tile(dk_ptr + t0 * H * K + hk * K, dk_s.load(A_TK).to(dk_ptr.dtype.element_ty), H * K, nt, zp, eos, BT, K, A_TK)


def local_wy_launch(q, k, v, vnew, h, dh, gcum, beta, tinv, do, dvnew, dq, dk, dv, dg, dbeta, plan, scale: float):
    """(kernel, grid, args, kwargs) of one launch over the plan's chunk slots and key heads. Separate from the launch
    so that a CPU test can check the arguments against the AOT signature (aot.py, local_wy_signature)."""
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    args = (q, k, v, vnew, h, dh, gcum, beta, tinv, do, dvnew, dq, dk, dv, dg, dbeta,
            plan.cu, plan.chunk_indices, plan.chunk_offsets, plan.N, float(scale))
    return chunk_local_wy_bwd_kernel, (plan.num_slots, H), args, dict(H=H, HV=HV, K=K, V=V, BT=BT, num_warps=WARPS)


def chunk_local_wy_bwd_gluon(q, k, v, vnew, h, dh, gcum, beta, tinv, do, dvnew, dq, dk, dv, dg, dbeta, plan,
                             scale: float) -> None:
    """Stages 2 and 3 of triton/backward.py chunk_gated_delta_rule_bwd on sm_90a (its `local_wy` hook): writes dq,
    dk, dv, dg, dbeta from the recompute's vnew, h, gcum, tinv and stage 1's dh, dvnew."""
    kernel, grid, args, kwargs = local_wy_launch(q, k, v, vnew, h, dh, gcum, beta, tinv, do, dvnew, dq, dk, dv, dg,
                                                 dbeta, plan, scale)
    kernel[grid](*args, **kwargs)
