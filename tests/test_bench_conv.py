"""`linattn bench --op conv_gdn` (linattn/bench/conv.py) in process: the three convolutions' forward (no autograd) and
forward + backward on the tiny layer preset, Triton against the fp64 reference on the same inputs (outputs and every
gradient), the FLOP and byte models, and FLA reported unavailable (not a crash) where it does not import."""
import importlib.util

import pytest
import torch

from linattn.bench.base import Unavailable
from linattn.bench.conv import CONV_GDN, conv_bytes, conv_flops
from linattn.bench.ops import get_bench_op
from linattn.bench.presets import get_preset
from linattn.bench.timing import step
from linattn.runtime.settings import settings
from linattn.testing import TOL, assert_close

pytestmark = pytest.mark.skipif(not settings.interpret, reason="runs the CPU path under TRITON_INTERPRET=1")


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_three_convolutions_against_the_reference(mode):
    (shape,) = get_preset("layer_tiny")
    inputs = CONV_GDN.make_inputs(shape, "cpu", int(torch.seed() % 2**31), mode)
    runner = CONV_GDN.prepare("triton", shape, inputs, mode)
    outs, grads = step(runner.fn, *runner.args(inputs, mode))
    ref_inputs = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in inputs.items()}
    ref = CONV_GDN.prepare("reference", shape, ref_inputs, mode)
    ref_outs, ref_grads = step(ref.fn, *ref.args(ref_inputs, mode))
    assert runner.out_names == ("y_q", "y_k", "y_v") and len(outs) == 3
    assert outs[2].shape == (shape["B"], shape["T"], shape["HV"] * shape["V"])
    for name, o, r in zip(runner.out_names, outs, ref_outs):
        assert_close(name, o, r, TOL[torch.float32])
    if mode == "fwd":
        assert not grads and not any(o.requires_grad for o in outs)
        return
    assert len(grads) == len(runner.grad_names) == 6
    for name, g, r in zip(runner.grad_names, grads, ref_grads):
        assert_close(name, g, r, TOL[torch.float32])


def test_models_and_names():
    assert get_bench_op("conv_gdn") is CONV_GDN
    shape = dict(B=2, T=10, H=2, HV=4, K=8, V=8)
    elems = 2 * 10 * (16 + 16 + 32)
    assert conv_bytes(shape, "fwd") == 4 * elems and conv_bytes(shape, "fwdbwd") == 10 * elems
    assert conv_flops(shape, "fwd") == 8 * elems and conv_flops(shape, "fwdbwd") == 32 * elems
    with pytest.raises(Unavailable, match="not 'gluon'"):
        CONV_GDN.prepare("gluon", shape, {}, "fwd")
    if importlib.util.find_spec("fla") is None:
        with pytest.raises(Unavailable, match="fla not importable"):
            CONV_GDN.prepare("fla", shape, {}, "fwd")
