"""`linattn bench --op layer_gdn` / `--op layer_kda`: the GatedDeltaNet layer (`linattn.layers.GatedDeltaNet`) or the
Kimi Delta Attention layer (`linattn.layers.KimiDeltaAttention`) against FLA 0.6's `fla.layers.GatedDeltaNet` /
`fla.layers.KimiDeltaAttention` on x [B, T, hidden], timed like every bench row (each backend in fresh processes,
alternated; eager and CUDA-graph columns; the spread between processes).

Modes: fwd is a prefill without autograd (torch.no_grad, the chunk op), fwdbwd a training step (the forward with
autograd, then dx and every parameter's gradient), step a decode step (presets layer_step / layer_kda_step and their
_tiny forms: B sequences, one token each, after a PROMPT-token prefill into the layer's cache made when the runner is
prepared; each call advances the cache, and in a CUDA graph linattn's in-place states advance on every replay while
FLA's layer, which writes a new recurrent state, repeats the same step: the same work). Both layers hold the same
weights (linattn's layer initialised from a fixed seed, FLA's loaded with its state dict: the names are FLA's), so
outputs and gradients are compared by name. linattn's backend name reaches the layer's ops through LINATTN_BACKEND
("auto": the dispatcher's choice). FLA runs its own Triton path (FLA_FLASH_QLA=0); on Hopper with triton < 3.7.1 FLA
refuses its gated backward unless tilelang is installed (the row then reports FLA's error).

A shape is GDN's (B, T, H = num_heads, HV = num_v_heads, K = head_dim, V = head_dim * expand_v) plus `hidden`.
"""
from __future__ import annotations

import os
from typing import Dict

import torch

from linattn.bench.base import BenchOp, Runner, Unavailable, gdn_flops

OP = "chunk_gated_delta_rule"
# per layer kind: the layer class (the same name in linattn.layers and fla.layers) and the chunked op it runs
KINDS = {"gdn": ("GatedDeltaNet", OP), "kda": ("KimiDeltaAttention", "chunk_kda")}


def layer_dims(shape: Dict) -> Dict:
    return dict(hidden_size=shape["hidden"], head_dim=shape["K"], num_heads=shape["H"], num_v_heads=shape["HV"],
                expand_v=shape["V"] / shape["K"])


def _projections(shape: Dict, kind: str = "gdn") -> int:
    """Weights of the projections. GDN: q, k [hidden, H K]; v, g [hidden, HV V]; a, b [hidden, HV]; o. KDA: q, k, v,
    b as GDN's; the gate f and the output gate g each through a rank-V bottleneck ([hidden, V] then [V, HV K] /
    [V, HV V]); o."""
    hid, H, HV, K, V = (shape[x] for x in ("hidden", "H", "HV", "K", "V"))
    if kind == "kda":
        return hid * (2 * H * K + HV * V + HV + 2 * V) + V * HV * (K + V) + HV * V * hid
    return hid * (2 * H * K + 2 * HV * V + 2 * HV) + HV * V * hid


PROMPT = 16                 # the prefill before a timed decode step (mode "step")


def layer_flops(shape: Dict, mode: str, runner: str = "", kind: str = "gdn") -> float:
    """The projections' matmuls (2 per weight and token forward, 3x that with the backward's two) plus the chunk op's
    count (linattn.bench.base.gdn_flops, KDA's too: its per-channel decay adds elementwise work only); convolutions
    and norms (a few FLOPs per element) left out. A decode step: the projections and the state update (about 6 FLOPs
    per state element)."""
    tokens = shape["B"] * shape["T"]
    mm = 2.0 * tokens * _projections(shape, kind)
    if mode == "step":
        return mm + 6.0 * shape["B"] * shape["HV"] * shape["K"] * shape["V"]
    return mm * (3.0 if mode == "fwdbwd" else 1.0) + gdn_flops(shape, mode)


