"""Stages 2b + 3 + 4 of the GDN forward in one warp-specialised Gluon kernel (sm_90a): chunk_fused_ws.py with W and U
formed on the fly from kkt_solve's Tinv, so that wu_kernel (triton/intra_split.py) and its w / u round trip through
global memory (2 x 537 MB written and read back at B1 T65536 H16/HV32) go away. FlashQLA's organisation; design,
barriers, ownership, budgets and measurements: benchmarks/GLUON_FUSED_WU.md. The gluon backend's forward wherever
fused_wu_supported takes the call (default since round 15; LINATTN_GDN_GLUON_FUSED_WU=0 turns it off).

One CTA per (V block, sequence * value head), as chunk_fused_ws.py. Per chunk c, with dt the 16-bit operand dtype
and gam / beta the chunk's gates (0 on rows past the sequence end), EXACTLY wu_kernel's rounding points (with WU_AREG,
the default since round 16 at BV=32 and since round 17 at BV=64, a chunk that ends inside its sequence forms instead
w = ((Tinv * (beta * exp(gam))[None, :]).to(dt) @ k).to(dt) and u = ((Tinv * beta[None, :]).to(dt) @ v).to(dt), Tinv as
wgmma's register A operand and k, v the ring's tiles unchanged; GLUON_FUSED_WU.md, round 16; and with OUT_PIPE, the
default at BV=32 since round 17, the output partition is _output_pipelined, q k^T one chunk ahead):
  wu partition (worker 1, 4 warps = 1 warpgroup):
      ks = (k * (beta * exp(gam))[:, None]).to(dt)          -> wk_s[c % NWU]       (k: the ring's [BT, K] tile)
      vs = (v * beta[:, None]).to(dt)                       -> the ring's v tile, in place
      w  = (Tinv @ ks).to(dt)                               -> wk_s[c % NWU], in place of ks (after the wgmma)
      u  = (Tinv @ vs).to(dt)                               -> the ring's v tile, in place of vs
  state partition (default, 1 warpgroup) and output partition (worker 0, 1 warpgroup): chunk_fused_ws.py's, with
      product 1 reading W from wk_s[c % NWU] and U from the ring's v tile. Both are imported: the output partition
      IS chunk_fused_ws._ws_output; the state partition IS chunk_fused_ws._ws_state with WU_FED (it also waits
      wu_full and releases wk_s through wu_empty) and STATES_IN_ACC (h0 loaded / the final state stored straight
      in the accumulator layout: no conversion scratch, shared memory is tight).
  producer (worker 2, 1 warp): TMA of q, k ([BT, K] boxes), v ([BT, BV]) and Tinv ([BT, BT]) into slot c % STAGES.
Rows of a box past the sequence end hold the next sequence's tokens (TMA zero-fills only past T_tot): beta is 0
there, so ks and vs rows are 0 there (as wu_kernel's masked loads) and the W / U rows of valid tokens are exact;
W / U rows past the end are garbage and meet the state partition's row mask (vnew = where(valid, ...)).

Barriers (parity of the k-th completion is k & 1; a fresh barrier counts as if parity 1 had completed):
  ready[s]     count 1 + tx  producer expect(q + k + v + Tinv boxes); state, output and wu wait (c // STAGES) & 1.
  empty[s]     count 3       state (after product 2; fenced), output (after q k^T, q S), wu (after its products and
                             its in-place writes; fenced) arrive; producer waits ((c // STAGES) & 1) ^ 1.
  wu_full[j]   count 1       wu arrives once w is in wk_s[j] and u in the ring's v tile (fenced, thread barrier);
                             state waits (c // NWU) & 1.
  wu_empty[j]  count 1       state arrives after product 1 (its read of wk_s[j] and of u); wu waits
                             ((c // NWU) & 1) ^ 1 before writing ks of chunk c into wk_s[j].
  s_full, v_full, pub_empty  as chunk_fused_ws.py (NPUB published S / vnew buffers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import BT, NPUB, OUTPUT_REGS, PRODUCER_REGS, _aligned, _MBar
from linattn.ops.gated_delta_rule.triton.segment_start import SEGW_H0, SEGW_LAST, SEGW_SEQ_SHIFT, SEGW_WL_MASK
from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, tma_load,
                                          warpgroup_mma, warpgroup_mma_wait)

NWU = 2                  # W buffers (wk_s): the wu partition may run up to NWU chunks ahead of product 1
WU_REGS = 152            # setmaxnreg of the wu warpgroup (GLUON_FUSED_WU.md, register budget)

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import (_ws_output, _ws_output_index, _ws_state,
                                                                   _ws_store_o, ws_acc_layout, ws_rows_layout,
                                                                   ws_smem_layout)
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import _sequence_span

    # ------------------------------------------------------------------ worker 2: the TMA producer (1 warp)
    @gluon.jit
    def _wu_ring_load(q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, c, bos, hv, hk, vb,
                      K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr):
        """Chunk c's q, k, v, Tinv boxes into ring slot c % STAGES once its consumers released use c - STAGES
        (one producer iteration; chunk_fused_gf._gf_producer_g adds its gate staging after it). Returns the slot."""
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + k_desc.block_type.nbytes + v_desc.block_type.nbytes
                                + t_desc.block_type.nbytes)
        s = c % STAGES
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)     # the consumers released use c - STAGES
        row = (bos + c * BT).to(gl.int32)
        mbarrier.expect(ready.index(s), nbytes)                   # full boxes: TMA counts zero-filled bytes
        tma_load(q_desc, [row, hk * K], ready.index(s), q_s.index(s))
        tma_load(k_desc, [row, hk * K], ready.index(s), k_s.index(s))
        tma_load(v_desc, [row, hv * V + vb * BV], ready.index(s), v_s.index(s))
        tma_load(t_desc, [row, hv * BT], ready.index(s), t_s.index(s))
        return s

    @gluon.jit
    def _wu_producer(q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, nchunks, bos, hv, hk, vb,
                     K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr):
        for c in range(nchunks):
            _wu_ring_load(q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, c, bos, hv, hk, vb, K, V,
                          BT, BV, STAGES)

    # ------------------------------------------------------------------ worker 1: W and U (1 warpgroup)
    @gluon.jit
    def _wu_gates(gcum_ptr, beta_ptr, t0, eos, hv, r_k, r_v, HV: gl.constexpr):
        """gcum and beta of the chunk starting at token t0, as loaded (0 on rows >= eos): gam and beta in the k
        tile's row layout, beta again in the v tile's."""
        rk = t0 + r_k
        rv = t0 + r_v
        gam = gl.load(gcum_ptr + rk * HV + hv, mask=rk < eos, other=0.)
        bk = gl.load(beta_ptr + rk * HV + hv, mask=rk < eos, other=0.)
        bv = gl.load(beta_ptr + rv * HV + hv, mask=rv < eos, other=0.)
        return gam, bk, bv

    @gluon.jit
    def _wu_scaled_in_smem(k_s, v_s, t_s, wk_s, st, j, rk, rv, eos, bg, beta_v, LK: gl.constexpr,
                           LV: gl.constexpr, ACC_W: gl.constexpr, ACC_U: gl.constexpr, K: gl.constexpr,
                           BT: gl.constexpr, BV: gl.constexpr):
        """w = Tinv @ ks, u = Tinv @ vs with ks, vs the row-scaled k and v written to shared memory first (wu_kernel's
        rounding points). Rows past eos are SELECTED to 0 (as wu_kernel's zero-filled loads: the next sequence's rows
        cannot reach W / U of valid rows, even if not finite). The v tile is rewritten in place: only this partition
        reads v. Returns (w, u) in ACC_W / ACC_U, every wgmma waited."""
        dt: gl.constexpr = k_s.dtype
        ks = gl.where(gl.expand_dims(rk < eos, 1), k_s.index(st).load(LK).to(gl.float32) * gl.expand_dims(bg, 1),
                      0.).to(dt)
        wk_s.index(j).store(ks)
        vs = gl.where(gl.expand_dims(rv < eos, 1),
                      v_s.index(st).load(LV).to(gl.float32) * gl.expand_dims(beta_v, 1), 0.).to(dt)
        v_s.index(st).store(vs)
        fence_async_shared()                                       # generic stores -> wgmma (async proxy)
        gl.thread_barrier()
        w = warpgroup_mma(t_s.index(st), wk_s.index(j), gl.zeros([BT, K], gl.float32, ACC_W), use_acc=False,
                          is_async=True)
        u = warpgroup_mma(t_s.index(st), v_s.index(st), gl.zeros([BT, BV], gl.float32, ACC_U), use_acc=False,
                          is_async=True)
        w, u = warpgroup_mma_wait(0, deps=[w, u])
        return w, u

    @gluon.jit
    def _wu_worker(k_s, v_s, t_s, wk_s, ready, empty, wu_full, wu_empty, beta_ptr, gcum_ptr, nchunks, bos, eos, hv,
                   HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
                   NWU: gl.constexpr, AREG: gl.constexpr):
        dt: gl.constexpr = k_s.dtype
        LK: gl.constexpr = ws_rows_layout(K, dt.primitive_bitwidth, 4)     # the k tile [BT, K], 16-byte vectors
        LV: gl.constexpr = ws_rows_layout(BV, dt.primitive_bitwidth, 4)    # the v tile [BT, BV]
        ACC_W: gl.constexpr = ws_acc_layout(K)
        ACC_U: gl.constexpr = ws_acc_layout(BV)
        # AREG: the gates scale Tinv's COLUMNS in registers (Tinv diag(b) k == Tinv (b * k)) and Tinv is the wgmma's
        # register A operand, B the ring's k and v tiles as TMA wrote them: no scaled copy of k and v goes through
        # shared memory (round 16's ncu source view: that copy was ~57% of this partition's time, and this
        # partition the chain's bound at B1). The gates are carried in the k / v row layouts and moved to the A
        # operand's column layout at use.
        LAW: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_W, k_width=2)
        LAU: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_U, k_width=2)
        r_k = gl.arange(0, BT, layout=gl.SliceLayout(1, LK))
        r_v = gl.arange(0, BT, layout=gl.SliceLayout(1, LV))
        # The gates (wu_kernel's masked loads: gam = 0 and beta = 0 past the end) are loaded one chunk AHEAD and
        # carried through the loop: round 15 measured this partition as the chain's bound at BV=32 (~2.5 us per
        # chunk against the fused-ws chain's 1.6) with the loads issued at the top of their own iteration, where
        # their global latency sits right before the first use once the barrier waits are short.
        gam_raw, bk_raw, bv_raw = _wu_gates(gcum_ptr, beta_ptr, bos, eos, hv, r_k, r_v, HV)
        for c in range(nchunks):
            t0 = bos + c * BT
            st = c % STAGES
            j = c % NWU
            if not AREG:
                rk = t0 + r_k
                rv = t0 + r_v
            # next chunk's gates in flight during this chunk (rows past eos masked: nothing read past the end)
            gam_nx, bk_nx, bv_nx = _wu_gates(gcum_ptr, beta_ptr, t0 + BT, eos, hv, r_k, r_v, HV)
            if not AREG:
                bg = bk_raw.to(gl.float32) * gl.exp(gam_raw)
                beta_v = bv_raw.to(gl.float32)
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)
            mbarrier.wait(wu_empty.index(j), ((c // NWU) & 1) ^ 1)      # product 1 of chunk c - NWU is done
            if AREG:
                # (the scales are formed inside each branch here: formed once before it, they spilled 4 bytes)
                if t0 + BT > eos:
                    # the sequence's last chunk, whose box holds the next sequence's rows: the scaled copies with
                    # those rows selected to 0, as without AREG (a column scale of 0 would meet them as 0 * x,
                    # which is not 0 for x not finite)
                    w, u = _wu_scaled_in_smem(k_s, v_s, t_s, wk_s, st, j, t0 + r_k, t0 + r_v, eos,
                                              bk_raw.to(gl.float32) * gl.exp(gam_raw), bv_raw.to(gl.float32), LK,
                                              LV, ACC_W, ACC_U, K, BT, BV)
                else:
                    # the gates stay in the row layouts while carried (a column slice of the A operand holds 16 per
                    # thread and vector: the prefetched copies spilled); moved to the columns here
                    bw = gl.convert_layout(bk_raw.to(gl.float32) * gl.exp(gam_raw), gl.SliceLayout(0, LAW))
                    bu = gl.convert_layout(bv_raw.to(gl.float32), gl.SliceLayout(0, LAU))
                    aw = (t_s.index(st).load(LAW).to(gl.float32) * gl.expand_dims(bw, 0)).to(dt)
                    au = (t_s.index(st).load(LAU).to(gl.float32) * gl.expand_dims(bu, 0)).to(dt)
                    w = warpgroup_mma(aw, k_s.index(st), gl.zeros([BT, K], gl.float32, ACC_W), use_acc=False,
                                      is_async=True)
                    u = warpgroup_mma(au, v_s.index(st), gl.zeros([BT, BV], gl.float32, ACC_U), use_acc=False,
                                      is_async=True)
                    w, u = warpgroup_mma_wait(0, deps=[w, u])
            else:
                w, u = _wu_scaled_in_smem(k_s, v_s, t_s, wk_s, st, j, rk, rv, eos, bg, beta_v, LK, LV, ACC_W, ACC_U,
                                          K, BT, BV)
            gl.thread_barrier()                                        # every warp's wgmma has read its operands
            wk_s.index(j).store(w.to(dt))
            v_s.index(st).store(u.to(dt))
            fence_async_shared()                                       # w -> state's wgmma; k, v, Tinv -> next TMA
            gl.thread_barrier()
            mbarrier.arrive(wu_full.index(j))
            mbarrier.arrive(empty.index(st))
            gam_raw, bk_raw, bv_raw = gam_nx, bk_nx, bv_nx

    # ------------------------------------------------------------------ worker 0: the output (1 warpgroup)
    @gluon.jit
    def _ex2_ftz(x):
        """2^x by one MUFU.EX2 (ex2.approx.ftz: results below 2^-126 flush to 0). gl.exp2 / gl.exp add a range fix-up
        for denormal results (FSETP and two FMUL per element) that a gate factor of < 1e-38 does not need."""
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _output_pipelined(q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                          nchunks, bos, eos, hv, vb,
                          HV: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                          STAGES: gl.constexpr, NPUB: gl.constexpr, o_lo=0, WARM: gl.constexpr = False,
                          QK_DONE: gl.constexpr = False, PUB_T: gl.constexpr = False):
        """chunk_fused_ws._ws_output with q k^T one chunk ahead (OUT_PIPE): the q k^T of chunk c + 1 is issued as soon
        as chunk c's products are waited, so it runs on the tensor cores while this warpgroup forms chunk c's gated
        attention; the gates are loaded one chunk ahead in log2 units and exponentiated by ex2.approx.ftz, without
        the mask before the exponential (the select after it discards the upper triangle, inf included).
        Round 17's ncu source view: this warpgroup was ~97% busy at B1 (the chain's bound), the state waiting 28% on
        pub_empty and the wu warpgroup 25% on ready behind it.
        The q k^T issued in the last iteration (chunk nchunks) reads a ring slot that no copy is landing in (the
        producer's last copy is chunk nchunks - 1, in another slot; an earlier copy into this one was waited) and is
        discarded; it is waited before the partition ends.
        QK_DONE: no wgmma is in flight across the loop's entry or back edge: the first q k^T is waited before the loop
        and each next one with chunk c's output product (it is complete there anyway: wait(0)), so the loop carries a
        finished [BT, BT] tile. Where another partition in the same switch loop reads its own accumulators (the
        gate-free kernel's second state partition), ptxas otherwise serialises every wgmma of the kernel (C7514:
        non-wgmma instructions reading accumulator registers inside a pipeline stage, the loop-carried copies).
        PUB_T: the published pair is transposed, S^T in s_pub [BV, K] and vnew^T in v_pub [BV, BT] (the gate-free
        kernel's STATE_T partitions hold S^T); q S and att vnew read them as transposed views (K-major B operands)."""
        dt: gl.constexpr = q_s.dtype
        LOG2E: gl.constexpr = 1.4426950408889634
        ACC_A: gl.constexpr = ws_acc_layout(BT)               # q k^T [BT, BT]
        ACC_O: gl.constexpr = ws_acc_layout(BV)               # o [BT, BV]
        OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_O, k_width=2)
        LO: gl.constexpr = ws_rows_layout(BV, dt.primitive_bitwidth, 4)
        r_a, lower, r_o, c_o = _ws_output_index(vb, BT, BV, ACC_A, LO)
        gam = gl.load(gcum_ptr + (bos + r_a) * HV + hv, mask=(bos + r_a) < eos, other=0.) * LOG2E
        if nchunks > 0:
            mbarrier.wait(ready.index(0), 0)
        qk = warpgroup_mma(q_s.index(0), k_s.index(0).permute((1, 0)), gl.zeros([BT, BT], gl.float32, ACC_A),
                           use_acc=False, is_async=True)
        if QK_DONE:
            qk = warpgroup_mma_wait(0, deps=[qk])
        for c in range(nchunks):
            t0 = bos + c * BT
            st = c % STAGES
            j = c % NPUB
            t1 = t0 + BT
            gam_n = gl.load(gcum_ptr + (t1 + r_a) * HV + hv, mask=(t1 + r_a) < eos, other=0.) * LOG2E
            mbarrier.wait(s_full.index(j), (c // NPUB) & 1)
            if PUB_T:
                s_b = s_pub.index(j).permute((1, 0))
            else:
                s_b = s_pub.index(j)
            qs = warpgroup_mma(q_s.index(st), s_b, gl.zeros([BT, BV], gl.float32, ACC_O), use_acc=False,
                               is_async=True)
            if QK_DONE:
                qkv = qk
                qs = warpgroup_mma_wait(0, deps=[qs])
            else:
                qkv, qs = warpgroup_mma_wait(0, deps=[qk, qs])
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st))                   # q, k read by wgmma only (async -> async: no fence)
            st1 = (c + 1) % STAGES
            if c + 1 < nchunks:
                mbarrier.wait(ready.index(st1), ((c + 1) // STAGES) & 1)
            qk_n = warpgroup_mma(q_s.index(st1), k_s.index(st1).permute((1, 0)),
                                 gl.zeros([BT, BT], gl.float32, ACC_A), use_acc=False, is_async=True)
            # the intra-chunk attention: exp2 of the log2-unit gate differences, the upper triangle selected to 0
            gmat = _ex2_ftz(gl.expand_dims(gam, 1) - gl.expand_dims(gl.convert_layout(gam, gl.SliceLayout(0, ACC_A)), 0))
            att = gl.convert_layout(gl.where(lower, qkv * gmat, 0.).to(dt), OPA)
            o = qs * gl.expand_dims(_ex2_ftz(gl.convert_layout(gam, gl.SliceLayout(1, ACC_O))), 1)
            mbarrier.wait(v_full.index(j), (c // NPUB) & 1)
            if PUB_T:
                v_b = v_pub.index(j).permute((1, 0))
            else:
                v_b = v_pub.index(j)
            o = warpgroup_mma(att, v_b, o, is_async=True)
            if QK_DONE:
                o, qk_n = warpgroup_mma_wait(0, deps=[o, qk_n])
            else:
                o = warpgroup_mma_wait(0, deps=[o])           # in order: the next q k^T is done too
            gl.thread_barrier()
            mbarrier.arrive(pub_empty.index(j))                # s_pub[j], v_pub[j] read by wgmma only
            _ws_store_o(o, o_ptr, scale, t0, eos, hv, r_o, c_o, HV, V, LO, o_lo, WARM)
            gam = gam_n
            qk = qk_n
        if not QK_DONE:
            qkv = warpgroup_mma_wait(0, deps=[qk])              # no chunk: the first q k^T is still in flight

    @gluon.jit
    def _segment_word(seg_ptr, nh, n, bos, nchunks, BT: gl.constexpr):
        """The segment warm-up of program nh (segment_start.segment_windows), shared by this kernel and
        chunk_fused_gf.py: with seg_ptr, "sequence" n is a segment whose word (SEGW_*) gives the chain's start wl
        chunks before it (from h0 of the whole sequence where the window reaches that sequence's start, else from 0),
        whether it is its sequence's last segment (the only one storing a final state) and the sequence's index (the
        h0 / final row). Returns (o_lo: no o row stored before it, the h0 / final row, the chain's first token, its
        chunk count, h0 flag, final-state flag); without seg_ptr the plain sequence's."""
        if seg_ptr is not None:
            word = gl.load(seg_ptr + nh)
            wl = word & SEGW_WL_MASK
            return bos, word >> SEGW_SEQ_SHIFT, bos - wl * BT, nchunks + wl, word & SEGW_H0, word & SEGW_LAST
        else:
            return bos, n, bos, nchunks, 1, 1

    @gluon.jit
    def _wu_output(q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                   nchunks, bos, eos, hv, vb,
                   HV: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                   STAGES: gl.constexpr, NPUB: gl.constexpr, OUT_PIPE: gl.constexpr, o_lo, WARM: gl.constexpr,
                   QK_DONE: gl.constexpr = False, PUB_T: gl.constexpr = False):
        if OUT_PIPE:
            _output_pipelined(q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr,
                              scale, nchunks, bos, eos, hv, vb, HV, V, BT, BV, STAGES, NPUB, o_lo, WARM, QK_DONE,
                              PUB_T)
        else:
            _ws_output(q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                       nchunks, bos, eos, hv, vb, HV, V, BT, BV, STAGES, NPUB, o_lo, WARM)

    # ------------------------------------------------------------------ the kernel
    @gluon.jit
    def chunk_fused_wu_ws_kernel(
        q_desc, k_desc, v_desc, t_desc,        # TMA over q, k [T_tot, H*K], v [T_tot, HV*V], Tinv [T_tot, HV*BT]
        beta_ptr, gcum_ptr, o_ptr,             # beta [T_tot, HV] (any float), gcum [T_tot, HV] fp32; o [T_tot, HV, V]
        h0_ptr, ht_ptr,                        # optional: initial / final state [N, HV, K, V] fp32 (or None)
        cu_ptr, chunk_off_ptr, scale,          # the chunk plan (triton/chunk_indices.py); scale
        sel_ptr,                               # optional int32 (or None): without seg_ptr, [N * HV], (sequence, head)
                                               # pairs run where != 0; with seg_ptr, [sequences * HV] indexed by the
                                               # segment's sequence: its segments run where == 0
        seg_ptr,                               # optional [N * HV] int32 (or None): segment words (segment_start.py)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
        STAGES: gl.constexpr, NWU: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        OUTPUT_REGS: gl.constexpr, WU_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, WU_AREG: gl.constexpr = False,
        OUT_PIPE: gl.constexpr = False,
    ):
        dt: gl.constexpr = k_desc.dtype
        vb = gl.program_id(0)
        nh = gl.program_id(1)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)
        WARM: gl.constexpr = seg_ptr is not None            # the segment warm-up (_segment_word)
        o_lo, state_n, bos, nchunks, h0_on, ht_on = _segment_word(seg_ptr, nh, n, bos, nchunks, BT)
        if WARM:
            if sel_ptr is not None:
                # a segment of a (sequence, head) that runs unsegmented (the other launch) does nothing
                if gl.load(sel_ptr + state_n * HV + hv) != 0:
                    return
        else:
            if sel_ptr is not None:
                # a pair not selected does nothing: no o row, no final state (the segment-parallel forward's other
                # launch writes them: chunk_gated_delta_rule_fwd_fused_wu)
                if gl.load(sel_ptr + nh) == 0:
                    return

        q_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [STAGES, BT, BV], v_desc.layout)
        t_s = gl.allocate_shared_memory(dt, [STAGES, BT, BT], t_desc.layout)
        wk_s = gl.allocate_shared_memory(dt, [NWU, BT, K], k_desc.layout)
        s_pub = gl.allocate_shared_memory(dt, [NPUB, K, BV], ws_smem_layout(BV, dt.primitive_bitwidth))
        v_pub = gl.allocate_shared_memory(dt, [NPUB, BT, BV], v_desc.layout)
        vn_s = gl.allocate_shared_memory(dt, [BT, BV], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        wu_full = gl.allocate_shared_memory(gl.int64, [NWU, 1], mbarrier.MBarrierLayout())
        wu_empty = gl.allocate_shared_memory(gl.int64, [NWU, 1], mbarrier.MBarrierLayout())
        s_full = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        pub_empty = gl.allocate_shared_memory(gl.int64, [NPUB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=3)             # state + output + wu partitions
        for i in gl.static_range(NWU):
            mbarrier.init(wu_full.index(i), count=1)
            mbarrier.init(wu_empty.index(i), count=1)
        for i in gl.static_range(NPUB):
            mbarrier.init(s_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(pub_empty.index(i), count=1)
        fence_async_shared()                                     # barrier inits visible to the async proxy

        gl.warp_specialize(
            [(_ws_state, (k_s, wk_s, v_s, ready, empty, wu_full, wu_empty, s_pub, v_pub, vn_s, s_full, v_full,
                          pub_empty, gcum_ptr, None, None, h0_ptr, ht_ptr, nchunks, bos, eos, slot0, state_n, hv,
                          vb, HV, K, V, BT, BV, STAGES, NWU, NPUB, USE_H0, STORE_HT, False, False,   # no h, vnew
                          True, True, WARM, h0_on, ht_on)),      # WU_FED: W in wk_s, U in the v tile; STATES_IN_ACC
             (_wu_output, (q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                           nchunks, bos, eos, hv, vb, HV, V, BT, BV, STAGES, NPUB, OUT_PIPE, o_lo, WARM)),
             (_wu_worker, (k_s, v_s, t_s, wk_s, ready, empty, wu_full, wu_empty, beta_ptr, gcum_ptr, nchunks, bos,
                           eos, hv, HV, K, BT, BV, STAGES, NWU, WU_AREG)),
             (_wu_producer, (q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, nchunks, bos, hv, hk,
                             vb, K, V, BT, BV, STAGES))],
            worker_num_warps=[4, 4, 1], worker_num_regs=[OUTPUT_REGS, WU_REGS, PRODUCER_REGS])

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        for i in gl.static_range(NWU):
            mbarrier.invalidate(wu_full.index(i))
            mbarrier.invalidate(wu_empty.index(i))
        for i in gl.static_range(NPUB):
            mbarrier.invalidate(s_full.index(i))
            mbarrier.invalidate(v_full.index(i))
            mbarrier.invalidate(pub_empty.index(i))


# ---------------------------------------------------------------------------------------------------- launcher

@dataclass(frozen=True)
class FusedWuConfig:
    BV: int
    stages: int            # TMA ring depth
    nwu: int = NWU         # W buffers
    num_warps: int = 4     # the default (state) partition; the kernel launches 16 warps (4 warpgroups)
    areg: bool = False     # WU_AREG: Tinv as the W/U wgmma's register A operand (fused_wu_config: on unless
                           # LINATTN_GDN_GLUON_WU_AREG=0; at BV=64 with output / wu at 136 / 192: 24 bytes spill at
                           # these defaults)
    output_regs: int = OUTPUT_REGS   # setmaxnreg of the output / wu warpgroups (the state's follows: 512 - 24 - both)
    wu_regs: int = WU_REGS           # BV=64 with areg compiles without spill at 136 / 192 (state 160; round 16, AOT)
    out_pipe: bool = False           # OUT_PIPE: the output warpgroup issues q k^T one chunk ahead (_output_pipelined)


def fused_wu_config(N: int, HV: int, V: int, num_sms: int, bv16: bool = True) -> FusedWuConfig:
    """V split as chunk_fused_ws.fused_ws_config: BV=64 unless N*HV*V/64 programs would leave SMs idle, then 32.
    Ring depth 3 at BV=32 (200 860 B of shared memory), 2 at BV=64 (196 732 B; 3 stages would need ~246 KB).
    WU_AREG unless LINATTN_GDN_GLUON_WU_AREG=0, and with it (defaults since round 17, H200 gate green, 1.11-1.18x
    the fused kernel at every production row): OUT_PIPE at BV=32 (wu warpgroup at 160 registers; off with
    LINATTN_GDN_GLUON_OUT_PIPE=0) and WU_AREG at BV=64 with the output / wu warpgroups at 136 / 192 (off with
    LINATTN_GDN_GLUON_WU_AREG64=0). LINATTN_GDN_GLUON_OUT_PIPE64=1 (opt-in) adds OUT_PIPE at BV=64 (output / wu at
    152 / 176). BV=16 (as the BV=32 default otherwise; default since round 21, LINATTN_GDN_GLUON_BV16=0 off) where
    N * HV * V / 16 programs still fit the SMs, unless bv16=False (the W/U segment launch, seg_ptr)."""
    from linattn.runtime.settings import settings
    bv = 64
    while bv > 32 and N * HV * (V // bv) < num_sms:
        bv //= 2
    areg = settings.gdn_gluon_wu_areg
    if bv == 64:
        if areg and settings.gdn_gluon_wu_areg64:        # default since round 17: WU_AREG at BV=64 needs these registers
            if settings.gdn_gluon_out_pipe64:            # opt-in (after round 17): OUT_PIPE there, 0 spill only here
                return FusedWuConfig(64, 2, areg=True, out_pipe=True, output_regs=152, wu_regs=176)
            return FusedWuConfig(64, 2, areg=True, output_regs=136, wu_regs=192)
        return FusedWuConfig(64, 2)
    if bv16 and settings.gdn_gluon_bv16 and N * HV * (V // 16) <= num_sms and areg and settings.gdn_gluon_out_pipe:
        # default since round 21 (H200: gate green, bit-equal to BV=32, forward 1.045-1.057x at H2/HV8 B1-B2):
        # 16-column blocks where they still fit one wave, twice the CTAs of BV=32, each with half the V-dependent work
        return FusedWuConfig(16, 3, areg=True, out_pipe=True, wu_regs=160)
    if areg and settings.gdn_gluon_out_pipe:             # default since round 17 (4 bytes spill at 160 / 152 / 176)
        return FusedWuConfig(32, 3, areg=True, out_pipe=True, wu_regs=160)
    return FusedWuConfig(32, 3, areg=areg)


def fused_wu_supported(q: torch.Tensor, v: torch.Tensor, beta: Optional[torch.Tensor] = None,
                       cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[bool, str]:
    """Whether the fused-wu kernel takes this call (on top of the gluon backend's supports(): sm_90a, no
    interpreter). Varlen is taken (the kernel masks as chunk_fused_ws.py and wu_kernel do)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"dtype {q.dtype}: the fused-wu kernel takes bf16 or fp16"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"K={q.shape[-1]}, V={v.shape[-1]}: the fused-wu kernel is built for K == V == 128"
    if q.shape[0] * q.shape[1] == 0:
        return False, "no tokens: the TMA descriptors need a non-empty [T, heads*dim] view"
    if v.shape[2] % q.shape[2]:
        return False, "HV must be a multiple of H"
    if beta is not None and not beta.is_floating_point():
        return False, f"beta is {beta.dtype}: a float dtype is needed"
    return True, ""


def _selection(t: Optional[torch.Tensor], n: Optional[int], name: str = "select",
               per: str = "sequence") -> Optional[torch.Tensor]:
    """The kernel's sel_ptr (or seg_ptr): None, or the tensor as a contiguous int32 of n elements (n None: any size,
    the caller checks the shape; checked, never copied from host)."""
    if t is None:
        return None
    if t.dtype != torch.int32 or not t.is_contiguous() or (n is not None and t.numel() != n):
        raise ValueError(f"{name} must be a contiguous int32 tensor of {n if n is not None else '[sequences, HV]'} "
                         f"elements (one per {per} and value head), got {t.dtype} {tuple(t.shape)}")
    return t


def selection_args(select: Optional[torch.Tensor], seg: Optional[torch.Tensor], N: int, HV: int) -> tuple:
    """The kernels' (sel_ptr, seg_ptr), checked (_selection): without seg, select is [N, HV] over the plan's
    sequences; with seg ([N, HV] segment words over the plan's segments), select is [sequences, HV]."""
    if seg is not None and select is not None and (select.dim() != 2 or select.shape[1] != HV):
        raise ValueError(f"select is {tuple(select.shape)}: with segment words it is [sequences, HV={HV}]")
    return _selection(select, None if seg is not None else N * HV), _selection(seg, N * HV, "seg", "segment")


_DESC_TEMPLATES = None   # PlanCache of DescriptorFactory per (2-D view shape, strides, box, dtype): _fused_desc


def _fused_desc(cls, t2d: torch.Tensor, block, gdt):
    """TensorDescriptor.from_tensor(t2d, block, NVMMASharedLayout.get_default_for(block, gdt)), with the host path's
    descriptor templates (runtime/host_path.py, LINATTN_GLUON_HOST_CACHE, as the state pass's): the first descriptor
    of a (shape, strides, box, dtype) is built and validated by the constructor, later ones copy its fields and take
    this call's base (the layout, validation and dataclass construction were ~1/3 of an eager fused forward's host
    time: RESULTS.md round 23 part C). With the cache off, built afresh every call."""
    global _DESC_TEMPLATES
    from linattn.ops.gated_delta_rule.gluon.launcher import host_path
    from linattn.runtime.host_path import DescriptorFactory, PlanCache
    if not host_path.plan_cache:
        return cls.from_tensor(t2d, block, gl.NVMMASharedLayout.get_default_for(block, gdt))
    if _DESC_TEMPLATES is None:
        _DESC_TEMPLATES = PlanCache(host_path)
    shape, strides = t2d.shape, t2d.stride()      # as from_tensor passes them (a torch.Size, a tuple)
    factory = _DESC_TEMPLATES.get((cls, tuple(shape), strides, tuple(block), gdt), lambda: DescriptorFactory(
        cls, shape, strides, list(block), gl.NVMMASharedLayout.get_default_for(block, gdt), host_path))
    return factory(t2d)


def clear_desc_templates() -> None:
    """Forget the fused launches' descriptor templates."""
    if _DESC_TEMPLATES is not None:
        _DESC_TEMPLATES.clear()


def fused_wu_args(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float, BV: int) -> tuple:
    """The kernel arguments up to scale shared by chunk_fused_wu_ws_kernel and chunk_fused_gf_kernel: TMA descriptors
    over q, k ([BT, K] boxes), v ([BT, BV]) and Tinv ([BT, BT]), then beta, gcum, o, the states, the plan, scale."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import _gl_dtype
    from linattn.runtime.gluon_compat import TensorDescriptor
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    T_tot = plan.T_total
    dt = q.dtype
    for name, t in (("k", k), ("v", v), ("tinv", tinv)):
        if t.dtype != dt:
            raise ValueError(f"{name} is {t.dtype}, q is {dt}: the fused-wu kernel takes one 16-bit dtype")
    if tuple(tinv.shape) != (T_tot, HV, BT):
        raise ValueError(f"tinv is {tuple(tinv.shape)}, expected {(T_tot, HV, BT)}")
    gdt = _gl_dtype(dt)

    def desc(t2d, block):
        return _fused_desc(TensorDescriptor, _aligned(t2d), block, gdt)

    return (desc(q.reshape(T_tot, H * K), [BT, K]), desc(k.reshape(T_tot, H * K), [BT, K]),
            desc(v.reshape(T_tot, HV * V), [BT, BV]), desc(tinv.reshape(T_tot, HV * BT), [BT, BT]),
            beta.reshape(T_tot, HV), gcum, o, initial_state, final, plan.cu, plan.chunk_offsets, float(scale))


def fused_wu_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float, cfg: FusedWuConfig,
                    select: Optional[torch.Tensor] = None, seg: Optional[torch.Tensor] = None):
    """(kernel, grid, args, kwargs) of one launch of chunk_fused_wu_ws_kernel (separate from the launch so that a
    CPU test can check the arguments against the AOT signature, aot.py fused_wu_signature).
    q, k [B,T,H,K]; v [B,T,HV,V]; beta [B,T,HV] (any float dtype, contiguous); gcum [T_tot,HV] fp32 and
    tinv [T_tot,HV,64] in q's dtype (kkt_solve_kernel's outputs); o [B,T,HV,V] (written); initial_state / final
    [N,HV,K,V] fp32 or None; select [N, HV] int32 or None: only the (sequence, head) pairs where it is != 0 run (the
    others' CTAs exit at once: no o row, no final state written); seg [N, HV] int32 or None: the plan's sequences are
    segments and seg holds their segment words (segment_start.SEGW_*: sequence n's chain for head hv starts wl chunks
    before it, from the initial state of its whole sequence or from 0, stores no o row there and its final state
    only if it is its sequence's last segment; initial_state / final are then [sequences, HV, K, V]), and select is
    [sequences, HV]: the segments of a pair where it is != 0 exit at once (that pair runs unsegmented)."""
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    N = plan.N
    args = fused_wu_args(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, cfg.BV) + selection_args(
        select, seg, N, HV)
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, STAGES=cfg.stages, NWU=cfg.nwu, NPUB=NPUB,
                  USE_H0=initial_state is not None, STORE_HT=final is not None, OUTPUT_REGS=cfg.output_regs,
                  WU_REGS=cfg.wu_regs, PRODUCER_REGS=PRODUCER_REGS, WU_AREG=cfg.areg, OUT_PIPE=cfg.out_pipe,
                  num_warps=cfg.num_warps)
    return chunk_fused_wu_ws_kernel, (V // cfg.BV, N * HV), args, kwargs


def chunk_fused_wu_ws_gluon(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float,
                            config: Optional[FusedWuConfig] = None, select: Optional[torch.Tensor] = None,
                            seg: Optional[torch.Tensor] = None) -> None:
    """Stages 2b + 3 + 4 on sm_90a: writes o (and final when given) from q, k, v, beta and kkt_solve's gcum and
    Tinv. Launched through the host path (launcher.launches: the compiled kernel's handle; descriptors from
    templates, _fused_desc)."""
    from linattn.runtime.device import device_facts
    # BV=16 is gated on the GPU without segment words only: plain (round 21) and with the selection of the
    # segment-parallel forward's unsegmented launch (round 23, segments_round SEG_KIND=gf, H2/HV8 mixed decay)
    cfg = config or fused_wu_config(plan.N, v.shape[-2], v.shape[-1], device_facts(q.device).num_sms,
                                    bv16=seg is None)
    from linattn.ops.gated_delta_rule.gluon.launcher import launches
    kernel, grid, args, kwargs = fused_wu_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, cfg,
                                                 select, seg)
    launches(kernel, grid, args, kwargs)


def kkt_solve(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan, HV: int):
    """Stage 2a alone (triton/intra_split.py kkt_kernel(): kkt_solve_v4_kernel by default, LINATTN_GDN_KKT picks
    another; the frozen config; kkt_order's program order): gcum fp32 [T_tot, HV] and Tinv [T_tot, HV, 64] in k's
    dtype, the precision wu_kernel (and this kernel) multiplies it at."""
    from linattn.ops.gated_delta_rule.triton.intra_split import kkt_order, kkt_solve_kernel, split_intra_config
    from linattn.runtime.alloc import empty
    from linattn.runtime.settings import settings
    if settings.gdn_gluon_kkt != "off":       # opt-in: stage 2a in Gluon (gluon/kkt_solve.py)
        from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
        ok, _ = gk.kkt_gluon_supported(k, HV, plan.T_total)
        if ok:
            return gk.kkt_solve_gluon(k, g, beta, plan, HV, settings.gdn_gluon_kkt, settings.gdn_gluon_kkt_maxnreg)
    H, K = k.shape[-2], k.shape[-1]
    cfg = split_intra_config(K, K)
    gcum = empty(plan.T_total, HV, dtype=torch.float32, device=k.device)
    tinv = empty(plan.T_total, HV, BT, dtype=k.dtype, device=k.device)
    from linattn.ops.gated_delta_rule.gluon.launcher import launches
    launches(kkt_solve_kernel, (plan.num_slots, HV), (k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N),
             dict(H=H, HV=HV, K=K, BT=BT, BK=cfg.BK_kkt, DOT_PREC="ieee" if k.dtype == torch.float32 else "tf32",
                  num_warps=cfg.warps_kkt, **kkt_order(plan.num_slots)))
    return gcum, tinv


def segments_wanted(B: int, T: int, HV: int, V: int, cu_seqlens, device) -> Tuple[int, int]:
    """(S, L) of the segment-parallel forward (LINATTN_GDN_GLUON_SEGMENTS; triton/segment_start.py), or (1, chunks):
    fixed-length batches with too few sequence-heads to fill the GPU at BV = 64 (segment_start.plan_segments). No
    condition on the inputs: the start-state kernel sends a head unsegmented where its warm-up bound does not hold."""
    from linattn.ops.gated_delta_rule.triton.segment_start import plan_segments
    from linattn.runtime.device import device_facts
    from linattn.runtime.settings import settings
    nch = -(-T // BT)
    if not settings.gdn_gluon_segments or cu_seqlens is not None:
        return 1, nch
    facts = device_facts(device)
    return plan_segments(B, T, HV, V, facts.num_sms if facts.kind == "cuda" else 132)


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> "torch.cuda.Stream":
    """One side stream per device for the segment-parallel forward, at the highest priority (-100, mapped to the
    highest valid): the unsegmented heads' launch (their chains are the critical path) and, with the warm-up in the
    kernel, the window kernel before it (_segments). Round 18 timed the two launches apart: they overlap cleanly
    (both = the longer + 13 us at mixed decay; OPT_LOG 18.3-18.4); round 19 found the order and priority to matter
    by ~10-20 us (OPT_LOG 19.2-19.3)."""
    key = torch.device(device).index
    if key is None:
        key = torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key, priority=-100)
    return _SIDE_STREAMS[key]


def chunk_gated_delta_rule_fwd_fused_wu(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                        output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                                        fused_pass=None, segments=None, segment_pass=None):
    """The whole forward with this kernel: kkt_solve (stage 2a, Triton), then stages 2b + 3 + 4 in one launch.
    Same arguments as triton/forward.py chunk_gated_delta_rule_fwd; returns its FwdResult with o, final_state,
    gcum and the plan (w, u, h, vnew, tinv None: never stored). For the op linattn::chunk_gdn_fwd_gluon, whose
    backward recomputes from the saved inputs. fused_pass(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale,
    select=None[, seg=None]) replaces the Gluon launch (CPU tests pass the schedule model; seg only for segments).
    Segments (opt-in LINATTN_GDN_GLUON_SEGMENTS=1, segments_wanted; `segments` = (S, L) forces them): each sequence
    is cut into S segments of L chunks, each started a gate-truncated warm-up early (exact where the window reaches
    the sequence start; segment_start.py). A (sequence, head) none of whose segments is flagged (every warm-up window
    short enough) runs as S independent segments: one fused launch on the segment plan (segment_start.segment_plan),
    whose CTAs read their segment word (the warm-up length, h0 or 0, last segment or not); the others (slow decay
    somewhere) run unsegmented: one fused launch on the sequence plan, selected to them, on a side stream so that
    both run at once (no host synchronisation: the selection is read in the kernels). Both launches read h0 and
    write the final state straight from / into the caller's tensors; _segments gives the order on the GPU.
    segment_pass (same arguments as fused_pass, with select and seg) runs the segment launch in place of fused_pass:
    the gate-free BV=128 kernel's segments (chunk_fused_gf.gf_segments_wanted; the unsegmented pairs stay on
    fused_pass)."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.forward import FwdResult
    from linattn.runtime.alloc import empty
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    plan = make_chunk_plan(B, T, cu_seqlens, BT, q.device)
    run = fused_pass or chunk_fused_wu_ws_gluon
    S, L = segments or segments_wanted(B, T, HV, V, cu_seqlens, q.device)
    if S > 1:
        if cu_seqlens is not None:
            raise ValueError("segments: fixed-length batches only (cu_seqlens given)")
        o, final, gcum = _segments(run, segment_pass or run, q, k, v, g, beta, scale, initial_state,
                                   output_final_state, plan, S, L)
        return FwdResult(o, final, gcum, None, None, None, None, None, plan)
    gcum, tinv = kkt_solve(k, g, beta, plan, HV)
    o = empty(B, T, HV, V, dtype=v.dtype, device=q.device)
    final = empty(plan.N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    run(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale)
    return FwdResult(o, final, gcum, None, None, None, None, None, plan)


def _segments(run, seg_run, q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, plan, S: int,
              L: int):
    """The segment-parallel forward, each segment's warm-up inside the fused kernel: (o, final, gcum); `run` launches
    the unsegmented pairs (sequence plan, select), `seg_run` the segments (segment plan, select and seg). Order on the
    GPU (no host synchronisation; two streams joined at the end):
      side stream (highest priority): slow := 0, segment_window_kernel (segment words, slow) from the inputs k,
                    beta and g, next to kkt_solve (its CTAs dispatched ahead of kkt_solve's pending ones); then, once
                    kkt_solve is done, the unsegmented launch of the pairs with slow != 0 (sequence plan): their
                    chains are the critical path wherever a pair is slow, so they take the SMs first
      main stream:  kkt_solve; then, once the window kernel is done, the segment launch (segment plan, BV=64; its
                    segments of the pairs with slow != 0 exit at once)
    Round 19 (OPT_LOG 19.1-19.3, RESULTS.md round 19): two other orders were measured (the window kernel after
    kkt_solve on the main stream; the window kernel and the segment launch on a default-priority side stream); none
    gave the rows with a slow head 1.00x, and the same order moves by ~2% there between calls (this one: 0.981x and
    1.005x with every head slow at B1 T65536 in two calls).
    Both launches read h0 and store the final state straight from / into the caller's [B, HV, K, V] tensors."""
    from linattn.ops.gated_delta_rule.gluon.launcher import launches
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan, segment_windows
    from linattn.runtime.alloc import empty
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    splan = segment_plan(B, T, S, L, q.device)
    o = empty(B, T, HV, V, dtype=v.dtype, device=q.device)
    final = empty(B, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None

    def segment_launch():
        seg_run(q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V),
                beta.reshape(1, B * T, HV), gcum, tinv, o.view(1, B * T, HV, V), initial_state, final, splan, scale,
                select=slow, seg=segw)

    if not q.is_cuda:                          # one stream (CPU tests: the interpreter, the schedule model)
        slow, _, segw = segment_windows(k, beta, g, plan, S, L, launch=launches)
        gcum, tinv = kkt_solve(k, g, beta, plan, HV)
        run(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, select=slow)
        segment_launch()
        return o, final, gcum
    side = _side_stream(q.device)
    cur = torch.cuda.current_stream(q.device)
    side.wait_stream(cur)                      # the inputs are ready
    with torch.cuda.stream(side):
        slow, _, segw = segment_windows(k, beta, g, plan, S, L, launch=launches)
    window_done = torch.cuda.Event()
    window_done.record(side)
    slow.record_stream(cur)                    # allocated on the side stream, read on this one
    segw.record_stream(cur)
    gcum, tinv = kkt_solve(k, g, beta, plan, HV)
    side.wait_stream(cur)                      # kkt_solve
    with torch.cuda.stream(side):
        run(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, select=slow)
    cur.wait_event(window_done)
    segment_launch()
    cur.wait_stream(side)                      # before any tensor used on the side stream can be freed or reused
    return o, final, gcum


# ---------------------------------------------------------------------------------------------------- CPU model

def _interleave(parts, inflight, land, rng, where: str) -> int:
    """Runs generator partitions that yield (barrier, parity) at each mbarrier wait (None: a plain scheduling
    point), interleaved by `rng` with the landing of in-flight TMA copies (land(copy), oldest first); a state where
    nobody can move is a deadlock (RuntimeError). Returns the number of steps."""
    waits = [None] * len(parts)
    alive = [True] * len(parts)
    for i, p in enumerate(parts):
        try:
            waits[i] = next(p)
        except StopIteration:
            alive[i] = False
    steps = 0
    while any(alive) or inflight:
        runnable = [i for i in range(len(parts))
                    if alive[i] and (waits[i] is None or waits[i][0].passes(waits[i][1]))]
        choices = runnable + (["tma"] if inflight else [])
        if not choices:
            raise RuntimeError(f"deadlock: {where}, partitions at {waits}")
        pick = rng.choice(choices)
        steps += 1
        if pick == "tma":                      # the oldest copy lands (TMA completes in order per barrier)
            land(inflight.pop(0))
            continue
        try:
            waits[pick] = next(parts[pick])
        except StopIteration:
            alive[pick] = False
            waits[pick] = None
    return steps


def emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float, BV: int = 32,
                        stages: int = 3, nwu: int = NWU, npub: int = NPUB, w_out=None, u_out=None, seed: int = 0,
                        stats: Optional[dict] = None, areg: bool = False, out_pipe: bool = False,
                        select: Optional[torch.Tensor] = None, seg: Optional[torch.Tensor] = None,
                        gate_free: bool = False) -> None:
    """A torch model of chunk_fused_wu_ws_kernel's per-CTA schedule, for CPU tests and the GPU round's dry run (the
    arguments of chunk_fused_wu_ws_gluon). The four partitions (state, output, wu, producer) are generators that
    stop at every mbarrier wait; a seeded random scheduler interleaves them with the landing of the producer's TMA
    copies, so the barrier protocol decides which data each step sees: the in-place buffers are modelled in place
    (the ring's v tile holds v, then v * beta, then U; wk[j] holds the scaled k, then W), so a protocol error shows
    up as a wrong result or as a deadlock (RuntimeError). Boxes as the kernel's: full [BT, .] boxes from a chunk's
    first token (the next sequence's rows included, zero past T_tot); roundings as wu_kernel and chunk_fused_ws.
    w_out [T_tot, HV, K] / u_out [T_tot, HV, V], when given, receive W and U rows < eos (what wu_kernel writes).
    areg models WU_AREG: on chunks that end inside the sequence, W = (Tinv * (beta exp(gam))[None, :]).to(dt) @ k and
    U = (Tinv * beta[None, :]).to(dt) @ v with k and v the ring's tiles as loaded (the sequence's last chunk as
    without areg). out_pipe models OUT_PIPE (_output_pipelined): the output partition waits for chunk c + 1's ring
    slot and reads its q k^T right after releasing chunk c's slot, and forms the gate factors as 2^(log2e gam_i -
    log2e gam_j) flushed to 0 below 2^-126, unmasked before the select. select [N, HV] int32 as the kernel's sel_ptr:
    an unselected (sequence, head) is skipped (no o row, no final state written). seg [N, HV] int32 as the kernel's
    seg_ptr (segment words, segment_start.SEGW_*; select is then [sequences, HV], its pairs != 0 skipped): the chain
    of (n, hv) starts wl chunks before the segment, from initial_state[sequence] where the word says so (else 0), o
    rows stored from the segment start, the final state into final[sequence] only for a last segment.
    gate_free models chunk_fused_gf.py (BV = V = 128 there; any BV here): no wu partition (empty counts 2) and the
    state partition forms x = where(valid, beta (v - e^gam (K @ s_pub)), 0).to(dt) and vnew = where(valid, Tinv @ x,
    0).to(dt) from the ring's k, v and Tinv tiles."""
    import random
    dt = q.dtype
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    T_tot = plan.T_total
    f32 = torch.float32
    pad = lambda t: torch.cat([t, t.new_zeros(BT, *t.shape[1:])])       # noqa: E731  TMA zero-fill past T_tot
    qp, kp = pad(q.reshape(T_tot, H, K)), pad(k.reshape(T_tot, H, K))
    vp, tp = pad(v.reshape(T_tot, HV, V)), pad(tinv.reshape(T_tot, HV, BT))
    beta2 = beta.reshape(T_tot, HV)
    o2 = o.view(T_tot, HV, V)
    cu = plan.cu.tolist()
    rng = random.Random(seed)
    r_t = torch.arange(BT)
    lower = r_t[:, None] >= r_t[None, :]
    nbytes = 2 * (2 * BT * K + BT * BV + BT * BT)
    steps = 0

    def gates(t0, eos, hv):
        rows = t0 + r_t
        m = rows < eos
        gam = torch.where(m, gcum[rows.clamp(max=T_tot - 1), hv], torch.zeros(()))
        bet = torch.where(m, beta2[rows.clamp(max=T_tot - 1), hv].to(f32), torch.zeros(()))
        return gam, bet, gcum[t0 + min(eos - t0, BT) - 1, hv]

    sel = None if select is None else _selection(select, None if seg is not None else plan.N * HV).view(-1, HV).tolist()
    words = None if seg is None else _selection(seg, plan.N * HV, "seg", "segment").view(plan.N, HV).tolist()
    for n in range(plan.N):
        o_lo, eos = cu[n], cu[n + 1]
        nch_seq = -(-max(eos - o_lo, 0) // BT)
        for hv in range(HV):
            seq, w, h0_on, ht_on = n, 0, True, True    # the h0 / final row, warm-up chunks (no o stored there)
            if words is not None:
                word = words[n][hv]
                seq, w = word >> SEGW_SEQ_SHIFT.value, word & SEGW_WL_MASK.value
                h0_on, ht_on = bool(word & SEGW_H0.value), bool(word & SEGW_LAST.value)
            if sel is not None and (sel[seq][hv] != 0 if words is not None else sel[n][hv] == 0):
                continue                               # the kernel's CTAs exit at once: nothing written
            hk = hv // (HV // H)
            bos = o_lo - w * BT
            nch = nch_seq + w
            for vb in range(V // BV):
                cols = slice(vb * BV, (vb + 1) * BV)
                ready = [_MBar(1) for _ in range(stages)]
                empty = [_MBar(2 if gate_free else 3) for _ in range(stages)]
                wu_full = [_MBar(1) for _ in range(nwu)]
                wu_empty = [_MBar(1) for _ in range(nwu)]
                s_full = [_MBar(1) for _ in range(npub)]
                v_full = [_MBar(1) for _ in range(npub)]
                pub_empty = [_MBar(1) for _ in range(npub)]
                ring = [dict() for _ in range(stages)]
                wk = [None] * nwu
                s_pub = [None] * npub
                v_pub = [None] * npub
                inflight = []                          # TMA copies issued, not landed: (slot, tiles)

                def land(copy):
                    s, tiles = copy
                    ring[s] = tiles
                    ready[s].complete_tx(nbytes)

                def producer():
                    for c in range(nch):
                        s = c % stages
                        yield empty[s], ((c // stages) & 1) ^ 1
                        r0 = bos + c * BT
                        ready[s].expect(nbytes)
                        inflight.append((s, dict(q=qp[r0:r0 + BT, hk].clone(), k=kp[r0:r0 + BT, hk].clone(),
                                                 v=vp[r0:r0 + BT, hv, cols].clone(), t=tp[r0:r0 + BT, hv].clone())))

                def wu():
                    for c in range(nch):
                        t0 = bos + c * BT
                        st, j = c % stages, c % nwu
                        gam, bet, _ = gates(t0, eos, hv)
                        yield ready[st], (c // stages) & 1
                        yield wu_empty[j], ((c // nwu) & 1) ^ 1
                        bg = bet * torch.exp(gam)
                        tt = ring[st]["t"].to(f32)
                        if areg and t0 + BT <= eos:        # Tinv's columns scaled in registers: k, v as loaded
                            aw, au = (tt * bg[None, :]).to(dt).to(f32), (tt * bet[None, :]).to(dt).to(f32)
                            yield None                 # the two wgmmas read k and v from the ring
                            w = (aw @ ring[st]["k"].to(f32)).to(dt)
                            u = (au @ ring[st]["v"].to(f32)).to(dt)
                        else:
                            valid = ((t0 + r_t) < eos)[:, None]
                            wk[j] = torch.where(valid, ring[st]["k"].to(f32) * bg[:, None], 0.).to(dt)
                            ring[st]["v"] = torch.where(valid, ring[st]["v"].to(f32) * bet[:, None], 0.).to(dt)
                            yield None                 # the two wgmmas read the shared buffers
                            w = (tt @ wk[j].to(f32)).to(dt)
                            u = (tt @ ring[st]["v"].to(f32)).to(dt)
                        yield None
                        wk[j] = w
                        ring[st]["v"] = u
                        nv = min(eos - t0, BT)
                        if w_out is not None:
                            w_out[t0:t0 + nv, hv] = w[:nv]
                        if u_out is not None:
                            u_out[t0:t0 + nv, hv, cols] = u[:nv]
                        wu_full[j].arrive()
                        empty[st].arrive()

                def state():
                    if initial_state is not None and h0_on:
                        S = initial_state[seq, hv, :, cols].to(f32).clone()
                    else:
                        S = torch.zeros(K, BV)
                    for c in range(nch):
                        t0 = bos + c * BT
                        gam, bet, gam_last = gates(t0, eos, hv)
                        j = c % npub
                        yield pub_empty[j], ((c // npub) & 1) ^ 1
                        s_pub[j] = S.to(dt)
                        s_full[j].arrive()
                        st, jw = c % stages, c % nwu
                        yield ready[st], (c // stages) & 1
                        valid = ((t0 + r_t) < eos)[:, None]
                        if gate_free:
                            ks = ring[st]["k"].to(f32) @ s_pub[j].to(f32)
                            x = torch.where(valid, bet[:, None] * (ring[st]["v"].to(f32)
                                                                   - torch.exp(gam)[:, None] * ks), 0.).to(dt)
                            yield None                 # x in vn_s, read by the second wgmma
                            vn = torch.where(valid, ring[st]["t"].to(f32) @ x.to(f32), 0.).to(dt)
                        else:
                            yield wu_full[jw], (c // nwu) & 1
                            ws = wk[jw].to(f32) @ s_pub[j].to(f32)
                            vn = torch.where(valid, ring[st]["v"].to(f32) - ws, 0.).to(dt)
                        v_pub[j] = vn
                        d = torch.exp(gam_last - gam)
                        vs = torch.where(valid, vn.to(f32) * d[:, None], 0.).to(dt)
                        v_full[j].arrive()
                        if not gate_free:
                            wu_empty[jw].arrive()
                        yield None                     # a scheduling point between the two products
                        S = S * torch.exp(gam_last) + ring[st]["k"].to(f32).T @ vs.to(f32)
                        empty[st].arrive()
                    if final is not None and ht_on:
                        final[seq, hv, :, cols] = S

                def output_tail(c, t0, j, oc, att):
                    """o of chunk c from its inter-chunk part oc and its 16-bit gated attention att: att vnew once
                    v_full[j] passes, pub_empty[j] released, rows < eos stored."""
                    yield v_full[j], (c // npub) & 1
                    oc = oc + att.to(f32) @ v_pub[j].to(f32)
                    pub_empty[j].arrive()
                    oc = (oc * scale).to(o.dtype)
                    nv = min(eos - t0, BT)
                    lo = max(o_lo - t0, 0)
                    o2[t0 + lo:t0 + nv, hv, cols] = oc[lo:nv]

                def output_pipelined():
                    l2e = torch.tensor(1.4426950408889634, dtype=f32)

                    def ex2_ftz(x):
                        y = torch.exp2(x)
                        return torch.where(y < 2.0 ** -126, torch.zeros(()), y)

                    def qk_of(st):
                        return ring[st]["q"].to(f32) @ ring[st]["k"].to(f32).T

                    if nch > 0:
                        yield ready[0], 0
                    qk = qk_of(0) if nch > 0 else None
                    for c in range(nch):
                        t0 = bos + c * BT
                        st, j = c % stages, c % npub
                        gam = gates(t0, eos, hv)[0] * l2e
                        yield s_full[j], (c // npub) & 1
                        qs = ring[st]["q"].to(f32) @ s_pub[j].to(f32)
                        empty[st].arrive()
                        if c + 1 < nch:
                            st1 = (c + 1) % stages
                            yield ready[st1], ((c + 1) // stages) & 1
                            qk_n = qk_of(st1)
                        gmat = ex2_ftz(gam[:, None] - gam[None, :])
                        att = torch.where(lower, qk * gmat, 0.).to(dt)
                        yield from output_tail(c, t0, j, qs * ex2_ftz(gam)[:, None], att)
                        if c + 1 < nch:
                            qk = qk_n

                def output():
                    for c in range(nch):
                        t0 = bos + c * BT
                        st, j = c % stages, c % npub
                        gam, _, _ = gates(t0, eos, hv)
                        yield ready[st], (c // stages) & 1
                        qt = ring[st]["q"].to(f32)
                        qk = qt @ ring[st]["k"].to(f32).T
                        yield s_full[j], (c // npub) & 1
                        qs = qt @ s_pub[j].to(f32)
                        empty[st].arrive()
                        gmat = torch.exp(torch.where(lower, gam[:, None] - gam[None, :], 0.))
                        att = torch.where(lower, qk * gmat, 0.).to(dt)
                        yield from output_tail(c, t0, j, qs * torch.exp(gam)[:, None], att)

                parts = [state(), output_pipelined() if out_pipe else output()] + ([] if gate_free else [wu()])
                steps += _interleave(parts + [producer()],
                                     inflight, land, rng,
                                     f"sequence {n}, head {hv}, V block {vb}")
    if stats is not None:
        stats["steps"] = stats.get("steps", 0) + steps
