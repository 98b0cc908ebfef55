"""Per call signature, what a repeat eager call may skip: the input checks and the backend choice (the decode ops also
keep a direct launch). A signature is everything the checks, the choice and the launchers read: per tensor argument
its type, shape, strides, dtype, device and whether it requires grad; the grad mode; the options. Values inside
device tensors are never read on a GPU (no host sync), so they are not part of it; CPU calls read them and are never
remembered. Shared by the chunked ops (GDN, KDA) and the decode ops."""
from typing import Optional

import torch

from linattn.runtime.settings import settings

_TENSOR = torch.Tensor
# LINATTN_CHECK_INPUTS, read at import as the ops' validation reads it: with it set, every call's values are checked
_CHECK_GPU_VALUES = settings.check_inputs


def memo_applies(q) -> bool:
    """Plain eager calls on CUDA tensors, unless LINATTN_CHECK_INPUTS=1 asks for the values of every call checked."""
    return type(q) is torch.Tensor and q.is_cuda and not _CHECK_GPU_VALUES and not torch.compiler.is_compiling()


def call_key(backend, tensors: tuple, scale, pad_slot_id, flags: tuple) -> Optional[tuple]:
    """The signature: per tensor argument its shape, strides, dtype, device, type and whether it requires grad; the
    grad mode; scale and pad_slot_id by value; the options as the caller normalises them (flags, hashable); the
    backend asked for and the process default. None (checked afresh): a scale, pad_slot_id or backend of another type
    (a tensor's hash is its id, which a later tensor can reuse)."""
    if type(backend) is not str or not (scale is None or type(scale) is float or type(scale) is int) or \
            not (pad_slot_id is None or type(pad_slot_id) is int):
        return None
    # a plain tensor's entry leaves its type out (5 fields); a subclass's carries it (6), anything else is (type,)
    sigs = tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.requires_grad)
                  if type(t) is _TENSOR else (type(t), t.shape, t.stride(), t.dtype, t.get_device(), t.requires_grad)
                  if isinstance(t, _TENSOR) else (type(t),) for t in tensors])
    return (backend, settings.default_backend if backend == "auto" else None, torch.is_grad_enabled(), scale,
            pad_slot_id, flags, sigs)


def remember(cache: dict, key, value, limit: int = 4096) -> None:
    """cache[key] = value, the whole cache forgotten first once it holds `limit` entries (a bound, not an LRU)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


def keep_direct(cache: dict, key, backend, given: tuple, used: tuple, scale: float, output_final_state: bool) -> None:
    """After a chunked op's plain eager call under signature `key` (None: not remembered): keep the backend's direct
    path (Backend.direct) for its repeat calls where it has one and the call ran on the caller's own tensors (each of
    `used`, the (q, k, v, g, beta, initial_state) the backend got, is the tensor of `given` the caller passed)."""
    if key is None or backend.direct is None or not all(a is c for a, c in zip(given, used)):
        return
    q, k, v, g, beta, initial_state = used
    d = backend.direct(q, k, v, g, beta, float(scale), initial_state, output_final_state)
    if d is not None:
        remember(cache, key, d)


def run_direct(cache: dict, key, inputs: tuple):
    """The result of the direct path kept for `key` (keep_direct) on a repeat call's (q, k, v, g, beta,
    initial_state), or None: none kept, or it declined (then the caller takes the full path)."""
    direct = cache.get(key)
    return None if direct is None else direct(*inputs)
