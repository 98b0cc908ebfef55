"""Backward stage 1 in Gluon (sm_90a): the reverse state pass of triton/backward_state.py (chunk_state_bwd_kernel)
with the chunk tiles of q, k, w, dO and dVnew brought in by TMA into a STAGES-deep mbarrier ring, prefetching
STAGES-1 chunks ahead (in reverse chunk order) of the one being computed, and every product on warpgroup_mma.
The "gluon" backend's backward runs it (gluon/backend.py; H200: 1.46x the Triton kernel at B1 T65536,
benchmarks/RESULTS.md).

Per chunk, walked last to first, with dS [K, BV] the fp32 gradient flowing into this chunk's S_next (it starts
at d final_state, or zero), exactly as the Triton kernel (same rounding points):
    dh[chunk] = dS                                   (dh dtype)
    kdec      = (K * exp(gam_C - gam)[:, None]).to(dt)                 rows past the sequence end: 0
    dVnew     = dVnew_in + kdec @ dS.to(dt)          (fp32, then rounded to dvnew's dtype, stored in place)
    qg        = (Q * (exp(gam) * scale)[:, None]).to(dt)               rows past the sequence end: 0
    dS        = exp(gam_C) dS + qg^T dO - W^T dVnew.to(dt)
and dh0 = dS (fp32) after the first chunk. One program per (V block, sequence * value head); V is split exactly
as in the Triton kernel (every line is column-separable in V).

Products (one warpgroup, 4 warps; accumulator layout NVMMA v3 [4, 1] x [16, BV, 16] for [64, BV] and [128, BV]):
  P1  dVnew = kdec @ dS      A = kdec in registers (DotOperandLayout of the accumulator, k_width 2; the k tile is
                             read from the ring by ldmatrix, decayed and rounded in registers), B = dS.to(dt) from
                             ds_smem [K, BV] (MN-major B), accumulator = dVnew_in read from the ring: [64 x BV x 128]
  P2  dS += qg^T @ dO        A = qg_smem [BT, K] permuted (MN-major A), B = dO ring tile [BT, BV], accumulator =
                             exp(gam_C) dS: [128 x BV x 64]
  P3  dS += W^T @ (-dVnew)   A = W ring tile permuted (MN-major A), B = -dVnew.to(dt) in dvn_smem (negation is exact
                             in 16 bits; rows past the end 0), accumulator = P2's result: [128 x BV x 64]
P1 and P2 are independent: both are issued asynchronously and waited together; P3 needs P1's dVnew.

DV_LOCAL (the gluon backend's backward): stage 1a (triton/backward_dv_local.py, dVnew_in = P^T dO) is formed here
instead of read, so dVnew never makes the round trip through HBM between the two stages:
  P0  K Q^T                  A = k ring tile, B = q ring tile permuted (K-major B): [64 x 64 x 128], issued right
                             after the ring wait (it does not depend on dS), waited once qg is formed
      P^T = (scale K Q^T) * exp(gam_j - gam_i) on i <= j, q row j valid (masked before exp), rounded to dt as the
                             Triton stage rounds it, into pt_smem [64, 64]
  P0b dVnew_in = P^T @ dO    A = pt_smem, B = dO ring tile, zero accumulator: [64 x BV x 64]; P1 then accumulates
                             onto P0b's result (an in-flight token), so dVnew_in stays fp32 where the Triton stage
                             stores it rounded to dvnew's dtype (one rounding fewer)
The dVnew ring tile is then not loaded (the expect counts four boxes) and dvnew's contents on entry are not read.
Every V block recomputes P0 (the Triton stage forms it once per chunk and head): 1 MFLOP per chunk off the chain.
Triton sums exp(gam_C) dS + dot(qg^T, dO) - dot(W^T, dVnew) from two separate fp32 products; here the two
products accumulate into one fp32 accumulator (same operands, fp32-level reassociation only).

Varlen and the boxes: the descriptors cover the packed 2-D views q, k [T_tot, H*K], w [T_tot, HV*K], dO, dVnew
[T_tot, HV*V]; a chunk's box starts at its first token, so the last chunk's box may hold the NEXT sequence's rows
(TMA zero-fills only past T_tot). They are neutralised in registers with gl.where (never by multiplication, so
non-finite values there cannot leak): kdec and qg rows are 0, the -dVnew rows written for P3 are 0, and dVnew's
rows past the end are not stored. W and dO rows past the end then only ever multiply zeros.
dVnew in place: this program alone writes its rows/columns of dVnew (valid rows of chunk c, V block vb); the ring
prefetches chunks c-1, c-2 (earlier rows), never chunk c's rows again, so a prefetch never reads a stale tile that
this program has yet to write. The rows of the next sequence in a last chunk's box may be written concurrently by
another program: they are read, discarded by the masks, never written here.

Shared-memory buffers, who owns them and when they are reused:
  ring slot s (q_smem[s], k_smem[s], w_smem[s], do_smem[s], dv_smem[s], ready[s]); iteration i handles chunk
    c = nchunks-1-i in slot i % STAGES:
    prologue   iterations 0 .. STAGES-2 are issued into slots 0 .. STAGES-2 (predicated off past the last one).
    steady     iteration i first refills slot (i - 1) % STAGES with iteration i + STAGES - 1: every warp passed the
               thread barrier after its reads of iteration i - 1 (ldmatrix / local loads), the wgmmas reading the
               slot were waited, and a proxy fence orders the generic-proxy reads before the async-proxy TMA write.
               Then it waits on ready[i % STAGES] with parity (i // STAGES) & 1 and reads.
    drain      refills past the last iteration are predicated off (no expect, no copy): no TMA load is in flight
               when the loop ends and no phase is awaited that never completes; the barriers are invalidated.
    expect     counts the full boxes (TMA counts zero-filled bytes too).
  ds_smem [K, BV] (dh dtype): dS.to(dt), written by the generic proxy each iteration, fenced by every thread, then a
    thread barrier before the TMA store of dh[chunk] is issued (so the issuing thread's copy follows every thread's
    fence); also read by P1 (wgmma). Before it is rewritten, tma.store_wait(0) + the thread barrier make sure
    the previous dh store finished reading it; the previous P1 was waited.
  qg_smem [BT, K], dvn_smem [BT, BV], pt_smem [BT, BT]: P2's, P3's and P0b's operands, written (generic) then
    fenced; their previous readers (P2, P3, P0b of the previous iteration) were waited before the rewrite.
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, tma_load, tma_store,
                                          tma_store_wait, warpgroup_mma, warpgroup_mma_wait)

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import _sequence_span
    from linattn.ops.gated_delta_rule.triton.segment_start import SEGW_H0, SEGW_LAST, SEGW_SEQ_SHIFT, SEGW_WL_MASK

    @gluon.constexpr_function
    def bwd_acc_layout(BV, num_warps):
        """wgmma accumulator layout shared by dVnew [BT, BV] and dS [K, BV] (one warpgroup along M)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                         instr_shape=[16, BV // (num_warps // 4), 16])

    @gluon.constexpr_function
    def bwd_rows_layout(ncols, elem_bits, num_warps):
        """Blocked layout of a row-major [rows, ncols] tile: 16-byte vectors along the contiguous dim."""
        vec = min(128 // elem_bits, ncols)
        tpw_n = min(32, ncols // vec)
        return gl.BlockedLayout([1, vec], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])

    @gluon.jit
    def _issue_bwd_chunk(q_desc, k_desc, w_desc, do_desc, dv_desc, q_smem, k_smem, w_smem, do_smem, dv_smem, ready,
                         i, nchunks, bos, hv, hk, vb,
                         K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                         STAGES: gl.constexpr, DV_LOCAL: gl.constexpr):
        """TMA loads of iteration i's tiles (chunk nchunks-1-i) into ring slot i % STAGES (nothing past the end);
        the dVnew tile only where stage 1a wrote it (not DV_LOCAL)."""
        s = i % STAGES
        p = i < nchunks
        row = (bos + (nchunks - 1 - i) * BT).to(gl.int32)
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + k_desc.block_type.nbytes + w_desc.block_type.nbytes
                                + do_desc.block_type.nbytes + (0 if DV_LOCAL else dv_desc.block_type.nbytes))
        mbarrier.expect(ready.index(s), nbytes, pred=p)
        tma_load(q_desc, [row, hk * K], ready.index(s), q_smem.index(s), pred=p)
        tma_load(k_desc, [row, hk * K], ready.index(s), k_smem.index(s), pred=p)
        tma_load(w_desc, [row, hv * K], ready.index(s), w_smem.index(s), pred=p)
        tma_load(do_desc, [row, hv * V + vb * BV], ready.index(s), do_smem.index(s), pred=p)
        if not DV_LOCAL:
            tma_load(dv_desc, [row, hv * V + vb * BV], ready.index(s), dv_smem.index(s), pred=p)

    @gluon.jit
    def _reverse_segment(sel_ptr, seg_ptr, seq_len, nh, n, hv, bos, eos, nchunks, slot0, HV: gl.constexpr,
                         BT: gl.constexpr):
        """The chain of program row nh: (the dht / dh0 row, the end of the rows it stores, the chain's end, its chunk
        count, the dh slot of its first chunk, dht flag, dh0 flag). Without seg_ptr the plain sequence's (sel_ptr:
        [N * HV], the pairs with 0 run no chunk and store no dh0). With seg_ptr (segment_start.segment_windows'
        reverse words; fixed-length sequences of seq_len tokens in one packed stream), row nh is a segment whose chain
        runs wl warm-up chunks past its end (clipped at its sequence's end) from 0, or from d final_state where the
        window reaches the sequence end; it stores dh and dVnew of its own rows only, dh0 only as its sequence's
        first segment; sel_ptr [sequences * HV]: its segments run where 0 (the others run unsegmented)."""
        if seg_ptr is not None:
            word = gl.load(seg_ptr + nh)
            state_n = word >> SEGW_SEQ_SHIFT
            chain_eos = gl.minimum(eos + (word & SEGW_WL_MASK) * BT, (state_n + 1) * seq_len)
            nch = gl.cdiv(chain_eos - bos, BT).to(gl.int32)
            dh0_on = word & SEGW_LAST
            if sel_ptr is not None:
                if gl.load(sel_ptr + state_n * HV + hv) != 0:
                    nch = 0
                    dh0_on = 0
            slot = state_n * gl.cdiv(seq_len, BT) + (bos - state_n * seq_len) // BT
            return state_n, eos, chain_eos, nch, slot, word & SEGW_H0, dh0_on
        else:
            dh0_on = 1
            if sel_ptr is not None:
                run = (gl.load(sel_ptr + nh) != 0).to(gl.int32)
                nchunks = nchunks * run
                dh0_on = dh0_on * run
            return n, eos, eos, nchunks, slot0, 1, dh0_on

    @gluon.jit
    def chunk_state_bwd_tma_kernel(
        q_desc, k_desc, w_desc, do_desc, dv_desc,   # TMA over q, k [T_tot, H*K], w [T_tot, HV*K], do, dvnew [T_tot, HV*V]
        gcum_ptr,                                   # gcum [T_tot, HV] fp32
        dh_desc, dvnew_ptr,                         # TMA over dh [slots*HV*K, V]; dvnew [T_tot, HV, V] (in place)
        dht_ptr, dh0_ptr,                           # d final_state (any float) / d initial_state (fp32) [N, HV, K, V]
        cu_ptr, chunk_off_ptr, scale,               # the chunk plan (triton/chunk_indices.py), the q scale
        sel_ptr, seg_ptr, seq_len,                  # optional selection / segment words (or None), segment launch's T
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
        BT: gl.constexpr, BV: gl.constexpr, USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
        STAGES: gl.constexpr, DV_LOCAL: gl.constexpr = False, DECAY: gl.constexpr = "scalar",
    ):
        if DV_LOCAL:
            gl.static_assert(DECAY == "scalar", "stage 1a in the kernel is GDN's (a scalar decay)")
        NW: gl.constexpr = gl.num_warps()
        dt: gl.constexpr = w_desc.dtype
        ACC: gl.constexpr = bwd_acc_layout(BV, NW)
        OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)
        AROWS: gl.constexpr = gl.SliceLayout(1, OPA)
        LQ: gl.constexpr = bwd_rows_layout(K, 16, NW)             # the q tile, scaled in registers
        QROWS: gl.constexpr = gl.SliceLayout(1, LQ)
        LS: gl.constexpr = bwd_rows_layout(BV, 32, NW)            # fp32 states [K, BV] in global memory
        ACC_T: gl.constexpr = bwd_acc_layout(BT, NW)              # K Q^T [BT, BT] (DV_LOCAL)
        TI: gl.constexpr = gl.SliceLayout(1, ACC_T)
        TJ: gl.constexpr = gl.SliceLayout(0, ACC_T)

        vb = gl.program_id(0)
        nh = gl.program_id(1)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)
        WARM: gl.constexpr = seg_ptr is not None
        n, seg_end, eos, nchunks, slot0, dht_on, dh0_on = _reverse_segment(sel_ptr, seg_ptr, seq_len, nh, n, hv, bos,
                                                                           eos, nchunks, slot0, HV, BT)

        q_smem = gl.allocate_shared_memory(dt, [STAGES, BT, K], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dt, [STAGES, BT, K], k_desc.layout)
        w_smem = gl.allocate_shared_memory(dt, [STAGES, BT, K], w_desc.layout)
        do_smem = gl.allocate_shared_memory(dt, [STAGES, BT, BV], do_desc.layout)
        dv_smem = gl.allocate_shared_memory(dt, [1 if DV_LOCAL else STAGES, BT, BV], dv_desc.layout)
        ds_smem = gl.allocate_shared_memory(dt, [K, BV], dh_desc.layout)
        qg_smem = gl.allocate_shared_memory(dt, [BT, K], q_desc.layout)
        dvn_smem = gl.allocate_shared_memory(dt, [BT, BV], dv_desc.layout)
        pt_smem = gl.allocate_shared_memory(dt, [BT if DV_LOCAL else 8, BT], q_desc.layout)   # P^T; unused w/o DV_LOCAL
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        fence_async_shared()                                        # barrier inits visible to the async proxy
        for j in gl.static_range(STAGES - 1):                       # prologue: iterations 0 .. STAGES-2 in flight
            _issue_bwd_chunk(q_desc, k_desc, w_desc, do_desc, dv_desc, q_smem, k_smem, w_smem, do_smem, dv_smem,
                             ready, j, nchunks, bos, hv, hk, vb, K, V, BT, BV, STAGES, DV_LOCAL)

        sk = gl.arange(0, K, layout=gl.SliceLayout(1, LS))
        sv = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LS))
        state_off = (n.to(gl.int64) * HV + hv) * K * V + gl.expand_dims(sk, 1) * V + gl.expand_dims(sv, 0)
        ds = gl.zeros([K, BV], gl.float32, ACC)
        if USE_DHT:
            if dht_on != 0:
                ds = gl.convert_layout(gl.load(dht_ptr + state_off).to(gl.float32), ACC)

        r_t = gl.arange(0, BT, layout=ROWS)
        r_a = gl.arange(0, BT, layout=AROWS)
        r_q = gl.arange(0, BT, layout=QROWS)
        c_v = vb * BV + gl.arange(0, BV, layout=COLS)
        r_i = gl.arange(0, BT, layout=TI)
        r_j = gl.arange(0, BT, layout=TJ)

        # gates of the last chunk; each iteration then loads the next one's (an earlier chunk) while it computes.
        # DECAY "channel" (KDA): q and k hold the decayed queries and keys already (Q exp(gam), K exp(gam_C - gam),
        # per value head), and dS decays per key row by exp(gam_C) [K] (gcum [T_tot, HV, K], the last row's)
        t_n = bos + (nchunks - 1) * BT
        r_k = gl.arange(0, K, layout=ROWS)
        if DECAY == "scalar":
            gam = gl.load(gcum_ptr + (t_n + r_t) * HV + hv, mask=((t_n + r_t) < eos) & (nchunks > 0), other=0.)
            gam_last = gl.load(gcum_ptr + (t_n + gl.minimum(eos - t_n, BT) - 1) * HV + hv, mask=nchunks > 0,
                               other=0.)
        else:
            gam = gl.zeros([BT], gl.float32, ROWS)                  # unused
            gam_last = gl.load(gcum_ptr + ((t_n + gl.minimum(eos - t_n, BT) - 1) * HV + hv) * K + r_k,
                               mask=(r_k < K) & (nchunks > 0), other=0.)

        for i in range(0, nchunks):
            c = nchunks - 1 - i
            t0 = bos + c * BT
            # refill the slot read in iteration i - 1 with iteration i + STAGES - 1 (see the module docstring)
            fence_async_shared()
            gl.thread_barrier()
            _issue_bwd_chunk(q_desc, k_desc, w_desc, do_desc, dv_desc, q_smem, k_smem, w_smem, do_smem, dv_smem,
                             ready, i + STAGES - 1, nchunks, bos, hv, hk, vb, K, V, BT, BV, STAGES,
                             DV_LOCAL)
            # gates of chunk c - 1 (a whole chunk when c > 0), consumed next iteration
            t1 = t0 - BT
            if DECAY == "scalar":
                gam_n = gl.load(gcum_ptr + (t1 + r_t) * HV + hv, mask=c > 0, other=0.)
                gam_last_n = gl.load(gcum_ptr + (t1 + BT - 1) * HV + hv, mask=c > 0, other=0.)
            else:
                gam_n = gam
                gam_last_n = gl.load(gcum_ptr + ((t1 + BT - 1) * HV + hv) * K + r_k, mask=(r_k < K) & (c > 0),
                                     other=0.)

            # dh[chunk] = dS through ds_smem and a TMA store; ds_smem is also P1's B operand
            tma_store_wait(0)
            gl.thread_barrier()
            ds_smem.store(ds.to(dt))

            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if DV_LOCAL:   # P0: K Q^T, independent of dS: in flight while qg is formed
                tok_kq = warpgroup_mma(k_smem.index(s), q_smem.index(s).permute((1, 0)),
                                       gl.zeros([BT, BT], gl.float32, ACC_T), use_acc=False, is_async=True)
            rows = t0 + r_t
            valid = rows < eos
            # qg = (Q * exp(gam) * scale).to(dt), rows past the end 0, through qg_smem (P2's A operand)
            valid_q = gl.expand_dims((t0 + r_q) < eos, 1)
            if DECAY == "scalar":
                gam_q = gl.convert_layout(gam, QROWS)
                qv = q_smem.index(s).load(LQ).to(gl.float32) * gl.expand_dims(gl.exp(gam_q) * scale, 1)
            else:
                qv = q_smem.index(s).load(LQ).to(gl.float32) * scale
            qg_smem.store(gl.where(valid_q, qv, 0.).to(dt))
            if DV_LOCAL:
                # P^T = (scale K Q^T) * exp(gam_j - gam_i) on i <= j with q row j valid (masked before exp: gam is
                # 0 past the end), rounded to the operand dtype, through pt_smem (P0b's A operand); formed before
                # kdec so that K Q^T and kdec are never live together
                kq = warpgroup_mma_wait(0, deps=[tok_kq])
                upper = (gl.expand_dims(r_i, 1) <= gl.expand_dims(r_j, 0)) & gl.expand_dims((t0 + r_j) < eos, 0)
                gdiff = gl.expand_dims(gl.convert_layout(gam, TJ), 0) - gl.expand_dims(gl.convert_layout(gam, TI), 1)
                pt = gl.where(upper, kq * gl.exp(gl.where(upper, gdiff, 0.)) * scale, 0.)
                pt_smem.store(pt.to(dt))
            # kdec = (K * exp(gam_C - gam)).to(dt) in registers, rows past the end 0 (P1's A operand)
            valid_a = gl.expand_dims((t0 + r_a) < eos, 1)
            if DECAY == "scalar":
                gam_a = gl.convert_layout(gam, AROWS)
                kv = k_smem.index(s).load(OPA).to(gl.float32) * gl.expand_dims(gl.exp(gam_last - gam_a), 1)
            else:
                kv = k_smem.index(s).load(OPA).to(gl.float32)
            kdec = gl.where(valid_a, kv, 0.).to(dt)
            if not DV_LOCAL:
                dv_in = dv_smem.index(s).load(ACC).to(gl.float32)
            fence_async_shared()                                    # ds_smem, qg_smem, pt_smem -> TMA store / wgmma
            gl.thread_barrier()                                     # every thread's fence before the store issue
            if WARM:
                if t0 < seg_end:                                    # not a warm-up chunk past the segment's end
                    tma_store(dh_desc, [((slot0 + c) * HV + hv).to(gl.int32) * K, vb * BV], ds_smem)
            else:
                tma_store(dh_desc, [((slot0 + c) * HV + hv).to(gl.int32) * K, vb * BV], ds_smem)

            # P2 (dS side, independent of dS's new terms) and P1 (dVnew) in flight together
            if DECAY == "scalar":
                ds_dec = ds * gl.exp(gam_last)
            else:
                ds_dec = ds * gl.expand_dims(gl.exp(gam_last), 1)
            tok_s = warpgroup_mma(qg_smem.permute((1, 0)), do_smem.index(s), ds_dec, is_async=True)
            if DV_LOCAL:   # P0b: dVnew = P^T dO (fp32), then P1 accumulates kdec dS onto it
                tok_l = warpgroup_mma(pt_smem, do_smem.index(s), gl.zeros([BT, BV], gl.float32, ACC), use_acc=False,
                                      is_async=True)
                tok_v = warpgroup_mma(kdec, ds_smem, tok_l, is_async=True)
            else:
                tok_v = warpgroup_mma(kdec, ds_smem, dv_in, is_async=True)
            acc_s, dvn = warpgroup_mma_wait(0, deps=[tok_s, tok_v])
            dvn_op = dvn.to(dt)
            uv_off = gl.expand_dims(rows, 1) * (HV * V) + hv * V + gl.expand_dims(c_v, 0)
            if WARM:
                gl.store(dvnew_ptr + uv_off, dvn_op, mask=gl.expand_dims(rows < seg_end, 1))
            else:
                gl.store(dvnew_ptr + uv_off, dvn_op, mask=gl.expand_dims(valid, 1))
            # P3: dS = acc_s + W^T (-dVnew), rows past the end 0
            dvn_smem.store(gl.where(gl.expand_dims(valid, 1), -dvn_op.to(gl.float32), 0.).to(dt))
            fence_async_shared()
            if NW > 4:     # two warpgroups: each one's stores visible to the other's wgmma
                gl.thread_barrier()
            ds = warpgroup_mma(w_smem.index(s).permute((1, 0)), dvn_smem, acc_s)
            gam = gam_n
            gam_last = gam_last_n

        tma_store_wait(0)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
        if STORE_DH0:
            if dh0_on != 0:
                gl.store(dh0_ptr + state_off, gl.convert_layout(ds, LS))


