"""What FLA's delta-rule layers share around their core op, for linattn's GatedDeltaNet and KimiDeltaAttention:
the mode choice, the layer's cache entry, padding masks packed into varlen sequences (or, for a one-token step with
a mask and cached states, padded rows turned into padded state slots without a host read), the q/k/v projections
through causal short convolutions with SiLU, the cache update, and the gated output norm and projection."""
import math
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn.layers.conv import ShortConvolution, step3
from linattn.layers.padding import repad, unpad
from linattn.ops.matmul.linear_group import LinearGroup


class RecurrentLayer(nn.Module):
    """Base of the layers: __init__ sets the shared sizes and the q/k/v projections and convolutions (in FLA's
    parameter order: the subclass adds its own parameters after); subclasses add o_norm, o_proj, g_proj (or None)
    and call _forward_setup / _qkv / _finish around their op."""

    def __init__(self, hidden_size: int, expand_v: float, head_dim: int, num_heads: int, num_v_heads: Optional[int],
                 mode: str, use_short_conv: bool, conv_size: int, conv_bias: bool, layer_idx: Optional[int]):
        """The sizes and options every layer has (FLA's attribute names), checked, and the q/k/v projections with
        their short convolutions."""
        super().__init__()
        self._linear_group = LinearGroup()       # the projections of a decode step in one launch (_projections)
        self._slot_rows = {}            # (batch, device) -> (arange, all -1): _decode_slots' operands
        self.mode = mode
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.layer_idx = layer_idx
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v={expand_v} times head_dim={head_dim} must be an integer (the value head "
                             f"size), got {head_dim * expand_v}")
        if self.num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of num_heads={num_heads} (GVA)")
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'fused_recurrent', got {mode!r}")
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, activation="silu")
        else:
            warnings.warn(f"{type(self).__name__}: use_short_conv=False drops the short convolutions, which matter "
                          "for the model's quality (FLA warns the same)")

    def _layer_cache(self, past_key_values):
        if past_key_values is None:
            return None
        if self.layer_idx is None:
            raise ValueError(f"{type(self).__name__}: layer_idx must be set to use past_key_values")
        if len(past_key_values) > self.layer_idx:
            return past_key_values[self.layer_idx]
        return None

    def _decode_slots(self, attention_mask, batch_size, q_len, recurrent_state, conv_states, use_cache):
        """For a one-token step with a padding mask whose states are all cached and updated in place: [B] int32
        slots, row b's own index where its last mask column is set and -1 (a padded row) where not, computed on the
        device. The decode op and the short convolutions then leave a padded row's states alone and give it zero
        outputs, which the gated norm and o_proj keep zero: what packing the live rows would give, without reading
        the mask on the host. None where packing stays (a longer input, an uncached or out-of-place state)."""
        if q_len != 1 or not use_cache or attention_mask.shape[0] != batch_size or attention_mask.shape[1] < 1:
            return None
        if recurrent_state is None or recurrent_state.dtype != torch.float32 or \
                recurrent_state.shape[0] != batch_size or not recurrent_state.is_contiguous():
            return None
        if self.use_short_conv and any(c is None or c.shape[0] != batch_size for c in conv_states):
            return None
        key = (batch_size, attention_mask.device)
        rows = self._slot_rows.get(key)
        if rows is None:        # made once per batch size and device: the step then adds two small ops (ne, where)
            if len(self._slot_rows) >= 64:
                self._slot_rows.clear()
            rows = self._slot_rows[key] = (torch.arange(batch_size, dtype=torch.int32, device=key[1]),
                                           torch.full((batch_size,), -1, dtype=torch.int32, device=key[1]))
        return torch.where(attention_mask[:, -1] != 0, *rows)

    def _forward_setup(self, hidden_states, attention_mask, past_key_values, use_cache, kwargs) -> dict:
        """Checks the inputs, picks the mode (chunk with autograd; the recurrent op for inference calls of at most
        64 tokens; else self.mode) and reads the cache; packs a padded batch. Returns a dict: x (the layer input,
        packed where a mask asked), indices, cu_seqlens, slots, recurrent_state, conv_states, mode, batch_size,
        q_len."""
        name = type(self).__name__
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [batch, seq_len, {self.hidden_size}], got "
                             f"{tuple(hidden_states.shape)}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a 0/1 padding mask [batch, seq_len] (0 marks padding); "
                             f"an attention matrix of shape {tuple(attention_mask.shape)} is not supported")
        batch_size, q_len, _ = hidden_states.shape
        if torch.is_grad_enabled():
            mode = "chunk"
        elif q_len <= 64 and not self.training:
            mode = "fused_recurrent"
        else:
            mode = self.mode
        if self.training and mode != "chunk":
            raise ValueError(f"{name}: training runs the chunk mode only (fused_recurrent has no backward)")

        last_state = self._layer_cache(past_key_values)
        recurrent_state = last_state.get("recurrent_state") if last_state is not None else None
        conv_states = (None, None, None)
        if self.use_short_conv and last_state is not None and last_state.get("conv_state") is not None:
            conv_states = last_state["conv_state"]
        slots = None
        if attention_mask is not None and mode == "fused_recurrent" and kwargs.get("cu_seqlens") is None:
            slots = self._decode_slots(attention_mask, batch_size, q_len, recurrent_state, conv_states, use_cache)
        if slots is None:
            x, indices, cu_seqlens = unpad(hidden_states, attention_mask, kwargs.get("cu_seqlens"))
        else:       # a one-token step with a mask: padded rows become padded slots, no packing (no host read)
            x, indices, cu_seqlens = hidden_states, None, None
        return dict(x=x, indices=indices, cu_seqlens=cu_seqlens, slots=slots, recurrent_state=recurrent_state,
                    conv_states=conv_states, mode=mode, batch_size=batch_size, q_len=q_len)

    def _projections(self, x: torch.Tensor, *mods: nn.Module):
        """mods(x) for bias-free projections of x: one launch for all of them in an inference call of at most 64
        rows (LinearGroup: a decode step reads each weight once), each module's own call otherwise."""
        return self._linear_group(x, mods)

    def _qkv(self, s: dict, use_cache: bool, projected=None):
        """q, k [.., num_heads, head_k_dim] and v [.., num_v_heads, head_v_dim]: the projections (or `projected`,
        the three already computed) through the short convolutions with SiLU (their windows updated in
        s["conv_states"]), or SiLU alone without them."""
        x, slots, conv_states = s["x"], s["slots"], s["conv_states"]
        if projected is None:
            projected = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if self.use_short_conv:
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            # a one-token step (padded slots, or one token per row without packing): the three window updates in
            # one launch; ShortConvolution's forward would take its step path for each
            one_step = slots is not None or (not torch.is_grad_enabled() and s["cu_seqlens"] is None
                                             and x.shape[1] == 1)
            if not one_step:
                out, new_states = [], []
                for conv, p, cache in zip(convs, projected, conv_states):
                    y, c = conv(p, cache=cache, output_final_state=use_cache, cu_seqlens=s["cu_seqlens"])
                    out.append(y)
                    new_states.append(c)
            else:
                out, new_states = step3(convs, list(projected), conv_states, output_final_state=use_cache,
                                        state_indices=slots)
            q, k, v = out
            s["conv_states"] = tuple(new_states)
        else:
            q, k, v = (F.silu(p) for p in projected)
        return (q.unflatten(-1, (self.num_heads, self.head_k_dim)), k.unflatten(-1, (self.num_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def _finish(self, o: torch.Tensor, recurrent_state: Optional[torch.Tensor], s: dict, past_key_values,
                use_cache: bool, gate: Optional[torch.Tensor] = None):
        """Stores the new states in the cache, then the gated norm (`gate`, or g_proj(x), as the gate; a plain norm
        where the layer has no g_proj), o_proj, and the padded batch restored. Returns the layer's output."""
        if past_key_values is not None:
            past_key_values.update(layer_idx=self.layer_idx, recurrent_state=recurrent_state,
                                   conv_state=s["conv_states"] if self.use_short_conv and use_cache else None,
                                   offset=s["q_len"])
        if self.g_proj is not None:
            gate = self.g_proj(s["x"]) if gate is None else gate
            o = self.o_norm(o, gate.unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        else:
            o = self.o_norm(o)
        o = self.o_proj(o.flatten(-2))
        return repad(o, s["indices"], s["batch_size"], s["q_len"])
