"""The per-call host path shared by the matmul launchers: launch plans cached per call signature, and an
optional launch through the compiled-kernel handle.

Why: on the H200 (round 6) a 25 us GEMM (2000x3000x1000) took ~190 us per call on both paths; everything in
front of the kernel is host Python. A *plan* holds what depends only on the call's signature (shapes, strides,
dtype, device, explicit config): the launch config (heuristic or tuned-cache lookup), transposition flags,
TMA block shapes and layouts, grid, workspace shape. Computing it once per signature leaves, per call, the
tensor allocation, the descriptors (they hold the data pointers) and the launch.

The launch itself: `jit_fn[grid](...)` re-binds and re-specialises every argument and hashes a cache key on
every call. The first call of a plan goes through it and keeps the CompiledKernel it returns; with
`host_path.handle` on, later calls use `compiled[grid](*args)` (the CompiledKernel launcher, the same one the
JIT ends in, with the same argument list, constexprs included). The plan key fixes everything the JIT
specialises on (integer values, strides, dtypes, pointer alignment), so the kernel is the one the JIT would
pick. Feature-detected: a Triton whose JIT returns no usable handle keeps using the JIT.

The handle launch is on by default since round 9 (results/2026-11-29_r9_matmul.json): every gate case of both
paths ran through it on the H200 with the same error as the JIT launch (54 Triton, 99 + 132 Gluon cases), and it
took the Gluon call on 2000x3000x1000 from 43 to 34 us eager (the kernel: 33 us graph-replayed).

Switches (for measuring one against the other in one process; the defaults are what the gate validated):
    from linattn.ops.matmul.launch import host_path_options
    with host_path_options(plan_cache=False, handle=False): ...
or, for a whole process, LINATTN_MATMUL_HANDLE=0 in the environment (read at import) turns the handle launch off.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Optional


@dataclass
class HostPath:
    plan_cache: bool = True      # reuse launch plans per call signature
    handle: bool = True          # launch through the cached CompiledKernel (gated on the H200 in round 9)


def _handle_default() -> bool:
    return os.environ.get("LINATTN_MATMUL_HANDLE", "1").strip().lower() not in ("0", "false", "off", "no")


host_path = HostPath(handle=_handle_default())

_MAX_PLANS = 4096


@contextlib.contextmanager
def host_path_options(plan_cache: Optional[bool] = None, handle: Optional[bool] = None):
    """Temporarily switch the host-path options (restored on exit)."""
    saved = (host_path.plan_cache, host_path.handle)
    if plan_cache is not None:
        host_path.plan_cache = plan_cache
    if handle is not None:
        host_path.handle = handle
    try:
        yield host_path
    finally:
        host_path.plan_cache, host_path.handle = saved


class PlanCache:
    """key -> plan, bounded (cleared when full: shapes seen by a real workload are few)."""

    def __init__(self):
        self._plans: Dict[Hashable, Any] = {}

    def get(self, key, build):
        if not host_path.plan_cache:
            return build()
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = build()
        return plan

    def clear(self):
        self._plans.clear()

    def __len__(self):
        return len(self._plans)


def _usable_handle(k) -> bool:
    # A CompiledKernel launches as k[grid](*args); an async-compile future (k.result) or anything else does not.
    return k is not None and not hasattr(k, "result") and hasattr(type(k), "__getitem__") and hasattr(k, "run")


def launch(jit_fn, handles: Dict[Hashable, Any], slot: Hashable, grid, args, options: dict):
    """Launch `jit_fn` on a 3-tuple grid with all its arguments positional (constexprs included).
    `handles` (a plan's dict) keeps the CompiledKernel per `slot` for the handle path."""
    # Per current device, as the JIT's own caches: a handle holds a function loaded in one context. The device is
    # asked only once a handle exists: the interpreter returns none, and there may be no GPU driver to ask.
    if host_path.handle and handles:
        k = handles.get((slot, _current_device()))
        if k is not None:
            k[grid](*args)
            return
    k = jit_fn[grid](*args, **options)
    if host_path.handle and _usable_handle(k):
        handles[(slot, _current_device())] = k


def _current_device():
    from triton.runtime.driver import driver
    return driver.active.get_current_device()


class DescriptorFactory:
    """Per-call TensorDescriptors for one plan. The first is built by the constructor (which validates shape,
    strides, block and layout); later ones copy its fields and swap the base tensor, skipping a re-validation
    of what the plan key has fixed (the caller checks the 16-byte alignment of each base). A descriptor class
    with other fields than 3.6's (a future Triton) is always built by its constructor."""
    __slots__ = ("cls", "spec", "fields")

    def __init__(self, cls, shape, strides, block_shape, layout):
        self.cls, self.spec, self.fields = cls, (shape, strides, block_shape, layout), None

    def __call__(self, base):
        if self.fields is not None and host_path.plan_cache:
            d = object.__new__(self.cls)
            d.__dict__.update(self.fields)
            d.base = base
            return d
        d = self.cls(base, *self.spec)
        if self.fields is None and set(getattr(d, "__dict__", ())) == _KNOWN_DESCRIPTOR_FIELDS:
            self.fields = {k: v for k, v in d.__dict__.items() if k != "base"}   # no tensor kept alive
        return d


# The fields of triton 3.6's Gluon TensorDescriptor, none derived from the base. A descriptor class with any
# other field set (a later Triton may derive one from the base) is always built by its constructor.
_KNOWN_DESCRIPTOR_FIELDS = {"base", "shape", "strides", "block_shape", "layout", "padding"}
