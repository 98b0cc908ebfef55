"""KDA's backward WY stage in Gluon for Hopper: what triton/backward.py's kda_wy_bwd_kernel computes (its docstring
derives the terms), per (chunk slot, value head), 8 warps (two warpgroups, each takes half of every product's
columns), with the same outputs for kda_pair_bwd_kernel: the partial dq, dk and dgam (fp32 [T_tot, HV, K]), dbeta
(fp32), dAkk (strict lower) and dAqk (lower incl.) fp32 [T_tot, HV, BT], dv final. The gluon backend's backward
takes it where kda_wy_bwd_gluon_supported (chunk_kda_bwd's wy_bwd hook); elsewhere the Triton kernel runs.

The chunk's value-side tiles (dO, Vnew, dVnew, V) and the state's S and dS (whole [K, V], in key blocks) come in by
cp.async into shared memory (rows past the chunk's end zero-filled) and stay there as the products' operands; Tinv
comes by cp.async into the shared copy of its own dtype (fp32 or the inputs'), first, and the other two (fp32 Tinv^T
and Tinv fp32 or rounded) are formed from it through registers. The products and their precisions are the Triton
kernel's: 16-bit operands for Tinv^T dVnew, dVnew (beta V)^T, dO Vnew^T, dO S^T, Vnew dS^T, dVnew S^T; TF32 for dW
(beta K e^gam)^T, Tinv^T dW and the dAkk chain Tinv^T dTinv Tinv^T, whose operands are written to shared memory
K-major (transposed in registers where needed). The key side walks the key row in a loop over blocks of BK = 32
channels (at 64 the block's element-wise tiles spill; sm_90a, Triton 3.6.0: 255 registers, none spilled at 32); its
element-wise terms (gam, K, Q) come by cp.async into shared tiles, the next block's issued at the block's start, once
every warp has read this block's into registers, so they are in flight during all of the block's products (one
buffer: a second, a block further ahead, costs registers that the key side does not have); the outputs' int32
offsets count from the chunk's first row.

Shared memory (205,312 B at BK = 32, one CTA per SM): four [64, 128] 16-bit tiles, S and dS [128, 128], two [64, 64]
fp32 Tinv copies, the key block's dW, dW^T and beta K e^gam (fp32), a key block's gam, q and k; Tinv rounded shares
dW's buffer (read before the key side), the dAkk chain's dTinv^T and Tinv^T dTinv reuse dO's and Vnew's tiles, and
beta V reuses V's. Every write of a shared tile is followed by fence_async_shared and a CTA barrier before a wgmma
reads it, and a store into a reused tile is preceded by a CTA barrier (each wgmma here is waited when it returns).

Only K = V = 128, BT = 64, q, k, v, dO and the recompute's tensors in bf16, Tinv in bf16 or fp32 (fp16 stays on the
Triton stage, whose fp32 products are TF32x3 for fp16).
"""
from __future__ import annotations

from typing import Tuple

import torch

from linattn.runtime.gluon_compat import GLUON_OK, async_copy as cp, fence_async_shared, gl, gluon, warpgroup_mma

