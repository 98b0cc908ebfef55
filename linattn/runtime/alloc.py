"""Buffer allocation for kernel launchers, with a NaN-poisoning switch for tests and gates.

Launchers allocate every output and intermediate through `empty`. Inside `poisoned_allocations()`, floating
buffers start as NaN instead of whatever memory held, so an element that a kernel fails to write shows up as
NaN in the checked results instead of passing silently with stale data.
"""
import contextlib
import threading

import torch

_state = threading.local()


def _poisoning() -> bool:
    return getattr(_state, "depth", 0) > 0


def poisoning() -> bool:
    """Whether this thread is inside poisoned_allocations() (a launcher that allocates without `empty` fills its
    floating outputs with NaN then)."""
    return getattr(_state, "depth", 0) > 0


def empty(*shape, dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if _poisoning() and t.is_floating_point():
        t.fill_(float("nan"))
    return t


@contextlib.contextmanager
def poisoned_allocations():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
