"""The C launch under a compiled kernel's launcher, for launch lists (runtime/launch_list.py) to call directly.

A compiled kernel's `run` (triton 3.6: backends/nvidia/driver.py's CudaLauncher) takes a launch as
run(gridX, gridY, gridZ, stream, function, packed, launch metadata, enter hook, exit hook, *kernel args); where the
kernel needs no global or profile scratch it passes the same arguments, with the cooperative-grid and PDL flags and
two None scratch pointers inserted after `function`, to its `launch`. For a kernel with TensorDescriptor parameters
that `launch` is a wrapper (wrap_handle_tensordesc's `inner`) that replaces each descriptor argument by
make_tensordesc_arg(descriptor, its metadata) (the CUtensorMap encoded by cuTensorMapEncodeTiled, then the shape and
strides) before the C launch: 1-2 us of host time per descriptor, on every launch.

A replayed launch list knows each descriptor's fields for good (they are fixed by the call signature) and only the
base moves, so it keeps the expanded arguments per descriptor and re-encodes them only when the base pointer
differs from the previous replay's (the caching allocator hands a repeat call the same addresses). `CLaunch` is what
that needs: the C launch, the two flags, and per descriptor position its metadata and Triton's own
make_tensordesc_arg (the expansion is Triton's, never rebuilt here).

Feature-detected, structurally: the launcher is a CudaLauncher whose class call is CudaLauncher.__call__ itself,
and its scratch sizes are 0: its `launch` then takes exactly the arguments above. Where that `launch` is
wrap_handle_tensordesc's inner function (recognised by its code object and its closure's names; the base-argument
count it splits at must be the 13 above) the wrapper is skipped as described; any other `launch` is called as
__call__ would call it. Anything else (another launcher class, the interpreter): None, and the launch list calls
`run` as before.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

# gridX, gridY, gridZ, stream, function, cooperative grid, PDL, global scratch, profile scratch, packed metadata,
# launch metadata, enter hook, exit hook: what precedes the kernel arguments in a C launch
BASE_ARGS = 13
_WRAPPER_CELLS = {"launcher", "tensordesc_indices", "tensordesc_meta"}


class CLaunch:
    """A kernel's C launch: c(gridX, gridY, gridZ, stream, function, coop, pdl, None, None, packed, None, None, None,
    *expanded kernel args), where each descriptor argument at position p of the kernel's arguments is replaced by the
    list expand(descriptor, descs[p])."""
    __slots__ = ("c", "coop", "pdl", "descs", "expand")

    def __init__(self, c: Callable, coop: bool, pdl: bool, descs: Dict[int, Any], expand: Optional[Callable]):
        self.c, self.coop, self.pdl, self.descs, self.expand = c, coop, pdl, descs, expand


def _nvidia_driver():
    try:
        from triton.backends.nvidia import driver as nv
        return nv if hasattr(nv, "CudaLauncher") and hasattr(nv, "wrap_handle_tensordesc") else None
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this Triton
        return None


def _wrapper_codes(nv) -> tuple:
    """The code objects defined inside wrap_handle_tensordesc (its inner function among them)."""
    code = getattr(nv.wrap_handle_tensordesc, "__code__", None)
    return tuple(c for c in (code.co_consts if code is not None else ()) if hasattr(c, "co_freevars"))


def c_launch_of(run) -> Optional[CLaunch]:
    """The CLaunch under `run` (a CompiledKernel's launcher), or None where its structure is not the one described in
    the module doc (the caller then calls `run`)."""
    nv = _nvidia_driver()
    if nv is None:
        return None
    try:
        if not isinstance(run, nv.CudaLauncher) or type(run).__call__ is not nv.CudaLauncher.__call__:
            return None
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        coop, pdl, launch = bool(run.launch_cooperative_grid), bool(run.launch_pdl), run.launch
        code = getattr(launch, "__code__", None)
        if code is None or not any(code is c for c in _wrapper_codes(nv)):
            # not the descriptor wrapper: called with exactly what CudaLauncher.__call__ passes it
            return CLaunch(launch, coop, pdl, {}, None)
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
        if set(cells) != _WRAPPER_CELLS or launch.__globals__.get("_BASE_ARGS_FORMAT_LEN") != BASE_ARGS:
            return None
        expand = launch.__globals__.get("make_tensordesc_arg")
        positions = sorted(cells["tensordesc_indices"])
        meta = cells["tensordesc_meta"] or [None] * len(positions)
        if not callable(expand) or len(meta) != len(positions):
            return None
        return CLaunch(cells["launcher"], coop, pdl, dict(zip(positions, meta)), expand)
    except Exception:  # noqa: BLE001 - any other structure: run
        return None
