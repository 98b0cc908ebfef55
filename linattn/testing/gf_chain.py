"""Models of the gate-free fused forward's state chain (gluon/chunk_fused_gf.py) in PyTorch, with the kernel's bf16
roundings, for choosing a reformulation on the CPU before any kernel is written.

Both models compute one value head of one sequence in float64 and round to bf16 exactly where the kernel stores a
16-bit operand (rnd); fp32 accumulation is modelled as float64 (its error is far below bf16's). Per chunk c, with
gam the in-chunk cumulative gate, gC its last value, d = e^(gC - gam), Tinv_c = (I + A_c)^-1 as stage 2a stores it
(rounded):

  "today" (the kernel's order): s = rnd(S_c); ks = K_c s; x = rnd(beta (v - e^gam ks)); vnew = rnd(Tinv_c x);
      o = scale (e^gam (q s) + rnd(P_c) vnew); vs = rnd(d vnew); S_{c+1} = e^gC S_c + K_c^T vs.
      The chain between two chunks' x is  S publication -> K S (64x64x128) -> x -> Tinv x -> d vnew -> K^T (d vnew)
      (128x64x64) -> S publication.

  "lookahead": K_{c+1} S_{c+1} = e^gC_c (K_{c+1} S_c) + M_c (d vnew_c) with M_c = K_{c+1} K_c^T, so chunk c + 1's
      ks = e^gC_c (K_{c+1} rnd(S_c)) + rnd(M_c) vs_c: the first term and M_c are known a chunk ahead, and the chain
      between two chunks' x is  Tinv x -> d vnew -> M (d vnew) (64x64x64); S_{c+1} (for the output and the next
      chunk's first term) leaves the chain. The output is the same expression as today's.

Rows past the sequence end (the last chunk shorter than 64) are zero in every operand, as the kernel's selects make
them."""
from __future__ import annotations

from typing import Callable, Tuple

import torch

C = 64


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 and back (round to nearest even), as a 16-bit operand store."""
    return x.to(torch.bfloat16).to(x.dtype)


def _chunks(T: int):
    return [(s, min(s + C, T)) for s in range(0, T, C)]


def _chunk_terms(k, g, beta, s, e, rnd):
    """gam, gC, d and Tinv (rounded) of the chunk [s, e), in float64."""
    kc, gc, bc = k[s:e], g[s:e], beta[s:e]
    c = e - s
    gam = gc.cumsum(0)
    strict = torch.ones(c, c, dtype=torch.bool).tril(-1)
    diff = torch.where(strict, gam[:, None] - gam[None, :], torch.zeros(c, c, dtype=gam.dtype))
    A = torch.where(strict, bc[:, None] * (kc @ kc.T) * torch.exp(diff), torch.zeros_like(diff))
    eye = torch.eye(c, dtype=k.dtype)
    tinv = rnd(torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True))
    gC = gam[-1]
    return gam, gC, torch.exp(gC - gam), tinv


def _output(q, k, gam, s_pub, vnew, s, e, scale, rnd):
    qc, kc = q[s:e], k[s:e]
    c = e - s
    incl = torch.ones(c, c, dtype=torch.bool).tril()
    gmat = torch.exp(torch.where(incl, gam[:, None] - gam[None, :], torch.zeros(c, c, dtype=gam.dtype)))
    P = rnd(torch.where(incl, (qc @ kc.T) * gmat, torch.zeros(c, c, dtype=gam.dtype)))
    return scale * (torch.exp(gam)[:, None] * (qc @ s_pub) + P @ vnew)


def chain_today(q, k, v, g, beta, S0, scale: float, rnd: Callable = bf16_round) -> Tuple[torch.Tensor, torch.Tensor]:
    """o [T, V] and the final state [K, V] in the kernel's present order (module docstring)."""
    S = S0.clone()
    outs = []
    for s, e in _chunks(q.shape[0]):
        gam, gC, d, tinv = _chunk_terms(k, g, beta, s, e, rnd)
        kc = k[s:e]
        s_pub = rnd(S)
        ks = kc @ s_pub
        x = rnd(beta[s:e, None] * (v[s:e] - torch.exp(gam)[:, None] * ks))
        vnew = rnd(tinv @ x)
        outs.append(_output(q, k, gam, s_pub, vnew, s, e, scale, rnd))
        S = torch.exp(gC) * S + kc.T @ rnd(d[:, None] * vnew)
    return torch.cat(outs, 0), S


def chain_lookahead(q, k, v, g, beta, S0, scale: float, rnd: Callable = bf16_round) -> Tuple[torch.Tensor, torch.Tensor]:
    """o [T, V] and the final state [K, V] in the lookahead order (module docstring)."""
    S = S0.clone()
    outs = []
    chunks = _chunks(q.shape[0])
    s0, e0 = chunks[0]
    ks = k[s0:e0] @ rnd(S)                         # the first chunk's K S, as today's
    for i, (s, e) in enumerate(chunks):
        gam, gC, d, tinv = _chunk_terms(k, g, beta, s, e, rnd)
        kc = k[s:e]
        s_pub = rnd(S)
        x = rnd(beta[s:e, None] * (v[s:e] - torch.exp(gam)[:, None] * ks))
        vnew = rnd(tinv @ x)
        outs.append(_output(q, k, gam, s_pub, vnew, s, e, scale, rnd))
        vs = rnd(d[:, None] * vnew)
        if i + 1 < len(chunks):
            s1, e1 = chunks[i + 1]
            kn = k[s1:e1]
            M = rnd(kn @ kc.T)                          # keys only: computable a chunk ahead, off the chain
            ks = torch.exp(gC) * (kn @ s_pub) + M @ vs  # (kn @ s_pub): known once S_c is published
        S = torch.exp(gC) * S + kc.T @ vs
    return torch.cat(outs, 0), S


def make_head(T: int, K: int = 128, V: int = 128, decay: float = 1.0, seed: int = 0, h0: bool = True):
    """One value head's float64 inputs from make_gdn_inputs (q, k, v in bf16, as the kernel's inputs, then widened;
    its gates scaled by decay; h0 zero where not h0): (q, k, v [T, *], g, beta [T], S0 [K, V])."""
    from linattn.testing.inputs import make_gdn_inputs
    x = make_gdn_inputs(1, T, 1, 1, K, V, dtype=torch.bfloat16, initial_state=h0,
                        generator=torch.Generator().manual_seed(seed))
    q, k, v = (x[n][0, :, 0].to(torch.float64) for n in ("q", "k", "v"))
    g = x["g"][0, :, 0].to(torch.float64) * decay
    beta = x["beta"][0, :, 0].to(torch.float64)
    S0 = x["initial_state"][0, 0].to(torch.float64) if h0 else torch.zeros(K, V, dtype=torch.float64)
    return q, k, v, g, beta, S0


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300))
