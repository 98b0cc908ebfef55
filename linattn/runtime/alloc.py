"""Buffer allocation for kernel launchers, with a NaN-poisoning switch for tests and gates.

Launchers allocate every output and intermediate through `empty` (or `zeros`), which also report each buffer to a
launch-list recorder when one is active (runtime/launch_list.py). Inside `poisoned_allocations()`, floating
buffers start as NaN instead of whatever memory held, so an element that a kernel fails to write shows up as
NaN in the checked results instead of passing silently with stale data.
"""
import contextlib
import threading

import torch

from linattn.runtime import launch_list

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
    launch_list.note_alloc(t)
    return t


def zeros(*shape, dtype, device) -> torch.Tensor:
    """A zero-filled buffer (reported to a launch-list recorder as one, runtime/launch_list.py)."""
    t = torch.zeros(*shape, dtype=dtype, device=device)
    launch_list.note_alloc(t, zero=True)
    return t


@contextlib.contextmanager
def poisoned_allocations():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
