"""`linattn bench --op layer_gdn`: the GatedDeltaNet layer (`linattn.layers.GatedDeltaNet`) against FLA 0.6's
`fla.layers.GatedDeltaNet` on x [B, T, hidden], timed like every bench row (each backend in fresh processes,
alternated; eager and CUDA-graph columns; the spread between processes).

Modes: fwd is a prefill without autograd (torch.no_grad, the chunk op), fwdbwd a training step (the forward with
autograd, then dx and every parameter's gradient), step a decode step (presets layer_step / layer_step_tiny: B
sequences, one token each, after a PROMPT-token prefill into the layer's cache made when the runner is prepared; each
call advances the cache, and in a CUDA graph linattn's in-place states advance on every replay while FLA's layer,
which writes a new recurrent state, repeats the same step: the same work). Both layers hold the same weights
(linattn's layer initialised from a fixed seed, FLA's loaded with its state dict: the names are FLA's), so outputs
and gradients are compared by name. linattn's backend name reaches the layer's ops through LINATTN_BACKEND ("auto":
the dispatcher's choice). FLA runs its own Triton path (FLA_FLASH_QLA=0); on Hopper with triton < 3.7.1 FLA refuses
its gated backward unless tilelang is installed (the row then reports FLA's error).

A shape is GDN's (B, T, H = num_heads, HV = num_v_heads, K = head_dim, V = head_dim * expand_v) plus `hidden`.
"""
from __future__ import annotations

import os
from typing import Dict

import torch

from linattn.bench.base import BenchOp, Runner, Unavailable, gdn_flops

OP = "chunk_gated_delta_rule"


def layer_dims(shape: Dict) -> Dict:
    return dict(hidden_size=shape["hidden"], head_dim=shape["K"], num_heads=shape["H"], num_v_heads=shape["HV"],
                expand_v=shape["V"] / shape["K"])


def _projections(shape: Dict) -> int:
    """Weights of the seven projections: q, k [hidden, H K]; v, g [hidden, HV V]; a, b [hidden, HV]; o."""
    hid, H, HV, K, V = (shape[x] for x in ("hidden", "H", "HV", "K", "V"))
    return hid * (2 * H * K + 2 * HV * V + 2 * HV) + HV * V * hid


PROMPT = 16                 # the prefill before a timed decode step (mode "step")


def layer_flops(shape: Dict, mode: str, runner: str = "") -> float:
    """The projections' matmuls (2 per weight and token forward, 3x that with the backward's two) plus the chunk op's
    count (linattn.bench.base.gdn_flops); convolutions and norms (a few FLOPs per element) left out. A decode step:
    the projections and the state update (about 6 FLOPs per state element)."""
    tokens = shape["B"] * shape["T"]
    mm = 2.0 * tokens * _projections(shape)
    if mode == "step":
        return mm + 6.0 * shape["B"] * shape["HV"] * shape["K"] * shape["V"]
    return mm * (3.0 if mode == "fwdbwd" else 1.0) + gdn_flops(shape, mode)


LAYER_BYTES_MODEL = (
    "fwd: x read and y written (bf16), the weights read once (bf16), and each of q, k, v, the gate g_proj(x) and o "
    "written once and read once (bf16) between the layer's kernels; fwd+bwd: twice the forward's activation bytes "
    "each way plus the weight gradients written; step: the weights read once (bf16) and the fp32 recurrent state "
    "read and written once. A floor for a chain of kernels, not for one fused kernel.")


def layer_bytes(shape: Dict, mode: str, runner: str = "") -> float:
    """LAYER_BYTES_MODEL."""
    B, T, hid, H, HV, K, V = (shape[x] for x in ("B", "T", "hidden", "H", "HV", "K", "V"))
    es = 2
    acts = B * T * (2 * hid + 2 * (2 * H * K + 2 * HV * V + HV * V)) * es
    weights = _projections(shape) * es
    if mode == "step":
        return float(weights + 2 * B * HV * K * V * 4)
    if mode == "fwd":
        return float(acts + weights)
    return float(3 * acts + 2 * weights)


