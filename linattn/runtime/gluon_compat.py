"""The one place that imports the Gluon names linattn uses.

Gluon (`triton.experimental.gluon`) is experimental and its names move between Triton releases: 3.6 calls the
Hopper TMA load `tma.async_copy_global_to_shared`, later releases call it `tma.async_load`; the signature of
`gl.warp_specialize` changed in 3.6 (a list of `(fn, args)` pairs, entry 0 the default partition). Our kernels
use the aliases defined here (`tma_load`, `tma_store`, ...) so that a rename is fixed in this file only.

Nothing here runs at `import linattn` time: kernel modules import this module, and `gluon_status()` imports
lazily, so a Triton without Gluon still imports linattn and runs the Triton path. Kernel modules must check
`GLUON_OK` (or call `gluon_status()`) before defining `@gluon.jit` functions.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Dict, Tuple

# Filled by _load(); names stay None when this Triton lacks them.
gluon = gl = tma = mbarrier = None
fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None
mma_v2 = None                       # ampere mma.sync (valid on sm_90 too); the GDN literal state pass uses it
async_copy = None                   # cp.async (async_copy_global_to_shared, commit_group, wait_group), sm_80 and on
TensorDescriptor = None
tma_load = tma_store = tma_store_wait = None
GluonASTSource = None
GLUON_OK = False
GLUON_REASON = "not probed"
_DETAILS: Dict[str, Any] = {}


def _first_attr(obj, *names):
    """(name, attribute) for the first of `names` that `obj` has, else (None, None)."""
    for n in names:
        if obj is not None and hasattr(obj, n):
            return n, getattr(obj, n)
    return None, None


def _warp_specialize_form(fn) -> str:
    """'3.6' for warp_specialize(functions_and_args, worker_num_warps, worker_num_regs); 'pre-3.6' for the
    older (args, default_partition, worker_args, worker_partitions, ...) form; 'unknown' otherwise."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "unknown"
    if params[:1] == ["functions_and_args"]:
        return "3.6"
    if "default_partition" in params or "worker_partitions" in params:
        return "pre-3.6"
    return "unknown"


def _load() -> Tuple[bool, str, Dict[str, Any]]:
    global gluon, gl, tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    global TensorDescriptor, tma_load, tma_store, tma_store_wait, GluonASTSource, mma_v2, async_copy
    details: Dict[str, Any] = {}
    try:
        import triton
        details["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - any import failure means "no Triton"
        return False, f"triton does not import: {e!r}", details
    try:
        from triton.experimental import gluon as _gluon
        from triton.experimental.gluon import language as _gl
    except Exception as e:  # noqa: BLE001
        return False, f"triton {triton.__version__} has no triton.experimental.gluon ({e!r})", details
    try:
        from triton.experimental.gluon.language.nvidia import hopper as _hopper
    except Exception as e:  # noqa: BLE001
        return False, f"gluon has no nvidia.hopper language module ({e!r})", details
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _TD
    except Exception as e:  # noqa: BLE001
        _TD = None
        details["TensorDescriptor_error"] = repr(e)
    try:
        from triton.experimental.gluon._runtime import GluonASTSource as _src
    except Exception:  # noqa: BLE001 - only needed for ahead-of-time compiles
        _src = None

    gluon, gl = _gluon, _gl
    tma = getattr(_hopper, "tma", None)
    mbarrier = getattr(_hopper, "mbarrier", None)
    TensorDescriptor, GluonASTSource = _TD, _src
    missing = []
    chosen = {}
    for alias, obj, names in [
        ("tma_load", tma, ("async_copy_global_to_shared", "async_load")),
        ("tma_store", tma, ("async_copy_shared_to_global", "async_store")),
        ("tma_store_wait", tma, ("store_wait",)),
        ("fence_async_shared", _hopper, ("fence_async_shared",)),
        ("warpgroup_mma", _hopper, ("warpgroup_mma",)),
        ("warpgroup_mma_wait", _hopper, ("warpgroup_mma_wait",)),
        ("mma_v2", _hopper, ("mma_v2",)),
    ]:
        name, fn = _first_attr(obj, *names)
        globals()[alias] = fn
        chosen[alias] = name
        if fn is None:
            missing.append(f"{alias} (looked for {' / '.join(names)})")
    # optional: only the backward's local/WY kernel uses cp.async (the gluon backend keeps the Triton stages without it)
    async_copy = getattr(_hopper, "async_copy", None)
    chosen["async_copy"] = "async_copy" if async_copy is not None else None
    for name in ("init", "expect", "wait", "arrive", "invalidate", "MBarrierLayout"):
        if mbarrier is None or not hasattr(mbarrier, name):
            missing.append(f"mbarrier.{name}")
    for name in ("warp_specialize", "allocate_shared_memory", "NVMMASharedLayout", "NVMMADistributedLayout",
                 "thread_barrier"):
        if not hasattr(gl, name):
            missing.append(f"gl.{name}")
    if not hasattr(gluon, "constexpr_function"):
        missing.append("gluon.constexpr_function")
    if TensorDescriptor is None:
        missing.append("gluon.nvidia.hopper.TensorDescriptor")
    details["names"] = chosen
    ws_form = _warp_specialize_form(gl.warp_specialize) if hasattr(gl, "warp_specialize") else "absent"
    details["warp_specialize"] = ws_form
    details["aot_source"] = "GluonASTSource" if GluonASTSource is not None else None
    if missing:
        details["missing"] = missing
        return False, "this Gluon lacks: " + ", ".join(missing), details
    if ws_form != "3.6":
        return False, f"gl.warp_specialize has the {ws_form} signature; our kernels use the 3.6 form", details
    return True, f"Gluon available (triton {triton.__version__}, TMA load = tma.{chosen['tma_load']})", details


@lru_cache(maxsize=None)
def _probe() -> Tuple[bool, str]:
    global GLUON_OK, GLUON_REASON, _DETAILS
    ok, reason, details = _load()
    GLUON_OK, GLUON_REASON, _DETAILS = ok, reason, details
    return ok, reason


def gluon_status() -> Tuple[bool, str, Dict[str, Any]]:
    """(ok, reason, details): whether this Triton provides every Gluon name our Hopper kernels use.
    `details` holds the Triton version, which spelling of each renamed name was found, the warp_specialize
    form and any missing names. It says nothing about the GPU: backends check the device separately."""
    # The probe ran once at import (below); read its results rather than call the lru_cache'd _probe: torch.compile
    # traces through lru_cache into _load(), whose globals() it cannot trace (a compiled model whose `auto` asks the
    # Gluon decode's supports() fails so).
    return GLUON_OK, GLUON_REASON, dict(_DETAILS)


# Kernel modules do `from linattn.runtime.gluon_compat import gl, tma_load, ...`: probe at import of this module
# (never at `import linattn`), so the names are bound by then. The probe never raises.
_probe()
