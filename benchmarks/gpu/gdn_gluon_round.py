"""GPU round for the Gluon state pass of the GDN forward (issue 7): gate, then timing, for every variant.

    python benchmarks/gpu/gdn_gluon_round.py --out DIR [--variants wgmma,tma,literal] [--budget 195] [--sweep]
    python benchmarks/gpu/gdn_gluon_round.py --out DIR --dry-run      # CPU: imports, case list, configs

Each variant runs in its own child process (this script with --child VARIANT) under a timeout, so a hang or a
crash in one variant (a wrong mbarrier phase hangs the GPU kernel) costs only its own share of the budget.
The child writes DIR/gdn_gluon_<variant>.json after every step, so a timeout keeps what was measured.

Per variant:
 1. gate: linattn.chunk_gated_delta_rule(..., backend="gluon") with LINATTN_GDN_GLUON_VARIANT=variant on the
    K=V=128 16-bit cases of gdn_fwd_gate.py (its cases() and run_case(): NaN-poisoned buffers, fp64 reference,
    relative RMS, the same tolerances as the Triton path), plus varlen with 1-token sequences and lengths 1, 63,
    65, 1000, fixed T in {1, 63, 65, 1000}, GVA, with and without initial state; the final state every time.
    Also: gradients through the gluon backend equal the triton backend's (the backward recomputes with Triton),
    and gdn_fwd_gate's sync-free / CUDA-graph check.
 2. only if the gate is green: timing (CUDA events, median of repeats after warm-up) of the state stage alone
    (Gluon variant vs the Triton state kernel on identical inputs; their outputs h, vnew, final state are also
    compared) and of the whole forward (gluon backend vs triton backend), at B=1 T=8192/32768/65536 and
    B=8 T=4096, H=16 HV=32 K=V=128 bf16. At B=1 T=8192 and B=8 T=4096 also the gluon forward and state pass
    with the launcher's host-path cache on and off (gluon/launcher.py host_path; off = the path before the cache,
    as with LINATTN_GLUON_HOST_CACHE=0): eager ms and host-clock us per call, in the same process.
The parent merges everything into DIR/gdn_gluon.json with the environment line and prints a table.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                       # gdn_fwd_gate, common
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))     # linattn from this checkout (children too)
import torch  # noqa: E402

VARIANTS = ("wgmma", "tma", "literal")     # run order: the most advanced first; the last absorbs unused time
TIMING_SHAPES = ((1, 8192), (1, 32768), (1, 65536), (8, 4096))
SWEEP_SHAPES = ((1, 65536), (8, 4096))          # --sweep: other state-pass configs timed at these shapes
HOST_SHAPES = ((1, 8192), (8, 4096))            # the gluon forward also timed with the host-path cache off
GRAD_SHAPE = (1, 200, 16, 32, 128, 128)          # B, T, H, HV, K, V of the gradient check (warmed up by the parent)
from common import graph_ms, host_us, median_ms  # noqa: E402

BF, FP16 = torch.bfloat16, torch.float16


def gate_cases():
    """(name, B, T, H, HV, K, V, dtype, lens, extra): ours (short, varlen), then gdn_fwd_gate's K=V=128 16-bit
    cases, small first (a timeout then still leaves most cases measured). Our cases reuse the head counts and
    dtypes of gdn_fwd_gate's (H16/HV32 bf16, H8/HV16 fp16) so that they add no kernel specialisations to compile,
    except the H2/HV8 ones (round 21)."""
    from gdn_fwd_gate import cases
    own = []
    for T in (1, 63, 65, 1000):
        own.append((f"gluon_T{T}_gva_h0", 2, T, 16, 32, 128, 128, BF, None, {}))
    own.append(("gluon_T1000_fp16_no_h0", 2, 1000, 8, 16, 128, 128, FP16, None, dict(initial_state=False)))
    lens = [1, 1, 63, 1, 65, 1000, 1, 64, 128, 1]
    own.append(("gluon_varlen_1tok", 1, sum(lens), 16, 32, 128, 128, BF, lens, {}))
    own.append(("gluon_varlen_1tok_no_h0", 1, 265, 16, 32, 128, 128, BF, [1, 200, 1, 63], dict(initial_state=False)))
    # H2/HV8 (round 21; new head counts, so two more specialisations to compile): where few sequence-heads leave SMs
    # idle the launcher splits V finer (fused_wu_config's BV=16, the default since round 21, takes B1 and B2 here)
    own.append(("gluon_hv8_T1000", 1, 1000, 2, 8, 128, 128, BF, None, {}))
    own.append(("gluon_hv8_B2_T130_no_h0", 2, 130, 2, 8, 128, 128, BF, None, dict(initial_state=False)))
    own.append(("gluon_hv8_varlen_1tok", 1, 333, 2, 8, 128, 128, BF, [1, 200, 1, 65, 66], {}))
    # the gate-free kernel's segment launch on a multi-sequence batch (round 23's default: B * T >= 32768 tokens
    # eager, B * HV * S <= SMs): B4 T8192 H2/HV8 runs 4 segments of 32 chunks per sequence
    own.append(("gluon_hv8_B4_T8192_segments", 4, 8192, 2, 8, 128, 128, BF, None, {}))
    theirs = [c for c in cases() if c[5] == 128 and c[6] == 128 and c[7] in (BF, FP16)]
    return own + sorted(theirs, key=lambda c: c[1] * c[2])


def grad_check():
    """Gradients through backend="gluon" equal backend="triton"'s: both backwards are the Triton one on the same
    saved inputs, so with the SAME upstream gradients (fixed random do, dht; not a loss of the outputs, whose
    gradient would carry the two forwards' rounding differences into the comparison) they agree up to the
    backward's own run-to-run variation. Also the forward outputs of the two agree to rounding."""
    import linattn
    from linattn.testing import make_gdn_inputs, rel_rms
    x = make_gdn_inputs(*GRAD_SHAPE, dtype=BF, device="cuda", requires_grad=True)
    names = [k for k, v in x.items() if v is not None]
    B, T, H, HV, K, V = GRAD_SHAPE[:6]
    do = torch.randn(B, T, HV, V, device="cuda").to(BF)
    dht = torch.randn(B, HV, K, V, device="cuda")
    out = {}
    for backend in ("gluon", "triton", "triton_again"):
        o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend=backend.split("_")[0])
        grads = torch.autograd.grad((o, ht), [x[k] for k in names], (do, dht))
        out[backend] = (o.detach(), grads)
    rel = {k: rel_rms(a, b) for k, a, b in zip(names, out["gluon"][1], out["triton"][1])}
    rerun = {k: rel_rms(a, b) for k, a, b in zip(names, out["triton_again"][1], out["triton"][1])}
    err_o = rel_rms(out["gluon"][0], out["triton"][0])
    # every gradient of both backends against autograd through the fp64 chunk reference, same upstream gradients
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.settings import settings
    from linattn.testing import TOL
    ref = {k: v.detach().double().requires_grad_() for k, v in x.items() if v is not None}
    o64, ht64 = chunk_reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref["initial_state"], True,
                                None, False)
    g64 = torch.autograd.grad((o64, ht64), [ref[k] for k in names], (do.double(), dht.double()))
    vs64 = {b: {k: rel_rms(a, r) for k, a, r in zip(names, out[b][1], g64)} for b in ("gluon", "triton")}
    ok64 = all(e <= TOL[BF] for e in vs64["gluon"].values())
    # with LINATTN_GDN_GLUON_BWD_STATE=1 the gluon backward recomputes h with the Gluon state pass, and with
    # LINATTN_GDN_GLUON_BWD_DH (on by default since round 14) it runs its reverse state pass in Gluon: its gradients
    # then differ from Triton's by that rounding, and the fp64 check is the gate; otherwise they must be Triton's
    from linattn.ops.gated_delta_rule.gluon.backend import recompute_state_in_gluon
    bwd_state = recompute_state_in_gluon(settings.gdn_gluon_bwd_state, x["q"], x["v"], None)
    gluon_pieces = bwd_state or settings.gdn_gluon_bwd_dh
    same = all(rel[k] <= max(1e-5, 2 * rerun[k]) for k in names)
    return dict(case="grad_vs_triton", gluon_bwd_state=bwd_state, gluon_bwd_dh=settings.gdn_gluon_bwd_dh,
                rel_rms_grad_vs_triton=rel,
                rel_rms_grad_triton_rerun=rerun, rel_rms_grad_vs_fp64=vs64, tol_vs_fp64=TOL[BF],
                rel_err_o_vs_triton=err_o,
                passed=bool((gluon_pieces or same) and ok64 and err_o < 1.5e-2))


