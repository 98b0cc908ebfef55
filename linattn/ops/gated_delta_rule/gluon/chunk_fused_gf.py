"""Stages 2b + 3 + 4 of the GDN forward at BV = 128 (one CTA per sequence and value head) in the gate-free form, one
warp-specialised Gluon kernel (sm_90a): the gluon forward's kernel where gf_wanted holds (a wave of sequence-heads)
and for the segment launch (gf_segments_wanted).

Why: chunk_fused_wu_ws.py forms W = Tinv diag(beta e^gam) K, which does not depend on V, once per V block: at its
BV = 32 / 64 every chunk's W is computed 4 / 2 times per head. At BV = 128 that kernel spills (four partitions
cannot hold the state's [128, 128] accumulator, product 1's and the W/U accumulators). FlashQLA's gate-free form
needs neither W nor U:

    Vnew = U - W S = Tinv diag(beta) (V - diag(e^gam) K S)

so the W/U warpgroup goes away and the state partitions form Vnew from the ring's k, v and Tinv tiles. Per chunk c,
with dt the 16-bit operand dtype and gam / beta the chunk's gates (0 on rows past the sequence end):
  state partitions (the default and worker 0, 1 warpgroup each, each the [K, BV / 2] half of S's columns):
      s_pub     = S_c.to(dt)                                                  (published; also K S's B operand)
      x         = where(valid, beta * (v - e^gam * (K @ s_pub)), 0).to(dt)   -> vn_s, in two column parts
      vnew      = where(valid, Tinv @ vn_s, 0).to(dt)                        -> v_pub (published)
      S_{c+1}   = e^gam_C S_c + K^T @ (d * vnew).to(dt),  d = e^(gam_C - gam)  (vn_s rewritten after Tinv's wgmma)
  output partition (worker 1, 1 warpgroup): chunk_fused_wu_ws._wu_output (OUT_PIPE: q k^T one chunk ahead), BV = 128.
  producer (worker 2, 1 warp): chunk_fused_wu_ws._wu_producer: q, k [BT, K], v [BT, BV], Tinv [BT, BT] per chunk.
Every product of the chain is column-separable (K S, Tinv x and K^T (d vnew) act on a column half independently), so
each state partition publishes its half of S and vnew, forms its half of x and d * vnew in its columns of vn_s, and
the halves meet only at the ring (empty count 3) and the publication barriers (s_full, v_full count 2). Four
warpgroups: output 176, worker state 152, default state Gluon's remainder (sm_90a: 0 spill, wgmmas not serialised).
Rows of a box past the sequence end hold the next sequence's tokens: x's rows there are selected to 0 (where, so
values that are not finite cannot leak) and Tinv's rows of valid tokens have zeros past the diagonal, so Vnew of
valid rows is exact; the rows past the end are selected to 0 again after the product.
Shared memory at BV = 128, 2 stages, one published pair: ring 2 x (q 16 + k 16 + v 16 + Tinv 8 KB), s_pub 32 KB,
v_pub 16 KB, vn_s 16 KB (x, then d * vnew) = 176 KB plus the output's layout conversions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from linattn.ops.gated_delta_rule.gluon.ws_partitions import BT, PRODUCER_REGS
from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, warpgroup_mma,
                                          warpgroup_mma_wait)

GF_BV = 128
GF_STAGES = 2
GF_NPUB = 1
# Four warpgroups share the 64K registers (128 per thread on average). sm_90a AOT, SPLIT = 2 (product 1 in two
# [64, 32] parts per state partition): 0 spill in the plain and segment builds with the output at 176 and the worker
# state partition at 152 (the default state partition gets Gluon's remainder, 160). SPLIT = 1 keeps 4 bytes (the
# switch loop's shared-memory base) in local memory at every split tried.
GF_OUTPUT_REGS = 176
GF_STATE_REGS = 152
GF_SPLIT = 2

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import _segment_word, _wu_output, _wu_producer
    from linattn.ops.gated_delta_rule.gluon.ws_partitions import _ws_barriers, _ws_barriers_invalidate, ws_acc_layout, \
        ws_smem_layout
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import _sequence_span

    @gluon.jit
    def _gf_cols(buf, COL0: gl.constexpr, NCOL: gl.constexpr, BV: gl.constexpr):
        """Columns [COL0, COL0 + NCOL) of a [rows, BV] shared buffer (the buffer itself where NCOL == BV)."""
        if NCOL < BV:
            return buf.slice(COL0, NCOL, dim=1)
        else:
            return buf

    @gluon.jit
    def _gf_gates(gcum_ptr, beta_ptr, t0, eos, hv, r_t, HV: gl.constexpr, BT: gl.constexpr):
        """gam, beta (0 on rows >= eos) and gam at the chunk's last valid row (0 past the end) of the chunk at t0."""
        rows = t0 + r_t
        gam = gl.load(gcum_ptr + rows * HV + hv, mask=rows < eos, other=0.)
        bet = gl.load(beta_ptr + rows * HV + hv, mask=rows < eos, other=0.).to(gl.float32)
        gam_last = gl.load(gcum_ptr + (t0 + gl.minimum(eos - t0, BT) - 1) * HV + hv, mask=t0 < eos, other=0.)
        return gam, bet, gam_last

    @gluon.jit
    def _gf_state(k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr, gcum_ptr,
                  h0_ptr, ht_ptr, nchunks, bos, eos, n, hv,
                  HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                  STAGES: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
                  SPLIT: gl.constexpr, h0_on, ht_on, COL0: gl.constexpr, NCOL: gl.constexpr):
        """The state chain (module docstring) on the columns [COL0, COL0 + NCOL) of S, x and vnew. h0 is loaded only
        where h0_on != 0 (else the chain starts from 0), the final state stored only where ht_on != 0 (both 1 outside
        the segment launch: chunk_fused_wu_ws._segment_word), and n is the h0 / final row (the whole sequence's in the
        segment launch). Product 1's column part h + 1 is issued (asynchronously) before part h's x is formed and
        stored, so that its wgmma runs under that work. Chunk c + 1's gate loads are issued at the loop's top."""
        dt: gl.constexpr = k_s.dtype
        # this partition's columns of the x / d * vnew buffer
        vn_c = vn_s.slice(COL0, NCOL, dim=1)
        ACC: gl.constexpr = ws_acc_layout(NCOL)               # [BT, NCOL] and S [K, NCOL]
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)
        # h0 / the final state straight in the accumulator layout (once per CTA; no conversion scratch)
        # int32 offsets inside the state and one scalar int64 base: per-element 64-bit offsets (256 registers per
        # thread for a [128, 128] tile) spilled 144 bytes in the prologue
        sk = gl.arange(0, K, layout=ROWS)
        sv = gl.arange(0, NCOL, layout=COLS) + COL0
        state_off = gl.expand_dims(sk, 1) * V + gl.expand_dims(sv, 0)
        s = gl.zeros([K, NCOL], gl.float32, ACC)
        if USE_H0:
            if h0_on != 0:
                s = gl.load(h0_ptr + (n.to(gl.int64) * HV + hv) * K * V + state_off)
        r_t = gl.arange(0, BT, layout=ROWS)
        gam, bet, gam_last = _gf_gates(gcum_ptr, beta_ptr, bos, eos, hv, r_t, HV, BT)
        for c in range(nchunks):
            t0 = bos + c * BT
            # the gates of chunk c + 1 in flight during this chunk (masked past the end)
            gam_n, bet_n, gam_last_n = _gf_gates(gcum_ptr, beta_ptr, t0 + BT, eos, hv, r_t, HV, BT)

            # publish S_c once the output partition is done with chunk c - NPUB
            j = c % NPUB
            mbarrier.wait(pub_empty.index(j), ((c // NPUB) & 1) ^ 1)
            _gf_cols(s_pub.index(j), COL0, NCOL, BV).store(s.to(dt))
            fence_async_shared()                               # generic store -> wgmma (async proxy)
            gl.thread_barrier()
            mbarrier.arrive(s_full.index(j))

            st = c % STAGES
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)
            valid = gl.expand_dims((t0 + r_t) < eos, 1)
            # product 1: K S_c; x = beta (v - e^gam K S_c), rows past the end selected to 0. In column parts of
            # NCOL / SPLIT: with S's registers live, a whole product next to the v tile leaves the state warpgroup
            # short of registers
            HB: gl.constexpr = NCOL // SPLIT
            ACC_H: gl.constexpr = ws_acc_layout(HB)
            valid_h = gl.convert_layout(valid, ACC_H)
            bet_h = gl.expand_dims(gl.convert_layout(bet, gl.SliceLayout(1, ACC_H)), 1)
            eg_h = gl.expand_dims(gl.convert_layout(gl.exp(gam), gl.SliceLayout(1, ACC_H)), 1)
            ks = warpgroup_mma(k_s.index(st), _gf_cols(s_pub.index(j), COL0, NCOL, BV).slice(0, HB, dim=1),
                               gl.zeros([BT, HB], gl.float32, ACC_H), use_acc=False)
            for h in gl.static_range(SPLIT):
                if h + 1 < SPLIT:      # the next part's product in flight under this part's x
                    ks_n = warpgroup_mma(k_s.index(st),
                                         _gf_cols(s_pub.index(j), COL0, NCOL, BV).slice((h + 1) * HB, HB, dim=1),
                                         gl.zeros([BT, HB], gl.float32, ACC_H), use_acc=False, is_async=True)
                v = v_s.index(st).slice(COL0 + h * HB, HB, dim=1).load(ACC_H).to(gl.float32)
                vn_c.slice(h * HB, HB, dim=1).store(gl.where(valid_h, bet_h * (v - eg_h * ks), 0.).to(dt))
                if h + 1 < SPLIT:
                    ks = warpgroup_mma_wait(0, deps=[ks_n])
            fence_async_shared()
            gl.thread_barrier()
            # product 2: vnew = Tinv x
            vnew = warpgroup_mma(t_s.index(st), vn_c, gl.zeros([BT, NCOL], gl.float32, ACC), use_acc=False)
            vnew = gl.where(valid, vnew, 0.).to(dt)
            _gf_cols(v_pub.index(j), COL0, NCOL, BV).store(vnew)
            d = gl.exp(gam_last - gam)
            vs = gl.where(valid, vnew.to(gl.float32) * gl.expand_dims(d, 1), 0.).to(dt)
            gl.thread_barrier()                                # every warp's product 2 has read x from vn_s
            vn_c.store(vs)
            fence_async_shared()                               # v_pub (output's wgmma), vn_s (product 3)
            gl.thread_barrier()
            mbarrier.arrive(v_full.index(j))
            # product 3: S_{c+1} = e^gam_C S_c + K^T (d * vnew)
            s = warpgroup_mma(k_s.index(st).permute((1, 0)), vn_c, s * gl.exp(gam_last))
            # this partition's share of ring slot st is done (v read by generic loads: fence before the TMA refill)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st))
            gam = gam_n
            bet = bet_n
            gam_last = gam_last_n
        if STORE_HT:
            # the row index in int32 (N * HV <= 65535: the grid), widened for the element offset
            if ht_on != 0:
                gl.store(ht_ptr + (n * HV + hv).to(gl.int64) * (K * V) + state_off, s)

    @gluon.jit
    def _gf_shared(k_desc, v_desc, t_desc, STAGES: gl.constexpr, NPUB: gl.constexpr, CONSUMERS: gl.constexpr,
                   K: gl.constexpr, BV: gl.constexpr, BT: gl.constexpr):
        """The state partitions' shared memory and barriers (also chunk_state_gf.py's): the ring's k, v, Tinv tiles
        and its barriers (empty: CONSUMERS arrivals per use), the published pairs s_pub / v_pub (s_full, v_full: one
        arrival per state partition) and vn_s (x, then d * vnew)."""
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [STAGES, BT, BV], v_desc.layout)
        t_s = gl.allocate_shared_memory(dt, [STAGES, BT, BT], t_desc.layout)
        ready, empty, s_full, v_full, pub_empty = _ws_barriers(STAGES, NPUB, CONSUMERS, 2)
        s_pub = gl.allocate_shared_memory(dt, [NPUB, K, BV], ws_smem_layout(BV, dt.primitive_bitwidth))
        v_pub = gl.allocate_shared_memory(dt, [NPUB, BT, BV], v_desc.layout)
        vn_s = gl.allocate_shared_memory(dt, [BT, BV], v_desc.layout)
        return k_s, v_s, t_s, ready, empty, s_full, v_full, pub_empty, s_pub, v_pub, vn_s

    @gluon.jit
    def chunk_fused_gf_kernel(
        q_desc, k_desc, v_desc, t_desc,        # TMA over q, k [T_tot, H*K], v [T_tot, HV*V], Tinv [T_tot, HV*BT]
        beta_ptr, gcum_ptr, o_ptr,             # beta [T_tot, HV] (any float), gcum [T_tot, HV] fp32; o [T_tot, HV, V]
        h0_ptr, ht_ptr,                        # optional: initial / final state [N, HV, K, V] fp32 (or None)
        cu_ptr, chunk_off_ptr, scale,          # the chunk plan (triton/chunk_indices.py); scale
        sel_ptr,                               # optional int32 (or None), read with seg_ptr only: [sequences * HV]
                                               # indexed by the segment's sequence, its segments run where == 0
        seg_ptr,                               # optional [N * HV] int32 (or None): segment words (segment_start.py)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
        STAGES: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        OUTPUT_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, OUT_PIPE: gl.constexpr, SPLIT: gl.constexpr,
        STATE_REGS: gl.constexpr,
    ):
        gl.static_assert(BV == V, "the gate-free kernel holds a whole value head: BV == V")
        dt: gl.constexpr = k_desc.dtype
        nh = gl.program_id(0)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)
        # the segment warm-up (_segment_word). The segments of a pair that sel_ptr sends to the other launch run no
        # chunk and store no final state: an early return instead made ptxas keep two prologue values in local
        # memory across the partitions' dispatch (8 bytes of spill, sm_90a AOT). sel_ptr is read only with seg_ptr.
        WARM: gl.constexpr = seg_ptr is not None
        o_lo, state_n, bos, nchunks, h0_on, ht_on = _segment_word(seg_ptr, nh, n, bos, nchunks, BT)
        if WARM:
            if sel_ptr is not None:
                # a segment of a (sequence, head) that runs unsegmented (the other launch) does nothing
                if gl.load(sel_ptr + state_n * HV + hv) != 0:
                    nchunks = 0
                    ht_on = 0

        q_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], q_desc.layout)
        # empty: the two state partitions + the output
        k_s, v_s, t_s, ready, empty, s_full, v_full, pub_empty, s_pub, v_pub, vn_s = _gf_shared(
            k_desc, v_desc, t_desc, STAGES, NPUB, 3, K, BV, BT)
        # two state partitions (the default and worker 0), each the [K, BV / 2] half of S's columns: the chain's
        # serial elementwise work per chunk (S's publication, x, d * vnew) halves, its products run at N = BV / 2
        HALF: gl.constexpr = BV // 2
        gl.warp_specialize(
            [(_gf_state, (k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr,
                          gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES, NPUB,
                          USE_H0, STORE_HT, SPLIT, h0_on, ht_on, 0, HALF)),
             (_gf_state, (k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr,
                          gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES, NPUB,
                          USE_H0, STORE_HT, SPLIT, h0_on, ht_on, HALF, HALF)),
             (_wu_output, (q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                           nchunks, bos, eos, hv, 0, HV, V, BT, BV, STAGES, NPUB, OUT_PIPE, o_lo, WARM, True)),
             (_wu_producer, (q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, nchunks, bos, hv,
                             hk, 0, K, V, BT, BV, STAGES))],
            worker_num_warps=[4, 4, 1], worker_num_regs=[STATE_REGS, OUTPUT_REGS, PRODUCER_REGS])
        _ws_barriers_invalidate(ready, empty, s_full, v_full, pub_empty, STAGES, NPUB)


