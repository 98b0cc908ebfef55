"""GPU round for the warp-specialised Gluon fused forward that forms W and U itself (stages 2b+3+4,
gluon/chunk_fused_wu_ws.py; benchmarks/GLUON_FUSED_WU.md):
`python benchmarks/gpu/gluon_fused_wu_round.py --out DIR [--budget 180] [--dry-run] [--no-timing]`.

1. gate: the cases run in a CHILD PROCESS watched by the parent (case_watchdog.py), --case-timeout (45 s; the first
   case, which pays the start-up and compiles, twice that) per case: a hang in the barrier protocol is reported as
   {"ok": false, "error": "timeout ..."}, the child is killed and a fresh one takes the remaining cases; no new case
   starts after --gate-budget seconds (default 0.55 x --budget; listed as skipped). Per case (H16 HV32 K=V=128 on
   the GPU): the fused-wu forward (chunk_fused_wu_ws.chunk_gated_delta_rule_fwd_fused_wu: kkt_solve, then the
   kernel), o and the final state NaN-poisoned before the kernel writes them and the fused-wu launch counted, against
   (a) the fp64 chunk reference (relative RMS <= linattn.testing.TOL of the dtype) and (b) the current gluon forward
   (launcher.chunk_gated_delta_rule_fwd_gluon with need_intermediates=False and LINATTN_GDN_GLUON_FUSED_WS=1: stage 2
   as kkt_solve + wu_kernel, then the fused-ws kernel; also <= TOL, expected ~1e-3 or below: accumulation order).
   Cases: T = 1, 63, 64, 65, 1000, 8192, 65536 (B1), initial state on/off, bf16 and fp16, B2 T1000, varlen with
   1-token sequences. Once the launcher is wired (runtime settings has gdn_gluon_fused_wu, GLUON_FUSED_WU.md
   "Wiring"), one more case runs the op linattn::chunk_gdn_fwd_gluon with LINATTN_GDN_GLUON_FUSED_WU=1 and requires
   the fused-wu launch.
2. only if the gate is green (and not --no-timing): timing (median of CUDA-event repeats) at B1 T65536, B8 T4096,
   B1 T32768, B1 T8192 (H16 HV32, bf16, initial and final state): stages 2b+3+4 as wu_kernel + fused-ws vs the
   fused-wu kernel alone, both on the same kkt_solve outputs (o checked against each other first); the whole forward
   (current gluon forward vs the fused-wu forward).
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (H1 HV2) with STAND-INS
(res["stand_ins"]): the Gluon fused-wu launch is replaced by the torch model of its schedule (emulate_fused_wu_ws),
the Gluon fused-ws launch by emulate_fused_ws. Host-clock times, no claims.
Writes DIR/gluon_fused_wu.json after every case and row, and prints a table.
"""
import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)                                       # common, case_watchdog
sys.path.insert(1, ROOT)                                       # linattn from this checkout
# this round gates and times the W/U kernel: where the gate-free BV=128 kernel is the default (round 22: a wave of
# sequence-heads, e.g. B8 at HV32) the public forward would run that one instead (its gate: the gluon step with
# LINATTN_GDN_GLUON_GF128=1); the children inherit the setting
os.environ.setdefault("LINATTN_GDN_GLUON_GF128", "0")
import torch  # noqa: E402
from case_watchdog import child_env, child_loop, script_cmd, watch_cases  # noqa: E402
from common import median_ms, round_result, write_json  # noqa: E402

