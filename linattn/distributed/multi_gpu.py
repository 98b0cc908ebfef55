"""Context parallelism on W GPUs of one host (NCCL): the gate and the scaling of chunk_gated_delta_rule /
chunk_kda (docs/context-parallel.md).

    python3 -m linattn.distributed.multi_gpu --world 2 --out cp.json           # NCCL, one process per GPU
    TRITON_INTERPRET=1 python3 -m linattn.distributed.multi_gpu --world 2 --dry-run --out cp.json   # gloo, CPU

1. Gate: the checks of tests/test_context_parallel.py (linattn/testing/cp_cases.py) with one rank per GPU: packed
   streams with sequences crossing the boundary, inside one rank and of 1 token, an initial state and final states;
   GDN in bf16 and fp32, KDA in bf16, GDN and KDA with FLA's in-kernel gate, beta sigmoid and state_v_first.
   Every rank's output, the final states (returned on every rank) and every gradient (initial state, A_log and
   dt_bias summed over ranks) against the fp64 reference at the dtype's tolerance and against the one-process call
   on one GPU at the same tolerance (on a GPU the two calls' fp32 products may round differently: TF32 units).
2. Scaling: one sequence of T tokens, forward + backward (and forward alone), B1 H16/HV32 K = V = 128 bf16, no
   initial or final state (FLA's CP form): W ranks on T / W tokens each (backend "auto", and "triton" by name),
   against the one-GPU call on all T tokens (the Triton backend and `auto`, the fastest one-GPU path). A step's time
   is the slowest rank's (the ranks start together after a barrier), median of --reps steps; efficiency = one-GPU
   time / (W * W-rank time).
The ranks are spawned from this process; each writes its results to a temporary folder, this process compares
them and writes one JSON (--out) with the environment. Exit status 1 when a gate case fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import List, Optional

import torch

GATE_DIMS = (4, 8, 128, 128)
GATE_DIMS_DRY = (1, 2, 16, 16)


def gate_cases(world: int, dry_run: bool) -> List[dict]:
    """(name, case) pairs; fresh random inputs on every call."""
    from linattn.testing.cp_cases import make_case
    dims = GATE_DIMS_DRY if dry_run else GATE_DIMS
    T = 48 * world if dry_run else 2048 * world
    # a sequence inside rank 0, one crossing every boundary after it, a 1-token sequence, the rest on the last rank
    first = T // (2 * world)
    lengths = [first, T - first - 1 - T // (4 * world), 1, T // (4 * world)]
    specs = [("gdn bf16 h0 final", dict(dtype=torch.bfloat16, op="gdn")),
             ("gdn fp32 h0 final", dict(dtype=torch.float32, op="gdn")),
             ("kda bf16 h0 final", dict(dtype=torch.bfloat16, op="kda")),
             ("gdn FLA options bf16 h0 final", dict(dtype=torch.bfloat16, op="gdn", fla_options=True)),
             ("kda FLA options bf16 h0 final", dict(dtype=torch.bfloat16, op="kda", fla_options=True))]
    if dry_run:                                   # the CPU test's own cases cover the rest under the interpreter
        specs = specs[1:2]
    return [dict(name=name, **make_case(lengths, world, with_h0=True, final=True, dims=dims, **kw))
            for name, kw in specs]


def _step_times(fn, dev, reps: int, warmup: int) -> List[float]:
    """Seconds of each of `reps` steps, each the slowest rank's: a barrier, fn(), a device sync, the max over
    ranks."""
    import torch.distributed as dist
    from linattn.distributed.model import _sync
    for _ in range(warmup):
        fn()
    _sync(dev)
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append(float(dt.item()))
    return out


def _scaling(rank: int, world: int, dev, T: int, dims, dtype, reps: int, warmup: int, op: str) -> dict:
    """The one-GPU call (every rank runs it on its own GPU at once, the slowest counted) and the W-rank call."""
    import linattn
    from linattn.bench.base import delta_rule_inputs
    from linattn.distributed import build_cp_context
    H, HV, K, V = dims
    fn = linattn.chunk_kda if op == "kda" else linattn.chunk_gated_delta_rule
    # the bench's inputs, drawn on the device from one seed: the same stream on every rank
    shape = dict(B=1, T=T, H=H, HV=HV, K=K, V=V)
    x = delta_rule_inputs(shape, dev, 1234, "fwdbwd", dtype, (), channel_gate=op == "kda")
    full = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    do = x["do"]

    def call(x, dout, **kw):
        x = {n: t.detach().requires_grad_(True) for n, t in x.items()}

        def fwd():
            with torch.no_grad():
                fn(**x, **kw)

        def fwd_bwd():
            o, _ = fn(**x, **kw)
            o.backward(dout)
            for t in x.values():
                t.grad = None
        return fwd, fwd_bwd

    row = dict(T=T, world=world)
    for backend in ("triton", "auto"):
        fwd, fwd_bwd = call(full, do, backend=backend)
        row[f"one_gpu_{backend}_fwd_s"] = _step_times(fwd, dev, reps, warmup)
        row[f"one_gpu_{backend}_fwd_bwd_s"] = _step_times(fwd_bwd, dev, reps, warmup)
    P = T // world
    sl = slice(rank * P, (rank + 1) * P)
    cp = build_cp_context(torch.tensor([0, T], device=dev))
    local = {n: t[:, sl].contiguous() for n, t in full.items()}
    # the CP call with backend "auto" (cp_*: the kernels it picks, linattn/distributed/chunk.py gdn_cp_op) and with
    # the Triton kernels by name (cp_triton_*)
    for key, backend in (("cp", "auto"), ("cp_triton", "triton")):
        fwd, fwd_bwd = call(local, do[:, sl].contiguous(), cp_context=cp, backend=backend)
        row[f"{key}_fwd_s"] = _step_times(fwd, dev, reps, warmup)
        row[f"{key}_fwd_bwd_s"] = _step_times(fwd_bwd, dev, reps, warmup)
    for mode in ("fwd", "fwd_bwd"):
        cp_s = statistics.median(row[f"cp_{mode}_s"])
        for backend in ("triton", "auto"):
            one = statistics.median(row[f"one_gpu_{backend}_{mode}_s"])
            row[f"efficiency_{mode}_vs_{backend}"] = one / (world * cp_s)
        row[f"efficiency_triton_{mode}_vs_triton"] = (statistics.median(row[f"one_gpu_triton_{mode}_s"])
                                                     / (world * statistics.median(row[f"cp_triton_{mode}_s"])))
    return row


def _worker(rank: int, world: int, init_file: str, out_dir: str, cases: List[dict], scaling: dict):
    import torch.distributed as dist
    from linattn.testing.cp_cases import rank_call
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        for i, case in enumerate(cases):
            torch.save(rank_call(rank, case, device=dev), os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
        rows = [_scaling(rank, world, dev, T, scaling["dims"], scaling["dtype"], scaling["reps"],
                         scaling["warmup"], op) for op in scaling["ops"] for T in scaling["T"]]
        if rank == 0:
            torch.save(rows, os.path.join(out_dir, "scaling.pt"))
    finally:
        dist.destroy_process_group()


def _median_ms(xs) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m linattn.distributed.multi_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    p.add_argument("--T", type=int, nargs="+", default=[131072, 262144, 524288],
                   help="tokens of the scaling runs' one sequence (multiples of --world)")
    p.add_argument("--ops", nargs="+", choices=["gdn", "kda"], default=["gdn"], help="ops of the scaling runs")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--skip-gate", action="store_true")
    p.add_argument("--dry-run", action="store_true",
                   help="gloo on the CPU (run under TRITON_INTERPRET=1): one small gate case, a tiny scaling run")
    p.add_argument("--out", required=True, help="path of the JSON to write")
    a = p.parse_args(argv)
    import torch.multiprocessing as mp
    from linattn.bench.env import collect_env, env_line
    from linattn.testing.compare import TOL
    from linattn.testing.cp_cases import check, expected
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("no GPU: run with --dry-run on a CPU (TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if cuda and torch.cuda.device_count() < a.world:
        print(f"--world {a.world} needs {a.world} GPUs, this host has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    Ts = [2 * 64 * a.world] if a.dry_run else a.T
    uneven = [T for T in Ts if T % a.world]
    if uneven:
        print(f"--T must be multiples of --world {a.world}: not {uneven}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    env = collect_env(dev)
    print(env_line(env), flush=True)
    cases = [] if a.skip_gate else gate_cases(a.world, a.dry_run)
    # the expected results first (on GPU 0, or here): under the interpreter a forked rank then starts warm
    exps = [expected(c, same_call=True, device=dev) for c in cases]
    scaling = dict(T=Ts, ops=a.ops, dims=GATE_DIMS_DRY if a.dry_run else (16, 32, 128, 128),
                   dtype=torch.float32 if a.dry_run else torch.bfloat16, reps=1 if a.dry_run else a.reps,
                   warmup=0 if a.dry_run else 2)
    result = dict(env=env, world=a.world, backend="nccl" if cuda else "gloo", gate=[], scaling=[])
    with tempfile.TemporaryDirectory() as d:
        # the worker by its module's name (run with -m this module is __main__, which a spawned child does not
        # import under that name)
        from linattn.distributed import multi_gpu
        mp.start_processes(multi_gpu._worker, args=(a.world, os.path.join(d, "store"), d, cases, scaling),
                           nprocs=a.world, start_method="spawn" if cuda else "fork")
        for i, (case, exp) in enumerate(zip(cases, exps)):
            ranks = [torch.load(os.path.join(d, f"case{i}_rank{r}.pt")) for r in range(a.world)]
            res = check(case, ranks, a.world, same_call_tol=TOL[case["q"].dtype], exp=exp)
            row = dict(case=case["name"], tokens=int(case["cu"][-1]), lengths=case["cu"].diff().tolist(), **res)
            row["passed"] = not row["failures"]
            result["gate"].append(row)
            worst = max(max(e.values()) for e in row["errors"].values())
            print(f"gate {row['case']}: {'PASS' if row['passed'] else 'FAIL'} (worst relative RMS {worst:.2e})"
                  + "".join(f"\n   {m}" for m in row["failures"]), flush=True)
        result["scaling"] = torch.load(os.path.join(d, "scaling.pt"))
    for row in result["scaling"]:
        print(f"scaling T={row['T']} W={a.world}: one GPU triton / auto "
              f"{_median_ms(row['one_gpu_triton_fwd_bwd_s'])} / {_median_ms(row['one_gpu_auto_fwd_bwd_s'])} ms, "
              f"W ranks {_median_ms(row['cp_fwd_bwd_s'])} ms (forward + backward); efficiency vs triton "
              f"{row['efficiency_fwd_bwd_vs_triton']:.2f}, vs auto {row['efficiency_fwd_bwd_vs_auto']:.2f}; "
              f"forward {_median_ms(row['cp_fwd_s'])} ms, efficiency {row['efficiency_fwd_vs_triton']:.2f} / "
              f"{row['efficiency_fwd_vs_auto']:.2f}; CP on the Triton kernels {_median_ms(row['cp_triton_fwd_bwd_s'])}"
              f" ms, efficiency vs triton {row['efficiency_triton_fwd_bwd_vs_triton']:.2f}", flush=True)
    result["passed"] = all(r["passed"] for r in result["gate"])
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("PASSED" if result["passed"] else "FAILED", "->", a.out)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
