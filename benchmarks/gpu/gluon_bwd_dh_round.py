"""GPU round for the Gluon reverse state pass of the GDN backward (gluon/chunk_state_bwd.py, LINATTN_GDN_GLUON_BWD_DH=1;
benchmarks/GLUON_BWD_DH.md): `python benchmarks/gpu/gluon_bwd_dh_round.py --out DIR [--budget 150] [--dry-run]`.

1. gate (no new case after --gate-budget seconds; listed as skipped). The cases run in a CHILD PROCESS watched by the
   parent (case_watchdog.py, as in gluon_fused_ws_round.py): --case-timeout (60 s; the first case, which pays the
   start-up and compiles, twice that) per case; a case past it (a hang in the barrier protocol) is recorded as
   {"passed": false, "error": "timeout ...", "timed_out": true}, the child is killed and a fresh one takes the
   remaining cases. Timing runs in the parent process.
   a. kernel: on identical inputs (the backward's own recompute of w, gcum and its dv_local stage's dvnew), the Gluon
      kernel (chunk_state_bwd_gluon) against the Triton kernel (chunk_state_bwd_kernel, launched as backward.py
      does): dh (the chunk slots in use), dvnew (updated in place from the same start), dh0; relative RMS
      (linattn.testing.rel_rms semantics), outputs NaN-poisoned first, tolerance linattn.testing.TOL of the dtype.
      Cases: T = 1, 63, 64, 65, 1000 (B2, GVA), varlen with 1-token sequences, B8 T4096, B1 T65536, fp16, with and
      without d final_state / dh0.
   b. whole backward: linattn.chunk_gated_delta_rule(backend="gluon") forward + backward with the switch ON,
      NaN-poisoned buffers, every gradient against autograd through the fp64 chunk reference on the GPU (gdn_bwd_gate
      helpers and tolerances); the Gluon kernel must run exactly once per backward; the gradients with the switch on
      are also compared with the switch off ("vs_off", the Triton stage-1).
2. only if the gate is green (and --no-timing is not given): timing, CUDA events, median of repeats after warm-up,
   at B1 T65536, B8 T4096, B1 T32768, B1 T8192 in that order (H16 HV32 K=V=128 bf16, initial state and dht):
   a. the state-backward kernel alone, Triton vs Gluon (the launcher's config, then the other AOT-registered configs
      as a sweep while the budget lasts); dvnew is restored before every call, outside the timed events;
   b. the whole gluon-backend backward (backend._backward, the autograd function of backend="gluon") with the switch
      off and on, in the same process.
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes, with STAND-INS (res["stand_ins"]):
the Gluon kernel launch is replaced by the Triton kernel fed from the Gluon launcher's own arguments, the forward's
Gluon state pass by the Triton one, and the gluon backend's device check is bypassed. Host-clock times, no claims.
Writes DIR/gluon_bwd_dh.json after every case and row (a timeout keeps what was measured) and prints a table.
"""
import argparse
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)                                       # common, gdn_bwd_gate, case_watchdog
sys.path.insert(1, ROOT)                                       # linattn from this checkout
import torch  # noqa: E402
from case_watchdog import child_env, child_loop, script_cmd, watch_cases  # noqa: E402
from common import median_ms, round_result, write_json  # noqa: E402

ENV = "LINATTN_GDN_GLUON_BWD_DH"
FAKE_HANG_ENV = "BWD_DH_ROUND_FAKE_HANG"      # names a gate case that then sleeps forever (tests the watchdog)
TIMING_ROWS = ((1, 65536), (8, 4096), (1, 32768), (1, 8192))    # the shape that matters first
DRY_TIMING_ROWS = ((1, 130), (2, 65))
START = time.time()


def elapsed():
    return time.time() - START


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- stand-ins (dry run only)

