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


def _c_launcher_cls():
    """A launcher that is triton 3.6's CudaLauncher (its own __call__ and descriptor wrapper, so that
    runtime/c_launch.py finds the structure it looks for) over a C launch that records: each launch's kernel
    arguments as the C launch gets them, descriptors expanded by Triton's make_tensordesc_arg into
    _Utils.fill_tma_descriptor's stand-in tensor map and the shape and strides. None where this Triton has no
    CudaLauncher."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc
    except Exception:  # noqa: BLE001
        return None

    class CLauncher(CudaLauncher):
        def __init__(self, src, metadata):          # no C module built: the launch below records
            self.name = metadata.name
            self.num_ctas = getattr(metadata, "num_ctas", 1)
            self.launch = wrap_handle_tensordesc(self._record, dict(src.signature.items()),
                                                 getattr(metadata, "tensordesc_meta", None))
            self.global_scratch_size = metadata.global_scratch_size
            self.global_scratch_align = metadata.global_scratch_align
            self.profile_scratch_size = metadata.profile_scratch_size
            self.profile_scratch_align = metadata.profile_scratch_align
            self.launch_cooperative_grid = metadata.launch_cooperative_grid
            self.launch_pdl = metadata.launch_pdl

        def _record(self, gridX, gridY, gridZ, stream, function, coop, pdl, gscratch, pscratch, packed, lmeta,
                    enter, leave, *args):
            from triton.runtime.driver import driver
            driver.active.launches.append((self.name, (gridX, gridY, gridZ), args))
    return CLauncher


class TensorMap(tuple):
    """fill_tma_descriptor's stand-in result: (base pointer, swizzle, element size, element type, block, shape,
    strides, padding)."""
    __slots__ = ()


class _Utils:
    fills = 0            # fill_tma_descriptor calls (class-wide: make_tensordesc_arg reaches the active driver's)

    def fill_tma_descriptor(self, base, swizzle, elem_size, elem_type, block, shape, strides, padding):
        _Utils.fills += 1
        return TensorMap((base, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding))

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
def fake_hopper(c_launcher: bool = False):
    """Within: Triton's active driver is a FakeCudaDriver and linattn's device facts say H200. Yields the driver
    (its .launches lists every launch). Not for use under TRITON_INTERPRET=1 (Triton kernels are interpreted).
    c_launcher: kernels compiled within get Triton's own CudaLauncher structure (_c_launcher_cls), whose launches
    record the C launch's arguments (descriptors expanded); ValueError where this Triton has none."""
    from triton.runtime.driver import driver
    import linattn.runtime.device as device_mod
    from linattn.runtime.device import DeviceFacts
    fake = FakeCudaDriver()
    if c_launcher:
        fake.launcher_cls = _c_launcher_cls()
        if fake.launcher_cls is None:
            raise ValueError("c_launcher=True: this Triton has no CudaLauncher")
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
