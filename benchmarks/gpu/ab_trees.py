"""Same-run A/B of two linattn source trees on one GPU: the production rows (forward, forward+backward, decode)
timed in fresh processes, the trees alternated, so that a refactor can be shown to leave speed unchanged.

    python benchmarks/gpu/ab_trees.py --tree old=/path/to/old/tree --tree new=. --passes 2 --json $OUT/ab.json

Each (pass, tree) runs in its own child process with PYTHONPATH set to that tree (the child checks that it
imported linattn from there). Inside a child every row is checked once against the tree's own reference-free
sanity (finite outputs), then timed as a CUDA-graph replay (median of `--repeats` replays of a graph of `--calls`
calls, per input set, two input sets alternated) and, for the forward, eagerly as well. The summary gives, per
row, each tree's median over its processes, the spread between its processes, and old/new (the first tree's median over each other tree's: > 1, that tree is faster).
Only the public API is used (linattn.chunk_gated_delta_rule, linattn.fused_recurrent_gated_delta_rule with
backend="auto"), so any two trees with that API can be compared. `--op kda`: linattn.chunk_kda's rows instead
(KDA_ROWS: forward without autograd, eager and graphed, and forward + backward eager; H = HV = 32, K = V = 128, bf16,
initial and final state, a per-key-channel log decay). `--op train`: TRAIN_ROWS, short training steps of both ops
(host-bound: what launch lists and host paths change), with and without FLA's in-kernel gate, each with its host us.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

FWD_ROWS = [  # (name, B, T, H, HV, varlen)
    ("B1 T8192", 1, 8192, 16, 32, False),
    ("B1 T32768", 1, 32768, 16, 32, False),
    ("B1 T65536", 1, 65536, 16, 32, False),
    ("B8 T4096", 8, 4096, 16, 32, False),
    ("B4 T16384", 4, 16384, 16, 32, False),
    ("varlen24", 1, 0, 16, 32, True),
]
DECODE_ROWS = [  # (name, batch, state dtype, pool in place)
    ("decode B1 fp32", 1, "fp32", True),
    ("decode B32 fp32", 32, "fp32", True),
    ("decode B256 fp32", 256, "fp32", True),
    ("decode B256 fp32 FLA-mode", 256, "fp32", False),
    ("decode B256 bf16", 256, "bf16", True),
]
KDA_ROWS = [  # (name, B, T)
    ("kda B1 T32768", 1, 32768),
    ("kda B8 T4096", 8, 4096),
    ("kda B4 T16384", 4, 16384),
]
# (name, op, backend, T, FLA's in-kernel gate): host-bound training steps at B1, H16/HV32 (KDA: H = HV = 32)
TRAIN_ROWS = [
    ("train gdn triton T1024", "gdn", "triton", 1024, False),
    ("train gdn triton T1024 gate", "gdn", "triton", 1024, True),
    ("train gdn auto T1024", "gdn", "auto", 1024, False),
    ("train gdn auto T1024 gate", "gdn", "auto", 1024, True),
    ("train gdn auto T8192 gate", "gdn", "auto", 8192, True),
    ("train kda auto T1024", "kda", "auto", 1024, False),
    ("train kda auto T2048 gate", "kda", "auto", 2048, True),
]
VARLEN_LENS = [256, 4096, 512, 3072, 1024, 2048, 768, 3584, 1536, 2560, 384, 4000,
               640, 3200, 1280, 2304, 896, 3840, 1792, 2816, 448, 3456, 1152, 2680]


def _child(args) -> dict:
    import torch
    import linattn
    here = os.path.realpath(os.path.dirname(linattn.__file__))
    want = os.path.realpath(os.path.join(args.child, "linattn"))
    assert here == want, f"imported linattn from {here}, expected {want}"
    dev = "cuda"
    K = V = 128
    torch.manual_seed(0)

    def graph_time(fn, sets):
        """Median ms per call of CUDA-graph replays (each graph holds args.calls calls on one input set)."""
        graphs = []
        for s in sets:
            for _ in range(3):
                fn(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(args.calls):
                    fn(s)
            graphs.append(g)
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            for g in graphs:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / args.calls)
        return statistics.median(times)

    def eager_time(fn, sets):
        for s in sets:
            for _ in range(3):
                fn(s)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            for s in sets:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(args.calls):
                    fn(s)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / args.calls)
        return statistics.median(times)

    out = {"linattn": here, "rows": {}}
    if args.op == "kda":
        return _kda_rows(args, out, graph_time, eager_time)
    if args.op == "train":
        return _train_rows(args, out, eager_time, dev)
    for name, B, T, H, HV, varlen in FWD_ROWS:
        cu = None
        if varlen:
            T = sum(VARLEN_LENS)
            cu = torch.tensor([0] + VARLEN_LENS, device=dev).cumsum(0).to(torch.int32)
        N = B if cu is None else cu.numel() - 1

        def make():
            q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
            k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
            v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
            g = -torch.rand(B, T, HV, device=dev) * 0.1 - 0.01
            beta = torch.rand(B, T, HV, device=dev) * 0.9 + 0.05
            h0 = torch.randn(N, HV, K, V, device=dev) * 0.1
            return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)

        _time_row(args, out, name, [make(), make()],
                  lambda x, cu=cu: linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu),
                  graph_time, eager_time)

    H = HV = 32
    for name, B, sdt, pool in DECODE_ROWS:
        dt = torch.float32 if sdt == "fp32" else torch.bfloat16

        def make():
            q = torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16)
            k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).to(torch.bfloat16)
            v = torch.randn(B, 1, HV, V, device=dev, dtype=torch.bfloat16)
            g = -torch.rand(B, 1, HV, device=dev) * 0.1 - 0.01
            beta = torch.rand(B, 1, HV, device=dev) * 0.9 + 0.05
            s = dict(q=q, k=k, v=v, g=g, beta=beta)
            if pool:
                slots = 2 * B + 3
                s["initial_state"] = (torch.randn(slots, HV, K, V, device=dev) * 0.1).to(dt)
                s["state_indices"] = torch.randperm(slots, device=dev)[:B].to(torch.int32)
                s["inplace"] = True
            else:
                s["initial_state"] = (torch.randn(B, HV, K, V, device=dev) * 0.1).to(dt)
                s["output_final_state"] = True
            return s

        sets = [make(), make()]

        def dec(s):
            return linattn.fused_recurrent_gated_delta_rule(**s)

        o, _ = dec(sets[0])
        assert torch.isfinite(o.float()).all(), name
        row = {"graph_ms": graph_time(dec, sets)}
        out["rows"][name] = row
        print(f"[{args.label}] {name}: {row}", flush=True)
    return out


def _time_row(args, out, name, sets, call, graph_time, eager_time) -> None:
    """One forward row: call(inputs) -> (o, final state) checked finite, then timed without autograd (graph and
    eager) and as forward + backward eagerly (random upstream gradients; each call's .grad cleared after it, so
    nothing accumulates); the row goes into out["rows"][name]."""
    import torch
    leaves = ("q", "k", "v", "g", "beta", "initial_state")
    o, ht = call(sets[0])
    assert torch.isfinite(o.float()).all() and torch.isfinite(ht).all(), name
    row = {"fwd_graph_ms": graph_time(call, sets), "fwd_eager_ms": eager_time(call, sets)}
    gsets = []
    for s in sets:
        gs = {n: (t.detach().clone().requires_grad_(True) if n in leaves else t) for n, t in s.items()}
        gs["do"], gs["dht"] = torch.randn_like(s["v"]), torch.randn_like(s["initial_state"])
        gsets.append(gs)

    def fwdbwd(s):
        o, ht = call({n: t for n, t in s.items() if n not in ("do", "dht")})
        torch.autograd.backward((o, ht), (s["do"], s["dht"]))
        for n in leaves:
            s[n].grad = None

    row["fwdbwd_eager_ms"] = eager_time(fwdbwd, gsets)
    out["rows"][name] = row
    del sets, gsets
    torch.cuda.empty_cache()
    print(f"[{args.label}] {name}: {row}", flush=True)


def _kda_rows(args, out, graph_time, eager_time) -> dict:
    """KDA_ROWS through linattn.chunk_kda (backend "auto"): the forward without autograd (graph and eager), then
    forward + backward eagerly."""
    import torch
    import linattn
    dev, H, K = "cuda", 32, 128
    for name, B, T in KDA_ROWS:
        def make():
            q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
            k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
            v = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
            g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev) + 3.0)
            beta = torch.rand(B, T, H, device=dev) * 0.9 + 0.05
            h0 = torch.randn(B, H, K, K, device=dev) * 0.1
            return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)

        _time_row(args, out, name, [make(), make()], lambda x: linattn.chunk_kda(**x, output_final_state=True),
                  graph_time, eager_time)
    return out


def train_inputs(op: str, T: int, gate: bool, dev: str, H: int = 16, HV: int = 32, K: int = 128):
    """One input set of a TRAIN_ROWS step: leaves requiring grad (FLA's raw gate input, A_log and dt_bias with
    `gate`), the upstream gradients do / dht, and the op's options."""
    import torch
    import torch.nn.functional as F
    if op == "kda":
        H = HV
    x = dict(q=torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16),
             k=F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(torch.bfloat16),
             v=torch.randn(1, T, HV, K, device=dev, dtype=torch.bfloat16),
             beta=torch.rand(1, T, HV, device=dev) * 0.9 + 0.05,
             initial_state=torch.randn(1, HV, K, K, device=dev) * 0.1)
    gshape = (1, T, HV, K) if op == "kda" else (1, T, HV)
    if gate:
        x["g"] = torch.randn(*gshape, device=dev)
        x["A_log"] = torch.log(torch.rand(HV, device=dev) * 15 + 1)
        x["dt_bias"] = torch.rand(HV * K if op == "kda" else HV, device=dev) * 0.1
    elif op == "kda":
        x["g"] = F.logsigmoid(torch.randn(*gshape, device=dev) + 3.0)
    else:
        x["g"] = -torch.rand(*gshape, device=dev) * 0.1 - 0.01
    x = {n: t.requires_grad_(True) for n, t in x.items()}
    return x, torch.randn_like(x["v"]), torch.randn_like(x["initial_state"]), dict(use_gate_in_kernel=gate)