def triton_stand_in_kernel(grid, args, kwargs):
    """DRY-RUN STAND-IN for chunk_state_bwd_tma_kernel[grid](*args, **kwargs): runs the Triton chunk_state_bwd_kernel
    on the tensors behind the Gluon launcher's arguments (the descriptors' bases are the same memory as the tensors
    the Triton launch takes), with the grid and constexprs the launcher chose."""
    from linattn.ops.gated_delta_rule.triton.backward_state import chunk_state_bwd_kernel
    qd, kd, wd, dod, _dvd, gcum, dhd, dvnew, dht, dh0, cu, offs, scale = args
    chunk_state_bwd_kernel[grid](
        qd.base, kd.base, wd.base, gcum, dod.base, dhd.base, dvnew, dht, dh0, cu, offs, scale,
        H=kwargs["H"], HV=kwargs["HV"], K=kwargs["K"], V=kwargs["V"], BT=kwargs["BT"], BK=kwargs["K"],
        BV=kwargs["BV"], USE_DHT=kwargs["USE_DHT"], STORE_DH0=kwargs["STORE_DH0"], DOT_PREC="tf32", num_warps=4)


class StandInKernel:
    """Replaces the module's Gluon kernel object: kernel[grid](*args, **kwargs) records the launch and runs the
    Triton kernel (triton_stand_in_kernel)."""
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            triton_stand_in_kernel(grid, args, kwargs)
        return run


def install_dry_run_stand_ins():
    """What the dry run replaces (all labelled in the JSON). Returns an undo function."""
    import dataclasses

    from linattn.backends import op_backends
    from linattn.ops.gated_delta_rule.gluon import chunk_state_bwd as gb
    from linattn.ops.gated_delta_rule.gluon import launcher
    table = op_backends("chunk_gated_delta_rule")
    saved = (gb.__dict__.get("chunk_state_bwd_tma_kernel"), launcher.chunk_state_gluon, table.backends["gluon"])
    gb.chunk_state_bwd_tma_kernel = StandInKernel()

    def fwd_state(k, w, u, gcum, h, vnew, h0, final, plan, variant=None, config=None):
        import triton

        from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
        H, K = k.shape[2], k.shape[3]
        HV, V = u.shape[1], u.shape[2]
        chunk_state_fwd_kernel[(triton.cdiv(V, 64), plan.N * HV)](
            k, w, u, gcum, h, vnew, h0 if h0 is not None else gcum, final if final is not None else gcum,
            plan.cu, plan.chunk_offsets, H=H, HV=HV, K=K, V=V, BT=64, BK=K, BV=64,
            USE_H0=h0 is not None, STORE_HT=final is not None, DOT_PREC="tf32", num_warps=4)
    launcher.chunk_state_gluon = fwd_state
    table.backends["gluon"] = dataclasses.replace(saved[2], supports=lambda **_: (True, ""))
    # the gluon forward's fused stages 3+4 (on by default since round 14) have no CPU stand-in here: the forward
    # then runs the state pass above and the Triton output stage
    # (nor the fused-wu kernel, on by default since round 15)
    fused_envs = ("LINATTN_GDN_GLUON_FUSED_WS", "LINATTN_GDN_GLUON_FUSED_WU")
    saved_env = {e: os.environ.get(e) for e in fused_envs}
    for e in fused_envs:
        os.environ[e] = "0"

    def undo():
        gb.chunk_state_bwd_tma_kernel, launcher.chunk_state_gluon, table.backends["gluon"] = saved
        for e, value in saved_env.items():
            if value is None:
                os.environ.pop(e, None)
            else:
                os.environ[e] = value
    return undo


STAND_INS = ["gluon/chunk_state_bwd.py chunk_state_bwd_tma_kernel -> Triton chunk_state_bwd_kernel on the Gluon "
             "launcher's arguments", "gluon/launcher.py chunk_state_gluon (forward) -> Triton chunk_state_fwd_kernel",
             "gluon backend supports() -> True (no sm_90 device check)",
             "LINATTN_GDN_GLUON_FUSED_WS=0 (the fused Gluon forward has no CPU stand-in here)"]


# ---------------------------------------------------------------- the two launches on identical inputs

