"""Stages 2b + 3 + 4 of the GDN forward in one warp-specialised Gluon kernel (sm_90a): the state chain and the output
of ws_partitions.py with W and U formed on the fly from kkt_solve's Tinv, so that W and U never go through global
memory. FlashQLA's organisation. The gluon forward's kernel at BV = 16 / 32 / 64 (fused_forward.fused_wu_config);
the gate-free BV = 128 kernel (chunk_fused_gf.py) reuses its producer, output partition and segment words.

One CTA per (V block, sequence * value head). Per chunk c, with dt the 16-bit operand dtype and gam / beta the
chunk's gates (0 on rows past the sequence end):
  wu partition (worker 1, 4 warps = 1 warpgroup), a chunk that ends inside its sequence:
      w = ((Tinv * (beta * exp(gam))[None, :]).to(dt) @ k).to(dt)     -> wk_s[c % NWU]
      u = ((Tinv * beta[None, :]).to(dt) @ v).to(dt)                   -> the ring's v tile, in place
    Tinv is wgmma's register A operand, k and v the ring's tiles unchanged. The sequence's last chunk (its box holds
    the next sequence's rows) forms the row-scaled copies instead, rows past the end selected to 0:
      ks = (k * (beta * exp(gam))[:, None]).to(dt) -> wk_s[c % NWU];  vs = (v * beta[:, None]).to(dt) -> the v tile
      w = (Tinv @ ks).to(dt), u = (Tinv @ vs).to(dt), written in place of ks and vs
  state partition (default, 1 warpgroup): ws_partitions._ws_state, product 1 reading W from wk_s[c % NWU] and U
      from the ring's v tile.
  output partition (worker 0, 1 warpgroup): _output_pipelined (OUT_PIPE: q k^T one chunk ahead) or
      ws_partitions._ws_output, per the launch config.
  producer (worker 2, 1 warp): TMA of q, k ([BT, K] boxes), v ([BT, BV]) and Tinv ([BT, BT]) into slot c % STAGES.
Rows of a box past the sequence end hold the next sequence's tokens (TMA zero-fills only past T_tot): beta is 0
there, so the W / U rows of valid tokens are exact; W / U rows past the end are garbage and meet the state
partition's row mask (vnew = where(valid, ...)).

Barriers (parity of the k-th completion is k & 1; a fresh barrier counts as if parity 1 had completed):
  ready[s]     count 1 + tx  producer expect(q + k + v + Tinv boxes); state, output and wu wait (c // STAGES) & 1.
  empty[s]     count 3       state (after product 2; fenced), output (after q k^T, q S), wu (after its products and
                             its in-place writes; fenced) arrive; producer waits ((c // STAGES) & 1) ^ 1.
  wu_full[j]   count 1       wu arrives once w is in wk_s[j] and u in the ring's v tile (fenced, thread barrier);
                             state waits (c // NWU) & 1.
  wu_empty[j]  count 1       state arrives after product 1 (its read of wk_s[j] and of u); wu waits
                             ((c // NWU) & 1) ^ 1 before writing chunk c into wk_s[j].
  s_full, v_full, pub_empty  as ws_partitions.py (NPUB published S / vnew buffers).
"""
from __future__ import annotations

from linattn.ops.gated_delta_rule.gluon.ws_partitions import BT, NPUB, OUTPUT_REGS, PRODUCER_REGS  # noqa: F401
from linattn.ops.gated_delta_rule.triton.segment_start import SEGW_H0, SEGW_LAST, SEGW_SEQ_SHIFT, SEGW_WL_MASK
from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, tma_load,
                                          warpgroup_mma, warpgroup_mma_wait)

