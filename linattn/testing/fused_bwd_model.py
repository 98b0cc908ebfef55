"""A torch model of the fused per-chunk GDN backward (gdn-backward-design.md, P1), for CPU tests and precision
studies: per sequence, the chunks walked in reverse with dS carried in fp32, every chunk's gradients formed from
the inputs, the chunk-start state h and dS alone (nothing of the forward but h; dVnew, Vnew, W, dA, P and dP stay
local to the chunk), in the decomposition the fused kernel is to use:

  A      = (I + strict_lower(diag(beta) K K^T))^-1     gate-free, depends on k and beta only (what a forward can save)
  Ag     = (Gam * A) diag(beta)                         the gated Tinv times beta (Gam_ij = exp(gam_i - gam_j), i >= j)
  W      = Ag diag(exp gam) K,  Vnew = Ag V - W S       (U = Ag V; Vnew from V - exp(gam) K S in one product)
  Pg     = scale (Q K^T) * Gam on i >= j
  dVnew  = Pg^T dO + diag(exp(gam_C - gam)) K dS
  dS'    = exp(gam_C) dS + scale (diag(exp gam) Q)^T dO - W^T dVnew       (the chain: K dS, then W^T dVnew)
  dQ     = scale diag(exp gam) dO S^T + dP K,  dP = scale (dO Vnew^T) * Gam on i >= j
  dK     = dP^T Q + diag(exp(gam_C - gam)) Vnew dS^T + diag(exp gam) Ag^T dW + (dKK + dKK^T) K,  dW = -dVnew S^T
  dV     = Ag^T dVnew
  dAg    = dW (diag(exp gam) K)^T + dVnew V^T;  dT = dAg diag(beta);  dA = dT * Gam;  dA0 = -(A^T dA A^T) strict
  dbeta  = colsum(T * dAg) + rowsum(dA0 * K K^T);  dKK = diag(beta) dA0
  dgam   = rowsum(E) - colsum(E) for E = dP * (Q K^T) + dT * T (the Gam terms), + rowsum(Q * dQ_state),
           + exp(gam) rowsum(K * Ag^T dW), - x + [last row] (sum(x) + exp(gam_C) sum(dS * S)),
           x = rowsum(K * diag(exp(gam_C - gam)) Vnew dS^T);   dg = the in-chunk reverse cumsum of dgam

Rounding points (where the kernel holds a product's operand in 16 bits; `rnd` = None keeps everything in the
compute dtype): h as the recompute stores it, A as the forward saves it (`a_dtype`), Ag, W, Pg, dP as dQ's and dK's
operand, Vnew, dVnew, dS (as K dS's operand), and the operands of the dS chain's Q^T and K^T products. The dA chain
(A^T dA A^T) stays fp32, as exact transposes (FlashQLA's hi/lo halves, or TF32 with both operands K-major) give, and
the gate term E takes dP before its rounding: with the rounded dP, dg's error doubles where the gates decay fast
(g ~ -(0.3 + 5 U): 2.1e-3 -> 3.2e-3 relative RMS at bf16, against 1.5e-3 for the Triton backward). Sums over the
value heads of a key head (GVA) are formed after the walk."""
from __future__ import annotations

from typing import Dict, Optional

import torch

BT = 64


def _round(x: torch.Tensor, dt: Optional[torch.dtype]) -> torch.Tensor:
    return x if dt is None else x.to(dt).to(x.dtype)


def _spans(cu_seqlens, B: int, T: int):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _chunk_consts(kc, bc, gc, a_dtype):
    """Per chunk [HV, c, *]: gam, Gam (masked before exp), the gate-free A (rounded as saved), K K^T."""
    c = kc.shape[1]
    gam = gc.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool).tril()
    strict = torch.ones(c, c, dtype=torch.bool).tril(-1)
    diff = gam[:, :, None] - gam[:, None, :]
    Gam = torch.where(lower, torch.exp(torch.where(lower, diff, torch.zeros_like(diff))), torch.zeros_like(diff))
    kk = kc @ kc.transpose(-1, -2)
    A0 = torch.where(strict, bc[:, :, None] * kk, torch.zeros_like(kk))
    eye = torch.eye(c, dtype=kc.dtype).expand_as(A0)
    A = torch.linalg.solve_triangular(eye + A0, eye, upper=False, unitriangular=True)
    return gam, Gam, lower, strict, kk, _round(A, a_dtype)


