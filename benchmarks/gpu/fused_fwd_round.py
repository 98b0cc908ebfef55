"""GPU round for the fused state pass + output of the Triton GDN forward (triton/chunk_fused_fwd.py,
LINATTN_GDN_FUSED_FWD=1): `python benchmarks/gpu/fused_fwd_round.py --out DIR` (< 150 s on an H200).

1. gate: the forward gate's case matrix (gdn_fwd_gate.cases(): T in {1, 63, 64, 65, 8192, 65536}, B=8, GVA, fp16
   without initial state, varlen at T=65536 with 1-token sequences, small varlen fp32, K/V in {64, 60/100, 100/60,
   256, 16/32}, mixed dtypes, in-kernel L2 norm) through the public op with the switch on, NaN-poisoned buffers,
   against the fp64 chunk reference (relative RMS, TOL per dtype); per case also whether the fused kernel was
   taken (the forward takes it for 16-bit inputs with K <= 128 on a GPU: chunk_fused_fwd.fused_fwd_wanted) and
   its distance from the unfused forward on the same inputs. No new case starts after --gate-budget seconds (the
   skipped ones are listed; only a failed case stops the timing). Then gdn_fwd_gate's sync-free checks (sync debug
   mode "error", CUDA-graph capture of a varlen call replayed on new data) with the switch on.
2. only if the gate is green, timing by CUDA-graph replay (median) at the production rows B1 T8192/32768/65536,
   B8 T4096, B4 T16384 (H16 HV32 K=V=128 bf16, initial and final state): the whole forward unfused vs fused;
   stages 3+4 alone (chunk_state_fwd_kernel + chunk_output_kernel as forward.py launches them) vs the fused
   launcher at its default config and at BV in {32, 64} x warps in {4, 8} without pipelining, plus BV=32, 4 warps,
   num_stages=2 (each config's o and final state checked against the unfused ones; BV=64 and the pipelined config
   spill on sm_90a: the AOT table in benchmarks/FUSED_FWD.md).
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (host-clock times, no graphs).
Writes DIR/fused_fwd.json after every case and row (a timeout keeps what was measured) and prints a table.
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
# (BV, warps, stages): the BV x warps grid without pipelining, and BV=32/4 warps pipelined (56 bytes of spills)
SWEEP = [(32, 4, 1), (32, 8, 1), (64, 4, 1), (64, 8, 1), (32, 4, 2)]
START = time.time()


def _elapsed():
    return time.time() - START


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _set_fused(on):
    os.environ["LINATTN_GDN_FUSED_FWD"] = "1" if on else "0"


class _FusedCounter:
    """Counts the fused launches the forward makes (wraps forward.chunk_fused_fwd)."""
    def __init__(self):
        from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
        self.mod, self.orig, self.n = fwd_mod, fwd_mod.chunk_fused_fwd, 0

        def counted(*a, **kw):
            self.n += 1
            return self.orig(*a, **kw)
        fwd_mod.chunk_fused_fwd = counted

    def close(self):
        self.mod.chunk_fused_fwd = self.orig


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
    counter = _FusedCounter()
    try:
        for on in (True, False):
            if not on and not counter.n:        # the switch left this shape unfused: the same path twice
                out[False] = out[True]
                break
            _set_fused(on)
            with torch.no_grad(), poisoned_allocations():
                out[on] = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                                         use_qk_l2norm_in_kernel=l2, backend="triton")
            _sync(dev)
        taken = counter.n
    finally:
        counter.close()
        _set_fused(False)
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        ro, rh = chunk_reference(**x64, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    (o, ht), (o_d, ht_d) = out[True], out[False]
    eo, eh = rel_rms(o, ro), rel_rms(ht, rh)
    tol = TOL[dtype]
    return dict(case=name, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=str(dtype), varlen=bool(lens), fused_taken=taken,
                err_o=eo, err_state=eh, err_o_unfused=rel_rms(o_d, ro), o_vs_unfused=rel_rms(o, o_d),
                state_vs_unfused=rel_rms(ht, ht_d), tol=tol, passed=bool(eo <= tol and eh <= tol))


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
        print(("PASS " if r["passed"] else "FAIL ") + str({k: r.get(k) for k in ("case", "fused_taken", "err_o",
                                                                             "err_state", "o_vs_unfused")}),
              flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def sync_free():
    from gdn_fwd_gate import sync_free_checks
    counter = _FusedCounter()
    _set_fused(True)
    try:
        out = sync_free_checks("triton")
    finally:
        _set_fused(False)
        counter.close()
    out["fused_taken"] = counter.n
    out["passed"] = bool(out["passed"] and counter.n > 0)
    return out


# ---------------------------------------------------------------- timing

def _ms(fn, dev):
    return graph_ms(fn) if dev == "cuda" else median_ms(fn, warmup=1, repeats=1)


def _stage_inputs(B, T, dev, H, HV, K, V):
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=BF, device=dev)
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"],
                                         True, None, compute_output=False)
    return x, res


def _unfused_runner(x, res, o, final):
    """Stages 3 and 4 exactly as forward.py launches them by default (h and vnew written and read back)."""
    import triton
    from linattn.ops.gated_delta_rule.triton.chunk_output import chunk_output_kernel
    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2
    q, k, plan = x["q"], x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)
    h, vnew = torch.empty_like(res.h), torch.empty_like(res.vnew)

    def run():
        chunk_state_fwd_kernel[(triton.cdiv(V, cfg.BV_state), plan.N * HV)](
            k, res.w, res.u, res.gcum, h, vnew, x["initial_state"], final, plan.cu, plan.chunk_offsets,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state, USE_H0=True, STORE_HT=True,
            DOT_PREC="tf32", num_warps=cfg.warps_state, num_stages=cfg.stages)
        chunk_output_kernel[(triton.cdiv(V, cfg.BV_out), plan.num_slots, HV)](
            q, k, vnew, h, res.gcum, o, plan.cu, plan.chunk_indices, plan.chunk_offsets, plan.N, K ** -0.5,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_out, DOT_PREC="tf32",
            num_warps=cfg.warps_out, num_stages=cfg.stages)
    return run, dict(BV_state=cfg.BV_state, warps_state=cfg.warps_state, BV_out=cfg.BV_out)


def _fused_runner(x, res, o, final, cfg=None):
    from linattn.ops.gated_delta_rule.triton.chunk_fused_fwd import chunk_fused_fwd, fused_config
    q, k, plan = x["q"], x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    cfg = cfg or fused_config(K, V, plan.N, HV, k.device)

    def run():
        chunk_fused_fwd(q, k, res.w, res.u, res.gcum, o, x["initial_state"], final, plan, K ** -0.5,
                        H=H, HV=HV, K=K, V=V, dot_prec="tf32", cfg=cfg)
    return run, cfg


def timing_row(B, T, dev, dry):
    import linattn
    from linattn.ops.gated_delta_rule.triton.chunk_fused_fwd import FusedConfig
    from linattn.testing import rel_rms
    H, HV, K, V = (1, 2, 64, 64) if dry else (16, 32, 128, 128)
    x, res = _stage_inputs(B, T, dev, H, HV, K, V)
    N = res.plan.N
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V)
    o_ref, f_ref = torch.empty_like(x["v"]), torch.empty(N, HV, K, V, device=dev)
    run, ucfg = _unfused_runner(x, res, o_ref, f_ref)
    run()
    _sync(dev)
    row["unfused_cfg"] = ucfg
    row["stages34_unfused_ms"] = _ms(run, dev)
    o, f = torch.empty_like(o_ref), torch.empty_like(f_ref)
    row["fused"] = []
    default = _fused_runner(x, res, o, f)[1]
    for cfg in [default] + [FusedConfig(BV=bv, warps=w, stages=st) for bv, w, st in SWEEP]:
        ent = dict(BV=cfg.BV, warps=cfg.warps, stages=cfg.stages, default=cfg == default and not row["fused"])
        try:
            o.fill_(float("nan"))
            f.fill_(float("nan"))
            r = _fused_runner(x, res, o, f, cfg)[0]
            r()
            _sync(dev)
            ent["o_vs_unfused"], ent["state_vs_unfused"] = rel_rms(o, o_ref), rel_rms(f, f_ref)
            ent["ms"] = _ms(r, dev)
        except Exception as e:  # noqa: BLE001
            ent["error"] = repr(e)[:300]
        row["fused"].append(ent)
    best = min((e for e in row["fused"] if "ms" in e), key=lambda e: e["ms"], default=None)
    if best is not None:
        row["stages34_speedup_default"] = row["stages34_unfused_ms"] / row["fused"][0].get("ms", float("nan"))
        row["stages34_speedup_best"] = row["stages34_unfused_ms"] / best["ms"]
        row["best"] = dict(BV=best["BV"], warps=best["warps"], stages=best["stages"])
    for on in (False, True):
        _set_fused(on)
        try:
            def call():
                return linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
            with torch.no_grad():
                row["fwd_fused_ms" if on else "fwd_unfused_ms"] = _ms(call, dev)
        finally:
            _set_fused(False)
    row["fwd_speedup"] = row["fwd_unfused_ms"] / row["fwd_fused_ms"]
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
    fz = " ".join(f"bv{e['BV']}w{e['warps']}s{e['stages']}{'*' if e.get('default') else ''} {e['ms']:.3f}"
                  for e in r["fused"] if "ms" in e)
    return (f"  B{r['B']} T{r['T']}: stages 3+4 unfused {r['stages34_unfused_ms']:.3f} ms | fused {fz} | "
            f"x{r.get('stages34_speedup_best', float('nan')):.2f} | fwd {r['fwd_unfused_ms']:.3f} -> "
            f"{r['fwd_fused_ms']:.3f} ms (x{r['fwd_speedup']:.2f})")


def table(res):
    lines = ["gate: " + ("PASSED" if res.get("gate_passed") else "NOT PASSED")
             + ("" if res.get("gate_complete", True) else " (cases skipped for the budget)")]
    for c in res.get("gate", []):
        lines.append(f"  {c['case']}: ERROR {c['error'][:200]}" if "error" in c else
                     f"  {c['case']}: fused {c['fused_taken']} o {c['err_o']:.2e} state {c['err_state']:.2e} "
                     f"(unfused o {c['err_o_unfused']:.2e}, fused vs unfused {c['o_vs_unfused']:.1e}) tol {c['tol']} "
                     f"{'ok' if c['passed'] else 'FAIL'}")
    if "sync_free" in res:
        lines.append(f"  sync free: {res['sync_free']}")
    lines += [table_row(r) for r in res.get("timing", [])]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=140.0, help="total seconds: no timing row starts after budget - 25")
    ap.add_argument("--gate-budget", type=float, default=85.0, help="seconds; no new gate case starts after it")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    a = ap.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run with TRITON_INTERPRET=1 for a CPU run of the logic")
    path = os.path.join(a.out, "fused_fwd.json")
    res = dict(script="fused_fwd_round.py", device=dev, dry_run=a.dry_run)
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
        res["timing"] = timing(dev, a.dry_run, a.budget - 25, saver("timing"))
    res["total_s"] = round(_elapsed(), 1)
    write_json(path, res)
    print(table(res))
    print(f"results: {path} ({res['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
