"""GPU round for the two-kernel stage 2 of the Triton GDN forward (triton/intra_split.py, LINATTN_GDN_SPLIT_INTRA=1):
`python benchmarks/gpu/split_intra_round.py --out DIR` (< 120 s on an H200).

1. gate: the forward gate's case matrix (gdn_fwd_gate.cases(): T in {1, 63, 64, 65, 8192, 65536}, B=8, GVA, fp16
   without initial state, varlen at T=65536 with 1-token sequences, small varlen fp32, K/V in {64, 60/100, 100/60,
   256, 16/32}, mixed dtypes, in-kernel L2 norm) through the public op with the switch on, NaN-poisoned buffers,
   against the fp64 chunk reference (relative RMS, TOL per dtype); per case whether the split stage was taken (it
   always is with the switch on) and the distance of o from the one-kernel forward on the same inputs. No new case
   starts after --gate-budget seconds (skipped ones are listed; only a failed case stops the timing). Then
   gdn_fwd_gate's sync-free checks (sync debug mode "error", CUDA-graph capture of a varlen call) with the switch on.
2. only if the gate is green, timing by CUDA-graph replay (median) at the production rows B1 T8192/32768/65536,
   B8 T4096, B4 T16384 (H16 HV32 K=V=128 bf16, initial and final state): stage 2 alone as the forward launches it
   (intra_chunk_wy_kernel) vs the split launcher (kkt_solve + wu, Tinv through a bf16 buffer), each of the two split
   kernels alone, and the split launcher with the backward's fp32 Tinv (store_tinv); w and u of the split checked
   against the one-kernel stage's; then the whole forward with the switch off and on.
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (host-clock times, no graphs).
Writes DIR/split_intra.json after every case and row (a timeout keeps what was measured) and prints a table.
"""
import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                       # common, gdn_fwd_gate
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))     # linattn from this checkout
import torch  # noqa: E402
from common import graph_ms, median_ms, write_json  # noqa: E402

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TIMING_ROWS = ((1, 8192), (1, 32768), (1, 65536), (8, 4096), (4, 16384))
START = time.time()
SWITCH = "LINATTN_GDN_SPLIT_INTRA"


def _elapsed():
    return time.time() - START


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _set_split(on):
    os.environ[SWITCH] = "1" if on else "0"


class _SplitCounter:
    """Counts the split launches the forward makes (wraps forward.intra_split)."""
    def __init__(self):
        from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
        self.mod, self.orig, self.n = fwd_mod, fwd_mod.intra_split, 0

        def counted(*a, **kw):
            self.n += 1
            return self.orig(*a, **kw)
        fwd_mod.intra_split = counted

    def close(self):
        self.mod.intra_split = self.orig


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


