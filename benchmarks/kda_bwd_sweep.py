"""Timing sweep of the KDA Triton backward's launch constants on a GPU: kda_pair_bwd_kernel's and kda_wy_bwd_kernel's
key block, warps and pipelining stages, kda_pair_diag_bwd_kernel's heads per program, kda_dg_kernel's key block and
the reverse state pass's value columns per program (linattn/ops/kda/triton/backward.py and forward.py module
constants), each config in a fresh process (its own compiles, no state from the
previous one), the kernels' CUDA times by torch.profiler (kernel_breakdown.py's breakdown: mean of 3 calls) at H = HV =
32, K = V = 128, bf16, with the bench's decays and with them x100 (every chunk flagged pairwise). Timing only: a config
that wins goes through `gate.py --only kda` before it becomes the default.

    python3 benchmarks/kda_bwd_sweep.py                                   # the default configs below
    python3 benchmarks/kda_bwd_sweep.py --config PAIR_BK=16,PAIR_WARPS=8 --config WY_WARPS=4 --g-scale 1

Writes $OUT/kda_bwd_sweep.json (default: this folder) with the environment line; prints one line per config and
decay: the backward's total and its largest kernels.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# the configs not timed since the pair kernel took the in-block pairs
# (results/2026-12-06_kda_bwd_sweep_dd00182_h100.json has PAIR_BK 16 / 64, PAIR_WARPS=8 and WY_WARPS=4; STATE_BV is
# the Triton reverse pass's, which the gluon backend no longer runs)
DEFAULT_CONFIGS = ["", "DIAG_BH=8", "DG_BK=64", "WY_BK=16", "WY_STAGES=2", "PAIR_STAGES=2"]
KNOWN = {"PAIR_BK", "PAIR_WARPS", "PAIR_STAGES", "WY_BK", "WY_WARPS", "WY_STAGES", "DG_BK", "DIAG_BH", "STATE_BV"}


def parse(config: str) -> dict:
    out = {}
    for item in filter(None, config.split(",")):
        name, value = item.split("=")
        if name not in KNOWN:
            raise SystemExit(f"unknown constant {name!r}; known: {sorted(KNOWN)}")
        out[name] = int(value)
    return out


def child(config: str, g_scales, shape) -> dict:
    import torch
    sys.path.insert(0, HERE)
    import kernel_breakdown as kb
    from linattn.ops.kda.triton import backward as bw
    for name, value in parse(config).items():
        setattr(bw, name, value)             # read at each launch (DIAG_BH is imported into backward.py)
    B, T = shape
    res = {}
    for gs in g_scales:
        torch.manual_seed(0)
        r = kb.breakdown(*kb.make_call("kda", "gluon", B, T, 32, 32, g_scale=gs))
        res[f"g x{gs:g}"] = dict(bwd_total_ms=r["bwd_total_ms"], bwd=r["bwd"])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None, help="NAME=VALUE[,NAME=VALUE...]; '' = the defaults")
    ap.add_argument("--g-scale", type=float, nargs="+", default=[1.0, 100.0])
    ap.add_argument("--shape", type=int, nargs=2, default=[1, 32768], metavar=("B", "T"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.g_scale, args.shape)))
        return 0
    configs = args.config if args.config is not None else DEFAULT_CONFIGS
    for c in configs:
        parse(c)                             # refuse a typo before any GPU time is spent
    from linattn.bench.env import collect_env, env_line
    import torch
    out = dict(env=env_line(collect_env(torch.device("cuda"))), shape=args.shape, g_scales=args.g_scale, configs={})
    for c in configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", c, "--shape", *map(str, args.shape),
               "--g-scale", *map(str, args.g_scale)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            out["configs"][c or "default"] = dict(error=p.stderr[-1500:])
            print(f"{c or 'default':<28} failed: {p.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        res = json.loads(p.stdout.strip().splitlines()[-1])
        out["configs"][c or "default"] = res
        for key, r in res.items():
            top = ", ".join(f"{n[:24]} {ms:.3f}" for n, ms in list(sorted(r["bwd"].items(), key=lambda kv: -kv[1]))[:4])
            print(f"{c or 'default':<28} {key:<7} bwd {r['bwd_total_ms']:7.3f} ms   {top}", flush=True)
    path = os.path.join(os.environ.get("OUT", HERE), "kda_bwd_sweep.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