def _write(path, obj):
    from common import write_json
    write_json(path, obj)


# ---------------------------------------------------------------- timing

def _rel(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def triton_state_launcher(k, w, u, gcum, h, vnew, h0, final, plan):
    """The Triton state stage exactly as triton/forward.py launches it."""
    import triton

    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2
    H, K = k.shape[2], k.shape[3]
    HV, V = u.shape[1], u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)
    grid = (triton.cdiv(V, cfg.BV_state), plan.N * HV)

    def run():
        chunk_state_fwd_kernel[grid](
            k, w, u, gcum, h, vnew, h0 if h0 is not None else gcum, final if final is not None else gcum,
            plan.cu, plan.chunk_offsets, H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state,
            USE_H0=h0 is not None, STORE_HT=final is not None, DOT_PREC="tf32",
            num_warps=cfg.warps_state, num_stages=cfg.stages)
    return run, cfg.BV_state


def sweep_configs(variant):
    """State-pass launch configs worth comparing on the GPU (all compile without spills for sm_90a)."""
    from linattn.ops.gated_delta_rule.gluon.launcher import StateConfig
    if variant == "literal":
        return [StateConfig(32, 4, 0), StateConfig(64, 8, 0)]
    return [StateConfig(bv, 4, st) for bv in (32, 64) for st in (2, 3)]