WS_ENV = "LINATTN_GDN_GLUON_FUSED_WS"
WU_ENV = "LINATTN_GDN_GLUON_FUSED_WU"
FAKE_HANG_ENV = "FUSED_WU_ROUND_FAKE_HANG"    # names a gate case that then sleeps forever (tests the watchdog)
GATE_CASES = [  # (name, B, T, lens, dtype, initial state)
    ("T1", 1, 1, None, "bf16", True), ("T63", 1, 63, None, "bf16", True),
    ("T64", 1, 64, None, "bf16", False), ("T65", 1, 65, None, "bf16", True),
    ("T1000", 1, 1000, None, "bf16", True), ("T1000_noh0", 1, 1000, None, "bf16", False),
    ("T1000_fp16", 1, 1000, None, "fp16", True), ("B2_T1000", 2, 1000, None, "bf16", True),
    ("B4_T1000", 4, 1000, None, "bf16", True),                       # dense at the BV=64 config (N*HV = 128)
    ("varlen", 1, 1391, [1, 63, 1, 64, 65, 1, 1196], "bf16", True),
    ("T8192", 1, 8192, None, "bf16", True), ("T8192_fp16", 1, 8192, None, "fp16", False),
    ("op_switch_T1000", 1, 1000, None, "bf16", True),
    ("T65536", 1, 65536, None, "bf16", True),
]
DRY_GATE_CASES = [("T1", 1, 1, None, "bf16", True), ("T65", 1, 65, None, "bf16", True),
                  ("T130_fp16_noh0", 1, 130, None, "fp16", False),
                  ("varlen", 1, 131, [1, 64, 1, 65], "bf16", True),
                  ("op_switch_T70", 1, 70, None, "bf16", True)]
# (B, T) or (1, "varlen"): the production preset's varlen row (24 sequences, presets.PRODUCTION_VARLEN)
TIMING_ROWS = ((1, 65536), (8, 4096), (4, 16384), (1, "varlen"), (1, 32768), (2, 32768), (1, 8192))
DRY_TIMING_ROWS = ((1, 130), (2, 65), (1, "varlen"))
# launch configs timed besides the default at these rows (fused_wu kernel alone): (BV, stages, nwu)
# (BV, stages, NWU[, other FusedWuConfig fields]); round 16 added WU_AREG at BV=64 with the registers it needs there
# and round 17 OUT_PIPE (the output warpgroup's q k^T one chunk ahead, on top of WU_AREG; BV=32 at wu 160 registers,
# now the default there; BV=64 at output / wu 152 / 176, the next candidate: round 17's source view at B8 put the
# output warpgroup at ~94% busy once WU_AREG took the copy off the wu warpgroup)
AREG64 = dict(areg=True, output_regs=136, wu_regs=192)
OPIPE = dict(areg=True, out_pipe=True, wu_regs=160)
OPIPE64 = dict(areg=True, out_pipe=True, output_regs=152, wu_regs=176)   # BV=64 OUT_PIPE (AOT: 0 spill only here)
SWEEP = {(1, 65536): ((32, 3, 2, OPIPE), (32, 2, 2), (64, 2, 2)),
         (1, 32768): ((32, 3, 2, OPIPE),), (2, 32768): ((32, 3, 2, OPIPE),), (1, 8192): ((32, 3, 2, OPIPE),),
         (8, 4096): ((64, 2, 2, OPIPE64), (64, 2, 2), (32, 3, 2, OPIPE)), (4, 16384): ((64, 2, 2, OPIPE64),),
         (): ((64, 2, 2, OPIPE64),)}                     # (): the varlen row
DRY_SWEEP = {(1, 130): ((32, 2, 1), (64, 2, 2, AREG64), (32, 3, 2, OPIPE), (64, 2, 2, OPIPE64))}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
START = time.time()


def elapsed():
    return time.time() - START


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def heads(dry):
    return (1, 2) if dry else (16, 32)


def launcher_wired() -> bool:
    """Whether runtime/settings.py carries the LINATTN_GDN_GLUON_FUSED_WU switch (GLUON_FUSED_WU.md, "Wiring")."""
    from linattn.runtime.settings import settings
    return hasattr(type(settings), "gdn_gluon_fused_wu")


# ---------------------------------------------------------------- stand-ins (dry run only)

