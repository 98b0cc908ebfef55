"""Eager forward of the gluon backend against its CUDA-graph time (issue 37: within 1.10x at B1 T8192), per tree and
eager segmentation threshold, each (tree, threshold, shape) in a fresh process, alternated, 2 rounds.

    python3 benchmarks/seg_eager_probe.py OUT.json [--variants .:-1 .:0 OTHER_TREE:-1]
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import seg_eager_probe as s; s.SHAPES = [(1, 2048)];
                s.main('OUT.json', [('.', -1)], backend='gluon')"     # the gluon path eagerly where auto picks Triton

A variant is TREE:MIN_TOKENS: the child imports linattn from TREE (PYTHONPATH; the JSON row says which file) and,
for MIN_TOKENS >= 0, patches gluon/chunk_fused_gf.py's GF_SEG_MIN_EAGER_TOKENS (eager calls segment from that many
tokens; -1 keeps the tree's own). Per row: eager_ms (median of 5 x 100 back-to-back calls after 20 warm-up calls),
host_us (one call with the GPU idle, median of 30), graph_ms (a capture made after the eager warm-up, median of 100 replays: linattn.bench.timing.time_graph).
H16/HV32, K = V = 128, bf16, initial and final state, backend auto unless main() is given another. (Also
`--child MIN B T [BACKEND]`: one row.)"""
import json, os, statistics, subprocess, sys, time

SHAPES = [(1, 4096), (1, 8192), (1, 16384), (2, 8192)]


def child(min_tokens, B, T, backend="auto"):
    import torch
    import linattn
    row_file = linattn.__file__
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf as gfm
    if min_tokens >= 0:
        gfm.GF_SEG_MIN_EAGER_TOKENS = min_tokens
    min_tokens = gfm.GF_SEG_MIN_EAGER_TOKENS
    # eager_probe.py's inputs (loaded by path after linattn, so linattn stays the tree's own)
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "eager_probe", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "eager_probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    x = probe._inputs("fwd", B, T, 16, 32, torch)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    fn = lambda: linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                backend=backend)
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    eager = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        eager.append((time.perf_counter() - t) * 10)
    host = []
    for _ in range(30):
        torch.cuda.synchronize()
        t = time.perf_counter(); fn(); host.append((time.perf_counter() - t) * 1e6)
    from linattn.bench.timing import time_graph          # side-stream warm-up, capture, replays
    graph = time_graph(lambda **kw: fn(), [({}, (), ())], 100, "cuda")
    print(json.dumps(dict(linattn=row_file, backend=backend, min_tokens=min_tokens, B=B, T=T, eager_ms=statistics.median(eager), eager_all=eager,
                          host_us=statistics.median(host), graph_ms=graph.get("median_ms"),
                          graph_status=graph.get("reason", "ok"))))


VARIANTS = ((".", -1), (".", 0))

def main(outfile, variants=VARIANTS, backend="auto"):
    rows = []
    for rnd in range(2):
        for B, T in SHAPES:
            for tree, m in variants:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))   # replaces the parent's
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(m), str(B), str(T), backend],
                                   capture_output=True, text=True, timeout=120, cwd=os.path.abspath(tree), env=env)
                line = [l for l in r.stdout.splitlines() if l.startswith("{")]
                row = json.loads(line[-1]) if line else dict(min_tokens=m, B=B, T=T, error=r.stderr[-400:])
                row["round"] = rnd
                row["tree"] = tree
                rows.append(row); print(row, flush=True)
    from linattn.bench.env import collect_env
    json.dump(dict(env=collect_env("cuda"), rows=rows, probe_source=open(__file__).read().splitlines()),
              open(outfile, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
    elif len(sys.argv) > 3 and sys.argv[2] == "--variants":
        main(sys.argv[1], [(v.rsplit(":", 1)[0], int(v.rsplit(":", 1)[1])) for v in sys.argv[3:]])
    else:
        main(sys.argv[1])