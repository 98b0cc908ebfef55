"""A one-GPU model of context-parallel scaling for chunk_gated_delta_rule (and, with --op kda, chunk_kda)
(docs/context-parallel.md).

For each world size W it runs, on this one device, what rank r of W runs: the context-parallel forward and backward
on T / W tokens of one sequence of T tokens, through the real code path with SimulatedComm standing in for the peers
(no communication: the summaries, compositions and kernels are those of a real rank, the gathered values are
copies). It times three roles: the first rank (summary, no incoming state), a rank the sequence spans whole (summary
with its transition M, incoming state composed through W - 2 ranks, the backward's dh0-only pass) and the last
rank, and takes the slowest as the step's local time (every rank waits for the others at the collective). The
one-process call on all T tokens is timed the same way. Then per pass:

    modelled time = slowest rank's local time (kernels + summary + composition)
                    + latency per collective + bytes received by one rank / link bandwidth

with the forward's all-gather of [HV, K, V + K] fp32 per rank and the backward's of [HV, K, V] fp32 (plus the
all-reduces of the final states and their gradient with --final). A model, not a measurement of communication:
overlap, NVLink contention and the collectives' own kernels are not in it.

    python3 -m linattn.distributed.model                      # B1 T=262080 H16/HV32 K=V=128 bf16, W = 2..8
    python3 -m linattn.distributed.model --dry-run            # tiny sizes, the CPU under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

import torch


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev, reps: int, warmup: int = 1) -> float:
    """Median seconds of fn() over reps calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def _inputs(T: int, H: int, HV: int, K: int, V: int, dtype, dev, op: str = "gdn"):
    from linattn.testing.inputs import make_gdn_inputs
    x = make_gdn_inputs(1, T, H, HV, K, V, dtype=dtype, device=dev, initial_state=False)
    x.pop("initial_state")
    if op == "kda":                             # KDA: the same log decays, per key channel
        x["g"] = x["g"][..., None].expand(-1, -1, -1, K).contiguous()
    return {n: t.requires_grad_(True) for n, t in x.items()}


def _pass_times(x, do, dev, reps: int, final: bool, cp=None, warmup: int = 1, op: str = "gdn"):
    """(forward seconds, forward + backward seconds) of one call on x."""
    import linattn
    fn = linattn.chunk_kda if op == "kda" else linattn.chunk_gated_delta_rule

    def fwd():
        with torch.no_grad():
            fn(**x, output_final_state=final, cp_context=cp)

    def fwd_bwd():
        o, fin = fn(**x, output_final_state=final, cp_context=cp)
        loss = (o * do).sum() + (fin.sum() if final else 0)
        loss.backward()
        for t in x.values():
            t.grad = None

    return _time(fwd, dev, reps, warmup), _time(fwd_bwd, dev, reps, warmup)


def comm_model(W: int, HV: int, K: int, V: int, N: int, final: bool, bw: float, lat: float) -> dict:
    """Bytes one rank receives per pass and the modelled seconds (latency per collective + bytes / bandwidth)."""
    fwd = (W - 1) * HV * K * (V + K) * 4
    bwd = (W - 1) * HV * K * V * 4
    n_fwd = n_bwd = 1
    if final:                                   # ring all-reduce: 2 (W - 1) / W of the buffer in
        red = int(2 * (W - 1) / W * N * HV * K * V * 4)
        fwd, bwd, n_fwd, n_bwd = fwd + red, bwd + red, 2, 2
    return dict(bytes_fwd=fwd, bytes_bwd=bwd, comm_fwd_s=n_fwd * lat + fwd / bw, comm_bwd_s=n_bwd * lat + bwd / bw)


