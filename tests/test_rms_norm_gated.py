"""rms_norm_gated and FusedRMSNormGated against the fp64 reference: the output and every gradient, both gate
orders, silu and sigmoid, the whole row and groups, with and without weight and bias, rows not a multiple of the
row block, D not a power of two."""
import pytest
import torch

import linattn
import linattn.layers
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close

D = 36


def _run(x, g, w, b, backend, cast=None, **kw):
    leaves = {k: (v.detach().to(cast) if cast else v.detach()).requires_grad_(True)
              for k, v in dict(x=x, g=g, weight=w, bias=b).items() if v is not None}
    y = linattn.rms_norm_gated(leaves["x"], leaves["g"], leaves.get("weight"), leaves.get("bias"), backend=backend,
                               **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(0)).to(y)
    return y, dict(zip(leaves, torch.autograd.grad((y * dy).sum(), list(leaves.values()))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("group_size", [None, 12])
def test_matches_fp64(device, dtype, activation, norm_before_gate, group_size):
    x, g = torch.randn(3, 7, D, device=device).to(dtype), torch.randn(3, 7, D, device=device).to(dtype)
    w, b = (1 + 0.3 * torch.randn(D, device=device)), 0.3 * torch.randn(D, device=device)   # fp32 parameters
    kw = dict(activation=activation, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    with poisoned_allocations():
        y, grads = _run(x, g, w, b, "triton", **kw)
    y_ref, grads_ref = _run(x, g, w, b, "reference", cast=torch.float64, **kw)
    assert y.dtype == dtype
    assert_close("y", y, y_ref, TOL[dtype])
    for name, ref in grads_ref.items():
        assert grads[name].dtype == dict(x=x, g=g, weight=w, bias=b)[name].dtype
        assert_close(f"d{name}", grads[name], ref, TOL[dtype])


def test_without_weight_and_bias(device):
    x, g = torch.randn(5, D, device=device), torch.randn(5, D, device=device)
    with poisoned_allocations():
        y, grads = _run(x, g, None, None, "triton")
    y_ref, grads_ref = _run(x, g, None, None, "reference", cast=torch.float64)
    assert_close("y", y, y_ref, TOL[torch.float32])
    for name, ref in grads_ref.items():
        assert_close(f"d{name}", grads[name], ref, TOL[torch.float32])


def test_module_matches_fla_layout(device):
    """FLA's FusedRMSNormGated: one parameter "weight" (ones), bias None; a state dict loads; forward == the op."""
    m = linattn.layers.FusedRMSNormGated(D, eps=1e-5, device=device)
    assert list(m.state_dict()) == ["weight"] and m.bias is None and bool((m.weight == 1).all())
    sd = {"weight": torch.randn(D, device=device)}
    m.load_state_dict(sd)
    x, g = torch.randn(2, 4, D, device=device), torch.randn(2, 4, D, device=device)
    y_ref = linattn.rms_norm_gated(x.double(), g.double(), sd["weight"].double(), eps=1e-5, backend="reference")
    assert_close("module", m(x, g), y_ref, TOL[torch.float32])
    assert list(linattn.layers.FusedRMSNormGated(D, elementwise_affine=False).state_dict()) == []


def test_custom_ops_opcheck(device):
    x, g, w = torch.randn(4, D, device=device), torch.randn(4, D, device=device), torch.randn(D, device=device)
    torch.library.opcheck(torch.ops.linattn.rms_norm_gated_fwd, (x.requires_grad_(), g, w, None, 1e-6, 12, "swish",
                                                                  False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_bad_inputs_are_named(device):
    x = torch.randn(4, D, device=device)
    cases = [
        (dict(g=x[:, :5]), ValueError, "g"),
        (dict(g=x, weight=torch.randn(5)), ValueError, "weight"),
        (dict(g=x, activation="relu"), ValueError, "activation"),
        (dict(g=x, group_size=10), ValueError, "group_size"),
        (dict(g=x, residual=x), NotImplementedError, "residual"),
        (dict(g=x, prenorm=True), NotImplementedError, "prenorm"),
    ]
    for kw, exc, word in cases:
        with pytest.raises(exc, match=word):
            linattn.rms_norm_gated(x, **kw)
    with pytest.raises(ValueError, match="activation"):
        linattn.layers.FusedRMSNormGated(D, activation="relu")
