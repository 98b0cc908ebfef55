"""The host path of the public Triton GDN forward (and backward) on a CPU, up to the launches: the stand-in sm_90
driver of linattn/runtime/hostsim.py records each Triton launch instead of making it, so
`chunk_gated_delta_rule(..., backend="triton")` runs its whole Python path (checks, backend choice, the torch
custom op, chunk plan, launch configs, allocations, the JIT's binding and cache lookup, the launcher call) on CPU
tensors, to be timed, profiled and counted without a GPU.

    python -m linattn.ops.gated_delta_rule.triton.hostsim [--calls 300] [--shape 1,8192] [--backward]
                                                           [--no-plan-cache] [--profile] [--json]

Prints per call: host us (best of 3 means), torch ops (aten ops the Python path dispatches, the custom op's
inside included; `device` = those that launch a device kernel on a GPU: not views, not allocations) and Triton
launches. What is simulated, inside this module only (the library is not changed):
  - the Triton backend's "CPU tensors need TRITON_INTERPRET=1" check is lifted, and the launchers' device facts
    say H200 (132 SMs), so they pick the configs and grids they pick on the GPU;
  - with `pool` (default), linattn.runtime.alloc.empty reuses freed buffers of the same shape and dtype, as the
    CUDA caching allocator does: a fresh 128 MB CPU tensor costs an mmap (~25 us), a cached CUDA block ~1-2 us;
  - kernels are compiled for sm_90a on the first call of each signature (as `linattn inspect` does).
Not included: the C launcher (cuLaunchKernelEx), CUDA's per-op launch cost of the torch ops (a CPU op here costs
~2-5 us of host time; a CUDA one ~5-10 us on the H200's host), the stream and capture queries the plan cache makes
on a GPU. Counting (count_torch_ops) also works under TRITON_INTERPRET=1 with the launches stubbed out
(stub_interpreted_launches): tests/test_host_path_fwd.py uses that to pin the forward's op count.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# modules that import device_facts by name (the launchers ask them for SMs and the device kind)
_FACTS_USERS = ("forward", "backward")
_PLAN_USERS = ("forward", "backward")
_NO_KERNEL = {"empty.memory_format", "empty_strided.default", "empty.default"}
# aten ops that read device data on the host (a synchronisation on a GPU): a scalar read, or an output shape that
# depends on values
_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "unique", "_unique",
             "_unique2", "unique_dim", "unique_consecutive", "equal", "repeat_interleave"}
# Tensor methods that copy to the host: on CPU tensors they dispatch nothing, so they are counted by name
_SYNC_METHODS = ("tolist", "cpu", "numpy")


def _triton_module(name):
    import importlib
    return importlib.import_module(f"linattn.ops.gated_delta_rule.triton.{name}")


@contextlib.contextmanager
def _patched(patches):
    """patches: [(object, attribute, value)]; restored on exit."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, value in patches:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


@contextlib.contextmanager
def simulated_h200(pool: bool = True, plan_cache: bool = True):
    """Within: Triton launches are recorded by a stand-in sm_90 driver (yielded; .launches), the launchers see an
    H200, the public op accepts CPU tensors for backend="triton", and (pool) allocations are reused as by the CUDA
    caching allocator. plan_cache=False: the launchers build every fixed-length chunk plan afresh (the path before
    the plan cache). Not under TRITON_INTERPRET=1 (the kernels would be interpreted functions): run a child."""
    from linattn.ops.gated_delta_rule import api
    from linattn.ops.gated_delta_rule.triton import chunk_indices
    from linattn.runtime.device import DeviceFacts
    from linattn.runtime.hostsim import H200_SMS, fake_hopper
    facts = DeviceFacts("cuda", "NVIDIA H200 (simulated)", (9, 0), H200_SMS, 232448, 0)
    patches = [(_triton_module(m), "device_facts", lambda device=None: facts) for m in _FACTS_USERS]
    patches.append((api._backends.backends["triton"], "supports", lambda **_: (True, "")))
    if not plan_cache:
        patches += [(_triton_module(m), "make_chunk_plan", chunk_indices.build_chunk_plan) for m in _PLAN_USERS]
    with fake_hopper() as drv, _patched(patches), (pooled_allocations() if pool else contextlib.nullcontext()):
        drv.launches = _LaunchNames()
        yield drv


