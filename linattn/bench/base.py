"""The bench's data types: an op to time (`BenchOp`), one timeable implementation of it (`Runner`), and the
refusal a backend gives when it cannot be timed here (`Unavailable`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Tuple


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
