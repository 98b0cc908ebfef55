"""`linattn bench --op kda`: the chunked Kimi Delta Attention op (`chunk_kda`, forward and forward + backward) timed like
every bench row (each backend in fresh processes, eager calls and CUDA-graph replays), against FLA's
fla.ops.kda.chunk_kda on the same inputs and the roofline floor.

A shape is GDN's (B, T, H, HV, K, V, optional `lengths`); the decay g is per key channel, [B, T, HV, K]. The FLOP
count is GDN's chunked form (gdn-math.md): the per-channel decay changes which factors enter the intra-chunk products,
not their number. The bytes are GDN's with the K-wide gate (g read, and dg written in the backward, at HV * K fp32
values per token instead of HV). FLA is timed on its own Triton path, as in the GDN bench (FLA_FLASH_QLA=0,
FLA_TILELANG=0 unless set).
"""
from __future__ import annotations

import os
from typing import Dict

import torch

from linattn.bench.base import BenchOp, Runner, Unavailable, delta_rule_inputs, gdn_flops

OP = "chunk_kda"
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")

KDA_BYTES_MODEL = (
    "fwd: q,k read once (H heads, bf16), v read and o written once (HV heads, bf16), g read (fp32, HV*K per token), "
    "beta read (fp32, HV per token), initial state read and final state written (fp32). fwd+bwd: the forward's "
    "bytes, plus the backward reading q,k,v,g,beta, the initial state, do and dht once and writing dq,dk,dv,dg,dbeta,"
    "dh0 once (recomputation and saved intermediates are not compulsory, so not counted).")


def kda_inputs(shape: Dict, device, seed: int, mode: str = "fwd", dtype=torch.bfloat16) -> Dict:
    """bf16 q, k (L2-normalised), v; fp32 g [B, T, HV, K] (a log decay per channel in about [-0.3, 0), mean -0.116,
    GDN's bench distribution drawn per channel; times the shape's "g_scale" where given); fp32 beta in (0, 1); fp32
    initial state; with mode "fwdbwd" also the output gradients do, dht. Drawn on the device."""
    return delta_rule_inputs(shape, device, seed, mode, dtype, LEAVES, channel_gate=True)


def kda_flops(shape: Dict, mode: str, runner: str = "") -> float:
    """GDN's chunked count (gdn-math.md): forward ~ 2*C*(3K+2V) + 6*K*V per token and value head, C = 64; fwd+bwd
    3.5x forward (the backward does about 2.5x the forward's work)."""
    return gdn_flops(shape, mode)


def kda_bytes(shape: Dict, mode: str, runner: str = "") -> float:
    """KDA_BYTES_MODEL: GDN's compulsory bytes (linattn.bench.ops.gdn_bytes) with g K values wide."""
    B, T, H, HV, K, V = (shape[x] for x in ("B", "T", "H", "HV", "K", "V"))
    es = 2                                         # bf16 operands
    N = len(shape["lengths"]) if shape.get("lengths") else B
    qk = 2 * B * T * H * K * es
    v = B * T * HV * V * es
    o = v
    gb = B * T * HV * (K + 1) * 4                  # g [B, T, HV, K] and beta [B, T, HV], fp32
    state = N * HV * K * V * 4
    fwd = qk + v + o + gb + 2 * state
    if mode == "fwd":
        return float(fwd)
    inputs = qk + v + gb + state
    return float(fwd + 2 * inputs + o + state)    # read inputs, do, dht; write grads of the inputs


def _call_args(inputs: Dict, mode: str, cu_dtype=None):
    """(kwargs, leaves, output grads), once per input set outside the timed region."""
    kw = {n: inputs[n] for n in LEAVES}
    cu = inputs.get("cu_seqlens")
    kw.update(output_final_state=True, cu_seqlens=cu if cu is None or cu_dtype is None else cu.to(cu_dtype))
    if mode != "fwdbwd":
        return kw, (), ()
    return kw, tuple(inputs[n] for n in LEAVES), (inputs["do"], inputs["dht"])


def _prepare_linattn(name: str, inputs: Dict) -> Runner:
    from linattn.backends import op_backends
    from linattn.ops.kda.chunk import chunk_kda
    reg = op_backends(OP)
    if name not in reg.backends:
        raise Unavailable(f"not registered for {OP} (registered: {reg.names()})")
    ok, reason = reg.backends[name].accepts(**{n: inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state",
                                                                       "cu_seqlens")}, output_final_state=True)
    if not ok:
        raise Unavailable(f"supports() rejects: {reason}")
    return Runner(name, lambda **kw: chunk_kda(**kw, backend=name), _call_args, ("o", "final_state"), GRADS,
                  notes=[f"linattn.chunk_kda(backend={name!r})"])


def _prepare_fla() -> Runner:
    os.environ["FLA_FLASH_QLA"] = "0"
    os.environ.setdefault("FLA_TILELANG", "0")
    try:
        import fla
        from fla.ops.kda import chunk_kda as fla_kda
    except Exception as e:                            # ImportError, or a driver query failing on a CPU
        raise Unavailable(f"fla not importable: {type(e).__name__}: {e}")
    return Runner("fla", lambda **kw: fla_kda(**kw), lambda inp, m: _call_args(inp, m, torch.int64),
                  ("o", "final_state"), GRADS, family="peer",
                  notes=[f"fla {getattr(fla, '__version__', '?')} fla.ops.kda.chunk_kda, FLA_FLASH_QLA=0, "
                         f"FLA_TILELANG={os.environ['FLA_TILELANG']}"])


def kda_prepare(backend: str, shape: Dict, inputs: Dict, mode: str) -> Runner:
    if backend == "fla":
        return _prepare_fla()
    if backend in ("flashqla", "sdpa"):
        raise Unavailable(f"{backend} has no KDA op to compare")
    return _prepare_linattn(backend, inputs)


KDA = BenchOp(
    name="kda", registry_op=OP, linattn_backends=("triton", "gluon", "reference"), peers=("fla", "flashqla", "sdpa"),
    make_inputs=kda_inputs, flops=kda_flops, bytes=kda_bytes, bytes_model=KDA_BYTES_MODEL, prepare=kda_prepare,
    typical_call=lambda device: None, api_module="linattn.ops.kda.chunk", default_presets=("kda_production",
                                                                                           "kda_tiny"))
