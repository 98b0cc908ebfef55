"""`linattn bench --op layer_gdn` and `--op layer_kda` (linattn/bench/layer.py) in process: the runner's forward (no
autograd) and training step (dx and every parameter's gradient, named by parameter) on the tiny preset, the same results
for two linattn backends built from the same seed, the FLOP and byte models, and FLA reported unavailable (not a crash)
where fla.layers does not import."""
import importlib.util
import math

import pytest
import torch

from linattn.bench.base import Unavailable
from linattn.bench.layer import LAYER_GDN, LAYER_KDA, layer_bytes, layer_flops
from linattn.bench.presets import get_preset
from linattn.bench.timing import step
from linattn.runtime.settings import settings

pytestmark = pytest.mark.skipif(not settings.interpret, reason="runs the CPU path under TRITON_INTERPRET=1")
# (bench op, its tiny preset, its tiny decode-step preset)
OPS = pytest.mark.parametrize("op,tiny,step_tiny", [(LAYER_GDN, "layer_tiny", "layer_step_tiny"),
                                                    (LAYER_KDA, "layer_kda_tiny", "layer_kda_step_tiny")],
                              ids=["gdn", "kda"])


def _run(op, backend, shape, inputs, mode):
    runner = op.prepare(backend, shape, inputs, mode)
    outs, grads = step(runner.fn, *runner.args(inputs, mode))
    return runner, outs, grads


@OPS
def test_training_step_and_prefill(monkeypatch, op, tiny, step_tiny):
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    (shape,) = get_preset(tiny)
    inputs = op.make_inputs(shape, "cpu", 3, "fwdbwd")
    runs = {}
    for backend in ("auto", "triton"):
        monkeypatch.setenv("LINATTN_BACKEND", backend)      # restored after the test; the runner sets it again
        runs[backend] = _run(op, backend, shape, inputs, "fwdbwd")
    runner, outs, grads = runs["auto"]
    assert runner.grad_names[0] == "dx" and len(runner.grad_names) == len(grads) > 10
    assert "dA_log" in runner.grad_names and "dq_proj.weight" in runner.grad_names
    assert outs[0].shape == inputs["x"].shape and all(g is not None and torch.isfinite(g).all() for g in grads)
    for a, b in zip(outs + grads, runs["triton"][1] + runs["triton"][2]):
        assert torch.equal(a, b)                  # the same weights and the same kernels on the CPU
    fwd_inputs = op.make_inputs(shape, "cpu", 3, "fwd")
    _, (y,), grads = _run(op, "auto", shape, fwd_inputs, "fwd")
    assert grads == () and not y.requires_grad
    assert torch.allclose(y, outs[0].detach(), atol=1e-6, rtol=1e-5)


@OPS
def test_models_and_fla(op, tiny, step_tiny):
    shape = get_preset("layer" if op is LAYER_GDN else "layer_kda")[0]
    for mode in ("fwd", "fwdbwd"):
        assert op.flops(shape, mode) > 0 and op.bytes(shape, mode) > 0
    assert math.isclose(op.flops(shape, "fwdbwd") / op.flops(shape, "fwd"), 3.0, rel_tol=0.2)
    # the projections' weights counted as the layer holds them: 2 FLOPs per weight and token at a decode step
    import linattn.layers
    (small,) = get_preset(step_tiny)
    layer = getattr(linattn.layers, "GatedDeltaNet" if op is LAYER_GDN else "KimiDeltaAttention")(
        hidden_size=small["hidden"], head_dim=small["K"], num_heads=small["H"], num_v_heads=small["HV"],
        expand_v=small["V"] / small["K"])
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    state_flops = 6.0 * small["B"] * small["HV"] * small["K"] * small["V"]
    assert op.flops(small, "step") == 2.0 * small["B"] * weights + state_flops
    if importlib.util.find_spec("fla") is None:
        (shape,) = get_preset(tiny)
        with pytest.raises(Unavailable, match="fla.layers not importable"):
            op.prepare("fla", shape, op.make_inputs(shape, "cpu", 0, "fwd"), "fwd")


@OPS
def test_decode_step_mode(monkeypatch, op, tiny, step_tiny):
    """Mode step: the runner prefills its layer's cache once, then each call is one token per sequence against it;
    two linattn backends built from the same seed give the same step, and a call advances the cache (the second
    step differs from the first)."""
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    (shape,) = get_preset(step_tiny)
    inputs = op.make_inputs(shape, "cpu", 4, "step")
    assert inputs["x"].shape == (shape["B"], 1, shape["hidden"]) and inputs["prompt"].shape[1] > 1
    firsts = {}
    for backend in ("auto", "triton"):
        monkeypatch.setenv("LINATTN_BACKEND", backend)
        runner = op.prepare(backend, shape, inputs, "step")
        (y1,), grads = step(runner.fn, *runner.args(inputs, "step"))
        (y2,), _ = step(runner.fn, *runner.args(inputs, "step"))
        assert grads == () and y1.shape == inputs["x"].shape and torch.isfinite(y1).all()
        assert not torch.equal(y1, y2)            # the cache advanced
        firsts[backend] = y1
    assert torch.equal(firsts["auto"], firsts["triton"])
    assert op.bytes(shape, "step") > 0 and op.flops(shape, "step") > 0
    with pytest.raises(ValueError, match="T must be 1"):
        op.make_inputs(get_preset(tiny)[0], "cpu", 0, "step")


def test_cli_presets_per_layer_op(capsys):
    """The CLI picks each layer op's own presets: on this CPU, a GPU preset is refused naming the op's tiny one."""
    from linattn.cli import main
    assert main(["bench", "--op", "layer_kda", "--modes", "step", "--preset", "layer_kda_step"]) == 2
    assert "layer_kda_step_tiny" in capsys.readouterr().err
    assert main(["bench", "--op", "layer_kda", "--preset", "layer_kda"]) == 2
    assert "layer_kda_tiny" in capsys.readouterr().err
    assert layer_flops(get_preset("layer")[0], "fwd") == LAYER_GDN.flops(get_preset("layer")[0], "fwd")
    assert layer_bytes(get_preset("layer")[0], "fwd") == LAYER_GDN.bytes(get_preset("layer")[0], "fwd")
