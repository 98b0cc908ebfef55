"""The Gluon reverse state pass of the GDN backward (gluon/chunk_state_bwd.py, LINATTN_GDN_GLUON_BWD_DH=1) on a CPU
host: every registered config compiles for sm_90a with WGMMA, TMA loads/store and mbarriers, spills nothing and fits
in shared memory; the launcher's arguments are exactly what was compiled, through the real JIT path too; a torch
model of the ring kernel's arithmetic (whole boxes running into the next sequence, masks in registers, the kernel's
roundings) matches the Triton kernel; the switch is off by default and, set, hands the launcher the backward's
tensors (a stand-in runs the Triton kernel in place of the Gluon launch: Gluon kernels cannot run on a CPU); the GPU
round's --dry-run. The kernel itself has not run here: benchmarks/gpu/gluon_bwd_dh_round.py gates it on an H200.
Run only what this file covers: `python -m pytest tests/test_gluon_state_bwd.py`."""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMEM_LIMIT_SM90 = 232448
_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()
NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_bwd_dh_gluon_"))
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


def test_launcher_configs_are_registered():
    from linattn.ops.gated_delta_rule.aot import BWD_DH_CONFIGS, bwd_dh_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_config
    names = {bwd_dh_kernel_name(*c) for c in BWD_DH_CONFIGS}
    assert names == set(NAMES)
    for N in (1, 8):                      # B1 T65536 and B8 T4096 at H16/HV32 on an H200 (132 SMs)
        cfg = state_bwd_config(N, 32, 128, 132)
        assert bwd_dh_kernel_name("bf16", cfg.BV, cfg.num_warps, cfg.stages) in names
    assert state_bwd_config(1, 32, 128, 132).BV == 32 and state_bwd_config(1, 32, 128, 132).stages == 3
    assert state_bwd_config(8, 32, 128, 132).BV == 64 and state_bwd_config(8, 32, 128, 132).stages == 2


@needs_gluon
@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_spill_with_intended_instructions(name):
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    assert 0 < rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
    assert rep.num_warps == 4 and rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0
    bv = int(name.split("_bv")[1].split("_")[0])
    stages = int(name.rsplit("_s", 1)[1])
    # dVnew: 64 x BV x 128 (8 k-steps); dS: 128 x BV x 64 twice (2 M-halves x 4 k-steps each) -> 24 HGMMA 64xBVx16
    op = f"HGMMA.64x{bv}x16.F32" + (".BF16" if "_bf16_" in name else "")
    assert rep.sass.get(op, 0) == 24, rep.sass
    # five TMA loads (q, k, w, dO, dVnew) per issue: STAGES-1 prologue issues and one in the loop
    assert rep.sass.get("UTMALDG.2D", 0) == 5 * stages, rep.sass
    assert rep.sass.get("UTMASTG.2D", 0) == 1                     # dh[chunk] by TMA store
    assert rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 1  # waits on the ready barriers
    assert rep.sass.get("SYNCS.EXCH.64", 0) == stages              # one mbarrier init per ring slot


def _plan_and_buffers(B, T, H, HV, lens=None, dtype=torch.bfloat16, dht=True, dh0=True):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    K = V = 128
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, slots, N = plan.T_total, plan.num_slots, plan.N
    bufs = (torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, H, K, dtype=dtype),
            torch.zeros(T_tot, HV, K, dtype=dtype), torch.zeros(T_tot, HV), torch.zeros(B, T, HV, V, dtype=dtype),
            torch.zeros(slots, HV, K, V, dtype=dtype), torch.zeros(T_tot, HV, V, dtype=dtype),
            torch.zeros(N, HV, K, V) if dht else None, torch.zeros(N, HV, K, V) if dh0 else None)
    return plan, bufs


