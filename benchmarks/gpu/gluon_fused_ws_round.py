"""GPU round for the warp-specialised Gluon fused forward (stages 3+4, gluon/chunk_fused_ws.py,
LINATTN_GDN_GLUON_FUSED_WS=1; benchmarks/GLUON_FUSED_WS.md):
`python benchmarks/gpu/gluon_fused_ws_round.py --out DIR [--budget 150] [--dry-run] [--no-timing]`.

1. gate: the cases run in a CHILD PROCESS watched by the parent, --case-timeout (45 s; the first case, which pays
   the start-up and compiles, twice that) per case: a hang in the barrier protocol is reported as {"ok": false,
   "error": "timeout ..."}, the child is killed and a fresh one takes the remaining cases (case_watchdog.py); no new
   case starts after --gate-budget seconds (default 0.55 x --budget; listed as skipped). Per case (H16 HV32 K=V=128
   on the GPU):
   the fused forward (launcher.chunk_gated_delta_rule_fwd_gluon with the switch on and need_intermediates=False,
   what the op linattn::chunk_gdn_fwd_gluon runs), its o and final state NaN-poisoned before the kernel writes them
   and the fused launch counted, against (a) the fp64 chunk reference (relative RMS <= linattn.testing.TOL of the
   dtype) and (b) the current gluon forward (switch off: Gluon state pass + Triton output; also <= TOL).
   Cases: T = 1, 63, 64, 65, 1000, 8192, 65536 (B1), initial state on/off, bf16 and fp16, B2 T1000 GVA, varlen with
   1-token sequences; and one case with the optional stores (h, vnew) compared with the unfused state pass's.
2. only if the gate is green (and not --no-timing): timing (median of CUDA-event repeats) at B1 T65536, B8 T4096,
   B1 T32768, B1 T8192 (H16 HV32, bf16, initial and final state): stages 3+4 unfused (Gluon state pass + Triton
   output OUTPUT_V2, on the same stage-2 outputs) vs fused; the whole gluon forward with the switch off vs on.
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (H1 HV2) with STAND-INS
(res["stand_ins"]): the Gluon fused launch is replaced by the torch model of its schedule (emulate_fused_ws), the
Gluon state pass by the Triton state kernel. Host-clock times, no claims.
Writes DIR/gluon_fused_ws.json after every case and row, and prints a table.
"""
import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)                                       # common
sys.path.insert(1, ROOT)                                       # linattn from this checkout
import torch  # noqa: E402
from case_watchdog import child_env, child_loop, script_cmd, watch_cases  # noqa: E402
from common import median_ms, round_result, write_json  # noqa: E402

ENV = "LINATTN_GDN_GLUON_FUSED_WS"
FAKE_HANG_ENV = "FUSED_WS_ROUND_FAKE_HANG"    # names a gate case that then sleeps forever (tests the watchdog)
GATE_CASES = [  # (name, B, T, lens, dtype, initial state, store h/vnew)
    ("T1", 1, 1, None, "bf16", True, False), ("T63", 1, 63, None, "bf16", True, False),
    ("T64", 1, 64, None, "bf16", False, False), ("T65", 1, 65, None, "bf16", True, False),
    ("T1000", 1, 1000, None, "bf16", True, False), ("T1000_noh0", 1, 1000, None, "bf16", False, False),
    ("T1000_fp16", 1, 1000, None, "fp16", True, False), ("B2_T1000", 2, 1000, None, "bf16", True, False),
    ("varlen", 1, 1391, [1, 63, 1, 64, 65, 1, 1196], "bf16", True, False),
    ("T8192", 1, 8192, None, "bf16", True, False), ("T8192_fp16", 1, 8192, None, "fp16", False, False),
    ("store_h_vnew_T1000", 1, 1000, None, "bf16", True, True),
    ("T65536", 1, 65536, None, "bf16", True, False),
]
DRY_GATE_CASES = [("T1", 1, 1, None, "bf16", True, False), ("T65", 1, 65, None, "bf16", True, False),
                  ("T130_fp16_noh0", 1, 130, None, "fp16", False, False),
                  ("varlen", 1, 131, [1, 64, 1, 65], "bf16", True, False),
                  ("store_h_vnew_T100", 1, 100, None, "bf16", True, True)]
