"""`ShortConvolution`: FLA's depthwise causal short convolution module (an nn.Conv1d: weight [D, 1, W], optional
bias [D]; FLA's state-dict names) on linattn.causal_conv1d / causal_conv1d_update."""
from typing import Optional, Tuple

import torch
import torch.nn as nn

from linattn.ops.conv1d import causal_conv1d, causal_conv1d_update, causal_conv1d_update3


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution over [B, T, D] (or packed [1, T, D] with cu_seqlens), with an optional SiLU and
    a carried window: the cache is [N, D, W], the last W inputs of each sequence, oldest first (FLA's layout)."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: Optional[str] = "silu",
                 device=None, dtype=None, **kwargs):
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size,
                         bias=bias, device=device, dtype=dtype)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"ShortConvolution: activation must be None, 'silu' or 'swish', got {activation!r}")
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                cache: Optional[torch.Tensor] = None, output_final_state: bool = False,
                cu_seqlens: Optional[torch.Tensor] = None, **kwargs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [B, T, D]; mask [B, T] zeroes padded inputs (not with cu_seqlens); cache [N, D, W] the windows
        before x (None: zeros); residual [B, T, D] added to the output. A one-token-per-sequence call without
        autograd updates `cache` in place (the decode step). Returns (y [B, T, D], the new windows [N, D, W] if
        output_final_state else None)."""
        B, T, D = x.shape
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if mask is not None:
            if cu_seqlens is not None:
                raise ValueError("ShortConvolution: pass either mask or cu_seqlens, not both")
            x = x * mask.unsqueeze(-1).to(x.dtype)
        step = not torch.is_grad_enabled() and B * T == N
        if step and cu_seqlens is not None:
            # one token per sequence only if no sequence is empty (a host read of the offsets, as FLA does)
            step = bool((cu_seqlens.diff() == 1).all())
        if step:
            return self.step(x, residual, cache, output_final_state)
        y, final = causal_conv1d(x, self.weight.squeeze(1), self.bias, activation=self.activation,
                                 initial_state=cache, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        if residual is not None:
            y = y + residual
        return y, final

    def step(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, cache: Optional[torch.Tensor] = None,
             output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, *,
             state_indices: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One token per sequence (FLA's ShortConvolution.step): x [B, 1, D] (or packed [1, N, D] with cu_seqlens,
        every sequence one token long); cache [N, D, W] (None: zeros), updated in place. state_indices (keyword
        only): [N] int, each row's window in cache, a negative index a padded row (its window is left alone, its
        output is zeros; causal_conv1d_update's pool convention). Returns (y like x, cache if output_final_state
        else None). Inference only (no autograd)."""
        rows = x if cu_seqlens is None else x.transpose(0, 1)             # [N, 1, D], a view either way
        if cache is None:
            cache = x.new_zeros(rows.shape[0], x.shape[-1], self.kernel_size[0])
        y = causal_conv1d_update(rows, cache, self.weight.squeeze(1), self.bias, activation=self.activation,
                                 state_indices=state_indices)
        if cu_seqlens is not None:
            y = y.transpose(0, 1)
        if residual is not None:
            y = y + residual
        return y, (cache if output_final_state else None)


def step3(convs, xs, caches, output_final_state: bool = False, state_indices: Optional[torch.Tensor] = None):
    """ShortConvolution.step of three convolutions over the same rows (a layer's q, k and v in a decode step): one
    kernel launch where they share an activation (causal_conv1d_update3). xs [B, 1, D_i]; caches [N, D_i, W] or
    None (zeros), updated in place. Returns ([y_i], [cache_i] if output_final_state else [None] * 3)."""
    if len({c.activation for c in convs}) != 1:
        outs = [c.step(x, cache=k, output_final_state=output_final_state, state_indices=state_indices)
                for c, x, k in zip(convs, xs, caches)]
        return [o[0] for o in outs], [o[1] for o in outs]
    caches = [k if k is not None else x.new_zeros(x.shape[0], x.shape[-1], c.kernel_size[0])
              for c, x, k in zip(convs, xs, caches)]
    ys = causal_conv1d_update3(xs, caches, [c.weight.squeeze(1) for c in convs], [c.bias for c in convs],
                               activation=convs[0].activation, state_indices=state_indices)
    return ys, (caches if output_final_state else [None] * 3)
