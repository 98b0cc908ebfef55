"""The gated RMS norm in plain PyTorch (fp64-capable, differentiable by plain autograd): the "reference" backend
of `rms_norm_gated` and the ground truth of its tests."""
import torch
import torch.nn.functional as F


def gate_activation(g: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.sigmoid(g) if activation == "sigmoid" else F.silu(g)


def rms_norm_gated_reference(x, g, weight=None, bias=None, activation="swish", eps=1e-6, group_size=None,
                             norm_before_gate=True):
    """x, g [..., D]; weight, bias [D] or None. Per row and group of group_size (default D) columns:
    norm_before_gate: y = (rmsnorm(x) * weight + bias) * act(g); else y = rmsnorm(x * act(g)) * weight + bias.
    Computes in fp32 (fp64 for fp64 x); y in x's dtype."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    D = x.shape[-1]
    G = D if group_size is None else group_size
    xf = x.to(dt)
    a = gate_activation(g.to(dt), activation)
    z = xf if norm_before_gate else xf * a
    zg = z.unflatten(-1, (D // G, G))
    h = (zg * torch.rsqrt(zg.square().mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        h = h * weight.to(dt)
    if bias is not None:
        h = h + bias.to(dt)
    y = h * a if norm_before_gate else h
    return y.to(x.dtype)
