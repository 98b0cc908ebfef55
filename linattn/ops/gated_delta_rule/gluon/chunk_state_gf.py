"""The backward's recompute of the chunk-start states h and of Vnew in the gate-free form: chunk_fused_gf.py's two
state partitions with a store partition in place of the output (sm_90a). The gluon backward's recompute (backend.py).

Why: the recompute needs h [slots, HV, K, V] and Vnew [T_tot, HV, V] for the backward's local stage. Through W and U
it costs the W/U kernel (reads k, v, Tinv; writes W and U) plus the state pass (reads k, W, U; writes h, Vnew). The
gate-free chain (chunk_fused_gf.py's module docstring) forms Vnew = Tinv diag(beta) (V - diag(e^gam) K S) from the
ring's k, v and Tinv tiles, so U is never formed and W only for the reverse state pass (triton/intra_split.py's
wu_kernel without U). One CTA per (sequence, value head) at BV = V = 128, or per segment in the segment launch.

Partitions (4 warpgroups' worth of warps):
  state partitions (the default and worker 0, one warpgroup each, the [K, 64] column halves of S): chunk_fused_gf's
      _gf_state unchanged: S_c published in s_pub[j] (s_full), vnew_c in v_pub[j] (v_full), j = c % NPUB.
  store partition (worker 1, one warpgroup): per chunk, once s_full[j] completes, the TMA store of s_pub[j] as
      h[slot of chunk c]; once v_full[j] completes, the TMA store of v_pub[j] as Vnew's rows (a chunk that ends inside
      its sequence), or masked generic stores of its valid rows (a sequence's last, partial chunk: the box's rows past
      the end belong to the next sequence); then tma_store_wait(0) (the bulk copies have read s_pub / v_pub) and the
      arrival on pub_empty[j]. Warm-up chunks of the segment launch (rows before the segment's first) store nothing.
  producer (worker 2, one warp): chunk_fused_wu_ws._wu_producer without q: k, v and Tinv boxes per chunk.
Barriers: chunk_fused_gf's ring (empty count 2: the two state partitions), s_full / v_full (count 2), pub_empty
(count 1, the store partition). NPUB = 2 published pairs: the store of chunk c's pair runs under chunk c + 1's chain.
Shared memory at 2 stages: ring 2 x (k 16 + v 16 + Tinv 8 KB), s_pub 2 x 32, v_pub 2 x 16, vn_s 16 KB = 208 KB.

The h slot of chunk c: slot0 + c on the sequence plan; in the segment launch (fixed-length sequences of seq_len
tokens in one packed stream), the sequence plan's slot of the chunk at token t is n * cdiv(seq_len, BT) + (t - n *
seq_len) / BT for the segment's sequence n, so the kernel needs seq_len and no second plan.
"""
from __future__ import annotations

from typing import Optional

import torch

from linattn.ops.gated_delta_rule.gluon.ws_partitions import BT, PRODUCER_REGS
from linattn.runtime.gluon_compat import GLUON_OK, gl, gluon, mbarrier, tma_store, tma_store_wait

