"""What every gate section shares: the run mode (a dry run is tiny sizes on the CPU under TRITON_INTERPRET=1, set by
gate.py before any section runs), the device, and device-side relative errors with the gate's tolerance rule."""
from __future__ import annotations

import math

import torch

DRY = False
DEV = "cuda"
GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def configure(dry: bool) -> None:
    """Dry run: tiny sizes on the CPU; otherwise real sizes on the GPU."""
    global DRY, DEV
    DRY, DEV = bool(dry), ("cpu" if dry else "cuda")


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def free():
    import gc
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def captured(step, warmups: int = 2):
    """(graph, its static outputs): `warmups` eager calls of step on a side stream (every kernel compiled outside the
    capture, as torch's graph docs require), then a CUDA graph of one call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


def rel(out, ref) -> float:
    """linattn.testing.rel_rms computed on the tensors' device (no multi-GB host copies at T = 65536)."""
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {tuple(out.shape)} vs {tuple(ref.shape)}")
    o, r = out.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    den, num = float(r.norm()), float((o - r).norm())
    return num / den if den else num


def f64(x: dict) -> dict:
    """fp64 copies of a dict's floating-point tensors (other values as they are)."""
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}


def errors(got: dict, ref: dict, qkv_dtype) -> tuple:
    """({name: relative RMS error or "missing"}, all within tolerance): the tolerance of q/k/v's dtype
    (linattn.testing.TOL), or of a 16-bit output's own dtype when that is looser (a gradient is rounded to its
    input's dtype)."""
    from linattn.testing import TOL
    errs, ok = {}, True
    for n, r in ref.items():
        g = got.get(n)
        if g is None:
            errs[n], ok = "missing", False
            continue
        tol = TOL[qkv_dtype]
        if g.dtype in (torch.bfloat16, torch.float16):
            tol = max(tol, TOL[g.dtype])
        errs[n] = rel(g, r)
        ok = ok and errs[n] <= tol
    return errs, ok
