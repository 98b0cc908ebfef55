"""Padding masks to packed sequences and back (FLA's unpad / repad of its layers, in plain differentiable torch)."""
from typing import Optional, Tuple

import torch


def unpad(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor]
          ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """[B, T, ...] with a 0/1 mask [B, T'] (T' >= T: its last T columns apply, as for a decode step after a padded
    prefill) -> ([1, total, ...] the kept tokens packed, their flat indices, int32 cu_seqlens [B + 1]).

    Explicit cu_seqlens win: the input then comes back unchanged, as FLA does. Without a mask nothing changes.
    Packing reads the mask on the host (the packed length decides the output's shape).
    """
    if cu_seqlens is not None or attention_mask is None:
        return hidden_states, None, cu_seqlens
    B, T = hidden_states.shape[:2]
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(f"attention_mask must be a 0/1 padding mask [batch, >= seq_len] = [{B}, >= {T}] "
                         f"(0 marks padding), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[:, attention_mask.shape[1] - T:].bool()
    indices = torch.nonzero(mask.flatten()).flatten()
    lens = mask.sum(-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    packed = hidden_states.reshape(B * T, *hidden_states.shape[2:]).index_select(0, indices).unsqueeze(0)
    return packed, indices, cu


def repad(x: torch.Tensor, indices: Optional[torch.Tensor], batch_size: int, seq_len: int) -> torch.Tensor:
    """unpad's inverse: [1, total, ...] -> [batch_size, seq_len, ...], zeros at the padded positions."""
    if indices is None:
        return x
    flat = x.new_zeros(batch_size * seq_len, *x.shape[2:]).index_copy(0, indices, x.squeeze(0))
    return flat.reshape(batch_size, seq_len, *x.shape[2:])
