"""Hardware counters of one GDN forward+backward (which backward kernel holds the time).

Two roles, as benchmarks/gpu/ncu_fwd.py:

    ncu --clock-control none --profile-from-start off --section ... --csv --page details \\
        python benchmarks/gpu/ncu_bwd.py run --backend triton --B 1 --T 65536   # the profiled program
    python benchmarks/gpu/ncu_bwd.py summarize --out DIR CSV...                   # CSVs -> ncu_bwd_summary.json

`run` makes the inputs (bf16, H16/HV32, K=V=128, initial state, every input requiring grad), runs one forward and
backward outside the profiled range (compiles, FLA's autotuning), then one forward, a marker kernel, and one
backward between cudaProfilerStart/Stop. The marker is torch.cuda._sleep's `spin_kernel` (a few cycles): in ncu's
launch-ordered output it separates the forward's kernels from the backward's, which share names (our backward
recomputes the forward's stage 2 and state pass). `--backend fla` profiles FLA's Triton path (FLA_FLASH_QLA=0) with
its Hopper guard on the gated backward bypassed (chunk_o.TRITON_ABOVE_3_7_1 forced True:
timing only, its gradients are not checked here). `--phase bwd` leaves the forward out of the profiled range.

`summarize` reads ncu's `--csv --page details` files with ncu_fwd.summarize_csv (per kernel: duration, DRAM and SM
throughput, achieved and theoretical occupancy, registers, shared memory, grid, top warp stalls), splits each file
at the marker into forward and backward, and adds per phase the total and the time per kernel name (launches of the
same name summed). `--dry-run` checks it on a small CSV in ncu's layout; `run --dry-run` drives ours through the
same calls on the CPU at a small shape under TRITON_INTERPRET=1 (no profiler, no marker kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_fwd import summarize_csv  # noqa: E402

MARKER = "spin_kernel"      # torch.cuda._sleep's kernel


def split_phases(kernels: list) -> dict:
    """Launch-ordered kernels -> {"fwd": [...], "bwd": [...]} at the first marker kernel; without a marker (a
    --phase bwd run) every kernel is backward."""
    idx = next((i for i, k in enumerate(kernels) if MARKER in k["kernel"]), None)
    if idx is None:
        return {"fwd": [], "bwd": list(kernels)}
    return {"fwd": kernels[:idx], "bwd": kernels[idx + 1:]}


def by_name(kernels: list) -> dict:
    """Kernel name (up to the template arguments) -> [launches, summed us], largest first."""
    acc: dict = {}
    for k in kernels:
        name = k["kernel"].split("<")[0].split("(")[0].strip() or k["kernel"]
        n, us = acc.get(name, (0, 0.0))
        acc[name] = (n + 1, us + k.get("duration_us", 0.0))
    return {name: [n, round(us, 1)] for name, (n, us) in sorted(acc.items(), key=lambda kv: -kv[1][1])}


def summarize(paths, out_dir):
    res = {}
    for p in paths:
        with open(p, errors="replace") as f:
            kernels = summarize_csv(f.read())
        phases = split_phases(kernels)
        res[os.path.basename(p)] = {
            ph: dict(total_us=round(sum(k.get("duration_us", 0.0) for k in ks), 1), by_name=by_name(ks), kernels=ks)
            for ph, ks in phases.items()}
    for name, ph in res.items():
        print(f"{name}: forward {ph['fwd']['total_us']} us ({len(ph['fwd']['kernels'])} kernels), "
              f"backward {ph['bwd']['total_us']} us ({len(ph['bwd']['kernels'])} kernels)")
        for k in ph["bwd"]["kernels"]:
            if k.get("duration_us", 0.0) < 20.0:         # allocations' fills and the like
                continue
            stall = next(iter(k.get("stalls", {})), "")
            print(f"  bwd {k.get('duration_us', 0):9.1f} us  dram {k.get('dram_throughput_pct', 0):5.1f}%  "
                  f"mem {k.get('memory_throughput_pct', 0):5.1f}%  sm {k.get('sm_throughput_pct', 0):5.1f}%  occ {k.get('achieved_occupancy_pct', 0):5.1f}%  "
                  f"regs {k.get('registers_per_thread', 0):4.0f}  {k['kernel'][:48]}  {stall[:40]}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ncu_bwd_summary.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def _inputs(B, T, H, HV, device):
    import torch
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, *((128, 128) if device == "cuda" else (32, 32)), dtype=torch.bfloat16,
                        device=device, requires_grad=True)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen).to(device=device, dtype=x["v"].dtype)
    dht = torch.randn(x["initial_state"].shape, generator=gen).to(device=device, dtype=torch.float32)
    return x, do, dht


def _fn(backend):
    import linattn
    if backend == "fla":
        os.environ["FLA_FLASH_QLA"] = "0"
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True        # FLA's Hopper guard on its gated backward: timing only
        return lambda x: fla_fn(**x, output_final_state=True)
    return lambda x: linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend=backend)


def run(backend: str, B: int, T: int, H: int, HV: int, phase: str, dry_run: bool):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch
    device = "cpu" if dry_run else "cuda"
    x, do, dht = _inputs(B, T, H, HV, device)
    fn = _fn(backend)
    leaves = [t for t in x.values() if t is not None]

    def fwd():
        return fn(x)

    def bwd(out):
        o, ht = out
        return torch.autograd.grad((o, ht), leaves, (do, dht))

    def sync():
        if not dry_run:
            torch.cuda.synchronize()

    grads = bwd(fwd())                             # compile, autotune
    sync()
    if dry_run:
        assert all(g is not None and g.shape == t.shape and torch.isfinite(g.float()).all()
                   for g, t in zip(grads, leaves)), "gradients"
        out = fwd()
        print(f"ncu_bwd run dry run: ok ({backend}, {len(leaves)} gradients, o {tuple(out[0].shape)})")
        return
    out = None if phase == "fwd_bwd" else fwd()
    sync()
    torch.cuda.cudart().cudaProfilerStart()
    if out is None:
        out = fwd()
        torch.cuda._sleep(1)                       # the marker between the phases (spin_kernel)
    grads = bwd(out)
    sync()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_bwd: profiled one {backend} {'forward+backward' if phase == 'fwd_bwd' else 'backward'} "
          f"at B={B} T={T} H={H} HV={HV}")


def _row(kid, name, metric, unit, value, section="GPU Speed Of Light Throughput"):
    return (f'"{kid}","1","python3","h","{name}","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","{section}",'
            f'"{metric}","{unit}","{value}"\n')


_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
           '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
_SAMPLE = ("==PROF== Connected to process 1\n" + _HEADER
           + _row(0, "kkt_solve_kernel", "Duration", "us", "700.0")
           + _row(1, "chunk_state_fwd_kernel", "Duration", "ms", "2.0")
           + _row(2, "spin_kernel(long)", "Duration", "us", "1.5")
           + _row(3, "kkt_solve_kernel", "Duration", "us", "750.0")
           + _row(4, "chunk_state_fwd_kernel", "Duration", "ms", "2.01")
           + _row(5, "chunk_local_bwd_kernel", "Duration", "usecond", "6,500.0")
           + _row(5, "chunk_local_bwd_kernel", "Registers Per Thread", "register/thread", "255", "Launch Statistics")
           + _row(5, "chunk_local_bwd_kernel", "Stall Long Scoreboard", "cycle", "9.5", "Warp State Statistics")
           + _row(6, "void at::vectorized_elementwise_kernel<4, at::FillFunctor<float> >", "Duration", "us", "3.0")
           + _row(7, "void at::vectorized_elementwise_kernel<4, at::AddFunctor<float> >", "Duration", "us", "5.0"))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--backend", default="triton")
    r.add_argument("--B", type=int, default=1)
    r.add_argument("--T", type=int, default=65536)
    r.add_argument("--H", type=int, default=16)
    r.add_argument("--HV", type=int, default=32)
    r.add_argument("--phase", choices=("fwd_bwd", "bwd"), default="fwd_bwd")
    r.add_argument("--dry-run", action="store_true", help="CPU, interpreter, small shape: the call path only")
    s = sub.add_parser("summarize")
    s.add_argument("--out", required=True)
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("csv", nargs="*")
    a = ap.parse_args()
    if a.cmd == "run":
        if a.dry_run:
            run(a.backend, 1, 130, 2, 4, a.phase, True)
        else:
            run(a.backend, a.B, a.T, a.H, a.HV, a.phase, False)
        return
    if a.dry_run:
        os.makedirs(a.out, exist_ok=True)
        p = os.path.join(a.out, "sample_bwd.csv")
        with open(p, "w") as f:
            f.write(_SAMPLE)
        ph = summarize([p], a.out)["sample_bwd.csv"]
        assert [k["kernel"] for k in ph["fwd"]["kernels"]] == ["kkt_solve_kernel", "chunk_state_fwd_kernel"], ph
        assert ph["fwd"]["total_us"] == 2700.0 and ph["bwd"]["total_us"] == 9268.0, ph
        assert list(ph["bwd"]["by_name"])[0] == "chunk_local_bwd_kernel", ph["bwd"]["by_name"]
        assert ph["bwd"]["by_name"]["void at::vectorized_elementwise_kernel"] == [2, 8.0], ph["bwd"]["by_name"]
        loc = ph["bwd"]["kernels"][2]
        assert loc["registers_per_thread"] == 255 and list(loc["stalls"]) == ["Stall Long Scoreboard"], loc
        assert split_phases(ph["bwd"]["kernels"])["fwd"] == []
        print("ncu_bwd summarize dry run: ok")
        return
    summarize(a.csv, a.out)


if __name__ == "__main__":
    main()
