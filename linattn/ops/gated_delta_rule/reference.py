"""Gated DeltaNet in plain PyTorch: the definition every backend is checked against (shared/gdn-math.md).

Both functions take the op's arguments and return `(o, final_state)`. They compute in fp32, or in fp64 when the
inputs are fp64 (the tests call them on fp64 copies). `naive_recurrent` is the step-by-step recurrence;
`chunk_reference` is the differentiable chunk form, used for gradient checks.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from linattn.ops.norm.reference import l2norm  # noqa: F401  (the q / k norm of the reference ops; kda imports it here)


def _compute_dtype(*ts):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _split(cu_seqlens, B, T):
    """(batch index, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    dt = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    H, HV = q.shape[2], v.shape[2]
    # GVA: value head j reads query/key head j // (HV // H)
    q = q.repeat_interleave(HV // H, dim=2)
    k = k.repeat_interleave(HV // H, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q, k, v, g, beta, scale, dt


def naive_recurrent(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                    output_final_state: bool = False, cu_seqlens=None,
                    use_qk_l2norm_in_kernel: bool = False, output_token_states: bool = False):
    """(o, final_state); with output_token_states, (o, final_state, token_states) where token_states[n] is
    [len_n, HV, K, V]: sequence n's state after each of its tokens (what speculative decoding keeps)."""
    B, T = q.shape[:2]
    out_dtype = v.dtype
    q, k, v, g, beta, scale, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    o = torch.zeros(B, T, HV, V, dtype=dt, device=q.device)
    finals, token_states = [], []
    state_dtype = torch.float64 if dt == torch.float64 else torch.float32
    for n, (b, s, e) in enumerate(_split(cu_seqlens, B, T)):
        S = (initial_state[n].to(dt).clone() if initial_state is not None
             else torch.zeros(HV, K, V, dtype=dt, device=q.device))
        seq_states = []
        for t in range(s, e):
            S = S * torch.exp(g[b, t])[:, None, None]
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + torch.einsum("hk,hv->hkv", k[b, t], u)
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t] * scale)
            seq_states.append(S.to(state_dtype))
        finals.append(S)
        token_states.append(torch.stack(seq_states) if seq_states else S.new_zeros(0, HV, K, V, dtype=state_dtype))
    final = torch.stack(finals) if output_final_state else None
    out = (o.to(out_dtype), None if final is None else final.to(state_dtype))
    return out + (token_states,) if output_token_states else out


def _chunk_one(q, k, v, g, beta, scale, S, C):
    """One sequence: q,k [T,HV,K], v [T,HV,V], g,beta [T,HV], S [HV,K,V]. Returns (o [T,HV,V], S_final)."""
    T = q.shape[0]
    outs = []
    for s in range(0, T, C):
        e = min(s + C, T)
        qc, kc, vc = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)   # [HV, c, *]
        gc, bc = g[s:e].transpose(0, 1), beta[s:e].transpose(0, 1)                            # [HV, c]
        c = e - s
        gam = gc.cumsum(-1)
        diff = gam[:, :, None] - gam[:, None, :]
        lower_incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
        # mask before exp: entries above the diagonal would overflow for very negative g
        Gam = torch.exp(torch.where(lower_incl, diff, torch.zeros_like(diff)))
        A = torch.where(strict, bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * Gam, torch.zeros_like(diff))
        eye = torch.eye(c, dtype=q.dtype, device=q.device).expand_as(A)
        Tinv = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        W = Tinv @ ((bc * torch.exp(gam))[:, :, None] * kc)
        U = Tinv @ (bc[:, :, None] * vc)
        Vnew = U - W @ S
        qs = qc * scale
        P = torch.where(lower_incl, (qs @ kc.transpose(-1, -2)) * Gam, torch.zeros_like(diff))
        o = torch.exp(gam)[:, :, None] * (qs @ S) + P @ Vnew
        gl = gam[:, -1:]
        S = torch.exp(gl)[:, :, None] * S + (torch.exp(gl - gam)[:, :, None] * kc).transpose(-1, -2) @ Vnew
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0), S


def chunk_reference(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                    output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False,
                    chunk_size: int = 64) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chunk form of gdn-math.md, differentiable by autograd (for gradient checks)."""
    B, T = q.shape[:2]
    out_dtype = v.dtype
    q, k, v, g, beta, scale, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    rows, finals = [], []
    for n, (b, s, e) in enumerate(_split(cu_seqlens, B, T)):
        S = (initial_state[n].to(dt) if initial_state is not None
             else torch.zeros(HV, K, V, dtype=dt, device=q.device))
        if e > s:
            o, S = _chunk_one(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], scale, S, chunk_size)
        else:
            o = torch.zeros(0, HV, V, dtype=dt, device=q.device)
        rows.append((b, o))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack([r for _, r in rows])
    else:
        o = torch.cat([r for _, r in rows], 0)[None]
    final = torch.stack(finals) if output_final_state else None
    state_dtype = torch.float64 if dt == torch.float64 else torch.float32
    return o.to(out_dtype), None if final is None else final.to(state_dtype)


def fla_gates(g, beta, A_log=None, dt_bias=None, beta_scale: int = 0):
    """FLA's in-kernel gate and beta options as plain functions (fp32, fp64 for fp64 inputs): with A_log (FLA's
    use_gate_in_kernel) g is the raw gate input and the decay is -exp(A_log) * softplus(g + dt_bias), A_log and
    dt_bias of HV elements; with beta_scale (use_beta_sigmoid_in_kernel: 1, or 2 with allow_neg_eigval) beta is a
    logit and beta_scale * sigmoid(beta) is used. Returns (g, beta) as the recurrence takes them."""
    dt = _compute_dtype(g, beta, A_log, dt_bias)
    if A_log is not None:
        x = g.to(dt) + (0 if dt_bias is None else dt_bias.to(dt).reshape(-1))
        g = -torch.exp(A_log.to(dt).reshape(-1)) * F.softplus(x)
    if beta_scale:
        beta = beta_scale * torch.sigmoid(beta.to(dt))
    return g, beta


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None,
                           beta_scale: int = 0, state_v_first: bool = False):
    """The reference backend: the chunk form in plain PyTorch (fp32 math, fp64 for fp64 inputs), with FLA's gate and
    beta options (fla_gates) and state_v_first (initial and final states [N, HV, V, K])."""
    g, beta = fla_gates(g, beta, A_log, dt_bias, beta_scale)
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    o, final = chunk_reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel)
    if state_v_first and final is not None:
        final = final.transpose(-1, -2).contiguous()
    return o, final
