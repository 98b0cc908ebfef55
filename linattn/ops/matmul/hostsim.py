"""The matmul host path on a CPU, up to the launch: a stand-in Triton driver that says "sm_90, 132 SMs" and
records each launch instead of making it, so the whole Python path (backend choice, plan, descriptors, the
JIT's binding and cache lookup, the launcher call) runs and can be timed and profiled without a GPU.

    python -m linattn.ops.matmul.hostsim [--calls 2000] [--profile] [--check]

Kernels are really compiled (for sm_90a, as `linattn inspect` does) on the first call of each signature.
What this does not include: the C launcher (cuLaunchKernelEx) and, for Gluon, its cuTensorMapEncodeTiled per
descriptor; benchmarks/gpu/matmul_gate.py section `host` measures those on the H200. Tests use it to check that
the compiled-handle launch passes the launcher exactly what the JIT passes.
"""
from __future__ import annotations

import contextlib
import time
from typing import List

import torch

H200_SMS = 132


class _Launcher:
    def __init__(self, sink: List, src, metadata):
        self.sink, self.name = sink, metadata.name

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        # args: packed metadata, launch metadata, enter hook, exit hook, then every kernel argument
        self.sink.append((self.name, (gridX, gridY, gridZ), args[4:]))


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": H200_SMS, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 3201000, "mem_bus_width": 6144}

    def load_binary(self, name, kernel, shared, device):
        return None, 1, 128, 0, 1024          # module, function, n_regs, n_spills, n_max_threads


class FakeCudaDriver:
    """Enough of triton's CudaDriver for JITFunction.run and CompiledKernel launches to complete."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)
        self.utils = _Utils()
        self.launches: List = []
        self.launcher_cls = lambda src, metadata: _Launcher(self.launches, src, metadata)

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


def _normalise(x):
    """A launch argument as comparable data: tensors by pointer/shape/strides, descriptors by their fields."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype))
    if hasattr(x, "block_shape") and hasattr(x, "base"):
        return ("desc", _normalise(x.base), list(x.shape), list(x.strides), list(x.block_shape), repr(x.layout),
                getattr(x, "padding", None))
    return x


def check_launch_paths(calls: int = 300) -> dict:
    """For each launcher, the launches recorded with the plan cache off, on, and on with the handle launch:
    the kernel, grid and every argument must be identical. Also the per-call host time of each (us)."""
    from linattn.ops.matmul.gluon.matmul import CONFIGS, matmul_gluon
    from linattn.ops.matmul.launch import host_path_options
    from linattn.ops.matmul.triton.matmul import matmul_triton
    M, N, K = 200, 136, 4104                     # ragged; K long enough that split-K slices differ
    a = torch.randn(M, K, dtype=torch.bfloat16)
    bt = torch.randn(N, K, dtype=torch.bfloat16).T        # a transposed B: B_T / strided Triton operand
    out = torch.empty(M, N, dtype=torch.bfloat16)
    cases = {"triton": lambda: matmul_triton(a, bt, out=out),
             "gluon": lambda: matmul_gluon(a, bt, out=out, config=CONFIGS["128x128x64_s5_w8"]),
             "gluon_e2": lambda: matmul_gluon(a, bt, out=out,
                                              config=CONFIGS["128x256x64_s4_w8_e2"]),
             "gluon_auto": lambda: matmul_gluon(a, bt, out=out)}     # the heuristic picks split-K 4 here
    res = {}
    with fake_hopper() as drv:
        for name, fn in cases.items():
            rec = {}
            for variant, (plan_cache, handle) in {"jit": (False, False), "plan": (True, False),
                                                  "plan+handle": (True, True)}.items():
                with host_path_options(plan_cache=plan_cache, handle=handle):
                    fn()                                   # compiles / fills the plan and the handle
                    del drv.launches[:]
                    with _count_jit_runs() as jit_runs:
                        fn()
                    launches = [(k, g, [_normalise(x) for x in args]) for k, g, args in drv.launches]
                    # workspaces are fresh allocations: compare everything but their pointers
                    rec[variant] = dict(launches=_strip_workspace(launches), jit_runs=jit_runs[0],
                                        us=per_call_us(fn, calls))
            ref = rec["jit"]["launches"]
            res[name] = dict(same=all(r["launches"] == ref for r in rec.values()), n_launches=len(ref),
                             kernels=[k for k, _, _ in ref], jit_runs={v: r["jit_runs"] for v, r in rec.items()},
                             us={v: round(r["us"], 1) for v, r in rec.items()})
    return res


@contextlib.contextmanager
def _count_jit_runs():
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


def _strip_workspace(launches):
    out = []
    for k, g, args in launches:
        out.append((k, g, [("fp32 tensor",) + x[2:] if isinstance(x, tuple) and x[:1] == ("tensor",)
                           and x[-1] == "torch.float32" else _strip_desc(x) for x in args]))
    return out


def _strip_desc(x):
    if isinstance(x, tuple) and x[:1] == ("desc",) and x[1][-1] == "torch.float32":
        return ("desc", "fp32 workspace") + x[2:]
    return x


def main(argv=None) -> int:
    import argparse
    import cProfile
    import io
    import pstats
    from linattn.ops.matmul.launch import host_path_options
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--shape", default="2000x3000x1000")
    ap.add_argument("--profile", action="store_true", help="cProfile top 15 by cumulative time per variant")
    ap.add_argument("--check", action="store_true", help="print check_launch_paths() as JSON and exit")
    args = ap.parse_args(argv)
    if args.check:
        import json
        print(json.dumps(check_launch_paths()))
        return 0
    M, N, K = map(int, args.shape.split("x"))
    a = torch.randn(M, K, dtype=torch.bfloat16)
    b = torch.randn(K, N, dtype=torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    from linattn.ops.matmul.gluon.matmul import matmul_gluon
    from linattn.ops.matmul.triton.matmul import matmul_triton
    with fake_hopper() as drv:
        for name, fn in (("triton", lambda: matmul_triton(a, b, out=out)),
                         ("gluon", lambda: matmul_gluon(a, b, out=out))):
            for plan_cache, handle in ((False, False), (True, False), (True, True)):
                with host_path_options(plan_cache=plan_cache, handle=handle):
                    us = per_call_us(fn, args.calls)
                    print(f"{name:7s} plan_cache={plan_cache!s:5s} handle={handle!s:5s} {us:8.1f} us/call "
                          f"(Python host path to the launcher, {args.shape})")
                    if args.profile:
                        pr = cProfile.Profile()
                        pr.enable()
                        for _ in range(200):
                            fn()
                        pr.disable()
                        s = io.StringIO()
                        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(15)
                        print(s.getvalue())
        print(f"{len(drv.launches)} launches recorded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
