"""Stages 3 + 4 of the GDN forward fused in one warp-specialised Gluon kernel (sm_90a): the state chain and the output
run on different warps of one CTA, so h never goes to global memory and the output's products are off the chain's
critical path (FlashQLA's organisation, benchmarks/FLASHQLA_NOTES.md section 3; design: benchmarks/GLUON_FUSED_WS.md).
The "gluon" backend's forward takes it by default since round 14 where `fused_ws_supported` says so
(LINATTN_GDN_GLUON_FUSED_WS=0 turns it off; H200: stages 3+4 1.39x at B1 T65536, benchmarks/GLUON_FUSED_WS.md).

One CTA per (V block, sequence * value head), as chunk_state_tma.py. Per chunk c of the sequence, with S_c the
[K, BV] fp32 state at the chunk's start (gdn-math.md, chunk form; the same rounding points as chunk_state_tma.py
"wgmma" + triton/chunk_output.py OUTPUT_V2):
  state partition (default, 4 warps = 1 warpgroup):
      s_pub[j]  = S_c.to(dt)                                          (published; also product 1's B operand)
      vnew      = U - W @ s_pub[j]                                     (fp32; rows past the sequence end -> 0)
      v_pub[j]  = vnew.to(dt)                                          (published)
      S_{c+1}   = exp(gam_C) S_c + K^T @ (d * v_pub[j]).to(dt),  d = exp(gam_C - gam), 0 past the end
  output partition (worker 0, 4 warps = 1 warpgroup), one chunk behind at most NPUB:
      qk  = Q @ K^T;  att = where(lower_incl, qk * exp(where(lower_incl, gam_i - gam_j, 0)), 0).to(dt)
      o   = ((Q @ s_pub[j]) * exp(gam) + att @ v_pub[j]) * scale      -> o rows < eos (masked store, o's dtype)
  producer (worker 1, 1 warp): TMA of q, k, w (boxes [BT, K]) and u ([BT, BV]) of chunk c into ring slot c % STAGES.
gcum ([T, HV] fp32, 4 bytes per row and head: below TMA's 16-byte inner box) is read by the two consumer partitions
with plain loads, the state partition one chunk ahead (as chunk_state_tma.py).

Barriers (mbarrier parity of the k-th completion of a barrier is k & 1; a fresh barrier counts as if the phase of
parity 1 had completed, so a producer's first wait on an "empty" barrier passes):
  ready[s]     count 1   producer: expect(full boxes) + 4 TMA loads; completes when the bytes land.
                         state and output partitions both wait parity (c // STAGES) & 1.
  empty[s]     count 2   state partition arrives after product 2 of chunk c (w, k by wgmma, u by generic loads, so
                         it fences first); output partition arrives after its q k^T and q S wgmmas are waited.
                         producer waits parity ((c // STAGES) & 1) ^ 1 before refilling slot s with chunk c.
  s_full[j]    count 1   state partition arrives once s_pub[j] holds S_c (every thread fenced, thread barrier).
                         output partition waits parity (c // NPUB) & 1.
  v_full[j]    count 1   state partition arrives once v_pub[j] holds vnew_c (fenced, thread barrier).
                         output partition waits parity (c // NPUB) & 1.
  pub_empty[j] count 1   output partition arrives after its last wgmma reading s_pub[j] and v_pub[j] is waited.
                         state partition waits parity ((c // NPUB) & 1) ^ 1 before writing s_pub[j] for chunk c.
No partition can fall two phases behind on any barrier: the ring's ready[s] cannot complete use k+1 before
empty[s] completed use k, which needs the output partition's arrival for use k (same for the published buffers).
Drain: the producer issues exactly nchunks chunks and both consumers wait on all of them, so no TMA load is in flight
when warp_specialize returns; the optional h stores are waited by the state partition; barriers are then invalidated.

Optional outputs (flags; the backward's recompute path never needs them, benchmarks/GLUON_FUSED_WS.md):
  STORE_H     h[chunk] = S_c by a TMA store from s_pub[j] (h_desc over [slots*HV*K, V]); before s_pub[j] is
              rewritten the state partition waits for all but NPUB-1 of its outstanding stores.
  STORE_VNEW  vnew rows < eos by masked stores from the state partition.
  USE_H0 / STORE_HT  initial / final state [N, HV, K, V] fp32.
Unused pointer / descriptor arguments are passed as None (constexpr).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, tma_load, tma_store,
                                          tma_store_wait, warpgroup_mma, warpgroup_mma_wait)

BT = 64
NPUB = 2                 # published (S, vnew) buffer pairs
PRODUCER_REGS = 24       # setmaxnreg of the 1-warp TMA producer (the hardware minimum)
OUTPUT_REGS = 160        # setmaxnreg of the output warpgroup (AOT: see GLUON_FUSED_WS.md)

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import _sequence_span

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

    # ------------------------------------------------------------------ worker 1: the TMA producer (1 warp)
    @gluon.jit
    def _ws_producer(q_desc, k_desc, w_desc, u_desc, q_s, k_s, w_s, u_s, ready, empty, nchunks, bos, hv, hk, vb,
                     K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr):
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + k_desc.block_type.nbytes + w_desc.block_type.nbytes
                                + u_desc.block_type.nbytes)
        for c in range(nchunks):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)     # both consumers released use c - STAGES
            row = (bos + c * BT).to(gl.int32)
            mbarrier.expect(ready.index(s), nbytes)                   # full boxes: TMA counts zero-filled bytes
            tma_load(q_desc, [row, hk * K], ready.index(s), q_s.index(s))
            tma_load(k_desc, [row, hk * K], ready.index(s), k_s.index(s))
            tma_load(w_desc, [row, hv * K], ready.index(s), w_s.index(s))
            tma_load(u_desc, [row, hv * V + vb * BV], ready.index(s), u_s.index(s))

    # ------------------------------------------------------------------ default partition: the state chain
    # Shared with chunk_fused_wu_ws.py, whose default partition is this function with two constexpr flags:
    #   WU_FED         W and U come from that kernel's wu partition: W in w_s[c % NWU] (its wk_s), published behind
    #                  wu_full[c % NWU] and released through wu_empty[c % NWU] after product 1; U in the ring's u tile
    #                  (its v tile, rewritten in place). Off (here): W and U are TMA tiles of ring slot c % STAGES,
    #                  and wu_full, wu_empty, NWU are None.
    #   STATES_IN_ACC  h0 / the final state are loaded and stored straight in the accumulator layout (uncoalesced,
    #                  once per CTA) instead of through a coalesced blocked layout and its conversion scratch (16-32 KB
    #                  of shared memory the fused-wu kernel has no room for).
    #   STATES_GATED   (the segment launch, chunk_fused_wu_ws with seg_ptr) h0 is loaded only where h0_on != 0 (else
    #                  the chain starts from 0) and the final state stored only where ht_on != 0; n is then the
    #                  whole sequence's index (the h0 / final row), not the segment's.
    @gluon.jit
    def _ws_state(k_s, w_s, u_s, ready, empty, wu_full, wu_empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty,
                  gcum_ptr, h_desc, vnew_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, slot0, n, hv, vb,
                  HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                  STAGES: gl.constexpr, NWU: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr,
                  STORE_HT: gl.constexpr, STORE_H: gl.constexpr, STORE_VNEW: gl.constexpr, WU_FED: gl.constexpr,
                  STATES_IN_ACC: gl.constexpr, STATES_GATED: gl.constexpr = False, h0_on=1, ht_on=1):
        dt: gl.constexpr = w_s.dtype
        ACC: gl.constexpr = ws_acc_layout(BV)                 # vnew [BT, BV] and S [K, BV]
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)
        # fp32 states [K, BV] in global memory (with STATES_IN_ACC the conversions below are no-ops)
        LS: gl.constexpr = ACC if STATES_IN_ACC else ws_rows_layout(BV, 32, 4)

        sk = gl.arange(0, K, layout=gl.SliceLayout(1, LS))
        sv = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LS))
        state_off = (n.to(gl.int64) * HV + hv) * K * V + gl.expand_dims(sk, 1) * V + gl.expand_dims(sv, 0)
        if USE_H0:
            if STATES_GATED:
                s = gl.zeros([K, BV], gl.float32, ACC)
                if h0_on != 0:
                    s = gl.convert_layout(gl.load(h0_ptr + state_off), ACC)
            else:
                s = gl.convert_layout(gl.load(h0_ptr + state_off), ACC)
        else:
            s = gl.zeros([K, BV], gl.float32, ACC)

        r_t = gl.arange(0, BT, layout=ROWS)
        c_v = vb * BV + gl.arange(0, BV, layout=COLS)
        gam = gl.load(gcum_ptr + (bos + r_t) * HV + hv, mask=(bos + r_t) < eos, other=0.)
        gam_last = gl.load(gcum_ptr + (bos + gl.minimum(eos - bos, BT) - 1) * HV + hv, mask=nchunks > 0, other=0.)
        for c in range(nchunks):
            t0 = bos + c * BT
            # gates of chunk c + 1 (masked off past the end), consumed next iteration
            t1 = t0 + BT
            gam_n = gl.load(gcum_ptr + (t1 + r_t) * HV + hv, mask=(t1 + r_t) < eos, other=0.)
            gam_last_n = gl.load(gcum_ptr + (t1 + gl.minimum(eos - t1, BT) - 1) * HV + hv, mask=t1 < eos, other=0.)

            # publish S_c in s_pub[j] once the output partition is done with chunk c - NPUB
            j = c % NPUB
            mbarrier.wait(pub_empty.index(j), ((c // NPUB) & 1) ^ 1)
            if STORE_H:
                tma_store_wait(NPUB - 1)                       # the h store of chunk c - NPUB (from s_pub[j]) is done
                gl.thread_barrier()
            s_pub.index(j).store(s.to(dt))
            fence_async_shared()                               # generic store -> wgmma / TMA store (async proxy)
            gl.thread_barrier()
            mbarrier.arrive(s_full.index(j))
            if STORE_H:
                tma_store(h_desc, [((slot0 + c) * HV + hv).to(gl.int32) * K, vb * BV], s_pub.index(j))

            st = c % STAGES
            jw = c % NWU if WU_FED else st                     # W's buffer: w_s[c % NWU] (WU_FED) or the ring slot
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)  # k (product 2), and W, U unless WU_FED
            if WU_FED:
                mbarrier.wait(wu_full.index(jw), (c // NWU) & 1)   # W (w_s[jw]) and U (the u tile) of chunk c
            rows = t0 + r_t
            valid = gl.expand_dims(rows < eos, 1)
            # product 1: vnew = U - W S_c  (B = the published 16-bit S)
            ws = warpgroup_mma(w_s.index(jw), s_pub.index(j), gl.zeros([BT, BV], gl.float32, ACC), use_acc=False)
            vnew = gl.where(valid, u_s.index(st).load(ACC).to(gl.float32) - ws, 0.).to(dt)
            v_pub.index(j).store(vnew)
            if STORE_VNEW:
                uv_off = gl.expand_dims(rows, 1) * (HV * V) + hv * V + gl.expand_dims(c_v, 0)
                gl.store(vnew_ptr + uv_off, vnew, mask=valid)
            d = gl.exp(gam_last - gam)
            vs = gl.where(valid, vnew.to(gl.float32) * gl.expand_dims(d, 1), 0.).to(dt)
            vn_s.store(vs)
            fence_async_shared()                               # v_pub (output's wgmma), vn_s (product 2)
            gl.thread_barrier()
            mbarrier.arrive(v_full.index(j))
            if WU_FED:
                mbarrier.arrive(wu_empty.index(jw))            # w_s[jw] read by product 1 (waited): free
            # product 2: S_{c+1} = exp(gam_C) S_c + K^T (d * vnew)
            s = warpgroup_mma(k_s.index(st).permute((1, 0)), vn_s, s * gl.exp(gam_last))
            # this partition's share of ring slot st is done (u read by generic loads: fence before the TMA refill)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st))
            gam = gam_n
            gam_last = gam_last_n

        if STORE_H:
            tma_store_wait(0)
        if STORE_HT:
            if STATES_GATED:
                if ht_on != 0:
                    gl.store(ht_ptr + state_off, gl.convert_layout(s, LS))
            else:
                gl.store(ht_ptr + state_off, gl.convert_layout(s, LS))

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
    def _ws_barriers(STAGES: gl.constexpr, NPUB: gl.constexpr, CONSUMERS: gl.constexpr, PUBLISHERS: gl.constexpr = 1):
        """The ring's ready[STAGES] (count 1 + tx) and empty[STAGES] (count CONSUMERS) and the published pairs'
        s_full, v_full (count PUBLISHERS: the partitions that publish a share of each), pub_empty[NPUB] (count 1),
        allocated and initialised, the inits fenced for the async proxy."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        s_full = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        pub_empty = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        for i in gl.static_range(NPUB):
            mbarrier.init(s_full.index(i), count=PUBLISHERS)
            mbarrier.init(v_full.index(i), count=PUBLISHERS)
            mbarrier.init(pub_empty.index(i), count=1)
        fence_async_shared()                                     # barrier inits visible to the async proxy
        return ready, empty, s_full, v_full, pub_empty

    @gluon.jit
    def _ws_barriers_invalidate(ready, empty, s_full, v_full, pub_empty, STAGES: gl.constexpr, NPUB: gl.constexpr):
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        for i in gl.static_range(NPUB):
            mbarrier.invalidate(s_full.index(i))
            mbarrier.invalidate(v_full.index(i))
            mbarrier.invalidate(pub_empty.index(i))

    # ------------------------------------------------------------------ the kernel
    @gluon.jit
    def chunk_fused_ws_kernel(
        q_desc, k_desc, w_desc, u_desc,        # TMA over q, k [T_tot, H*K], w [T_tot, HV*K], u [T_tot, HV*V]
        gcum_ptr, o_ptr,                       # gcum [T_tot, HV] fp32; o [T_tot, HV, V] (v's dtype)
        h_desc, vnew_ptr,                      # optional: TMA over h [slots*HV*K, V]; vnew [T_tot, HV, V] (or None)
        h0_ptr, ht_ptr,                        # optional: initial / final state [N, HV, K, V] fp32 (or None)
        cu_ptr, chunk_off_ptr, scale,          # the chunk plan (triton/chunk_indices.py); scale
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
        STAGES: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        STORE_H: gl.constexpr, STORE_VNEW: gl.constexpr, OUTPUT_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        dt: gl.constexpr = w_desc.dtype
        vb = gl.program_id(0)
        nh = gl.program_id(1)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)

        q_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], k_desc.layout)
        w_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], w_desc.layout)
        u_s = gl.allocate_shared_memory(dt, [STAGES, BT, BV], u_desc.layout)
        s_pub = gl.allocate_shared_memory(dt, [NPUB, K, BV], ws_smem_layout(BV, dt.primitive_bitwidth))
        v_pub = gl.allocate_shared_memory(dt, [NPUB, BT, BV], u_desc.layout)
        vn_s = gl.allocate_shared_memory(dt, [BT, BV], u_desc.layout)
        ready, empty, s_full, v_full, pub_empty = _ws_barriers(STAGES, NPUB, 2)   # empty: state + output partitions

        gl.warp_specialize(
            [(_ws_state, (k_s, w_s, u_s, ready, empty, None, None, s_pub, v_pub, vn_s, s_full, v_full, pub_empty,
                          gcum_ptr, h_desc, vnew_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, slot0, n, hv, vb,
                          HV, K, V, BT, BV, STAGES, None, NPUB, USE_H0, STORE_HT, STORE_H, STORE_VNEW,
                          False, False)),                        # WU_FED, STATES_IN_ACC off: W, U from the ring
             (_ws_output, (q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                           nchunks, bos, eos, hv, vb, HV, V, BT, BV, STAGES, NPUB)),
             (_ws_producer, (q_desc, k_desc, w_desc, u_desc, q_s, k_s, w_s, u_s, ready, empty, nchunks, bos, hv, hk,
                             vb, K, V, BT, BV, STAGES))],
            worker_num_warps=[4, 1], worker_num_regs=[OUTPUT_REGS, PRODUCER_REGS])
        _ws_barriers_invalidate(ready, empty, s_full, v_full, pub_empty, STAGES, NPUB)