@needs_gluon
@pytest.mark.parametrize("B,T,lens", [(1, 4096, None), (8, 512, None), (1, 3000, [1, 63, 65, 1000, 1871])])
def test_launch_matches_aot_signature(B, T, lens):
    """state_bwd_launch's arguments (descriptors build on CPU tensors) mangle to exactly the AOT signature; grid,
    constexprs, descriptor views and boxes are the intended ones."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import bwd_dh_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_config, state_bwd_launch
    plan, bufs = _plan_and_buffers(B, T, 16, 32, lens)
    cfg = state_bwd_config(plan.N, 32, 128, 132)
    kernel, grid, args, kwargs = state_bwd_launch(*bufs, plan, 128 ** -0.5, cfg)
    sig = bwd_dh_signature("bf16", cfg.BV)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (128 // cfg.BV, plan.N * 32)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, BV=cfg.BV, USE_DHT=True, STORE_DH0=True,
                          STAGES=cfg.stages, num_warps=4)
    T_tot, slots = plan.T_total, plan.num_slots
    shapes = [list(a.shape) for a in args[:5]] + [list(args[6].shape)]
    assert shapes == [[T_tot, 16 * 128]] * 2 + [[T_tot, 32 * 128]] + [[T_tot, 32 * 128]] * 2 + [[slots * 32 * 128, 128]]
    assert [a.block_shape for a in args[:5]] + [args[6].block_shape] == \
        [[64, 128]] * 3 + [[64, cfg.BV]] * 2 + [[128, cfg.BV]]
    assert all(list(a.strides) == [a.shape[1], 1] for a in args[:5])
    q, k, w, gcum, do, dh, dvnew, dht, dh0 = bufs
    # the tensors themselves, not copies: dvnew is read by TMA and updated in place, dh written by TMA
    assert args[4].base.data_ptr() == dvnew.data_ptr() and args[7] is dvnew and args[6].base.data_ptr() == dh.data_ptr()
    assert args[5] is gcum and args[8] is dht and args[9] is dh0 and args[10] is plan.cu
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")


def _jit_compile_main():
    """Child process: the real JIT launch path (binder, specialisation, compile) with the launcher's own arguments on
    CPU tensors, under a stand-in driver that reports sm_90a and never launches (warmup). One JSON line per case."""
    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_config, state_bwd_launch

    use_compile_only_sm90_driver()
    for B, T, dtype, states in ((1, 300, torch.bfloat16, True), (8, 100, torch.float16, False)):
        plan, bufs = _plan_and_buffers(B, T, 16, 32, dtype=dtype, dht=states, dh0=states)
        cfg = state_bwd_config(plan.N, 32, 128, 132)
        kernel, grid, args, kwargs = state_bwd_launch(*bufs, plan, 128 ** -0.5, cfg)
        k = kernel.warmup(*args, grid=grid, **kwargs)
        print(json.dumps(dict(B=B, BV=cfg.BV, stages=cfg.stages, num_warps=k.metadata.num_warps,
                              shared=k.metadata.shared,
                              tma_boxes=[m["block_size"] for m in (k.metadata.tensordesc_meta or [])],
                              expect_tx=re.findall(r"mbarrier\.arrive\.expect_tx\S*\s+_,\s*\[[^\]]+\],\s*(\d+)",
                                                   k.asm["ptx"]))))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "jit"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["B"], r["BV"], r["stages"]) for r in rows] == [(1, 32, 3), (8, 64, 2)]
    for r in rows:
        assert r["num_warps"] == 4 and 0 < r["shared"] <= SMEM_LIMIT_SM90, r
        # q, k, w [64,128] boxes go as [64,64] messages (128-byte swizzle); dO, dVnew [64,BV]; dh [128,BV]
        assert r["tma_boxes"] == [[64, 64]] * 3 + [[64, r["BV"]]] * 2 + [[128, r["BV"]]], r
        # review 2026-11-29: every expect (STAGES-1 prologue issues + 1 in the loop) counts the five full boxes q, k, w
        # [64,128] and dO, dVnew [64,BV]: TMA counts the zero-filled rows past T_tot too, so a clipped last box
        # still completes the phase
        assert r["expect_tx"] == [str(2 * (3 * 64 * 128 + 2 * 64 * r["BV"]))] * r["stages"], r


if __name__ == "__main__":
    if sys.argv[1:] == ["jit"]:
        _jit_compile_main()


# ---------------------------------------------------------------- the ring kernel's arithmetic, modelled in torch

def _emulate_bwd_tma(q, k, w, gcum, do, dvnew_in, dht, want_dh0, plan, scale, BV, BT=64):
    """What chunk_state_bwd_tma_kernel computes, in torch, box by box: each chunk reads full [BT, .] boxes starting
    at its first token (rows of the next sequence included, zero past T_tot), neutralises the rows past the
    sequence end with where, rounds where the kernel rounds, and updates dvnew in place."""
    dt = q.dtype
    T_tot, HV, K = w.shape
    H, V = q.shape[2], do.shape[-1]
    pad = lambda t: torch.cat([t, t.new_zeros(BT, *t.shape[1:])])       # noqa: E731  TMA zero-fill past T_tot
    qp, kp, wp = pad(q.reshape(T_tot, H, K)), pad(k.reshape(T_tot, H, K)), pad(w)
    dop, gp = pad(do.reshape(T_tot, HV, V)), pad(gcum)
    dvnew = dvnew_in.clone()
    dh = torch.full((plan.num_slots, HV, K, V), float("nan"), dtype=dt)
    dh0 = torch.full((plan.N, HV, K, V), float("nan"))
    cu, offs = plan.cu.tolist(), plan.chunk_offsets.tolist()
    for n in range(plan.N):
        bos, eos = cu[n], cu[n + 1]
        for hv in range(HV):
            hk = hv // (HV // H)
            for vb in range(V // BV):
                cols = slice(vb * BV, (vb + 1) * BV)
                ds = dht[n, hv, :, cols].float().clone() if dht is not None else torch.zeros(K, BV)
                for c in reversed(range(-(-(eos - bos) // BT))):
                    t0 = bos + c * BT
                    valid = (torch.arange(BT) + t0) < eos
                    dh[offs[n] + c, hv, :, cols] = ds.to(dt)
                    dvp = pad(dvnew)                      # the box as read now (earlier chunks' rows: not yet written)
                    qb, kb, wb = qp[t0:t0 + BT, hk], kp[t0:t0 + BT, hk], wp[t0:t0 + BT, hv]
                    dob, dvb = dop[t0:t0 + BT, hv, cols], dvp[t0:t0 + BT, hv, cols]
                    gam = gp[t0:t0 + BT, hv]
                    g_last = gcum[t0 + min(eos - t0, BT) - 1, hv]
                    kdec = torch.where(valid[:, None], kb.float() * torch.exp(g_last - gam)[:, None], 0.).to(dt)
                    dv_op = (dvb.float() + kdec.float() @ ds.to(dt).float()).to(dt)
                    dvnew[torch.arange(t0, t0 + BT)[valid], hv, cols] = dv_op[valid]
                    qg = torch.where(valid[:, None], qb.float() * (torch.exp(gam) * scale)[:, None], 0.).to(dt)
                    neg = torch.where(valid[:, None], -dv_op.float(), 0.).to(dt)
                    ds = ds * torch.exp(g_last) + qg.float().T @ dob.float()
                    ds = ds + wb.float().T @ neg.float()
                if want_dh0:
                    dh0[n, hv, :, cols] = ds
    return dh, dvnew, (dh0 if want_dh0 else None)


def _gdn_round():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))
    import gluon_bwd_dh_round
    return gluon_bwd_dh_round


@pytest.mark.parametrize("lens,dht,h0,dtype", [(None, True, True, torch.bfloat16),
                                               ([1, 63, 1, 130, 64, 1], True, True, torch.bfloat16),
                                               ([65, 1, 64], False, False, torch.float16)])
def test_ring_model_matches_triton_kernel(device, lens, dht, h0, dtype):
    """Model check of the Gluon kernel's arithmetic (not of the Gluon code, which needs a GPU): whole boxes that run
    into the next sequence, the masks in registers, dVnew updated in place and one fp32 accumulator for dS give the
    Triton kernel's dh, dvnew and dh0 (same inputs: the backward's recompute and its dv_local stage)."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.testing import rel_rms
    rnd = _gdn_round()
    B, T = (1, sum(lens)) if lens else (2, 100)
    p = rnd.prepare(B, T, 1, 2, dtype, "cpu", lens, dht, h0)
    dh_t, dv_t, dh0_t = rnd.outputs(p, "cpu")
    rnd.triton_launch(p, dh_t, dv_t, dh0_t)
    dh_m, dv_m, dh0_m = _emulate_bwd_tma(p.q, p.k, p.w, p.gcum, p.do, p.dvnew0, p.dht, h0, p.plan, p.scale, BV=64)
    used = int(p.plan.chunk_offsets[-1])
    assert rel_rms(dh_m[:used], dh_t[:used]) < 2e-3
    assert rel_rms(dv_m, dv_t) < 2e-3
    if h0:
        assert rel_rms(dh0_m, dh0_t) < 2e-3