def run_gate_case(case, dev):
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, random_cu_seqlens, rel_rms
    name, B, T, H, HV, K, V, dtype, lens, extra = case
    extra = dict(extra)
    l2 = extra.pop("l2", False)
    cu = random_cu_seqlens(lens, dev) if lens else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=dev, num_states=len(lens) if lens else None, **extra)
    out = {}
    counter = _SplitCounter()
    try:
        for on in (True, False):
            _set_split(on)
            with torch.no_grad(), poisoned_allocations():
                out[on] = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                                         use_qk_l2norm_in_kernel=l2, backend="triton")
            _sync(dev)
            if on:
                taken = counter.n
    finally:
        counter.close()
        _set_split(False)
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        ro, rh = chunk_reference(**x64, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    (o, ht), (o_d, ht_d) = out[True], out[False]
    eo, eh = rel_rms(o, ro), rel_rms(ht, rh)
    tol = TOL[dtype]
    return dict(case=name, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=str(dtype), varlen=bool(lens), split_taken=taken,
                err_o=eo, err_state=eh, err_o_one_kernel=rel_rms(o_d, ro), o_vs_one_kernel=rel_rms(o, o_d),
                state_vs_one_kernel=rel_rms(ht, ht_d), tol=tol,
                passed=bool(eo <= tol and eh <= tol and taken == 1))


def gate(dev, dry, budget, save):
    rows = []
    for case in gate_cases(dry):
        if _elapsed() > budget:
            rows.append(dict(case=case[0], passed=False, error="skipped: gate budget"))
            continue
        t0 = time.time()
        try:
            r = run_gate_case(case, dev)
        except Exception:  # noqa: BLE001
            r = dict(case=case[0], passed=False, error=traceback.format_exc()[-1500:])
        r["s"] = round(time.time() - t0, 2)
        rows.append(r)
        save(rows)
        print(("PASS " if r["passed"] else "FAIL ") + str({k: r.get(k) for k in ("case", "split_taken", "err_o",
                                                                             "err_state", "o_vs_one_kernel")}),
              flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def sync_free():
    from gdn_fwd_gate import sync_free_checks
    counter = _SplitCounter()
    _set_split(True)
    try:
        out = sync_free_checks("triton")
    finally:
        _set_split(False)
        counter.close()
    out["split_taken"] = counter.n
    out["passed"] = bool(out["passed"] and counter.n > 0)
    return out


# ---------------------------------------------------------------- timing

def _ms(fn, dev):
    return graph_ms(fn) if dev == "cuda" else median_ms(fn, warmup=1, repeats=1)


def timing_row(B, T, dev, dry):
    import linattn
    from linattn.ops.gated_delta_rule.triton import intra_split as sm
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs
    from linattn.ops.gated_delta_rule.triton.intra_chunk import intra_chunk_wy_kernel
    from linattn.testing import make_gdn_inputs, rel_rms
    H, HV, K, V = (1, 2, 64, 64) if dry else (16, 32, 128, 128)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=BF, device=dev)
    k, v, g, beta = x["k"], x["v"], x["g"], x["beta"]
    plan = make_chunk_plan(B, T, None, CHUNK, dev)
    Tt, slots, N = plan.T_total, plan.num_slots, plan.N
    cfg = _configs(K, V, N, HV, dev)
    scfg = sm.split_intra_config(K, V)
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, split_cfg=vars(scfg))

    def bufs():
        return (torch.empty(Tt, HV, device=dev), torch.empty(Tt, HV, K, dtype=BF, device=dev),
                torch.empty(Tt, HV, V, dtype=BF, device=dev))
    g1, w1, u1 = bufs()

    def one_kernel():                          # stage 2 as forward.py launches it by default
        intra_chunk_wy_kernel[(slots, HV)](
            k, v, g, beta, g1, w1, u1, g1, plan.cu, plan.chunk_indices, N, H=H, HV=HV, K=K, V=V, BT=CHUNK,
            BK=cfg.BK_intra, BV=cfg.BV_intra, STORE_TINV=False, DOT_PREC="tf32", num_warps=cfg.warps_intra)
    g2, w2, u2 = bufs()
    tinv16 = torch.empty(Tt, HV, CHUNK, dtype=BF, device=dev)
    tinv32 = torch.empty(Tt, HV, CHUNK, dtype=FP32, device=dev)

    def kkt(tinv):
        sm.kkt_solve_kernel[(slots, HV)](k, g, beta, g2, tinv, plan.cu, plan.chunk_indices, N, H=H, HV=HV, K=K,
                                         BT=CHUNK, BK=scfg.BK_kkt, DOT_PREC="tf32", num_warps=scfg.warps_kkt)

    def wu(tinv):
        sm.wu_kernel[(slots, HV)](k, v, beta, g2, tinv, w2, u2, plan.cu, plan.chunk_indices, N, H=H, HV=HV, K=K,
                                  V=V, BT=CHUNK, BK=scfg.BK, BV=scfg.BV, DOT_PREC="tf32", num_warps=scfg.warps_wu)

    def split():                               # the launcher as the forward calls it (bf16 Tinv buffer inside)
        sm.intra_split(k, v, g, beta, g2, w2, u2, None, plan, H=H, HV=HV, K=K, V=V, dot_prec="tf32")
    one_kernel()
    for t in (g2, w2, u2):
        t.fill_(float("nan"))
    split()
    _sync(dev)
    row["w_vs_one_kernel"], row["u_vs_one_kernel"] = rel_rms(w2, w1), rel_rms(u2, u1)
    row["gcum_vs_one_kernel"] = rel_rms(g2, g1)
    row["stage2_one_kernel_ms"] = _ms(one_kernel, dev)
    row["stage2_split_ms"] = _ms(split, dev)
    row["kkt_solve_ms"] = _ms(lambda: kkt(tinv16), dev)
    row["wu_ms"] = _ms(lambda: wu(tinv16), dev)
    row["kkt_solve_f32_ms"] = _ms(lambda: kkt(tinv32), dev)
    row["wu_f32_ms"] = _ms(lambda: wu(tinv32), dev)
    row["stage2_speedup"] = row["stage2_one_kernel_ms"] / row["stage2_split_ms"]
    del tinv16, tinv32
    for on in (False, True):
        _set_split(on)
        try:
            def call():
                return linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
            with torch.no_grad():
                row["fwd_split_ms" if on else "fwd_one_kernel_ms"] = _ms(call, dev)
        finally:
            _set_split(False)
    row["fwd_speedup"] = row["fwd_one_kernel_ms"] / row["fwd_split_ms"]
    return row