# ---------------------------------------------------------------------------------------------------- launcher

@dataclass(frozen=True)
class FusedGfConfig:
    BV: int = GF_BV
    stages: int = GF_STAGES
    npub: int = GF_NPUB
    output_regs: int = GF_OUTPUT_REGS
    out_pipe: bool = True
    split: int = GF_SPLIT
    num_warps: int = 4     # the default (state) partition; the kernel launches 16 warps (4 warpgroups)
    state_regs: int = GF_STATE_REGS   # setmaxnreg of the worker state partition


def gf_supported(q: torch.Tensor, v: torch.Tensor) -> tuple:
    """Whether the gate-free BV=128 kernel takes the call (on top of fused_wu_supported): V == 128 (one CTA holds a
    whole value head)."""
    if v.shape[-1] != GF_BV:
        return False, f"V={v.shape[-1]}: the gate-free kernel holds a whole value head of {GF_BV}"
    return True, ""


def gf_wanted(N: int, HV: int, num_sms: int) -> bool:
    """Where the gate-free kernel runs: at least 15/16 of a wave of (sequence, value head) CTAs, N * HV * 16 >= 15 *
    SMs (124 on an H200). Its chunk step (~4 us at B1, H200) is ~2.4x the BV=32 kernel's, bought back by doing a whole
    head's V (W once instead of per V block): faster than the W/U kernel from N * HV = 128 up, slower below
    (benchmarks/RESULTS.md)."""
    return N * HV * 16 >= 15 * num_sms


