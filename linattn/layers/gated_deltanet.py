"""`GatedDeltaNet`: FLA 0.6's Gated DeltaNet layer (fla.layers.GatedDeltaNet) on linattn's ops.

The same constructor arguments, the same parameter names and shapes (an FLA checkpoint's state dict loads with
strict=True), the same forward: q/k/v projections through a causal short convolution with SiLU, q and k
L2-normalised in the kernel, the decay g = -exp(A_log) * softplus(a_proj(x) + dt_bias), beta = sigmoid(b_proj(x))
(times 2 with allow_neg_eigval), the chunked op when training or for long inputs, the recurrent op for short
inference calls, an output norm gated by g_proj(x) (or a plain RMSNorm without use_gate), o_proj. A 0/1 padding
mask packs the batch into varlen sequences and unpacks the output. A cache (RecurrentCache or any object with
FLA's Cache methods) carries the convolution windows and the recurrent state from a prefill into decode steps.
"""
import math
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from linattn.layers.cache import RecurrentCache
from linattn.layers.conv import ShortConvolution
from linattn.layers.norm import FusedRMSNormGated
from linattn.layers.rmsnorm import RMSNorm
from linattn.layers.padding import repad, unpad
from linattn.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

# Whether the chunked op computes the decay and beta's sigmoid itself (FLA's use_gate_in_kernel=True with A_log /
# dt_bias, use_beta_sigmoid_in_kernel=True). While it refuses them the layer computes both in PyTorch, FLA's way.
CHUNK_FUSES_GATE = False


def gdn_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The log decay -exp(A_log) * softplus(a + dt_bias), in fp32 (FLA's gate)."""
    a = a.float()
    if dt_bias is not None:
        a = a + dt_bias.float()
    return -A_log.float().exp() * F.softplus(a)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet layer with FLA 0.6's constructor and state-dict names (see the module docstring).

    hidden_size, expand_v (head_v_dim = head_dim * expand_v), head_dim, num_heads, num_v_heads (GVA: a multiple of
    num_heads; default num_heads), mode ("chunk" or "fused_recurrent"), use_gate, use_short_conv, allow_neg_eigval,
    conv_size, conv_bias, layer_idx (needed with a cache), norm_eps, output_gate_activation ("swish", "silu",
    "sigmoid"). Other keywords are ignored, as FLA does.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: Optional[int] = None, mode: str = "chunk", use_gate: bool = True,
                 use_short_conv: bool = True, allow_neg_eigval: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: Optional[int] = None, norm_eps: float = 1e-5,
                 output_gate_activation: str = "swish", **kwargs):
        super().__init__()
        self.mode = mode
        self.allow_neg_eigval = allow_neg_eigval
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.use_gate = use_gate
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
        self._slot_rows = {}            # (batch, device) -> (arange, all -1): _decode_slots' operands

        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v={expand_v} times head_dim={head_dim} must be an integer (the value head "
                             f"size), got {head_dim * expand_v}")
        if self.num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of num_heads={num_heads} (GVA)")
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'fused_recurrent', got {mode!r}")
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError("output_gate_activation must be 'swish', 'silu' or 'sigmoid', got "
                             f"{output_gate_activation!r}")

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)

        # FLA's initialisation: A ~ U(0, 16); dt log-uniform in [1e-3, 0.1] (floored at 1e-4), stored through the
        # inverse softplus so that softplus(dt_bias) = dt
        A = torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0, 16)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        dt_min, dt_max, dt_floor = 0.001, 0.1, 1e-4
        dt = torch.exp(torch.rand(self.num_v_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = torch.clamp(dt, min=dt_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True

        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, activation="silu")
        else:
            warnings.warn("GatedDeltaNet: use_short_conv=False drops the short convolutions, which matter for the "
                          "model's quality (FLA warns the same)")
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps, activation=output_gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    # ------------------------------------------------------------------------------------------------ forward
    def _layer_cache(self, past_key_values):
        if past_key_values is None:
            return None
        if self.layer_idx is None:
            raise ValueError("GatedDeltaNet: layer_idx must be set to use past_key_values")
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

    def _beta(self, b: torch.Tensor) -> torch.Tensor:
        beta = torch.sigmoid(b.float())
        return beta * 2.0 if self.allow_neg_eigval else beta

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[RecurrentCache] = None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, **kwargs):
        """hidden_states [B, T, hidden_size]; attention_mask: optional 0/1 padding mask [B, T'] (T' >= T, 0 marks
        padding; its last T columns apply); past_key_values: a RecurrentCache (or FLA-style Cache), read when it
        holds this layer's states, updated with the new ones (use_cache=True returns them); cu_seqlens (keyword):
        packed sequences with B = 1, instead of a mask. Returns (o [B, T, hidden_size], None, past_key_values)."""
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
            raise ValueError("GatedDeltaNet: training runs the chunk mode only (fused_recurrent has no backward)")

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

        if self.use_short_conv:
            if slots is None:
                q, cq = self.q_conv1d(self.q_proj(x), cache=conv_states[0], output_final_state=use_cache,
                                      cu_seqlens=cu_seqlens)
                k, ck = self.k_conv1d(self.k_proj(x), cache=conv_states[1], output_final_state=use_cache,
                                      cu_seqlens=cu_seqlens)
                v, cv = self.v_conv1d(self.v_proj(x), cache=conv_states[2], output_final_state=use_cache,
                                      cu_seqlens=cu_seqlens)
            else:
                q, cq = self.q_conv1d.step(self.q_proj(x), cache=conv_states[0], output_final_state=use_cache,
                                           state_indices=slots)
                k, ck = self.k_conv1d.step(self.k_proj(x), cache=conv_states[1], output_final_state=use_cache,
                                           state_indices=slots)
                v, cv = self.v_conv1d.step(self.v_proj(x), cache=conv_states[2], output_final_state=use_cache,
                                           state_indices=slots)
            conv_states = (cq, ck, cv)
        else:
            q, k, v = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x))
        q = q.unflatten(-1, (self.num_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        a, b = self.a_proj(x), self.b_proj(x)

        if mode == "chunk":
            if CHUNK_FUSES_GATE:
                gate = dict(g=a, beta=b, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
                            use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)
            else:
                gate = dict(g=gdn_decay(a, self.A_log, self.dt_bias), beta=self._beta(b))
            o, recurrent_state = chunk_gated_delta_rule(
                q=q, k=k, v=v, initial_state=recurrent_state, output_final_state=use_cache,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **gate)
        else:
            # the decode op computes the decay -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (2 sigmoid(b)
            # with allow_neg_eigval) itself; a fp32 state is updated in place
            inplace = recurrent_state is not None and use_cache and recurrent_state.dtype == torch.float32
            o, recurrent_state = fused_recurrent_gated_delta_rule(
                q=q, k=k, v=v, g=a, beta=b, initial_state=recurrent_state, output_final_state=use_cache,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval, cu_seqlens=cu_seqlens,
                inplace=inplace, state_indices=slots)

        if past_key_values is not None:
            past_key_values.update(layer_idx=self.layer_idx, recurrent_state=recurrent_state,
                                   conv_state=conv_states if self.use_short_conv and use_cache else None,
                                   offset=q_len)

        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        else:
            o = self.o_norm(o)
        o = self.o_proj(o.flatten(-2))
        o = repad(o, indices, batch_size, q_len)
        return o, None, past_key_values