BT = 64
BK = 32             # key channels per block of the key side's walk
WARPS = 8

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_local_wy_bwd import (_acc, _chunk_span, _copy, _landed, _put,
                                                                       _rows, _store_tile)

    @gluon.jit
    def _copy_key_block(g_dst, q_dst, k_dst, g_base, q_base, k_base, kb, nt, zp, eos, H: gl.constexpr,
                        HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, LKF: gl.constexpr,
                        LK16: gl.constexpr):
        """cp.async of key block kb's [BT, BK] tiles of gam (fp32), q and k of the chunk (rows >= nt zero)."""
        _copy(g_dst, g_base + kb * BK, HV * K, nt, zp, eos, BT, BK, LKF)
        _copy(q_dst, q_base + kb * BK, H * K, nt, zp, eos, BT, BK, LK16)
        _copy(k_dst, k_base + kb * BK, H * K, nt, zp, eos, BT, BK, LK16)

    @gluon.jit
    def kda_wy_bwd_gluon_kernel(
        q_ptr, k_ptr, v_ptr,                                   # the op's inputs
        gcum_ptr, beta_ptr, tinv_ptr, h_ptr, vnew_ptr,         # the recomputed forward
        do_ptr, dh_ptr, dvnew_ptr,                             # dO, dS into each chunk's S_next, the whole dVnew
        dq_ptr, dk_ptr, dv_ptr, dgam_ptr, dbeta_ptr, dakk_ptr, daqk_ptr,
        cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, scale,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
    ):
        dt: gl.constexpr = vnew_ptr.dtype.element_ty
        A_TV: gl.constexpr = _acc(V, 16)           # [BT, V] results
        A_TT: gl.constexpr = _acc(BT, 16)          # [BT, BT] results of 16-bit products
        A_TF: gl.constexpr = _acc(BT, 8)           # [BT, BT] results of TF32 products
        A_TK: gl.constexpr = _acc(BK, 16)          # [BT, BK] results of 16-bit products
        A_KF: gl.constexpr = _acc(BK, 8)           # [BT, BK] results of TF32 products
        RT: gl.constexpr = gl.SliceLayout(1, A_TT)
        CT: gl.constexpr = gl.SliceLayout(0, A_TT)
        RK: gl.constexpr = gl.SliceLayout(1, A_TK)
        CK: gl.constexpr = gl.SliceLayout(0, A_TK)
        RV: gl.constexpr = gl.SliceLayout(1, A_TV)
        L16: gl.constexpr = _rows(V, 16)
        S_TV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, V], dt)
        S_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, V], dt)
        S_TT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dt)
        S_TF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)
        S_TKF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.float32)
        S_KTF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BT], gl.float32)
        S_TK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BK], dt)
        LKF: gl.constexpr = _rows(BK, 32)
        LK16: gl.constexpr = _rows(BK, 16)

        p = gl.program_id(0)
        hv = gl.program_id(1)
        hk = hv // (HV // H)
        n = gl.load(chunk_idx_ptr + 2 * p)
        c = gl.load(chunk_idx_ptr + 2 * p + 1)
        if n < N:                                             # else a surplus slot of the varlen bound
            zp, eos, t0, slot, nt, last = _chunk_span(cu_ptr, chunk_off_ptr, n, c, BT)
            vrow = t0 * HV * V + hv * V
            a_row = (t0 * HV + hv) * BT
            g_row = (t0 * HV + hv) * K
            q_row = (t0 * H + hk) * K
            state = (slot.to(gl.int64) * HV + hv) * K * V

            do_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            vn_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            dvn_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            v_s = gl.allocate_shared_memory(dt, [BT, V], S_TV)
            h_s = gl.allocate_shared_memory(dt, [K // BK, BK, V], S_KV)                # S in key blocks
            dh_s = gl.allocate_shared_memory(dt, [K // BK, BK, V], S_KV)
            ti_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_TF)        # Tinv
            tit_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_TF)       # Tinv^T
            w_s = gl.allocate_shared_memory(gl.float32, [BT, BK], S_TKF)        # dW of a key block
            ti16_s = w_s._reinterpret(dt, [BT, BT], S_TT)                       # Tinv rounded (before the key side)
            wt_s = gl.allocate_shared_memory(gl.float32, [BK, BT], S_KTF)       # its transpose
            kbe_s = gl.allocate_shared_memory(gl.float32, [BT, BK], S_TKF)      # beta K e^gam
            g_s = gl.allocate_shared_memory(gl.float32, [BT, BK], S_TKF)        # gam, q, k of a key block
            q_s = gl.allocate_shared_memory(dt, [BT, BK], S_TK)
            k_s = gl.allocate_shared_memory(dt, [BT, BK], S_TK)
            dti_s = do_s._reinterpret(gl.float32, [BT, BT], S_TF)               # dTinv^T (the products are done)
            z_s = vn_s._reinterpret(gl.float32, [BT, BT], S_TF)                 # Tinv^T dTinv

            # Tinv (rows past the end zero) into its copy of the same dtype, first: the others are formed from it
            if tinv_ptr.dtype.element_ty == gl.float32:
                _copy(ti_s, tinv_ptr + a_row, HV * BT, nt, zp, eos, BT, BT, _rows(BT, 32))
            else:
                _copy(ti16_s, tinv_ptr + a_row, HV * BT, nt, zp, eos, BT, BT, _rows(BT, 16))
            cp.commit_group()
            _copy(do_s, do_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            _copy(vn_s, vnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            _copy(dvn_s, dvnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            _copy(v_s, v_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
            cp.commit_group()
            for kb in gl.static_range(K // BK):
                _copy(h_s.index(kb), h_ptr + state + kb * BK * V, V, BK, zp, eos, BK, V, L16)
                _copy(dh_s.index(kb), dh_ptr + state + kb * BK * V, V, BK, zp, eos, BK, V, L16)
            cp.commit_group()
            _copy_key_block(g_s, q_s, k_s, gcum_ptr + g_row, q_ptr + q_row, k_ptr + q_row, 0, nt, zp, eos, H, HV,
                            K, BT, BK, LKF, LK16)
            cp.commit_group()

            r_t = gl.arange(0, BT, layout=RT)
            c_t = gl.arange(0, BT, layout=CT)
            r_v = gl.arange(0, BT, layout=RV)
            valid_t = r_t < nt
            tok = t0 + r_t
            rows_m = gl.expand_dims(valid_t, 1) & (gl.expand_dims(c_t, 0) >= 0)        # [BT, BT]: row < nt
            # int32 offsets of a chunk's [BT, 64] tiles from the chunk's first row: [T_tot, HV, BT] (dAkk, dAqk,
            # Tinv), [T_tot, HV, K] (dq, dk, dgam, gcum) and [T_tot, H, K] (q, k) rows
            off_a = gl.expand_dims(r_t * (HV * BT), 1) + gl.expand_dims(c_t, 0)
            beta = gl.load(beta_ptr + tok * HV + hv, mask=valid_t, other=0.).to(gl.float32)
            # Tinv [i, j]: fp32, transposed, rounded, from the copy that landed
            _landed(3)
            if tinv_ptr.dtype.element_ty == gl.float32:
                tinv = ti_s.load(A_TT)
                ti16_s.store(tinv.to(dt))
            else:
                tinv = ti16_s.load(A_TT).to(gl.float32)
                ti_s.store(tinv)
            tit_s.store(gl.permute(tinv, (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            _landed(2)                                        # dO, Vnew, dVnew, V

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
            incl = gl.expand_dims(r_t, 1) >= gl.expand_dims(c_t, 0)
            gl.store(daqk_ptr + a_row + off_a, gl.where(incl, scale * aq, 0.), mask=rows_m)

            # ---- the key side, per block of BK channels: the output's and the state's direct terms, W's terms
            r_k = gl.arange(0, BT, layout=RK)
            beta_k = gl.convert_layout(beta, RK)
            c_k = gl.arange(0, BK, layout=CK)
            for kb in range(K // BK):
                gam_last = gl.load(gcum_ptr + g_row + last * (HV * K) + kb * BK + c_k)
                _landed(0)                                    # S and dS (first block), this block's gam, q, k
                ck = kb * BK + c_k
                rows_k = gl.expand_dims(r_k < nt, 1) & (gl.expand_dims(ck, 0) >= 0)
                off_hk = gl.expand_dims(r_k * (HV * K), 1) + gl.expand_dims(ck, 0)
                gam = g_s.load(A_TK)
                qf = q_s.load(A_TK).to(gl.float32)
                kf = k_s.load(A_TK).to(gl.float32)
                gl.thread_barrier()                           # every warp has read this block's gam, q, k: the
                if kb + 1 < K // BK:                          # next block's by cp.async, in flight during this one
                    _copy_key_block(g_s, q_s, k_s, gcum_ptr + g_row, q_ptr + q_row, k_ptr + q_row, kb + 1, nt, zp,
                                    eos, H, HV, K, BT, BK, LKF, LK16)
                    cp.commit_group()
                gam = gl.where(rows_k, gam, gl.expand_dims(gam_last, 0))       # rows past the end: gam_C
                eg = gl.exp(gam)
                ekd = gl.where(rows_k, gl.exp(gl.expand_dims(gam_last, 0) - gam), 0.)
                h_k = h_s.index(kb)
                dh_k = dh_s.index(kb)

                dqdec = scale * warpgroup_mma(do_s, h_k.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_TK),
                                              use_acc=False)
                gl.store(dq_ptr + g_row + off_hk, dqdec * eg, mask=rows_k)
                dgam = dqdec * qf * eg
                dkdec = warpgroup_mma(vn_s, dh_k.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_TK),
                                      use_acc=False)
                x = dkdec * kf * ekd
                dk = dkdec * ekd
                dgam -= x
                hd = gl.sum(h_k.load(L16).to(gl.float32) * dh_k.load(L16).to(gl.float32), axis=1)
                dgl = gl.sum(x, axis=0) + gl.exp(gam_last) * gl.convert_layout(hd, CK)

                dw = -warpgroup_mma(dvn_s, h_k.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_TK), use_acc=False)
                gl.thread_barrier()                           # the previous block's TF32 operands are read
                w_s.store(dw)
                wt_s.store(gl.permute(dw, (1, 0)))
                kbe_s.store(gl.expand_dims(beta_k, 1) * kf * eg)
                fence_async_shared()
                gl.thread_barrier()
                dtinv = warpgroup_mma(w_s, kbe_s.permute((1, 0)), dtinv)                     # += dW (beta K e^g)^T
                dkb = warpgroup_mma(tit_s, wt_s.permute((1, 0)), gl.zeros([BT, BK], gl.float32, A_KF),
                                    use_acc=False)                                           # Tinv^T dW
                dkb = gl.convert_layout(dkb, A_TK)
                dbeta += gl.convert_layout(gl.sum(dkb * kf * eg, axis=1), RV)
                dk += gl.expand_dims(beta_k, 1) * dkb * eg
                dgam += gl.expand_dims(beta_k, 1) * dkb * kf * eg
                dgam = gl.where(rows_k, dgam + gl.where(gl.expand_dims(r_k, 1) == last, gl.expand_dims(dgl, 0), 0.),
                                0.)
                gl.store(dk_ptr + g_row + off_hk, dk, mask=rows_k)
                gl.store(dgam_ptr + g_row + off_hk, dgam, mask=rows_k)

            # ---- dAkk = -Tinv^T dTinv Tinv^T (strict lower), TF32
            _put(dti_s, gl.permute(dtinv, (1, 0)))
            z = warpgroup_mma(tit_s, dti_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
            _put(z_s, z)
            da = warpgroup_mma(z_s, ti_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
            da = gl.convert_layout(da, A_TT)
            gl.store(dakk_ptr + a_row + off_a, gl.where(gl.expand_dims(r_t, 1) > gl.expand_dims(c_t, 0), -da, 0.),
                     mask=rows_m)
            gl.store(dbeta_ptr + (t0 + r_v) * HV + hv, dbeta, mask=r_v < nt)


def kda_wy_bwd_gluon_launch(q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk,
                            plan, scale: float):
    """(kernel, grid, args, kwargs) of one launch over the plan's chunk slots and value heads (the Triton kernel's
    arguments, in its order)."""
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    args = (q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk,
            plan.cu, plan.chunk_indices, plan.chunk_offsets, plan.N, float(scale))
    return kda_wy_bwd_gluon_kernel, (plan.num_slots, HV), args, dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK,
                                                                     num_warps=WARPS)


def kda_wy_bwd_gluon_supported(q, v, do, tinv, vnew) -> Tuple[bool, str]:
    """(ok, reason): the Gluon WY stage takes K = V = 128, q, k, v, dO and the recompute's tensors in bf16 (Tinv in
    bf16 or fp32), on a CUDA device with Gluon."""
    if not GLUON_OK:
        return False, "this Triton has no Gluon"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"K={q.shape[-1]}, V={v.shape[-1]}; the Gluon WY stage takes K = V = 128"
    if q.dtype != torch.bfloat16 or {v.dtype, do.dtype, vnew.dtype} != {q.dtype}:
        # fp16 stays on the Triton stage, whose fp32 products run as TF32x3 there (triton/common.py dot_precision)
        return False, (f"q {q.dtype}, v {v.dtype}, do {do.dtype}, vnew {vnew.dtype}: the Gluon WY stage takes bf16 "
                       f"throughout (its fp32 products are single TF32)")
    if tinv.dtype not in (q.dtype, torch.float32):
        return False, f"Tinv is {tinv.dtype}; the Gluon WY stage takes it in q's dtype or fp32"
    if not q.is_cuda:
        return False, f"q is on {q.device}; the Gluon WY stage runs on a CUDA (sm_90) device"
    return True, ""


def kda_wy_bwd_gluon(q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk, plan,
                     scale: float) -> None:
    """chunk_kda_bwd's wy_bwd hook (launch_kda_wy_bwd's arguments): the Gluon kernel where kda_wy_bwd_gluon_supported,
    else the Triton one."""
    if not kda_wy_bwd_gluon_supported(q, v, do, tinv, vnew)[0]:
        from linattn.ops.kda.triton.backward import launch_kda_wy_bwd
        launch_kda_wy_bwd(q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv, dgam, dbeta, dakk, daqk, plan,
                          scale)
        return
    from linattn.ops.gated_delta_rule.gluon.host import launches
    kernel, grid, args, kwargs = kda_wy_bwd_gluon_launch(q, k, v, gcum, beta, tinv, h, vnew, do, dh, dvnew, dq, dk, dv,
                                                         dgam, dbeta, dakk, daqk, plan, scale)
    launches(kernel, grid, args, kwargs)