# ---------------------------------------------------------------- host side: config and launch

from dataclasses import dataclass  # noqa: E402
from typing import Optional  # noqa: E402

from linattn.ops.gated_delta_rule.gluon.host import aligned, fused_desc, gl_dtype, launches  # noqa: E402

BT = 64


@dataclass(frozen=True)
class BwdStateConfig:
    BV: int
    num_warps: int
    stages: int          # TMA ring depth


def state_bwd_config(N: int, HV: int, V: int, num_sms: int, dv_local: bool = False) -> BwdStateConfig:
    """V split as the Triton backward's state pass (backward._configs): BV=64 unless N*HV*V/64 programs would
    leave SMs idle, then 32. One warpgroup (4 warps: wgmma's unit, the forward's Gluon state pass's choice), but
    two at BV=64 with stage 1a in the kernel (dv_local: one warpgroup needs 255 registers and spills there).
    Ring depth: 3 at BV=32 (217 KB of smem, one CTA per SM: there are <= 2 x num_sms programs there), 2 at BV=64
    (188 KB; 3 would not fit in 227 KB). AOT: gluon/aot.py."""
    bv = 64
    while bv > 32 and N * HV * (V // bv) < num_sms:
        bv //= 2
    return BwdStateConfig(bv, 8 if dv_local and bv == 64 else 4, 3 if bv == 32 else 2)


def state_bwd_launch(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale: float, cfg: BwdStateConfig,
                     dv_local: bool = False, select=None, seg=None, seq_len: int = 0, decay: str = "scalar"):
    """(kernel, grid, args, kwargs) of one launch of chunk_state_bwd_tma_kernel; the arguments mirror the Triton
    launch of chunk_state_bwd_kernel in triton/backward.py. Separate from the launch so that a CPU test can check
    them (descriptors build on CPU tensors) against the AOT signature (aot.py, bwd_dh_signature).
    dv_local: the kernel forms dVnew's in-chunk part P^T dO itself (stage 1a, backward_dv_local.py) and only writes
    dvnew (its contents on entry are not read); else it adds the state term to the dvnew that stage 1a wrote.
    q, k [B,T,H,K], w [T_tot,HV,K], do [B,T,HV,V], gcum [T_tot,HV] fp32, dh [slots,HV,K,V], dvnew [T_tot,HV,V] (all
    contiguous, one 16-bit dtype); dht [N,HV,K,V] any float or None; dh0 [N,HV,K,V] fp32 or None.
    select / seg / seq_len: the segment launch (plan: segment_start.segment_plan's; seg: segment_windows' reverse
    words over its segments, select [sequences, HV] their slow pairs, seq_len the sequences' T; dh the sequence
    plan's slots) or the unsegmented launch of the selected pairs (select [N, HV], no seg).
    decay "channel" (KDA): q, k the decayed queries and keys [T_tot, HV, K] (Q exp(gam), K exp(gam_C - gam), per
    value head), gcum [T_tot, HV, K] fp32; not with dv_local."""
    from linattn.ops.gated_delta_rule.gluon.fused_forward import selection_args
    from linattn.runtime.gluon_compat import TensorDescriptor
    H, K = q.shape[-2], q.shape[-1]
    HV, V = dvnew.shape[1], dvnew.shape[2]
    N, T_tot, slots = plan.N, plan.T_total, dh.shape[0]
    dt = q.dtype
    for name, t in (("k", k), ("w", w), ("do", do), ("dh", dh), ("dvnew", dvnew)):
        if t.dtype != dt:
            raise ValueError(f"{name} is {t.dtype}, q is {dt}: the Gluon state backward takes one 16-bit dtype")
    if dh.data_ptr() % 16:
        raise ValueError("dh must be 16-byte aligned for the TMA store (the backward allocates it)")
    if decay not in ("scalar", "channel"):
        raise ValueError(f"decay must be 'scalar' or 'channel', got {decay!r}")
    if decay == "channel" and (dv_local or gcum.shape[-1] != K or H != HV):
        raise ValueError("decay 'channel' takes the decayed q and k per value head [T_tot, HV, K], gcum [T_tot, HV, "
                         f"K], no dv_local (q {tuple(q.shape)}, gcum {tuple(gcum.shape)}, dv_local {dv_local})")
    gdt = gl_dtype(dt)

    def desc(t2d, block):             # templates per (shape, strides, box, dtype): one layout object for the key
        return fused_desc(TensorDescriptor, t2d, block, gdt)

    dv2d = dvnew.view(T_tot, HV * V)
    if dv2d.data_ptr() % 16:
        raise ValueError("dvnew must be 16-byte aligned (read by TMA, updated in place)")
    args = (desc(aligned(q.reshape(T_tot, H * K)), [BT, K]), desc(aligned(k.reshape(T_tot, H * K)), [BT, K]),
            desc(aligned(w.reshape(T_tot, HV * K)), [BT, K]), desc(aligned(do.reshape(T_tot, HV * V)), [BT, cfg.BV]),
            desc(dv2d, [BT, cfg.BV]), gcum, desc(dh.view(slots * HV * K, V), [K, cfg.BV]), dvnew,
            dht if dht is not None else gcum, dh0 if dh0 is not None else gcum, plan.cu, plan.chunk_offsets,
            float(scale)) + selection_args(select, seg, plan.N, HV) + (int(seq_len),)
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, USE_DHT=dht is not None, STORE_DH0=dh0 is not None,
                  STAGES=cfg.stages, DV_LOCAL=bool(dv_local), DECAY=decay, num_warps=cfg.num_warps)
    grid = (V // cfg.BV, N * HV)
    return chunk_state_bwd_tma_kernel, grid, args, kwargs


# The segment launch of the reverse pass: BV = 64 (two warpgroups with stage 1a) in as many segments per sequence as
# one wave of CTAs holds. Unsegmented, B1 H16/HV32 runs BV = 32 (128 CTAs, ~2.65 us a chunk on an H100): each CTA
# repeats the chunk's dV-independent work (K Q^T, the decayed q and k tiles) for its quarter of V. In two segments at
# BV = 64 the same 128 CTAs walk half the chain each (plus a warm-up of a few chunks) at ~3.5 us a chunk.
SEG_BV = 64


def state_bwd_segments(B: int, T: int, HV: int, V: int, cu_seqlens, device, capturing: bool = False):
    """(S, L) of the reverse pass's segment launch (chunk_state_bwd_gluon's segments), or None: the forward's rule
    (chunk_fused_gf.gf_segments_wanted: fixed-length batches, one wave of CTAs, segments of at least
    GF_SEG_MIN_CHUNKS chunks, eager calls from GF_SEG_MIN_EAGER_TOKENS tokens) for HV * V / SEG_BV CTAs per
    sequence."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import gf_segments_wanted
    if V % SEG_BV:
        return None
    S, L = gf_segments_wanted(B, T, HV * (V // SEG_BV), cu_seqlens, device, capturing=capturing)
    return (S, L) if S > 1 else None


_PREPARED: dict = {}      # (B, T, HV, V, device) -> the capture-time segment plan's (S, L), or None


def state_bwd_prepare_capture(B: int, T: int, HV: int, V: int, device) -> None:
    """On an eager fixed-length backward that runs unsegmented where a CUDA-graph capture of it would segment (under
    GF_SEG_MIN_EAGER_TOKENS tokens): build the capture's segment plan now (segment_start's cache), so that a capture
    after the eager warm-up records none of its construction (as chunk_fused_gf.gf_prepare_capture for the forward;
    the recompute's segments are the forward's, prepared there). A repeat call looks the key up (the plan is built
    again if the plan cache has dropped it since)."""
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan, segment_plan_cached
    key = (B, T, HV, V, device)
    segs = _PREPARED.get(key, False)
    if segs is False:
        segs = state_bwd_segments(B, T, HV, V, None, device, capturing=True)
        if len(_PREPARED) >= 64:
            _PREPARED.clear()
        _PREPARED[key] = segs
    if segs is not None and not segment_plan_cached(B, T, *segs, device):
        segment_plan(B, T, *segs, device)


def _launch(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale: float, cfg: BwdStateConfig, dv_local: bool,
            select=None, seg=None, seq_len: int = 0, decay: str = "scalar") -> None:
    """One launch of chunk_state_bwd_tma_kernel (state_bwd_launch's arguments) through the host path."""
    kernel, grid, args, kwargs = state_bwd_launch(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, cfg, dv_local,
                                                  select=select, seg=seg, seq_len=seq_len, decay=decay)
    launches(kernel, grid, args, kwargs)


def chunk_state_bwd_gluon(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale: float,
                          config: Optional[BwdStateConfig] = None, dv_local: bool = False, segments=None, g=None,
                          beta=None, run=None, decay: str = "scalar") -> None:
    """Backward stage 1 on sm_90a, a drop-in for the Triton launch of chunk_state_bwd_kernel (the `state_bwd` hook
    of triton/backward.py chunk_gated_delta_rule_bwd): writes dh, adds the state term to dvnew in place, writes dh0
    when given. With dv_local, stages 1a and 1 in one launch: dvnew is written whole (P^T dO + the state term), its
    contents on entry unread. K == V == 128, bf16/fp16 (the gluon backend's supports() checks the call).
    segments = (S, L) (state_bwd_segments) with g and beta, the op's inputs: the segment launch (_segments). run
    replaces _launch (same arguments; CPU tests pass testing/state_models.py's model). decay "channel": KDA's pass
    (state_bwd_launch), unsegmented, without stage 1a."""
    from linattn.runtime.device import device_facts
    cfg = config or state_bwd_config(plan.N, dvnew.shape[1], dvnew.shape[2], device_facts(q.device).num_sms, dv_local)
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    run = run or _launch
    if decay != "scalar":
        if segments is not None or dv_local:
            raise ValueError("decay 'channel' runs unsegmented, without stage 1a (dv_local)")
        run(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, cfg, False, decay=decay)
        return
    if segments is not None:
        _segments(run, q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, cfg, dv_local, g, beta, *segments)
        return
    run(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, cfg, dv_local)


def _segments(run, q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale: float, cfg: BwdStateConfig, dv_local: bool,
              g, beta, S: int, L: int) -> None:
    """The reverse pass in S segments of L chunks per sequence (fixed-length q [B, T, ...]; g, beta the inputs whose
    chunk decays choose the windows), on the current stream: segment_windows(reverse=True); the (sequence, head)
    pairs it flags unsegmented (cfg's launch on the sequence plan, selected: it exits at once where none is flagged);
    the others' segments (BV = SEG_BV on the segment plan; each chain runs its window past the segment's end first,
    stores only its own rows, the first segment dh0). One stream, as recompute_gf (chunk_state_gf.py) says why."""
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan, segment_window_buffers, \
        segment_windows
    from linattn.runtime.launch_list import keep
    B, T, H, K = q.shape
    HV = dvnew.shape[1]
    dev = q.device
    splan = segment_plan(B, T, S, L, dev)
    keep(splan)
    slow, flag, segw = segment_window_buffers(plan.N, S, HV, dev)
    segment_windows(k, beta, g, plan, S, L, launch=launches, out=(slow, flag, segw), reverse=True)
    run(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, cfg, dv_local, select=slow)
    run(q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), w, gcum, do.reshape(1, B * T, HV, -1), dh, dvnew, dht,
        dh0, splan, scale, BwdStateConfig(SEG_BV, 8 if dv_local else 4, 2), dv_local, select=slow, seg=segw,
        seq_len=T)
