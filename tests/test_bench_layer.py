"""`linattn bench --op layer_gdn` (linattn/bench/layer.py) in process: the runner's forward (no autograd) and
training step (dx and every parameter's gradient, named by parameter) on the tiny preset, the same results for
two linattn backends built from the same seed, the FLOP and byte models, and FLA reported unavailable (not a crash)
where fla.layers does not import."""
import importlib.util
import math

import pytest
import torch

from linattn.bench.base import Unavailable
from linattn.bench.layer import LAYER_GDN, layer_bytes, layer_flops
from linattn.bench.presets import get_preset
from linattn.bench.timing import step
from linattn.runtime.settings import settings

pytestmark = pytest.mark.skipif(not settings.interpret, reason="runs the CPU path under TRITON_INTERPRET=1")


def _run(backend, shape, inputs, mode):
    runner = LAYER_GDN.prepare(backend, shape, inputs, mode)
    outs, grads = step(runner.fn, *runner.args(inputs, mode))
    return runner, outs, grads


def test_training_step_and_prefill(monkeypatch):
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    (shape,) = get_preset("layer_tiny")
    inputs = LAYER_GDN.make_inputs(shape, "cpu", 3, "fwdbwd")
    runs = {}
    for backend in ("auto", "triton"):
        monkeypatch.setenv("LINATTN_BACKEND", backend)      # restored after the test; the runner sets it again
        runs[backend] = _run(backend, shape, inputs, "fwdbwd")
    runner, outs, grads = runs["auto"]
    assert runner.grad_names[0] == "dx" and len(runner.grad_names) == len(grads) > 10
    assert "dA_log" in runner.grad_names and "dq_proj.weight" in runner.grad_names
    assert outs[0].shape == inputs["x"].shape and all(g is not None and torch.isfinite(g).all() for g in grads)
    for a, b in zip(outs + grads, runs["triton"][1] + runs["triton"][2]):
        assert torch.equal(a, b)                  # the same weights and the same kernels on the CPU
    fwd_inputs = LAYER_GDN.make_inputs(shape, "cpu", 3, "fwd")
    _, (y,), grads = _run("auto", shape, fwd_inputs, "fwd")
    assert grads == () and not y.requires_grad
    assert torch.allclose(y, outs[0].detach(), atol=1e-6, rtol=1e-5)


def test_models_and_fla():
    shape = get_preset("layer")[0]
    for mode in ("fwd", "fwdbwd"):
        assert layer_flops(shape, mode) > 0 and layer_bytes(shape, mode) > 0
    assert math.isclose(layer_flops(shape, "fwdbwd") / layer_flops(shape, "fwd"), 3.0, rel_tol=0.2)
    if importlib.util.find_spec("fla") is None:
        (tiny,) = get_preset("layer_tiny")
        with pytest.raises(Unavailable, match="fla.layers not importable"):
            LAYER_GDN.prepare("fla", tiny, LAYER_GDN.make_inputs(tiny, "cpu", 0, "fwd"), "fwd")


def test_decode_step_mode(monkeypatch):
    """Mode step: the runner prefills its layer's cache once, then each call is one token per sequence against it;
    two linattn backends built from the same seed give the same step, and a call advances the cache (the second
    step differs from the first)."""
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    (shape,) = get_preset("layer_step_tiny")
    inputs = LAYER_GDN.make_inputs(shape, "cpu", 4, "step")
    assert inputs["x"].shape == (shape["B"], 1, shape["hidden"]) and inputs["prompt"].shape[1] > 1
    firsts = {}
    for backend in ("auto", "triton"):
        monkeypatch.setenv("LINATTN_BACKEND", backend)
        runner = LAYER_GDN.prepare(backend, shape, inputs, "step")
        (y1,), grads = step(runner.fn, *runner.args(inputs, "step"))
        (y2,), _ = step(runner.fn, *runner.args(inputs, "step"))
        assert grads == () and y1.shape == inputs["x"].shape and torch.isfinite(y1).all()
        assert not torch.equal(y1, y2)            # the cache advanced
        firsts[backend] = y1
    assert torch.equal(firsts["auto"], firsts["triton"])
    assert layer_bytes(shape, "step") > 0 and layer_flops(shape, "step") > 0
    with pytest.raises(ValueError, match="T must be 1"):
        LAYER_GDN.make_inputs(get_preset("layer_tiny")[0], "cpu", 0, "step")
