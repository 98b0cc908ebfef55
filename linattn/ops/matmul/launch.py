"""The per-call host path shared by the matmul launchers: launch plans cached per call signature, and an
optional launch through the compiled-kernel handle. The machinery is generic and lives in
linattn/runtime/host_path.py (the GDN Gluon state pass uses it too); this module holds matmul's switches and
binds them to it, under the names the matmul code and its tests use.

Why: on the H200 a 25 us GEMM (2000x3000x1000) took ~190 us per call on both paths; everything in
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

The handle launch is always on: every gate case of both paths runs through it on the H200 with the same error as
the JIT launch, and it takes the Gluon call on 2000x3000x1000 from 43 to 34 us eager (the kernel: 33 us
graph-replayed; results/2026-11-29_r9_matmul.json).

For measuring one against the other in one process, the tests switch both off for a block:
    from linattn.ops.matmul.launch import host_path_options
    with host_path_options(plan_cache=False, handle=False): ...
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Optional

from linattn.runtime import host_path as _hp
from linattn.runtime.host_path import HostPath, MAX_PLANS as _MAX_PLANS  # noqa: F401 (re-exported)
from linattn.runtime.host_path import KNOWN_DESCRIPTOR_FIELDS as _KNOWN_DESCRIPTOR_FIELDS  # noqa: F401
from linattn.runtime.host_path import usable_handle as _usable_handle  # noqa: F401


host_path = HostPath(handle=True)


def host_path_options(plan_cache: Optional[bool] = None, handle: Optional[bool] = None):
    """Temporarily switch the matmul host-path options (restored on exit)."""
    return host_path.options(plan_cache=plan_cache, handle=handle)


class PlanCache(_hp.PlanCache):
    """key -> plan, bounded, under matmul's switches (see linattn/runtime/host_path.py)."""

    def __init__(self, host_path_: Optional[HostPath] = None):
        super().__init__(host_path_ or host_path)


def launch(jit_fn, handles: Dict[Hashable, Any], slot: Hashable, grid, args, options: dict):
    """Launch `jit_fn` on a 3-tuple grid with all its arguments positional (constexprs included), under matmul's
    switches. `handles` (a plan's dict) keeps the CompiledKernel per `slot` for the handle path."""
    _hp.launch(host_path, jit_fn, handles, slot, grid, args, options, _current_device)


def _current_device():
    return _hp.current_device()


class DescriptorFactory(_hp.DescriptorFactory):
    """Per-call TensorDescriptors for one plan, copied from a validated template (linattn/runtime/host_path.py),
    under matmul's switches."""
    __slots__ = ()

    def __init__(self, cls, shape, strides, block_shape, layout, host_path_: Optional[HostPath] = None):
        super().__init__(cls, shape, strides, block_shape, layout, host_path_ or host_path)
