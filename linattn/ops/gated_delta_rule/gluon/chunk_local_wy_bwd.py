"""Backward stages 2 and 3 in one Gluon kernel (sm_90a): the chunk-parallel local terms (triton/backward_local.py)
and the way back through the WY representation (triton/backward_wy.py), per (chunk slot, query/key head), walking
the HV // H value heads of the group. What the two Triton kernels pass through memory stays on chip: dW, the partial
dK (dk_part), the dgam partials and M^T; K K^T is formed once per key head instead of once per value head.

Tiles come in by cp.async straight into shared memory (rows past the chunk's end zero-filled, so the next sequence's
rows never enter), a head's tiles in two commit groups issued together; every product is a synchronous
warpgroup_mma; 8 warps (two warpgroups, each takes half of every product's columns). The formulas, rounding points
and masks are the Triton kernels' (their docstrings derive them) but one: the intra-chunk pairs of O's gate term come
through q.dQ and k.dK here, not once as M = Pm * Q K^T (the Triton local stage's device for fp32 precision; at 16-bit
inputs their rounding dominates, the gate's strong-decay case gives the same dg and A_log errors either way, and
Q K^T per head costs 3% of this kernel);
per value head hv of key head hk, with gam the chunk's cumulative gate (rows past the end take the last valid row's),
Gam_ij = exp(gam_i - gam_j), lower = i >= j, strict = i > j:

  local   dP = dO Vnew^T;  Pm = (dP * Gam) on lower, rounded to the operand dtype
          dQ_h = scale (diag(exp gam) dO S^T + Pm K);  dQ += dQ_h;  dgam = rowsum(Q * dQ_h)
          dW = -(dVnew S^T), rounded;  Dk = diag(exp(gam_C - gam)) Vnew dS^T;  dK += Dk;  x = rowsum(K * Dk)
          dgam += -x, and on the last valid row sum(x) + exp(gam_C) sum(dS * S)
          dK_h = scale Pm^T Q;  dK += dK_h;  dgam -= rowsum(K * dK_h)
  WY      X = dW K^T;  rs_w = colsum(Tinv * X);  X = X diag(exp gam) + dVnew V^T
          dV = diag(beta) Tinv^T dVnew;  dbeta = colsum(Tinv * X);  dTinv = (X diag(beta)) on strict
          D = -(Tinv^T (dTinv Tinv^T)) * Gam on strict (TF32 products);  M = diag(beta) D
          dbeta += rowsum(D * K K^T);  dgam += beta (exp(gam) rs_w + rowsum(D * K K^T)) - colsum(M * K K^T)
          dg = the in-chunk reverse cumsum of dgam;  dK += (M + M^T) K + diag(beta exp gam) Tinv^T dW
where S = h[chunk] and dS = dh[chunk] (the state at the chunk's start and the gradient flowing into the chunk's
S_next, stage 1's output), dVnew the full gradient of Vnew (stage 1 added the state term), Tinv in the operand dtype
(the forward's own stage 2a's: what the forward multiplied by), taken to fp32 exactly where fp32 operands are needed.

Two passes over the group's value heads, so that one [64, 128] fp32 sum is live at a time: pass 1 forms dQ (summed
in registers, stored at its end) and keeps each head's dQ gate term in dgam_s; pass 2 forms Pm again (one 64x64x128
product) and everything else, dK summed in shared memory (fp32 [64, 128]; in registers through the loop it pushed
the head's body over 255 registers). sm_90a, H16/HV32 bf16: 255 registers, 8 B spilled (0 at HV = H), 218 KB of
shared memory, one CTA per SM.

Transposed operands: a 16-bit tile is read transposed by wgmma through .permute of its shared buffer (MN-major A, or
K-major B); the TF32 products need both operands K-major, so Tinv^T and z^T are written to shared memory from
registers already transposed (gl.permute).

Shared memory: eleven [64, 128] 16-bit slots (q, k, do, vn in one [256, 128] buffer; dvn, v, h as two in another; dh
as two; Tinv fp32 as one), Tinv as loaded ([64, 64] 16-bit) and the fp32 dK sum. No NVMMA buffer has more than 256
rows: past that, a .permute view addresses the 64-column slabs differently from the plain view that cp.async and
stores write through. A 16-bit [64, 128] slot is two 8 KB slabs (columns 0..63, then 64..127, 32 KB apart in a [256,
128] buffer), so a 16 KB temporary reinterpreted from a row slice covers the slab of columns 0..63 of two
consecutive slots, and column slices (dim=1) give one slab each. The temporaries live where their tiles were read:
pass 1's Pm in dvn's first slab; in pass 2 Pm in do's, dW in h's first 64 rows, M + M^T in the second column slab of
h's last 64 rows, dTinv and Tinv^T (fp32) in dh's two column halves, z^T (fp32) in do's and vn's first slabs. Every
write of a shared buffer (cp.async landing, a register store) is followed by fence_async_shared and a CTA barrier
before a wgmma reads it, and a store into a reused slot is preceded by a CTA barrier (every warp's reads of the old
tile are done: each wgmma here is waited when it returns); the next head's copies are issued after a CTA barrier.

Only K = V = 128, BT = 64, bf16/fp16 q/k/v/dO and Tinv, fp32 gcum, FLA's default gate and beta: the gluon backend's
calls (its supports()); chunk_gated_delta_rule_bwd keeps FLA's options on the Triton kernels.
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import GLUON_OK, async_copy as cp, fence_async_shared, gl, gluon, warpgroup_mma

BT = 64
WARPS = 8

if GLUON_OK:
    @gluon.constexpr_function
    def _acc(n, k):
        """wgmma accumulator of a [64, n] product over k-wide steps: one warpgroup along M, the two split the n."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, k])

    @gluon.constexpr_function
    def _pow2(n):
        """The smallest power of two >= n (shared buffers have power-of-two shapes)."""
        return 1 << (n - 1).bit_length()

    @gluon.constexpr_function
    def _rows(ncols, elem_bits):
        """Blocked layout of a row-major [rows, ncols] tile over 8 warps, 16-byte vectors along the columns."""
        vec = min(128 // elem_bits, ncols)
        tpw_n = min(32, ncols // vec)
        return gl.BlockedLayout([1, vec], [32 // tpw_n, tpw_n], [8, 1], [1, 0])

    @gluon.jit
    def _chunk_span(cu_ptr, chunk_off_ptr, n, c, BT: gl.constexpr):
        """Chunk c of sequence n (not a surplus slot): (zp, eos, t0, slot, nt, last) with zp = cu_ptr + n + 1
        (*zp == eos: _offsets' opaque zero), t0 the chunk's first token (int64), slot its state slot, nt its valid
        rows (>= BT unless this is the sequence's last chunk) and last = min(nt, BT) - 1."""
        bos = gl.load(cu_ptr + n)
        zp = cu_ptr + n + 1
        eos = gl.load(zp)
        t0 = bos + c.to(gl.int64) * BT
        slot = gl.load(chunk_off_ptr + n) + c
        nt = (eos - t0).to(gl.int32)
        return zp, eos, t0, slot, nt, gl.minimum(nt, BT) - 1

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
    def _store_tile(base, x, row_stride, nrows, zero_ptr, zero_ref, R: gl.constexpr, C: gl.constexpr,
                    L: gl.constexpr):
        """Stores x [R, C] (layout L) at base, rows < nrows only."""
        r, offs = _offsets(zero_ptr, zero_ref, row_stride, R, C, L)
        gl.store(base + offs, x, mask=gl.expand_dims(r < nrows, 1))

    @gluon.jit
    def _copy(dst, base, row_stride, nrows, zero_ptr, zero_ref, R: gl.constexpr, C: gl.constexpr, L: gl.constexpr):
        """cp.async of the [R, C] tile at base into dst (16-byte copies along the rows), rows >= nrows zero-filled."""
        r, offs = _offsets(zero_ptr, zero_ref, row_stride, R, C, L)
        c = gl.arange(0, C, layout=gl.SliceLayout(0, L))
        cp.async_copy_global_to_shared(dst, base + offs, mask=gl.expand_dims(r < nrows, 1) & gl.expand_dims(c < C, 0))

    @gluon.jit
    def _landed(n_pending: gl.constexpr):
        """This thread's cp.async groups but the last n_pending have landed, every thread's copies are visible to
        the generic and the async proxy."""
        cp.wait_group(n_pending)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _put(dst, x):
        """x into dst, a view of a buffer whose earlier contents every warp is done with (the barrier first), then
        visible to wgmma."""
        gl.thread_barrier()
        dst.store(x)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def chunk_local_wy_bwd_kernel(
        q_ptr, k_ptr, v_ptr, vnew_ptr,            # q, k [T_tot, H, K], v, vnew [T_tot, HV, V] (one 16-bit dtype)
        h_ptr, dh_ptr,                            # h, dh [slots, HV, K, V] (that dtype)
        gcum_ptr, beta_ptr, tinv_ptr,             # gcum fp32 / beta any float [T_tot, HV], tinv [T_tot, HV, BT] (dt)
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
        LT16: gl.constexpr = _rows(BT, 16)
        S_TK: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, K], dt)
        S_TT2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BT, BT], dt)
        S_TF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float32)

        p = gl.program_id(0)
        hk = gl.program_id(1)
        n = gl.load(chunk_idx_ptr + 2 * p)
        c = gl.load(chunk_idx_ptr + 2 * p + 1)
        if n < N:                                             # else a surplus slot of the varlen bound
            zp, eos, t0, slot, nt, last = _chunk_span(cu_ptr, chunk_off_ptr, n, c, BT)

            # shared memory: eleven [BT, 128] 16-bit slots in four buffers of at most 256 rows (module docstring): q,
            # k, do, vn; dvn, v, h (two); dh (two); Tinv (fp32); and Tinv as loaded. The temporaries reuse slabs
            # already read.
            S_TT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dt)
            lo = gl.allocate_shared_memory(dt, [4 * BT, K], S_TK)
            hi = gl.allocate_shared_memory(dt, [4 * BT, K], S_TK)
            q_s = lo.slice(0, BT)
            k_s = lo.slice(BT, BT)
            do_s = lo.slice(2 * BT, BT)
            vn_s = lo.slice(3 * BT, BT)
            dvn_s = hi.slice(0, BT)
            v_s = hi.slice(BT, BT)
            h_s = hi.slice(2 * BT, K)
            dh_s = gl.allocate_shared_memory(dt, [K, V], S_TK)
            ti_s = gl.allocate_shared_memory(gl.float32, [BT, BT], S_TF)                # Tinv, fp32 (from tin_s)
            tin_s = gl.allocate_shared_memory(dt, [BT, BT], S_TT)                       # Tinv as loaded (dt)
            pm1_s = dvn_s._reinterpret(dt, [2 * BT, BT], S_TT2).slice(0, BT)             # pass 1: Pm (dvn cols < 64)
            pm_s = do_s._reinterpret(dt, [2 * BT, BT], S_TT2).slice(0, BT)               # pass 2: Pm (do cols < 64)
            dw_s = hi.slice(2 * BT, BT)                                                  # dW (h is read)
            sm_s = hi.slice(3 * BT, BT).slice(BT, BT, dim=1)._reinterpret(dt, [BT, BT], S_TT)    # M + M^T
            dti_s = dh_s.slice(0, BT, dim=1)._reinterpret(gl.float32, [BT, BT], S_TF)    # dTinv (dS is read)
            tit_s = dh_s.slice(BT, BT, dim=1)._reinterpret(gl.float32, [BT, BT], S_TF)   # Tinv^T
            zt_s = do_s._reinterpret(gl.float32, [BT, BT], S_TF)                         # z^T: do, vn cols < 64
            dgam_s = gl.allocate_shared_memory(gl.float32, [_pow2(G), BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))

            _copy(q_s, q_ptr + t0 * H * K + hk * K, H * K, nt, zp, eos, BT, K, L16)
            _copy(k_s, k_ptr + t0 * H * K + hk * K, H * K, nt, zp, eos, BT, K, L16)
            cp.commit_group()

            r_t = gl.arange(0, BT, layout=RT)
            c_t = gl.arange(0, BT, layout=CT)
            lower = gl.expand_dims(r_t, 1) >= gl.expand_dims(c_t, 0)
            strict = gl.expand_dims(r_t, 1) > gl.expand_dims(c_t, 0)
            r_k = gl.arange(0, BT, layout=RK)
            valid_t = r_t < nt

            # ---- pass 1: dQ (the group's sum in registers) and each head's dQ gate term, kept in dgam_s
            dq = gl.zeros([BT, K], gl.float32, A_TK)
            for j in range(0, G):
                hv = hk * G + j
                vrow = t0 * HV * V + hv * V
                gl.thread_barrier()                           # the previous head's reads of do, vn, h, pm are done
                _copy(do_s, do_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
                _copy(vn_s, vnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
                _copy(h_s, h_ptr + (slot.to(gl.int64) * HV + hv) * K * V, V, K, zp, eos, K, V, L16)
                cp.commit_group()
                gam_r = gl.load(gcum_ptr + (t0 + gl.minimum(r_t, last)) * HV + hv)
                gam_c = gl.convert_layout(gam_r, CT)
                _landed(0)
                dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
                dos = warpgroup_mma(do_s, h_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                gdiff = gl.where(lower, gl.expand_dims(gam_r, 1) - gl.expand_dims(gam_c, 0), 0.)
                _put(pm1_s, gl.where(lower, dp * gl.exp(gdiff), 0.).to(dt))
                dqh = warpgroup_mma(pm1_s, k_s, dos * gl.expand_dims(gl.exp(gl.convert_layout(gam_r, RK)), 1))
                dqh = dqh * scale
                dgam_s.index(j).store(gl.sum(dqh * q_s.load(A_TK).to(gl.float32), axis=1))
                dq += dqh
            _store_tile(dq_ptr + t0 * H * K + hk * K, dq.to(dq_ptr.dtype.element_ty), H * K, nt, zp, eos, BT, K, A_TK)

            # ---- pass 2: per head, the rest of dK (the group's sum in registers), dV, dbeta, dg
            # the group's dK sum (fp32) waits in shared memory between heads: held in registers through the loop it
            # pushes the head's body over 255 registers
            dk_s = gl.allocate_shared_memory(gl.float32, [BT, K], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
                                             gl.zeros([BT, K], gl.float32, A_TK))
            for j in range(0, G):
                hv = hk * G + j
                vrow = t0 * HV * V + hv * V
                state = (slot.to(gl.int64) * HV + hv) * K * V
                gl.thread_barrier()                           # the previous head's (and pass 1's) reads are done
                _copy(do_s, do_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
                _copy(vn_s, vnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
                _copy(dvn_s, dvnew_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
                _copy(h_s, h_ptr + state, V, K, zp, eos, K, V, L16)
                _copy(dh_s, dh_ptr + state, V, K, zp, eos, K, V, L16)
                cp.commit_group()
                _copy(v_s, v_ptr + vrow, HV * V, nt, zp, eos, BT, V, L16)
                _copy(tin_s, tinv_ptr + (t0 * HV + hv) * BT, HV * BT, nt, zp, eos, BT, BT, LT16)
                cp.commit_group()
                gam_r = gl.load(gcum_ptr + (t0 + gl.minimum(r_t, last)) * HV + hv)
                gam_c = gl.convert_layout(gam_r, CT)
                gam_k = gl.convert_layout(gam_r, RK)
                gam_last = gl.load(gcum_ptr + (t0 + last) * HV + hv)
                beta_r = gl.load(beta_ptr + (t0 + r_t) * HV + hv, mask=valid_t, other=0.).to(gl.float32)
                beta_c = gl.convert_layout(beta_r, CT)
                _landed(1)                                    # do, vn, dvn, h, dh

                # Pm again (pass 1's slot is dvn's now), dW, the state part of dK and the gate terms, dK_h
                dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
                gdiff = gl.where(lower, gl.expand_dims(gam_r, 1) - gl.expand_dims(gam_c, 0), 0.)
                _put(pm_s, gl.where(lower, dp * gl.exp(gdiff), 0.).to(dt))
                dw = warpgroup_mma(dvn_s, h_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dks = warpgroup_mma(vn_s, dh_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dks = dks * gl.expand_dims(gl.exp(gam_last - gam_k), 1)
                sds = gl.sum(gl.sum(h_s.load(L16).to(gl.float32) * dh_s.load(L16).to(gl.float32), axis=1), axis=0)
                x = gl.sum(dks * k_s.load(A_TK).to(gl.float32), axis=1)
                dgam = dgam_s.index(j).load(RK) - x + gl.where(r_k == last, gl.sum(x, axis=0) + gl.exp(gam_last) * sds,
                                                               0.)
                dk_s.store(dk_s.load(A_TK) + dks)             # each thread updates its own elements: no barrier
                dkh = warpgroup_mma(pm_s.permute((1, 0)), q_s, gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dkh = dkh * scale
                dgam -= gl.sum(dkh * k_s.load(A_TK).to(gl.float32), axis=1)
                dk_s.store(dk_s.load(A_TK) + dkh)
                _put(dw_s, (-dw).to(dt))                      # h, dh, vn and pm are read from here on
                _landed(0)                                    # v, Tinv

                # WY phase 1: X, dV, dbeta, dTinv
                tinv = tin_s.load(A_TT).to(gl.float32)
                xw = warpgroup_mma(dw_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
                rs_w = gl.sum(tinv * xw, axis=0)                               # rowsum(K * Tinv^T dW), per column
                xw = warpgroup_mma(dvn_s, v_s.permute((1, 0)), xw * gl.expand_dims(gl.exp(gam_c), 0))
                dvh = warpgroup_mma(tin_s.permute((1, 0)), dvn_s, gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dvh = dvh * gl.expand_dims(gl.convert_layout(beta_r, RK), 1)
                _store_tile(dv_ptr + vrow, dvh.to(dv_ptr.dtype.element_ty), HV * V, nt, zp, eos, BT, V, A_TK)
                dbeta = gl.sum(tinv * xw, axis=0)
                dtinv = gl.where(strict, xw * gl.expand_dims(beta_c, 0), 0.)

                # WY phase 2: D = -(Tinv^T dTinv Tinv^T) * Gam (TF32), M, the gate terms, dg, dbeta
                gl.thread_barrier()
                dti_s.store(dtinv)
                tit_s.store(gl.permute(tinv, (1, 0)))
                ti_s.store(tinv)
                fence_async_shared()
                gl.thread_barrier()
                z = warpgroup_mma(dti_s, ti_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
                _put(zt_s, gl.permute(z, (1, 0)))
                da = warpgroup_mma(tit_s, zt_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TF), use_acc=False)
                da = gl.convert_layout(da, A_TT)
                gstrict = gl.where(strict, gl.expand_dims(gam_r, 1) - gl.expand_dims(gam_c, 0), 0.)
                d = gl.where(strict, -da * gl.exp(gstrict), 0.)
                kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, A_TT), use_acc=False)
                rs_d = gl.sum(d * kk, axis=1)
                m = d * gl.expand_dims(beta_r, 1)
                rs_m = gl.sum(m * kk, axis=0)
                # M + M^T as the Triton stage forms it: fp32 M plus M^T read back rounded (through sm_s)
                _put(sm_s, m.to(dt))
                m_t = sm_s.permute((1, 0)).load(A_TT)
                _put(sm_s, (m + m_t.to(gl.float32)).to(dt))
                dbeta = gl.convert_layout(dbeta, RT) + rs_d
                dgam_t = (beta_r * (gl.exp(gam_r) * gl.convert_layout(rs_w, RT) + rs_d) - gl.convert_layout(rs_m, RT)
                          + gl.convert_layout(dgam, RT))
                # dg_i = sum over j >= i in the chunk of dgam_j (gam is the in-chunk cumsum of g)
                dg = gl.sum(gl.where(gl.expand_dims(c_t, 0) >= gl.expand_dims(r_t, 1),
                                     gl.expand_dims(gl.convert_layout(dgam_t, CT), 0), 0.), axis=1)
                gl.store(dg_ptr + (t0 + r_t) * HV + hv, dg.to(dg_ptr.dtype.element_ty), mask=valid_t)
                gl.store(dbeta_ptr + (t0 + r_t) * HV + hv, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid_t)

                # WY phase 3: dK += (M + M^T) K + diag(beta exp gam) Tinv^T dW
                tdw = warpgroup_mma(tin_s.permute((1, 0)), dw_s, gl.zeros([BT, K], gl.float32, A_TK), use_acc=False)
                dk = warpgroup_mma(sm_s, k_s,
                                   dk_s.load(A_TK) + tdw * gl.expand_dims(gl.convert_layout(beta_r, RK) * gl.exp(gam_k), 1))
                dk_s.store(dk)

            gl.thread_barrier()
            _store_tile(dk_ptr + t0 * H * K + hk * K, dk_s.load(A_TK).to(dk_ptr.dtype.element_ty), H * K, nt, zp, eos,
                        BT, K, A_TK)


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
    from linattn.ops.gated_delta_rule.gluon.host import launches
    kernel, grid, args, kwargs = local_wy_launch(q, k, v, vnew, h, dh, gcum, beta, tinv, do, dvnew, dq, dk, dv, dg,
                                                 dbeta, plan, scale)
    launches(kernel, grid, args, kwargs)
