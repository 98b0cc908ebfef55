"""The warp-specialised Gluon fused forward (stages 3+4, gluon/chunk_fused_ws.py, LINATTN_GDN_GLUON_FUSED_WS=1) on a
CPU host: every registered config compiles for sm_90a (3 warpgroups, setmaxnreg per partition, WGMMA, TMA loads,
mbarriers, 0 spill, shared memory in budget); the launcher's arguments are exactly what was compiled (AOT signature,
grid, constexprs, TMA boxes; the real JIT path under a compile-only sm_90a driver); a torch model of the per-CTA
schedule (emulate_fused_ws: partitions interleaved at random at their mbarrier waits) gives the Triton forward's o,
final state, h and vnew, and the fp64 recurrence within TOL; the switch is off by default and, set, hands the fused
launcher the forward's tensors; the GPU round's --dry-run. The kernel has not run here (Gluon needs a GPU):
benchmarks/gpu/gluon_fused_ws_round.py gates it on an H200.
Run only this file: `python -m pytest tests/test_gluon_fused_ws.py`."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMEM_LIMIT_SM90 = 232448
_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()
NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_fwd_fused_ws_gluon_"))
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


def test_launcher_configs_are_registered():
    from linattn.ops.gated_delta_rule.aot import FUSED_WS_CONFIGS, fused_ws_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import fused_ws_config
    names = {fused_ws_kernel_name(*c) for c in FUSED_WS_CONFIGS}
    assert names == set(NAMES) and len(NAMES) == 4
    assert fused_ws_config(1, 32, 128, 132).BV == 32 and fused_ws_config(1, 32, 128, 132).stages == 3
    assert fused_ws_config(8, 32, 128, 132).BV == 64 and fused_ws_config(8, 32, 128, 132).stages == 2
    for N in (1, 8):
        cfg = fused_ws_config(N, 32, 128, 132)
        assert fused_ws_kernel_name("bf16", cfg.BV, cfg.stages, False) in names


@needs_gluon
def test_smem_layout_of_published_state_is_the_default():
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import ws_smem_layout
    from linattn.runtime.gluon_compat import gl
    for bv in (32, 64):
        for dt in (gl.bfloat16, gl.float16):
            assert ws_smem_layout.fn(bv, 16) == gl.NVMMASharedLayout.get_default_for([128, bv], dt)


@needs_gluon
@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_spill_with_intended_instructions(name):
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    assert 0 < rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
    assert rep.num_warps == 12                                  # state WG + output WG + producer warp (padded WG)
    assert rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0
    bv = int(name.split("_bv")[1].split("_")[0])
    stages = int(re.search(r"_bv\d+_s(\d+)", name)[1])
    suffix = ".BF16" if "_bf16_" in name else ""
    # product 1 W S (8 k-steps), product 2 K^T (d vnew) (2 M-halves x 4), q S (8), att vnew (4): 28 of 64xBVx16;
    # q k^T: 8 of 64x64x16
    if bv == 64:
        assert rep.sass.get(f"HGMMA.64x64x16.F32{suffix}", 0) == 36, rep.sass
    else:
        assert rep.sass.get(f"HGMMA.64x32x16.F32{suffix}", 0) == 28, rep.sass
        assert rep.sass.get(f"HGMMA.64x64x16.F32{suffix}", 0) == 8, rep.sass
    # q, k, w boxes [64,128] go as two [64,64] messages, u as one: 7 per chunk, issued from the producer loop only
    assert rep.sass.get("UTMALDG.2D", 0) == 7, rep.sass
    assert rep.sass.get("UTMASTG.2D", 0) == (1 if "store_h" in name else 0), rep.sass
    # mbarrier inits: ready + empty per ring slot, s_full + v_full + pub_empty per published buffer (NPUB = 2)
    assert rep.sass.get("SYNCS.EXCH.64", 0) == 2 * stages + 3 * 2, rep.sass
    assert rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 6, rep.sass   # 1 + 3 + 2 waits at least
    assert rep.sass.get("SYNCS.ARRIVE.TRANS64", 0) == 1                        # the producer's expect
    assert rep.sass.get("SYNCS.ARRIVE.TRANS64.A1T0", 0) == 5                   # s_full, v_full, 2x empty, pub_empty


def _buffers(B, T, H, HV, lens=None, dtype=torch.bfloat16, states=True, store=False):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    K = V = 128
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, N = plan.T_total, plan.N
    q, k = torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, H, K, dtype=dtype)
    w, u = torch.zeros(T_tot, HV, K, dtype=dtype), torch.zeros(T_tot, HV, V, dtype=dtype)
    gcum, o = torch.zeros(T_tot, HV), torch.zeros(B, T, HV, V, dtype=dtype)
    h0 = torch.zeros(N, HV, K, V) if states else None
    fin = torch.zeros(N, HV, K, V) if states else None
    h = torch.zeros(plan.num_slots, HV, K, V, dtype=dtype) if store else None
    vnew = torch.zeros(T_tot, HV, V, dtype=dtype) if store else None
    return plan, (q, k, w, u, gcum, o, h0, fin), h, vnew


@needs_gluon
@pytest.mark.parametrize("B,T,lens,states,store", [(1, 4096, None, True, False), (8, 512, None, True, False),
                                                   (1, 3000, [1, 63, 65, 1000, 1871], False, False),
                                                   (1, 300, None, True, True)])
def test_launch_matches_aot_signature(B, T, lens, states, store):
    """fused_ws_launch's arguments (descriptors build on CPU tensors) mangle to exactly the AOT signature; grid,
    constexprs, descriptor views and boxes are the intended ones; optional tensors are None (constexpr)."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_ws_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import (NPUB, OUTPUT_REGS, PRODUCER_REGS, fused_ws_config,
                                                                   fused_ws_launch)
    plan, bufs, h, vnew = _buffers(B, T, 16, 32, lens, states=states, store=store)
    cfg = fused_ws_config(plan.N, 32, 128, 132)
    kernel, grid, args, kwargs = fused_ws_launch(*bufs, plan, 128 ** -0.5, cfg, h=h, vnew=vnew)
    sig = fused_ws_signature("bf16", cfg.BV, store, states)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (128 // cfg.BV, plan.N * 32)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, BV=cfg.BV, STAGES=cfg.stages, NPUB=NPUB, USE_H0=states,
                          STORE_HT=states, STORE_H=store, STORE_VNEW=store, OUTPUT_REGS=OUTPUT_REGS,
                          PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    T_tot = plan.T_total
    assert [list(a.shape) for a in args[:4]] == [[T_tot, 16 * 128]] * 2 + [[T_tot, 32 * 128]] * 2
    assert [a.block_shape for a in args[:4]] == [[64, 128]] * 3 + [[64, cfg.BV]]
    q, k, w, u, gcum, o, h0, fin = bufs
    assert args[0].base.data_ptr() == q.data_ptr() and args[3].base.data_ptr() == u.data_ptr()
    assert args[4] is gcum and args[5] is o and args[8] is h0 and args[9] is fin and args[10] is plan.cu
    if store:
        assert args[6].base.data_ptr() == h.data_ptr() and args[6].block_shape == [128, cfg.BV] and args[7] is vnew
    else:
        assert args[6] is None and args[7] is None
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")


def _jit_compile_main():
    """Child process: the real JIT launch path with the launcher's own arguments on CPU tensors, under a stand-in
    driver that reports sm_90a and never launches (warmup). One JSON line per case."""
    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import fused_ws_config, fused_ws_launch

    use_compile_only_sm90_driver()
    for B, T, dtype, states, store in ((1, 300, torch.bfloat16, True, False), (8, 100, torch.float16, False, False),
                                       (1, 130, torch.bfloat16, True, True)):
        plan, bufs, h, vnew = _buffers(B, T, 16, 32, dtype=dtype, states=states, store=store)
        cfg = fused_ws_config(plan.N, 32, 128, 132)
        kernel, grid, args, kwargs = fused_ws_launch(*bufs, plan, 128 ** -0.5, cfg, h=h, vnew=vnew)
        k = kernel.warmup(*args, grid=grid, **kwargs)
        ptx = k.asm["ptx"]
        print(json.dumps(dict(B=B, BV=cfg.BV, stages=cfg.stages, store=store, num_warps=k.metadata.num_warps,
                              shared=k.metadata.shared, reqntid=re.findall(r"\.reqntid (\d+)", ptx),
                              maxnreg=sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
                              tma_boxes=[m["block_size"] for m in (k.metadata.tensordesc_meta or [])],
                              # named barriers without a thread count (whole CTA) and with one (partition-local)
                              cta_bars=sorted(set(re.findall(r"\b(?:bar|barrier)\.sync\s+(\d+)\s*;", ptx))),
                              part_bars=sorted(set(re.findall(r"\b(?:bar|barrier)\.sync\s+(\d+),\s*(\d+)\s*;", ptx))),
                              expect_tx=re.findall(r"mbarrier\.arrive\.expect_tx\S*\s+_,\s*\[[^\]]+\],\s*(\d+)", ptx))))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "jit"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["B"], r["BV"], r["stages"]) for r in rows] == [(1, 32, 3), (8, 64, 2), (1, 32, 3)]
    for r in rows:
        assert r["num_warps"] == 12 and r["reqntid"] == ["384"] and 0 < r["shared"] <= SMEM_LIMIT_SM90, r
        # the state (default) warpgroup grows to 256, the output warpgroup to OUTPUT_REGS, the producer to 24
        incs = {int(n) for d, n in r["maxnreg"] if d == "inc"}
        decs = {int(n) for d, n in r["maxnreg"] if d == "dec"}
        assert {256, 160} <= incs and 24 in decs, r
        # q, k, w [64,128] boxes go as [64,64] messages (128-byte swizzle); u [64,BV]; h [128,BV] when stored
        assert r["tma_boxes"] == [[64, 64]] * 3 + [[64, r["BV"]]] + ([[128, r["BV"]]] if r["store"] else []), r
        # review 2026-11-29: inside the partitions every barrier is partition-local (bar.sync id, 128: the state and
        # output warpgroups); the only CTA-wide named barrier is warp_specialize's own hand-off (id 1), so no
        # partition can block on warps of another one. The expect (producer, once per chunk) counts the four full
        # boxes q, k, w [64,128] and u [64,BV] (TMA counts zero-filled bytes too).
        assert r["cta_bars"] == ["1"], r
        assert r["part_bars"] and all(n == "128" and i != "1" for i, n in r["part_bars"]), r
        assert r["expect_tx"] == [str(2 * (3 * 64 * 128 + 64 * r["BV"]))], r