# The segment launch at BV=128: at B1-B2 the gate-free kernel has one CTA per value head (32-64 on 132 SMs) and a
# ~4 us chunk step; each sequence is cut into as many segments as one wave of CTAs holds, each started a
# gate-truncated warm-up early (triton/segment_start.py), and the chain per CTA shortens by that factor. One wave,
# not more: every further wave pays a whole segment chain again. B1-B2 HV32 forward 1.35-1.58x, flat where every
# head decays slowly (those pairs run unsegmented; benchmarks/RESULTS.md).
GF_SEG_MIN_CHUNKS = 16     # no segment shorter: a warm-up window (~3 chunks at production decay) stays <= ~20% of it
# An eager call (not under CUDA-graph capture) is segmented only from this many tokens: below, the segment path's
# host time (four launches and the side stream's events, replayed from the signature's launch list: ~0.16-0.27 ms a
# call on the H100 machine's host) is not covered by what it saves on the GPU. Eager B1 H16/HV32 with the launch list
# (benchmarks/RESULTS.md, "Eager forward"): T8192 0.170-0.245 ms segmented vs 0.258 unsegmented (CUDA graph 0.205-
# 0.214), T16384 0.306 vs 0.307, B2 T8192 0.310-0.338 vs 0.311. Shorter eager calls go to Triton under `auto`.
GF_SEG_MIN_EAGER_TOKENS = 8192