def prepare(B, T, H, HV, dtype, dev, lens=None, dht=True, h0=True, seed=0):
    """Inputs of stage 1 as the backward makes them: the recomputed w, gcum and plan, dO, and dvnew after the
    dv_local stage (dvnew0, kept to restore)."""
    from linattn.ops.gated_delta_rule.triton import backward as bw
    from linattn.ops.gated_delta_rule.triton.backward_dv_local import chunk_dv_local_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs, random_cu_seqlens
    K = V = 128
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=dev, num_states=len(lens) if lens else None,
                        initial_state=h0, generator=gen)
    cu = random_cu_seqlens(lens, dev) if lens else None
    scale = K ** -0.5
    with torch.no_grad():
        fwd = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], False,
                                         cu, compute_output=False)
    plan = fwd.plan
    do = torch.randn(B, T, HV, V, device=dev).to(dtype)          # on the device: no GB of host randn at T=65536
    N = plan.N
    dht_t = torch.randn(N, HV, K, V, device=dev) if dht else None
    cfg = bw._configs(K, V, N, HV, dev)
    dvnew0 = torch.empty(plan.T_total, HV, V, dtype=dtype, device=dev)
    chunk_dv_local_kernel[(plan.num_slots, HV)](
        x["q"], x["k"], fwd.gcum, do, dvnew0, plan.cu, plan.chunk_indices, N, scale,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, BV=cfg.BV, DOT_PREC="tf32", num_warps=cfg.warps_dv_local,
        num_stages=2)
    return SimpleNamespace(x=x, q=x["q"], k=x["k"], w=fwd.w, gcum=fwd.gcum, do=do, dht=dht_t, plan=plan, scale=scale,
                           dvnew0=dvnew0, want_dh0=h0, H=H, HV=HV, K=K, V=V, cfg=cfg)


def outputs(p, dev):
    """Fresh NaN-poisoned dh and dh0, and dvnew restored from dvnew0 (it is updated in place)."""
    from linattn.runtime.alloc import empty, poisoned_allocations
    with poisoned_allocations():
        dh = empty(p.plan.num_slots, p.HV, p.K, p.V, dtype=p.q.dtype, device=dev)
        dh0 = empty(p.plan.N, p.HV, p.K, p.V, dtype=torch.float32, device=dev) if p.want_dh0 else None
    return dh, p.dvnew0.clone(), dh0


def triton_launch(p, dh, dvnew, dh0):
    """Stage 1 exactly as triton/backward.py launches it."""
    import triton

    from linattn.ops.gated_delta_rule.triton.backward_state import chunk_state_bwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK
    cfg = p.cfg
    chunk_state_bwd_kernel[(triton.cdiv(p.V, cfg.BV_state), p.plan.N * p.HV)](
        p.q, p.k, p.w, p.gcum, p.do, dh, dvnew, p.dht if p.dht is not None else p.gcum,
        dh0 if dh0 is not None else p.gcum, p.plan.cu, p.plan.chunk_offsets, p.scale,
        H=p.H, HV=p.HV, K=p.K, V=p.V, BT=CHUNK, BK=cfg.BK_state, BV=cfg.BV_state,
        USE_DHT=p.dht is not None, STORE_DH0=dh0 is not None, DOT_PREC="tf32",
        num_warps=cfg.warps_state, num_stages=cfg.stages_state)


def gluon_launch(p, dh, dvnew, dh0, config=None):
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import chunk_state_bwd_gluon
    chunk_state_bwd_gluon(p.q, p.k, p.w, p.gcum, p.do, dh, dvnew, p.dht, dh0, p.plan, p.scale, config)


def _rel(a, b):
    """linattn.testing.rel_rms on the tensors' device (inf when `a` has a non-finite element)."""
    a, b = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    den = float(b.norm())
    return float((a - b).norm()) / den if den else float((a - b).norm())


