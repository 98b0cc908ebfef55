"""The bench's data types: an op to time (`BenchOp`), one timeable implementation of it (`Runner`), and the
refusal a backend gives when it cannot be timed here (`Unavailable`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F


CHUNK = 64                      # C in gdn-math.md's FLOP formula


class Unavailable(Exception):
    """This backend cannot be timed here; str(exc) says why."""


@dataclass
class Runner:
    """One timeable implementation. `args(inputs, mode)` gives (call kwargs, leaves to differentiate,
    gradients of the outputs); `fn(**kwargs)` returns a tuple of outputs named by `out_names`."""
    name: str
    fn: Callable
    args: Callable
    out_names: Tuple[str, ...]
    grad_names: Tuple[str, ...]
    compare: bool = True                 # False when the runner computes another function (SDPA)
    grads_verified: bool = True
    notes: List[str] = field(default_factory=list)
    family: str = "linattn"              # "linattn" or "peer"


@dataclass
class BenchOp:
    name: str
    registry_op: str                     # name in linattn.backends
    linattn_backends: Tuple[str, ...]
    peers: Tuple[str, ...]
    make_inputs: Callable                # (shape, device, seed, mode) -> dict
    flops: Callable                      # (shape, mode, runner_name) -> float
    bytes: Callable                      # (shape, mode, runner_name) -> float
    bytes_model: str
    prepare: Callable                    # (backend, shape, inputs, mode) -> Runner
    typical_call: Callable               # (device) -> kwargs for supports()/explain(), or None (doctor has its own)
    reference: str = "reference"
    api_module: str = ""                 # the module that registers the op's backends (default linattn.ops.<name>.api)
    max_sets: int = 8                    # input sets cycled through at most (timing.num_input_sets)
    modes: Tuple[str, ...] = ("fwd", "fwdbwd")
    default_presets: Tuple[str, str] = ("quick", "tiny")   # `linattn bench`'s preset on a GPU, on the CPU
    step_presets: Tuple[str, str] = ()   # the same for --modes step (the layer ops)


def delta_rule_inputs(shape: Dict, device, seed: int, mode: str, dtype, leaves: Tuple[str, ...],
                      channel_gate: bool = False) -> Dict:
    """The chunked delta-rule ops' bench inputs (GDN's and KDA's): dtype q, k (L2-normalised), v; fp32 log decay g in
    about [-0.3, 0) (mean -0.116; times the shape's "g_scale" where given), [B, T, HV] or per key channel
    [B, T, HV, K] with channel_gate; fp32 beta in (0, 1); fp32 initial state; int32 cu_seqlens from the shape's
    "lengths"; with mode "fwdbwd" also the output gradients do, dht, and `leaves` requiring grad. Drawn on the device
    (production sizes are gigabytes: a CPU generator would dominate the run)."""
    B, T, H, HV, K, V = (shape[x] for x in ("B", "T", "H", "HV", "K", "V"))
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, device=device, generator=gen, dtype=torch.float32)

    lengths = shape.get("lengths")
    N = len(lengths) if lengths else B
    g_shape = (B, T, HV, K) if channel_gate else (B, T, HV)
    out = dict(q=rnd(B, T, H, K).to(dtype), k=F.normalize(rnd(B, T, H, K), dim=-1).to(dtype),
               v=rnd(B, T, HV, V).to(dtype), g=F.logsigmoid(rnd(*g_shape) + 4.0) * (4.0 * shape.get("g_scale", 1.0)),
               beta=torch.sigmoid(rnd(B, T, HV)), initial_state=rnd(N, HV, K, V) * 0.5, cu_seqlens=None)
    if lengths:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    if mode == "fwdbwd":
        out["do"] = rnd(B, T, HV, V).to(dtype)
        out["dht"] = rnd(N, HV, K, V)
        for name in leaves:
            out[name].requires_grad_(True)
    return out


def gdn_flops(shape: Dict, mode: str, runner: str = "") -> float:
    """gdn-math.md: forward ~ 2*C*(3K+2V) + 6*K*V per token and value head; fwd+bwd counted as 3.5x forward
    (the backward does about 2.5x the forward's work). SDPA: causal QK^T and PV, 2*B*HV*T^2*D forward."""
    B, T, HV, K, V = (shape[x] for x in ("B", "T", "HV", "K", "V"))
    if runner == "sdpa":
        fwd = 2.0 * B * HV * T * T * K
    else:
        fwd = float(B * T * HV) * (2 * CHUNK * (3 * K + 2 * V) + 6 * K * V)
    return fwd * (3.5 if mode == "fwdbwd" else 1.0)