TIMING_ROWS = ((1, 65536), (8, 4096), (1, 32768), (1, 8192))
DRY_TIMING_ROWS = ((1, 130), (2, 65))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
START = time.time()


def elapsed():
    return time.time() - START


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def heads(dry):
    return (1, 2) if dry else (16, 32)


# ---------------------------------------------------------------- stand-ins (dry run only)

def install_stand_ins(dry: bool):
    """Counts fused launches (and NaN-poisons o and the final state before the kernel writes them); in a dry run
    replaces the Gluon fused launch by the torch model of its schedule and returns the Triton state pass as the
    stand-in for the Gluon one (None on a GPU)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws
    real = chunk_fused_ws.chunk_fused_ws_gluon
    counter = {"fused": 0}

    def counted(q, k, w, u, gcum, o, h0, final, plan, scale, h=None, vnew=None, config=None):
        counter["fused"] += 1
        o.fill_(float("nan"))
        if final is not None:
            final.fill_(float("nan"))
        if dry:      # STAND-IN: the torch model of the kernel's per-CTA schedule
            cfg = config or chunk_fused_ws.fused_ws_config(plan.N, u.shape[1], u.shape[2], 132)
            chunk_fused_ws.emulate_fused_ws(q, k, w, u, gcum, o, h0, final, plan, scale, BV=cfg.BV,
                                            stages=cfg.stages, h=h, vnew=vnew)
        else:
            real(q, k, w, u, gcum, o, h0, final, plan, scale, h=h, vnew=vnew, config=config)
    chunk_fused_ws.chunk_fused_ws_gluon = counted
    if not dry:
        return counter, None

    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel

    def triton_state(k, w, u, gcum, h, vnew, h0, final, plan):      # STAND-IN for the Gluon state pass
        chunk_state_fwd_kernel[(u.shape[2] // 64, plan.N * u.shape[1])](
            k, w, u, gcum, h, vnew, h0 if h0 is not None else gcum, final if final is not None else gcum,
            plan.cu, plan.chunk_offsets, H=k.shape[2], HV=u.shape[1], K=k.shape[3], V=u.shape[2], BT=64,
            BK=k.shape[3], BV=64, USE_H0=h0 is not None, STORE_HT=final is not None, DOT_PREC="tf32")
    return counter, triton_state


# ---------------------------------------------------------------- one gate case (child process)

def run_case(case, dry):
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.testing import TOL, make_gdn_inputs, rel_rms
    name, B, T, lens, dtn, h0, store = case
    dev = "cpu" if dry else "cuda"
    dtype = DTYPES[dtn]
    H, HV = heads(dry)
    counter, state_pass = install_stand_ins(dry)
    N = B if lens is None else len(lens)
    gen = torch.Generator().manual_seed(hash(name) % 2 ** 31)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, device=dev, num_states=N, initial_state=h0,
                        generator=gen)
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64,
                                                device=dev)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    out = dict(case=name, B=B, T=T, lens=lens, dtype=dtn, initial_state=h0, store=store)
    os.environ[ENV] = "0"   # explicit: the switch is on by default since round 14
    ref = chunk_gated_delta_rule_fwd_gluon(*args, state_pass=state_pass)          # current gluon forward
    sync(dev)
    o64, f64 = chunk_reference(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True, cu_seqlens=cu)
    tol = TOL[dtype]
    if store:      # the optional h / vnew stores, through the launcher directly, on the unfused forward's stage 2
        o = torch.empty_like(ref.o)
        final = torch.empty_like(ref.final_state)
        h = torch.full_like(ref.h, float("nan"))
        vnew = torch.full_like(ref.vnew, float("nan"))
        chunk_fused_ws.chunk_fused_ws_gluon(x["q"], x["k"], ref.w, ref.u, ref.gcum, o, x["initial_state"], final,
                                            ref.plan, scale, h=h, vnew=vnew)
        sync(dev)
        used = int(ref.plan.chunk_offsets[-1])
        out.update(h_vs_unfused=rel_rms(h[:used], ref.h[:used]), vnew_vs_unfused=rel_rms(vnew, ref.vnew))
    else:
        os.environ[ENV] = "1"
        # no state_pass hook here: with one, the launcher keeps stages 3 and 4 apart (the hook replaces stage 3)
        res = chunk_gated_delta_rule_fwd_gluon(*args, need_intermediates=False)
        sync(dev)
        os.environ[ENV] = "0"   # explicit: the switch is on by default since round 14
        o, final = res.o, res.final_state
    out.update(fused_launches=counter["fused"], o_vs_fp64=rel_rms(o, o64), final_vs_fp64=rel_rms(final, f64),
               o_vs_unfused=rel_rms(o, ref.o), final_vs_unfused=rel_rms(final, ref.final_state),
               unfused_o_vs_fp64=rel_rms(ref.o, o64), tol=tol)
    errs = [out["o_vs_fp64"], out["final_vs_fp64"], out["o_vs_unfused"], out["final_vs_unfused"]]
    errs += [out["h_vs_unfused"], out["vnew_vs_unfused"]] if store else []
    out["ok"] = counter["fused"] == 1 and all(e <= tol for e in errs)
    return out


def child_main(names_json, dry):
    """Runs the named cases in order in this process, printing START <name> before and RESULT <json> after each
    (case_watchdog.child_loop)."""
    cases = {c[0]: c for c in (DRY_GATE_CASES if dry else GATE_CASES)}
    child_loop(json.loads(names_json), lambda name: run_case(cases[name], dry), fake_hang_env=FAKE_HANG_ENV)


def gate(res, path, args):
    """The cases run in one child process (one CUDA context and one set of compiles for all); the parent gives each
    case --case-timeout seconds from its START line (the first twice that). A case past that (a hang in the barrier
    protocol, or an error that never returns) is recorded as a timeout, the child's process group is killed, and a
    fresh child takes the remaining cases (case_watchdog.watch_cases)."""
    rows = res["gate"]["cases"]

    def on_result(row, seconds):
        row["seconds"] = seconds
        rows.append(row)
        write_json(path, res)
        print(f"gate {row['case']:>20}: {'ok ' if row['ok'] else 'FAIL'} "
              + " ".join(f"{k}={row[k]:.2e}" for k in ("o_vs_fp64", "final_vs_fp64", "o_vs_unfused")
                         if k in row) + (f" {row.get('error', '')}" if not row["ok"] else ""), flush=True)

    def on_failure(name, why, seconds):
        rows.append(dict(case=name, ok=False, error=why, seconds=seconds))
        print(f"gate {name:>20}: FAIL {why[:200]}", flush=True)
        write_json(path, res)

    extra = ["--out", args.out] + (["--dry-run"] if args.dry_run else [])
    res["gate"]["skipped"] += watch_cases(
        [c[0] for c in (DRY_GATE_CASES if args.dry_run else GATE_CASES)],
        lambda todo: script_cmd(__file__, todo, *extra), case_timeout=args.case_timeout,
        first_timeout=2 * args.case_timeout, stop=lambda: elapsed() > args.gate_budget, on_result=on_result,
        on_failure=on_failure, env=child_env(ROOT))
    res["gate"]["passed"] = bool(rows) and all(r["ok"] for r in rows)


# ---------------------------------------------------------------- timing

def timing(res, path, args):
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon, chunk_state_gluon
    from linattn.ops.gated_delta_rule.triton.chunk_output import OUTPUT_V2, chunk_output
    from linattn.testing import make_gdn_inputs, rel_rms
    dry = args.dry_run
    dev = "cpu" if dry else "cuda"
    H, HV = heads(dry)
    real = chunk_fused_ws.chunk_fused_ws_gluon
    counter, state_pass = install_stand_ins(dry)
    if dry:      # STAND-IN (as in the gate) without the NaN poisoning, which would be timed too
        def fused(q, k, w, u, gcum, o, h0, final, plan, scale, h=None, vnew=None, config=None):
            cfg = config or chunk_fused_ws.fused_ws_config(plan.N, u.shape[1], u.shape[2], 132)
            chunk_fused_ws.emulate_fused_ws(q, k, w, u, gcum, o, h0, final, plan, scale, BV=cfg.BV, stages=cfg.stages)
    else:
        fused = real
    chunk_fused_ws.chunk_fused_ws_gluon = fused
    for B, T in (DRY_TIMING_ROWS if dry else TIMING_ROWS):
        if elapsed() > args.budget - 15:
            res["timing_skipped"].append(f"B{B} T{T}")
            continue
        try:
            x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, device=dev)
            scale = 128 ** -0.5
            fargs = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, None)
            os.environ[ENV] = "0"   # explicit: the switch is on by default since round 14
            ref = chunk_gated_delta_rule_fwd_gluon(*fargs, state_pass=state_pass)
            p = ref.plan
            h, vnew = torch.empty_like(ref.h), torch.empty_like(ref.vnew)
            o, fin = torch.empty_like(ref.o), torch.empty_like(ref.final_state)

            def unfused():
                if state_pass is not None:
                    state_pass(x["k"], ref.w, ref.u, ref.gcum, h, vnew, x["initial_state"], fin, p)
                else:
                    chunk_state_gluon(x["k"], ref.w, ref.u, ref.gcum, h, vnew, x["initial_state"], fin, p)
                chunk_output(x["q"], x["k"], vnew, h, ref.gcum, o, p, scale, H=H, HV=HV, K=128, V=128,
                             dot_prec="tf32", cfg=OUTPUT_V2, BT=64)

            def fused_only():
                fused(x["q"], x["k"], ref.w, ref.u, ref.gcum, o, x["initial_state"], fin, p, scale)

            def fwd(on):
                def run():
                    if on:
                        os.environ[ENV] = "1"
                    else:
                        os.environ[ENV] = "0"   # explicit: the switch is on by default since round 14
                    chunk_gated_delta_rule_fwd_gluon(*fargs, state_pass=None if on else state_pass,
                                                     need_intermediates=False)
                return run
            row = dict(B=B, T=T, H=H, HV=HV)
            fused_only()
            sync(dev)
            row["fused_o_vs_unfused"] = rel_rms(o, ref.o)
            row["fused_final_vs_unfused"] = rel_rms(fin, ref.final_state)
            reps = dict(warmup=1, repeats=3) if dry else dict(warmup=3, repeats=20)
            row["unfused_ms"] = median_ms(unfused, **reps)
            row["fused_ms"] = median_ms(fused_only, **reps)
            row["stages_speedup"] = row["unfused_ms"] / row["fused_ms"]
            row["fwd_off_ms"] = median_ms(fwd(False), **reps)
            row["fwd_on_ms"] = median_ms(fwd(True), **reps)
            os.environ[ENV] = "0"   # explicit: the switch is on by default since round 14
            row["fwd_speedup"] = row["fwd_off_ms"] / row["fwd_on_ms"]
        except Exception as e:  # noqa: BLE001
            row = dict(B=B, T=T, error=repr(e)[:500], trace=traceback.format_exc()[-3000:])
        res["timing"].append(row)
        write_json(path, res)
        print(f"timing B{B} T{T}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()
                                               if isinstance(v, float)), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150)
    ap.add_argument("--gate-budget", type=float, default=None)
    ap.add_argument("--case-timeout", type=float, default=45)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--child-case", default=None)
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # this round measures the fused-ws kernel; the fused-wu kernel (on by default since round 15) would take its
    # place in the op's path (children inherit this)
    os.environ["LINATTN_GDN_GLUON_FUSED_WU"] = "0"
    if args.child_case is not None:
        child_main(args.child_case, args.dry_run)
        return
    if args.gate_budget is None:
        args.gate_budget = 0.55 * args.budget
    if args.dry_run:
        args.case_timeout = max(args.case_timeout, 20)
    dev = "cpu" if args.dry_run else "cuda"
    path = os.path.join(args.out, "gluon_fused_ws.json")
    res = round_result("gluon_fused_ws_round.py", dev, dry_run=args.dry_run, budget=args.budget,
                       stand_ins=(["Gluon fused launch -> emulate_fused_ws (torch model of the schedule)",
                                   "Gluon state pass -> Triton chunk_state_fwd_kernel"] if args.dry_run else []))
    res.update(gate=dict(cases=[], skipped=[], passed=False), timing=[], timing_skipped=[])
    write_json(path, res)
    gate(res, path, args)
    write_json(path, res)
    if res["gate"]["passed"] and not args.no_timing:
        timing(res, path, args)
    elif not res["gate"]["passed"]:
        res["timing_skipped"].append("gate not green")
    res["seconds"] = round(elapsed(), 1)
    write_json(path, res)
    print(f"gate {'GREEN' if res['gate']['passed'] else 'RED'}; {len(res['timing'])} timing rows; "
          f"{res['seconds']} s; {path}")


if __name__ == "__main__":
    main()
