"""Launch lists for the small public ops whose repeat calls are remembered by their own call signature
(backends.CheckedCalls): causal_conv1d's forward, causal_conv1d_update(3) and rms_norm_gated's forward.

Why: such an op makes one or two launches of a few microseconds on the GPU, while its host path builds each launch
from every argument on every call (runtime/host_path.LaunchCache: a key over each argument, the plan lookup, the
argument tuple) and costs several times the kernel in host time. A call signature fixes everything the launcher
reads but the data pointers, so a repeat call can replay the signature's recorded launches (runtime/launch_list.py)
with its own pointers: the output allocated as before, the same kernels, grids and arguments.

Which calls: plain eager calls that record no autograd graph (runtime/device.py eager_without_autograd) and are not
being captured into a CUDA graph (there the host path runs and is captured), keyed by the op's CheckedCalls key. A
call whose host path copies an input (a non-contiguous weight) or launches through the JIT (its first call, the
interpreter) gives no list; the list declines (None) where its replay would not be the recorded launches (another
device or stream, a launch hook, the host path's options off, an unaligned input) and the host path runs.

How the ops use it: the op's memo keeps its launcher's OpLists beside the impl; a memo hit first tries `replay`
(the list straight from the public function, no impl in between), and the impl's eager path goes through `__call__`
(a replay, or the host path recorded while the signature may still get a list).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from linattn.runtime.alloc import poisoning
from linattn.runtime.capture import stream_capturing
from linattn.runtime.device import eager_without_autograd
from linattn.runtime.host_path import HostPath, current_device, hooks_active
from linattn.runtime.launch_list import LaunchList, SignatureLists


def one(t) -> tuple:
    """outputs_of for a launcher returning one tensor."""
    return (t,)


def as_tuple(res) -> tuple:
    """outputs_of for a launcher returning a tuple or list of outputs (tensors or None)."""
    return tuple(res)


class OpLists:
    """Per CheckedCalls key of one op, the launch list of a recorded call (SignatureLists); see the module doc."""

    def __init__(self, host_path: HostPath):
        self.lists = SignatureLists(host_path, current_device, hooks_active, poisoning)

    def __call__(self, key: Optional[tuple], inputs: Sequence[Optional[torch.Tensor]], run: Callable[[], Any],
                 outputs_of: Callable[[Any], tuple] = one) -> tuple:
        """The outputs of run() (the op's host path on `inputs`, None where an optional tensor is absent), through
        key's list where the call may take one (see the module doc); run() otherwise. key None: not remembered."""
        if key is None or not eager_without_autograd(*inputs) or stream_capturing(inputs[0]):
            return outputs_of(run())
        return self.lists(key, inputs, run, outputs_of)

    def replay(self, key: Optional[tuple], inputs: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
        """A repeat call's outputs straight from key's list (for an op's remembered-signature path, skipping its
        impl), or None: no list kept for key, a call that may not take one, or the list declined. The caller then
        runs its usual path (which records while key may still get a list)."""
        lst = self.lists.lists.get(key)
        if type(lst) is not LaunchList or not eager_without_autograd(*inputs) or stream_capturing(inputs[0]):
            return None
        return lst(*inputs)

    def clear(self) -> None:
        self.lists.clear()