class _LaunchNames(list):
    """The stand-in driver's launch record without the arguments: (kernel, grid, ()). Keeping the arguments of
    every timed call would keep every buffer alive (and defeat the allocation pool)."""

    def append(self, launch):
        super().append((launch[0], launch[1], ()))


@contextlib.contextmanager
def pooled_allocations():
    """linattn.runtime.alloc.empty, in every linattn module that imported it, reuses a buffer of the same shape and
    dtype once nothing else references it (a stand-in for the CUDA caching allocator's block reuse; the data are
    never read here: launches are recorded, not made)."""
    from linattn.runtime import alloc
    orig = alloc.empty
    free: Dict[tuple, List[torch.Tensor]] = {}

    def empty(*shape, dtype, device):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        key = (shape, dtype, str(device))
        bufs = free.setdefault(key, [])
        for t in bufs:
            if sys.getrefcount(t) <= 3:          # the list, the loop variable, getrefcount's argument
                return t
        t = orig(*shape, dtype=dtype, device=device)
        bufs.append(t)
        return t
    users = [m for name, m in list(sys.modules.items())
             if name.startswith("linattn.") and m is not None and getattr(m, "empty", None) is orig]
    with _patched([(m, "empty", empty) for m in users]):
        yield


class TorchOpCounter(TorchDispatchMode):
    """Records every op dispatched while active: (name, launches a device kernel). A linattn custom op is recorded
    and then its Python implementation runs under the counter, so the ops inside it are counted too (a plain
    re-dispatch would run them with the mode popped). No kernel: allocations, and ops whose result aliases an
    input without writing it (views, a .to() that returns its input). Host syncs: the ops of _SYNC_OPS and the
    calls of Tensor.tolist / .cpu / .numpy (whatever the tensor's device: on a GPU each would synchronise)."""

    def __init__(self):
        super().__init__()
        self.ops: List[tuple] = []
        self.syncs: List[str] = []
        self._saved = []

    def __enter__(self):
        for name in _SYNC_METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved.append((name, torch.Tensor.__dict__.get(name)))
            setattr(torch.Tensor, name, self._recording(name, orig))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, orig in reversed(self._saved):
                if orig is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, orig)
            self._saved.clear()

    def _recording(self, name, orig):
        def method(t, *args, **kwargs):
            self.syncs.append(f"Tensor.{name}")
            return orig(t, *args, **kwargs)
        return method

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if func.namespace == "linattn":
            self.ops.append((name, False))
            from torch._library.custom_ops import OPDEFS
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        self.ops.append((name, name.split(".", 1)[1] not in _NO_KERNEL and not _aliases_input(func, args, out)))
        if func.namespace == "aten" and name.split(".")[1] in _SYNC_OPS:
            self.syncs.append(name)
        return out

    def summary(self) -> dict:
        aten = [o for o in self.ops if o[0].startswith("aten.")]
        device = [name for name, kernel in aten if kernel]
        return dict(total=len(self.ops), aten=len(aten), device=len(device), device_ops=device,
                    custom=[name for name, _ in self.ops if name.startswith("linattn.")], syncs=list(self.syncs))


def _aliases_input(func, args, out) -> bool:
    if func._schema.is_mutable or not isinstance(out, torch.Tensor):
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


def count_torch_ops(fn: Callable[[], object]) -> dict:
    """TorchOpCounter.summary() of one call of fn."""
    with TorchOpCounter() as c:
        fn()
    return c.summary()


