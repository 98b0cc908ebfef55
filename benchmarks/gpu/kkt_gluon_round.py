"""GPU round for the Gluon stage 2a (gluon/kkt_solve.py, opt-in LINATTN_GDN_GLUON_KKT) against the Triton kernel the
gluon forward launches today (chunk_fused_wu_ws.kkt_solve: kkt_solve_v4_kernel in kkt_order's program order):
`python benchmarks/gpu/kkt_gluon_round.py --out DIR [--budget 150] [--dry-run]`.

Per row (H16 HV32 K=128 bf16 unless named: B1 T8192, B1 T65536, B8 T4096, the 24-sequence varlen row of
linattn.bench.presets.PRODUCTION_VARLEN; then the boundary rows: varlen with 1-token sequences and lengths not a
multiple of 64, B2 T100, GVA 1 (H=HV=8) and GVA 4 (H4 HV16)):
1. the Triton kernel ("ref") and each Gluon form (FORMS: name -> (form, register cap)) launched into NaN-filled gcum
   and Tinv buffers: every value finite, gcum equal to ref's (torch.equal), Tinv bit-equal to ref's (recorded), and
   the Tinv error of each against torch.linalg.inv(I + A) in float64 on a sample of (chunk, value head) pairs
   (kkt_v2_round.tinv_errors); ok when each form's worst error is <= 1.25 x ref's worst + 1e-5.
2. timing of each (median of CUDA-event repeats, eager launches, the same buffers), ratio ref / form; then the
   same as CUDA-graph replays (graph_speedup_*).
Every row's checks run before its timing; a row that raises is recorded with its error. `--dry-run` needs a GPU too
(Gluon does not run under the interpreter): it only checks the script's logic on the CPU by skipping every launch.
Writes DIR/kkt_gluon.json after every row.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))
import torch  # noqa: E402
from common import graph_ms, median_ms, run_rows, start_round, write_json  # noqa: E402
from kkt_v2_round import chunk_list, tinv_errors  # noqa: E402

START = time.time()
# (B, T, H, HV, lengths or None)
ROWS = [(1, 8192, 16, 32, None), (1, 65536, 16, 32, None), (8, 4096, 16, 32, None), (1, "varlen", 16, 32, None),
        (1, "edge", 16, 32, [1, 63, 1, 65, 70, 130, 1, 200]), (2, 100, 16, 32, None), (2, 1000, 8, 8, None),
        (1, 3000, 4, 16, None)]
FORMS = {"plain": ("plain", None), "shift": ("shift", None), "split": ("split", None), "ftz": ("ftz", None)}
if os.environ.get("KKT_GLUON_FORMS"):            # kkt_solve.FORMS names, each optionally "_r<register cap>"
    FORMS = {n: (n.split("_r")[0], int(n.split("_r")[1]) if "_r" in n else None)
             for n in os.environ["KKT_GLUON_FORMS"].split(",")}
SAMPLE = 256
BOUND, FLOOR = 1.25, 1e-5


def row_inputs(B, T, H, HV, lens, dev):
    from linattn.bench.presets import PRODUCTION_VARLEN
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.testing import make_gdn_inputs
    cu, N = None, B
    if T in ("varlen", "edge"):
        lens = lens or PRODUCTION_VARLEN["lengths"]
        T, N = sum(lens), len(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=dev)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, device=dev, num_states=N, initial_state=False,
                        generator=torch.Generator().manual_seed(int(time.time() * 1e6) % 2 ** 31))
    plan = make_chunk_plan(B, T, cu, 64, dev)
    return x["k"], x["g"], x["beta"], cu, T, plan


def run_row(B, T, H, HV, lens, dev, timed):
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import kkt_solve
    from linattn.ops.gated_delta_rule.gluon.kkt_solve import kkt_solve_gluon
    k, g, beta, cu, T, plan, = row_inputs(B, T, H, HV, lens, dev)
    row = dict(B=B, T=T, H=H, HV=HV, varlen=cu is not None, slots=plan.num_slots, lengths=lens)
    Tt = plan.T_total
    os.environ["LINATTN_GDN_GLUON_KKT"] = "0"      # "ref": the Triton kernel (unset is the Gluon default since round 26)

    def ref(gcum=None, tinv=None):
        if gcum is None:
            return kkt_solve(k, g, beta, plan, HV)
        gc, ti = kkt_solve(k, g, beta, plan, HV)
        gcum.copy_(gc)
        tinv.copy_(ti)

    def form(name):
        f, cap = FORMS[name]
        return lambda gcum=None, tinv=None: kkt_solve_gluon(k, g, beta, plan, HV, f, cap, gcum=gcum, tinv=tinv)

    runs = {"ref": ref, **{n: form(n) for n in FORMS}}
    outs = {}
    for name, fn in runs.items():
        gcum = torch.full((Tt, HV), float("nan"), dtype=torch.float32, device=dev)
        tinv = torch.full((Tt, HV, 64), float("nan"), dtype=torch.bfloat16, device=dev)
        if name == "ref":
            gcum, tinv = fn()            # kkt_solve allocates its own (NaN-poisoned under the tests' allocator)
        else:
            fn(gcum, tinv)
        outs[name] = (gcum, tinv)
    torch.cuda.synchronize()
    chunks = chunk_list(B, T, cu)
    pick = torch.Generator().manual_seed(int(time.time()) % 1000)
    n_pairs = min(SAMPLE, len(chunks) * HV)
    idx = torch.randperm(len(chunks) * HV, generator=pick)[:n_pairs].tolist()
    pairs = [(chunks[j // HV], j % HV) for j in idx]
    err = tinv_errors({n: o[1] for n, o in outs.items()}, k, g, beta, pairs, H, HV)
    row["tinv_err"] = err
    ok = True
    for n in FORMS:
        gc, ti = outs[n]
        fin = bool(torch.isfinite(gc).all()) and bool(torch.isfinite(ti).all())
        geq = bool(torch.equal(gc, outs["ref"][0]))
        teq = bool(torch.equal(ti, outs["ref"][1]))
        eok = err[n]["max"] <= BOUND * err["ref"]["max"] + FLOOR
        row[n] = dict(finite=fin, gcum_equal=geq, tinv_equal=teq, err_ok=eok,
                      gcum_max_abs_diff=float((gc - outs["ref"][0]).abs().max()))
        ok = ok and fin and eok
    row["ok"] = ok
    del outs
    if timed:
        for _ in range(2):                 # two rounds in turn; the better kept per kernel
            for name, fn in runs.items():
                ms = median_ms(fn, warmup=5, repeats=30)     # each allocates its gcum and Tinv, as the forward
                row[f"{name}_ms"] = min(ms, row.get(f"{name}_ms", ms))
        for n in FORMS:
            row[f"speedup_{n}"] = row["ref_ms"] / row[f"{n}_ms"]
        # CUDA-graph replays too (round 27: the eager per-call times of the ~0.05-0.1 ms B1 T8192 row moved 1.7x between
        # sessions on both sides, host launch cost inside the events); the eager ones stay for comparison with
        # earlier rounds
        for _ in range(2):
            for name, fn in runs.items():
                ms = graph_ms(fn, repeats=30)
                row[f"{name}_graph_ms"] = min(ms, row.get(f"{name}_graph_ms", ms))
        for n in FORMS:
            row[f"graph_speedup_{n}"] = row["ref_graph_ms"] / row[f"{n}_graph_ms"]
    return row


def main():
    args, dry, dev, path, res = start_round(__file__, "kkt_gluon.json", budget=150.0)
    res["forms"] = FORMS
    if dry:
        res["skipped"].append("dry run: Gluon kernels need the GPU")
        write_json(path, res)
        return
    rows = [(i, r) for i, r in enumerate(ROWS)]
    if os.environ.get("KKT_GLUON_ROWS"):          # a subset of ROWS by index, e.g. "0,1,2,3"
        rows = [rows[int(i)] for i in os.environ["KKT_GLUON_ROWS"].split(",")]

    def line(row):
        sp = " ".join(f"{n} {row.get('speedup_' + n, 0):.3f}x" for n in FORMS)
        gsp = " ".join(f"{n} {row.get('graph_speedup_' + n, 0):.3f}x" for n in FORMS)
        return (f"B{row.get('B')} T{row.get('T')} H{row.get('H')}/{row.get('HV')} ok={row.get('ok')} "
                f"ref {row.get('ref_ms', 0):.4f} ms {sp}; graphs: ref {row.get('ref_graph_ms', 0):.4f} ms {gsp} "
                + str({n: row.get(n) for n in FORMS}))

    run_rows(res, path, rows, lambda i, r: run_row(*r, dev, i < 4), line, args.budget, START)
    write_json(path, res)


if __name__ == "__main__":
    main()
