"""`KimiDeltaAttention`: FLA 0.6's Kimi Delta Attention layer (fla.layers.KimiDeltaAttention) on linattn's KDA ops.

The same constructor arguments, parameter names and shapes (an FLA checkpoint's state dict loads with strict=True),
the same forward: q/k/v projections through causal short convolutions with SiLU, q and k L2-normalised in the kernel,
the per-key-channel decay g = -exp(A_log) * softplus(f_proj(x) + dt_bias) computed in the kernel (f_proj a low-rank
pair of projections to num_v_heads * head_k_dim; with lower_bound, FLA's bounded form), beta = sigmoid(b_proj(x))
in the kernel (times 2 with allow_neg_eigval), states stored [N, HV, V, K] as FLA's layer keeps them
(state_v_first), the chunked op when training or for long inputs, the recurrent op for short inference calls, an
output norm gated by sigmoid(g_proj(x)) (g_proj a low-rank pair with a bias), o_proj. Padding masks, varlen
(cu_seqlens) and a cache (RecurrentCache or FLA's Cache) as in linattn's GatedDeltaNet.
"""
import math
from typing import Optional

import torch
import torch.nn as nn

from linattn.layers.cache import RecurrentCache
from linattn.layers.norm import FusedRMSNormGated
from linattn.layers.recurrent import RecurrentLayer
from linattn.ops.kda.chunk import chunk_kda
from linattn.ops.kda.fused_recurrent import fused_recurrent_kda


class KimiDeltaAttention(RecurrentLayer):
    """Kimi Delta Attention layer with FLA 0.6's constructor and state-dict names (see the module docstring).

    hidden_size, expand_v (head_v_dim = head_dim * expand_v), head_dim, num_heads, num_v_heads (GVA: a multiple of
    num_heads; default num_heads), mode ("chunk" or "fused_recurrent"), use_short_conv, allow_neg_eigval,
    safe_gate (needs lower_bound; A_log then starts at 0), lower_bound (< 0: the gate's bounded form), conv_size,
    conv_bias, layer_idx (needed with a cache), norm_eps. Other keywords are ignored, as FLA does.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: Optional[int] = None, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: Optional[int] = None,
                 norm_eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_short_conv, conv_size,
                         conv_bias, layer_idx)
        self.allow_neg_eigval = allow_neg_eigval
        self.safe_gate = safe_gate
        self.lower_bound = lower_bound
        self.gate_dim = self.num_v_heads * self.head_k_dim
        if safe_gate and lower_bound is None:
            raise ValueError("KimiDeltaAttention: safe_gate=True needs lower_bound (the gate's bound, e.g. -5)")
        if lower_bound is not None and not lower_bound < 0:
            raise ValueError(f"KimiDeltaAttention: lower_bound must be < 0, got {lower_bound}")

        # the gate per value head and key channel, through a low-rank bottleneck of head_v_dim (FLA's f_proj)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # FLA's initialisation: A ~ U(1, 16) (0 for A_log with safe_gate); dt log-uniform in [1e-3, 0.1] (floored at
        # 1e-4) per value head and key channel, stored through the inverse softplus so that softplus(dt_bias) = dt
        if safe_gate:
            self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32))
        else:
            self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(1, 16)))
        self.A_log._no_weight_decay = True
        dt = torch.exp(torch.rand(self.gate_dim, dtype=torch.float32) * (math.log(0.1) - math.log(0.001))
                       + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.value_dim, bias=True))
        self.o_norm = FusedRMSNormGated(self.head_v_dim, activation="sigmoid", eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[RecurrentCache] = None, use_cache: Optional[bool] = False,
                output_attentions: Optional[bool] = False, **kwargs):
        """The call of GatedDeltaNet.forward (the same arguments: padding mask, cache, cu_seqlens); the recurrent
        state in the cache is [N, HV, V, K], FLA's. Returns (o [B, T, hidden_size], None, past_key_values)."""
        s = self._forward_setup(hidden_states, attention_mask, past_key_values, use_cache, kwargs)
        x, recurrent_state = s["x"], s["recurrent_state"]
        # the projections of x (the gate's and the output gate's first, low-rank halves among them) in one launch
        # at a decode step
        proj = self._projections(x, self.q_proj, self.k_proj, self.v_proj, self.f_proj[0], self.b_proj,
                                 self.g_proj[0])
        q, k, v = self._qkv(s, use_cache, proj[:3])
        g = self.f_proj[1](proj[3]).unflatten(-1, (self.num_v_heads, self.head_k_dim))
        beta = proj[4]
        common = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=self.A_log, dt_bias=self.dt_bias,
                      output_final_state=use_cache, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
                      lower_bound=self.lower_bound, state_v_first=True, cu_seqlens=s["cu_seqlens"])
        if s["mode"] == "chunk":
            o, recurrent_state = chunk_kda(initial_state=recurrent_state, safe_gate=self.safe_gate, **common)
        else:
            # a fp32 state is updated in place (a padded row's slot, -1, is left alone)
            inplace = recurrent_state is not None and use_cache and recurrent_state.dtype == torch.float32
            o, recurrent_state = fused_recurrent_kda(initial_state=recurrent_state, inplace=inplace,
                                                     state_indices=s["slots"], **common)
        return (self._finish(o, recurrent_state, s, past_key_values, use_cache, self.g_proj[1](proj[5])), None,
                past_key_values)