LAYER_BYTES_MODEL = (
    "fwd: x read and y written (bf16), the weights read once (bf16), and each of q, k, v, the gate g_proj(x) and o "
    "written once and read once (bf16) between the layer's kernels; fwd+bwd: twice the forward's activation bytes "
    "each way plus the weight gradients written; step: the weights read once (bf16) and the fp32 recurrent state "
    "read and written once. A floor for a chain of kernels, not for one fused kernel.")


def layer_bytes(shape: Dict, mode: str, runner: str = "", kind: str = "gdn") -> float:
    """LAYER_BYTES_MODEL (KDA's gate is per key channel: HV K values a token instead of none)."""
    B, T, hid, H, HV, K, V = (shape[x] for x in ("B", "T", "hidden", "H", "HV", "K", "V"))
    es = 2
    gate = HV * K if kind == "kda" else 0
    acts = B * T * (2 * hid + 2 * (2 * H * K + 2 * HV * V + HV * V + gate)) * es
    weights = _projections(shape, kind) * es
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


def layer_prepare(backend: str, shape: Dict, inputs: Dict, mode: str, kind: str = "gdn") -> Runner:
    import linattn.layers
    cls = KINDS[kind][0]
    dev, dtype = inputs["x"].device, inputs["x"].dtype
    torch.manual_seed(0)
    lin = getattr(linattn.layers, cls)(**layer_dims(shape), layer_idx=0).to(device=dev, dtype=dtype)
    if backend == "fla":
        os.environ["FLA_FLASH_QLA"] = "0"
        try:
            import fla
            import fla.layers
            peer = getattr(fla.layers, cls)(**layer_dims(shape), layer_idx=0).to(device=dev, dtype=dtype)
        except Exception as e:                    # ImportError (fla.layers needs the flash-linear-attention wheel)
            raise Unavailable(f"fla.layers not importable: {type(e).__name__}: {str(e)[:200]}")
        peer.load_state_dict(lin.state_dict())
        return _runner("fla", peer.train(), "peer",
                       [f"fla {getattr(fla, '__version__', '?')} fla.layers.{cls}, FLA_FLASH_QLA=0"],
                       inputs.get("prompt"))
    if backend not in ("auto", "triton", "gluon"):
        raise Unavailable(f"the layer runs linattn's backends auto, triton or gluon, or the peer fla; not {backend!r}")
    os.environ["LINATTN_BACKEND"] = backend
    return _runner(backend, lin.train(), "linattn",
                   [f"linattn.layers.{cls}, LINATTN_BACKEND={backend}"], inputs.get("prompt"))


def _layer_op(kind: str, presets: tuple, step_presets: tuple) -> BenchOp:
    def flops(shape: Dict, mode: str, runner: str = "") -> float:
        return layer_flops(shape, mode, runner, kind)

    def nbytes(shape: Dict, mode: str, runner: str = "") -> float:
        return layer_bytes(shape, mode, runner, kind)
    # the runner writes the FLOP model's docstring into every result
    flops.__doc__, nbytes.__doc__ = layer_flops.__doc__, layer_bytes.__doc__
    return BenchOp(
        name=f"layer_{kind}", registry_op=KINDS[kind][1], linattn_backends=("auto", "triton", "gluon"),
        peers=("fla",), make_inputs=layer_inputs, flops=flops, bytes=nbytes, bytes_model=LAYER_BYTES_MODEL,
        prepare=lambda backend, shape, inputs, mode: layer_prepare(backend, shape, inputs, mode, kind),
        typical_call=lambda device: None, reference="", api_module="linattn.layers", default_presets=presets,
        modes=("fwd", "fwdbwd", "step"), step_presets=step_presets)


LAYER_GDN = _layer_op("gdn", ("layer", "layer_tiny"), ("layer_step", "layer_step_tiny"))
LAYER_KDA = _layer_op("kda", ("layer_kda", "layer_kda_tiny"), ("layer_kda_step", "layer_kda_step_tiny"))