def gf_segment_plan(B: int, T: int, HV: int, num_sms: int) -> tuple:
    """(S, L) of the gate-free segment launch for B sequences of T tokens: S = the segments per sequence that one wave
    of B * HV * S CTAs holds, none shorter than GF_SEG_MIN_CHUNKS chunks, L = cdiv(chunks, S) (S recounted so that
    no segment is empty); (1, chunks) where fewer than two segments result."""
    nch = -(-max(T, 0) // BT)
    S = min(num_sms // max(B * HV, 1), nch // GF_SEG_MIN_CHUNKS)
    if S < 2:
        return 1, nch
    L = -(-nch // S)
    return -(-nch // L), L


def gf_segments_wanted(B: int, T: int, HV: int, cu_seqlens, device, capturing: bool = False) -> tuple:
    """(S, L) for the gluon forward, its backward's recompute (backend.recompute_segments) and, with HV the CTAs per
    sequence, its reverse pass (chunk_state_bwd.state_bwd_segments): gf_segment_plan's
    under CUDA-graph capture or from GF_SEG_MIN_EAGER_TOKENS tokens, else (1, chunks); fixed-length batches only (the
    segment plan cuts equal sequences)."""
    from linattn.runtime.device import device_facts
    nch = -(-max(T, 0) // BT)
    if cu_seqlens is not None or not (capturing or B * T >= GF_SEG_MIN_EAGER_TOKENS):
        return 1, nch
    facts = device_facts(device)
    return gf_segment_plan(B, T, HV, facts.num_sms if facts.kind == "cuda" else 132)


_PREPARED: dict = {}     # (B, T, HV, device) -> the segment plan's cache key, or None where capture would not segment


def gf_prepare_capture(B: int, T: int, HV: int, device) -> None:
    """On an eager call that runs unsegmented where a CUDA-graph capture of the same call would segment (fewer than
    GF_SEG_MIN_EAGER_TOKENS tokens): build what the segment launch keeps across calls (its segment plan, the side
    stream and its events) now, so that a capture after the usual eager warm-up records none of the plan's
    construction (~35 us of small kernels in every replay at B1 T8192). A repeat call looks the plan up (it is built
    again if the plan cache has dropped it since)."""
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan_cached
    key = (B, T, HV, device)
    if key in _PREPARED:
        plan_key = _PREPARED[key]
        if plan_key is None or segment_plan_cached(*plan_key):
            return
    S, L = gf_segments_wanted(B, T, HV, None, device, capturing=True)
    plan_key = None
    if S > 1:
        from linattn.ops.gated_delta_rule.gluon.fused_forward import prepare_segments
        prepare_segments(B, T, S, L, device)
        plan_key = (B, T, S, L, device)
    if len(_PREPARED) >= 64:
        _PREPARED.clear()
    _PREPARED[key] = plan_key


def fused_gf_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float,
                    cfg: Optional[FusedGfConfig] = None, select: Optional[torch.Tensor] = None,
                    seg: Optional[torch.Tensor] = None):
    """(kernel, grid, args, kwargs) of one launch of chunk_fused_gf_kernel: the arguments of fused_wu_launch (the
    same descriptors and pointers, v's box [BT, 128], the same selection select and segment words seg)."""
    from linattn.ops.gated_delta_rule.gluon.fused_forward import fused_wu_args, selection_args
    cfg = cfg or FusedGfConfig()
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    args = fused_wu_args(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, cfg.BV) + selection_args(
        select, seg, plan.N, HV)
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, STAGES=cfg.stages, NPUB=cfg.npub,
                  USE_H0=initial_state is not None, STORE_HT=final is not None, OUTPUT_REGS=cfg.output_regs,
                  PRODUCER_REGS=PRODUCER_REGS, OUT_PIPE=cfg.out_pipe, SPLIT=cfg.split, STATE_REGS=cfg.state_regs,
                  num_warps=cfg.num_warps)
    return chunk_fused_gf_kernel, (plan.N * HV,), args, kwargs


def chunk_fused_gf_gluon(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float,
                         select: Optional[torch.Tensor] = None, seg: Optional[torch.Tensor] = None,
                         stream=None) -> None:
    """Stages 2b + 3 + 4 at BV = 128 in the gate-free form (a fused_pass for fused_forward's whole forward): writes o
    (and final when given). With seg (segment words over the plan's segments), the segment launch of the
    segment-parallel forward, select [sequences, HV] as chunk_fused_wu_ws_gluon's; select alone is refused (the
    unsegmented pairs run on the W/U kernel, whose chain is the shorter at few CTAs)."""
    if select is not None and seg is None:
        raise ValueError("the gate-free kernel takes a selection only with segment words (seg)")
    from linattn.ops.gated_delta_rule.gluon.host import launches
    kernel, grid, args, kwargs = fused_gf_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale,
                                                 select=select, seg=seg)
    launches(kernel, grid, args, kwargs, stream=stream)