KERNEL_CASES = [  # name, B, T, H, HV, dtype, lens, dht, h0
    ("T1", 2, 1, 16, 32, "bf16", None, True, True),
    ("T63", 2, 63, 16, 32, "bf16", None, True, True),
    ("T64_no_dht", 2, 64, 16, 32, "bf16", None, False, True),
    ("T65_no_dh0", 2, 65, 16, 32, "bf16", None, True, False),
    ("T1000", 2, 1000, 16, 32, "bf16", None, True, True),
    ("T1000_fp16_no_dht_no_dh0", 2, 1000, 8, 16, "fp16", None, False, False),
    ("varlen_1tok", 1, None, 16, 32, "bf16", [1, 1, 63, 1, 65, 1000, 1, 64, 128, 1], True, True),
    ("varlen_1tok_fp16_no_dht", 1, None, 8, 16, "fp16", [1, 200, 1, 63, 64, 1], False, True),
    ("B8_T4096", 8, 4096, 16, 32, "bf16", None, True, True),
    ("B1_T65536", 1, 65536, 16, 32, "bf16", None, True, True),
]
DRY_KERNEL_CASES = [
    ("T1", 2, 1, 1, 2, "bf16", None, True, True),
    ("T65_no_dh0", 2, 65, 1, 2, "bf16", None, True, False),
    ("T64_fp16_no_dht", 1, 64, 1, 2, "fp16", None, False, True),
    ("varlen_1tok", 1, None, 1, 2, "bf16", [1, 63, 1, 65, 1], True, True),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def kernel_case(case, dev):
    from linattn.testing import TOL
    name, B, T, H, HV, dt, lens, dht, h0 = case
    T = sum(lens) if lens else T
    p = prepare(B, T, H, HV, DTYPES[dt], dev, lens, dht, h0)
    out = {}
    for which, launch in (("triton", triton_launch), ("gluon", gluon_launch)):
        dh, dvnew, dh0 = outputs(p, dev)
        launch(p, dh, dvnew, dh0)
        sync(dev)
        out[which] = (dh, dvnew, dh0)
    used = int(p.plan.chunk_offsets[-1])
    errs = {"dh": _rel(out["gluon"][0][:used], out["triton"][0][:used]), "dvnew": _rel(out["gluon"][1], out["triton"][1])}
    if h0:
        errs["dh0"] = _rel(out["gluon"][2], out["triton"][2])
    tol = TOL[DTYPES[dt]]
    return dict(case=name, shape=dict(B=B, T=T, H=H, HV=HV, dtype=dt, lens=lens, dht=dht, dh0=h0),
                errors_vs_triton=errs, tol=tol, passed=all(e <= tol for e in errs.values()))


BWD_CASES = [  # gdn_bwd_gate-style cases the gluon backend takes (K = V = 128, 16-bit)
    dict(name="bwd-T65-gva-fp16-no-h0", B=2, T=65, H=8, HV=16, K=128, V=128, dtype="float16", h0=False),
    dict(name="bwd-varlen-1tok", lengths=[1, 63, 1, 65, 1000, 1, 64], H=16, HV=32, K=128, V=128, l2norm=True),
    dict(name="bwd-long-T65536", B=1, T=65536, H=16, HV=32, K=128, V=128),
]
DRY_BWD_CASES = [
    dict(name="bwd-T65-fp16-no-h0", B=1, T=65, H=1, HV=2, K=128, V=128, dtype="float16", h0=False),
    dict(name="bwd-varlen-1tok", lengths=[1, 64, 1, 5], H=1, HV=2, K=128, V=128, l2norm=True),
]


class LaunchCounter:
    """Counts chunk_state_bwd_gluon calls (the backend looks the function up on its module at each backward)."""
    def __init__(self):
        from linattn.ops.gated_delta_rule.gluon import chunk_state_bwd as gb
        self.gb, self.orig, self.n = gb, gb.chunk_state_bwd_gluon, 0

        def counted(*a, **kw):
            self.n += 1
            return self.orig(*a, **kw)
        gb.chunk_state_bwd_gluon = counted

    def close(self):
        self.gb.chunk_state_bwd_gluon = self.orig


STATE_ENV = "LINATTN_GDN_GLUON_BWD_STATE"


def set_switch(on, state=False):
    """The dh switch explicitly on or off (on by default since round 14, so off must be "0"); state: also the Gluon
    recompute of the forward's state pass in the backward (LINATTN_GDN_GLUON_BWD_STATE)."""
    os.environ[ENV] = "1" if on else "0"
    os.environ[STATE_ENV] = "1" if state else "0"


def bwd_case(case, dev):
    import gdn_bwd_gate as gg

    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    inp, cu = gg._make(case, dev)
    l2 = case.get("l2norm", False)
    ref, do, dht = gg._reference_grads(inp, cu, l2)
    fn = lambda *a, **kw: linattn.chunk_gated_delta_rule(*a, backend="gluon", **kw)  # noqa: E731
    got, counter = {}, LaunchCounter()
    try:
        for on in (True, False):
            set_switch(on)
            n0 = counter.n
            with poisoned_allocations():
                out = gg._run_op(fn, inp, cu, l2, do, dht)
            sync(dev)
            got[on] = {n: t.detach().clone() for n, t in out.items()}
            if on:
                taken = counter.n - n0
            else:
                taken_off = counter.n - n0
    finally:
        counter.close()
        set_switch(False)
    errs, ok = gg._errors(got[True], ref, inp["q"].dtype)
    vs = {n: gg._rel(got[True][n], got[False][n]) for n in got[True] if n not in ("o", "final_state")}
    return dict(case=case["name"], shape=case, gluon_dh_launches=taken, gluon_dh_launches_switch_off=taken_off,
                errors=errs, vs_off=vs, errors_off=gg._errors(got[False], ref, inp["q"].dtype)[0],
                passed=bool(ok and taken == 1 and taken_off == 0))


def gate_items(dry):
    """The gate's cases in order, by name: {name: (kind, case)}."""
    items = [("kernel", c) for c in (DRY_KERNEL_CASES if dry else KERNEL_CASES)]
    items += [("backward", c) for c in (DRY_BWD_CASES if dry else BWD_CASES)]
    return {(c[0] if kind == "kernel" else c["name"]): (kind, c) for kind, c in items}


def run_gate_item(name, dev, dry):
    """One gate case (in the watched child): its row, an exception as {"passed": False, "error": trace}."""
    kind, case = gate_items(dry)[name]
    t0 = time.time()
    try:
        r = kernel_case(case, dev) if kind == "kernel" else bwd_case(case, dev)
    except Exception:  # noqa: BLE001
        r = dict(case=name, passed=False, error=traceback.format_exc()[-1500:])
    r["kind"] = kind
    r["s"] = round(time.time() - t0, 2)
    if dev == "cuda":
        torch.cuda.empty_cache()
    return r


def child_main(names_json, dev, dry):
    """The watched child: the named gate cases in order in this process (case_watchdog.child_loop)."""
    set_switch(False)
    if dry:
        install_dry_run_stand_ins()
    torch.manual_seed(0)
    child_loop(json.loads(names_json), lambda name: run_gate_item(name, dev, dry), fake_hang_env=FAKE_HANG_ENV)


def _print_row(r):
    print(("PASS " if r["passed"] else "FAIL ") + str({k: r.get(k) for k in (
        "kind", "case", "errors_vs_triton", "gluon_dh_launches", "errors", "error")}), flush=True)


def gate(dev, dry, budget, save, case_timeout=60.0, out="."):
    """The gate cases run in a watched child process (case_watchdog.watch_cases): each gets case_timeout seconds from
    its start (the first, which pays the start-up and compiles, twice that); a case past it (a hang in the barrier
    protocol) is recorded as {"passed": False, "error": "timeout ...", "timed_out": True}, the child is killed and a
    fresh one takes the remaining cases. No new case starts after `budget` seconds ("skipped: gate budget")."""
    rows = []
    items = gate_items(dry)

    def on_result(r, seconds):
        r.setdefault("kind", items[r["case"]][0])
        r.setdefault("passed", False)       # a row from child_loop's fallback carries "ok" instead
        r["wall_s"] = seconds
        rows.append(r)
        save(rows)
        _print_row(r)

    def on_failure(name, why, seconds):
        rows.append(dict(kind=items[name][0], case=name, passed=False, error=why, timed_out=why.startswith("timeout"),
                         s=seconds, wall_s=seconds))
        save(rows)
        _print_row(rows[-1])

    extra = ["--out", out] + (["--dry-run"] if dry else [])
    skipped = watch_cases(list(items), lambda todo: script_cmd(__file__, todo, *extra), case_timeout=case_timeout,
                          first_timeout=2 * case_timeout, stop=lambda: elapsed() > budget, on_result=on_result,
                          on_failure=on_failure, env=child_env(ROOT))
    for name in skipped:
        rows.append(dict(kind=items[name][0], case=name, passed=False, error="skipped: gate budget"))
    save(rows)
    return rows


# ---------------------------------------------------------------- timing

def kernel_ms(run, restore, dev, warmup=3, repeats=15):
    """Median ms of run() by CUDA events, restore() (dvnew's start values) before each call outside the events."""
    for _ in range(warmup):
        restore()
        run()
    if dev != "cuda":
        restore()
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) * 1e3
    times = []
    for _ in range(repeats):
        restore()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def sweep_configs():
    from linattn.ops.gated_delta_rule.aot import BWD_DH_CONFIGS
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import BwdStateConfig
    return [BwdStateConfig(bv, w, s) for dt, bv, w, s in BWD_DH_CONFIGS if dt == "bf16"]