def _train_rows(args, out, eager_time, dev) -> dict:
    """TRAIN_ROWS: one eager training step (forward with autograd, backward of o and the final state, every .grad
    cleared after it) timed as eager_time times it, and its host us (one step from an idle GPU, median of 20)."""
    import torch
    import linattn
    for name, op, backend, T, gate in TRAIN_ROWS:
        sets = [train_inputs(op, T, gate, dev) for _ in range(2)]
        fn = linattn.chunk_kda if op == "kda" else linattn.chunk_gated_delta_rule

        def step(s, fn=fn, backend=backend):
            x, do, dht, opts = s
            o, ht = fn(**x, output_final_state=True, backend=backend, **opts)
            torch.autograd.backward((o, ht), (do, dht))
            for t in x.values():
                t.grad = None

        row = {"fwdbwd_eager_ms": eager_time(step, sets)}
        host = []
        for i in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(sets[i % 2])
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        row["host_us"] = statistics.median(host)
        out["rows"][name] = row
        print(f"[{args.label}] {name}: {row}", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="LABEL=PATH (a source tree holding linattn/)")
    p.add_argument("--passes", type=int, default=2, help="how many times each tree runs, alternated")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--op", choices=("gdn", "kda", "train"), default="gdn", help="gdn: GDN's forward and decode rows; "
                   "kda: chunk_kda's rows; train: TRAIN_ROWS, host-bound training steps")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        res = _child(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    trees = [t.split("=", 1) for t in args.tree]
    if len(trees) < 2:
        p.error("give two or more --tree LABEL=PATH")
    runs = {label: [] for label, _ in trees}
    for r in range(args.passes):
        order = trees if r % 2 == 0 else trees[::-1]
        for label, path in order:
            res_file = f"/tmp/ab_{label}_{r}.json"
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            t0 = time.time()
            cmd = [sys.executable, os.path.abspath(__file__), "--child", os.path.abspath(path), "--label", label,
                   "--result", res_file, "--repeats", str(args.repeats), "--calls", str(args.calls),
                   "--op", args.op]
            subprocess.run(cmd, env=env, check=True)
            with open(res_file) as f:
                runs[label].append(json.load(f))
            print(f"pass {r} {label}: {time.time() - t0:.0f} s", flush=True)
    labels = [label for label, _ in trees]
    base = labels[0]
    summary = {}
    print(f"\n{'row':<28}{'metric':<16}" + "".join(f"{lb + ' ms':>12}{lb + ' spread':>12}" for lb in labels)
          + "".join(f"{base + '/' + lb:>12}" for lb in labels[1:]))       # > 1: that tree is faster
    for row in runs[base][0]["rows"]:
        for metric in runs[base][0]["rows"][row]:
            vals = {lb: [run["rows"][row][metric] for run in runs[lb]] for lb in labels}
            med = {lb: statistics.median(v) for lb, v in vals.items()}
            spread = {lb: max(v) / min(v) - 1 for lb, v in vals.items()}
            ratios = {lb: med[base] / med[lb] for lb in labels[1:]}    # > 1: faster than the base
            summary[f"{row} | {metric}"] = dict(per_process=vals, median=med, spread=spread, speedup_vs_base=ratios)
            print(f"{row:<28}{metric:<16}" + "".join(f"{med[lb]:>12.4f}{spread[lb] * 100:>11.1f}%" for lb in labels)
                  + "".join(f"{ratios[lb]:>12.3f}" for lb in labels[1:]))
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, os.path.abspath(trees[-1][1]))       # env_line imports linattn: the last tree's
        from common import env_line                      # GPU, clocks, torch, triton, commit (LINATTN_COMMIT)
        with open(args.json, "w") as f:
            json.dump(dict(env=env_line()["line"], trees=dict(trees), summary=summary, runs=runs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