if __name__ == "__main__":
    if sys.argv[1:] == ["jit"]:
        _jit_compile_main()


# ---------------------------------------------------------------- the per-CTA schedule, modelled in torch

def _inputs(B, T, lens, dtype, h0, HV=2, seed=0):
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(seed)
    N = B if lens is None else len(lens)
    x = make_gdn_inputs(B, T, 1, HV, 128, 128, dtype=dtype, num_states=N, initial_state=h0, generator=gen)
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    return x, cu


CASES = [  # (B, T, lens, dtype, initial state, BV, stages, npub, seed)
    (1, 1, None, torch.bfloat16, True, 32, 3, 2, 0),
    (1, 63, None, torch.bfloat16, False, 32, 3, 2, 1),
    (1, 64, None, torch.bfloat16, True, 64, 2, 2, 2),
    (2, 65, None, torch.bfloat16, True, 32, 3, 2, 3),
    (1, 300, None, torch.float16, True, 64, 2, 2, 4),
    (1, 260, [1, 63, 1, 130, 64, 1], torch.bfloat16, True, 32, 3, 2, 5),
    (1, 200, [65, 1, 64, 70], torch.float16, False, 64, 2, 2, 6),
    (1, 257, None, torch.bfloat16, True, 32, 1, 1, 7),          # ring of 1, one published buffer: still correct
]