def timing_row(B, T, dev, dry, budget):
    from linattn.ops.gated_delta_rule.gluon import backend
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_config
    from linattn.runtime.device import device_facts
    H, HV = (1, 2) if dry else (16, 32)
    p = prepare(B, T, H, HV, torch.bfloat16, dev)
    row = dict(B=B, T=T, H=H, HV=HV, K=128, V=128)
    dh, dvnew, dh0 = outputs(p, dev)
    restore = lambda: dvnew.copy_(p.dvnew0)  # noqa: E731
    cfg = state_bwd_config(p.plan.N, HV, 128, device_facts(dev).num_sms)
    row["gluon_config"] = dict(BV=cfg.BV, num_warps=cfg.num_warps, stages=cfg.stages)
    row["triton_config"] = dict(BV=p.cfg.BV_state, num_warps=p.cfg.warps_state, stages=p.cfg.stages_state)
    row["state_bwd_triton_ms"] = kernel_ms(lambda: triton_launch(p, dh, dvnew, dh0), restore, dev)
    row["state_bwd_gluon_ms"] = kernel_ms(lambda: gluon_launch(p, dh, dvnew, dh0, cfg), restore, dev)
    row["state_bwd_speedup"] = row["state_bwd_triton_ms"] / row["state_bwd_gluon_ms"]
    # the whole gluon-backend backward (its autograd function), switch off and on, on the same inputs
    x, do, dfinal = p.x, p.do, p.dht
    ctx = SimpleNamespace(saved_tensors=(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], None),
                          scale=128 ** -0.5, output_final_state=True, variant=backend.selected_variant())
    # bwd_on_state_ms: the dh pass and the Gluon recompute of the forward state pass together (round 13 gated the
    # recompute, green, but never timed it)
    for key, on, state in (("bwd_off_ms", False, False), ("bwd_on_ms", True, False),
                           ("bwd_on_state_ms", True, True), ("bwd_state_only_ms", False, True)):
        set_switch(on, state)
        try:
            with torch.no_grad():
                row[key] = median_ms(lambda: backend._backward(ctx, do, dfinal), warmup=3 if dev == "cuda" else 1,
                                     repeats=10)
        finally:
            set_switch(False)
    row["bwd_speedup"] = row["bwd_off_ms"] / row["bwd_on_ms"]
    row["bwd_saved_ms"] = row["bwd_off_ms"] - row["bwd_on_ms"]
    row["bwd_state_speedup"] = row["bwd_on_ms"] / row["bwd_on_state_ms"]   # what the recompute adds on top of dh
    # the other registered configs while the budget lasts (sweep)
    row["sweep"] = []
    for alt in sweep_configs():
        if alt == cfg or elapsed() > budget:
            continue
        try:
            ms = kernel_ms(lambda: gluon_launch(p, dh, dvnew, dh0, alt), restore, dev)
            row["sweep"].append(dict(BV=alt.BV, num_warps=alt.num_warps, stages=alt.stages, ms=ms))
        except Exception as e:  # noqa: BLE001
            row["sweep"].append(dict(BV=alt.BV, num_warps=alt.num_warps, stages=alt.stages, error=repr(e)[:300]))
    return row