SGF_BV = 128
SGF_STAGES = 2
SGF_NPUB = 2
SGF_SPLIT = 2
# setmaxnreg of the worker state partition and of the store partition (the default state partition gets Gluon's
# remainder)
SGF_STATE_REGS = 152
SGF_STORE_REGS = 80

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import _gf_shared, _gf_state
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import _segment_word, _wu_producer
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import _sequence_span
    from linattn.ops.gated_delta_rule.gluon.ws_partitions import _ws_barriers_invalidate, ws_rows_layout

    @gluon.jit
    def _gf_store(s_pub, v_pub, s_full, v_full, pub_empty, h_desc, vn_desc, vnew_ptr, nchunks, bos, eos, hv,
                  slot_base, o_lo, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                  NPUB: gl.constexpr, WARM: gl.constexpr):
        """The store partition (module docstring): h[slot_base + c] and Vnew's rows of chunk c from the published
        pair j = c % NPUB, then pub_empty[j]."""
        LV: gl.constexpr = ws_rows_layout(V, v_pub.dtype.primitive_bitwidth, 4)
        r_v = gl.arange(0, BT, layout=gl.SliceLayout(1, LV))
        c_v = gl.arange(0, V, layout=gl.SliceLayout(0, LV))
        for c in range(nchunks):
            t0 = bos + c * BT
            j = c % NPUB
            ph = (c // NPUB) & 1
            keep = t0 >= o_lo
            mbarrier.wait(s_full.index(j), ph)
            if keep:
                tma_store(h_desc, [((slot_base + c) * HV + hv).to(gl.int32) * K, 0], s_pub.index(j))
            mbarrier.wait(v_full.index(j), ph)
            if keep:
                if t0 + BT <= eos:
                    tma_store(vn_desc, [t0.to(gl.int32), hv * V], v_pub.index(j))
                else:
                    rows = t0 + r_v
                    off = gl.expand_dims(rows.to(gl.int64) * (HV * V) + hv * V, 1) + gl.expand_dims(c_v, 0)
                    gl.store(vnew_ptr + off, v_pub.index(j).load(LV), mask=gl.expand_dims(rows < eos, 1))
            tma_store_wait(0)
            gl.thread_barrier()
            mbarrier.arrive(pub_empty.index(j))

    @gluon.jit
    def chunk_state_gf_kernel(
        k_desc, v_desc, t_desc,                # TMA over k [T_tot, H*K], v [T_tot, HV*V], Tinv [T_tot, HV*BT] (16-bit)
        h_desc, vn_desc,                       # TMA over h [slots*HV*K, V] and Vnew [T_tot, HV*V] (stores)
        beta_ptr, gcum_ptr, vnew_ptr,          # beta [T_tot, HV] (any float), gcum [T_tot, HV] fp32, Vnew [T_tot, HV,
                                               # V] (the partial chunks' generic stores)
        h0_ptr, ht_ptr,                        # optional: initial / final state [N, HV, K, V] fp32 (or None)
        cu_ptr, chunk_off_ptr,                 # the chunk plan (triton/chunk_indices.py): sequences, or segments
        sel_ptr,                               # optional int32 (or None): without seg_ptr [N * HV], pairs run where
                                               # != 0; with it [sequences * HV], the segments run where == 0
        seg_ptr,                               # optional [N * HV] int32 (or None): segment words (segment_start.py)
        seq_len,                               # the segment launch's sequence length (unused without seg_ptr)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
        STAGES: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        SPLIT: gl.constexpr, STATE_REGS: gl.constexpr, STORE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        gl.static_assert(BV == V, "the gate-free kernel holds a whole value head: BV == V")
        nh = gl.program_id(0)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)
        WARM: gl.constexpr = seg_ptr is not None
        o_lo, state_n, bos, nchunks, h0_on, ht_on = _segment_word(seg_ptr, nh, n, bos, nchunks, BT)
        if WARM:
            # the sequence plan's slot of the chain's first chunk (bos is the warm-up's first token)
            slot_base = state_n * gl.cdiv(seq_len, BT) + (bos - state_n * seq_len) // BT
            if sel_ptr is not None:
                # a segment of a (sequence, head) that runs unsegmented (the other launch) does nothing
                if gl.load(sel_ptr + state_n * HV + hv) != 0:
                    nchunks = 0
                    ht_on = 0
        else:
            slot_base = slot0
            if sel_ptr is not None:
                run = (gl.load(sel_ptr + nh) != 0).to(gl.int32)
                nchunks = nchunks * run
                ht_on = ht_on * run

        # empty: the two state partitions (the store partition reads no ring tile)
        k_s, v_s, t_s, ready, empty, s_full, v_full, pub_empty, s_pub, v_pub, vn_s = _gf_shared(
            k_desc, v_desc, t_desc, STAGES, NPUB, 2, K, BV, BT)
        HALF: gl.constexpr = BV // 2
        gl.warp_specialize(
            [(_gf_state, (k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr,
                          gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES, NPUB,
                          USE_H0, STORE_HT, SPLIT, h0_on, ht_on, 0, HALF)),
             (_gf_state, (k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr,
                          gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES, NPUB,
                          USE_H0, STORE_HT, SPLIT, h0_on, ht_on, HALF, HALF)),
             (_gf_store, (s_pub, v_pub, s_full, v_full, pub_empty, h_desc, vn_desc, vnew_ptr, nchunks, bos, eos, hv,
                          slot_base, o_lo, HV, K, V, BT, NPUB, WARM)),
             (_wu_producer, (None, k_desc, v_desc, t_desc, None, k_s, v_s, t_s, ready, empty, nchunks, bos, hv,
                             hk, 0, K, V, BT, BV, STAGES))],
            worker_num_warps=[4, 4, 1], worker_num_regs=[STATE_REGS, STORE_REGS, PRODUCER_REGS])
        _ws_barriers_invalidate(ready, empty, s_full, v_full, pub_empty, STAGES, NPUB)


def state_gf_launch(k, v, beta, gcum, tinv16, h, vnew, initial_state, final, plan,
                    select: Optional[torch.Tensor] = None, seg: Optional[torch.Tensor] = None, seq_len: int = 0):
    """(kernel, grid, args, kwargs) of one launch of chunk_state_gf_kernel. k [.., H, K], v [.., HV, V] over plan's
    T_total tokens; beta [T_tot, HV]-shaped (any float); gcum [T_tot, HV] fp32; tinv16 [T_tot, HV, 64] in k's dtype;
    h [slots, HV, K, V] (slots of the sequence plan) and vnew [T_tot, HV, V] in k's dtype (written); initial_state /
    final [sequences, HV, K, V] fp32 or None; select / seg as chunk_fused_gf_gluon's, seq_len with seg."""
    from linattn.ops.gated_delta_rule.gluon.fused_forward import selection_args
    from linattn.ops.gated_delta_rule.gluon.host import aligned, fused_desc, gl_dtype
    from linattn.runtime.gluon_compat import TensorDescriptor
    H, K = k.shape[-2], k.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    T_tot = plan.T_total
    dt = k.dtype
    if tuple(tinv16.shape) != (T_tot, HV, BT) or tinv16.dtype != dt:
        raise ValueError(f"tinv16 is {tinv16.dtype} {tuple(tinv16.shape)}, expected {dt} {(T_tot, HV, BT)}")
    if h.dtype != dt or vnew.dtype != dt or h.data_ptr() % 16 or vnew.data_ptr() % 16:
        raise ValueError("h and vnew must be 16-byte aligned buffers in k's dtype (the TMA stores)")
    gdt = gl_dtype(dt)

    def desc(t2d, block):
        return fused_desc(TensorDescriptor, t2d, block, gdt)

    args = (desc(aligned(k.reshape(T_tot, H * K)), [BT, K]), desc(aligned(v.reshape(T_tot, HV * V)), [BT, V]),
            desc(aligned(tinv16.reshape(T_tot, HV * BT)), [BT, BT]), desc(h.view(-1, V), [K, V]),
            desc(vnew.view(T_tot, HV * V), [BT, V]), beta.reshape(T_tot, HV), gcum, vnew, initial_state, final,
            plan.cu, plan.chunk_offsets) + selection_args(select, seg, plan.N, HV) + (int(seq_len),)
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=SGF_BV, STAGES=SGF_STAGES, NPUB=SGF_NPUB,
                  USE_H0=initial_state is not None, STORE_HT=final is not None, SPLIT=SGF_SPLIT,
                  STATE_REGS=SGF_STATE_REGS, STORE_REGS=SGF_STORE_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return chunk_state_gf_kernel, (plan.N * HV,), args, kwargs


def chunk_state_gf_gluon(k, v, beta, gcum, tinv16, h, vnew, initial_state, final, plan,
                         select: Optional[torch.Tensor] = None, seg: Optional[torch.Tensor] = None, seq_len: int = 0,
                         stream=None) -> None:
    """h, Vnew (and final when given) of the backward's recompute on sm_90a (state_gf_launch's arguments), through
    the host path (gluon/host.py)."""
    from linattn.ops.gated_delta_rule.gluon.host import launches
    kernel, grid, args, kwargs = state_gf_launch(k, v, beta, gcum, tinv16, h, vnew, initial_state, final, plan,
                                                 select=select, seg=seg, seq_len=seq_len)
    launches(kernel, grid, args, kwargs, stream=stream)



def recompute_gf(q, k, v, g, beta, initial_state, plan, segments=None, state_pass=None, stage2a=None):
    """The gluon backward's recompute of the forward's intermediates (triton/backward.py's `recompute` hook): gcum and
    Tinv, W alone by wu_kernel (for the reverse state pass), then h and Vnew by chunk_state_gf_kernel. Returns
    triton/forward.py's FwdResult (o, the final state and u None).
    stage2a = (gcum, tinv): the forward's stage 2a outputs as its autograd kept them (Tinv in k's dtype, the one the
    forward multiplied by): no stage 2a here, and FwdResult.tinv is that Tinv (what the Gluon local/WY stage reads);
    None: gcum and Tinv by the Triton kkt_solve_kernel, Tinv fp32 for the Triton WY stage and 16-bit for the chain.
    segments = (S, L) (chunk_fused_gf.gf_segments_wanted; fixed-length batches): the chain in segments with their
    gate-truncated warm-ups, as the gluon forward runs it, so h and Vnew carry the forward's error contract
    (segment_start.py): the window kernel, then the pairs it flags unsegmented (sequence plan, selected), then the
    others' segments (segment plan), all on the current stream. (The forward runs its unsegmented pairs on a side
    stream; a launch-list replay of the backward with side-stream launches gave wrong gradients where heads were
    flagged, so the backward keeps one stream: the flagged pairs' launch exits at once where none is flagged.)
    state_pass: replaces chunk_state_gf_gluon (same arguments; CPU tests pass testing/state_models.py's model)."""
    from linattn.ops.gated_delta_rule.triton.common import dot_precision
    from linattn.ops.gated_delta_rule.triton.forward import FwdResult
    from linattn.ops.gated_delta_rule.triton.host import launches
    from linattn.ops.gated_delta_rule.triton.intra_split import kkt_order, kkt_solve_kernel, split_intra_config, \
        wu_kernel
    from linattn.runtime.alloc import empty
    B, T, H, K = k.shape
    HV, V = v.shape[-2], v.shape[-1]
    T_tot, dev, dt = plan.T_total, k.device, k.dtype
    cfg = split_intra_config(K, V)
    prec = dot_precision(dt)
    S, L = segments or (1, 0)
    seg = None
    if S > 1:
        from linattn.ops.gated_delta_rule.gluon.host import launches as gluon_launches
        from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan, segment_window_buffers, \
            segment_windows
        from linattn.runtime.launch_list import keep
        splan = segment_plan(B, T, S, L, dev)
        keep(splan)
        seg = segment_windows(k, beta, g, plan, S, L, launch=gluon_launches,
                              out=segment_window_buffers(plan.N, S, HV, dev))
    grid = (plan.num_slots, HV)
    if stage2a is None:
        gcum = empty(T_tot, HV, dtype=torch.float32, device=dev)
        tinv = empty(T_tot, HV, BT, dtype=torch.float32, device=dev)
        tinv16 = empty(T_tot, HV, BT, dtype=dt, device=dev)
        launches(kkt_solve_kernel, grid, (k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N),
                 dict(H=H, HV=HV, K=K, BT=BT, BK=cfg.BK_kkt, DOT_PREC=prec, num_warps=cfg.warps_kkt,
                      **kkt_order(plan.num_slots)), tensors=dict(tinv16_ptr=tinv16))
    else:
        gcum, tinv16 = stage2a
        tinv = tinv16
    h = empty(plan.num_slots, HV, K, V, dtype=dt, device=dev)
    vnew = empty(T_tot, HV, V, dtype=dt, device=dev)
    run = state_pass or chunk_state_gf_gluon
    if seg is None:
        run(k, v, beta, gcum, tinv16, h, vnew, initial_state, None, plan)
    else:
        slow, _, segw = seg
        run(k, v, beta, gcum, tinv16, h, vnew, initial_state, None, plan, select=slow)
        run(k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V), beta, gcum, tinv16, h, vnew, initial_state, None,
            splan, select=slow, seg=segw, seq_len=T)
    w = empty(T_tot, HV, K, dtype=dt, device=dev)
    launches(wu_kernel, grid, (k, v, beta, gcum, tinv16, w, None, plan.cu, plan.chunk_indices, plan.N),
             dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=cfg.BK, BV=cfg.BV, DOT_PREC=prec, num_warps=cfg.warps_wu))
    return FwdResult(None, None, gcum, w, None, vnew, h, tinv, plan, beta)
