"""Shared by the GPU rounds of an opt-in v2 stage of the Triton GDN backward (bwd_wy_round.py: LINATTN_GDN_BWD_WY=v2,
triton/backward_wy_v2.py; bwd_local_round.py: LINATTN_GDN_BWD_LOCAL=v2, triton/backward_local_v2.py). Each script
names its `Stage` and calls main(stage).

1. gate: gdn_bwd_gate.py's gate cases (T=65536 B1 H16/HV32 K=V=128 bf16; varlen of mixed lengths with 1-token
   sequences, GVA, l2norm; a fp16 batch with K=100, V=60 and mixed gate dtypes) through the public op's forward and
   backward with the switch ON, NaN-poisoned buffers, every gradient against autograd through the fp64 chunk
   reference on the GPU (gdn_bwd_gate's helpers and tolerances); per case the number of v2 launches (must be 1) and
   the stage's gradients with the switch on against the switch off on the same inputs ("vs_v1"). No new case
   starts after --gate-budget seconds (listed as skipped; only a failed case stops the timing).
2. only if the gate is green: the whole backward (triton/backward.py: recompute + stages 1a-3), CUDA-graph replay
   median, with the switch off and on in the same process (and, where the stage says so, with both opt-in stages
   on), at B1 T65536, B8 T4096 and B1 T8192 (H16 HV32 K=V=128 bf16, initial state and dht).
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (host-clock times, no graphs).
Writes DIR/bwd_<stage>.json after every case and row (a timeout keeps what was measured) and prints a table.
"""
import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                       # common, gdn_bwd_gate
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))     # linattn from this checkout
import torch  # noqa: E402
from common import graph_ms, median_ms, round_result, write_json  # noqa: E402

ENV_WY = "LINATTN_GDN_BWD_WY"
TIMING_ROWS = ((1, 65536), (8, 4096), (1, 8192))
DRY_TIMING_ROWS = ((1, 130), (2, 65))
START = time.time()


@dataclass(frozen=True)
class Stage:
    name: str                  # "wy" | "local": DIR/bwd_<name>.json, the row key "<name>_saved_ms"
    label: str                 # "WY stage"
    env: str                   # the opt-in switch (value "v2")
    module_attr: str           # backward.py's name for the v2 kernel's module
    kernel: str                # the v2 kernel's name in that module
    vs_grads: Tuple[str, ...]  # gradients compared switch on vs off
    with_wy: bool = False      # a third timing column: this stage's v2 and WY v2 together


def elapsed():
    return time.time() - START


def set_switch(stage, on, wy=False):
    """The stage's switch on or off; wy=True also turns WY v2 on (off otherwise, unless it is the stage)."""
    wanted = {stage.env: on}
    wanted[ENV_WY] = wanted.get(ENV_WY, False) or wy
    for env, want in wanted.items():
        os.environ[env] = "v2" if want else "v1"          # explicit both ways: v2 is the default since round 13


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


class V2Counter:
    """Counts the v2 kernel's launches from backward.py (wraps its module reference until close())."""
    def __init__(self, stage):
        from linattn.ops.gated_delta_rule.triton import backward as bw
        self.bw, self.attr, self.orig, self.n = bw, stage.module_attr, getattr(bw, stage.module_attr), 0
        counter, orig, kernel = self, self.orig, stage.kernel

        class Launch:
            def __getitem__(self, grid):
                def run(*a, **kw):
                    counter.n += 1
                    return getattr(orig, kernel)[grid](*a, **kw)
                return run

        class Proxy:                      # the module, with its v2 kernel counted
            def __getattr__(self, name):
                return Launch() if name == kernel else getattr(orig, name)
        setattr(bw, self.attr, Proxy())

    def close(self):
        setattr(self.bw, self.attr, self.orig)


# ---------------------------------------------------------------- gate

def gate_case(stage, case, dev, dry):
    import gdn_bwd_gate as gg
    from linattn.runtime.alloc import poisoned_allocations
    inp, cu = gg._make(case, dev)
    l2 = case.get("l2norm", False)
    ref, do, dht = gg._reference_grads(inp, cu, l2)
    got, counter = {}, V2Counter(stage)
    try:
        for on in (True, False):
            set_switch(stage, on)
            with poisoned_allocations():
                out = gg._run_op(gg._ours(), inp, cu, l2, do, dht)
            sync(dev)
            got[on] = {n: t.detach().clone() for n, t in out.items()}
            if on:
                taken = counter.n
    finally:
        counter.close()
        set_switch(stage, False)
    errs, ok = gg._errors(got[True], ref, inp["q"].dtype)
    vs = {n: gg._rel(got[True][n], got[False][n]) for n in stage.vs_grads if n in got[True]}
    return {"case": case["name"], "shape": case, "v2_taken": taken, "errors": errs, "vs_v1": vs,
            "errors_v1": gg._errors(got[False], ref, inp["q"].dtype)[0], "passed": bool(ok and taken == 1)}


