"""A torch model of the fused Gluon forward kernels' per-CTA schedule (gluon/chunk_fused_wu_ws.py and
gluon/chunk_fused_gf.py), for CPU tests: the partitions are Python generators that stop at every mbarrier wait, a
seeded random scheduler interleaves them with the landing of the producer's TMA copies, so a barrier-protocol error
shows up as a wrong result or as a deadlock (RuntimeError)."""
from __future__ import annotations

from typing import Optional

import torch

from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import NWU
from linattn.ops.gated_delta_rule.gluon.fused_forward import _selection
from linattn.ops.gated_delta_rule.gluon.ws_partitions import BT, NPUB
from linattn.ops.gated_delta_rule.triton.segment_start import SEGW_H0, SEGW_LAST, SEGW_SEQ_SHIFT, SEGW_WL_MASK


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


def emulate_fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float, BV: int = 32,
                        stages: int = 3, nwu: int = NWU, npub: int = NPUB, w_out=None, u_out=None, seed: int = 0,
                        stats: Optional[dict] = None, areg: bool = True, out_pipe: bool = False,
                        select: Optional[torch.Tensor] = None, seg: Optional[torch.Tensor] = None,
                        gate_free: bool = False) -> None:
    """A torch model of chunk_fused_wu_ws_kernel's per-CTA schedule, for CPU tests (the arguments of
    fused_forward.chunk_fused_wu_ws_gluon). The four partitions (state, output, wu, producer) are generators that
    stop at every mbarrier wait; a seeded random scheduler interleaves them with the landing of the producer's TMA
    copies, so the barrier protocol decides which data each step sees: the in-place buffers are modelled in place
    (the ring's v tile holds v, then v * beta, then U; wk[j] holds the scaled k, then W), so a protocol error shows
    up as a wrong result or as a deadlock (RuntimeError). Boxes as the kernel's: full [BT, .] boxes from a chunk's
    first token (the next sequence's rows included, zero past T_tot); roundings as the kernel's.
    w_out [T_tot, HV, K] / u_out [T_tot, HV, V], when given, receive W and U rows < eos.
    areg (the kernel's form; False: every chunk as the last) models the W/U partition: on chunks that end inside the
    sequence, W = (Tinv * (beta exp(gam))[None, :]).to(dt) @ k and U = (Tinv * beta[None, :]).to(dt) @ v with k and v the ring's tiles as loaded (the sequence's last chunk as
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
