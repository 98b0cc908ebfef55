"""Stage 3 of the forward in Gluon: the state pass with the chunk tiles of w, k and u brought in by TMA into a
STAGES-deep mbarrier ring, prefetching STAGES-1 chunks ahead of the one being computed; products on warpgroup_mma.

Math per chunk (gdn-math.md, chunk form): Vnew = U - W S; S <- exp(gam_C) S + K^T (d * Vnew). One program per
(V block, sequence * value head). The decay of product 2 is applied to Vnew's rows instead of K's rows, which is
the same product:
    (diag(d) K)^T Vnew = K^T (diag(d) Vnew),   d = exp(gam_C - gam), 0 on rows past the sequence end
so K^T is read straight from its TMA buffer as a transposed shared-memory view, never rewritten. Both operands of
each product are in shared memory: W (ring) @ S (s_smem, 16-bit, MN-major B); K^T (ring, permuted view, MN-major A)
@ (d * Vnew) (vn_smem, 16-bit); the fp32 state is the wgmma accumulator in registers; 4 warps (one warpgroup).

Varlen: the descriptors cover the whole packed [T_tot, heads * dim] views and a chunk's box starts at its first
token, so the box's rows past the sequence end hold the NEXT sequence's tokens (TMA zero-fills only rows past
T_tot). Those rows are neutralised in registers: their Vnew rows are not stored and get d = 0 (selected with
gl.where, so even non-finite values there cannot reach the state).

Shared-memory buffers, who owns them and when they are reused:
  ring slot i (w_smem[i], k_smem[i], u_smem[i], ready[i]), for chunks c = i, i + STAGES, ...:
    prologue   chunks 0 .. STAGES-2 are issued into slots 0 .. STAGES-2 (predicated off past the last chunk).
    steady     iteration c first refills slot (c - 1) % STAGES with chunk c + STAGES - 1: that slot's last
               readers (local loads / wgmma of iteration c - 1) have all finished, because every warp passed the
               thread barrier before the refill and wgmma is waited synchronously; a proxy fence orders those
               generic-proxy reads before the async-proxy TMA write. Then it waits on ready[c % STAGES] with parity
               (c // STAGES) & 1 (the k-th use of a slot completes its phase k), and reads.
    drain      refills for chunks >= nchunks are predicated off (no expect, no copy), so when the loop ends no
               TMA load is in flight and nobody waits on a phase that never completes; barriers are invalidated.
    expect     counts the full boxes (TMA counts zero-filled bytes too).
  s_smem [K, BV] (operand dtype): the chunk-start state S. Written by the generic proxy at the start of each
    iteration, then fenced; read by the TMA store of h[chunk] (async) and by product 1 (wgmma). Before it is
    rewritten, tma.store_wait(0) (issuing thread) + the thread barrier make sure the previous iteration's h store
    has finished reading it; product 1 of the previous iteration has completed (wgmma waited).
  vn_smem [BT, BV]: d * Vnew in the operand dtype, B of product 2. Written (generic) after product 1, fenced, read
    by wgmma, which is waited before the next iteration rewrites it.
The Vnew rows go out with plain masked stores (a chunk may end inside the box; the rows past its end belong to
the next sequence and must not be written).
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, tma_load, tma_store,
                                          tma_store_wait, warpgroup_mma)

if GLUON_OK:

    @gluon.constexpr_function
    def state_acc_layout(BV, num_warps):
        """wgmma accumulator layout shared by Vnew [BT, BV] and the state [K, BV]."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                         instr_shape=[16, BV // (num_warps // 4), 16])

    @gluon.constexpr_function
    def rows_layout(ncols, elem_bits, num_warps):
        """Blocked layout of a row-major [rows, ncols] tile: 16-byte vectors along the contiguous dim."""
        vec = min(128 // elem_bits, ncols)
        tpw_n = min(32, ncols // vec)
        return gl.BlockedLayout([1, vec], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])

    @gluon.jit
    def _sequence_span(nh, cu_ptr, chunk_off_ptr, H: gl.constexpr, HV: gl.constexpr, BT: gl.constexpr):
        """Sequence n and value head hv of program row nh = n * HV + hv, its key head, its token span [bos, eos),
        its first chunk slot and its chunk count (the chunk plan of triton/chunk_indices.py). Shared by the Gluon
        state passes (forward, backward) and the fused forward."""
        n = nh // HV
        hv = nh % HV
        hk = hv // (HV // H)
        bos = gl.load(cu_ptr + n)
        eos = gl.load(cu_ptr + n + 1)
        slot0 = gl.load(chunk_off_ptr + n)
        nchunks = gl.cdiv(gl.maximum(eos - bos, 0), BT).to(gl.int32)
        return n, hv, hk, bos, eos, slot0, nchunks

    @gluon.jit
    def _issue_chunk(w_desc, k_desc, u_desc, w_smem, k_smem, u_smem, ready, c, nchunks, bos, hv, hk, vb,
                     HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                     STAGES: gl.constexpr):
        """TMA loads of chunk c's w, k and u boxes into ring slot c % STAGES (nothing when c >= nchunks)."""
        i = c % STAGES
        p = c < nchunks
        row = (bos + c * BT).to(gl.int32)
        nbytes: gl.constexpr = w_desc.block_type.nbytes + k_desc.block_type.nbytes + u_desc.block_type.nbytes
        mbarrier.expect(ready.index(i), nbytes, pred=p)
        tma_load(w_desc, [row, hv * K], ready.index(i), w_smem.index(i), pred=p)
        tma_load(k_desc, [row, hk * K], ready.index(i), k_smem.index(i), pred=p)
        tma_load(u_desc, [row, hv * V + vb * BV], ready.index(i), u_smem.index(i), pred=p)

    @gluon.jit
    def _chunk_products(w_smem, k_smem, u_smem, s_smem, vn_smem, ready, it, s, gam, gam_last, t0, eos, r_t, c_v,
                        hv, vnew_ptr, HV: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                        STAGES: gl.constexpr, ACC: gl.constexpr, DECAY: gl.constexpr = "scalar"):
        """One chunk of the state pass on ring slot it % STAGES, S already in s_smem: waits for the slot's loads,
        then product 1 (Vnew = U - W S, stored on the valid rows) and product 2 (S = exp(gam_C) S + K^T (d * Vnew));
        returns the next S. DECAY "channel" (KDA): the k tile holds the decayed keys K exp(gam_C - gam) and gam_last
        is gam_C per key channel ([K], the state's rows): S = diag(exp(gam_C)) S + Kdec^T Vnew (gam unused)."""
        dt: gl.constexpr = s_smem.dtype
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        rows = t0 + r_t
        valid = rows < eos
        # product 1: Vnew = U - W S
        ws = warpgroup_mma(w_smem.index(slot), s_smem, gl.zeros([BT, BV], gl.float32, ACC), use_acc=False)
        vnew = u_smem.index(slot).load(ACC).to(gl.float32) - ws
        uv_off = gl.expand_dims(rows, 1) * (HV * V) + hv * V + gl.expand_dims(c_v, 0)
        gl.store(vnew_ptr + uv_off, vnew.to(dt), mask=gl.expand_dims(valid, 1))
        if DECAY == "channel":
            # product 2: S = diag(exp(gam_C)) S + Kdec^T Vnew, Vnew's rows past the sequence end 0
            vn_smem.store(gl.where(gl.expand_dims(valid, 1), vnew, 0.).to(dt))
            fence_async_shared()
            s = warpgroup_mma(k_smem.index(slot).permute((1, 0)), vn_smem, s * gl.expand_dims(gl.exp(gam_last), 1))
        else:
            # product 2: S = exp(gam_C) S + K^T (d * Vnew), d = exp(gam_C - gam) on valid rows, else 0
            d = gl.exp(gam_last - gam)
            vs = gl.where(gl.expand_dims(valid, 1), vnew.to(dt).to(gl.float32) * gl.expand_dims(d, 1), 0.).to(dt)
            vn_smem.store(vs)
            fence_async_shared()
            s = warpgroup_mma(k_smem.index(slot).permute((1, 0)), vn_smem, s * gl.exp(gam_last))
        return s

    @gluon.jit
    def chunk_state_fwd_tma_kernel(
        k_desc, w_desc, u_desc,                # TMA over k [T_tot, H*K], w [T_tot, HV*K], u [T_tot, HV*V]
        gcum_ptr,                              # gcum [T_tot, HV] fp32 ([T_tot, HV, K] with DECAY "channel")
        h_desc, vnew_ptr,                      # TMA over h [slots*HV*K, V]; vnew [T_tot, HV, V]
        h0_ptr, ht_ptr,                        # initial / final state [N, HV, K, V] fp32
        cu_ptr, chunk_off_ptr,                 # the chunk plan (triton/chunk_indices.py)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
        BT: gl.constexpr, BV: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        STAGES: gl.constexpr, DECAY: gl.constexpr = "scalar",
    ):
        """Grid (V / BV, N * HV). DECAY "scalar" (GDN): gcum [T_tot, HV], k the keys. DECAY "channel" (KDA's recompute,
        kda/gluon/state.py): k the decayed keys K exp(gam_C - gam) per value head (H == HV), gcum [T_tot, HV, K], of
        which each chunk's last row is read; the same h and vnew as the Triton pass with decay "channel"."""
        NW: gl.constexpr = gl.num_warps()
        dt: gl.constexpr = w_desc.dtype
        ACC: gl.constexpr = state_acc_layout(BV, NW)
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)
        LS: gl.constexpr = rows_layout(BV, 32, NW)             # fp32 states [K, BV] in global memory

        vb = gl.program_id(0)
        nh = gl.program_id(1)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)

        w_smem = gl.allocate_shared_memory(dt, [STAGES, BT, K], w_desc.layout)
        k_smem = gl.allocate_shared_memory(dt, [STAGES, BT, K], k_desc.layout)
        u_smem = gl.allocate_shared_memory(dt, [STAGES, BT, BV], u_desc.layout)
        s_smem = gl.allocate_shared_memory(dt, [K, BV], h_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        fence_async_shared()                                     # barrier inits visible to the async proxy
        for j in gl.static_range(STAGES - 1):                    # prologue: chunks 0 .. STAGES-2 in flight
            _issue_chunk(w_desc, k_desc, u_desc, w_smem, k_smem, u_smem, ready, j, nchunks, bos, hv, hk, vb,
                         HV, K, V, BT, BV, STAGES)

        sk = gl.arange(0, K, layout=gl.SliceLayout(1, LS))
        sv = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LS))
        state_off = (n.to(gl.int64) * HV + hv) * K * V + gl.expand_dims(sk, 1) * V + gl.expand_dims(sv, 0)
        if USE_H0:
            s = gl.convert_layout(gl.load(h0_ptr + state_off), ACC)
        else:
            s = gl.zeros([K, BV], gl.float32, ACC)

        r_t = gl.arange(0, BT, layout=ROWS)
        c_v = vb * BV + gl.arange(0, BV, layout=COLS)
        vn_smem = gl.allocate_shared_memory(dt, [BT, BV], u_desc.layout)

        # gates of chunk 0, then each iteration loads the next chunk's while this one computes
        if DECAY == "channel":
            g_k = gl.arange(0, K, layout=ROWS)                # the state's rows: gam_C per key channel
            gam_last = gl.load(gcum_ptr + ((bos + gl.minimum(eos - bos, BT) - 1) * HV + hv) * K + g_k,
                               mask=nchunks > 0, other=0.)
            gam = gam_last
        else:
            gam = gl.load(gcum_ptr + (bos + r_t) * HV + hv, mask=(bos + r_t) < eos, other=0.)
            gam_last = gl.load(gcum_ptr + (bos + gl.minimum(eos - bos, BT) - 1) * HV + hv, mask=nchunks > 0,
                               other=0.)

        for c in range(0, nchunks):
            t0 = bos + c * BT
            # refill the slot read in iteration c - 1 with chunk c + STAGES - 1 (see the module docstring)
            fence_async_shared()
            gl.thread_barrier()
            _issue_chunk(w_desc, k_desc, u_desc, w_smem, k_smem, u_smem, ready, c + STAGES - 1, nchunks, bos,
                         hv, hk, vb, HV, K, V, BT, BV, STAGES)
            # gates of chunk c + 1 (masked off past the end), consumed next iteration
            t1 = t0 + BT
            if DECAY == "channel":
                gam_last_n = gl.load(gcum_ptr + ((t1 + gl.minimum(eos - t1, BT) - 1) * HV + hv) * K + g_k,
                                     mask=t1 < eos, other=0.)
                gam_n = gam_last_n
            else:
                gam_n = gl.load(gcum_ptr + (t1 + r_t) * HV + hv, mask=(t1 + r_t) < eos, other=0.)
                gam_last_n = gl.load(gcum_ptr + (t1 + gl.minimum(eos - t1, BT) - 1) * HV + hv, mask=t1 < eos,
                                     other=0.)

            # h[chunk] = S through s_smem and a TMA store; s_smem is also product 1's B operand
            tma_store_wait(0)
            gl.thread_barrier()
            s_smem.store(s.to(dt))
            fence_async_shared()
            tma_store(h_desc, [((slot0 + c) * HV + hv).to(gl.int32) * K, vb * BV], s_smem)

            s = _chunk_products(w_smem, k_smem, u_smem, s_smem, vn_smem, ready, c, s, gam, gam_last, t0, eos, r_t,
                                c_v, hv, vnew_ptr, HV, V, BT, BV, STAGES, ACC, DECAY)
            gam = gam_n
            gam_last = gam_last_n

        tma_store_wait(0)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
        if STORE_HT:
            gl.store(ht_ptr + state_off, gl.convert_layout(s, LS))
