"""Shared by the GPU rounds of an opt-in switch of the Triton GDN forward (fused_fwd_round.py: LINATTN_GDN_FUSED_FWD,
split_intra_round.py: LINATTN_GDN_SPLIT_INTRA): the switch and a count of the launches it makes, the gate case
(the forward with the switch on vs the fp64 reference and vs the switch-off forward), the gate loop under a time
budget, the sync-free checks with the switch on, the timing-row loop, the table and the main() driver. Each round
script keeps its own timing row and its row formatter.

A switch's result fields: "<name>_taken" (the counted launches with the switch on), "err_o_<off>" (the switch-off
forward's o vs the reference), "o_vs_<off>" and "state_vs_<off>" (switch on vs off)."""
import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from common import graph_ms, median_ms, round_result, write_json

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TIMING_ROWS = ((1, 8192), (1, 32768), (1, 65536), (8, 4096), (4, 16384))
DRY_TIMING_ROWS = ((1, 130), (2, 65))
START = time.time()


def elapsed():
    return time.time() - START


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def ms(fn, dev):
    """CUDA-graph replay median on a GPU; one host-clock call on the CPU (dry run)."""
    return graph_ms(fn) if dev == "cuda" else median_ms(fn, warmup=1, repeats=1)


@dataclass(frozen=True)
class Switch:
    env: str        # the opt-in environment variable, e.g. LINATTN_GDN_FUSED_FWD
    attr: str       # the function of triton/forward.py that the switch makes the forward call (counted)
    name: str       # "fused": the field "fused_taken" and the table's label
    off: str        # "unfused": the switch-off fields' suffix ("err_o_unfused"); the table says it with spaces

    def set(self, on):
        os.environ[self.env] = "1" if on else "0"

    @property
    def taken_key(self):
        return f"{self.name}_taken"


class LaunchCounter:
    """Counts the calls of forward.<attr> (wraps it until close())."""
    def __init__(self, attr):
        from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
        self.mod, self.attr, self.orig, self.n = fwd_mod, attr, getattr(fwd_mod, attr), 0

        def counted(*a, **kw):
            self.n += 1
            return self.orig(*a, **kw)
        setattr(fwd_mod, attr, counted)

    def close(self):
        setattr(self.mod, self.attr, self.orig)


# ---------------------------------------------------------------- gate

def gate_cases(dry):
    """(name, B, T, H, HV, K, V, dtype, varlen lengths or None, extra) as gdn_fwd_gate.cases() yields them."""
    if dry:
        return [("dry_T65", 2, 65, 2, 4, 32, 32, BF, None, {}),
                ("dry_T1", 1, 1, 2, 4, 32, 32, BF, None, {}),
                ("dry_fp16_no_h0", 1, 130, 1, 2, 64, 64, FP16, None, dict(initial_state=False)),
                ("dry_varlen", 1, 200, 2, 4, 32, 32, BF, [1, 63, 1, 135], {}),
                ("dry_K60_V100", 1, 70, 1, 2, 60, 100, BF, None, {}),
                ("dry_fp32_l2", 1, 100, 1, 2, 32, 32, FP32, None, dict(l2=True, normalize_k=False))]
    from gdn_fwd_gate import cases
    return list(cases())


