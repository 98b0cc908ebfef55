"""runtime/eager_ops: a differentiable op called from plain eager code runs its implementation through a
torch.autograd.Function built from its registered autograd (no custom-op dispatch, forward or backward), with the same
outputs and gradients as the custom op; traced or transformed calls keep the custom op. Checked on the causal
convolution and on a whole GatedDeltaNet training step."""
import collections

import pytest
import torch

import linattn
from linattn.ops.conv1d import api as conv_api
from linattn.ops.gated_delta_rule.triton.hostsim import TorchOpCounter, stub_interpreted_launches
from linattn.runtime.settings import settings

pytestmark = pytest.mark.skipif(not settings.interpret, reason="CPU tensors under TRITON_INTERPRET=1")


def _conv_inputs():
    x = torch.randn(2, 20, 8, requires_grad=True)
    w = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    return x, w, b


def _conv_grads(call, x, w, b):
    y, final = call(x, w, b, None, None, True, "silu", None)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + final.sum()
    return (y, final) + torch.autograd.grad(loss, (x, w, b))


def test_eager_call_skips_the_custom_op_with_the_same_results():
    x, w, b = _conv_inputs()
    with TorchOpCounter() as c:
        eager = _conv_grads(conv_api._conv_fwd, x, w, b)
    assert c.summary()["custom"] == []                  # neither causal_conv1d_fwd nor causal_conv1d_bwd dispatched
    with TorchOpCounter() as c:
        through_op = _conv_grads(conv_api._conv_fwd.op, x, w, b)
    # the custom op's forward; its backward, run by autograd in plain eager code, calls the backward op's
    # implementation the same way
    assert collections.Counter(c.summary()["custom"]) == {"linattn.causal_conv1d_fwd.default": 1}
    for a, r in zip(eager, through_op):
        assert torch.equal(a, r)
    with torch.no_grad(), TorchOpCounter() as c:         # no autograd to record: the implementation itself
        y, _ = conv_api._conv_fwd(x, w, b, None, None, False, "silu", None)
    assert c.summary()["custom"] == [] and not y.requires_grad and torch.equal(y, eager[0])


def test_what_counts_as_plain_eager():
    """Plain tensors and parameters outside any transform: plain eager; a tensor subclass or a torch.func transform
    active: not (those calls keep the custom op)."""
    from linattn.runtime.eager_ops import plain_eager

    class Sub(torch.Tensor):
        pass
    x = torch.randn(3)
    assert plain_eager((x, torch.nn.Parameter(torch.randn(2)), None, 1.5, "silu"))
    assert not plain_eager((x, x.as_subclass(Sub)))
    seen = []

    def f(t):
        seen.append(plain_eager((t,)))
        return t.sum()
    torch.func.grad(f)(x)
    assert seen == [False]


def test_layer_training_step_dispatches_no_custom_op():
    """A GatedDeltaNet training step (its convolutions, L2 norms, chunk op and gated norm, forward and backward)
    in plain eager code: no custom-op dispatch (the step made 14 before eager_ops)."""
    from linattn.layers import GatedDeltaNet
    layer = GatedDeltaNet(hidden_size=32, head_dim=16, num_heads=1, num_v_heads=2, expand_v=1, layer_idx=0).train()
    x = torch.randn(1, 40, 32, requires_grad=True)
    with stub_interpreted_launches() as launches, TorchOpCounter() as c:
        y = layer(x)[0]
        y.backward(torch.ones_like(y))
    assert launches and c.summary()["custom"] == []
    assert x.grad is not None and layer.q_proj.weight.grad is not None
