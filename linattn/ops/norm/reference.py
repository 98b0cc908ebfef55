"""The norms in plain PyTorch (fp64-capable, differentiable by plain autograd): the gated RMS norm (the "reference"
backend of `rms_norm_gated` and the ground truth of its tests) and the L2 norm of q and k (the chunk ops'
use_qk_l2norm_in_kernel; `l2norm`'s path where its Triton pass does not run, and the reference ops')."""
import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along the last dim, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


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
