"""Timing (shared/.library METHOD: events or graph replays, warm-up first, median of repeats, rotated inputs),
the two roofline ceilings, and cold start in a fresh process. `linattn.bench.child` calls these inside the fresh
process that times one backend.

Two columns per row: eager (each repeat one pass of eager calls between two CUDA events) and, where the backend
can be captured, CUDA graph (each repeat one replay of the captured pass). Nothing inside a timed region
synchronises with the host; the events are read after one synchronisation at the end. On the CPU the host clock
is the only clock (work there is synchronous) and there is no graph column.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Sequence

import torch


def step(fn: Callable, kw: Dict, leaves: Sequence, gouts: Sequence):
    """One call; with leaves, also the backward (autograd.grad: fresh gradient tensors, no accumulation
    into .grad between repeats). Returns (outputs tuple, grads tuple)."""
    outs = fn(**kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not leaves:
        return outs, ()
    pairs = [(o, g) for o, g in zip(outs, gouts) if o is not None and o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], list(leaves), [g for _, g in pairs], allow_unused=True)
    return outs, grads


def l2_bytes(device) -> int:
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20))
    return 0


def num_input_sets(set_bytes: float, device, max_sets: int = 8) -> int:
    """How many input sets to cycle through so that a repeat never finds its inputs in the L2: together they
    span at least 3x the L2 (the H200's is 60 MB), and never fewer than two on a GPU. One on the CPU, where
    the interpreter's time is nowhere near cache effects."""
    l2 = l2_bytes(device)
    if l2 == 0:
        return 1
    return int(min(max_sets, max(2, math.ceil(3 * l2 / max(set_bytes, 1.0)))))


def _summary(times: List[float], method: str, n_sets: int) -> Dict:
    return dict(status="ok", median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                repeats=len(times), times_ms=times, timing=method, input_sets=n_sets)


def event_times_ms(run: Callable, repeats: int) -> List[float]:
    """ms of each of `repeats` calls of run(), by a CUDA event pair around each call (one synchronisation at the
    end), in call order."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _pass(fn: Callable, arg_sets: List) -> Callable:
    def one_pass():
        for kw, leaves, gouts in arg_sets:
            step(fn, kw, leaves, gouts)
    return one_pass


def time_eager(fn: Callable, arg_sets: List, repeats: int, warmup: int, device) -> Dict:
    """What a user's eager loop costs: median / min / max ms per call. `arg_sets`: [(kwargs, leaves, grad
    outputs)], made once, cycled through; each repeat runs every set once and is divided by their number. On a
    GPU an event pair brackets each repeat and the repeats follow each other without a host synchronisation, so
    a host-bound call is timed by its host time and a GPU-bound one by its kernels, as in a training loop."""
    n, one_pass = len(arg_sets), _pass(fn, arg_sets)
    for _ in range(warmup):
        one_pass()
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            one_pass()
            times.append((time.perf_counter() - t0) * 1e3 / n)
        return _summary(times, "eager, host clock (cpu)", n)
    torch.cuda.synchronize()
    return _summary([t / n for t in event_times_ms(one_pass, repeats)], "eager, cuda events", n)


def time_graph(fn: Callable, arg_sets: List, repeats: int, device) -> Dict:
    """The same pass over the sets captured once as a CUDA graph, then replayed (`repeats` replays, events
    around each). Call after time_eager (its warm-up compiled and tuned everything). A backend that cannot be
    captured (host synchronisation, CPU tensors, unsupported calls) gives status "n/a" and the reason."""
    if torch.device(device).type != "cuda":
        return dict(status="n/a", reason="no CUDA device")
    n, one_pass = len(arg_sets), _pass(fn, arg_sets)
    try:
        # warm the side stream first, as torch's graph docs require, then capture one pass over all sets
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            one_pass()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_pass()
    except Exception as e:
        try:
            torch.cuda.synchronize()
        except Exception:                           # a capture that failed on the device leaves its error here
            pass
        first = str(e).splitlines()[0][:160] if str(e) else ""
        return dict(status="n/a", reason=f"capture failed: {type(e).__name__}: {first}")
    graph.replay()                                  # one untimed replay: the graph's first launch uploads it
    times = [t / n for t in event_times_ms(graph.replay, repeats)]
    del graph
    return _summary(times, "cuda graph replay", n)


def measure_ceilings(device) -> Dict:
    """The matrix rate and the copy bandwidth of this device, measured now. GPU: a bf16 8192^3 torch.matmul
    and a 1 GiB device-to-device copy (bytes read + written). CPU: tiny stand-ins (fp32 256^3, 16 MiB copy)
    that only keep the columns filled; they say nothing about a GPU."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    if dev.type == "cuda":
        n, dt, copy_elems, reps, how = 8192, torch.bfloat16, 1 << 28, 10, "bf16 8192^3 torch.matmul; 1 GiB fp32 copy"
    else:
        n, dt, copy_elems, reps, how = 256, torch.float32, 1 << 22, 5, "CPU stand-ins: fp32 256^3 matmul; 16 MiB copy"
    a = torch.randn(n, n, device=dev, generator=gen).to(dt)
    b = torch.randn(n, n, device=dev, generator=gen).to(dt)
    src = torch.randn(copy_elems, device=dev, generator=gen)
    dst = torch.empty_like(src)
    mm = time_eager(lambda: torch.matmul(a, b), [({}, (), ())], reps, 3, dev)
    cp = time_eager(lambda: dst.copy_(src), [({}, (), ())], reps, 3, dev)
    flops = 2.0 * n ** 3
    nbytes = 2.0 * src.numel() * src.element_size()
    return dict(matmul_tflops=flops / (mm["median_ms"] * 1e-3) / 1e12, copy_gbps=nbytes / (cp["median_ms"] * 1e-3) / 1e9,
                matmul_ms=mm["median_ms"], copy_ms=cp["median_ms"], how=how)


