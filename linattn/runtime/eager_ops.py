"""`custom_op`: torch.library.custom_op for linattn's differentiable ops, whose plain eager calls skip the custom op.

A torch custom op with registered autograd is what torch.compile(fullgraph=True), CUDA graphs of compiled code and
torch.func need, but its dispatch (schema binding, default filling, the autograd wrapper, redispatch) costs host
time on every eager call: ~19 us against ~6 for a torch.autograd.Function, and ~76 against ~35 us for a forward and
backward, on this project's CPU machine; an H200 host is slower. A training step calls seven such ops and their
backward ops, so an eager step pays it a dozen times.

EagerCustomOp wraps the op: a call from plain eager code (tensor arguments plain tensors or parameters, not traced
by torch.compile, no torch.func transform active) runs the op's Python implementation directly, through a
torch.autograd.Function made from the op's registered setup_context and backward where autograd must record the
call; every other call goes through the custom op. The Function is what torch.library builds for the custom op's
autograd, with the same context and the same (materialised) gradients, so both paths compute the same results.
Only ops without mutated arguments are wrapped; an op whose autograd is not registered keeps the custom op when a
differentiable call needs it (its error stays torch's)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from linattn.runtime.device import under_torch_compile


def plain_eager(args) -> bool:
    """Whether a call with these arguments is plain eager code: its tensors plain tensors or parameters, not traced
    by torch.compile, no torch.func transform active."""
    if under_torch_compile():
        return False
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is None or active():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
            return False
    return True


class EagerCustomOp:
    """A torch custom op (`.op`, registered as usual) and its Python implementation (`.impl`); calling the
    object picks between them (module docstring). register_fake / register_autograd are the custom op's."""

    def __init__(self, name: str, fn: Callable):
        self.name = name
        self.impl = fn
        self.op = torch.library.custom_op(name, mutates_args=())(fn)
        self._function: Optional[type] = None

    def register_fake(self, fn: Callable) -> Callable:
        return self.op.register_fake(fn)

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        impl = self.impl

        # setup_context runs inside forward (the form without a setup_context staticmethod): apply() then binds
        # no default arguments through inspect.signature, ~40% of its host time; the Function serves only calls
        # with no torch.func transform active, which is what that form gives up
        class _Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                out = impl(*args)
                setup_context(ctx, args, out)
                return out

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)

        _Function.__name__ = _Function.__qualname__ = self.name.split("::")[-1] + "_eager"
        self._function = _Function

    def __call__(self, *args, **kwargs):
        if kwargs or not plain_eager(args):
            return self.op(*args, **kwargs)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            if self._function is None:
                return self.op(*args)
            return self._function.apply(*args)
        return self.impl(*args)


def custom_op(name: str) -> Callable[[Callable], EagerCustomOp]:
    """Decorator: torch.library.custom_op(name, mutates_args=()) as an EagerCustomOp."""
    def wrap(fn: Callable) -> EagerCustomOp:
        return EagerCustomOp(name, fn)
    return wrap
