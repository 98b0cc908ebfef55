"""A Triton host path on a CPU, up to the launch: a stand-in Triton driver that says "sm_90, 132 SMs" and records
each launch instead of making it, so the whole Python path of a launcher (plan, descriptors, the JIT's binding
and cache lookup, the launcher call) runs and can be timed and profiled without a GPU. Kernels are really
compiled (for sm_90a, as `linattn inspect` does) on the first call of each signature.

Used by linattn/ops/matmul/hostsim.py and linattn/ops/gated_delta_rule/gluon/hostsim.py. What this does not
include: the C launcher (cuLaunchKernelEx) and, for Gluon, its cuTensorMapEncodeTiled per descriptor. Not for
use under TRITON_INTERPRET=1 (Triton kernels are then interpreted functions): run it in a child process.
"""
from __future__ import annotations

import contextlib
import time
from typing import List

import torch

H200_SMS = 132


class _Launcher:
    """Records each launch in the launches list of the driver active at launch time (a CompiledKernel keeps its
    launcher for life, across fake_hopper() contexts)."""

    def __init__(self, src, metadata):
        self.name = metadata.name

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        # args: packed metadata, launch metadata, enter hook, exit hook, then every kernel argument
        from triton.runtime.driver import driver
        driver.active.launches.append((self.name, (gridX, gridY, gridZ), args[4:]))


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": H200_SMS, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 3201000, "mem_bus_width": 6144}

    def load_binary(self, name, kernel, shared, device):
        # module, function, n_regs, n_spills, n_max_threads. A module that is not None: a CompiledKernel then
        # loads once, as on the GPU, instead of re-creating its launcher on every launch
        return "fake module", 1, 128, 0, 1024


class FakeCudaDriver:
    """Enough of triton's CudaDriver for JITFunction.run and CompiledKernel launches to complete."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)
        self.utils = _Utils()
        self.launches: List = []
        self.launcher_cls = _Launcher

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


@contextlib.contextmanager
def fake_hopper():
    """Within: Triton's active driver is a FakeCudaDriver and linattn's device facts say H200. Yields the driver
    (its .launches lists every launch). Not for use under TRITON_INTERPRET=1 (Triton kernels are interpreted)."""
    from triton.runtime.driver import driver
    import linattn.runtime.device as device_mod
    from linattn.runtime.device import DeviceFacts
    fake = FakeCudaDriver()
    facts = DeviceFacts("cuda", "NVIDIA H200 (simulated)", (9, 0), H200_SMS, 232448, 0)
    saved_active, saved_facts = driver._active, device_mod.device_facts
    driver.set_active(fake)
    device_mod.device_facts = lambda device=None: facts
    try:
        yield fake
    finally:
        driver._active = saved_active
        device_mod.device_facts = saved_facts


def per_call_us(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def normalise(x):
    """A launch argument as comparable data: tensors by pointer/shape/strides, descriptors by their fields."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype))
    if hasattr(x, "block_shape") and hasattr(x, "base"):
        return ("desc", normalise(x.base), list(x.shape), list(x.strides), list(x.block_shape), repr(x.layout),
                getattr(x, "padding", None))
    return x


@contextlib.contextmanager
def count_jit_runs():
    """Within: count[0] is the number of JITFunction.run calls (launches through the JIT's dispatch)."""
    from triton.runtime.jit import JITFunction
    count, orig = [0], JITFunction.run

    def run(self, *args, **kwargs):
        count[0] += 1
        return orig(self, *args, **kwargs)
    JITFunction.run = run
    try:
        yield count
    finally:
        JITFunction.run = orig