def timing_row(variant, B, T, sweep=False):
    import linattn
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_state_gluon, state_config
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.device import device_facts
    H, HV, K, V = 16, 32, 128, 128
    dev = "cuda"
    x = dict(q=torch.randn(B, T, H, K, device=dev).to(BF),
             k=torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(BF),
             v=torch.randn(B, T, HV, V, device=dev).to(BF),
             g=torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev) + 4.0) * 4.0,
             beta=torch.sigmoid(torch.randn(B, T, HV, device=dev)),
             initial_state=torch.randn(B, HV, K, V, device=dev) * 0.5)
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V)
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"],
                                         True, None, compute_output=False)
        plan = res.plan
        bufs = {}
        for name in ("triton", "gluon"):
            bufs[name] = (torch.empty_like(res.h), torch.empty_like(res.vnew), torch.empty_like(res.final_state))
        tri_run, tri_bv = triton_state_launcher(x["k"], res.w, res.u, res.gcum, *bufs["triton"][:2],
                                                x["initial_state"], bufs["triton"][2], plan)
        cfg = state_config(variant, plan.N, HV, V, device_facts(dev).num_sms)

        def glu_run():
            chunk_state_gluon(x["k"], res.w, res.u, res.gcum, *bufs["gluon"][:2], x["initial_state"],
                              bufs["gluon"][2], plan, variant, cfg)
        tri_run()
        glu_run()
        torch.cuda.synchronize()
        used = plan.chunk_offsets[-1].item()          # surplus chunk slots are never written
        row["state_diff_vs_triton"] = dict(
            h=_rel(bufs["gluon"][0][:used], bufs["triton"][0][:used]), vnew=_rel(bufs["gluon"][1], bufs["triton"][1]),
            final=_rel(bufs["gluon"][2], bufs["triton"][2]))
        row["state_config"] = dict(BV=cfg.BV, num_warps=cfg.num_warps, stages=cfg.stages, triton_BV=tri_bv)
        row["state_triton_ms"] = median_ms(tri_run)
        row["state_gluon_ms"] = median_ms(glu_run)
        row["state_speedup"] = row["state_triton_ms"] / row["state_gluon_ms"]
        if sweep:
            row["state_sweep"] = []
            for alt in sweep_configs(variant):
                if alt == cfg:
                    continue
                out = tuple(torch.empty_like(b) for b in bufs["gluon"])

                def alt_run():
                    chunk_state_gluon(x["k"], res.w, res.u, res.gcum, out[0], out[1], x["initial_state"], out[2],
                                      plan, variant, alt)
                try:
                    alt_run()
                    torch.cuda.synchronize()
                    row["state_sweep"].append(dict(BV=alt.BV, num_warps=alt.num_warps, stages=alt.stages,
                                                   ms=median_ms(alt_run),
                                                   final_diff_vs_triton=_rel(out[2], bufs["triton"][2])))
                except Exception as e:
                    row["state_sweep"].append(dict(BV=alt.BV, num_warps=alt.num_warps, stages=alt.stages,
                                                   error=repr(e)[:300]))
        for backend in ("triton", "gluon"):
            def call(backend=backend):
                return linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend=backend)
            row[f"fwd_{backend}_ms"] = median_ms(call)
            try:                       # the eager time includes the host path; the graph replay does not
                row[f"fwd_{backend}_graph_ms"] = graph_ms(call)
            except Exception as e:     # noqa: BLE001
                row[f"fwd_{backend}_graph_error"] = repr(e)[:300]
        if (B, T) in HOST_SHAPES:
            row.update(host_cache_timing(x, glu_run))
        row["fwd_speedup"] = row["fwd_triton_ms"] / row["fwd_gluon_ms"]
        if "fwd_gluon_graph_ms" in row and "fwd_triton_graph_ms" in row:
            row["fwd_graph_speedup"] = row["fwd_triton_graph_ms"] / row["fwd_gluon_graph_ms"]
    return row