NWU = 2                  # W buffers (wk_s): the wu partition may run up to NWU chunks ahead of product 1
WU_REGS = 152            # setmaxnreg of the wu warpgroup (launch configs set their own: fused_forward.py)

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.ws_partitions import (_ws_output, _ws_output_index, _ws_state,
                                                                  _ws_store_o, ws_acc_layout, ws_rows_layout,
                                                                  ws_smem_layout)
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import _sequence_span

    # ------------------------------------------------------------------ worker 2: the TMA producer (1 warp)
    @gluon.jit
    def _wu_ring_load(q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, c, bos, hv, hk, vb,
                      K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr):
        """Chunk c's q, k, v, Tinv boxes into ring slot c % STAGES once its consumers released use c - STAGES
        (one producer iteration). Returns the slot. q_desc None (the recompute, chunk_state_gf.py): no q box."""
        QB: gl.constexpr = 0 if q_desc is None else q_desc.block_type.nbytes
        nbytes: gl.constexpr = QB + k_desc.block_type.nbytes + v_desc.block_type.nbytes + t_desc.block_type.nbytes
        s = c % STAGES
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)     # the consumers released use c - STAGES
        row = (bos + c * BT).to(gl.int32)
        mbarrier.expect(ready.index(s), nbytes)                   # full boxes: TMA counts zero-filled bytes
        if q_desc is not None:
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
        tile's row layout, beta again in the v tile's. gcum_ptr None (KDA, whose key tile carries its per-channel
        gate already): gam 0."""
        rk = t0 + r_k
        rv = t0 + r_v
        if gcum_ptr is None:
            gam = gl.zeros_like(rk).to(gl.float32)
        else:
            gam = gl.load(gcum_ptr + rk * HV + hv, mask=rk < eos, other=0.)
        bk = gl.load(beta_ptr + rk * HV + hv, mask=rk < eos, other=0.)
        bv = gl.load(beta_ptr + rv * HV + hv, mask=rv < eos, other=0.)
        return gam, bk, bv

    @gluon.jit
    def _wu_scaled_in_smem(k_s, v_s, t_s, wk_s, st, j, rk, rv, eos, bg, beta_v, LK: gl.constexpr,
                           LV: gl.constexpr, ACC_W: gl.constexpr, ACC_U: gl.constexpr, K: gl.constexpr,
                           BT: gl.constexpr, BV: gl.constexpr):
        """w = Tinv @ ks, u = Tinv @ vs with ks, vs the row-scaled k and v written to shared memory first. Rows past
        eos are SELECTED to 0 (the next sequence's rows cannot reach W / U of valid rows, even if not finite). The v tile is rewritten in place: only this partition
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
                   NWU: gl.constexpr):
        dt: gl.constexpr = k_s.dtype
        LK: gl.constexpr = ws_rows_layout(K, dt.primitive_bitwidth, 4)     # the k tile [BT, K], 16-byte vectors
        LV: gl.constexpr = ws_rows_layout(BV, dt.primitive_bitwidth, 4)    # the v tile [BT, BV]
        ACC_W: gl.constexpr = ws_acc_layout(K)
        ACC_U: gl.constexpr = ws_acc_layout(BV)
        # The gates scale Tinv's COLUMNS in registers (Tinv diag(b) k == Tinv (b * k)) and Tinv is the wgmma's
        # register A operand, B the ring's k and v tiles as TMA wrote them: no scaled copy of k and v goes through
        # shared memory (that copy was most of this partition's time, and this partition bounds the chain at B1).
        # The gates are carried in the k / v row layouts and moved to the A operand's column layout at use.
        LAW: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_W, k_width=2)
        LAU: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_U, k_width=2)
        r_k = gl.arange(0, BT, layout=gl.SliceLayout(1, LK))
        r_v = gl.arange(0, BT, layout=gl.SliceLayout(1, LV))
        # The gates (gam = 0 and beta = 0 past the end) are loaded one chunk AHEAD and carried through the loop:
        # issued at the top of their own iteration, their global latency sits right before the first use once the
        # barrier waits are short.
        gam_raw, bk_raw, bv_raw = _wu_gates(gcum_ptr, beta_ptr, bos, eos, hv, r_k, r_v, HV)
        for c in range(nchunks):
            t0 = bos + c * BT
            st = c % STAGES
            j = c % NWU
            # next chunk's gates in flight during this chunk (rows past eos masked: nothing read past the end)
            gam_nx, bk_nx, bv_nx = _wu_gates(gcum_ptr, beta_ptr, t0 + BT, eos, hv, r_k, r_v, HV)
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)
            mbarrier.wait(wu_empty.index(j), ((c // NWU) & 1) ^ 1)      # product 1 of chunk c - NWU is done
            # (the scales are formed inside each branch here: formed once before it, they spilled 4 bytes)
            if t0 + BT > eos:
                # the sequence's last chunk, whose box holds the next sequence's rows: the scaled copies with those
                # rows selected to 0 (a column scale of 0 would meet them as 0 * x, which is not 0 for x not finite)
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
                          QK_DONE: gl.constexpr = False):
        """ws_partitions._ws_output with q k^T one chunk ahead (OUT_PIPE): the q k^T of chunk c + 1 is issued as soon
        as chunk c's products are waited, so it runs on the tensor cores while this warpgroup forms chunk c's gated
        attention; the gates are loaded one chunk ahead in log2 units and exponentiated by ex2.approx.ftz, without
        the mask before the exponential (the select after it discards the upper triangle, inf included). At B1
        this warpgroup is the chain's bound.
        The q k^T issued in the last iteration (chunk nchunks) reads a ring slot that no copy is landing in (the
        producer's last copy is chunk nchunks - 1, in another slot; an earlier copy into this one was waited) and is
        discarded; it is waited before the partition ends.
        QK_DONE: no wgmma is in flight across the loop's entry or back edge: the first q k^T is waited before the loop
        and each next one with chunk c's output product (it is complete there anyway: wait(0)), so the loop carries a
        finished [BT, BT] tile. Where another partition in the same switch loop reads its own accumulators (the
        gate-free kernel's second state partition), ptxas otherwise serialises every wgmma of the kernel (C7514:
        non-wgmma instructions reading accumulator registers inside a pipeline stage, the loop-carried copies)."""
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
            qs = warpgroup_mma(q_s.index(st), s_pub.index(j), gl.zeros([BT, BV], gl.float32, ACC_O), use_acc=False,
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
            o = warpgroup_mma(att, v_pub.index(j), o, is_async=True)
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
        """The segment warm-up of program nh (segment_start.segment_windows) in chunk_fused_gf.py's segment launch:
        with seg_ptr, "sequence" n is a segment whose word (SEGW_*) gives the chain's start wl
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
                   QK_DONE: gl.constexpr = False):
        if OUT_PIPE:
            _output_pipelined(q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr,
                              scale, nchunks, bos, eos, hv, vb, HV, V, BT, BV, STAGES, NPUB, o_lo, WARM, QK_DONE)
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
        sel_ptr,                               # optional int32 (or None): [N * HV], (sequence, head) pairs run where
                                               # != 0 (the segment-parallel forward's unsegmented launch)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
        STAGES: gl.constexpr, NWU: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        OUTPUT_REGS: gl.constexpr, WU_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, OUT_PIPE: gl.constexpr = False,
    ):
        dt: gl.constexpr = k_desc.dtype
        vb = gl.program_id(0)
        nh = gl.program_id(1)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)
        if sel_ptr is not None:
            # a pair not selected does nothing: no o row, no final state (the segment-parallel forward's other
            # launch writes them: fused_forward.chunk_gated_delta_rule_fwd_fused_wu)
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
                          pub_empty, gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, n, hv, vb,
                          HV, K, V, BT, BV, STAGES, NWU, NPUB, USE_H0, STORE_HT, False)),   # W in wk_s, U: v tile
             (_wu_output, (q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                           nchunks, bos, eos, hv, vb, HV, V, BT, BV, STAGES, NPUB, OUT_PIPE, bos, False)),
             (_wu_worker, (k_s, v_s, t_s, wk_s, ready, empty, wu_full, wu_empty, beta_ptr, gcum_ptr, nchunks, bos,
                           eos, hv, HV, K, BT, BV, STAGES, NWU)),
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
