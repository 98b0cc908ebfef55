"""Stages 2b + 3 + 4 of the GDN forward at BV = 128 (one CTA per sequence and value head) in the gate-free form, one
warp-specialised Gluon kernel (sm_90a; the gluon forward's default since round 22 where gf_wanted holds,
LINATTN_GDN_GLUON_GF128 "1" always / "0" never; design, budgets and measurements: benchmarks/GLUON_BV128.md).

Why: chunk_fused_wu_ws.py forms W = Tinv diag(beta e^gam) K, which does not depend on V, once per V block: at its
BV = 32 / 64 every chunk's W is computed 4 / 2 times per head (OPT_LOG 21.5: the W/U warpgroup bounds the chain at
B1). At BV = 128 that kernel spills (OPT_LOG 22.4: four partitions cannot hold the state's [128, 128] accumulator,
product 1's and the W/U accumulators). FlashQLA's gate-free form needs neither W nor U:

    Vnew = U - W S = Tinv diag(beta) (V - diag(e^gam) K S)

so the W/U warpgroup goes away and the state warpgroup forms Vnew from the ring's k, v and Tinv tiles. Per chunk c,
with dt the 16-bit operand dtype and gam / beta the chunk's gates (0 on rows past the sequence end):
  state partition (default, 1 warpgroup; with STATE_WGS = 2, the default since round 24, two: below):
      s_pub     = S_c.to(dt)                                                  (published; also K S's B operand)
      x         = where(valid, beta * (v - e^gam * (K @ s_pub)), 0).to(dt)   -> vn_s, in two column halves
      vnew      = where(valid, Tinv @ vn_s, 0).to(dt)                        -> v_pub (published)
      S_{c+1}   = e^gam_C S_c + K^T @ (d * vnew).to(dt),  d = e^(gam_C - gam)  (vn_s rewritten after Tinv's wgmma)
  output partition (worker 0, 1 warpgroup): chunk_fused_wu_ws._wu_output (OUT_PIPE: q k^T one chunk ahead), BV = 128.
  producer (worker 1, 1 warp): chunk_fused_wu_ws._wu_producer: q, k [BT, K], v [BT, BV], Tinv [BT, BT] per chunk.
Rows of a box past the sequence end hold the next sequence's tokens: x's rows there are selected to 0 (where, so
values that are not finite cannot leak) and Tinv's rows of valid tokens have zeros past the diagonal, so Vnew of
valid rows is exact; the rows past the end are selected to 0 again after the product.

STATE_WGS = 2 (LINATTN_GDN_GLUON_GF_STATE2; the default since round 24, 1.06-1.13x over one state partition): the
state chain in two partitions, the default and worker 0, each holding the [K, BV / 2] half of S's columns. Every
product of the chain is column-separable (K S, Tinv x and K^T (d vnew) act on a column half independently), so each
partition publishes its half of S and vnew, forms its half of x and d * vnew in its columns of vn_s, and the halves
meet only at the ring (empty count 3) and the publication barriers (s_full, v_full count 2). Four warpgroups: output
176, worker state 152, default state Gluon's remainder.

Barriers as chunk_fused_ws.py with two consumers (ready[s] count 1 + tx; empty[s] count 2: the state partition after
product 3 (v read by generic loads: fenced), the output after q k^T and q S; s_full, v_full, pub_empty per published
buffer). Shared memory at BV = 128, 2 stages, one published pair: ring 2 x (q 16 + k 16 + v 16 + Tinv 8 KB), s_pub
32 KB, v_pub 16 KB, vn_s 16 KB (x, then d * vnew) = 176 KB plus the output's layout conversions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import BT, PRODUCER_REGS
from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, warpgroup_mma,
                                          warpgroup_mma_wait)

GF_BV = 128
GF_STAGES = 2
GF_NPUB = 1
GF_SPLIT = 2             # product 1 (K S) and x in column halves (register pressure, see _gf_state)
GF_OUTPUT_REGS = 240     # setmaxnreg of the output warpgroup (the state's is set by Gluon); sm_90a AOT: 0 spill at
#                          224 and 240 with SPLIT = 2 (without it 8 bytes at every split from 200 to 240: OPT_LOG 22.5)
GF_KS_PIPE_OUTPUT_REGS = 232   # with KS_PIPE (two product-1 accumulators live in the state warpgroup): 8 bytes of
#                                spill at 240, 0 at 232 and 224 (sm_90a AOT, plain and segment builds)
# Two state partitions (STATE_WGS = 2, LINATTN_GDN_GLUON_GF_STATE2; the default since round 24): four warpgroups
# share the 64K registers (128 per thread on average). sm_90a AOT, SPLIT = 2 (product 1 in two [64, 32] halves per
# partition): 0 spill in the plain, KS_PIPE, segment and segment + KS_PIPE builds with the output at 176 and the
# worker state partition at 152 (the default state partition gets Gluon's remainder, 160). SPLIT = 1 kept 4 bytes
# (the switch loop's shared-memory base) in local memory at every split tried, as did the output at 192 with two of
# the four builds.
# Where the state partitions issue the next chunk's gate loads (_gf_state GATE_AT; LINATTN_GDN_GLUON_GF_GATE_AT "0",
# "1", "2" overrides): 0, the loop's top. Round 28 (RESULTS.md part B, bit-equal): 1 0.89-0.97x, 2 0.99-1.02x.
GF_GATE_AT = 0
# The fence before a state partition releases its ring slot (_gf_state RELEASE_FENCE; LINATTN_GDN_GLUON_GF_RELEASE_FENCE
# "0" / "1" overrides): kept. Round 28 part F without it: gate green, bit-equal, 0.97-1.01x (flat).
GF_RELEASE_FENCE = True
GF_STATE2_OUTPUT_REGS = 176
GF_STATE2_STATE_REGS = 152
GF_STATE2_SPLIT = 2
# The transposed state partitions (STATE_T, _gf_state_t; opt-in LINATTN_GDN_GLUON_GF_STATE_T=1, round 28): the output
# at 168, the worker state partition at 160 (the default state partition gets 160 too). sm_90a AOT: 16 bytes of spill
# (two loop values per state partition, one prologue value across the dispatch) against 32 at 176 / 152; wgmma not
# serialised (at 176 / 144 ptxas serialised them: C7512).
GF_STATE_T_OUTPUT_REGS = 168
GF_STATE_T_STATE_REGS = 160

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (_segment_word, _wu_output, _wu_producer,
                                                                      _wu_ring_load)
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import (_ws_barriers, _ws_barriers_invalidate, ws_acc_layout,
                                                                   ws_smem_layout)
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
                  SPLIT: gl.constexpr, h0_on, ht_on, KS_PIPE: gl.constexpr = False, COL0: gl.constexpr = 0,
                  NC: gl.constexpr = 0, GATE_AT: gl.constexpr = 0, RELEASE_FENCE: gl.constexpr = True):
        """The state chain (module docstring). h0 is loaded only where h0_on != 0 (else the chain starts from 0), the
        final state stored only where ht_on != 0 (both 1 outside the segment launch: chunk_fused_wu_ws._segment_word),
        and n is the h0 / final row (the whole sequence's in the segment launch). KS_PIPE: product 1's column half h + 1
        is issued (asynchronously) before half h's x is formed and stored, so that its wgmma runs under that work.
        COL0, NC (NC = 0: all BV): the columns [COL0, COL0 + NC) of S, x, vnew that this partition holds (STATE_WGS = 2:
        two state partitions of BV / 2 columns each; every product of the chain is column-separable, so the halves
        share only the ring and the publication barriers).
        GATE_AT: where chunk c + 1's gate loads are issued in chunk c. A fence_async_shared (MEMBAR.ALL.CTA +
        FENCE.VIEW.ASYNC.S in SASS) can wait for this thread's global loads in flight, so the placement decides which
        fence, if any, waits on them. 0: at the loop's top, before S's publication (the default); 1: after the
        publication's fence and arrive (the next fence, x's, comes after product 1 and x); 2: after x's fence (the
        next, d * vnew's, comes after product 2 and vnew's publication). The same loads and arithmetic in each:
        bit-equal results.
        Round 28: 1 is 0.89-0.97x, 2 0.99-1.02x; the publication fence's long-scoreboard stall (~8% of a state
        partition's samples) is mostly the MEMBAR's own (it stays with no global load in the loop: STATE_T)."""
        dt: gl.constexpr = k_s.dtype
        NCOL: gl.constexpr = BV if NC == 0 else NC
        # this partition's columns of the published pair and of the x / d * vnew buffer (the whole buffers where
        # NCOL == BV, so that the one-partition build is unchanged)
        vn_c = vn_s
        if NCOL < BV:
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
            # the gates of chunk c + 1 in flight during this chunk (masked past the end); GATE_AT: where (docstring)
            if GATE_AT == 0:
                gam_n, bet_n, gam_last_n = _gf_gates(gcum_ptr, beta_ptr, t0 + BT, eos, hv, r_t, HV, BT)

            # publish S_c once the output partition is done with chunk c - NPUB
            j = c % NPUB
            mbarrier.wait(pub_empty.index(j), ((c // NPUB) & 1) ^ 1)
            _gf_cols(s_pub.index(j), COL0, NCOL, BV).store(s.to(dt))
            fence_async_shared()                               # generic store -> wgmma (async proxy)
            gl.thread_barrier()
            mbarrier.arrive(s_full.index(j))
            if GATE_AT == 1:
                gam_n, bet_n, gam_last_n = _gf_gates(gcum_ptr, beta_ptr, t0 + BT, eos, hv, r_t, HV, BT)

            st = c % STAGES
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)
            valid = gl.expand_dims((t0 + r_t) < eos, 1)
            # product 1: K S_c; x = beta (v - e^gam K S_c), rows past the end selected to 0. In column halves of
            # BV / 2 (SPLIT): with S's 128 registers live, a whole [64, 128] product and the v tile next to it left
            # the state warpgroup 2 registers short (8 bytes spilled, reloaded every chunk)
            HB: gl.constexpr = NCOL // SPLIT
            ACC_H: gl.constexpr = ws_acc_layout(HB)
            valid_h = gl.convert_layout(valid, ACC_H)
            bet_h = gl.expand_dims(gl.convert_layout(bet, gl.SliceLayout(1, ACC_H)), 1)
            eg_h = gl.expand_dims(gl.convert_layout(gl.exp(gam), gl.SliceLayout(1, ACC_H)), 1)
            if KS_PIPE:
                ks = warpgroup_mma(k_s.index(st), _gf_cols(s_pub.index(j), COL0, NCOL, BV).slice(0, HB, dim=1),
                                   gl.zeros([BT, HB], gl.float32, ACC_H), use_acc=False)
                for h in gl.static_range(SPLIT):
                    if h + 1 < SPLIT:      # the next half's product in flight under this half's x
                        ks_n = warpgroup_mma(k_s.index(st),
                                             _gf_cols(s_pub.index(j), COL0, NCOL, BV).slice((h + 1) * HB, HB, dim=1),
                                             gl.zeros([BT, HB], gl.float32, ACC_H), use_acc=False, is_async=True)
                    v = v_s.index(st).slice(COL0 + h * HB, HB, dim=1).load(ACC_H).to(gl.float32)
                    vn_c.slice(h * HB, HB, dim=1).store(gl.where(valid_h, bet_h * (v - eg_h * ks), 0.).to(dt))
                    if h + 1 < SPLIT:
                        ks = warpgroup_mma_wait(0, deps=[ks_n])
            else:
                for h in gl.static_range(SPLIT):
                    ks = warpgroup_mma(k_s.index(st), _gf_cols(s_pub.index(j), COL0, NCOL, BV).slice(h * HB, HB, dim=1),
                                       gl.zeros([BT, HB], gl.float32, ACC_H), use_acc=False)
                    v = v_s.index(st).slice(COL0 + h * HB, HB, dim=1).load(ACC_H).to(gl.float32)
                    vn_c.slice(h * HB, HB, dim=1).store(gl.where(valid_h, bet_h * (v - eg_h * ks), 0.).to(dt))
            fence_async_shared()
            gl.thread_barrier()
            if GATE_AT == 2:
                gam_n, bet_n, gam_last_n = _gf_gates(gcum_ptr, beta_ptr, t0 + BT, eos, hv, r_t, HV, BT)
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
            # this partition's share of ring slot st is done (v read by generic loads: fence before the TMA refill).
            # RELEASE_FENCE = False: no fence here, the one after d * vnew's store (above) already follows every
            # generic access of this chunk to the slot (v's loads come before it), and product 3 is an async-proxy
            # read; a MEMBAR-backed fence stalls on its own (round 28, OPT_LOG 28.1)
            if RELEASE_FENCE:
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
    def _gf_producer_g(q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, g_s, ready, empty, gready, gcum_ptr,
                       beta_ptr, nchunks, bos, eos, hv, hk, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                       BT: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr):
        """chunk_fused_wu_ws._wu_producer (the TMA of q, k, v, Tinv into ring slot c % STAGES), and the chunk's gate
        factors staged into g_s[4 slot + i] after the copies are issued, so the loads' latency runs under the copies':
        i = 0 e^gam, 1 beta, 2 d = e^(gam_C - gam), 3 e^gam_C in every entry (gam, beta 0 on rows >= eos, as
        _gf_gates' masked loads; the same exponentials of the same values as _gf_state's, so bit-equal). The state
        partitions' tiles are transposed, so each of their threads would hold 16 tokens' gates (round 28: their
        exponentials there, 8x those of the row orientation, made the transposed chain 0.86-0.91x the default).
        gready[slot] (count 1) is arrived once they are stored. The slot is free again when empty[slot] completes
        (the state partitions read it before they arrive there)."""
        LG: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        r = gl.arange(0, BT, layout=LG)
        for c in range(nchunks):
            st = _wu_ring_load(q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, c, bos, hv, hk, 0,
                               K, V, BT, BV, STAGES)
            rows = bos + c * BT + r
            gam = gl.load(gcum_ptr + rows * HV + hv, mask=rows < eos, other=0.)
            bet = gl.load(beta_ptr + rows * HV + hv, mask=rows < eos, other=0.).to(gl.float32)
            # gam at the chunk's last valid token (exactly: a sum of it and zeros)
            gam_last = gl.sum(gl.where(r == gl.minimum(eos - bos - c * BT, BT).to(gl.int32) - 1, gam, 0.), axis=0)
            g_s.index(4 * st).store(gl.exp(gam))
            g_s.index(4 * st + 1).store(bet)
            g_s.index(4 * st + 2).store(gl.exp(gam_last - gam))
            g_s.index(4 * st + 3).store(gl.exp(gl.zeros([BT], gl.float32, LG) + gam_last))
            mbarrier.arrive(gready.index(st))                 # release: the stores above before the consumers' reads

    @gluon.jit
    def _gf_state_t(k_s, v_s, t_s, g_s, ready, empty, gready, s_pub, v_pub, s_full, v_full, pub_empty,
                    h0_ptr, ht_ptr, nchunks, bos, eos, n, hv,
                    HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                    STAGES: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
                    h0_on, ht_on, COL0: gl.constexpr, NCOL: gl.constexpr):
        """The state chain of _gf_state (STATE_WGS = 2, columns [COL0, COL0 + NCOL) of S), transposed (STATE_T): the
        partition holds S^T [NCOL, K] and every product of the chain takes its 16-bit A operand from registers, so
        that nothing the chain computes goes through shared memory on its way to the next product:
            ks^T   = S_c^T K^T                            (A: S_c^T in bf16, registers; B: the k tile, K-major view)
            x^T    = where(valid, beta (v^T - e^gam ks^T), 0)                 (v^T: the v tile read transposed)
            vnew^T = where(valid, x^T Tinv^T, 0)          (A: x^T, registers; B: the Tinv tile, K-major view)
            S^T    = e^gam_C S^T + (d vnew)^T K           (A: registers; B: the k tile as stored)
        The same roundings as _gf_state (S, x, vnew, d vnew in bf16 where it rounds them). ks^T, x^T and d vnew^T
        are formed in two halves of the chunk's BT / 2 tokens (register pressure: a token's gates are replicated
        over a thread's 16 columns of the transposed tiles), the products over those halves accumulated. The gates
        come from g_s, staged by the producer (_gf_producer_g): no global load in this partition's loop, so no
        fence waits on one. S_c^T and vnew^T are still published (s_pub [BV, K], v_pub [BV, BT]: the output
        partition reads them transposed, PUB_T), but each publication's stores and fence run while a product is in
        flight (ks^T, then the S update), not between two products of the chain. The ring's v tile is read by
        generic loads before v_pub's fence, which so also orders them before the slot's release.
        Round 28 on an H200 (RESULTS.md parts C-H): bit-equal to _gf_state's results, the whole gate green, the forward
        0.96-0.99x the default's (0.86-0.91x before the gate factors were staged): opt-in. Its partitions then wait on
        their products 6% of the time and issue the transposed layout's elementwise work ~80%."""
        dt: gl.constexpr = k_s.dtype
        HT: gl.constexpr = BT // 2
        ACC_S: gl.constexpr = ws_acc_layout(K)                # S^T [NCOL, K]
        ACC_H: gl.constexpr = ws_acc_layout(HT)               # ks^T, x^T halves [NCOL, BT / 2]
        OPA_H: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_H, k_width=2)
        OPA_SH: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_S, k_width=2)
        COLS_H: gl.constexpr = gl.SliceLayout(0, ACC_H)
        s = gl.zeros([NCOL, K], gl.float32, ACC_S)
        if USE_H0:
            if h0_on != 0:
                # h0 [K, V] read transposed, straight in the accumulator layout (once per CTA)
                sv = gl.arange(0, NCOL, layout=gl.SliceLayout(1, ACC_S)) + COL0
                sk = gl.arange(0, K, layout=gl.SliceLayout(0, ACC_S))
                s = gl.load(h0_ptr + (n.to(gl.int64) * HV + hv) * K * V + gl.expand_dims(sk, 0) * V
                            + gl.expand_dims(sv, 1))
        r_h = gl.arange(0, HT, layout=COLS_H)
        for c in range(nchunks):
            t0 = bos + c * BT
            j = c % NPUB
            st = c % STAGES
            # publish S_c^T once the output partition is done with chunk c - NPUB; it is also ks^T's A operand
            # (from registers, S^T in bf16 next to S^T in fp32 left the worker partition short: wgmma serialised)
            s_mine = s_pub.index(j).slice(COL0, NCOL, dim=0)
            mbarrier.wait(pub_empty.index(j), ((c // NPUB) & 1) ^ 1)
            s_mine.store(s.to(dt))
            fence_async_shared()                               # generic store -> wgmma (async proxy)
            gl.thread_barrier()
            mbarrier.arrive(s_full.index(j))
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)
            k_t = k_s.index(st).permute((1, 0))                # [K, BT]
            ks0 = warpgroup_mma(s_mine, k_t.slice(0, HT, dim=1), gl.zeros([NCOL, HT], gl.float32, ACC_H),
                                use_acc=False, is_async=True)
            ks1 = warpgroup_mma(s_mine, k_t.slice(HT, HT, dim=1), gl.zeros([NCOL, HT], gl.float32, ACC_H),
                                use_acc=False, is_async=True)
            mbarrier.wait(gready.index(st), (c // STAGES) & 1)
            eg_s = g_s.index(4 * st)
            bet_s = g_s.index(4 * st + 1)
            d_s = g_s.index(4 * st + 2)
            v_t = v_s.index(st).slice(COL0, NCOL, dim=1).permute((1, 0))   # [NCOL, BT]
            t_t = t_s.index(st).permute((1, 0))                # Tinv^T [BT, BT]
            ks0, ks1 = warpgroup_mma_wait(0, deps=[ks0, ks1])
            # x^T by halves of the chunk's tokens (columns), then vnew^T by halves: vnew_h = x_0 Tinv^T[0:HT, h] +
            # x_1 Tinv^T[HT:, h], and the S update over both halves of the tokens (register pressure, docstring).
            # The chunk's valid tokens as one int32 count (per-column 64-bit compares cost registers here: a thread
            # holds 16 tokens of the transposed tiles)
            lim = gl.minimum(eos - t0, BT).to(gl.int32)
            valid0 = gl.expand_dims(r_h < lim, 0)
            valid1 = gl.expand_dims(r_h + HT < lim, 0)
            v0 = v_t.slice(0, HT, dim=1).load(ACC_H).to(gl.float32)
            x0 = gl.where(valid0, gl.expand_dims(bet_s.slice(0, HT).load(COLS_H), 0)
                          * (v0 - gl.expand_dims(eg_s.slice(0, HT).load(COLS_H), 0) * ks0), 0.).to(dt)
            x0 = gl.convert_layout(x0, OPA_H)
            v1 = v_t.slice(HT, HT, dim=1).load(ACC_H).to(gl.float32)
            x1 = gl.where(valid1, gl.expand_dims(bet_s.slice(HT, HT).load(COLS_H), 0)
                          * (v1 - gl.expand_dims(eg_s.slice(HT, HT).load(COLS_H), 0) * ks1), 0.).to(dt)
            x1 = gl.convert_layout(x1, OPA_H)
            zh = gl.zeros([NCOL, HT], gl.float32, ACC_H)
            vn0 = warpgroup_mma(x0, t_t.slice(0, HT, dim=0).slice(0, HT, dim=1), zh, use_acc=False, is_async=True)
            vn0 = warpgroup_mma(x1, t_t.slice(HT, HT, dim=0).slice(0, HT, dim=1), vn0, is_async=True)
            vn1 = warpgroup_mma(x0, t_t.slice(0, HT, dim=0).slice(HT, HT, dim=1), zh, use_acc=False, is_async=True)
            vn1 = warpgroup_mma(x1, t_t.slice(HT, HT, dim=0).slice(HT, HT, dim=1), vn1, is_async=True)
            egl = gl.max(g_s.index(4 * st + 3).slice(0, HT).load(COLS_H), axis=0)    # e^gam_C (all entries equal)
            vn0, vn1, x0, x1 = warpgroup_mma_wait(0, deps=[vn0, vn1, x0, x1])
            vn0 = gl.where(valid0, vn0, 0.).to(dt)
            vn1 = gl.where(valid1, vn1, 0.).to(dt)
            vs0 = gl.convert_layout(gl.where(valid0, vn0.to(gl.float32)
                                             * gl.expand_dims(d_s.slice(0, HT).load(COLS_H), 0), 0.).to(dt), OPA_SH)
            vs1 = gl.convert_layout(gl.where(valid1, vn1.to(gl.float32)
                                             * gl.expand_dims(d_s.slice(HT, HT).load(COLS_H), 0), 0.).to(dt), OPA_SH)
            k_c = k_s.index(st)
            s = warpgroup_mma(vs0, k_c.slice(0, HT, dim=0), s * egl, is_async=True)
            s = warpgroup_mma(vs1, k_c.slice(HT, HT, dim=0), s, is_async=True)
            # publish vnew^T while the S update runs (the output partition's att vnew); this fence also orders the
            # generic loads of the ring's v tile before the slot's release below
            v_mine = v_pub.index(j).slice(COL0, NCOL, dim=0)
            v_mine.slice(0, HT, dim=1).store(vn0)
            v_mine.slice(HT, HT, dim=1).store(vn1)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(v_full.index(j))
            s, vs0, vs1 = warpgroup_mma_wait(0, deps=[s, vs0, vs1])
            gl.thread_barrier()                                # every warp's S update has read the k tile
            mbarrier.arrive(empty.index(st))
        if STORE_HT:
            if ht_on != 0:
                sv = gl.arange(0, NCOL, layout=gl.SliceLayout(1, ACC_S)) + COL0
                sk = gl.arange(0, K, layout=gl.SliceLayout(0, ACC_S))
                gl.store(ht_ptr + (n * HV + hv).to(gl.int64) * (K * V) + gl.expand_dims(sk, 0) * V
                         + gl.expand_dims(sv, 1), s)

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
        OUTPUT_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, OUT_PIPE: gl.constexpr = True,
        SPLIT: gl.constexpr = GF_SPLIT, KS_PIPE: gl.constexpr = False,
        STATE_WGS: gl.constexpr = 1, STATE_REGS: gl.constexpr = 0, GATE_AT: gl.constexpr = 0,
        STATE_T: gl.constexpr = False, RELEASE_FENCE: gl.constexpr = True,
    ):
        gl.static_assert(BV == V, "the gate-free kernel holds a whole value head: BV == V")
        gl.static_assert(GATE_AT >= 0 and GATE_AT <= 2, "GATE_AT: 0, 1 or 2 (_gf_state)")
        dt: gl.constexpr = k_desc.dtype
        nh = gl.program_id(0)
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)
        # the segment warm-up, as chunk_fused_wu_ws_kernel's (_segment_word). The segments of a pair that sel_ptr
        # sends to the other launch run no chunk and store no final state: an early return instead made ptxas keep
        # two prologue values in local memory across the partitions' dispatch (8 bytes of spill, sm_90a AOT).
        # sel_ptr is read only with seg_ptr.
        WARM: gl.constexpr = seg_ptr is not None
        o_lo, state_n, bos, nchunks, h0_on, ht_on = _segment_word(seg_ptr, nh, n, bos, nchunks, BT)
        if WARM:
            if sel_ptr is not None:
                # a segment of a (sequence, head) that runs unsegmented (the other launch) does nothing
                if gl.load(sel_ptr + state_n * HV + hv) != 0:
                    nchunks = 0
                    ht_on = 0

        q_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [STAGES, BT, BV], v_desc.layout)
        t_s = gl.allocate_shared_memory(dt, [STAGES, BT, BT], t_desc.layout)
        # empty: the state partitions + the output; s_full / v_full: one arrival per state partition
        ready, empty, s_full, v_full, pub_empty = _ws_barriers(STAGES, NPUB, 1 + STATE_WGS, STATE_WGS)

        if STATE_T:
            # the transposed chain (_gf_state_t): S^T and vnew^T published, no x / d * vnew buffer
            gl.static_assert(STATE_WGS == 2, "STATE_T: two state partitions")
            HALF_T: gl.constexpr = BV // 2
            s_pub_t = gl.allocate_shared_memory(dt, [NPUB, BV, K], ws_smem_layout(K, dt.primitive_bitwidth))
            v_pub_t = gl.allocate_shared_memory(dt, [NPUB, BV, BT], ws_smem_layout(BT, dt.primitive_bitwidth))
            # the gate factors per ring slot: [4 * slot + i], staged by _gf_producer_g
            g_s = gl.allocate_shared_memory(gl.float32, [4 * STAGES, BT],
                                            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
            gready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(gready.index(i), count=1)
            fence_async_shared()
            gl.warp_specialize(
                [(_gf_state_t, (k_s, v_s, t_s, g_s, ready, empty, gready, s_pub_t, v_pub_t, s_full, v_full,
                                pub_empty, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES,
                                NPUB, USE_H0, STORE_HT, h0_on, ht_on, 0, HALF_T)),
                 (_gf_state_t, (k_s, v_s, t_s, g_s, ready, empty, gready, s_pub_t, v_pub_t, s_full, v_full,
                                pub_empty, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES,
                                NPUB, USE_H0, STORE_HT, h0_on, ht_on, HALF_T, HALF_T)),
                 (_wu_output, (q_s, k_s, ready, empty, s_pub_t, v_pub_t, s_full, v_full, pub_empty, gcum_ptr, o_ptr,
                               scale, nchunks, bos, eos, hv, 0, HV, V, BT, BV, STAGES, NPUB, OUT_PIPE, o_lo, WARM,
                               True, True)),
                 (_gf_producer_g, (q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, g_s, ready, empty, gready,
                                   gcum_ptr, beta_ptr, nchunks, bos, eos, hv, hk, HV, K, V, BT, BV, STAGES))],
                worker_num_warps=[4, 4, 1], worker_num_regs=[STATE_REGS, OUTPUT_REGS, PRODUCER_REGS])
            _ws_barriers_invalidate(ready, empty, s_full, v_full, pub_empty, STAGES, NPUB)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(gready.index(i))
            return
        s_pub = gl.allocate_shared_memory(dt, [NPUB, K, BV], ws_smem_layout(BV, dt.primitive_bitwidth))
        v_pub = gl.allocate_shared_memory(dt, [NPUB, BT, BV], v_desc.layout)
        vn_s = gl.allocate_shared_memory(dt, [BT, BV], v_desc.layout)
        if STATE_WGS == 1:
            gl.warp_specialize(
                [(_gf_state, (k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr,
                              gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES, NPUB,
                              USE_H0, STORE_HT, SPLIT, h0_on, ht_on, KS_PIPE, 0, 0, GATE_AT, RELEASE_FENCE)),
                 (_wu_output, (q_s, k_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, gcum_ptr, o_ptr, scale,
                               nchunks, bos, eos, hv, 0, HV, V, BT, BV, STAGES, NPUB, OUT_PIPE, o_lo, WARM)),
                 (_wu_producer, (q_desc, k_desc, v_desc, t_desc, q_s, k_s, v_s, t_s, ready, empty, nchunks, bos, hv,
                                 hk, 0, K, V, BT, BV, STAGES))],
                worker_num_warps=[4, 1], worker_num_regs=[OUTPUT_REGS, PRODUCER_REGS])
        else:
            # two state partitions (the default and worker 0), each the [K, BV / 2] half of S's columns: the chain's
            # serial elementwise work per chunk (S's publication, x, d * vnew) halves, its products run at N = BV / 2
            gl.static_assert(STATE_WGS == 2, "STATE_WGS: 1 or 2 state partitions")
            HALF: gl.constexpr = BV // 2
            gl.warp_specialize(
                [(_gf_state, (k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr,
                              gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES, NPUB,
                              USE_H0, STORE_HT, SPLIT, h0_on, ht_on, KS_PIPE, 0, HALF, GATE_AT,
                              RELEASE_FENCE)),
                 (_gf_state, (k_s, v_s, t_s, ready, empty, s_pub, v_pub, vn_s, s_full, v_full, pub_empty, beta_ptr,
                              gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, state_n, hv, HV, K, V, BT, BV, STAGES, NPUB,
                              USE_H0, STORE_HT, SPLIT, h0_on, ht_on, KS_PIPE, HALF, HALF, GATE_AT,
                              RELEASE_FENCE)),
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
    ks_pipe: bool = False  # KS_PIPE (fused_gf_config: the plain launch's default since round 23)
    num_warps: int = 4     # the default (state) partition; the kernel launches 12 warps (3 warpgroups), 16 with
    #                        state_wgs == 2 (4 warpgroups)
    state_wgs: int = 1     # 2: two state partitions of BV / 2 columns (LINATTN_GDN_GLUON_GF_STATE2; 16 warps;
    #                        fused_gf_config's default since round 24)
    state_regs: int = 0    # setmaxnreg of the worker state partition where state_wgs == 2
    gate_at: int = 0       # GATE_AT (_gf_state): where the state partitions issue the next chunk's gate loads
    state_t: bool = False  # STATE_T (_gf_state_t): the two state partitions hold S^T (LINATTN_GDN_GLUON_GF_STATE_T)
    release_fence: bool = True   # RELEASE_FENCE (_gf_state; LINATTN_GDN_GLUON_GF_RELEASE_FENCE=0 drops it)


def fused_gf_config(segments: bool = False) -> FusedGfConfig:
    """The launch config. Two state partitions (STATE_WGS=2, LINATTN_GDN_GLUON_GF_STATE2 unset or "1"; "0": one) since
    round 24: H200 (RESULTS.md round 24 part B, gate green, o and final bit-equal), CUDA graphs, against one state
    warpgroup: 1.113x B8 T4096, 1.133x B4 T16384, 1.125x varlen24, 1.067x B1 T65536, 1.059x B1 T8192, 1.073x B2 T32768
    (H16/HV32); 1.096x / 1.069x at HV64 B8 / B4; 1.058x / 1.061x at H2/HV8 B1 T65536 / B8 T4096.
    KS_PIPE (product 1's halves pipelined; with one state partition the output warpgroup at GF_KS_PIPE_OUTPUT_REGS),
    LINATTN_GDN_GLUON_GF_KS_PIPE unset: with two state partitions on both launches (round 24 part G, gate green with it
    forced on, bit-equal: the segment launch 1.009-1.014x at all six rows, B1-B2 HV32 and H2/HV8; the plain launch
    0.996-1.006x in part E), with one on the plain launch only; "1" both, "0" neither. Round 23 with one state
    partition (OPT_LOG 23.6; gate green forced on, bit-equal): plain launch 1.017x B8 T4096, 1.039x B4 T16384, 1.013x
    varlen24 (H16/HV32); segment launch 0.989x B1 T65536, 0.995x B1 T8192, 1.001x H2/HV8 B1 T65536."""
    from linattn.runtime.settings import settings
    mode = settings.gdn_gluon_gf_ks_pipe
    state2 = settings.gdn_gluon_gf_state2 != "off"
    ks_pipe = mode == "on" or (mode == "auto" and (state2 or not segments))
    gate_at = settings.gdn_gluon_gf_gate_at
    if gate_at is None:
        gate_at = GF_GATE_AT
    fence = settings.gdn_gluon_gf_release_fence
    release_fence = GF_RELEASE_FENCE if fence == "auto" else fence == "on"
    if state2 and settings.gdn_gluon_gf_state_t:
        return FusedGfConfig(output_regs=GF_STATE_T_OUTPUT_REGS, split=GF_STATE2_SPLIT, ks_pipe=ks_pipe, state_wgs=2,
                             state_regs=GF_STATE_T_STATE_REGS, state_t=True)
    if state2:
        return FusedGfConfig(output_regs=GF_STATE2_OUTPUT_REGS, split=GF_STATE2_SPLIT, ks_pipe=ks_pipe, state_wgs=2,
                             state_regs=GF_STATE2_STATE_REGS, gate_at=gate_at, release_fence=release_fence)
    if ks_pipe:
        return FusedGfConfig(output_regs=GF_KS_PIPE_OUTPUT_REGS, ks_pipe=True, gate_at=gate_at,
                             release_fence=release_fence)
    return FusedGfConfig(gate_at=gate_at, release_fence=release_fence)


def gf_supported(q: torch.Tensor, v: torch.Tensor) -> tuple:
    """Whether the gate-free BV=128 kernel takes the call (on top of fused_wu_supported): V == 128 (one CTA holds a
    whole value head)."""
    if v.shape[-1] != GF_BV:
        return False, f"V={v.shape[-1]}: the gate-free kernel holds a whole value head of {GF_BV}"
    return True, ""


def gf_wanted(N: int, HV: int, num_sms: int) -> bool:
    """Where the gate-free kernel is the default (LINATTN_GDN_GLUON_GF128 unset): at least 15/16 of a wave of
    (sequence, value head) CTAs, N * HV * 16 >= 15 * SMs (124 on an H200). Its chunk step (~4 us at B1, H200) is
    ~2.4x the BV=32 kernel's, bought back by doing a whole head's V (W once instead of per V block): H200, round 22
    (83a788d): 1.074-1.111x at N * HV = 128 / 256 / 512 / 768, 0.871x / 0.895x at 64, ~0.45x at 32."""
    return N * HV * 16 >= 15 * num_sms


# The segment launch at BV=128 (LINATTN_GDN_GLUON_GF_SEGMENTS): at B1-B2 the gate-free kernel has one CTA per value
# head (32-64 on 132 SMs) and a ~4 us chunk step; cut each sequence into as many segments as one wave of CTAs holds,
# each started a gate-truncated warm-up early (triton/segment_start.py, as the W/U kernel's opt-in segments), and the
# chain per CTA shortens by that factor. One wave, not more: every further wave pays a whole segment chain again.
GF_SEG_MIN_CHUNKS = 16     # no segment shorter: a warm-up window (~3 chunks at production decay) stays <= ~20% of it
# LINATTN_GDN_GLUON_GF_SEGMENTS unset: the default since round 23 (H200, gate green with the segments forced on; B1-B2
# HV32 forward 1.34-1.58x as CUDA graphs, H2/HV8 B1 1.85x / 4.57x at T8192 / T65536; where every head decays slowly
# 0.993-1.009x and where half do 0.994x at HV32, 1.000x at H2/HV8: those pairs run unsegmented; OPT_LOG 23.1-23.4)
GF_SEGMENTS_AUTO = True
# An eager call (not under CUDA-graph capture) is segmented by default only from this many tokens: the segment path's
# host time (~0.55 ms per call on the H200 machine, round 23: two more launches, the side stream) exceeds the GPU time
# of shorter calls. Round 23, B1 H16/HV32 eager: T8192 0.566 vs 0.290 ms unsegmented, T16384 0.573 vs 0.506, T32768
# 0.640 vs 0.994; as CUDA graphs 1.34x / 1.46x / 1.54x faster.
GF_SEG_MIN_EAGER_TOKENS = 32768


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
    """(S, L) for the gluon forward (LINATTN_GDN_GLUON_GF_SEGMENTS: "1" wherever gf_segment_plan splits, "0" never,
    unset: where GF_SEGMENTS_AUTO, under CUDA-graph capture or from GF_SEG_MIN_EAGER_TOKENS tokens), or (1, chunks):
    fixed-length batches only (the segment plan cuts equal sequences)."""
    from linattn.runtime.device import device_facts
    from linattn.runtime.settings import settings
    nch = -(-max(T, 0) // BT)
    mode = settings.gdn_gluon_gf_segments
    if mode == "off" or cu_seqlens is not None:
        return 1, nch
    if mode == "auto" and not (GF_SEGMENTS_AUTO and (capturing or B * T >= GF_SEG_MIN_EAGER_TOKENS)):
        return 1, nch
    facts = device_facts(device)
    return gf_segment_plan(B, T, HV, facts.num_sms if facts.kind == "cuda" else 132)


def fused_gf_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float,
                    cfg: Optional[FusedGfConfig] = None, select: Optional[torch.Tensor] = None,
                    seg: Optional[torch.Tensor] = None):
    """(kernel, grid, args, kwargs) of one launch of chunk_fused_gf_kernel: the arguments of fused_wu_launch (the
    same descriptors and pointers, v's box [BT, 128], the same selection select and segment words seg)."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import fused_wu_args, selection_args
    cfg = cfg or fused_gf_config(segments=seg is not None)
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    args = fused_wu_args(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, cfg.BV) + selection_args(
        select, seg, plan.N, HV)
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, STAGES=cfg.stages, NPUB=cfg.npub,
                  USE_H0=initial_state is not None, STORE_HT=final is not None, OUTPUT_REGS=cfg.output_regs,
                  PRODUCER_REGS=PRODUCER_REGS, OUT_PIPE=cfg.out_pipe, SPLIT=cfg.split, KS_PIPE=cfg.ks_pipe,
                  STATE_WGS=cfg.state_wgs, STATE_REGS=cfg.state_regs, GATE_AT=cfg.gate_at, STATE_T=cfg.state_t,
                  RELEASE_FENCE=cfg.release_fence, num_warps=cfg.num_warps)
    return chunk_fused_gf_kernel, (plan.N * HV,), args, kwargs


def chunk_fused_gf_gluon(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float,
                         select: Optional[torch.Tensor] = None, seg: Optional[torch.Tensor] = None) -> None:
    """Stages 2b + 3 + 4 at BV = 128 in the gate-free form (a fused_pass for chunk_fused_wu_ws's whole forward):
    writes o (and final when given). With seg (segment words over the plan's segments), the segment launch of the
    segment-parallel forward, select [sequences, HV] as chunk_fused_wu_ws_gluon's; select alone is refused (the
    unsegmented pairs run on chunk_fused_wu_ws, whose chain is the shorter at few CTAs)."""
    if select is not None and seg is None:
        raise ValueError("the gate-free kernel takes a selection only with segment words (seg)")
    from linattn.ops.gated_delta_rule.gluon.launcher import launches
    kernel, grid, args, kwargs = fused_gf_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale,
                                                 select=select, seg=seg)
    launches(kernel, grid, args, kwargs)
