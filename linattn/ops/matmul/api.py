"""matmul: argument checks, backend registration and the public function."""
from __future__ import annotations

from typing import Tuple

import torch

from linattn.backends import op_backends
from linattn.ops.matmul.reference import matmul_reference

DTYPES = (torch.bfloat16, torch.float16)


def check_inputs(a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise ValueError/TypeError with a clear message for anything matmul does not accept."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"matmul: a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"matmul: a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.dtype not in DTYPES:
        raise TypeError(f"matmul: dtype {a.dtype} not supported; use torch.bfloat16 or torch.float16")
    if b.dtype != a.dtype:
        raise TypeError(f"matmul: a is {a.dtype} but b is {b.dtype}; both must have the same dtype")
    if a.device != b.device:
        raise ValueError(f"matmul: a is on {a.device} but b is on {b.device}")


# ------------------------------------------------------------------ backends: supports(**call) -> (ok, reason)

def _triton_supports(a, b, **_) -> Tuple[bool, str]:
    from linattn.runtime.settings import settings
    if a.device.type == "cuda" or settings.interpret:
        return True, "ok"
    return False, (f"tensors on {a.device} need a CUDA GPU, or TRITON_INTERPRET=1 set before importing linattn to "
                   "run Triton on the CPU")


def _gluon_supports(a, b, **_) -> Tuple[bool, str]:
    from linattn.runtime.device import hopper_gluon_ready
    ok, reason = hopper_gluon_ready(a, "the Gluon GEMM")
    if not ok:
        return False, reason
    from linattn.ops.matmul.gluon.matmul import tma_layout
    for name, t in (("a", a), ("b", b)):
        kind, why = tma_layout(t)
        if kind is None:
            return False, f"{name}: {why}"
    if (b.shape[1] * b.element_size()) % 16:
        return False, f"N={b.shape[1]}: the output's row stride must be a multiple of 16 bytes for the TMA store"
    return True, "ok"


def _reference_supports(a, b, **_) -> Tuple[bool, str]:
    return True, "ok"


def _triton_impl(a, b):
    from linattn.ops.matmul.triton.matmul import matmul_triton
    return matmul_triton(a, b)


def _gluon_impl(a, b):
    from linattn.ops.matmul.gluon.matmul import matmul_gluon
    return matmul_gluon(a, b)


def _reference_impl(a, b):
    return matmul_reference(a, b)


_backends = op_backends("matmul")
_backends.register("gluon", _gluon_impl, _gluon_supports, priority=0)
_backends.register("triton", _triton_impl, _triton_supports, priority=10)
# by name; `auto` falls back to it for CPU tensors where Triton does not interpret (linattn/backends.py)
_backends.register("reference", _reference_impl, _reference_supports, priority=100, auto=False)


def matmul(a: torch.Tensor, b: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """C = A @ B with fp32 accumulation.

    a: [M, K], b: [K, N], both torch.bfloat16 or both torch.float16, on the same device. Either may be a
    transposed view (e.g. ``w.T`` of a contiguous [N, K] weight): kernels read strides, no copy is made.
    Returns a new contiguous [M, N] tensor in the operands' dtype.
    backend: "auto" (Gluon on sm_90 when TMA alignment allows, else Triton; on CPU tensors Triton under
    TRITON_INTERPRET=1, else the torch reference), "gluon", "triton" or "reference";
    an explicitly requested backend that cannot run the call raises linattn.backends.BackendError with the reason.
    """
    chosen = _select(backend, a, b)
    if chosen is None:                       # an empty dimension: nothing to launch; an empty sum is zero
        return torch.zeros(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)
    return chosen.impl(a, b)


# (backend, env defaults, registered backends, shapes, strides, dtypes, devices, 16-byte alignment) -> the
# Backend chosen. Every input check and supports() answer is a function of this key, so a hit skips them; the
# rejection log and `last_rejections` are written on the miss, as before. Off with the plan cache (launch.py).
_SELECTED: dict = {}


def _selection_key(backend: str, a, b):
    from linattn.runtime.settings import settings
    try:
        return (backend, settings.default_backend, settings.interpret, tuple(map(id, _backends.backends.values())),
                a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
                a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0)
    except Exception:  # noqa: BLE001 - not tensors, or tensors without storage (fake/traced): no caching
        return None


def _select(backend: str, a, b):
    from linattn.ops.matmul.launch import host_path
    key = _selection_key(backend, a, b) if host_path.plan_cache else None
    if key is not None:
        hit = _SELECTED.get(key, _MISS)
        if hit is not _MISS:
            return hit
    check_inputs(a, b)
    M, K = a.shape
    N = b.shape[1]
    chosen = None if (M == 0 or N == 0 or K == 0) else _backends.select(backend, a=a, b=b)
    if key is not None:
        if len(_SELECTED) >= 4096:
            _SELECTED.clear()
        _SELECTED[key] = chosen
    return chosen


_MISS = object()
