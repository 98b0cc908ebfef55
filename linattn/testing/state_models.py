"""Torch models of the gluon backward's two segment-capable kernels for CPU tests: chunk_state_gf_kernel (the
recompute, gluon/chunk_state_gf.py) and chunk_state_bwd_tma_kernel with stage 1a (DV_LOCAL, the reverse pass,
gluon/chunk_state_bwd.py). Each takes its launcher's arguments and follows the kernel's per-program prologue (the
sequence or segment span, the segment word, the selection, the h / dh slot) and its formulas with the kernel's
operand roundings, so that the host sides (recompute_gf, chunk_state_bwd_gluon's segment launch) can be checked on a
CPU against the Triton stages (tests/test_gluon_state_gf.py, tests/test_gluon_state_bwd.py). They model the
arithmetic, not the partitions' schedule (the forward's barriers are modelled by testing/fused_model.py)."""
from __future__ import annotations

import torch

from linattn.ops.gated_delta_rule.triton.segment_start import SEGW_H0, SEGW_LAST, SEGW_SEQ_SHIFT, SEGW_WL_MASK

BT = 64


def _programs(plan, H: int, HV: int, select, seg, seq_len: int):
    """Per program row nh = n * HV + hv of a launch on plan: (n, hv, hk, bos, eos, slot of its first chunk, warm-up
    chunks, edge flag (SEGW_H0), own flag (SEGW_LAST), the h0 / final row, whether it runs). Without seg: the plan's
    sequence, both flags set, it runs where select (if any) is != 0. With seg: a segment of the fixed-length sequences
    of seq_len tokens, its word's fields, its slot on the sequence plan, it runs where its sequence's select is 0."""
    cu, offs = plan.cu.tolist(), plan.chunk_offsets.tolist()
    sel = None if select is None else select.reshape(-1).tolist()
    words = None if seg is None else seg.reshape(-1).tolist()
    for nh in range(plan.N * HV):
        n, hv = divmod(nh, HV)
        bos, eos = cu[n], cu[n + 1]
        if words is None:
            yield n, hv, hv // (HV // H), bos, eos, offs[n], 0, True, True, n, sel is None or sel[nh] != 0
            continue
        word = words[nh]
        state_n = word >> SEGW_SEQ_SHIFT.value
        slot = state_n * -(-seq_len // BT) + (bos - state_n * seq_len) // BT
        yield (n, hv, hv // (HV // H), bos, eos, slot, word & SEGW_WL_MASK.value, bool(word & SEGW_H0.value),
               bool(word & SEGW_LAST.value), state_n, sel is None or sel[state_n * HV + hv] == 0)


def _rows(x: torch.Tensor, t0: int, T_tot: int) -> torch.Tensor:
    """Rows t0 .. t0 + BT of x (its first dim), zero past T_tot (TMA's zero fill)."""
    out = x.new_zeros((BT,) + tuple(x.shape[1:]))
    hi = min(t0 + BT, T_tot)
    if hi > t0:
        out[:hi - t0] = x[t0:hi]
    return out


def emulate_state_gf(k, v, beta, gcum, tinv16, h, vnew, initial_state, final, plan, select=None, seg=None,
                     seq_len: int = 0, stream=None) -> None:
    """chunk_state_gf_gluon's effect on h, vnew (and final). A segment's chain starts its warm-up chunks before the
    segment (from h0 where the window reaches the sequence start, else 0) and stores from the segment's first row."""
    H, K = k.shape[-2], k.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    T_tot, dt = plan.T_total, k.dtype
    kf, vf = k.reshape(T_tot, H, K), v.reshape(T_tot, HV, V)
    bf = beta.reshape(T_tot, HV).float()
    for n, hv, hk, bos, eos, slot_base, wl, h0_on, ht_on, state_n, runs in _programs(plan, H, HV, select, seg,
                                                                                      seq_len):
        o_lo, bos, slot_base = bos, bos - wl * BT, slot_base - wl       # the chain starts wl chunks early
        nch = -(-max(eos - bos, 0) // BT) if runs else 0
        s = torch.zeros(K, V)
        if initial_state is not None and h0_on:
            s = initial_state[state_n, hv].float().clone()
        for c in range(nch):
            t0 = bos + c * BT
            r = torch.arange(t0, t0 + BT)
            valid = (r < eos)[:, None]
            s_pub = s.to(dt)
            kc = _rows(kf[:, hk], t0, T_tot).float()
            vc = _rows(vf[:, hv], t0, T_tot).float()
            gam = torch.where(valid[:, 0], _rows(gcum[:, hv], t0, T_tot), 0.)
            bet = torch.where(valid[:, 0], _rows(bf[:, hv], t0, T_tot), 0.)
            gam_last = gam[min(eos - t0, BT) - 1]
            x = torch.where(valid, bet[:, None] * (vc - gam.exp()[:, None] * (kc @ s_pub.float())), 0.).to(dt)
            vn = torch.where(valid, _rows(tinv16[:, hv], t0, T_tot).float() @ x.float(), 0.).to(dt)
            if t0 >= o_lo:
                h[slot_base + c, hv] = s_pub
                m = valid[:, 0]
                vnew[r[m], hv] = vn[m]
            d = torch.where(valid[:, 0], (gam_last - gam).exp(), 0.)
            s = gam_last.exp() * s + kc.to(dt).float().T @ (vn.float() * d[:, None]).to(dt).float()
        if final is not None and ht_on and runs:
            final[state_n, hv] = s


def emulate_state_bwd(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale: float, cfg, dv_local: bool,
                      select=None, seg=None, seq_len: int = 0) -> None:
    """The DV_LOCAL kernel's effect on dh, dvnew and dh0 (chunk_state_bwd's `_launch` arguments; cfg's V split
    changes no value and is ignored). A segment's chain runs its warm-up chunks past the segment's end first (from d
    final_state where the window reaches the sequence end, else 0), stores dh and dVnew of its own rows, and d
    initial_state as its sequence's first segment."""
    if not dv_local:
        raise NotImplementedError("the model is of the DV_LOCAL kernel (the gluon backend's)")
    dt = q.dtype
    H, K = q.shape[-2], q.shape[-1]
    HV, V = dvnew.shape[1], dvnew.shape[2]
    T_tot = plan.T_total
    q2, k2 = q.reshape(T_tot, H, K).float(), k.reshape(T_tot, H, K).float()
    do2 = do.reshape(T_tot, HV, V).float()
    for n, hv, hk, bos, eos, slot0, wl, dht_on, dh0_on, state_n, runs in _programs(plan, H, HV, select, seg,
                                                                                    seq_len):
        seg_end = eos
        if seg is not None:
            eos = min(eos + wl * BT, (state_n + 1) * seq_len)
        if not runs:
            eos, dh0_on = bos, False
        dS = torch.zeros(K, V)
        if dht is not None and dht_on:
            dS = dht[state_n, hv].float().clone()
        for c in reversed(range(-(-max(eos - bos, 0) // BT))):
            t0 = bos + BT * c
            rows = slice(t0, min(t0 + BT, eos))
            nt = rows.stop - rows.start
            gam = gcum[rows, hv]
            gl_ = gam[-1]
            Q, Kt, dO, W = q2[rows, hk], k2[rows, hk], do2[rows, hv], w[rows, hv].float()
            if t0 < seg_end:
                dh[slot0 + c, hv] = dS.to(dh.dtype)
            upper = torch.ones(nt, nt).triu().bool()
            pt = torch.where(upper, scale * (Kt @ Q.T) * torch.where(upper, gam[None, :] - gam[:, None],
                                                                     torch.zeros(())).exp(), torch.zeros(()))
            kdec = (Kt * (gl_ - gam).exp()[:, None]).to(dt).float()
            dvn = pt.to(dt).float() @ dO.to(dt).float() + kdec @ dS.to(dt).float()
            keep = torch.arange(t0, rows.stop) < seg_end
            dvnew[torch.arange(t0, rows.stop)[keep], hv] = dvn[keep].to(dvnew.dtype)
            qg = (Q * (gam.exp() * scale)[:, None]).to(dt).float()
            dS = gl_.exp() * dS + qg.T @ dO.to(dt).float() - W.T @ dvn.to(dt).float()
        if dh0 is not None and dh0_on:
            dh0[state_n, hv] = dS