@pytest.mark.parametrize("B,T,lens,dtype,h0,BV,stages,npub,seed", CASES)
def test_schedule_model_matches_triton_forward(device, B, T, lens, dtype, h0, BV, stages, npub, seed):
    """The per-CTA schedule (chunk order, which published S_c / vnew_c each output chunk reads, the ring and buffer
    parities, the masks of a last partial chunk, boxes running into the next sequence, the final state), run with
    the partitions interleaved at random, gives the Triton forward's o and final state (and h, vnew when asked),
    and the fp64 recurrence within TOL. Outputs are NaN-poisoned first."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import emulate_fused_ws
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import TOL, rel_rms
    x, cu = _inputs(B, T, lens, dtype, h0, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    ref = chunk_gated_delta_rule_fwd(*args)
    seen = {}

    def fused(q, k, w, u, gcum, o, initial_state, final, plan, scale_):
        o.fill_(float("nan"))
        final.fill_(float("nan"))
        seen["h"] = torch.full((plan.num_slots,) + ref.h.shape[1:], float("nan"), dtype=dtype)
        seen["vnew"] = torch.full_like(ref.vnew, float("nan"))
        emulate_fused_ws(q, k, w, u, gcum, o, initial_state, final, plan, scale_, BV=BV, stages=stages, npub=npub,
                         h=seen["h"], vnew=seen["vnew"], seed=seed, stats=seen)
    res = chunk_gated_delta_rule_fwd(*args, fused_pass=fused)
    assert res.h is None and res.vnew is None and seen["steps"] > 0
    assert rel_rms(res.o, ref.o) < 3e-3
    assert rel_rms(res.final_state, ref.final_state) < 3e-3
    used = int(ref.plan.chunk_offsets[-1])
    assert rel_rms(seen["h"][:used], ref.h[:used]) < 3e-3
    assert rel_rms(seen["vnew"], ref.vnew) < 3e-3
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True, cu_seqlens=cu)
    assert rel_rms(res.o, o64) < TOL[dtype] and rel_rms(res.final_state, f64) < TOL[dtype]


def test_schedule_model_detects_a_broken_protocol():
    """The model is able to fail: an mbarrier whose wait parity is off by one phase hangs (RuntimeError)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws as fw
    plan, bufs, _, _ = _buffers(1, 200, 1, 2)
    orig = fw._MBar.passes
    try:
        # the ring's empty barriers (count 2) read with the wrong parity: the producer's first wait never passes
        fw._MBar.passes = lambda self, parity: (self.done & 1) == parity if self.count == 2 else orig(self, parity)
        with pytest.raises(RuntimeError, match="deadlock"):
            fw.emulate_fused_ws(*bufs, plan, 0.1, BV=32, stages=2)
    finally:
        fw._MBar.passes = orig