@contextlib.contextmanager
def stub_interpreted_launches():
    """Under TRITON_INTERPRET=1: every Triton launch is recorded (kernel names, yielded list) and not run, so a
    count of torch ops sees only the host path's own ops, not the interpreter's copies."""
    from triton.runtime.interpreter import InterpretedFunction
    names: List[str] = []

    def run(self, *args, **kwargs):
        names.append(self.fn.__name__)
    with _patched([(InterpretedFunction, "run", run)]):
        yield names


def public_call(B: int, T: int, H: int = 16, HV: int = 32, K: int = 128, V: int = 128, dtype=torch.bfloat16,
                backward: bool = False, device: str = "cpu"):
    """A zero-argument function making the measured call: the public op with an initial state and the final
    state at the given shape (and, with backward, a backward of o and the final state through autograd)."""
    import linattn
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=device)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    ins = [x[n].detach().requires_grad_(backward) for n in names]
    if backward:
        do = torch.randn(B, T, HV, V, dtype=dtype, device=device)
        dht = torch.randn_like(x["initial_state"], dtype=torch.float32)

    def call():
        o, ht = linattn.chunk_gated_delta_rule(*ins[:5], initial_state=ins[5], output_final_state=True,
                                               backend="triton")
        if backward:
            torch.autograd.backward((o, ht), (do, dht))
            for t in ins:
                t.grad = None
        return o, ht
    return call


def measure(B: int, T: int, calls: int, backward: bool = False, pool: bool = True, plan_cache: bool = True,
            profile: bool = False) -> dict:
    """us per call (best of 3 means), ops and launches per call of public_call(B, T) under simulated_h200."""
    from linattn.runtime.hostsim import per_call_us
    # with a backward, no pool: its references would make autograd's AccumulateGrad copy every gradient
    pool = pool and not backward
    fn = public_call(B, T, backward=backward)
    with simulated_h200(pool=False, plan_cache=plan_cache) as drv:
        fn()                                        # compiles, fills the caches
        del drv.launches[:]
        ops = count_torch_ops(fn)                   # unpooled: the allocations are counted as ops too
        launches = [name for name, _, _ in drv.launches]
    with simulated_h200(pool=pool, plan_cache=plan_cache) as drv:
        us = min(per_call_us(fn, calls) for _ in range(3))
        del drv.launches[:]
        stats = None
        if profile:
            import cProfile
            import io
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            del drv.launches[:]
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
            stats = out.getvalue()
    return dict(us=round(us, 1), ops=ops, launches=launches, profile=stats)


def main(argv=None) -> int:
    import argparse
    import json
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--shape", default="1,8192", help="B,T (H=16, HV=32, K=V=128, bf16)")
    ap.add_argument("--backward", action="store_true", help="forward + backward through autograd")
    ap.add_argument("--no-plan-cache", action="store_true", help="build every chunk plan afresh")
    ap.add_argument("--no-pool", action="store_true",
                    help="fresh CPU allocations (mmap for big buffers); always so with --backward")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top 30 by own time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("run without TRITON_INTERPRET=1 (the stand-in driver compiles and records real launches)")
    B, T = (int(s) for s in args.shape.split(","))
    r = measure(B, T, args.calls, args.backward, pool=not args.no_pool, plan_cache=not args.no_plan_cache,
                profile=args.profile)
    if args.json:
        print(json.dumps({k: v for k, v in r.items() if k != "profile"}))
        return 0
    what = "fwd+bwd" if args.backward else "fwd"
    o = r["ops"]
    print(f"B{B} T{T} {what}: {r['us']:.1f} us/call, torch ops {o['aten']} (device kernels "
          f"{o['device']}), Triton launches {len(r['launches'])}: {', '.join(r['launches'])}")
    if o["device_ops"]:
        print("  device ops: " + ", ".join(o["device_ops"]))
    if r["profile"]:
        print(r["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