def gate_case(case, dev, sw, reuse_when_untaken=False):
    """One gate case through the public op with the switch on, then off (NaN-poisoned buffers), against the fp64
    chunk reference; passed when o and the final state are within TOL. reuse_when_untaken: when the switch-on run
    made no counted launch it took the switch-off path, so its output stands for the switch-off run too."""
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, random_cu_seqlens, rel_rms
    name, B, T, H, HV, K, V, dtype, lens, extra = case
    extra = dict(extra)
    l2 = extra.pop("l2", False)
    cu = random_cu_seqlens(lens, dev) if lens else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=dev, num_states=len(lens) if lens else None, **extra)
    out, taken = {}, 0
    counter = LaunchCounter(sw.attr)
    try:
        for on in (True, False):
            if not on and reuse_when_untaken and not taken:
                out[False] = out[True]
                break
            sw.set(on)
            with torch.no_grad(), poisoned_allocations():
                out[on] = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                                         use_qk_l2norm_in_kernel=l2, backend="triton")
            sync(dev)
            if on:
                taken = counter.n
    finally:
        counter.close()
        sw.set(False)
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        ro, rh = chunk_reference(**x64, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    (o, ht), (o_d, ht_d) = out[True], out[False]
    eo, eh = rel_rms(o, ro), rel_rms(ht, rh)
    tol = TOL[dtype]
    return {"case": name, "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": V, "dtype": str(dtype), "varlen": bool(lens),
            sw.taken_key: taken, "err_o": eo, "err_state": eh, f"err_o_{sw.off}": rel_rms(o_d, ro),
            f"o_vs_{sw.off}": rel_rms(o, o_d), f"state_vs_{sw.off}": rel_rms(ht, ht_d), "tol": tol,
            "passed": bool(eo <= tol and eh <= tol)}


def gate(dev, dry, budget, save, sw, run_case):
    """run_case(case, dev) over gate_cases(dry); no new case starts after `budget` seconds (listed as skipped)."""
    rows = []
    for case in gate_cases(dry):
        if elapsed() > budget:
            rows.append(dict(case=case[0], passed=False, error="skipped: gate budget"))
            continue
        t0 = time.time()
        try:
            r = run_case(case, dev)
        except Exception:  # noqa: BLE001
            r = dict(case=case[0], passed=False, error=traceback.format_exc()[-1500:])
        r["s"] = round(time.time() - t0, 2)
        rows.append(r)
        save(rows)
        print(("PASS " if r["passed"] else "FAIL ") + str({k: r.get(k) for k in ("case", sw.taken_key, "err_o",
                                                                             "err_state", f"o_vs_{sw.off}")}),
              flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def sync_free(sw):
    """gdn_fwd_gate's sync-free checks with the switch on; passed only if the switch's launch was also taken."""
    from gdn_fwd_gate import sync_free_checks
    counter = LaunchCounter(sw.attr)
    sw.set(True)
    try:
        out = sync_free_checks("triton")
    finally:
        sw.set(False)
        counter.close()
    out[sw.taken_key] = counter.n
    out["passed"] = bool(out["passed"] and counter.n > 0)
    return out


# ---------------------------------------------------------------- timing and table

def forward_ms(row, x, dev, sw, off_key, on_key):
    """The whole forward (public op, final state) with the switch off into row[off_key], on into row[on_key]."""
    import linattn
    for on in (False, True):
        sw.set(on)
        try:
            def call():
                return linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
            with torch.no_grad():
                row[on_key if on else off_key] = ms(call, dev)
        finally:
            sw.set(False)


def row_line(r, table_row):
    """A timing row's table line: table_row(r) for a row that ran, the error for one that did not."""
    return f"  B{r['B']} T{r['T']}: ERROR {r['error'][:200]}" if "error" in r else table_row(r)


def timing(dev, dry, budget, save, timing_row, table_row):
    rows = []
    for B, T in (DRY_TIMING_ROWS if dry else TIMING_ROWS):
        if elapsed() > budget:
            rows.append(dict(B=B, T=T, error="skipped: budget"))
            continue
        try:
            rows.append(timing_row(B, T, dev, dry))
        except Exception:  # noqa: BLE001
            rows.append(dict(B=B, T=T, error=traceback.format_exc()[-1500:]))
        save(rows)
        print(row_line(rows[-1], table_row), flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(res, sw, table_row):
    off = sw.off.replace("_", " ")
    lines = ["gate: " + ("PASSED" if res.get("gate_passed") else "NOT PASSED")
             + ("" if res.get("gate_complete", True) else " (cases skipped for the budget)")]
    for c in res.get("gate", []):
        lines.append(f"  {c['case']}: ERROR {c['error'][:200]}" if "error" in c else
                     f"  {c['case']}: {sw.name} {c[sw.taken_key]} o {c['err_o']:.2e} state {c['err_state']:.2e} "
                     f"({off} o {c[f'err_o_{sw.off}']:.2e}, {sw.name} vs {off} {c[f'o_vs_{sw.off}']:.1e}) "
                     f"tol {c['tol']} {'ok' if c['passed'] else 'FAIL'}")
    if "sync_free" in res:
        lines.append(f"  sync free: {res['sync_free']}")
    lines += [row_line(r, table_row) for r in res.get("timing", [])]
    return "\n".join(lines)


# ---------------------------------------------------------------- driver

def main(script, json_name, sw, run_case, timing_row, table_row, budget, gate_budget, margin):
    """The round: gate (run_case over the case matrix, then the sync-free checks on a GPU), and only if it passed,
    timing_row over the timing rows; DIR/json_name rewritten after every case and row, then the table printed.
    budget: total seconds, no timing row starts after budget - margin; gate_budget: no gate case starts after it."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=budget,
                    help=f"total seconds: no timing row starts after budget - {margin}")
    ap.add_argument("--gate-budget", type=float, default=gate_budget, help="seconds; no new gate case starts after it")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    a = ap.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run with TRITON_INTERPRET=1 for a CPU run of the logic")
    path = os.path.join(a.out, json_name)
    res = round_result(script, dev, dry_run=a.dry_run)
    torch.manual_seed(0)

    def saver(key):
        def save(rows):
            res[key] = rows
            write_json(path, res)
        return save
    res["gate"] = gate(dev, a.dry_run, a.gate_budget, saver("gate"), sw, run_case)
    if dev == "cuda":
        try:
            res["sync_free"] = sync_free(sw)
        except Exception:  # noqa: BLE001
            res["sync_free"] = dict(passed=False, error=traceback.format_exc()[-1500:])
    # a case skipped for the gate budget is not a failure (gate_complete says whether every case ran); a failed
    # or erroring case or sync check keeps the timing from running
    ran = [c for c in res["gate"] if not str(c.get("error", "")).startswith("skipped")]
    res["gate_complete"] = len(ran) == len(res["gate"])
    res["gate_passed"] = bool(ran and all(c.get("passed") for c in ran)
                              and res.get("sync_free", {"passed": True})["passed"])
    res["gate_s"] = round(elapsed(), 1)
    write_json(path, res)
    if res["gate_passed"] and not a.no_timing:
        res["timing"] = timing(dev, a.dry_run, a.budget - margin, saver("timing"), timing_row, table_row)
    res["total_s"] = round(elapsed(), 1)
    write_json(path, res)
    print(table(res, sw, table_row))
    print(f"results: {path} ({res['total_s']:.0f} s)")
