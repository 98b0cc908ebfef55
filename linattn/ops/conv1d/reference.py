"""The depthwise causal convolution in plain PyTorch (fp64-capable, differentiable by plain autograd): the
"reference" backend of `causal_conv1d` and `causal_conv1d_update`, and the ground truth of their tests.

Per sequence, the window is the initial state's W columns followed by the sequence's tokens; token t reads window
positions t + 1 .. t + W (weight column j multiplies position t + 1 + j, so column W - 1 multiplies the token
itself), and the final state is the window's last W positions. Reads cu_seqlens and state_indices on the host."""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _spans(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> List[Tuple[int, int, int]]:
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, x.shape[1]) for b in range(x.shape[0])]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def conv_window(xs: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                activation: Optional[str], dt: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """One sequence: xs [L, D], h0 [D, W] or None. Returns (y [L, D], final state [D, W]) in dt."""
    L, D = xs.shape
    W = weight.shape[1]
    pre = torch.zeros(W, D, dtype=dt, device=xs.device) if h0 is None else h0.to(dt).transpose(0, 1)
    win = torch.cat([pre, xs.to(dt)], 0)                                   # [W + L, D]
    w = weight.to(dt)
    a = sum(w[:, j] * win[1 + j:1 + j + L] for j in range(W))
    if bias is not None:
        a = a + bias.to(dt)
    y = F.silu(a) if activation is not None else a
    return y, win[L:L + W].transpose(0, 1)


def causal_conv1d_reference(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                            activation=None, cu_seqlens=None):
    """x [B, T, D], weight [D, W], bias [D], residual [B, T, D] (added after the activation), initial_state
    [N, D, W]. Returns (y [B, T, D] in x's dtype, final state [N, D, W] in x's dtype or None); computes in fp32
    (fp64 for fp64 x)."""
    dt = _compute_dtype(x)
    spans = _spans(x, cu_seqlens)
    ys, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        h0 = None if initial_state is None else initial_state[n]
        y, fin = conv_window(x[b, s:e], weight, bias, h0, activation, dt)
        ys.append(y)
        finals.append(fin)
    if cu_seqlens is None:
        y = torch.stack(ys, 0)
    else:
        y = torch.cat(ys, 0)[None]
    if residual is not None:
        y = y + residual.to(dt)
    final = torch.stack(finals, 0).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final


def causal_conv1d_update_reference(x, conv_state, weight, bias=None, activation=None, state_indices=None):
    """x [N, D] or [N, T, D]; conv_state [slots, D, W] updated in place (in its dtype); state_indices [N] or None
    (row n uses slot n). A negative or out-of-range slot is a padded row: zero output, no state read or write."""
    squeeze = x.dim() == 2
    x3 = x[:, None] if squeeze else x
    dt = _compute_dtype(x)
    slots = list(range(x3.shape[0])) if state_indices is None else [int(i) for i in state_indices.tolist()]
    y = torch.zeros(x3.shape, dtype=dt, device=x.device)
    for n, slot in enumerate(slots):
        if not 0 <= slot < conv_state.shape[0]:
            continue
        yn, fin = conv_window(x3[n], weight, bias, conv_state[slot], activation, dt)
        y[n] = yn
        conv_state[slot] = fin.to(conv_state.dtype)
    y = y.to(x.dtype)
    return y[:, 0] if squeeze else y