# ---------------------------------------------------------------- the switch

def test_switch_is_on_by_default(monkeypatch):
    """On by default since round 14 (gate green on the H200, backward 1.06-1.07x); "0" turns it off."""
    import importlib
    settings_mod = importlib.import_module("linattn.runtime.settings")   # the module (linattn.runtime.settings is the object)
    monkeypatch.delenv("LINATTN_GDN_GLUON_BWD_DH", raising=False)
    assert settings_mod.settings.gdn_gluon_bwd_dh is True
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_DH", "0")
    assert settings_mod.settings.gdn_gluon_bwd_dh is False
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_DH", "1")
    assert settings_mod.settings.gdn_gluon_bwd_dh is True
    assert "LINATTN_GDN_GLUON_BWD_DH" in settings_mod.__doc__


@needs_gluon
@pytest.mark.parametrize("varlen", [False, True])
def test_switch_reaches_the_gluon_launcher(device, monkeypatch, varlen):
    """LINATTN_GDN_GLUON_BWD_DH=1: the gluon backend's backward launches chunk_state_bwd_tma_kernel once, through
    state_bwd_launch, with the backward's own tensors (descriptor views, strides, boxes), the grid and constexprs of
    state_bwd_config; a stand-in runs the Triton kernel on those arguments, so the gradients equal the Triton
    backward's bit for bit. Set to "0", the Gluon launcher is never called."""
    if device != "cpu":
        pytest.skip("CPU orchestration check")
    from linattn.ops.gated_delta_rule.gluon import backend
    from linattn.ops.gated_delta_rule.gluon import chunk_state_bwd as gb
    from linattn.testing import make_gdn_inputs, random_cu_seqlens
    rnd = _gdn_round()
    stand_in = rnd.StandInKernel()
    monkeypatch.setattr(gb, "chunk_state_bwd_tma_kernel", stand_in)
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_STATE", "0")   # unset = Gluon at N*HV <= 64 (round 14)
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_DH", "0")
    lens = [1, 64, 1, 70] if varlen else None
    B, T, H, HV = (1, sum(lens), 1, 2) if varlen else (2, 70, 1, 2)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, device="cpu",
                        num_states=len(lens) if lens else None)
    cu = random_cu_seqlens(lens, "cpu") if lens else None
    do = torch.randn(B, T, HV, 128).to(torch.bfloat16)
    dfinal = torch.randn_like(x["initial_state"])
    ctx = SimpleNamespace(saved_tensors=(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], cu),
                          scale=128 ** -0.5, output_final_state=True, variant="wgmma")
    want = backend._backward(ctx, do, dfinal)
    assert stand_in.launches == []
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_DH", "1")
    got = backend._backward(ctx, do, dfinal)
    assert len(stand_in.launches) == 1
    grid, args, kwargs = stand_in.launches[0]
    N = len(lens) if lens else B
    T_tot = B * T
    cfg = gb.state_bwd_config(N, HV, 128, 2)              # the CPU's device_facts report 2 "SMs"
    assert grid == (128 // cfg.BV, N * HV)
    assert kwargs == dict(H=H, HV=HV, K=128, V=128, BT=64, BV=cfg.BV, USE_DHT=True, STORE_DH0=True,
                          STAGES=cfg.stages, num_warps=4)
    qd, kd, wd, dod, dvd, gcum, dhd, dvnew, dht, dh0, cu_arg, offs, scale = args
    assert [list(d.shape) for d in (qd, kd, wd, dod, dvd)] == [[T_tot, H * 128]] * 2 + [[T_tot, HV * 128]] * 3
    assert [list(d.strides) for d in (qd, kd, wd, dod, dvd)] == [[H * 128, 1]] * 2 + [[HV * 128, 1]] * 3
    assert dvd.base.data_ptr() == dvnew.data_ptr() and dvnew.shape == (T_tot, HV, 128)
    assert list(dhd.shape) == [dhd.base.shape[0], 128] and dhd.block_shape == [128, cfg.BV]
    assert gcum.shape == (T_tot, HV) and gcum.dtype == torch.float32
    assert dht.shape == dh0.shape == (N, HV, 128, 128) and dh0.dtype == torch.float32
    assert torch.equal(dht, dfinal) and int(cu_arg[-1]) == T_tot and offs.shape == (N + 1,)
    assert scale == pytest.approx(128 ** -0.5)
    assert qd.base.data_ptr() == x["q"].data_ptr() and dod.base.data_ptr() == do.data_ptr()
    assert len(got) == len(want) == 11         # the op's 11 inputs (variant, keys_normalised last)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


def test_gpu_round_dry_run(tmp_path):
    """benchmarks/gpu/gluon_bwd_dh_round.py --dry-run: the gate (Gluon launcher vs Triton kernel on identical inputs
    through the stand-in; whole backward with the switch on vs fp64, the launch counted) and the timing rows' logic,
    on the CPU under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    env.pop("LINATTN_GDN_GLUON_BWD_DH", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_bwd_dh_round.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gluon_bwd_dh.json").read_text())
    assert res["dry_run"] and any("Triton" in s for s in res["stand_ins"]) and "env" in res
    assert res["gate_passed"] and res["gate_complete"]
    kinds = [c["kind"] for c in res["gate"]]
    assert kinds.count("kernel") == 4 and kinds.count("backward") == 2
    assert all(c["gluon_dh_launches"] == 1 and c["gluon_dh_launches_switch_off"] == 0
               for c in res["gate"] if c["kind"] == "backward")
    assert [(r["B"], r["T"]) for r in res["timing"]] == [(1, 130), (2, 65)]
    for r in res["timing"]:
        assert r["state_bwd_triton_ms"] > 0 and r["state_bwd_gluon_ms"] > 0 and r["bwd_on_ms"] > 0
        assert r["bwd_on_state_ms"] > 0 and r["bwd_state_only_ms"] > 0 and r["bwd_off_ms"] > 0
        assert all("ms" in s for s in r["sweep"])


def test_gpu_round_reports_a_hang(tmp_path):
    """A gate case that never returns (as an mbarrier deadlock would) is reported as a timeout by the round's watched
    child (benchmarks/gpu/case_watchdog.py); the other cases still run, in a fresh child, and pass."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, BWD_DH_ROUND_FAKE_HANG="T65_no_dh0")
    env.pop("LINATTN_GDN_GLUON_BWD_DH", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_bwd_dh_round.py"),
                           "--dry-run", "--no-timing", "--case-timeout", "20", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gluon_bwd_dh.json").read_text())
    by = {c["case"]: c for c in res["gate"]}
    assert [c["case"] for c in res["gate"]] == ["T1", "T65_no_dh0", "T64_fp16_no_dht", "varlen_1tok",
                                                "bwd-T65-fp16-no-h0", "bwd-varlen-1tok"]
    hung = by["T65_no_dh0"]
    assert not hung["passed"] and hung["error"].startswith("timeout") and hung["timed_out"] and hung["kind"] == "kernel"
    assert all(c["passed"] for n, c in by.items() if n != "T65_no_dh0")
    assert all(c["gluon_dh_launches"] == 1 for c in res["gate"] if c["kind"] == "backward")
    assert res["gate_complete"] and not res["gate_passed"] and "timing" not in res
