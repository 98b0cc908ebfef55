"""FusedRMSNormGated: FLA's module of the same name (fla.modules.FusedRMSNormGated) over `linattn.rms_norm_gated`,
with FLA's constructor, parameter names ("weight"; "bias" registered as None) and forward, so FLA state dicts
load. transformers' Qwen3NextRMSNormGated holds the same "weight" (pass activation="silu", eps=its eps)."""
from typing import Optional

import torch
from torch import nn

from linattn.ops.norm.api import rms_norm_gated


class FusedRMSNormGated(nn.Module):
    """y = rmsnorm(x) * weight * act(g) over the last dimension (hidden_size; FLA's GatedDeltaNet uses the value
    head dim). Keyword-only extras: group_size (normalise groups of that many columns), norm_before_gate=False
    (gate first, as FLA's RMSNormGated), backend."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None, *, group_size: Optional[int] = None,
                 norm_before_gate: bool = True, backend: str = "auto") -> None:
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"FusedRMSNormGated: unsupported activation {activation!r} "
                             "(use 'swish', 'silu' or 'sigmoid')")
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.activation = activation
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        s = f"{self.hidden_size}, eps={self.eps}, activation={self.activation}"
        if not self.elementwise_affine:
            s += ", elementwise_affine=False"
        if self.group_size is not None:
            s += f", group_size={self.group_size}"
        if not self.norm_before_gate:
            s += ", norm_before_gate=False"
        return s

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual: Optional[torch.Tensor] = None,
                prenorm: bool = False, residual_in_fp32: bool = False) -> torch.Tensor:
        return rms_norm_gated(x, g, self.weight, self.bias, self.activation, residual, prenorm, residual_in_fp32,
                              self.eps, group_size=self.group_size, norm_before_gate=self.norm_before_gate,
                              backend=self.backend)