def fused_bwd_model(q, k, v, g, beta, do, dht=None, initial_state=None, scale: Optional[float] = None,
                    cu_seqlens=None, rnd: Optional[torch.dtype] = None, a_dtype: Optional[torch.dtype] = None,
                    compute_dtype: torch.dtype = torch.float64) -> Dict[str, torch.Tensor]:
    """Gradients of chunk_gated_delta_rule (no l2norm, g and beta as given) for q, k [B, T, H, K], v, do
    [B, T, HV, V], g, beta [B, T, HV], dht / initial_state [N, HV, K, V]: dict(dq, dk, dv, dg, dbeta, dh0), in
    compute_dtype. rnd: the 16-bit operand dtype of the kernel's products; a_dtype: the saved A's dtype."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    cd = compute_dtype
    f = lambda x: x.to(cd)                                             # noqa: E731
    q, k, v, g, beta, do = f(q), f(k), f(v), f(g), f(beta), f(do)
    dq = torch.zeros(B, T, HV, K, dtype=cd)
    dk = torch.zeros(B, T, HV, K, dtype=cd)
    dv = torch.zeros(B, T, HV, V, dtype=cd)
    dg = torch.zeros(B, T, HV, dtype=cd)
    dbeta = torch.zeros(B, T, HV, dtype=cd)
    spans = _spans(cu_seqlens, B, T)
    dh0 = torch.zeros(len(spans), HV, K, V, dtype=cd)
    r = lambda x: _round(x, rnd)                                       # noqa: E731
    for n, (b, s, e) in enumerate(spans):
        qh = q[b, s:e].repeat_interleave(G, dim=1).transpose(0, 1)     # [HV, t, K]
        kh = k[b, s:e].repeat_interleave(G, dim=1).transpose(0, 1)
        vh, doh = v[b, s:e].transpose(0, 1), do[b, s:e].transpose(0, 1)
        gh, bh = g[b, s:e].transpose(0, 1), beta[b, s:e].transpose(0, 1)
        starts = list(range(0, e - s, BT))
        # the recompute: chunk-start states in fp32, stored rounded (the forward's chain, gdn-math.md)
        S = f(initial_state[n]) if initial_state is not None else torch.zeros(HV, K, V, dtype=cd)
        hs = []
        for c0 in starts:
            c1 = min(c0 + BT, e - s)
            kc, vc, gc, bc = kh[:, c0:c1], vh[:, c0:c1], gh[:, c0:c1], bh[:, c0:c1]
            gam, Gam, _, _, _, A = _chunk_consts(kc, bc, gc, a_dtype)
            hs.append(r(S))
            Ag = r(Gam * A * bc[:, None, :])
            vnew = Ag @ r(vc - torch.exp(gam)[:, :, None] * (kc @ hs[-1]))
            gC = gam[:, -1:]
            S = torch.exp(gC)[:, :, None] * S + (torch.exp(gC - gam)[:, :, None] * kc).transpose(-1, -2) @ r(vnew)
        dS = f(dht[n]) if dht is not None else torch.zeros(HV, K, V, dtype=cd)
        for ci in reversed(range(len(starts))):
            c0 = starts[ci]
            c1 = min(c0 + BT, e - s)
            qc, kc, vc, doc = qh[:, c0:c1], kh[:, c0:c1], vh[:, c0:c1], doh[:, c0:c1]
            gc, bc, Sh = gh[:, c0:c1], bh[:, c0:c1], hs[ci]
            gam, Gam, lower, strict, kk, A = _chunk_consts(kc, bc, gc, a_dtype)
            eg = torch.exp(gam)[:, :, None]
            gC = gam[:, -1]
            ed = torch.exp(gC[:, None] - gam)[:, :, None]               # exp(gam_C - gam)
            T_ = Gam * A
            Ag = r(T_ * bc[:, None, :])
            W = r(Ag @ (eg * kc))
            vnew = r(Ag @ r(vc - eg * (kc @ Sh)))
            Pk = qc @ kc.transpose(-1, -2)
            Pg = r(torch.where(lower, scale * Pk * Gam, torch.zeros_like(Pk)))
            dvnew = r(Pg.transpose(-1, -2) @ doc + r(ed * kc) @ r(dS))
            dS_prev = (torch.exp(gC)[:, None, None] * dS + r(scale * eg * qc).transpose(-1, -2) @ doc
                       - W.transpose(-1, -2) @ dvnew)
            dq_state = scale * eg * (doc @ Sh.transpose(-1, -2))
            dPg = doc @ vnew.transpose(-1, -2)
            dPf = torch.where(lower, scale * dPg * Gam, torch.zeros_like(dPg))      # fp32: the gate terms' dP
            dP = r(dPf)                                                             # dQ's and dK's operand
            dqc = dq_state + dP @ kc
            dks = ed * (vnew @ r(dS).transpose(-1, -2))
            dW = r(-(dvnew @ Sh.transpose(-1, -2)))
            agtdw = Ag.transpose(-1, -2) @ dW
            dAg = dW @ (eg * kc).transpose(-1, -2) + dvnew @ vc.transpose(-1, -2)
            dT = dAg * bc[:, None, :]
            dA = torch.where(lower, dT * Gam, torch.zeros_like(dT))
            dA0 = torch.where(strict, -(A.transpose(-1, -2) @ dA @ A.transpose(-1, -2)), torch.zeros_like(dA))
            dkk = bc[:, :, None] * dA0
            dkc = dP.transpose(-1, -2) @ qc + dks + eg * agtdw + (dkk + dkk.transpose(-1, -2)) @ kc
            dvc = Ag.transpose(-1, -2) @ dvnew
            dbc = (T_ * dAg).sum(-2) + (dA0 * kk).sum(-1)
            E = torch.where(lower, dPf * Pk + dT * T_, torch.zeros_like(dT))
            x = (kc * dks).sum(-1)
            dgam = (E.sum(-1) - E.sum(-2) + (qc * dq_state).sum(-1) + torch.exp(gam) * (kc * agtdw).sum(-1) - x)
            dgam[:, -1] += x.sum(-1) + torch.exp(gC) * (dS * Sh).sum((-1, -2))
            dgc = dgam.flip(-1).cumsum(-1).flip(-1)
            dq[b, s + c0:s + c1] = dqc.transpose(0, 1)
            dk[b, s + c0:s + c1] = dkc.transpose(0, 1)
            dv[b, s + c0:s + c1] = dvc.transpose(0, 1)
            dg[b, s + c0:s + c1] = dgc.transpose(0, 1)
            dbeta[b, s + c0:s + c1] = dbc.transpose(0, 1)
            dS = dS_prev
        dh0[n] = dS
    # GVA: a key head's gradient is the sum over its value heads
    dq = dq.reshape(B, T, H, G, K).sum(3)
    dk = dk.reshape(B, T, H, G, K).sum(3)
    return dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0)