def run(T: int, H: int, HV: int, K: int, V: int, worlds: List[int], dtype, dev, reps: int, final: bool,
        bw: float, lat: float, warmup: int = 1, out=print, op: str = "gdn") -> dict:
    from linattn.distributed import build_cp_context
    from linattn.distributed.comm import SimulatedComm
    uneven = [W for W in worlds if W < 1 or T % W]
    if uneven:
        raise ValueError(f"--T {T} must be a multiple of every world size (each rank holds T / W tokens); "
                         f"not of {uneven}")
    cu = torch.tensor([0, T], dtype=torch.int64, device=dev)     # the offsets live with the tokens, as a caller's do
    x = _inputs(T, H, HV, K, V, dtype, dev, op)
    do = torch.randn(1, T, HV, V, device=dev).to(dtype)
    full_f, full_fb = _pass_times(x, do, dev, reps, final, warmup=warmup, op=op)
    out(f"one device, all {T} tokens: forward {full_f * 1e3:.3f} ms, forward + backward {full_fb * 1e3:.3f} ms")
    out(f"{'W':>2} {'rank':>12} {'local fwd ms':>12} {'local f+b ms':>12} {'fwd MB in':>9} {'bwd MB in':>9} "
        f"{'model fwd ms':>12} {'model f+b ms':>12} {'fwd x':>6} {'f+b x':>6}")
    rows = []
    for W in worlds:
        P = T // W
        roles = sorted({0, W - 1} | ({W // 2} if W >= 3 else set()))
        times = {}
        for r in roles:
            cp = build_cp_context(cu, rank=r, world_size=W, comm=SimulatedComm(r, W))
            xr = {n: t.detach()[:, r * P:(r + 1) * P].clone().requires_grad_(True) for n, t in x.items()}
            times[r] = _pass_times(xr, do[:, r * P:(r + 1) * P], dev, reps, final, cp, warmup, op)
        f = max(t[0] for t in times.values())
        fb = max(t[1] for t in times.values())
        c = comm_model(W, HV, K, V, 1, final, bw, lat)
        mf = f + c["comm_fwd_s"]
        mfb = fb + c["comm_fwd_s"] + c["comm_bwd_s"]
        slow = max(times, key=lambda r: times[r][1])
        role = "spanned" if 0 < slow < W - 1 else ("first" if slow == 0 else "last")
        out(f"{W:>2} {f'{slow} ({role})':>12} {f * 1e3:>12.3f} {fb * 1e3:>12.3f} {c['bytes_fwd'] / 1e6:>9.2f} "
            f"{c['bytes_bwd'] / 1e6:>9.2f} {mf * 1e3:>12.3f} {mfb * 1e3:>12.3f} {full_f / mf:>6.2f} "
            f"{full_fb / mfb:>6.2f}")
        rows.append(dict(W=W, per_rank_s={str(r): dict(fwd=t[0], fwd_bwd=t[1]) for r, t in times.items()},
                         local_fwd_s=f, local_fwd_bwd_s=fb, model_fwd_s=mf, model_fwd_bwd_s=mfb,
                         speedup_fwd=full_f / mf, speedup_fwd_bwd=full_fb / mfb, **c))
    return dict(op=op, T=T, H=H, HV=HV, K=K, V=V, dtype=str(dtype), device=str(dev), reps=reps, final=final,
                link_bytes_per_s=bw, latency_s=lat, one_device_fwd_s=full_f, one_device_fwd_bwd_s=full_fb,
                worlds=rows)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m linattn.distributed.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=["gdn", "kda"], default="gdn", help="chunk_gated_delta_rule or chunk_kda")
    p.add_argument("--T", type=int, default=262080,
                   help="tokens of the one sequence (default 840 * 312: a multiple of every default world size)")
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--HV", type=int, default=32)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--final", action="store_true", help="return the final states (adds their all-reduces)")
    p.add_argument("--bandwidth", type=float, default=400e9, help="link bytes/s per direction (NVLink ~400e9)")
    p.add_argument("--latency", type=float, default=20e-6, help="seconds per collective")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes (T=192, H1/HV2, K=V=16, W=3: every role, fp32, one rep, no warm-up)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.dry_run:
        a.T, a.H, a.HV, a.K, a.V, a.worlds, dtype, a.reps = 192, 1, 2, 16, 16, [3], torch.float32, 1
    elif dev.type != "cuda":
        print("no GPU: the full-size model needs one (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    res = run(a.T, a.H, a.HV, a.K, a.V, a.worlds, dtype, dev, a.reps, a.final, a.bandwidth, a.latency,
              warmup=0 if a.dry_run else 1, op=a.op)
    if a.json:
        from linattn.bench.env import collect_env, env_line
        env = collect_env(dev)
        res.update(env=env, env_line=env_line(env), backend_env=os.environ.get("LINATTN_BACKEND", "auto"))
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
