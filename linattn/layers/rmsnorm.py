"""`RMSNorm`: FLA's RMSNorm module (weight, optional bias; FLA's state-dict names), for GatedDeltaNet's output norm
without the gate (use_gate=False). Plain PyTorch: that branch normalises one small tensor per layer call."""
from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (+ bias) over the last dimension, computed in fp32, in x's dtype."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False, eps: float = 1e-5,
                 device=None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm: x's last dimension must be hidden_size={self.hidden_size}, got "
                             f"{tuple(x.shape)}")
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)