def install_stand_ins(dry: bool, poison: bool = True):
    """Counts the fused-wu and fused-ws launches (NaN-poisoning o and the final state before the kernel writes them
    when `poison`); in a dry run replaces both Gluon launches by the torch models of their schedules."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws as ws
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as wu
    real_wu = getattr(wu.chunk_fused_wu_ws_gluon, "real", wu.chunk_fused_wu_ws_gluon)
    real_ws = getattr(ws.chunk_fused_ws_gluon, "real", ws.chunk_fused_ws_gluon)
    counter = {"fused_wu": 0, "fused_ws": 0}

    def poisoned(o, final):
        if poison:
            o.fill_(float("nan"))
            if final is not None:
                final.fill_(float("nan"))

    def counted_wu(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, config=None, select=None, seg=None):
        counter["fused_wu"] += 1
        if select is None:   # a selected launch (segments) writes part of o: the other launch wrote the rest
            poisoned(o, final)
        if dry:      # STAND-IN: the torch model of the kernel's per-CTA schedule
            cfg = config or wu.fused_wu_config(plan.N, v.shape[-2], v.shape[-1], 132)
            wu.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=cfg.BV,
                                   stages=cfg.stages, nwu=cfg.nwu, areg=cfg.areg, out_pipe=cfg.out_pipe,
                                   select=select, seg=seg)
        else:
            real_wu(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, config=config, select=select, seg=seg)

    def counted_ws(q, k, w, u, gcum, o, h0, final, plan, scale, h=None, vnew=None, config=None):
        counter["fused_ws"] += 1
        poisoned(o, final)
        if dry:      # STAND-IN
            cfg = config or ws.fused_ws_config(plan.N, u.shape[1], u.shape[2], 132)
            ws.emulate_fused_ws(q, k, w, u, gcum, o, h0, final, plan, scale, BV=cfg.BV, stages=cfg.stages, h=h,
                                vnew=vnew)
        else:
            real_ws(q, k, w, u, gcum, o, h0, final, plan, scale, h=h, vnew=vnew, config=config)
    counted_wu.real, counted_ws.real = real_wu, real_ws
    wu.chunk_fused_wu_ws_gluon = counted_wu
    ws.chunk_fused_ws_gluon = counted_ws
    return counter


def current_forward(args):
    """The current gluon forward as the op runs it: kkt_solve + wu_kernel, then the fused-ws kernel."""
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    os.environ[WS_ENV] = "1"
    os.environ[WU_ENV] = "0"           # explicit, in case the launcher has been wired since
    return chunk_gated_delta_rule_fwd_gluon(*args, need_intermediates=False)


# ---------------------------------------------------------------- one gate case (child process)

def run_case(case, dry):
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import chunk_gated_delta_rule_fwd_fused_wu
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.testing import TOL, make_gdn_inputs, rel_rms
    name, B, T, lens, dtn, h0 = case
    dev = "cpu" if dry else "cuda"
    dtype = DTYPES[dtn]
    H, HV = heads(dry)
    out = dict(case=name, B=B, T=T, lens=lens, dtype=dtn, initial_state=h0)
    if name.startswith("op_switch") and not launcher_wired():
        return dict(out, ok=True, skipped="launcher not wired yet (GLUON_FUSED_WU.md, Wiring)")
    counter = install_stand_ins(dry)
    N = B if lens is None else len(lens)
    gen = torch.Generator().manual_seed(hash(name) % 2 ** 31)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, device=dev, num_states=N, initial_state=h0,
                        generator=gen)
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64,
                                                device=dev)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    ref = current_forward(args)
    sync(dev)
    ws_launches = counter["fused_ws"]
    o64, f64 = chunk_reference(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True, cu_seqlens=cu)
    tol = TOL[dtype]
    if name.startswith("op_switch"):     # the op as the gluon backend runs it, switch on
        from linattn.ops.gated_delta_rule.gluon import backend  # noqa: F401  (registers the op)
        os.environ[WU_ENV] = "1"
        o, final = torch.ops.linattn.chunk_gdn_fwd_gluon(*args, "wgmma")
        os.environ[WU_ENV] = "0"
    else:
        res = chunk_gated_delta_rule_fwd_fused_wu(*args)
        o, final = res.o, res.final_state
    sync(dev)
    out.update(fused_wu_launches=counter["fused_wu"], fused_ws_launches=ws_launches,
               o_vs_fp64=rel_rms(o, o64), final_vs_fp64=rel_rms(final, f64),
               o_vs_current=rel_rms(o, ref.o), final_vs_current=rel_rms(final, ref.final_state),
               current_o_vs_fp64=rel_rms(ref.o, o64), tol=tol)
    errs = [out["o_vs_fp64"], out["final_vs_fp64"], out["o_vs_current"], out["final_vs_current"]]
    out["ok"] = counter["fused_wu"] == 1 and ws_launches == 1 and all(e <= tol for e in errs)
    return out


def child_main(names_json, dry):
    """Runs the named cases in order in this process, printing START <name> before and RESULT <json> after each
    (case_watchdog.child_loop)."""
    cases = {c[0]: c for c in (DRY_GATE_CASES if dry else GATE_CASES)}
    child_loop(json.loads(names_json), lambda name: run_case(cases[name], dry), fake_hang_env=FAKE_HANG_ENV)


def gate(res, path, args):
    """One child process for all cases (one CUDA context, one set of compiles); a case past --case-timeout (a hang)
    is recorded as a timeout, the child's process group killed, and a fresh child takes the rest."""
    rows = res["gate"]["cases"]

    def on_result(row, seconds):
        row["seconds"] = seconds
        rows.append(row)
        write_json(path, res)
        print(f"gate {row['case']:>18}: {'ok ' if row['ok'] else 'FAIL'} "
              + " ".join(f"{k}={row[k]:.2e}" for k in ("o_vs_fp64", "final_vs_fp64", "o_vs_current") if k in row)
              + (f" {row['skipped']}" if "skipped" in row else "")
              + (f" {row.get('error', '')}" if not row["ok"] else ""), flush=True)

    def on_failure(name, why, seconds):
        rows.append(dict(case=name, ok=False, error=why, seconds=seconds))
        print(f"gate {name:>18}: FAIL {why[:200]}", flush=True)
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
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws as ws
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as wu
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.intra_split import split_intra_config, wu_kernel
    from linattn.testing import make_gdn_inputs, rel_rms
    dry = args.dry_run
    dev = "cpu" if dry else "cuda"
    H, HV = heads(dry)
    install_stand_ins(dry, poison=False)        # no NaN fills inside the timed calls
    from linattn.bench.presets import PRODUCTION_VARLEN, varlen_lengths
    for B, T in (DRY_TIMING_ROWS if dry else TIMING_ROWS):
        if elapsed() > args.budget - 15:
            res["timing_skipped"].append(f"B{B} T{T}")
            continue
        try:
            cu, N = None, B
            if T == "varlen":
                lens = varlen_lengths(3, 1, 90, seed=7) if dry else PRODUCTION_VARLEN["lengths"]
                T, N = sum(lens), len(lens)
                cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=dev)
            x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, device=dev, num_states=N)
            scale = 128 ** -0.5
            fargs = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
            q, k, v, beta, h0 = x["q"], x["k"], x["v"], x["beta"], x["initial_state"]
            plan = make_chunk_plan(B, T, cu, 64, dev)
            gcum, tinv = wu.kkt_solve(k, x["g"], beta, plan, HV)
            w = torch.empty(plan.T_total, HV, 128, dtype=k.dtype, device=dev)
            u = torch.empty_like(w)
            o_ws, o_wu = torch.empty_like(v), torch.empty_like(v)
            f_ws, f_wu = torch.empty_like(h0), torch.empty_like(h0)
            cfg = split_intra_config(128, 128)

            def wu_plus_ws():           # stages 2b + 3 + 4 today: wu_kernel, then the fused-ws kernel
                wu_kernel[(plan.num_slots, HV)](
                    k, v, beta, gcum, tinv, w, u, plan.cu, plan.chunk_indices, plan.N, H=H, HV=HV, K=128, V=128,
                    BT=64, BK=cfg.BK, BV=cfg.BV, DOT_PREC="tf32", num_warps=cfg.warps_wu)
                ws.chunk_fused_ws_gluon(q, k, w, u, gcum, o_ws, h0, f_ws, plan, scale)

            def fused_wu():             # the same three stages as one kernel
                wu.chunk_fused_wu_ws_gluon(q, k, v, beta, gcum, tinv, o_wu, h0, f_wu, plan, scale)

            row = dict(B=B, T=T, H=H, HV=HV, N=N, varlen=cu is not None,
                       config=list(wu.fused_wu_config(N, HV, 128, 132 if dry else torch.cuda.get_device_properties(
                           0).multi_processor_count).__dict__.values()))
            wu_plus_ws()
            fused_wu()
            sync(dev)
            row["wu_o_vs_ws"] = rel_rms(o_wu, o_ws)
            row["wu_final_vs_ws"] = rel_rms(f_wu, f_ws)
            reps = dict(warmup=1, repeats=3) if dry else dict(warmup=3, repeats=20)
            row["wu_plus_ws_ms"] = median_ms(wu_plus_ws, **reps)
            row["fused_wu_ms"] = median_ms(fused_wu, **reps)
            row["stages_speedup"] = row["wu_plus_ws_ms"] / row["fused_wu_ms"]
            row["fwd_current_ms"] = median_ms(lambda: current_forward(fargs), **reps)
            row["fwd_fused_wu_ms"] = median_ms(lambda: wu.chunk_gated_delta_rule_fwd_fused_wu(*fargs), **reps)
            row["fwd_speedup"] = row["fwd_current_ms"] / row["fwd_fused_wu_ms"]
            for bv, st, nwu, *more in (DRY_SWEEP if dry else SWEEP).get((B, T) if cu is None else (), ()):
                extra = more[0] if more else {}
                c = wu.FusedWuConfig(bv, st, nwu, **extra)
                tag = (f"bv{bv}_s{st}_nwu{nwu}" + ("_areg" if extra.get("areg") else "")
                       + ("_opipe" if extra.get("out_pipe") else "")
                       + ("_o{output_regs}_w{wu_regs}".format(**extra) if "output_regs" in extra else ""))
                row[f"fused_wu_ms_{tag}"] = median_ms(
                    lambda: wu.chunk_fused_wu_ws_gluon(q, k, v, beta, gcum, tinv, o_wu, h0, f_wu, plan, scale,
                                                       config=c), **reps)
                row[f"o_vs_ws_{tag}"] = rel_rms(o_wu, o_ws)   # ~3e-3 with areg: W / U round differently
        except Exception as e:  # noqa: BLE001
            row = dict(B=B, T=T, error=repr(e)[:500], trace=traceback.format_exc()[-3000:])
        res["timing"].append(row)
        write_json(path, res)
        print(f"timing B{B} T{T}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()
                                               if isinstance(v, float)), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=180)
    ap.add_argument("--gate-budget", type=float, default=None)
    ap.add_argument("--case-timeout", type=float, default=45)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--child-case", default=None)
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.child_case is not None:
        child_main(args.child_case, args.dry_run)
        return
    if args.gate_budget is None:
        args.gate_budget = 0.55 * args.budget
    if args.dry_run:
        args.case_timeout = max(args.case_timeout, 20)
    dev = "cpu" if args.dry_run else "cuda"
    path = os.path.join(args.out, "gluon_fused_wu.json")
    res = round_result("gluon_fused_wu_round.py", dev, dry_run=args.dry_run, budget=args.budget,
                       launcher_wired=launcher_wired(),
                       stand_ins=(["Gluon fused-wu launch -> emulate_fused_wu_ws (torch model of the schedule)",
                                   "Gluon fused-ws launch -> emulate_fused_ws"] if args.dry_run else []))
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
