"""Outputs that no loss reaches get None in the ops' backwards, not a zero-filled gradient (a memset and its host time
per call): chunk_gated_delta_rule's final state (or its o), causal_conv1d's final state (or its y), l2norm's rstd.
Each op's gradients with only one of its outputs in the loss, against fp64 autograd of the reference, on
NaN-poisoned outputs; and a training step that leaves the final states out dispatches no aten.zeros in its
backward."""
import pytest
import torch

import linattn
from linattn.ops.conv1d.reference import causal_conv1d_reference
from linattn.ops.gated_delta_rule.reference import chunk_gated_delta_rule as gdn_reference
from linattn.ops.gated_delta_rule.triton.hostsim import count_torch_ops
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import assert_close, make_gdn_inputs

from markers import needs_triton   # tests/ is on sys.path

F32 = 1e-3


def _gdn_grads(x, which, fn):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, ht = fn(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out = ht if which == "final" else o
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    (out.double() * w).sum().backward()
    return {n: t.grad for n, t in leaves.items()}


@needs_triton
@pytest.mark.parametrize("which", ["final", "o"])
def test_gdn_grads_with_one_output_in_the_loss(which):
    x = make_gdn_inputs(1, 90, 1, 2, 16, 16, dtype=torch.float32)
    with poisoned_allocations():
        got = _gdn_grads(x, which, lambda **kw: linattn.chunk_gated_delta_rule(**kw, backend="triton"))
    ref = _gdn_grads({n: t.double() for n, t in x.items()}, which, gdn_reference)
    for n, t in got.items():
        assert t is not None and t.dtype == x[n].dtype, n
        if ref[n] is None:                       # q does not reach the final state: its gradient is exactly zero
            assert which == "final" and n == "q" and bool((t == 0).all()), (n, t.abs().max())
        else:
            assert_close(f"d{n}", t, ref[n], F32)


@needs_triton
@pytest.mark.parametrize("which", ["final", "y"])
def test_conv_grads_with_one_output_in_the_loss(which):
    x = torch.randn(2, 37, 64)
    w, b, h0 = torch.randn(64, 4), torch.randn(64), torch.randn(2, 64, 4)

    def grads(args, fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in args]
        y, final = fn(*leaves)
        out = final if which == "final" else y
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
        (out.double() * w).sum().backward()
        return [t.grad for t in leaves]

    with poisoned_allocations():
        got = grads((x, w, b, h0), lambda x, w, b, h0: linattn.causal_conv1d(
            x, w, b, initial_state=h0, output_final_state=True, activation="silu", backend="triton"))
    ref = grads([t.double() for t in (x, w, b, h0)], lambda x, w, b, h0: causal_conv1d_reference(
        x, w, b, initial_state=h0, output_final_state=True, activation="silu"))
    for name, t, r in zip(("x", "weight", "bias", "initial_state"), got, ref):
        assert t is not None, name
        if r is None:                            # the final state is the window's last inputs: no weight or bias in it
            assert which == "final" and name in ("weight", "bias") and bool((t == 0).all()), (name, t.abs().max())
        else:
            assert_close(f"d{name}", t, r, F32)


@needs_triton
def test_training_step_fills_no_zero_gradient():
    """o only in the loss (the final states returned and dropped, as a layer's training step does): the backward of
    the convolution, l2norm and the chunk op dispatches no aten.zeros."""
    x = make_gdn_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32)
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    cx = torch.randn(1, 70, 32, requires_grad=True)
    y, _ = linattn.causal_conv1d(cx, torch.randn(32, 4), None, output_final_state=True, activation="silu",
                                 backend="triton")
    o, _ = linattn.chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          backend="triton")
    loss = o.sum() + y.sum()
    ops = count_torch_ops(lambda: loss.backward())
    assert not [op for op in ops["device_ops"] if op.startswith("aten.zeros")], ops["device_ops"]
    assert all(t.grad is not None for t in leaves.values()) and cx.grad is not None
