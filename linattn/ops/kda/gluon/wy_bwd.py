"""KDA's backward WY stage in Gluon for Hopper: what triton/backward.py's kda_wy_bwd_kernel computes (its docstring
derives the terms), per (chunk slot, value head), 8 warps (two warpgroups, each takes half of every product's
columns), with the same outputs for kda_pair_bwd_kernel: the partial dq, dk and dgam (fp32 [T_tot, HV, K]), dbeta
(fp32), dAkk (strict lower) and dAqk (lower incl.) fp32 [T_tot, HV, BT], dv final.

The chunk's value-side tiles (dO, Vnew, dVnew, V) and the state's S and dS (whole [K, V]) come in by cp.async into
shared memory (rows past the chunk's end zero-filled) and stay there as the products' operands; Tinv is read through
registers into three shared copies (fp32 Tinv, fp32 Tinv^T, Tinv rounded to the inputs' dtype). The products and
their precisions are the Triton kernel's: 16-bit operands for Tinv^T dVnew, dVnew (beta V)^T, dO Vnew^T, dO S^T,
Vnew dS^T, dVnew S^T; TF32 for dW (beta K e^gam)^T, Tinv^T dW and the dAkk chain Tinv^T dTinv Tinv^T, whose operands
are written to shared memory K-major (transposed in registers where needed). The key side walks the key row in two
blocks of 64 channels; the element-wise terms (gam, K, Q and their exps) are read per block straight into the
products' accumulator layout.

Shared memory: four [64, 128] 16-bit tiles, S and dS [128, 128], three [64, 64] Tinv copies and two fp32 [64, 64]
scratch tiles (dW and dW^T, then dTinv^T and Tinv^T dTinv); beta K e^gam reuses V's tile once beta V has been read.
Every write of a shared tile is followed by fence_async_shared and a CTA barrier before a wgmma reads it, and a
store into a reused tile is preceded by a CTA barrier (each wgmma here is waited when it returns).

Only K = V = 128, BT = 64, bf16 / fp16 q, k, v, dO and the recompute's tensors in that dtype, Tinv in it or fp32.
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import GLUON_OK, async_copy as cp, fence_async_shared, gl, gluon, warpgroup_mma

BT = 64
WARPS = 8

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_local_wy_bwd import _acc, _copy, _landed, _put, _rows, _store_tile

    @gluon.jit
    def kda_wy_bwd_gluon_kernel(
        q_ptr, k_ptr, v_ptr,                                   # the op's inputs
        gcum_ptr, beta_ptr, tinv_ptr, h_ptr, vnew_ptr,         # the recomputed forward
        do_ptr, dh_ptr, dvnew_ptr,                             # dO, dS into each chunk's S_next, the whole dVnew
        dq_ptr, dk_ptr, dv_ptr, dgam_ptr, dbeta_ptr, dakk_ptr, daqk_ptr,
        cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, scale,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
    ):
        dt: gl.constexpr = vnew_ptr.dtype.element_ty
        BK: gl.constexpr = 64
        A_TV: gl.constexpr = _acc(V, 16)           # [BT, V] results
        A_TT: gl.constexpr = _acc(BT, 16)          # [BT, BT] and [BT, BK] results of 16-bit products
        A_TF: gl.constexpr = _acc(BT, 8)           # [BT, BT] and [BT, BK] results of TF32 products
        RT: gl.constexpr = gl.SliceLayout(1, A_TT)
        CT: gl.constexpr = gl.SliceLayout(0, A_TT)
        RV: gl.constexpr = gl.SliceLayout(1, A_TV)
        L16: gl.constexpr = _rows(V, 16)
        S_TV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, V], dt)
        S_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, V], dt)
        S_TT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dt)
        S_TF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)

        p = gl.program_id(0)
        hv = gl.program_id(1)
        hk = hv // (HV // H)
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
            vrow = t0 * HV * V + hv * V
            state = (slot.to(gl.int64) * HV + hv) * K * V

            do_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            vn_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            dvn_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            v_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            h_s = gl.allocate_shared_memory(dt, [K, V], S_KV)
            dh_s = gl.allocate_shared_memory(dt, [K, V], S_KV)
            ti_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_TF)        # Tinv
            tit_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_TF)       # Tinv^T
            ti16_s = gl.allocate_shared_memory(dt, [BT, BT], S_TT)              # Tinv rounded
            w_s = gl.allocate_shared_memory(gl.float32, [BT, BK], S_TF)         # dW, then dTinv^T
            wt_s = gl.allocate_shared_memory(gl.float32, [BK, BT], S_TF)        # dW^T, then Tinv^T dTinv
            kbe_s = v_s._reinterpret(gl.float32, [BT, BK], S_TF)                # beta K e^gam (V read by then)

            _copy(do_s, do_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            _copy(vn_s, vnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            _copy(dvn_s, dvnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            _copy(v_s, v_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            cp.commit_group()
            _copy(h_s, h_ptr + state, V, K, zp, eos, K, V, L16)
            _copy(dh_s, dh_ptr + state, V, K, zp, eos, K, V, L16)
            cp.commit_group()

            r_t = gl.arange(0, BT, layout=RT)
            c_t = gl.arange(0, BT, layout=CT)
            r_v = gl.arange(0, BT, layout=RV)
            valid_t = r_t < nt
            tok = t0 + r_t
            incl = gl.expand_dims(r_t, 1) >= gl.expand_dims(c_t, 0)
            strict = gl.expand_dims(r_t, 1) > gl.expand_dims(c_t, 0)
            rows_m = gl.expand_dims(valid_t, 1) & (gl.expand_dims(c_t, 0) >= 0)        # [BT, BT]: row < nt
            off_a = gl.expand_dims(tok * HV + hv, 1) * BT + gl.expand_dims(c_t, 0)
            beta = gl.load(beta_ptr + tok * HV + hv, mask=valid_t, other=0.).to(gl.float32)
            # Tinv [i, j] (rows past the end zero): fp32, transposed, rounded
            tinv = gl.load(tinv_ptr + off_a, mask=rows_m, other=0.).to(gl.float32)
            ti_s.store(tinv)
            tit_s.store(gl.permute(tinv, (1, 0)))
            ti16_s.store(tinv.to(dt))
            fence_async_shared()
            gl.thread_barrier()
            _landed(1)                                        # dO, Vnew, dVnew, V

            # ---- the value side: dV, dbeta's U term, dTinv's U term, dAqk
            dvb = warpgroup_mma(ti16_s.permute((1, 0)), dvn_s, gl.zeros([BT, V], gl.float32, A_TV), use_acc=False)
            beta_v = gl.convert_layout(beta, RV)
            _store_tile(dv_ptr + vrow, (dvb * gl.expand_dims(beta_v, 1)).to(dv_ptr.dtype.element_ty), HV * V, nt, zp,
                        eos, BT, V, A_TV)
            vf = v_s.load(A_TV).to(gl.float32)
            dbeta = gl.sum(dvb * vf, axis=1)
            _put(v_s, (gl.expand_dims(beta_v, 1) * vf).to(dt))                 # beta V
            dtinv = warpgroup_mma(dvn_s, v_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
            dtinv = gl.convert_layout(dtinv, A_TF)
            aq = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
            gl.store(daqk_ptr + off_a, gl.where(incl, scale * aq, 0.), mask=rows_m)
            _landed(0)                                        # S, dS

            # ---- the key side, per block of BK channels: the output's and the state's direct terms, W's terms
            for kb in gl.static_range(K // BK):
                ck = kb * BK + c_t
                off_hk = gl.expand_dims(tok * HV + hv, 1) * K + gl.expand_dims(ck, 0)
                off_q = gl.expand_dims(tok * H + hk, 1) * K + gl.expand_dims(ck, 0)
                gam_last = gl.load(gcum_ptr + ((t0 + last) * HV + hv) * K + ck)
                gam = gl.load(gcum_ptr + off_hk, mask=rows_m, other=0.)
                gam = gl.where(rows_m, gam, gl.expand_dims(gam_last, 0))       # rows past the end: gam_C
                eg = gl.exp(gam)
                ekd = gl.where(rows_m, gl.exp(gl.expand_dims(gam_last, 0) - gam), 0.)
                h_k = h_s.slice(kb * BK, BK)
                dh_k = dh_s.slice(kb * BK, BK)

                dqdec = scale * warpgroup_mma(do_s, h_k.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_TT),
                                              use_acc=False)
                gl.store(dq_ptr + off_hk, dqdec * eg, mask=rows_m)
                qf = gl.load(q_ptr + off_q, mask=rows_m, other=0.).to(gl.float32)
                dgam = dqdec * qf * eg
                kf = gl.load(k_ptr + off_q, mask=rows_m, other=0.).to(gl.float32)
                dkdec = warpgroup_mma(vn_s, dh_k.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_TT),
                                      use_acc=False)
                x = dkdec * kf * ekd
                dk = dkdec * ekd
                dgam -= x
                hd = gl.sum(h_k.load(L16).to(gl.float32) * dh_k.load(L16).to(gl.float32), axis=1)
                dgl = gl.sum(x, axis=0) + gl.exp(gam_last) * gl.convert_layout(hd, CT)

                dw = -warpgroup_mma(dvn_s, h_k.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_TT), use_acc=False)
                gl.thread_barrier()                           # the previous block's TF32 operands are read
                w_s.store(dw)
                wt_s.store(gl.permute(dw, (1, 0)))
                kbe_s.store(gl.expand_dims(beta, 1) * kf * eg)
                fence_async_shared()
                gl.thread_barrier()
                dtinv = warpgroup_mma(w_s, kbe_s.permute((1, 0)), dtinv)                     # += dW (beta K e^g)^T
                dkb = warpgroup_mma(tit_s, wt_s.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_TF),
                                    use_acc=False)                                           # Tinv^T dW
                dkb = gl.convert_layout(dkb, A_TT)
                dbeta += gl.convert_layout(gl.sum(dkb * kf * eg, axis=1), RV)
                dk += gl.expand_dims(beta, 1) * dkb * eg
                dgam += gl.expand_dims(beta, 1) * dkb * kf * eg
                dgam = gl.where(rows_m, dgam + gl.where(gl.expand_dims(r_t, 1) == last, gl.expand_dims(dgl, 0), 0.),
                                0.)
                gl.store(dk_ptr + off_hk, dk, mask=rows_m)
                gl.store(dgam_ptr + off_hk, dgam, mask=rows_m)

            # ---- dAkk = -Tinv^T dTinv Tinv^T (strict lower), TF32
            _put(w_s, gl.permute(dtinv, (1, 0)))
            z = warpgroup_mma(tit_s, w_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
            _put(wt_s, z)
            da = warpgroup_mma(wt_s, ti_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
            da = gl.convert_layout(da, A_TT)
            gl.store(dakk_ptr + off_a, gl.where(strict, -da, 0.), mask=rows_m)
            gl.store(dbeta_ptr + (t0 + r_v) * HV + hv, dbeta, mask=r_v < nt)


def kda_wy_bwd_gluon_launch(q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk,
                            plan, scale: float):
    """(kernel, grid, args, kwargs) of one launch over the plan's chunk slots and value heads (the Triton kernel's
    arguments, in its order)."""
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    args = (q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk,
            plan.cu, plan.chunk_indices, plan.chunk_offsets, plan.N, float(scale))
    return kda_wy_bwd_gluon_kernel, (plan.num_slots, HV), args, dict(H=H, HV=HV, K=K, V=V, BT=BT, num_warps=WARPS)