def floor_ms(flops: float, nbytes: float, ceilings: Dict) -> Dict:
    t_math = flops / (ceilings["matmul_tflops"] * 1e12) * 1e3
    t_mem = nbytes / (ceilings["copy_gbps"] * 1e9) * 1e3
    return dict(floor_ms=max(t_math, t_mem), math_ms=t_math, memory_ms=t_mem,
                bound="math" if t_math >= t_mem else "memory")


# ------------------------------------------------------------------------------------------------- cold start

CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TILELANG_CACHE_DIR")


def linattn_tree() -> str:
    """The folder this process imported linattn from (the one that holds the package)."""
    import linattn
    return os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))


def child_env(env: Dict[str, str] = None) -> Dict[str, str]:
    """env (default this process's) with linattn_tree() first on PYTHONPATH, for a child that must time the code
    this process imported. The children also run in that folder: `python -m` puts the working directory ahead of
    PYTHONPATH, so a child started in another checkout would import that checkout's linattn."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([linattn_tree()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                             if p])
    return env


def cold_start(op: str, backend: str, mode: str, shape: Dict, device: str, timeout_s: float = 900,
               keep_caches: bool = True) -> Dict:
    """The first call of `backend` in a fresh process with the same python: import, compile and any
    autotuning included. The JIT caches we know of (Triton, Inductor, TileLang) point at new empty folders, so
    an earlier run on this machine does not make the start look warm. With keep_caches, what the child compiled
    (and FLA's cached autotuning results) is then copied into this process's own cache folders, where the
    caller names them in the same variables: the bench that follows reuses it instead of compiling twice."""
    spec = json.dumps(dict(op=op, backend=backend, mode=mode, shape=shape, device=device))
    with tempfile.TemporaryDirectory(prefix="linattn-cold-") as tmp:
        env = child_env()
        for var in CACHE_VARS:
            env[var] = os.path.join(tmp, var.lower())
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-m", "linattn.bench.cold", spec], env=env, cwd=linattn_tree(),
                               capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return dict(backend=backend, mode=mode, status="error", reason=f"timed out after {timeout_s:.0f} s")
        wall = time.perf_counter() - t0
        kept = _keep_caches(tmp) if keep_caches and p.returncode == 0 else []
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not last:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return dict(backend=backend, mode=mode, status="error", reason=f"rc={p.returncode}: {tail[0][:300]}")
    out = json.loads(last[-1])
    out.update(process_s=wall, isolated_caches=list(CACHE_VARS), caches_kept_for_bench=kept)
    return out


def _keep_caches(tmp: str) -> List[str]:
    """Copy a cold child's cache folders into this process's own (the variables of CACHE_VARS, where set).
    The caches are content-addressed, so merging folders is safe. Returns the variables copied."""
    import shutil
    kept = []
    for var in CACHE_VARS:
        src, dst = os.path.join(tmp, var.lower()), os.environ.get(var)
        if dst and os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)
            kept.append(var)
    return kept
