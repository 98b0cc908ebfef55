"""GPU round for the segment warm-up scheme on the Gluon TMA state pass (gluon/chunk_state_warmup_tma.py; opt-in
LINATTN_GDN_SEGMENT_WARMUP=1 on the gluon backend; benchmarks/GLUON_WARMUP.md).

    python benchmarks/gpu/gluon_warmup_round.py --out DIR [--budget 150] [--no-timing]
    TRITON_INTERPRET=1 python benchmarks/gpu/gluon_warmup_round.py --out DIR --dry-run   # CPU: tiny shapes, stand-ins

1. gate: on identical stage-2 outputs (the Triton forward's w, u, gcum from make_gdn_inputs, whose keys are
   L2-normalised), the Gluon warm-up pass (chunk_state_warmup_gluon, its automatic segment plan unless forced) and the
   plain Gluon pass (chunk_state_gluon), outputs NaN-poisoned first, each against an fp64 state pass over the same
   stage-2 outputs, run chunk by chunk on the device (errors accumulated per chunk, no fp64 copy of h): h (every chunk
   start), vnew, final state, relative RMS (linattn.testing.rel_rms semantics: non-finite -> inf), TOL of the dtype.
   Also warm-up vs plain Gluon (max abs difference); at weak decay every window reaches the sequence start, so the
   two must agree to <= 1e-6 relative (expected: bit-identical). Cases: B1 T65536 H16/HV32 default gates (the one
   long case), T8192 H16/HV32 strong (g ~ -0.5/token) and weak (g ~ -1e-4/token) decay, T4133 H2/HV8 with forced
   8-chunk segments (9 segments, ragged last chunk, no initial state), fp16 T8192 H2/HV8; the window lengths the
   kernel finds (computed on the host from g, warmup_state_round.window_stats). Plus the whole gluon-backend forward
   (launcher.chunk_gated_delta_rule_fwd_gluon, keys_normalised=True) at B1 T8192 H16/HV32, switch on vs off: the
   warm-up kernel launched exactly once (spy), o and final vs the fp64 chunk reference, and a second call under
   torch.cuda.set_sync_debug_mode("error") (no host synchronisation). The gate cases (forward case last) run in a
   CHILD PROCESS watched by the parent (case_watchdog.py, as in gluon_fused_ws_round.py): --case-timeout (60 s; the
   first case, which pays the start-up and compiles, twice that) per case; a case past it (a hang in the barrier
   protocol) is recorded as {"passed": false, "error": "timeout ...", "timed_out": true}, the child is killed and a
   fresh one takes the remaining cases; no new case starts after --budget - 20 s ({"skipped": "budget"}).
2. only if the gate is green (and --no-timing is not given), within --budget seconds: stage 3 alone on identical
   stage-2 outputs, CUDA-graph replay median (ms): plain Gluon, warm-up Gluon (automatic S), warm-up Triton
   (chunk_state_warmup at the Triton forward's config), plain Triton, at B1 T65536 H16/HV32, B1 T65536 H2/HV8, B1
   T32768 H16/HV32, B1 T8192 H16/HV32 (in that order); then, while the budget lasts, a sweep of the Gluon warm-up
   (S neighbours; 1 ring stage: 3 CTAs per SM), the weak-decay worst case at T65536 H16/HV32, and the gluon-backend
   forward switch off vs on at B1 T65536 H16/HV32.
`--dry-run` (CPU, TRITON_INTERPRET=1, K=V=128 at tiny T): STAND-INS, labelled in res["stand_ins"]: the Gluon warm-up
kernel's launch runs the Triton warm-up kernel on the Gluon launcher's own arguments (the descriptors' bases), the
plain Gluon pass runs the Triton state kernel; host-clock times, no claims.
Writes DIR/gluon_warmup.json after every case and row (a timeout keeps what was measured) and prints a table.
"""
import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)                                       # common, warmup_state_round, case_watchdog
sys.path.insert(1, ROOT)                                       # linattn from this checkout
import torch  # noqa: E402
from case_watchdog import child_env, child_loop, script_cmd, watch_cases  # noqa: E402
from common import graph_ms, median_ms, round_result, write_json  # noqa: E402