def layer_inputs(shape: Dict, device, seed: int, mode: str = "fwd") -> Dict:
    """x [B, T, hidden] bf16 (and, for fwdbwd, dy and x requiring grad), drawn on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, hid = shape["B"], shape["T"], shape["hidden"]
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    out = dict(x=torch.randn(B, T, hid, device=device, generator=gen).to(dtype))
    if mode == "step":
        if T != 1:
            raise ValueError(f"mode step times one token per sequence: the shape's T must be 1, got {T}")
        out["prompt"] = torch.randn(B, PROMPT, hid, device=device, generator=gen).to(dtype)
    if mode == "fwdbwd":
        out["dy"] = torch.randn(B, T, hid, device=device, generator=gen).to(dtype)
        out["x"].requires_grad_(True)
    return out


def _runner(name: str, layer, family: str, notes, prompt=None) -> Runner:
    params = sorted((n, p) for n, p in layer.named_parameters() if p.requires_grad)
    cache = None
    if prompt is not None:                        # step: the prefill into the layer's cache, once
        from linattn.layers import RecurrentCache
        layer.eval()
        cache = RecurrentCache()
        with torch.no_grad():
            layer(prompt, past_key_values=cache, use_cache=True)

    def fn(x):
        if cache is not None:                     # step: one token per sequence against the cache
            with torch.no_grad():
                return (layer(x, past_key_values=cache, use_cache=True)[0],)
        if not x.requires_grad:                   # fwd: a prefill without autograd
            with torch.no_grad():
                return (layer(x)[0],)
        return (layer(x)[0],)

    def args(inputs: Dict, mode: str):
        if mode != "fwdbwd":
            return dict(x=inputs["x"]), (), ()
        return dict(x=inputs["x"]), (inputs["x"], *(p for _, p in params)), (inputs["dy"],)
    return Runner(name, fn, args, ("y",), ("dx", *("d" + n for n, _ in params)), family=family, notes=notes)


def layer_prepare(backend: str, shape: Dict, inputs: Dict, mode: str) -> Runner:
    import linattn.layers
    dev, dtype = inputs["x"].device, inputs["x"].dtype
    torch.manual_seed(0)
    lin = linattn.layers.GatedDeltaNet(**layer_dims(shape), layer_idx=0).to(device=dev, dtype=dtype)
    if backend == "fla":
        os.environ["FLA_FLASH_QLA"] = "0"
        try:
            import fla
            import fla.layers
            peer = fla.layers.GatedDeltaNet(**layer_dims(shape), layer_idx=0).to(device=dev, dtype=dtype)
        except Exception as e:                    # ImportError (fla.layers needs the flash-linear-attention wheel)
            raise Unavailable(f"fla.layers not importable: {type(e).__name__}: {str(e)[:200]}")
        peer.load_state_dict(lin.state_dict())
        return _runner("fla", peer.train(), "peer",
                       [f"fla {getattr(fla, '__version__', '?')} fla.layers.GatedDeltaNet, FLA_FLASH_QLA=0"],
                       inputs.get("prompt"))
    if backend not in ("auto", "triton", "gluon"):
        raise Unavailable(f"the layer runs linattn's backends auto, triton or gluon, or the peer fla; not {backend!r}")
    os.environ["LINATTN_BACKEND"] = backend
    return _runner(backend, lin.train(), "linattn",
                   [f"linattn.layers.GatedDeltaNet, LINATTN_BACKEND={backend}"], inputs.get("prompt"))


LAYER_GDN = BenchOp(
    name="layer_gdn", registry_op=OP, linattn_backends=("auto", "triton", "gluon"), peers=("fla",),
    make_inputs=layer_inputs, flops=layer_flops, bytes=layer_bytes, bytes_model=LAYER_BYTES_MODEL,
    prepare=layer_prepare, typical_call=lambda device: None, reference="", api_module="linattn.layers",
    default_presets=("layer", "layer_tiny"), modes=("fwd", "fwdbwd", "step"))
