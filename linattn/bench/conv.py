"""`linattn bench --op conv_gdn`: the GatedDeltaNet layer's three short convolutions (q and k over H * K channels, v
over HV * V; W = 4, SiLU, bf16, no bias or states, as the layer calls `causal_conv1d` in training) timed as one row,
forward and forward + backward, against FLA 0.6's `fla.modules.causal_conv1d.causal_conv1d` as it dispatches by
default, each backend in fresh processes like every bench row. A shape is GDN's (B, T, H, HV, K, V); the reference
backend (fp32 PyTorch) checks the anchor.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch

from linattn.bench.base import BenchOp, Runner, Unavailable

W = 4
NAMES = ("q", "k", "v")
CONV_BYTES_MODEL = (
    "fwd: x read and y written once per convolution (bf16). fwd+bwd: the forward's bytes, plus the backward reading x "
    "and dy and writing dx once (the pre-activation recomputed from x, not stored); weights negligible.")


def _channels(shape: Dict):
    return (shape["H"] * shape["K"], shape["H"] * shape["K"], shape["HV"] * shape["V"])


def conv_inputs(shape: Dict, device, seed: int, mode: str = "fwd") -> Dict:
    """Per convolution: x [B, T, D] and weight [D, W] (bf16 on a GPU, fp32 on the CPU; weight ~ N(0, 0.25)); with mode
    fwdbwd also dy, and x / weight requiring grad. Drawn on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    B, T = shape["B"], shape["T"]
    out = {}
    for name, D in zip(NAMES, _channels(shape)):
        out[f"x_{name}"] = torch.randn(B, T, D, device=device, generator=gen).to(dtype)
        out[f"w_{name}"] = (torch.randn(D, W, device=device, generator=gen) * 0.5).to(dtype)
        if mode == "fwdbwd":
            out[f"dy_{name}"] = torch.randn(B, T, D, device=device, generator=gen).to(dtype)
            out[f"x_{name}"].requires_grad_(True)
            out[f"w_{name}"].requires_grad_(True)
    return out


def conv_flops(shape: Dict, mode: str, runner: str = "") -> float:
    """2 W FLOP per output element forward (the SiLU not counted); fwd+bwd 4x forward (the recomputed
    pre-activation, dx and dweight)."""
    fwd = 2.0 * W * shape["B"] * shape["T"] * sum(_channels(shape))
    return fwd * (4.0 if mode == "fwdbwd" else 1.0)


def conv_bytes(shape: Dict, mode: str, runner: str = "") -> float:
    """CONV_BYTES_MODEL: 4 bytes per element forward (x, y), 10 forward + backward (x, y, x, dy, dx)."""
    elems = shape["B"] * shape["T"] * sum(_channels(shape))
    return float(elems * (4 if mode == "fwd" else 10))


def _args(inputs: Dict, mode: str):
    kw = {k: v for k, v in inputs.items() if k[:2] in ("x_", "w_")}
    if mode != "fwdbwd":
        return kw, (), ()
    leaves = tuple(inputs[f"{p}_{n}"] for n in NAMES for p in ("x", "w"))
    return kw, leaves, tuple(inputs[f"dy_{n}"] for n in NAMES)


def _runner(name: str, conv, family: str, notes) -> Runner:
    def fn(**kw):
        # fwd runs without autograd, as in inference
        with contextlib.nullcontext() if kw["x_q"].requires_grad else torch.no_grad():
            return tuple(conv(kw[f"x_{n}"], kw[f"w_{n}"]) for n in NAMES)
    grads = tuple(f"d{p}_{n}" for n in NAMES for p in ("x", "w"))
    return Runner(name, fn, _args, tuple(f"y_{n}" for n in NAMES), grads, family=family, notes=notes)


def conv_prepare(backend: str, shape: Dict, inputs: Dict, mode: str) -> Runner:
    if backend == "fla":
        try:
            import fla
            from fla.modules.causal_conv1d import causal_conv1d as fla_conv
        except Exception as e:                        # ImportError, or a driver query failing on a CPU
            raise Unavailable(f"fla not importable: {type(e).__name__}: {e}")
        return _runner("fla", lambda x, w: fla_conv(x, w, activation="silu")[0], "peer",
                       [f"fla {getattr(fla, '__version__', '?')} fla.modules.causal_conv1d.causal_conv1d"])
    if backend not in ("triton", "reference"):
        raise Unavailable(f"causal_conv1d's backends are triton and reference; the peer is fla; not {backend!r}")
    import linattn
    return _runner(backend, lambda x, w: linattn.causal_conv1d(x, w, activation="silu", backend=backend)[0],
                   "linattn", [f"linattn.causal_conv1d(backend={backend!r}), three convolutions"])


CONV_GDN = BenchOp(
    name="conv_gdn", registry_op="causal_conv1d", linattn_backends=("triton", "reference"), peers=("fla",),
    make_inputs=conv_inputs, flops=conv_flops, bytes=conv_bytes, bytes_model=CONV_BYTES_MODEL, prepare=conv_prepare,
    typical_call=lambda device: None, api_module="linattn.ops.conv1d.api", default_presets=("layer", "layer_tiny"))
