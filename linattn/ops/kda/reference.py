"""Kimi Delta Attention (KDA) in plain PyTorch: the definition every KDA backend is checked against.

KDA is Gated DeltaNet with a decay per key channel: g [B, T, HV, K] (log decay, <= 0) instead of [B, T, HV]. With
state S [K, V] per (sequence, value head), for t = 1..T:

    S   <- diag(exp(g_t)) S                   # each key row of the state decays at its own rate
    u_t  = beta_t (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T (scale q_t)

Computes in fp32, or in fp64 when an input is fp64 (the tests call it on fp64 copies); every step is a torch op,
so autograd differentiates it (the gradient reference). Layouts and GVA as Gated DeltaNet (shared/gdn-math.md).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from linattn.ops.gated_delta_rule.reference import _split, l2norm


def kda_gate(g: torch.Tensor, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
             lower_bound: Optional[float] = None) -> torch.Tensor:
    """FLA 0.6's KDA gate on the raw input g [B, T, HV, K] (in g's precision, fp32 at least): A_log [HV], dt_bias
    [HV * K]. Without lower_bound: -exp(A_log) * softplus(g + dt_bias). With lower_bound:
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), or lower_bound * sigmoid(g + dt_bias) without A_log."""
    dt = torch.float64 if g.dtype == torch.float64 else torch.float32
    HV, K = g.shape[-2], g.shape[-1]
    x = g.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.to(dt).view(HV, K)
    if lower_bound is None:
        return -torch.exp(A_log.to(dt)).view(HV, 1) * F.softplus(x)
    if A_log is not None:
        x = torch.exp(A_log.to(dt)).view(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


def naive_recurrent_kda(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                        output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                        output_token_states: bool = False):
    """(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] or None); q, k [B, T, H, K], v [B, T, HV, V],
    g [B, T, HV, K] log decays, beta [B, T, HV] (post-sigmoid), initial_state [N, HV, K, V]. With
    output_token_states, a third item: per sequence its states after each token, [len_n, HV, K, V]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    dt = torch.float64 if any(t is not None and t.dtype == torch.float64
                              for t in (q, k, v, g, beta, initial_state)) else torch.float32
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(HV // H, dim=2)       # GVA: value head j reads query/key head j // (HV // H)
    k = k.repeat_interleave(HV // H, dim=2)
    scale = K ** -0.5 if scale is None else scale
    rows, finals, token_states = [], [], []
    for n, (b, s, e) in enumerate(_split(cu_seqlens, B, T)):
        S = (initial_state[n].to(dt) if initial_state is not None
             else torch.zeros(HV, K, V, dtype=dt, device=q.device))
        outs, seq_states = [], []
        for t in range(s, e):
            S = S * torch.exp(g[b, t])[:, :, None]
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[b, t] * scale))
            seq_states.append(S)
        rows.append(torch.stack(outs) if outs else v.new_zeros(0, HV, V))
        finals.append(S)
        token_states.append(torch.stack(seq_states) if seq_states else S.new_zeros(0, HV, K, V))
    o = torch.stack(rows) if cu_seqlens is None else torch.cat(rows, 0)[None]
    final = torch.stack(finals) if output_final_state else None
    out = (o.to(out_dtype), final)
    return out + (token_states,) if output_token_states else out