def host_cache_timing(x, state_run):
    """The gluon forward (and the state pass alone) with the launcher's host-path cache on (plans + compiled-handle
    launch, the default) and off (four TensorDescriptor.from_tensor and the JIT launch per call), in this one
    process: eager ms (CUDA events, back-to-back calls) and host-clock us per call (no synchronisation inside);
    plus the Triton forward's host-clock us. Prediction in benchmarks/GLUON_FWD.md "Host path"."""
    import linattn
    from linattn.ops.gated_delta_rule.gluon.launcher import host_path
    from linattn.runtime.settings import settings

    def fwd(backend):
        return lambda: linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend=backend)
    out = dict(host_cache_default=settings.gluon_host_cache)
    for tag, on in (("cache", True), ("nocache", False)):
        with host_path.options(plan_cache=on, handle=on):
            out[f"fwd_gluon_{tag}_ms"] = median_ms(fwd("gluon"))
            out[f"fwd_gluon_{tag}_host_us"] = host_us(fwd("gluon"))
            out[f"state_gluon_{tag}_ms"] = median_ms(state_run)
            out[f"state_gluon_{tag}_host_us"] = host_us(state_run)
    out["fwd_triton_host_us"] = host_us(fwd("triton"))
    out["fwd_host_cache_gain_ms"] = out["fwd_gluon_nocache_ms"] - out["fwd_gluon_cache_ms"]
    return out


# ---------------------------------------------------------------- child: one variant

def child(variant, out_dir, no_timing, sweep):
    from gdn_fwd_gate import run_case, sync_free_checks
    os.environ["LINATTN_GDN_GLUON_VARIANT"] = variant
    path = os.path.join(out_dir, f"gdn_gluon_{variant}.json")
    res = dict(variant=variant, cases=[], started=time.time())
    t0 = time.time()
    for c in gate_cases():
        c = list(c)
        c[-1] = dict(c[-1])                  # run_case pops from `extra`
        tc = time.time()
        try:
            r = run_case(*c, backend="gluon")
        except Exception as e:
            r = dict(case=c[0], passed=False, error=repr(e), trace=traceback.format_exc()[-1500:])
        r["seconds"] = time.time() - tc
        res["cases"].append(r)
        print(f"[{variant}] {'PASS' if r['passed'] else 'FAIL'} {r['case']} "
              f"o {r.get('err_o', float('nan')):.2e} state {r.get('err_state', float('nan')):.2e} "
              f"{r.get('error', '')}", flush=True)
        _write(path, res)
        torch.cuda.empty_cache()
    for name, fn in (("grad", grad_check), ("sync_free", lambda: sync_free_checks("gluon"))):
        try:
            r = fn()
        except Exception as e:
            r = dict(passed=False, error=repr(e), trace=traceback.format_exc()[-1500:])
        res[name] = r
        print(f"[{variant}] {name}: {r}", flush=True)
    res["gate_passed"] = (all(r["passed"] for r in res["cases"]) and res["grad"]["passed"]
                          and res["sync_free"]["passed"])
    res["gate_seconds"] = time.time() - t0
    _write(path, res)
    print(f"[{variant}] gate {'GREEN' if res['gate_passed'] else 'RED'} in {res['gate_seconds']:.0f} s", flush=True)
    if res["gate_passed"] and not no_timing:
        res["timing"] = []
        for B, T in TIMING_SHAPES:
            try:
                row = timing_row(variant, B, T, sweep and (B, T) in SWEEP_SHAPES)
            except Exception as e:
                row = dict(B=B, T=T, error=repr(e), trace=traceback.format_exc()[-1500:])
            torch.cuda.empty_cache()
            res["timing"].append(row)
            print(f"[{variant}] {row}", flush=True)
            _write(path, res)
    res["seconds"] = time.time() - t0
    _write(path, res)


