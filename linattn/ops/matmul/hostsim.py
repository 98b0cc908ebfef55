"""The matmul host path on a CPU, up to the launch: a stand-in Triton driver that says "sm_90, 132 SMs" and
records each launch instead of making it, so the whole Python path (backend choice, plan, descriptors, the
JIT's binding and cache lookup, the launcher call) runs and can be timed and profiled without a GPU.

    python -m linattn.ops.matmul.hostsim [--calls 2000] [--profile] [--check]

Kernels are really compiled (for sm_90a, as `linattn inspect` does) on the first call of each signature.
What this does not include: the C launcher (cuLaunchKernelEx) and, for Gluon, its cuTensorMapEncodeTiled per
descriptor, which only a run on a GPU measures. Tests use it to check that
the compiled-handle launch passes the launcher exactly what the JIT passes. The stand-in driver and the timing
helpers are generic: linattn/runtime/hostsim.py.
"""
from __future__ import annotations

import torch

from linattn.runtime.hostsim import (H200_SMS, FakeCudaDriver, fake_hopper, per_call_us,  # noqa: F401
                                     count_jit_runs as _count_jit_runs, normalise as _normalise)


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