def timing(dev, dry, budget, save):
    rows = []
    for B, T in (((1, 130), (2, 65)) if dry else TIMING_ROWS):
        if _elapsed() > budget:
            rows.append(dict(B=B, T=T, error="skipped: budget"))
            continue
        try:
            rows.append(timing_row(B, T, dev, dry))
        except Exception:  # noqa: BLE001
            rows.append(dict(B=B, T=T, error=traceback.format_exc()[-1500:]))
        save(rows)
        print(table_row(rows[-1]), flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def table_row(r):
    if "error" in r:
        return f"  B{r['B']} T{r['T']}: ERROR {r['error'][:200]}"
    return (f"  B{r['B']} T{r['T']}: stage 2 one kernel {r['stage2_one_kernel_ms']:.3f} ms | split "
            f"{r['stage2_split_ms']:.3f} (kkt_solve {r['kkt_solve_ms']:.3f} + wu {r['wu_ms']:.3f}; fp32 Tinv "
            f"{r['kkt_solve_f32_ms']:.3f} + {r['wu_f32_ms']:.3f}) x{r['stage2_speedup']:.2f} | w/u vs one kernel "
            f"{r['w_vs_one_kernel']:.1e}/{r['u_vs_one_kernel']:.1e} | fwd {r['fwd_one_kernel_ms']:.3f} -> "
            f"{r['fwd_split_ms']:.3f} ms (x{r['fwd_speedup']:.2f})")


def table(res):
    lines = ["gate: " + ("PASSED" if res.get("gate_passed") else "NOT PASSED")
             + ("" if res.get("gate_complete", True) else " (cases skipped for the budget)")]
    for c in res.get("gate", []):
        lines.append(f"  {c['case']}: ERROR {c['error'][:200]}" if "error" in c else
                     f"  {c['case']}: split {c['split_taken']} o {c['err_o']:.2e} state {c['err_state']:.2e} "
                     f"(one kernel o {c['err_o_one_kernel']:.2e}, split vs one kernel {c['o_vs_one_kernel']:.1e}) "
                     f"tol {c['tol']} {'ok' if c['passed'] else 'FAIL'}")
    if "sync_free" in res:
        lines.append(f"  sync free: {res['sync_free']}")
    lines += [table_row(r) for r in res.get("timing", [])]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=115.0, help="total seconds: no timing row starts after budget - 20")
    ap.add_argument("--gate-budget", type=float, default=60.0, help="seconds; no new gate case starts after it")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    a = ap.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run with TRITON_INTERPRET=1 for a CPU run of the logic")
    path = os.path.join(a.out, "split_intra.json")
    res = dict(script="split_intra_round.py", device=dev, dry_run=a.dry_run)
    try:
        from common import env_line
        res["env"] = env_line()["line"]
    except Exception as e:  # noqa: BLE001
        res["env"] = repr(e)[:200]
    torch.manual_seed(0)

    def saver(key):
        def save(rows):
            res[key] = rows
            write_json(path, res)
        return save
    res["gate"] = gate(dev, a.dry_run, a.gate_budget, saver("gate"))
    if dev == "cuda":
        try:
            res["sync_free"] = sync_free()
        except Exception:  # noqa: BLE001
            res["sync_free"] = dict(passed=False, error=traceback.format_exc()[-1500:])
    # a case skipped for the gate budget is not a failure (gate_complete says whether every case ran); a failed
    # or erroring case or sync check keeps the timing from running
    ran = [c for c in res["gate"] if not str(c.get("error", "")).startswith("skipped")]
    res["gate_complete"] = len(ran) == len(res["gate"])
    res["gate_passed"] = bool(ran and all(c.get("passed") for c in ran)
                              and res.get("sync_free", {"passed": True})["passed"])
    res["gate_s"] = round(_elapsed(), 1)
    write_json(path, res)
    if res["gate_passed"] and not a.no_timing:
        res["timing"] = timing(dev, a.dry_run, a.budget - 20, saver("timing"))
    res["total_s"] = round(_elapsed(), 1)
    write_json(path, res)
    print(table(res))
    print(f"results: {path} ({res['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