# ---------------------------------------------------------------- parent

def table(results):
    lines = ["variant  gate        state ms (gluon / triton / x)                 forward ms (gluon / triton / x)"]
    for v, r in results.items():
        gate = ("GREEN" if r.get("gate_passed") else "RED") + (f" {r['status']}" if r.get("status") else "")
        nfail = sum(not c.get("passed") for c in r.get("cases", []))
        head = f"{v:8s} {gate:5s} {nfail:2d} fail"
        rows = r.get("timing") or []
        if not rows:
            lines.append(head)
        for i, t in enumerate(rows):
            shape = f"B{t['B']} T{t['T']}"
            if "error" in t:
                cells = f"{shape:10s} error {t['error'][:80]}"
            else:
                cells = (f"{shape:10s} {t['state_gluon_ms']:7.3f} / {t['state_triton_ms']:7.3f} / "
                         f"{t['state_speedup']:4.2f}x   {t['fwd_gluon_ms']:7.3f} / {t['fwd_triton_ms']:7.3f} / "
                         f"{t['fwd_speedup']:4.2f}x")
            lines.append(f"{head if i == 0 else ' ' * len(head)}  {cells}")
            if "fwd_gluon_nocache_ms" in t:
                lines.append(f"{' ' * len(head)}  {'':10s} host cache on/off: forward {t['fwd_gluon_cache_ms']:7.3f} / "
                             f"{t['fwd_gluon_nocache_ms']:7.3f} ms eager, {t['fwd_gluon_cache_host_us']:6.1f} / "
                             f"{t['fwd_gluon_nocache_host_us']:6.1f} us host (triton {t['fwd_triton_host_us']:6.1f})")
    return "\n".join(lines)


def warm_up_triton():
    """Compile the Triton stages once in the parent, outside the variants' time shares; the children find them in
    the Triton cache (set TRITON_CACHE_DIR to share it with other steps on the machine too). Triton specialises on
    the head counts and dtype (constexpr / pointer types) and on N == 1 vs other N (int argument), so the forward
    runs once per such class of the gate and timing cases, the backward once for the gradient check. No Gluon
    here: nothing in the parent can hang on a Gluon kernel."""
    import linattn
    from linattn.testing import make_gdn_inputs
    with torch.no_grad():
        mixed = dict(gate_dtype=BF, beta_dtype=torch.float32, state_dtype=FP16)   # as mixed_fp16_beta32_g16_h0_16
        for B, H, HV, dtype, extra in ((1, 16, 32, BF, {}), (2, 16, 32, BF, {}), (1, 16, 32, FP16, {}),
                                       (2, 8, 16, FP16, {}), (2, 8, 16, FP16, mixed)):
            x = make_gdn_inputs(B, 130, H, HV, 128, 128, dtype=dtype, device="cuda", **extra)
            linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
    x = make_gdn_inputs(*GRAD_SHAPE, dtype=BF, device="cuda", requires_grad=True)
    o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
    (o.float().sum() + ht.sum()).backward()
    torch.cuda.synchronize()