def row_line(r):
    if "error" in r:
        return f"  B{r['B']} T{r['T']}: ERROR {r['error'][:200]}"
    sweep = " ".join(f"bv{s['BV']}s{s['stages']} {s['ms']:.3f}" for s in r.get("sweep", []) if "ms" in s)
    return (f"  B{r['B']} T{r['T']}: state bwd Triton {r['state_bwd_triton_ms']:.3f} ms | Gluon "
            f"{r['state_bwd_gluon_ms']:.3f} ms (x{r['state_bwd_speedup']:.3f}) | backward off {r['bwd_off_ms']:.3f} "
            f"on {r['bwd_on_ms']:.3f} ms (x{r['bwd_speedup']:.3f}, {r['bwd_saved_ms']:+.3f} ms)"
            f" | +state {r.get('bwd_on_state_ms', float('nan')):.3f} ms, state only "
            f"{r.get('bwd_state_only_ms', float('nan')):.3f} ms"
            + (f" | sweep {sweep}" if sweep else ""))


def timing(dev, dry, budget, save):
    rows = []
    for B, T in (DRY_TIMING_ROWS if dry else TIMING_ROWS):
        if elapsed() > budget:
            rows.append(dict(B=B, T=T, error="skipped: budget"))
            continue
        try:
            rows.append(timing_row(B, T, dev, dry, budget))
        except Exception:  # noqa: BLE001
            rows.append(dict(B=B, T=T, error=traceback.format_exc()[-1500:]))
        save(rows)
        print(row_line(rows[-1]), flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(res):
    lines = ["gate: " + ("PASSED" if res.get("gate_passed") else "NOT PASSED")
             + ("" if res.get("gate_complete", True) else " (cases skipped for the budget)")]
    for c in res.get("gate", []):
        if "error" in c:
            lines.append(f"  {c['kind']} {c['case']}: ERROR {c['error'][:200]}")
        elif c["kind"] == "kernel":
            errs = " ".join(f"{n} {e:.1e}" for n, e in c["errors_vs_triton"].items())
            lines.append(f"  kernel {c['case']}: Gluon vs Triton {errs} (tol {c['tol']:.0e}) "
                         f"{'ok' if c['passed'] else 'FAIL'}")
        else:
            errs = " ".join(f"{n if n in ('o', 'final_state') else 'd' + n} "
                            + (f"{e:.1e}" if isinstance(e, float) else str(e)) for n, e in c["errors"].items())
            lines.append(f"  backward {c['case']}: Gluon dh launches {c['gluon_dh_launches']} | vs fp64: {errs} "
                         f"{'ok' if c['passed'] else 'FAIL'}")
    lines += [row_line(r) for r in res.get("timing", [])]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150.0, help="total seconds: no timing row starts after budget-25")
    ap.add_argument("--gate-budget", type=float, default=80.0, help="seconds; no new gate case starts after it")
    ap.add_argument("--case-timeout", type=float, default=60.0, help="seconds per gate case in the watched child "
                                                                     "(the first case twice that)")
    ap.add_argument("--child-case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1, with "
                                                           "the Gluon launch replaced by the Triton kernel")
    a = ap.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs the kernels on the CPU: set TRITON_INTERPRET=1")
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run with TRITON_INTERPRET=1 for a CPU run of the logic")
    if a.child_case is not None:
        child_main(a.child_case, dev, a.dry_run)
        return
    set_switch(False)
    path = os.path.join(a.out, "gluon_bwd_dh.json")
    res = round_result("gluon_bwd_dh_round.py", dev, dry_run=a.dry_run)
    undo = None
    if a.dry_run:
        res["stand_ins"] = STAND_INS
        undo = install_dry_run_stand_ins()
    torch.manual_seed(0)

    def saver(key):
        def save(rows):
            res[key] = rows
            write_json(path, res)
        return save
    try:
        res["case_timeout_s"] = a.case_timeout
        res["gate"] = gate(dev, a.dry_run, a.gate_budget, saver("gate"), a.case_timeout, a.out)
        ran = [c for c in res["gate"] if not str(c.get("error", "")).startswith("skipped")]
        res["gate_complete"] = len(ran) == len(res["gate"])
        res["gate_passed"] = bool(ran and all(c.get("passed") for c in ran))
        res["gate_s"] = round(elapsed(), 1)
        write_json(path, res)
        if res["gate_passed"] and not a.no_timing:
            res["timing"] = timing(dev, a.dry_run, a.budget - 25, saver("timing"))
    finally:
        if undo is not None:
            undo()
    res["total_s"] = round(elapsed(), 1)
    write_json(path, res)
    print(table(res))
    print(f"results: {path} ({res['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