# ---------------------------------------------------------------- the switch

def test_switch_is_on_by_default(monkeypatch):
    """On by default since round 14 (gate green on the H200, forward 1.23-1.39x); "0" turns it off."""
    import importlib
    settings_mod = importlib.import_module("linattn.runtime.settings")
    monkeypatch.delenv("LINATTN_GDN_GLUON_FUSED_WS", raising=False)
    assert settings_mod.settings.gdn_gluon_fused_ws is True
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WS", "0")
    assert settings_mod.settings.gdn_gluon_fused_ws is False
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WS", "1")
    assert settings_mod.settings.gdn_gluon_fused_ws is True
    assert "LINATTN_GDN_GLUON_FUSED_WS" in settings_mod.__doc__


@pytest.mark.parametrize("switch,need", [(True, False), (False, False), (True, True)])
def test_switch_reaches_the_fused_launcher(device, monkeypatch, switch, need):
    """chunk_gated_delta_rule_fwd_gluon with LINATTN_GDN_GLUON_FUSED_WS=1 and need_intermediates=False (what the op
    linattn::chunk_gdn_fwd_gluon asks) calls chunk_fused_ws_gluon once with the forward's tensors; the model stand-in
    then gives the Triton forward's o and final. Switch off, or intermediates needed: never called."""
    if device != "cpu":
        pytest.skip("CPU stand-in check")
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import rel_rms
    calls = []

    def stand_in(q, k, w, u, gcum, o, h0, final, plan, scale):
        calls.append((q, k, w, u, gcum, o, h0, final, plan, scale))
        chunk_fused_ws.emulate_fused_ws(q, k, w, u, gcum, o, h0, final, plan, scale, BV=32, stages=3)

    def triton_state(k, w, u, gcum, h, vnew, h0, final, plan):          # the Gluon state pass's CPU stand-in
        chunk_state_fwd_kernel[(128 // 64, plan.N * u.shape[1])](
            k, w, u, gcum, h, vnew, h0 if h0 is not None else gcum, final if final is not None else gcum,
            plan.cu, plan.chunk_offsets, H=k.shape[2], HV=u.shape[1], K=128, V=128, BT=64, BK=128, BV=64,
            USE_H0=h0 is not None, STORE_HT=final is not None, DOT_PREC="tf32")
    monkeypatch.setattr(chunk_fused_ws, "chunk_fused_ws_gluon", stand_in)
    # the fused-wu kernel (on by default since round 15) takes precedence: this test is about the fused-ws path
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WU", "0")
    if switch:
        monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WS", "1")
    else:
        monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WS", "0")
    x, cu = _inputs(1, 150, None, torch.bfloat16, True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True, cu)
    ref = chunk_gated_delta_rule_fwd(*args)
    taken = switch and not need
    # the state_pass stand-in only runs when the fused path is not taken (the real one is the Gluon state pass)
    res = chunk_gated_delta_rule_fwd_gluon(*args, need_intermediates=need,
                                           state_pass=None if taken else triton_state)
    assert len(calls) == (1 if taken else 0)
    assert (res.h is None) == taken and (res.vnew is None) == taken
    if taken:
        q, k, w, u, gcum, o, h0, final, plan, scale = calls[0]
        assert q is x["q"] and k is x["k"] and h0 is x["initial_state"] and o is res.o and final is res.final_state
        assert w.shape == (150, 2, 128) and u.shape == (150, 2, 128) and gcum.shape == (150, 2)
    assert rel_rms(res.o, ref.o) < 3e-3 and rel_rms(res.final_state, ref.final_state) < 3e-3


def test_op_asks_for_no_intermediates(monkeypatch):
    """The op linattn::chunk_gdn_fwd_gluon (o and the final state only; its backward recomputes from the saved
    inputs) calls the launcher with need_intermediates=False, which is what lets the switch apply."""
    from linattn.ops.gated_delta_rule.gluon import backend  # noqa: F401  (registers the op)
    from linattn.ops.gated_delta_rule.gluon import launcher
    from linattn.ops.gated_delta_rule.triton.forward import FwdResult
    seen = {}

    def record(q, k, v, g, beta, scale, h0, out_final, cu, variant, **kw):
        seen.update(kw)
        return FwdResult(torch.zeros_like(v), None, None, None, None, None, None, None, None)
    monkeypatch.setattr(launcher, "chunk_gated_delta_rule_fwd_gluon", record)
    x, _ = _inputs(1, 10, None, torch.bfloat16, False)
    torch.ops.linattn.chunk_gdn_fwd_gluon(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.1, None, False, None, "wgmma")
    assert seen.get("need_intermediates") is False


# ---------------------------------------------------------------- the GPU round's dry run

def test_gpu_round_dry_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_fused_ws_round.py"),
                           "--out", str(tmp_path), "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gluon_fused_ws.json").read_text())
    assert res["dry_run"] is True and res["stand_ins"]
    assert res["gate"]["passed"] and res["gate"]["cases"] and all(c["ok"] for c in res["gate"]["cases"])
    assert all(c["fused_launches"] >= 1 for c in res["gate"]["cases"])
    assert res["timing"] and all("fused_ms" in r and "unfused_ms" in r for r in res["timing"])


def test_gpu_round_reports_a_hang(tmp_path):
    """A case that never returns (as a barrier hang would) is reported as a timeout; the next cases still run."""
    env = dict(os.environ, TRITON_INTERPRET="1", FUSED_WS_ROUND_FAKE_HANG="T65",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_fused_ws_round.py"),
                           "--out", str(tmp_path), "--dry-run", "--no-timing", "--case-timeout", "20"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gluon_fused_ws.json").read_text())
    by = {c["case"]: c for c in res["gate"]["cases"]}
    assert not by["T65"]["ok"] and "timeout" in by["T65"]["error"]
    assert by["T1"]["ok"] and by["varlen"]["ok"] and res["gate"]["passed"] is False
