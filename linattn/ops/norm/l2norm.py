"""`l2norm`: x / sqrt(sum(x^2) + eps) along the last dimension, in fp32, returned in x's dtype: what the chunk ops
do to q and k with use_qk_l2norm_in_kernel=True (FLA's l2norm_fwd / l2norm_bwd).

On CUDA and under the Triton interpreter it is one Triton pass each way (linattn/ops/norm/triton/l2norm.py) as the
torch custom op "linattn::l2norm_fwd" (fake implementation, registered autograd through "linattn::l2norm_bwd"),
keeping rstd [rows] fp32 for the backward; a call that records no autograd graph runs the launcher without the
custom op. Elsewhere (CPU without the interpreter, fp64, rows longer than MAX_D) it is the plain PyTorch
expression, in fp64 for fp64 inputs."""
from typing import Tuple

import torch

from linattn.ops.norm.reference import l2norm as l2norm_plain
from linattn.runtime import eager_ops
from linattn.runtime.settings import settings

MAX_D = 1024                 # one row is one register tile of the kernels (the chunk ops' K is at most 256)


@eager_ops.custom_op("linattn::l2norm_fwd")
def _fwd(x: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    from linattn.ops.norm.triton.l2norm import l2norm_fwd
    return l2norm_fwd(x, eps)


@_fwd.register_fake
def _(x, eps):
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@eager_ops.custom_op("linattn::l2norm_bwd")
def _bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    from linattn.ops.norm.triton.l2norm import l2norm_bwd
    return l2norm_bwd(x, rstd, dy.contiguous())


@_bwd.register_fake
def _(x, rstd, dy):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)         # rstd's gradient is None, not a zero-filled [rows] tensor per call


def _backward(ctx, dy, _drstd):
    if dy is None:                           # y reaches no loss
        return None, None
    x, rstd = ctx.saved_tensors
    return _bwd(x, rstd, dy), None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def _reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    return l2norm_plain(x if x.dtype == torch.float64 else x.float(), eps).to(x.dtype)


def _triton_ok(x: torch.Tensor) -> bool:
    return ((x.device.type == "cuda" or (x.device.type == "cpu" and settings.interpret))
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < x.shape[-1] <= MAX_D
            and type(x) is torch.Tensor)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] L2-normalised along D: x / sqrt(sum(x^2) + eps), the math in fp32, the result in x's dtype.
    Differentiable in x."""
    if not _triton_ok(x):
        return _reference(x, eps)
    x = x.contiguous()
    if (not torch.is_grad_enabled() or not x.requires_grad) and not torch.compiler.is_compiling():
        from linattn.ops.norm.triton.l2norm import l2norm_fwd
        return l2norm_fwd(x, float(eps))[0]
    return _fwd(x, float(eps))[0]