BF, FP16 = torch.bfloat16, torch.float16
ENV = "LINATTN_GDN_SEGMENT_WARMUP"
FAKE_HANG_ENV = "WARMUP_ROUND_FAKE_HANG"      # names a gate case that then sleeps forever (tests the watchdog)
FORWARD_CASE = "forward_gluon_backend_switch"
TIMING = ((1, 65536, 16, 32), (1, 65536, 2, 8), (1, 32768, 16, 32), (1, 8192, 16, 32))
TIMING_DRY = ((1, 64 * 8, 1, 2),)
START = time.time()
STAND_INS = []


def elapsed():
    return time.time() - START


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _set(on):
    os.environ[ENV] = "1" if on else "0"
    # the fused Gluon stages 3+4 (on by default since round 14) take precedence over the warm-up pass: this round
    # measures the unfused forward's state pass, with and without the warm-up
    os.environ["LINATTN_GDN_GLUON_FUSED_WS"] = "0"
    os.environ["LINATTN_GDN_GLUON_FUSED_WU"] = "0"     # the fused-wu kernel too (on by default since round 15)


# ---------------------------------------------------------------- stand-ins (dry run only)

def triton_stand_in_warmup(grid, args, kwargs):
    """DRY-RUN STAND-IN for chunk_state_warmup_tma_kernel[grid](*args, **kwargs): the Triton warm-up kernel on the
    tensors behind the Gluon launcher's arguments (the descriptors' bases are the same memory as the Triton launch's
    tensors), with the grid, N, segment length, threshold and constexprs the Gluon launcher chose."""
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import chunk_state_warmup_kernel
    kd, wd, ud, gcum, hd, vnew, h0, ht, cu, offs, N, L, thresh = args
    chunk_state_warmup_kernel[grid](
        kd.base, wd.base, ud.base, gcum, hd.base, vnew, h0, ht, cu, offs, N, L, thresh,
        H=kwargs["H"], HV=kwargs["HV"], K=kwargs["K"], V=kwargs["V"], BT=kwargs["BT"], BK=kwargs["K"],
        BV=kwargs["BV"], USE_H0=kwargs["USE_H0"], STORE_HT=kwargs["STORE_HT"], DOT_PREC="tf32", num_warps=4)


class StandInKernel:
    """Replaces chunk_state_warmup_tma's kernel object: kernel[grid](*args, **kwargs) records the launch and runs the
    Triton warm-up kernel (triton_stand_in_warmup)."""
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            triton_stand_in_warmup(grid, args, kwargs)
        return run


def plain_stand_in(k, w, u, gcum, h, vnew, h0, final, plan, variant=None, config=None):
    """DRY-RUN STAND-IN for launcher.chunk_state_gluon: the Triton state kernel (BV 64)."""
    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    H, K = k.shape[2], k.shape[3]
    HV, V = u.shape[1], u.shape[2]
    chunk_state_fwd_kernel[(V // 64, plan.N * HV)](
        k, w, u, gcum, h, vnew, h0 if h0 is not None else gcum, final if final is not None else gcum,
        plan.cu, plan.chunk_offsets, H=H, HV=HV, K=K, V=V, BT=64, BK=K, BV=64,
        USE_H0=h0 is not None, STORE_HT=final is not None, DOT_PREC="tf32", num_warps=4)


def install_dry_run_stand_ins():
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    from linattn.ops.gated_delta_rule.gluon import launcher
    from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as tw
    gw.chunk_state_warmup_tma_kernel = StandInKernel()
    launcher.chunk_state_gluon = plain_stand_in
    tw.MIN_SEG_CHUNKS = 2                                    # several segments at the tiny shapes
    STAND_INS.extend([
        "chunk_state_warmup_tma_kernel launch -> Triton chunk_state_warmup_kernel on the Gluon launcher's arguments",
        "launcher.chunk_state_gluon -> Triton chunk_state_fwd_kernel (BV 64)",
        "triton/chunk_state_warmup.MIN_SEG_CHUNKS = 2 (segment plans at tiny T)"])


# ---------------------------------------------------------------- helpers

def _gates(x, kind, gen):
    if kind == "strong":
        x["g"] = -0.5 * (torch.rand(x["g"].shape, generator=gen) + 0.5).to(x["g"].device, x["g"].dtype)
    elif kind == "weak":
        x["g"] = -1e-4 * (torch.rand(x["g"].shape, generator=gen) + 0.5).to(x["g"].device, x["g"].dtype)
    return x                                                 # "default": make_gdn_inputs' gates (keys normalised)


def stage2(B, T, H, HV, dev, dtype=BF, gates="default", h0=True, seed=3):
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(seed)
    x = _gates(make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, device=dev, initial_state=h0, generator=gen),
               gates, gen)
    _set(False)
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"],
                                         True, None, compute_output=False)
    return x, res


