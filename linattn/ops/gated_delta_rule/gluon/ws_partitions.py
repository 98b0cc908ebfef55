"""The partitions and layouts shared by the warp-specialised fused forward kernels (chunk_fused_wu_ws.py,
chunk_fused_gf.py; sm_90a): the state chain (_ws_state), the output (_ws_output), o's masked store and the
barrier set of the TMA ring and the published (S, vnew) buffers. FlashQLA's organisation: the state chain and the
output run on different warps of one CTA, so h never goes to global memory and the output's products are off the
chain's critical path.

Per chunk c of the sequence, with S_c the [K, BV] fp32 state at the chunk's start (gdn-math.md, chunk form):
  state partition (default, 4 warps = 1 warpgroup):
      s_pub[j]  = S_c.to(dt)                                          (published; also product 1's B operand)
      vnew      = U - W @ s_pub[j]                                     (fp32; rows past the sequence end -> 0)
      v_pub[j]  = vnew.to(dt)                                          (published)
      S_{c+1}   = exp(gam_C) S_c + K^T @ (d * v_pub[j]).to(dt),  d = exp(gam_C - gam), 0 past the end
  output partition (1 warpgroup), one chunk behind at most NPUB:
      qk  = Q @ K^T;  att = where(lower_incl, qk * exp(where(lower_incl, gam_i - gam_j, 0)), 0).to(dt)
      o   = ((Q @ s_pub[j]) * exp(gam) + att @ v_pub[j]) * scale      -> o rows < eos (masked store, o's dtype)
gcum ([T, HV] fp32, 4 bytes per row and head: below TMA's 16-byte inner box) is read by the two consumer partitions
with plain loads, the state partition one chunk ahead.

Barriers (mbarrier parity of the k-th completion of a barrier is k & 1; a fresh barrier counts as if the phase of
parity 1 had completed, so a producer's first wait on an "empty" barrier passes):
  ready[s]     count 1   producer: expect(full boxes) + the TMA loads; completes when the bytes land.
                         the consumer partitions wait parity (c // STAGES) & 1.
  empty[s]     count     one arrival per consumer partition (the state partition after product 2, fenced: it reads
                         the ring by generic loads too; the output after its q k^T and q S wgmmas are waited).
                         producer waits parity ((c // STAGES) & 1) ^ 1 before refilling slot s with chunk c.
  s_full[j]    count 1   state partition arrives once s_pub[j] holds S_c (every thread fenced, thread barrier).
                         output partition waits parity (c // NPUB) & 1.
  v_full[j]    count 1   state partition arrives once v_pub[j] holds vnew_c (fenced, thread barrier).
                         output partition waits parity (c // NPUB) & 1.
  pub_empty[j] count 1   output partition arrives after its last wgmma reading s_pub[j] and v_pub[j] is waited.
                         state partition waits parity ((c // NPUB) & 1) ^ 1 before writing s_pub[j] for chunk c.
No partition can fall two phases behind on any barrier: the ring's ready[s] cannot complete use k+1 before
empty[s] completed use k, which needs every consumer's arrival for use k (same for the published buffers).
Unused pointer / descriptor arguments are passed as None (constexpr).
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, warpgroup_mma,
                                          warpgroup_mma_wait)

BT = 64
NPUB = 2                 # published (S, vnew) buffer pairs
PRODUCER_REGS = 24       # setmaxnreg of the 1-warp TMA producer (the hardware minimum)
OUTPUT_REGS = 160        # setmaxnreg of the output warpgroup

if GLUON_OK:

    @gluon.constexpr_function
    def ws_acc_layout(N):
        """wgmma accumulator of one warpgroup for an [M, N] tile (M a multiple of 64)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])

    @gluon.constexpr_function
    def ws_rows_layout(ncols, elem_bits, num_warps):
        """Blocked layout of a row-major [rows, ncols] tile: 16-byte vectors along the contiguous dim."""
        vec = min(128 // elem_bits, ncols)
        tpw_n = min(32, ncols // vec)
        return gl.BlockedLayout([1, vec], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def ws_smem_layout(ncols, elem_bits):
        """NVMMASharedLayout.get_default_for([rows >= 8, ncols], 16-bit dtype): the largest swizzle dividing a row."""
        row_bytes = ncols * elem_bits // 8
        sw = 128 if row_bytes % 128 == 0 else (64 if row_bytes % 64 == 0 else (32 if row_bytes % 32 == 0 else 0))
        return gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=elem_bits, rank=2)

    # ------------------------------------------------------------------ default partition: the state chain
    # The state chain of chunk_fused_wu_ws.py: W comes from that kernel's wu partition in w_s[c % NWU] (its wk_s),
    # published behind wu_full[c % NWU] and released through wu_empty[c % NWU] after product 1; U in the ring's u
    # tile (its v tile, rewritten in place). h0 / the final state are loaded and stored straight in the accumulator
    # layout (uncoalesced, once per CTA): no conversion scratch, for which that kernel has no shared memory left.
    @gluon.jit
    def _ws_state(k_s, w_s, u_s, ready, empty, wu_full, wu_empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty,
                  gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, n, hv, vb,
                  HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                  STAGES: gl.constexpr, NWU: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr,
                  STORE_HT: gl.constexpr, CHANNEL: gl.constexpr, u_empty=None, USTAGES: gl.constexpr = 1,
                  U_RING: gl.constexpr = False):
        """The decay kind (CHANNEL False, GDN): gcum [T, HV], k_s the keys, S_{c+1} = exp(gam_C) S_c + K^T (d * vnew)
        through vn_s. CHANNEL True (KDA, kda/gluon/fused_forward.py): gcum [T, HV, K], k_s the decayed keys
        K exp(gam_C - gam) (stage 2a's), S_{c+1} = diag(exp(gam_C)) S_c + Kdec^T vnew with vnew straight from v_pub
        (vn_s unused). U_RING: u_s is a ring of its own (USTAGES slots, released through u_empty once U is read,
        which wu_full already orders after its TMA), ready / empty then k_s's alone."""
        dt: gl.constexpr = w_s.dtype
        ACC: gl.constexpr = ws_acc_layout(BV)                 # vnew [BT, BV] and S [K, BV]
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)

        sk = gl.arange(0, K, layout=gl.SliceLayout(1, ACC))
        sv = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, ACC))
        state_off = (n.to(gl.int64) * HV + hv) * K * V + gl.expand_dims(sk, 1) * V + gl.expand_dims(sv, 0)
        if USE_H0:
            s = gl.convert_layout(gl.load(h0_ptr + state_off), ACC)
        else:
            s = gl.zeros([K, BV], gl.float32, ACC)

        r_t = gl.arange(0, BT, layout=ROWS)
        if CHANNEL:
            # gam_C per key channel: gcum's row min(eos, t0 + BT) - 1
            gam_last = gl.load(gcum_ptr + ((bos + gl.minimum(eos - bos, BT) - 1) * HV + hv) * K + sk,
                               mask=nchunks > 0, other=0.)
        else:
            gam = gl.load(gcum_ptr + (bos + r_t) * HV + hv, mask=(bos + r_t) < eos, other=0.)
            gam_last = gl.load(gcum_ptr + (bos + gl.minimum(eos - bos, BT) - 1) * HV + hv, mask=nchunks > 0,
                               other=0.)
        for c in range(nchunks):
            t0 = bos + c * BT
            # gates of chunk c + 1 (masked off past the end), consumed next iteration
            t1 = t0 + BT
            if CHANNEL:
                gam_last_n = gl.load(gcum_ptr + ((t1 + gl.minimum(eos - t1, BT) - 1) * HV + hv) * K + sk,
                                     mask=t1 < eos, other=0.)
            else:
                gam_n = gl.load(gcum_ptr + (t1 + r_t) * HV + hv, mask=(t1 + r_t) < eos, other=0.)
                gam_last_n = gl.load(gcum_ptr + (t1 + gl.minimum(eos - t1, BT) - 1) * HV + hv, mask=t1 < eos,
                                     other=0.)

            # publish S_c in s_pub[j] once the output partition is done with chunk c - NPUB
            j = c % NPUB
            mbarrier.wait(pub_empty.index(j), ((c // NPUB) & 1) ^ 1)
            s_pub.index(j).store(s.to(dt))
            fence_async_shared()                               # generic store -> wgmma (async proxy)
            gl.thread_barrier()
            mbarrier.arrive(s_full.index(j))

            st = c % STAGES
            jw = c % NWU                                       # W's buffer
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)  # k (product 2)
            mbarrier.wait(wu_full.index(jw), (c // NWU) & 1)   # W (w_s[jw]) and U (the u tile) of chunk c
            rows = t0 + r_t
            valid = gl.expand_dims(rows < eos, 1)
            su = c % USTAGES if U_RING else st                 # U's slot
            if U_RING:
                u = u_s.index(su).load(ACC)                    # issued before product 1: its latency under it
            # product 1: vnew = U - W S_c  (B = the published 16-bit S)
            ws = warpgroup_mma(w_s.index(jw), s_pub.index(j), gl.zeros([BT, BV], gl.float32, ACC), use_acc=False)
            if not U_RING:
                u = u_s.index(su).load(ACC)
            vnew = gl.where(valid, u.to(gl.float32) - ws, 0.).to(dt)
            v_pub.index(j).store(vnew)
            if CHANNEL:
                fence_async_shared()                           # v_pub: the output's wgmma and product 2; u's reads
                gl.thread_barrier()                            # before the TMA refill of its own ring (U_RING)
                mbarrier.arrive(v_full.index(j))
                mbarrier.arrive(wu_empty.index(jw))            # w_s[jw] read by product 1 (waited): free
                if U_RING:
                    mbarrier.arrive(u_empty.index(su))
                # product 2: S_{c+1} = diag(exp(gam_C)) S_c + Kdec^T vnew
                s = warpgroup_mma(k_s.index(st).permute((1, 0)), v_pub.index(j),
                                  s * gl.expand_dims(gl.exp(gam_last), 1))
            else:
                d = gl.exp(gam_last - gam)
                vs = gl.where(valid, vnew.to(gl.float32) * gl.expand_dims(d, 1), 0.).to(dt)
                vn_s.store(vs)
                fence_async_shared()                           # v_pub (output's wgmma), vn_s (product 2)
                gl.thread_barrier()
                mbarrier.arrive(v_full.index(j))
                mbarrier.arrive(wu_empty.index(jw))            # w_s[jw] read by product 1 (waited): free
                # product 2: S_{c+1} = exp(gam_C) S_c + K^T (d * vnew)
                s = warpgroup_mma(k_s.index(st).permute((1, 0)), vn_s, s * gl.exp(gam_last))
                gam = gam_n
            # this partition's share of ring slot st is done (u read by generic loads: fence before the TMA refill)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st))
            gam_last = gam_last_n

        if STORE_HT:
            gl.store(ht_ptr + state_off, s)

    # ------------------------------------------------------------------ worker 0: the output (1 warpgroup)
    @gluon.jit
    def _ws_output_index(vb, BT: gl.constexpr, BV: gl.constexpr, ACC_A: gl.constexpr, LO: gl.constexpr):
        """The output partition's loop-invariant indices: the causal mask of q k^T (in ACC_A) and o's rows / columns
        in the store layout LO (also chunk_fused_wu_ws._output_pipelined's)."""
        r_a = gl.arange(0, BT, layout=gl.SliceLayout(1, ACC_A))
        c_a = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC_A))
        lower = gl.expand_dims(r_a, 1) >= gl.expand_dims(c_a, 0)
        r_o = gl.arange(0, BT, layout=gl.SliceLayout(1, LO))
        c_o = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LO))
        return r_a, lower, r_o, c_o

    @gluon.jit
    def _ws_store_o(o, o_ptr, scale, t0, eos, hv, r_o, c_o, HV: gl.constexpr, V: gl.constexpr, LO: gl.constexpr,
                    o_lo=0, WARM: gl.constexpr = False):
        """o * scale of one chunk, rows < eos, in o's dtype through the 16-byte row layout LO. WARM (the segment
        warm-up in chunk_fused_wu_ws): rows < o_lo are warm-up rows, not stored."""
        o = gl.convert_layout((o * scale).to(o_ptr.dtype.element_ty), LO)
        rows = t0 + r_o
        o_off = gl.expand_dims(rows, 1) * (HV * V) + hv * V + gl.expand_dims(c_o, 0)
        if WARM:
            gl.store(o_ptr + o_off, o, mask=gl.expand_dims((rows < eos) & (rows >= o_lo), 1))
        else:
            gl.store(o_ptr + o_off, o, mask=gl.expand_dims(rows < eos, 1))

    @gluon.jit
    def _ws_output(q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                   nchunks, bos, eos, hv, vb,
                   HV: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                   STAGES: gl.constexpr, NPUB: gl.constexpr, o_lo=0, WARM: gl.constexpr = False):
        dt: gl.constexpr = q_s.dtype
        ACC_A: gl.constexpr = ws_acc_layout(BT)               # q k^T [BT, BT]
        ACC_O: gl.constexpr = ws_acc_layout(BV)               # o [BT, BV]
        OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_O, k_width=2)
        LO: gl.constexpr = ws_rows_layout(BV, dt.primitive_bitwidth, 4)
        r_a, lower, r_o, c_o = _ws_output_index(vb, BT, BV, ACC_A, LO)
        for c in range(nchunks):
            t0 = bos + c * BT
            st = c % STAGES
            j = c % NPUB
            gam = gl.load(gcum_ptr + (t0 + r_a) * HV + hv, mask=(t0 + r_a) < eos, other=0.)
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)
            qk = warpgroup_mma(q_s.index(st), k_s.index(st).permute((1, 0)), gl.zeros([BT, BT], gl.float32, ACC_A),
                               use_acc=False, is_async=True)
            mbarrier.wait(s_full.index(j), (c // NPUB) & 1)
            qs = warpgroup_mma(q_s.index(st), s_pub.index(j), gl.zeros([BT, BV], gl.float32, ACC_O),
                               use_acc=False, is_async=True)
            qk, qs = warpgroup_mma_wait(0, deps=[qk, qs])
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st))                   # q, k read by wgmma only (async -> async: no fence)
            # the intra-chunk attention, masked before exp (as chunk_output.chunk_attention_from_qk)
            gmat = gl.exp(gl.where(lower, gl.expand_dims(gam, 1) - gl.expand_dims(gl.convert_layout(
                gam, gl.SliceLayout(0, ACC_A)), 0), 0.))
            att = gl.convert_layout(gl.where(lower, qk * gmat, 0.).to(dt), OPA)
            o = qs * gl.expand_dims(gl.exp(gl.convert_layout(gam, gl.SliceLayout(1, ACC_O))), 1)
            mbarrier.wait(v_full.index(j), (c // NPUB) & 1)
            o = warpgroup_mma(att, v_pub.index(j), o)
            gl.thread_barrier()
            mbarrier.arrive(pub_empty.index(j))                # s_pub[j], v_pub[j] read by wgmma only
            _ws_store_o(o, o_ptr, scale, t0, eos, hv, r_o, c_o, HV, V, LO, o_lo, WARM)

    # ------------------------------------------------------------------ barriers (also chunk_fused_gf.py's)
    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """A TMA ring's ready[STAGES] (count 1 + tx) and empty[STAGES] (count CONSUMERS), allocated and initialised;
        the caller fences the inits for the async proxy once all its barriers are initialised."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        return ready, empty

    @gluon.jit
    def ring_barriers_invalidate(ready, empty, STAGES: gl.constexpr):
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

    @gluon.jit
    def _ws_barriers(STAGES: gl.constexpr, NPUB: gl.constexpr, CONSUMERS: gl.constexpr, PUBLISHERS: gl.constexpr = 1):
        """The ring's ready[STAGES] (count 1 + tx) and empty[STAGES] (count CONSUMERS) and the published pairs'
        s_full, v_full (count PUBLISHERS: the partitions that publish a share of each), pub_empty[NPUB] (count 1),
        allocated and initialised, the inits fenced for the async proxy."""
        ready, empty = ring_barriers(STAGES, CONSUMERS)
        s_full = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        pub_empty = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NPUB):
            mbarrier.init(s_full.index(i), count=PUBLISHERS)
            mbarrier.init(v_full.index(i), count=PUBLISHERS)
            mbarrier.init(pub_empty.index(i), count=1)
        fence_async_shared()                                     # barrier inits visible to the async proxy
        return ready, empty, s_full, v_full, pub_empty

    @gluon.jit
    def _ws_barriers_invalidate(ready, empty, s_full, v_full, pub_empty, STAGES: gl.constexpr, NPUB: gl.constexpr):
        ring_barriers_invalidate(ready, empty, STAGES)
        for i in gl.static_range(NPUB):
            mbarrier.invalidate(s_full.index(i))
            mbarrier.invalidate(v_full.index(i))
            mbarrier.invalidate(pub_empty.index(i))

