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
from typing import Optional

import torch
import torch.nn as nn

from linattn.layers.cache import RecurrentCache
from linattn.layers.norm import FusedRMSNormGated
from linattn.layers.recurrent import RecurrentLayer
from linattn.layers.rmsnorm import RMSNorm
from linattn.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


class GatedDeltaNet(RecurrentLayer):
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
        super().__init__(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_short_conv, conv_size,
                         conv_bias, layer_idx)
        self.allow_neg_eigval = allow_neg_eigval
        self.use_gate = use_gate
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError("output_gate_activation must be 'swish', 'silu' or 'sigmoid', got "
                             f"{output_gate_activation!r}")

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

        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps, activation=output_gate_activation)
        else:
            self.g_proj = None
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[RecurrentCache] = None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, **kwargs):
        """hidden_states [B, T, hidden_size]; attention_mask: optional 0/1 padding mask [B, T'] (T' >= T, 0 marks
        padding; its last T columns apply); past_key_values: a RecurrentCache (or FLA-style Cache), read when it
        holds this layer's states, updated with the new ones (use_cache=True returns them); cu_seqlens (keyword):
        packed sequences with B = 1, instead of a mask. Returns (o [B, T, hidden_size], None, past_key_values)."""
        s = self._forward_setup(hidden_states, attention_mask, past_key_values, use_cache, kwargs)
        x, cu_seqlens, recurrent_state = s["x"], s["cu_seqlens"], s["recurrent_state"]
        mods = (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj) + \
            ((self.g_proj,) if self.g_proj is not None else ())
        proj = self._projections(x, *mods)
        q, k, v = self._qkv(s, use_cache, proj[:3])
        a, b = proj[3], proj[4]

        # FLA's gate options in the ops, as FLA's layer calls them: the decay -exp(A_log) * softplus(a + dt_bias)
        # and beta = sigmoid(b) (2 sigmoid(b) with allow_neg_eigval) computed inside the kernels (on Hopper `auto`
        # takes them through the Gluon forward's gate prologue)
        gate = dict(g=a, beta=b, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval)
        if s["mode"] == "chunk":
            o, recurrent_state = chunk_gated_delta_rule(
                q=q, k=k, v=v, initial_state=recurrent_state, output_final_state=use_cache,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **gate)
        else:
            # a fp32 state is updated in place
            inplace = recurrent_state is not None and use_cache and recurrent_state.dtype == torch.float32
            o, recurrent_state = fused_recurrent_gated_delta_rule(
                q=q, k=k, v=v, initial_state=recurrent_state, output_final_state=use_cache,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, inplace=inplace, state_indices=s["slots"],
                **gate)

        return (self._finish(o, recurrent_state, s, past_key_values, use_cache, proj[5] if len(proj) > 5 else None),
                None, past_key_values)