def poisoned(res):
    return (torch.full_like(res.h, float("nan")), torch.full_like(res.vnew, float("nan")),
            torch.full_like(res.final_state, float("nan")))


def run_plain_gluon(x, res, out):
    from linattn.ops.gated_delta_rule.gluon import launcher

    def run():
        launcher.chunk_state_gluon(x["k"], res.w, res.u, res.gcum, out[0], out[1], x["initial_state"], out[2],
                                   res.plan)
    return run


def run_warm_gluon(x, res, out, **kw):
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw

    def run():
        return gw.chunk_state_warmup_gluon(x["k"], res.w, res.u, res.gcum, out[0], out[1], x["initial_state"],
                                           out[2], res.plan, **kw)
    return run


def run_triton(x, res, out, warm):
    import triton

    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import chunk_state_warmup
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2
    k, plan, h0 = x["k"], res.plan, x["initial_state"]
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)

    def run():
        if warm:
            return chunk_state_warmup(k, res.w, res.u, res.gcum, out[0], out[1], h0, out[2], plan, H=H, HV=HV, K=K,
                                      V=V, dot_prec="tf32", BV=cfg.BV_state, num_warps=cfg.warps_state,
                                      num_stages=cfg.stages)
        chunk_state_fwd_kernel[(triton.cdiv(V, cfg.BV_state), plan.N * HV)](
            k, res.w, res.u, res.gcum, out[0], out[1], h0 if h0 is not None else res.gcum, out[2], plan.cu,
            plan.chunk_offsets, H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state,
            USE_H0=h0 is not None, STORE_HT=True, DOT_PREC="tf32", num_warps=cfg.warps_state, num_stages=cfg.stages)
    return run