# ---------------------------------------------------------------------------------------------------- launcher

@dataclass(frozen=True)
class FusedWsConfig:
    BV: int
    stages: int            # TMA ring depth
    num_warps: int = 4     # the default (state) partition; the kernel launches 12 warps (3 warpgroups)


def fused_ws_config(N: int, HV: int, V: int, num_sms: int) -> FusedWsConfig:
    """V split as the Gluon state pass (launcher.state_config): BV=64 unless N*HV*V/64 programs would leave SMs
    idle, then 32. Ring depth 3 at BV=32 (209016 B of shared memory), 2 at BV=64 (196696 B; 3 stages would need
    254072 B > 232448). One CTA per SM either way (shared memory)."""
    bv = 64
    while bv > 32 and N * HV * (V // bv) < num_sms:
        bv //= 2
    return FusedWsConfig(bv, 3 if bv == 32 else 2)


def fused_ws_supported(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None
                       ) -> Tuple[bool, str]:
    """Whether the fused kernel takes this call (on top of the gluon backend's supports(): sm_90a, no interpreter,
    bf16/fp16, K == V == 128, a non-empty call). Varlen is taken: the kernel masks exactly as chunk_state_tma.py."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"dtype {q.dtype}: the fused kernel takes bf16 or fp16"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"K={q.shape[-1]}, V={v.shape[-1]}: the fused kernel is built for K == V == 128"
    if q.shape[0] * q.shape[1] == 0:
        return False, "no tokens: the TMA descriptors need a non-empty [T, heads*dim] view"
    if v.shape[2] % q.shape[2]:
        return False, "HV must be a multiple of H"
    return True, ""


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a 16-byte aligned base; a view at an odd offset is copied (read-only operands only)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def fused_ws_launch(q, k, w, u, gcum, o, initial_state, final, plan, scale: float, cfg: FusedWsConfig,
                    h: Optional[torch.Tensor] = None, vnew: Optional[torch.Tensor] = None):
    """(kernel, grid, args, kwargs) of one launch of chunk_fused_ws_kernel. Separate from the launch so that a CPU
    test can check the arguments (descriptors build on CPU tensors) against the AOT signature (aot.py).
    q, k [B,T,H,K]; w [T_tot,HV,K]; u [T_tot,HV,V]; gcum [T_tot,HV] fp32; o [B,T,HV,V] (written); initial_state /
    final [N,HV,K,V] fp32 or None; h [slots,HV,K,V] / vnew [T_tot,HV,V] (q's dtype) or None: written when given."""
    from linattn.runtime.gluon_compat import TensorDescriptor
    H, K = q.shape[-2], q.shape[-1]
    HV, V = u.shape[1], u.shape[2]
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    dt = q.dtype
    for name, t in (("k", k), ("w", w), ("u", u)) + ((("h", h),) if h is not None else ()) \
            + ((("vnew", vnew),) if vnew is not None else ()):
        if t.dtype != dt:
            raise ValueError(f"{name} is {t.dtype}, q is {dt}: the fused kernel takes one 16-bit dtype")
    gdt = _gl_dtype(dt)

    def desc(t2d, block):
        return TensorDescriptor.from_tensor(t2d, block, gl.NVMMASharedLayout.get_default_for(block, gdt))

    h_desc = None
    if h is not None:
        if h.data_ptr() % 16:
            raise ValueError("h must be 16-byte aligned for the TMA store")
        h_desc = desc(h.view(slots * HV * K, V), [K, cfg.BV])
    args = (desc(_aligned(q.reshape(T_tot, H * K)), [BT, K]), desc(_aligned(k.reshape(T_tot, H * K)), [BT, K]),
            desc(_aligned(w.reshape(T_tot, HV * K)), [BT, K]), desc(_aligned(u.reshape(T_tot, HV * V)), [BT, cfg.BV]),
            gcum, o, h_desc, vnew, initial_state, final, plan.cu, plan.chunk_offsets, float(scale))
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, STAGES=cfg.stages, NPUB=NPUB,
                  USE_H0=initial_state is not None, STORE_HT=final is not None, STORE_H=h is not None,
                  STORE_VNEW=vnew is not None, OUTPUT_REGS=OUTPUT_REGS, PRODUCER_REGS=PRODUCER_REGS,
                  num_warps=cfg.num_warps)
    grid = (V // cfg.BV, N * HV)
    return chunk_fused_ws_kernel, grid, args, kwargs


def chunk_fused_ws_gluon(q, k, w, u, gcum, o, initial_state, final, plan, scale: float,
                         h: Optional[torch.Tensor] = None, vnew: Optional[torch.Tensor] = None,
                         config: Optional[FusedWsConfig] = None) -> None:
    """Stages 3 + 4 on sm_90a: writes o (and final, h, vnew when given) from the stage-2 outputs; the `fused_pass`
    hook of triton/forward.py chunk_gated_delta_rule_fwd. Launched through the Gluon JIT (no cached host plan yet:
    four TensorDescriptor.from_tensor per call, as the uncached state pass)."""
    from linattn.runtime.device import device_facts
    cfg = config or fused_ws_config(plan.N, u.shape[1], u.shape[2], device_facts(q.device).num_sms)
    kernel, grid, args, kwargs = fused_ws_launch(q, k, w, u, gcum, o, initial_state, final, plan, scale, cfg, h, vnew)
    kernel[grid](*args, **kwargs)


# ---------------------------------------------------------------------------------------------------- CPU model

class _MBar:
    """An mbarrier: `count` arrivals plus a transaction-byte count complete a phase; wait(parity) passes once the
    phase of that parity has completed, i.e. while the current (incomplete) phase has the other parity."""
    __slots__ = ("count", "pending", "tx", "done")

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.done = count, count, 0, 0

    def _check(self):
        if self.pending == 0 and self.tx == 0:
            self.done += 1
            self.pending = self.count

    def arrive(self):
        assert self.pending > 0
        self.pending -= 1
        self._check()

    def expect(self, nbytes: int):                # arrive.expect_tx
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._check()

    def passes(self, parity: int) -> bool:
        return (self.done & 1) != parity


def emulate_fused_ws(q, k, w, u, gcum, o, initial_state, final, plan, scale: float, BV: int = 32, stages: int = 3,
                     npub: int = NPUB, h=None, vnew=None, seed: int = 0, stats: Optional[dict] = None) -> None:
    """A torch model of chunk_fused_ws_kernel's per-CTA schedule, for CPU tests and the GPU round's dry run (same
    arguments as chunk_fused_ws_gluon). The three partitions are Python generators that stop at every mbarrier wait;
    a seeded random scheduler interleaves them with the landing of the producer's TMA copies, so the barrier
    protocol (ring slots, published S/vnew buffers, parities) decides which data each step sees: a protocol error
    shows up as a wrong result or as a deadlock (RuntimeError). Data flows through modelled shared-memory buffers
    with the kernel's boxes (full [BT, .] boxes from a chunk's first token, the next sequence's rows included, zero
    past T_tot) and roundings (bf16/fp16 operands, fp32 accumulation)."""
    import random
    dt = q.dtype
    T_tot, HV, K = w.shape
    H, V = q.shape[2], u.shape[2]
    f32 = torch.float32
    pad = lambda t: torch.cat([t, t.new_zeros(BT, *t.shape[1:])])       # noqa: E731  TMA zero-fill past T_tot
    qp, kp = pad(q.reshape(T_tot, H, K)), pad(k.reshape(T_tot, H, K))
    wp, up = pad(w.reshape(T_tot, HV, K)), pad(u.reshape(T_tot, HV, V))
    o2 = o.view(T_tot, HV, V)
    cu, offs = plan.cu.tolist(), plan.chunk_offsets.tolist()
    rng = random.Random(seed)
    r_t = torch.arange(BT)
    lower = r_t[:, None] >= r_t[None, :]
    steps = 0

    def gates(t0, eos, hv):
        rows = t0 + r_t
        gam = torch.where(rows < eos, gcum[rows.clamp(max=T_tot - 1), hv], torch.zeros(()))
        return gam, gcum[t0 + min(eos - t0, BT) - 1, hv]

    for n in range(plan.N):
        bos, eos = cu[n], cu[n + 1]
        nch = -(-max(eos - bos, 0) // BT)
        for hv in range(HV):
            hk = hv // (HV // H)
            for vb in range(V // BV):
                cols = slice(vb * BV, (vb + 1) * BV)
                ready = [_MBar(1) for _ in range(stages)]
                empty = [_MBar(2) for _ in range(stages)]
                s_full = [_MBar(1) for _ in range(npub)]
                v_full = [_MBar(1) for _ in range(npub)]
                pub_empty = [_MBar(1) for _ in range(npub)]
                ring = [dict() for _ in range(stages)]
                s_pub = [None] * npub
                v_pub = [None] * npub
                inflight = []                          # TMA copies issued, not landed: (slot, tiles)
                nbytes = 2 * (3 * BT * K + BT * BV)

                def producer():
                    for c in range(nch):
                        s = c % stages
                        yield empty[s], ((c // stages) & 1) ^ 1
                        r0 = bos + c * BT
                        ready[s].expect(nbytes)
                        inflight.append((s, dict(q=qp[r0:r0 + BT, hk].clone(), k=kp[r0:r0 + BT, hk].clone(),
                                                 w=wp[r0:r0 + BT, hv].clone(), u=up[r0:r0 + BT, hv, cols].clone())))

                def state():
                    if initial_state is not None:
                        S = initial_state[n, hv, :, cols].to(f32).clone()
                    else:
                        S = torch.zeros(K, BV)
                    for c in range(nch):
                        t0 = bos + c * BT
                        gam, gam_last = gates(t0, eos, hv)
                        j = c % npub
                        yield pub_empty[j], ((c // npub) & 1) ^ 1
                        s_pub[j] = S.to(dt)
                        if h is not None:
                            h[offs[n] + c, hv, :, cols] = s_pub[j]
                        s_full[j].arrive()
                        st = c % stages
                        yield ready[st], (c // stages) & 1
                        valid = ((t0 + r_t) < eos)[:, None]
                        ws = ring[st]["w"].to(f32) @ s_pub[j].to(f32)
                        vn = torch.where(valid, ring[st]["u"].to(f32) - ws, 0.).to(dt)
                        v_pub[j] = vn
                        if vnew is not None:
                            rows = (t0 + r_t)[valid[:, 0]]
                            vnew[rows, hv, cols] = vn[valid[:, 0]]
                        d = torch.exp(gam_last - gam)
                        vs = torch.where(valid, vn.to(f32) * d[:, None], 0.).to(dt)
                        v_full[j].arrive()
                        yield None                     # a scheduling point between the two products
                        S = S * torch.exp(gam_last) + ring[st]["k"].to(f32).T @ vs.to(f32)
                        empty[st].arrive()
                    if final is not None:
                        final[n, hv, :, cols] = S

                def output():
                    for c in range(nch):
                        t0 = bos + c * BT
                        st, j = c % stages, c % npub
                        gam, _ = gates(t0, eos, hv)
                        yield ready[st], (c // stages) & 1
                        qt = ring[st]["q"].to(f32)
                        qk = qt @ ring[st]["k"].to(f32).T
                        yield s_full[j], (c // npub) & 1
                        qs = qt @ s_pub[j].to(f32)
                        empty[st].arrive()
                        gmat = torch.exp(torch.where(lower, gam[:, None] - gam[None, :], 0.))
                        att = torch.where(lower, qk * gmat, 0.).to(dt)
                        oc = qs * torch.exp(gam)[:, None]
                        yield v_full[j], (c // npub) & 1
                        oc = oc + att.to(f32) @ v_pub[j].to(f32)
                        pub_empty[j].arrive()
                        oc = (oc * scale).to(o.dtype)
                        nv = min(eos - t0, BT)
                        o2[t0:t0 + nv, hv, cols] = oc[:nv]

                parts = [state(), output(), producer()]
                waits = [None, None, None]             # the (barrier, parity) each partition stands at
                alive = [True, True, True]
                for i, p in enumerate(parts):          # run each to its first wait
                    try:
                        waits[i] = next(p)
                    except StopIteration:
                        alive[i] = False
                while any(alive) or inflight:
                    runnable = [i for i in range(3) if alive[i] and (waits[i] is None or waits[i][0].passes(waits[i][1]))]
                    choices = runnable + (["tma"] if inflight else [])
                    if not choices:
                        raise RuntimeError(f"deadlock: sequence {n}, head {hv}, V block {vb}, partitions at {waits}")
                    pick = rng.choice(choices)
                    steps += 1
                    if pick == "tma":                  # the oldest copy lands (TMA completes in order per barrier)
                        s, tiles = inflight.pop(0)
                        ring[s] = tiles
                        ready[s].complete_tx(nbytes)
                        continue
                    try:
                        waits[pick] = next(parts[pick])
                    except StopIteration:
                        alive[pick] = False
                        waits[pick] = None
    if stats is not None:
        stats["steps"] = stats.get("steps", 0) + steps