def gate(stage, dev, dry, budget, save):
    import gdn_bwd_gate as gg
    rows = []
    for case in gg._sizes(dry)["gate"]:
        if elapsed() > budget:
            rows.append(dict(case=case["name"], passed=False, error="skipped: gate budget"))
            continue
        t0 = time.time()
        try:
            r = gate_case(stage, case, dev, dry)
        except Exception:  # noqa: BLE001
            r = dict(case=case["name"], passed=False, error=traceback.format_exc()[-1500:])
        r["s"] = round(time.time() - t0, 2)
        rows.append(r)
        save(rows)
        print(("PASS " if r["passed"] else "FAIL ") + str({k: r.get(k) for k in ("case", "v2_taken", "errors",
                                                                             "vs_v1", "error")}), flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- timing

def timing_row(stage, B, T, dev, dry):
    from linattn.ops.gated_delta_rule.triton import backward as bw
    from linattn.testing import make_gdn_inputs
    H, HV, K, V = (1, 2, 64, 64) if dry else (16, 32, 128, 128)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=dev)
    do = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, device=dev)
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V)

    def call():
        return bw.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"],
                                             None, do, dht)
    columns = [("bwd_v1_ms", False, False), ("bwd_v2_ms", True, False)]
    if stage.with_wy:
        columns.append(("bwd_both_ms", True, True))
    for key, on, wy in columns:
        set_switch(stage, on, wy)
        try:
            with torch.no_grad():
                row[key] = graph_ms(call) if dev == "cuda" else median_ms(call, warmup=1, repeats=1)
        finally:
            set_switch(stage, False)
    row["speedup"] = row["bwd_v1_ms"] / row["bwd_v2_ms"]
    row[f"{stage.name}_saved_ms"] = row["bwd_v1_ms"] - row["bwd_v2_ms"]
    return row


def row_line(stage, r):
    if "error" in r:
        return f"  B{r['B']} T{r['T']}: ERROR {r['error'][:200]}"
    line = (f"  B{r['B']} T{r['T']}: backward v1 {r['bwd_v1_ms']:.3f} ms | v2 {r['bwd_v2_ms']:.3f} ms "
            f"(x{r['speedup']:.3f}, {stage.label} {r[stage.name + '_saved_ms']:+.3f} ms saved)")
    if "bwd_both_ms" in r:
        line += f" | {stage.name} v2 + WY v2 {r['bwd_both_ms']:.3f} ms"
    return line


def timing(stage, dev, dry, budget, save):
    rows = []
    for B, T in (DRY_TIMING_ROWS if dry else TIMING_ROWS):
        if elapsed() > budget:
            rows.append(dict(B=B, T=T, error="skipped: budget"))
            continue
        try:
            rows.append(timing_row(stage, B, T, dev, dry))
        except Exception:  # noqa: BLE001
            rows.append(dict(B=B, T=T, error=traceback.format_exc()[-1500:]))
        save(rows)
        print(row_line(stage, rows[-1]), flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(stage, res):
    lines = ["gate: " + ("PASSED" if res.get("gate_passed") else "NOT PASSED")
             + ("" if res.get("gate_complete", True) else " (cases skipped for the budget)")]
    for c in res.get("gate", []):
        if "error" in c:
            lines.append(f"  {c['case']}: ERROR {c['error'][:200]}")
            continue
        errs = " ".join(f"{n if n in ('o', 'final_state') else 'd' + n} "
                        + (f"{e:.1e}" if isinstance(e, float) else str(e)) for n, e in c["errors"].items())
        vs = " ".join(f"d{n} {e:.1e}" for n, e in c["vs_v1"].items())
        lines.append(f"  {c['case']}: v2 taken {c['v2_taken']} | vs fp64: {errs} | vs v1: {vs} "
                     f"{'ok' if c['passed'] else 'FAIL'}")
    lines += [row_line(stage, r) for r in res.get("timing", [])]
    return "\n".join(lines)


def main(stage, script):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=140.0, help="total seconds: no timing row starts after budget-25")
    ap.add_argument("--gate-budget", type=float, default=75.0, help="seconds; no new gate case starts after it")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    a = ap.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run with TRITON_INTERPRET=1 for a CPU run of the logic")
    path = os.path.join(a.out, f"bwd_{stage.name}.json")
    res = round_result(script, dev, dry_run=a.dry_run)
    torch.manual_seed(0)

    def saver(key):
        def save(rows):
            res[key] = rows
            write_json(path, res)
        return save
    res["gate"] = gate(stage, dev, a.dry_run, a.gate_budget, saver("gate"))
    ran = [c for c in res["gate"] if not str(c.get("error", "")).startswith("skipped")]
    res["gate_complete"] = len(ran) == len(res["gate"])
    res["gate_passed"] = bool(ran and all(c.get("passed") for c in ran))
    res["gate_s"] = round(elapsed(), 1)
    write_json(path, res)
    if res["gate_passed"] and not a.no_timing:
        res["timing"] = timing(stage, dev, a.dry_run, a.budget - 25, saver("timing"))
    res["total_s"] = round(elapsed(), 1)
    write_json(path, res)
    print(table(stage, res))
    print(f"results: {path} ({res['total_s']:.0f} s)")