def fp64_errors(x, res, outs):
    """Relative RMS errors of each (h, vnew, final) in `outs` against the fp64 state pass over the same stage-2
    outputs (fixed-length batch), accumulated chunk by chunk on the device. Non-finite output -> inf."""
    k, plan, h0 = x["k"], res.plan, x["initial_state"]
    B, T, H, K = k.shape
    HV, V = res.u.shape[1], res.u.shape[2]
    G = HV // H
    nch = -(-T // 64)
    w = res.w.view(B, T, HV, K)
    u = res.u.view(B, T, HV, V)
    gc = res.gcum.view(B, T, HV)
    S = h0.double().clone() if h0 is not None else torch.zeros(B, HV, K, V, dtype=torch.float64, device=k.device)
    slots = plan.chunk_offsets[:-1].tolist()
    acc = [[torch.zeros((), dtype=torch.float64, device=k.device) for _ in range(6)] for _ in outs]
    for c in range(nch):
        t0, t1 = c * 64, min(T, c * 64 + 64)
        for o, a in zip(outs, acc):
            hc = torch.stack([o[0][slots[n] + c] for n in range(B)]).double()
            a[0] += (hc - S).square().sum()
            a[1] += S.square().sum()
        wc = w[:, t0:t1].double().permute(0, 2, 1, 3)                       # [B, HV, BT, K]
        uc = u[:, t0:t1].double().permute(0, 2, 1, 3)
        kc = k[:, t0:t1].double().repeat_interleave(G, dim=2).permute(0, 2, 1, 3)
        gam = gc[:, t0:t1].double().permute(0, 2, 1)                         # [B, HV, BT]
        vn = uc - wc @ S
        for o, a in zip(outs, acc):
            vo = o[1].view(B, T, HV, V)[:, t0:t1].double().permute(0, 2, 1, 3)
            a[2] += (vo - vn).square().sum()
            a[3] += vn.square().sum()
        gl = gam[..., -1:]
        S = S * gl.exp()[..., None] + kc.transpose(-1, -2) @ (vn * (gl - gam).exp()[..., None])
    out = []
    for o, a in zip(outs, acc):
        a[4] += (o[2].double() - S).square().sum()
        a[5] += S.square().sum()
        vals = [float(v) for v in a]
        finite = all(bool(torch.isfinite(t).all()) for t in (o[1], o[2])) and all(
            bool(torch.isfinite(o[0][slots[n]:slots[n] + nch]).all()) for n in range(B))
        err = {}
        for name, (num, den) in zip(("h", "vnew", "final"), ((vals[0], vals[1]), (vals[2], vals[3]),
                                                              (vals[4], vals[5]))):
            err[name] = float("inf") if not finite else (num ** 0.5 / den ** 0.5 if den > 0 else num ** 0.5)
        out.append(err)
    return out


def _max_rel_diff(a, b):
    """max |a - b| / max |b| over (h, vnew, final) (NaN anywhere: NaN)."""
    d = 0.0
    for x, y in zip(a, b):
        den = float(y.float().abs().max()) or 1.0
        d = max(d, float((x.float() - y.float()).abs().max()) / den)
    return d


# ---------------------------------------------------------------- gate

def gate_cases(dry):
    # (name, B, T, H, HV, dtype, gates, forced segment chunks or None, initial state)
    if dry:
        return [("dry_default", 1, 64 * 8, 1, 2, BF, "default", None, True),
                ("dry_weak_exact", 1, 64 * 8, 1, 2, BF, "weak", None, True),
                ("dry_strong_L2_ragged_no_h0", 1, 64 * 6 + 37, 1, 2, FP16, "strong", 2, False)]
    return [("T65536_H16_HV32_default", 1, 65536, 16, 32, BF, "default", None, True),
            ("T8192_H16_HV32_strong", 1, 8192, 16, 32, BF, "strong", None, True),
            ("T8192_H16_HV32_weak_exact", 1, 8192, 16, 32, BF, "weak", None, True),
            ("T4133_H2_HV8_default_L8_no_h0", 1, 4133, 2, 8, BF, "default", 8, False),
            ("fp16_T8192_H2_HV8_default", 1, 8192, 2, 8, FP16, "default", None, True)]


def run_gate_case(case, dev):
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import THRESH
    from linattn.testing import TOL
    from warmup_state_round import window_stats
    name, B, T, H, HV, dtype, gates, forced, h0 = case
    x, res = stage2(B, T, H, HV, dev, dtype, gates, h0)
    plain, warm = poisoned(res), poisoned(res)
    run_plain_gluon(x, res, plain)()
    S, L = run_warm_gluon(x, res, warm, seg_chunks=forced)()
    sync(dev)
    e_warm, e_plain = fp64_errors(x, res, [warm, plain])
    vs_plain = _max_rel_diff(warm, plain)
    tol = TOL[dtype]
    ok = all(e_warm[k] <= tol for k in e_warm) and all(e_plain[k] <= tol for k in e_plain)
    if gates == "weak":
        ok = ok and vs_plain <= 1e-6
    return dict(case=name, B=B, T=T, H=H, HV=HV, dtype=str(dtype), gates=gates, segments=S, seg_chunks=L,
                err_warm=e_warm, err_plain=e_plain, vs_plain_max_rel=vs_plain,
                bit_identical_to_plain=vs_plain == 0.0, windows=window_stats(x["g"], S, L, THRESH), tol=tol,
                passed=bool(ok))


def forward_case(dev, dry):
    """The gluon backend's forward (launcher.chunk_gated_delta_rule_fwd_gluon, keys_normalised=True), switch on vs
    off: the warm-up kernel launched once, o and final vs the fp64 chunk reference, no host sync (GPU)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, rel_rms
    B, T, H, HV = (1, 64 * 8, 1, 2) if dry else (1, 8192, 16, 32)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=BF, device=dev, generator=torch.Generator().manual_seed(5))
    calls = []
    orig = gw.chunk_state_warmup_gluon

    def spy(*a, **kw):
        calls.append(orig(*a, **kw))
        return calls[-1]
    gw.chunk_state_warmup_gluon = spy
    out = {}
    try:
        for on in (True, False):
            _set(on)
            with torch.no_grad(), poisoned_allocations():
                r = chunk_gated_delta_rule_fwd_gluon(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5,
                                                     x["initial_state"], True, None, keys_normalised=True)
            out[on] = (r.o, r.final_state)
        sync(dev)
        launched = list(calls)
        sync_free = "not checked (CPU)"
        if dev == "cuda":
            _set(True)
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.no_grad():
                    chunk_gated_delta_rule_fwd_gluon(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5,
                                                     x["initial_state"], True, None, keys_normalised=True)
                sync_free = "passed"
            except Exception as e:  # noqa: BLE001
                sync_free = "FAILED: " + repr(e)[:300]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            sync(dev)
    finally:
        gw.chunk_state_warmup_gluon = orig
        _set(False)
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        ro, rh = chunk_reference(**x64, output_final_state=True)
    (o, ht), (po, pht) = out[True], out[False]
    tol = TOL[BF]
    eo, eh = rel_rms(o, ro), rel_rms(ht, rh)
    return dict(case="forward_gluon_backend_switch", B=B, T=T, H=H, HV=HV, launches=len(launched),
                plan=launched[0] if launched else None, err_o=eo, err_state=eh, plain_err_o=rel_rms(po, ro),
                plain_err_state=rel_rms(pht, rh), sync_free=sync_free,
                passed=bool(len(launched) == 1 and eo <= tol and eh <= tol and sync_free in ("passed",
                                                                                           "not checked (CPU)")))


def run_gate_item(name, dev, dry):
    """One gate case by name (in the watched child): its row, an exception as {"passed": False, "error": trace}."""
    t0 = time.time()
    try:
        if name == FORWARD_CASE:
            r = forward_case(dev, dry)
        else:
            r = run_gate_case({c[0]: c for c in gate_cases(dry)}[name], dev)
    except Exception:  # noqa: BLE001
        r = dict(case=name, passed=False, error=traceback.format_exc()[-1500:])
    r["s"] = round(time.time() - t0, 2)
    if dev == "cuda":
        torch.cuda.empty_cache()
    return r


def child_main(names_json, dev, dry):
    """The watched child: the named gate cases in order in this process (case_watchdog.child_loop)."""
    if dry:
        install_dry_run_stand_ins()
    child_loop(json.loads(names_json), lambda name: run_gate_item(name, dev, dry), fake_hang_env=FAKE_HANG_ENV)


def gate(res, path, a):
    """The gate cases, then the forward case, in a watched child process (case_watchdog.watch_cases): each gets
    --case-timeout seconds from its start (the first, which pays the start-up and compiles, twice that); a case past
    it (a hang in the barrier protocol) is recorded as {"passed": False, "error": "timeout ...", "timed_out": True},
    the child is killed and a fresh one takes the remaining cases. No new case starts after budget - 20 seconds
    ({"skipped": "budget"})."""
    rows = res["gate"]

    def on_result(r, seconds):
        r.setdefault("passed", False)       # a row from child_loop's fallback carries "ok" instead
        r["wall_s"] = seconds
        rows.append(r)
        write_json(path, res)
        print(("PASS " if r["passed"] else "FAIL ") + r["case"] + (f" {r['error'][-300:]}" if "error" in r else ""),
              flush=True)

    def on_failure(name, why, seconds):
        rows.append(dict(case=name, passed=False, error=why, timed_out=why.startswith("timeout"), s=seconds,
                         wall_s=seconds))
        write_json(path, res)
        print(f"FAIL {name} {why[:300]}", flush=True)

    names = [c[0] for c in gate_cases(a.dry_run)] + [FORWARD_CASE]
    extra = ["--out", a.out] + (["--dry-run"] if a.dry_run else [])
    skipped = watch_cases(names, lambda todo: script_cmd(__file__, todo, *extra), case_timeout=a.case_timeout,
                          first_timeout=2 * a.case_timeout, stop=lambda: elapsed() > a.budget - 20,
                          on_result=on_result, on_failure=on_failure, env=child_env(ROOT))
    rows += [dict(case=name, passed=False, skipped="budget") for name in skipped]


# ---------------------------------------------------------------- timing

def _time(fn, dev):
    return graph_ms(fn) if dev == "cuda" else median_ms(fn, warmup=0, repeats=1)


def timing_row(B, T, H, HV, dev, budget_left):
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import plan_warmup
    from linattn.ops.gated_delta_rule.triton.forward import _configs
    t_row = time.time()
    x, res = stage2(B, T, H, HV, dev)
    row = dict(B=B, T=T, H=H, HV=HV)
    o1, o2 = poisoned(res), poisoned(res)
    row["gluon_plain_ms"] = _time(run_plain_gluon(x, res, o1), dev)
    run = run_warm_gluon(x, res, o2)
    S, L = run()
    row["gluon_warm"] = dict(segments=S, seg_chunks=L, ms=_time(run, dev))
    row["triton_warm"] = dict(ms=_time(run_triton(x, res, o2, warm=True), dev))
    cfg = _configs(128, 128, res.plan.N, HV, x["k"].device)
    row["triton_warm"]["segments"], row["triton_warm"]["seg_chunks"] = plan_warmup(res.plan, HV, 128,
                                                                                   cfg.BV_state, x["k"].device)
    row["triton_plain_ms"] = _time(run_triton(x, res, o2, warm=False), dev)
    row["speedup_gluon_warm_vs_gluon_plain"] = row["gluon_plain_ms"] / row["gluon_warm"]["ms"]
    row["speedup_gluon_warm_vs_triton_warm"] = row["triton_warm"]["ms"] / row["gluon_warm"]["ms"]
    # sweep while the budget lasts: S neighbours at 2 stages, 1 stage (3 CTAs per SM) at its own S
    from linattn.ops.gated_delta_rule.gluon.launcher import StateConfig
    n_sms = gw._num_sms(x["k"].device)
    base_cfg = gw.warmup_config("wgmma", res.plan.N, HV, 128, n_sms)
    cfg1 = StateConfig(base_cfg.BV, 4, 1)
    S1, _ = gw.plan_gluon_warmup(res.plan, HV, 128, "wgmma", cfg1, x["k"].device)
    row["sweep"] = []
    for label, kw in [(f"s2 S{s}", dict(num_segments=s)) for s in sorted({S + 1, 2 * S}) if s != S] + \
                     [(f"s1 S{S1}", dict(num_segments=S1, config=cfg1))]:
        if time.time() - t_row > budget_left * 0.5:
            row["sweep"].append(dict(config=label, skipped="budget"))
            continue
        r = run_warm_gluon(x, res, o2, **kw)
        got = r()
        row["sweep"].append(dict(config=label, segments=got[0], seg_chunks=got[1], ms=_time(r, dev)))
    return row


def extras(dev, dry, budget_end):
    """Weak-decay worst case and the gluon-backend forward switch off/on at B1 T65536 H16/HV32 (if time is left)."""
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    from linattn.testing import make_gdn_inputs
    B, T, H, HV = (1, 64 * 8, 1, 2) if dry else (1, 65536, 16, 32)
    out = {}
    if time.time() < budget_end - 20:
        x, res = stage2(B, T, H, HV, dev, gates="weak")
        o1, o2 = poisoned(res), poisoned(res)
        out["weak_decay"] = dict(gluon_plain_ms=_time(run_plain_gluon(x, res, o1), dev),
                                 gluon_warm_ms=_time(run_warm_gluon(x, res, o2), dev))
        del x, res, o1, o2
    if time.time() < budget_end - 20:
        x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=BF, device=dev)
        fw = {}
        for on in (False, True):
            _set(on)

            def fwd():
                with torch.no_grad():
                    chunk_gated_delta_rule_fwd_gluon(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5,
                                                     x["initial_state"], True, None, keys_normalised=True)
            fw["on" if on else "off"] = _time(fwd, dev)
        _set(False)
        out["forward_gluon_backend_ms"] = fw
    return out


def table(res):
    lines = ["gate: " + ("ALL PASSED" if res.get("gate_passed") else "NOT PASSED")]
    for c in res.get("gate", []):
        if "error" in c or "skipped" in c:
            lines.append(f"  {c['case']}: {c.get('error', c.get('skipped'))[-300:]}")
            continue
        if "err_warm" in c:
            ew, ep, wn = c["err_warm"], c["err_plain"], c["windows"]
            lines.append(f"  {c['case']}: S={c['segments']} L={c['seg_chunks']} warm h {ew['h']:.2e} vnew "
                         f"{ew['vnew']:.2e} final {ew['final']:.2e} | plain h {ep['h']:.2e} vnew {ep['vnew']:.2e} "
                         f"final {ep['final']:.2e} | vs plain {c['vs_plain_max_rel']:.1e} | window mean "
                         f"{wn.get('mean', 0):.1f} max {wn.get('max', 0)} | {'ok' if c['passed'] else 'FAIL'}")
        else:
            lines.append(f"  {c['case']}: launches {c['launches']} plan {c['plan']} o {c['err_o']:.2e} state "
                         f"{c['err_state']:.2e} (off: {c['plain_err_o']:.2e} / {c['plain_err_state']:.2e}) sync-free "
                         f"{c['sync_free']} | {'ok' if c['passed'] else 'FAIL'}")
    for r in res.get("timing", []):
        if "error" in r or "skipped" in r:
            lines.append(f"  B{r['B']} T{r['T']} H{r['H']}/HV{r['HV']}: {r.get('error', r.get('skipped'))[-300:]}")
            continue
        sw = " ".join(f"{e['config']} {e['ms']:.3f}" for e in r["sweep"] if "ms" in e)
        lines.append(f"  B{r['B']} T{r['T']} H{r['H']}/HV{r['HV']}: gluon plain {r['gluon_plain_ms']:.3f} | gluon warm "
                     f"S{r['gluon_warm']['segments']} {r['gluon_warm']['ms']:.3f} | triton warm "
                     f"S{r['triton_warm']['segments']} {r['triton_warm']['ms']:.3f} | triton plain "
                     f"{r['triton_plain_ms']:.3f} ms | x{r['speedup_gluon_warm_vs_gluon_plain']:.2f} vs gluon plain, "
                     f"x{r['speedup_gluon_warm_vs_triton_warm']:.2f} vs triton warm | sweep {sw}")
    if res.get("extras"):
        lines.append(f"  extras: {res['extras']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--case-timeout", type=float, default=60.0, help="seconds per gate case in the watched child "
                                                                     "(the first case twice that)")
    ap.add_argument("--child-case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not a.dry_run:
        sys.exit("no CUDA device: use --dry-run (with TRITON_INTERPRET=1) for a CPU run of the code paths")
    if a.child_case is not None:
        child_main(a.child_case, dev, a.dry_run)
        return 0
    if a.dry_run:
        install_dry_run_stand_ins()
    path = os.path.join(a.out, "gluon_warmup.json")
    res = round_result("gluon_warmup_round.py", dev, dry_run=a.dry_run, budget=a.budget)
    res["stand_ins"] = STAND_INS
    res["gate"] = []
    res["case_timeout_s"] = a.case_timeout
    gate(res, path, a)
    res["gate_passed"] = bool(res["gate"] and all(c.get("passed") for c in res["gate"]))
    res["gate_s"] = elapsed()
    write_json(path, res)
    if res["gate_passed"] and not a.no_timing:
        res["timing"] = []
        for B, T, H, HV in (TIMING_DRY if a.dry_run else TIMING):
            left = a.budget - elapsed()
            if left < 15:
                res["timing"].append(dict(B=B, T=T, H=H, HV=HV, skipped="budget"))
                continue
            try:
                res["timing"].append(timing_row(B, T, H, HV, dev, left))
            except Exception:  # noqa: BLE001
                res["timing"].append(dict(B=B, T=T, H=H, HV=HV, error=traceback.format_exc()[-1500:]))
            write_json(path, res)
        try:
            res["extras"] = extras(dev, a.dry_run, START + a.budget)
        except Exception:  # noqa: BLE001
            res["extras"] = dict(error=traceback.format_exc()[-1500:])
    res["total_s"] = elapsed()
    write_json(path, res)
    print(table(res))
    print(f"results: {path} ({res['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