def dry_run(out_dir, variants):
    """CPU check of the script's logic: everything imports, the case list builds, every case is a shape the
    gluon backend is meant for, and the configs the launcher would pick are registered for AOT."""
    import linattn  # noqa: F401
    from gdn_fwd_gate import run_case, sync_free_checks  # noqa: F401
    from linattn.ops.gated_delta_rule.aot import CONFIGS, kernel_name
    from linattn.ops.gated_delta_rule.gluon.launcher import state_config
    cs = gate_cases()
    bad = [c[0] for c in cs if not (c[5] == c[6] == 128 and c[7] in (BF, FP16))]
    lens_ok = [c[0] for c in cs if c[8] is not None and sum(c[8]) != c[2]]
    registered = {kernel_name(*c) for c in CONFIGS}
    configs = {}
    for v in variants:
        for B, T in TIMING_SHAPES:
            cfg = state_config(v, B, 32, 128, num_sms=132)
            name = kernel_name(v, "bf16", cfg.BV, cfg.num_warps, cfg.stages if v != "literal" else 0)
            configs[f"{v} B{B} T{T}"] = dict(name=name, registered=name in registered)
    from linattn.ops.gated_delta_rule.gluon.launcher import host_path
    with host_path.options(plan_cache=False, handle=False) as hp:     # the switch host_cache_timing flips
        switch_ok = not hp.plan_cache and not hp.handle
    host_shapes_ok = all(s in TIMING_SHAPES for s in HOST_SHAPES)
    out = dict(cases=[c[0] for c in cs], unsupported_cases=bad, bad_varlen=lens_ok, configs=configs,
               host_cache=dict(default=[host_path.plan_cache, host_path.handle], switch_ok=switch_ok,
                               shapes=[f"B{b} T{t}" for b, t in HOST_SHAPES], shapes_timed=host_shapes_ok),
               passed=not bad and not lens_ok and all(c["registered"] for c in configs.values()) and switch_ok
               and host_shapes_ok)
    print(json.dumps(out, indent=1))
    if out_dir:
        _write(os.path.join(out_dir, "gdn_gluon_dryrun.json"), out)
    return 0 if out["passed"] else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget", type=float, default=195.0, help="seconds for all variants together")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the other state-pass configs (BV 32/64, 2/3 stages) at B1 T65536 and B8 T4096")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if a.dry_run:
        return dry_run(a.out, variants)
    if a.child:
        child(a.child, a.out, a.no_timing, a.sweep)
        return 0
    from common import env_line
    t_start = time.time()
    env = env_line()
    print(env["line"], flush=True)
    results = {}
    t_warm = time.time()
    try:
        warm_up_triton()
        warm = dict(seconds=time.time() - t_warm)
    except Exception as e:
        warm = dict(error=repr(e), seconds=time.time() - t_warm)
    print(f"Triton warm-up (compiles shared by the children through the Triton cache): {warm}", flush=True)
    for i, v in enumerate(variants):
        left = a.budget - (time.time() - t_start)
        share = left / (len(variants) - i)           # unused time of a fast variant passes to the next ones
        if share < 10:
            results[v] = dict(status="SKIP", note=f"only {left:.0f} s of the budget left")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--out", a.out, "--child", v]
        if a.no_timing:
            cmd.append("--no-timing")
        if a.sweep:
            cmd.append("--sweep")
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, timeout=share, text=True, capture_output=True)
            status, rc = None, proc.returncode
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            status, rc = "TIMEOUT", None
            log = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + \
                  ((e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))
        print(log[-6000:], flush=True)
        path = os.path.join(a.out, f"gdn_gluon_{v}.json")
        r = json.load(open(path)) if os.path.exists(path) else {}
        if status is None and rc != 0:
            status = f"CRASH rc={rc}"
        if status:
            r["status"] = status
        r["child_seconds"] = time.time() - t0
        r["child_timeout_s"] = share
        r["log_tail"] = log[-3000:]
        results[v] = r
    summary = table(results)
    _write(os.path.join(a.out, "gdn_gluon.json"), dict(env=env, warm_up=warm, results=results, table=summary,
                                                       seconds=time.time() - t_start))
    print(summary)
    green = [v for v, r in results.items() if r.get("gate_passed")]
    other = [f"{v} ({r.get('status') or 'RED'})" for v, r in results.items() if v not in green]
    late = [f"{v} ({r['status']})" for v, r in results.items() if v in green and r.get("status")]
    print(f"GATE GREEN: {', '.join(green) or 'none'}; not green: {', '.join(other) or 'none'}"
          + (f"; green but stopped during timing: {', '.join(late)}" if late else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
