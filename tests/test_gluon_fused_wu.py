"""The warp-specialised Gluon fused forward that forms W and U itself (stages 2b+3+4, gluon/chunk_fused_wu_ws.py,
benchmarks/GLUON_FUSED_WU.md) on a CPU host: a torch model of the per-CTA schedule (emulate_fused_wu_ws: four
partitions interleaved at random at their mbarrier waits, the in-place buffers modelled in place) gives wu_kernel's
W and U (up to fp32 accumulation order), o bit-equal to the current fused path's model (emulate_fused_ws) on them,
and the Triton forward's o and final state, within TOL of the fp64 recurrence; a broken protocol deadlocks or gives
wrong data. The kernel has not run here (Gluon needs a GPU): benchmarks/gpu/gluon_fused_wu_round.py gates it.
Run only this file: `python -m pytest tests/test_gluon_fused_wu.py`."""
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
NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_fwd_fused_wu_ws_gluon_") and "_areg" not in n)
AREG_NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_fwd_fused_wu_ws_gluon_") and "_areg" in n
                    and "_opipe" not in n and "_sel" not in n)   # _sel(_warm): test_aot_gluon.py checks them
OPIPE = "gdn_fwd_fused_wu_ws_gluon_bf16_bv32_s3_areg_opipe_o160_w160"
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


# ---------------------------------------------------------------- AOT builds (sm_90a)

def test_launcher_configs_are_registered():
    from linattn.ops.gated_delta_rule.aot import FUSED_WU_CONFIGS, fused_wu_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import OUTPUT_REGS, WU_REGS, fused_wu_config
    names = {fused_wu_kernel_name(*c) for c in FUSED_WU_CONFIGS}
    assert names == set(NAMES) and len(NAMES) == 3
    assert fused_wu_config(1, 32, 128, 132) == fused_wu_config(1, 32, 128, 132)
    assert (fused_wu_config(1, 32, 128, 132).BV, fused_wu_config(1, 32, 128, 132).stages) == (32, 3)
    assert (fused_wu_config(8, 32, 128, 132).BV, fused_wu_config(8, 32, 128, 132).stages) == (64, 2)
    for N in (1, 8):                       # the default configs' builds (WU_AREG, OUT_PIPE at BV=32) are registered
        cfg = fused_wu_config(N, 32, 128, 132)
        regs = None if (cfg.output_regs, cfg.wu_regs) == (OUTPUT_REGS, WU_REGS) else (cfg.output_regs, cfg.wu_regs)
        for dt in ("bf16", "fp16") if cfg.BV == 64 else ("bf16",):
            assert fused_wu_kernel_name(dt, cfg.BV, cfg.stages, cfg.areg, regs, cfg.out_pipe) in REGISTRY, cfg


@needs_gluon
@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_spill_with_intended_instructions(name):
    """sm_90a, ptxas 12.8: 0 spill, no local memory, shared memory in budget, 16 warps (state, output and wu
    warpgroups plus the producer warp's padded warpgroup), and the intended HGMMA / UTMALDG / SYNCS / WARPGROUP."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import NPUB, NWU
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    assert 0 < rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
    assert rep.num_warps == 16 and rep.regs == 128                # 512 threads x 128: the whole register file
    assert rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0
    bv = int(re.search(r"_bv(\d+)_", name)[1])
    stages = int(re.search(r"_bv\d+_s(\d+)", name)[1])
    suffix = ".BF16" if "_bf16_" in name else ""
    # chunk_fused_ws's 28 at N = BV (W S 8, K^T (d vnew) 2 x 4, q S 8, att vnew 4) + Tinv vs 4; q k^T 8 at N = 64;
    # Tinv ks 4 at N = 128
    assert rep.sass.get(f"HGMMA.64x128x16.F32{suffix}", 0) == 4, rep.sass
    if bv == 64:
        assert rep.sass.get(f"HGMMA.64x64x16.F32{suffix}", 0) == 40, rep.sass
    else:
        assert rep.sass.get(f"HGMMA.64x32x16.F32{suffix}", 0) == 32, rep.sass
        assert rep.sass.get(f"HGMMA.64x64x16.F32{suffix}", 0) == 8, rep.sass
    # q, k [64,128] go as two [64,64] messages each, v [64,BV] and Tinv [64,64] as one: 6, from the producer only
    assert rep.sass.get("UTMALDG.2D", 0) == 6 and rep.families["UTMASTG"] == 0, rep.sass
    # mbarrier inits: ready + empty per ring slot, wu_full + wu_empty per W buffer, s_full + v_full + pub_empty
    assert rep.sass.get("SYNCS.EXCH.64", 0) == 2 * stages + 2 * NWU + 3 * NPUB, rep.sass
    assert rep.sass.get("SYNCS.ARRIVE.TRANS64", 0) == 1                        # the producer's expect
    # plain arrives: state (s_full, v_full, wu_empty, empty), output (empty, pub_empty), wu (wu_full, empty)
    assert rep.sass.get("SYNCS.ARRIVE.TRANS64.A1T0", 0) == 8, rep.sass
    assert rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 9, rep.sass   # 1 + 3 + 3 + 2 waits at least


@needs_gluon
@pytest.mark.parametrize("name", ["gdn_fwd_fused_wu_ws_gluon_bf16_bv32_s3_areg",
                                  "gdn_fwd_fused_wu_ws_gluon_bf16_bv64_s2_areg_o136_w192",
                                  "gdn_fwd_fused_wu_ws_gluon_fp16_bv64_s2_areg_o136_w192"])
def test_areg_build_compiles_without_spill(name):
    """WU_AREG (the default: at BV=32 the build without OUT_PIPE, at BV=64 with the output / wu warpgroups at 136 / 192
    registers, bf16 and fp16): 0 spill, no local memory, the register file as the copy build's, and both W / U paths
    in the code: the
    register-A products (W 4 at N = 128, U 4 at N = BV) next to the shared-memory ones kept for a sequence's last
    chunk."""
    assert AREG_NAMES == sorted(["gdn_fwd_fused_wu_ws_gluon_bf16_bv32_s3_areg",
                                 "gdn_fwd_fused_wu_ws_gluon_bf16_bv64_s2_areg_o136_w192",
                                 "gdn_fwd_fused_wu_ws_gluon_fp16_bv64_s2_areg_o136_w192"])
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing and rep.spill_bytes == 0, (rep.missing, rep.spill_bytes)
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, rep.sass
    assert rep.num_warps == 16 and rep.regs == 128 and 0 < rep.smem <= SMEM_LIMIT_SM90
    sfx = ".BF16" if "_bf16_" in name else ""
    assert rep.sass.get(f"HGMMA.64x128x16.F32{sfx}", 0) == 8, rep.sass          # W: 4 register-A + 4 smem-A
    if "_bv32_" in name:
        assert rep.sass.get(f"HGMMA.64x32x16.F32{sfx}", 0) == 32 + 4, rep.sass   # U: 4 more
    else:
        assert rep.sass.get(f"HGMMA.64x64x16.F32{sfx}", 0) == 40 + 4, rep.sass   # U: 4 more


def test_areg_switch(monkeypatch):
    """WU_AREG is on by default at BV=32 (B1 at HV32; round 16 on the H200: gate green, 1.05-1.08x) and, since round
    17, at BV=64; LINATTN_GDN_GLUON_WU_AREG=0 turns it off at both (WU_AREG=False: the build from before the switch
    existed)."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import fused_wu_config, fused_wu_launch
    plan, bufs = _buffers(1, 4096, 16, 32)
    for env, want in ((None, True), ("1", True), ("0", False)):
        if env is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_WU_AREG", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_WU_AREG", env)
        cfg1, cfg8 = fused_wu_config(1, 32, 128, 132), fused_wu_config(8, 32, 128, 132)
        assert (cfg1.BV, cfg1.areg, cfg8.BV, cfg8.areg) == (32, want, 64, want)
        if not _GLUON_OK:
            continue
        *_, kwargs = fused_wu_launch(*bufs[:7], bufs[7], bufs[8], plan, 0.1, cfg1)
        assert kwargs["WU_AREG"] is want


@needs_gluon
@pytest.mark.parametrize("name,base", [(OPIPE, "gdn_fwd_fused_wu_ws_gluon_bf16_bv32_s3_areg"),
                                       ("gdn_fwd_fused_wu_ws_gluon_bf16_bv64_s2_areg_opipe_o152_w176",
                                        "gdn_fwd_fused_wu_ws_gluon_bf16_bv64_s2_areg_o136_w192")])
def test_opipe_build_compiles_without_spill(name, base):
    """OUT_PIPE on top of WU_AREG (the BV=32 default, output / wu warpgroups at 160 / 160, state 168; at BV=64 a sweep
    row at 152 / 176, state 160): 0 spill, no local memory, the register file and shared memory as the WU_AREG
    build's; q k^T issued at two sites (before the loop and one chunk ahead inside it: 8 more HGMMA at N = 64, the
    rest as WU_AREG's); the gate exponentials without the denormal range fix-up (ex2.approx.ftz in the PTX, which
    the WU_AREG build does not use)."""
    from linattn.runtime.aot import kernel_asm
    assert name in REGISTRY
    rep, ref = inspect_kernel(REGISTRY[name]), inspect_kernel(REGISTRY[base])
    assert not rep.missing and rep.spill_bytes == 0, (rep.missing, rep.spill_bytes)
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, rep.sass
    assert rep.num_warps == 16 and rep.regs == 128 and rep.smem == ref.smem
    assert rep.sass.get("HGMMA.64x64x16.F32.BF16", 0) == ref.sass.get("HGMMA.64x64x16.F32.BF16", 0) + 8, rep.sass
    for op in ("HGMMA.64x128x16.F32.BF16", "HGMMA.64x32x16.F32.BF16"):
        assert rep.sass.get(op, 0) == ref.sass.get(op, 0), (op, rep.sass, ref.sass)
    assert "ex2.approx.ftz.f32" in kernel_asm(name, "ptx")
    assert "ex2.approx.ftz.f32" not in kernel_asm(base, "ptx")


def test_round17_switches(monkeypatch):
    """Defaults since round 17 (H200 gate green, the fused kernel 1.11-1.18x at every production row): OUT_PIPE in
    the BV=32 WU_AREG config (wu warpgroup at 160 registers: the build OPIPE), never at BV=64; WU_AREG at BV=64 with
    the output / wu warpgroups at 136 / 192. LINATTN_GDN_GLUON_OUT_PIPE=0 and LINATTN_GDN_GLUON_WU_AREG64=0 turn each
    off; LINATTN_GDN_GLUON_WU_AREG=0 turns off both (they ride on WU_AREG). LINATTN_GDN_GLUON_OUT_PIPE64=1 (opt-in;
    round 18: 1.05x at B8, 0.97x at B4) adds OUT_PIPE at BV=64 with the output / wu warpgroups at 152 / 176."""
    from linattn.ops.gated_delta_rule.aot import fused_wu_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import FusedWuConfig, fused_wu_config
    for name in ("LINATTN_GDN_GLUON_OUT_PIPE", "LINATTN_GDN_GLUON_WU_AREG64", "LINATTN_GDN_GLUON_WU_AREG",
                 "LINATTN_GDN_GLUON_OUT_PIPE64"):
        monkeypatch.delenv(name, raising=False)
    cfg1, cfg8 = fused_wu_config(1, 32, 128, 132), fused_wu_config(8, 32, 128, 132)
    assert cfg1 == FusedWuConfig(32, 3, areg=True, out_pipe=True, wu_regs=160)
    assert fused_wu_kernel_name("bf16", 32, 3, areg=True, regs=(cfg1.output_regs, cfg1.wu_regs), out_pipe=True) == OPIPE
    assert cfg8 == FusedWuConfig(64, 2, areg=True, output_regs=136, wu_regs=192) and not cfg8.out_pipe
    assert fused_wu_kernel_name("bf16", 64, 2, areg=True, regs=(136, 192)) in REGISTRY
    monkeypatch.setenv("LINATTN_GDN_GLUON_OUT_PIPE", "0")
    monkeypatch.setenv("LINATTN_GDN_GLUON_WU_AREG64", "0")
    assert fused_wu_config(1, 32, 128, 132) == FusedWuConfig(32, 3, areg=True)
    assert fused_wu_config(8, 32, 128, 132) == FusedWuConfig(64, 2)
    monkeypatch.delenv("LINATTN_GDN_GLUON_OUT_PIPE")
    monkeypatch.delenv("LINATTN_GDN_GLUON_WU_AREG64")
    monkeypatch.setenv("LINATTN_GDN_GLUON_OUT_PIPE64", "1")               # opt-in: OUT_PIPE at BV=64 too
    cfg8 = fused_wu_config(8, 32, 128, 132)
    assert cfg8 == FusedWuConfig(64, 2, areg=True, out_pipe=True, output_regs=152, wu_regs=176)
    assert fused_wu_kernel_name("bf16", 64, 2, areg=True, regs=(152, 176), out_pipe=True) in REGISTRY
    assert fused_wu_config(1, 32, 128, 132) == FusedWuConfig(32, 3, areg=True, out_pipe=True, wu_regs=160)
    monkeypatch.setenv("LINATTN_GDN_GLUON_WU_AREG", "0")                  # both ride on WU_AREG
    assert fused_wu_config(1, 32, 128, 132) == FusedWuConfig(32, 3)
    assert fused_wu_config(8, 32, 128, 132) == FusedWuConfig(64, 2)                   # OUT_PIPE64 rides on it too


BV16 = "gdn_fwd_fused_wu_ws_gluon_bf16_bv16_s3_areg_opipe_o160_w160"


def test_bv16_switch(monkeypatch):
    """LINATTN_GDN_GLUON_BV16 (on by default since round 21; "1" here): BV=16 with the BV=32 default's settings where
    N * HV * V / 16 programs fit the SMs (B1 and B2 at H2/HV8 on 132 SMs), BV=32 where they would not (B1 at HV32,
    B3 at HV8) and BV=64 where the batch fills the GPU; its build is registered. With "0", BV=16 is never taken."""
    from linattn.ops.gated_delta_rule.aot import fused_wu_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import FusedWuConfig, fused_wu_config
    for name in ("LINATTN_GDN_GLUON_OUT_PIPE", "LINATTN_GDN_GLUON_WU_AREG", "LINATTN_GDN_GLUON_BV16"):
        monkeypatch.delenv(name, raising=False)
    default32 = FusedWuConfig(32, 3, areg=True, out_pipe=True, wu_regs=160)
    monkeypatch.setenv("LINATTN_GDN_GLUON_BV16", "0")
    assert fused_wu_config(1, 8, 128, 132) == default32 and fused_wu_config(2, 8, 128, 132) == default32
    monkeypatch.setenv("LINATTN_GDN_GLUON_BV16", "1")
    cfg = fused_wu_config(1, 8, 128, 132)
    assert cfg == FusedWuConfig(16, 3, areg=True, out_pipe=True, wu_regs=160)
    assert fused_wu_config(2, 8, 128, 132) == cfg                       # 128 programs <= 132 SMs
    assert fused_wu_config(3, 8, 128, 132) == default32                 # 96 programs at BV=32, 192 at 16
    assert fused_wu_config(1, 32, 128, 132) == default32
    assert fused_wu_config(8, 32, 128, 132).BV == 64
    assert fused_wu_config(1, 8, 128, 132, bv16=False) == default32   # the segment-parallel forward's launches
    monkeypatch.delenv("LINATTN_GDN_GLUON_BV16")                        # the default since round 21: on
    assert fused_wu_config(1, 8, 128, 132) == cfg
    assert fused_wu_kernel_name("bf16", 16, 3, areg=True, regs=(cfg.output_regs, cfg.wu_regs), out_pipe=True) == BV16
    assert BV16 in REGISTRY


@needs_gluon
def test_bv16_build_compiles_without_spill():
    """The BV=16 build (sm_90a): 0 spill, no local memory, the whole register file over 16 warps, shared memory in
    budget, and its products at N = 16 (U, W S, K^T vnew, q S, P vnew) next to the V-independent ones at 64 / 128."""
    rep = inspect_kernel(REGISTRY[BV16])
    assert not rep.missing and rep.spill_bytes == 0, (rep.missing, rep.spill_bytes)
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, rep.sass
    assert rep.num_warps == 16 and rep.regs == 128 and 0 < rep.smem <= SMEM_LIMIT_SM90, (rep.regs, rep.smem)
    assert rep.sass.get("HGMMA.64x16x16.F32.BF16", 0) > 0, rep.sass
    assert rep.sass.get("HGMMA.64x32x16.F32.BF16", 0) == 0, rep.sass


def test_switch_ab_round_dry_run(tmp_path):
    """benchmarks/gpu/switch_ab_round.py --dry-run (the BV=16 A/B's script) on the CPU: both sides run, their outputs
    compared (the Triton backend, where the switch changes nothing: bit-equal), the JSON written."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "switch_ab_round.py"), "--out",
                           str(tmp_path), "--dry-run"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "switch_ab.json").read_text())
    assert res["passed"] and res["sides"] == {"bv32": "LINATTN_GDN_GLUON_BV16=0", "bv16": "LINATTN_GDN_GLUON_BV16=1"}
    assert len(res["rows"]) == 2 and all(r["bit_equal"] for r in res["rows"]), res["rows"]


def test_switch_ab_round_rows():
    """switch_ab_round.py's AB_ROWS: "B:T:H:HV[:decay]" (round 24: the slow and mixed decay rows of the decision rule),
    varlen lengths summed, a decay other than fast / slow / mixed refused."""
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("switch_ab_round", os.path.join(root, "benchmarks", "gpu",
                                                                                   "switch_ab_round.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_row("1:65536:16:32") == (1, 65536, 16, 32, None, "fast")
    assert mod.parse_row("2:4096:2:8:mixed") == (2, 4096, 2, 8, None, "mixed")
    assert mod.parse_row("1:varlen1+63+66:1:2:slow") == (1, 130, 1, 2, [1, 63, 66], "slow")
    for bad in ("1:130:1:2:steep", "1:130:1:2:slow:x"):
        with pytest.raises(ValueError, match="decay one of"):
            mod.parse_row(bad)


@pytest.mark.parametrize("T,lens,stages,npub,BV", [(260, None, 3, 2, 32), (261, [1, 130, 64, 65, 1], 3, 2, 32),
                                                   (1, None, 3, 2, 32), (200, [70, 1, 129], 1, 1, 32),
                                                   (130, None, 2, 1, 32), (193, [1, 128, 64], 2, 2, 64)])
def test_schedule_model_out_pipe_matches_default_model(device, T, lens, stages, npub, BV):
    """The schedule model with out_pipe (the output partition waits for chunk c + 1's slot and takes its q k^T right
    after releasing chunk c's; gate factors 2^(log2e gam_i - log2e gam_j) flushed below 2^-126) against the WU_AREG
    model without it, on fresh inputs and interleavings, outputs NaN-poisoned: the final state bit-equal (the state
    chain does not read the output partition's values), o within 1e-3 (the exponentials round differently: a few
    16-bit ulps of att flip, 2e-4 of the elements in a CPU run) and within TOL of the fp64 recurrence, its error
    vs fp64 within 1.02x of the default model's. T = 1 (the q k^T issued ahead is the only one), varlen with 1-token
    sequences, ring depths 1-3 and one publication buffer (the protocol: a deadlock raises), BV 32 and 64."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (chunk_gated_delta_rule_fwd_fused_wu,
                                                                      emulate_fused_wu_ws)
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x, cu = _inputs(1, T, lens, torch.bfloat16, True, 1, 2, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    outs = {}
    for out_pipe in (False, True):
        stats = {}

        def fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_):
            assert torch.isnan(o).all() and torch.isnan(final).all()
            emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_, BV=BV,
                                stages=stages, npub=npub, seed=seed, stats=stats, areg=True, out_pipe=out_pipe)
        with poisoned_allocations():
            outs[out_pipe] = chunk_gated_delta_rule_fwd_fused_wu(*args, fused_pass=fused)
        assert stats["steps"] > 0
    res, res0 = outs[True], outs[False]
    assert torch.isfinite(res.o).all() and torch.equal(res.final_state, res0.final_state)
    assert rel_rms(res.o, res0.o) < 1e-3
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=x["initial_state"].double(), output_final_state=True, cu_seqlens=cu)
    assert rel_rms(res.o, o64) < TOL[torch.bfloat16] and rel_rms(res.final_state, f64) < TOL[torch.bfloat16]
    assert rel_rms(res.o, o64) <= 1.02 * rel_rms(res0.o, o64)


@pytest.mark.parametrize("lens", [None, [1, 130, 64, 65]])
def test_schedule_model_areg_matches_fp64(device, lens):
    """The schedule model with areg (WU_AREG's rounding: Tinv * gates rounded, k and v as loaded) on full chunks and,
    for each sequence's last chunk, the shared-memory path: o and the final state within TOL of the fp64 recurrence,
    with errors vs fp64 within 1.15x the default model's (its W / U round k * gates instead; the two roundings are
    independent, so the models differ by about their own error: 3.7e-3 on o in one run, while their errors vs fp64
    stayed within 4% of each other over 6 seeds), W / U rows < eos within 1e-2 of wu_kernel's; fresh inputs and
    interleaving every run, outputs NaN-poisoned."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (chunk_gated_delta_rule_fwd_fused_wu,
                                                                      emulate_fused_wu_ws)
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    T = 260 if lens is None else sum(lens)
    x, cu = _inputs(1, T, lens, torch.bfloat16, True, 1, 2, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    with poisoned_allocations():
        ref = chunk_gated_delta_rule_fwd(*args)
    outs = {}
    for areg in (False, True):
        seen = {}

        def fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_):
            seen["w"], seen["u"] = torch.full_like(ref.w, float("nan")), torch.full_like(ref.u, float("nan"))
            emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_, BV=32, stages=3,
                                w_out=seen["w"], u_out=seen["u"], seed=seed, areg=areg)
        with poisoned_allocations():
            outs[areg] = (chunk_gated_delta_rule_fwd_fused_wu(*args, fused_pass=fused), seen)
    (res, seen), (res0, _) = outs[True], outs[False]
    for mine, theirs in ((seen["w"], ref.w), (seen["u"], ref.u)):
        assert torch.isfinite(mine).all() and rel_rms(mine, theirs) < 1e-2
    assert not torch.equal(seen["w"], ref.w)                  # the areg rounding did run
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=x["initial_state"].double(), output_final_state=True, cu_seqlens=cu)
    assert rel_rms(res.o, o64) < TOL[torch.bfloat16] and rel_rms(res.final_state, f64) < TOL[torch.bfloat16]
    assert rel_rms(res.o, o64) <= 1.15 * rel_rms(res0.o, o64)
    assert rel_rms(res.final_state, f64) <= 1.15 * rel_rms(res0.final_state, f64)


def _buffers(B, T, H, HV, lens=None, dtype=torch.bfloat16, states=True):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    K = V = 128
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, N = plan.T_total, plan.N
    q, k = torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, H, K, dtype=dtype)
    v, beta = torch.zeros(B, T, HV, V, dtype=dtype), torch.zeros(B, T, HV)
    gcum, tinv = torch.zeros(T_tot, HV), torch.zeros(T_tot, HV, 64, dtype=dtype)
    o = torch.zeros(B, T, HV, V, dtype=dtype)
    h0 = torch.zeros(N, HV, K, V) if states else None
    fin = torch.zeros(N, HV, K, V) if states else None
    return plan, (q, k, v, beta, gcum, tinv, o, h0, fin)


@needs_gluon
@pytest.mark.parametrize("B,T,lens,states", [(1, 4096, None, True), (8, 512, None, True),
                                             (1, 3000, [1, 63, 65, 1000, 1871], False)])
def test_launch_matches_aot_signature(B, T, lens, states):
    """fused_wu_launch's arguments (descriptors build on CPU tensors) mangle to exactly the AOT signature; grid,
    constexprs, descriptor views and boxes are the intended ones; the tensors themselves are passed."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_wu_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (NPUB, NWU, OUTPUT_REGS, PRODUCER_REGS,
                                                                      WU_REGS, fused_wu_config, fused_wu_launch)
    plan, bufs = _buffers(B, T, 16, 32, lens, states=states)
    cfg = fused_wu_config(plan.N, 32, 128, 132)
    kernel, grid, args, kwargs = fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg)
    sig = fused_wu_signature("bf16", cfg.BV, states)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (128 // cfg.BV, plan.N * 32)
    # the defaults since round 17: WU_AREG at both BV; OUT_PIPE at BV=32 with the wu warpgroup at 160 registers;
    # at BV=64 the output / wu warpgroups at 136 / 192
    regs = (OUTPUT_REGS, 160) if cfg.BV == 32 else (136, 192)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, BV=cfg.BV, STAGES=cfg.stages, NWU=NWU, NPUB=NPUB,
                          USE_H0=states, STORE_HT=states, OUTPUT_REGS=regs[0], WU_REGS=regs[1],
                          PRODUCER_REGS=PRODUCER_REGS, WU_AREG=True, OUT_PIPE=cfg.BV == 32, num_warps=4)
    T_tot = plan.T_total
    assert [list(a.shape) for a in args[:4]] == [[T_tot, 16 * 128]] * 2 + [[T_tot, 32 * 128], [T_tot, 32 * 64]]
    assert [a.block_shape for a in args[:4]] == [[64, 128]] * 2 + [[64, cfg.BV], [64, 64]]
    q, k, v, beta, gcum, tinv, o, h0, fin = bufs
    assert [a.base.data_ptr() for a in args[:4]] == [t.data_ptr() for t in (q, k, v, tinv)]
    assert args[4].data_ptr() == beta.data_ptr() and args[5] is gcum and args[6] is o
    assert args[7] is h0 and args[8] is fin and args[9] is plan.cu and args[10] is plan.chunk_offsets
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")


@needs_gluon
@pytest.mark.parametrize("warm", [False, True])
def test_segment_launch_matches_aot_signature(warm):
    """The segment-parallel forward's launches (select, and the segment words of the segment launch) mangle to the
    registered _sel / _sel_warm builds' signatures: the int32 selection ([N * HV], or [sequences, HV]
    with segment words) and the words are passed as themselves; a wrong dtype, size or shape is refused."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_wu_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import fused_wu_config, fused_wu_launch
    from linattn.runtime.aot import kernels
    plan, bufs = _buffers(16, 4096, 16, 32)                 # 16 "segments" of one sequence: BV=64
    cfg = fused_wu_config(plan.N, 32, 128, 132)
    sel = torch.zeros(1, 32, dtype=torch.int32) if warm else torch.ones(plan.N * 32, dtype=torch.int32)
    seg = torch.zeros(plan.N * 32, dtype=torch.int32) if warm else None
    _, grid, args, kwargs = fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, sel, seg)
    name = fused_wu_kernel_name("bf16", 64, 2, areg=True, regs=(136, 192), select=True, warm=warm)
    _, sig, const, _ = kernels()[name].build()
    runtime = [n for n in sig if sig[n] != "constexpr"]
    assert [mangle_type(a) for a in args if a is not None] == [sig[n] for n in runtime]
    assert {k: v for k, v in kwargs.items() if k in const} == {k: v for k, v in const.items() if k in kwargs}
    assert args[12] is sel and args[13] is seg and cfg.BV == 64 and grid == (2, plan.N * 32)
    with pytest.raises(ValueError, match="select must be a contiguous int32"):
        fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, sel.long(), seg)
    if warm:
        with pytest.raises(ValueError, match="seg must be a contiguous int32"):
            fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, sel, torch.zeros(3, dtype=torch.int32))
        with pytest.raises(ValueError, match=r"with segment words it is \[sequences, HV=32\]"):
            fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, torch.zeros(32, dtype=torch.int32), seg)
    else:
        with pytest.raises(ValueError, match="select must be a contiguous int32"):
            fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, torch.ones(3, dtype=torch.int32))


def test_supported():
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import fused_wu_supported
    q, v = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    assert fused_wu_supported(q, v, torch.zeros(1, 8, 4))[0]
    assert not fused_wu_supported(q.float(), v.float())[0]
    assert not fused_wu_supported(q[..., :64], v)[0]
    assert not fused_wu_supported(q[:, :0], v[:, :0])[0]
    assert not fused_wu_supported(torch.zeros(1, 8, 3, 128, dtype=torch.bfloat16), v)[0]
    assert not fused_wu_supported(q, v, torch.zeros(1, 8, 4, dtype=torch.int32))[0]


def _jit_compile_main():
    """Child process: the real JIT launch path with the launcher's own arguments on CPU tensors, under a stand-in
    driver that reports sm_90a and never launches (warmup). One JSON line per case."""
    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import fused_wu_config, fused_wu_launch

    use_compile_only_sm90_driver()
    for B, T, dtype, states in ((1, 300, torch.bfloat16, True), (8, 100, torch.float16, False)):
        plan, bufs = _buffers(B, T, 16, 32, dtype=dtype, states=states)
        cfg = fused_wu_config(plan.N, 32, 128, 132)
        kernel, grid, args, kwargs = fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg)
        k = kernel.warmup(*args, grid=grid, **kwargs)
        ptx = k.asm["ptx"]
        print(json.dumps(dict(B=B, BV=cfg.BV, stages=cfg.stages, num_warps=k.metadata.num_warps,
                              shared=k.metadata.shared, reqntid=re.findall(r"\.reqntid (\d+)", ptx),
                              maxnreg=re.findall(r"\.maxnreg (\d+)", ptx),
                              setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)",
                                                               ptx))),
                              tma_boxes=[m["block_size"] for m in (k.metadata.tensordesc_meta or [])],
                              cta_bars=sorted(set(re.findall(r"\b(?:bar|barrier)\.sync\s+(\d+)\s*;", ptx))),
                              part_bars=sorted(set(re.findall(r"\b(?:bar|barrier)\.sync\s+(\d+),\s*(\d+)\s*;",
                                                              ptx))),
                              expect_tx=re.findall(r"mbarrier\.arrive\.expect_tx\S*\s+_,\s*\[[^\]]+\],\s*(\d+)",
                                                   ptx))))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    """The launcher's arguments through the real JIT (a compile-only sm_90a driver): 16 warps, the setmaxnreg split of
    the default configs (since round 17: BV=32 state 168 / output 160 / wu 160, BV=64 state 160 / output 136 / wu
    192; producer 24: the whole 64 K register file), TMA boxes q, k as [64,64]
    messages, v [64,BV], Tinv [64,64]; every barrier inside a partition is partition-local (bar.sync id, 128:
    ids 0 state, 2 output, 3 wu), the only CTA-wide one is warp_specialize's (id 1); the expect counts the four
    full boxes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "jit"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["B"], r["BV"], r["stages"]) for r in rows] == [(1, 32, 3), (8, 64, 2)]
    for r in rows:
        assert r["num_warps"] == 16 and r["reqntid"] == ["512"] and 0 < r["shared"] <= SMEM_LIMIT_SM90, r
        assert r["maxnreg"] == ["128"], r
        state, output, wu = (168, 160, 160) if r["BV"] == 32 else (160, 136, 192)
        inside = {("dec", str(state)), ("inc", str(output)), ("inc", str(wu)), ("dec", "24")}
        assert inside <= set(map(tuple, r["setmaxnreg"])), r
        assert state + output + wu + 24 == 512                       # x 128 threads = 65 536 registers
        assert r["tma_boxes"] == [[64, 64]] * 2 + [[64, r["BV"]], [64, 64]], r
        assert r["cta_bars"] == ["1"], r
        assert {i for i, _ in r["part_bars"]} == {"0", "2", "3"} and all(n == "128" for _, n in r["part_bars"]), r
        assert r["expect_tx"] == [str(2 * (2 * 64 * 128 + 64 * r["BV"] + 64 * 64))], r


# ---------------------------------------------------------------- the launcher with a stand-in kernel

def test_gluon_entry_launches_the_kernel_with_the_forward_tensors(monkeypatch):
    """chunk_gated_delta_rule_fwd_fused_wu with no fused_pass goes through chunk_fused_wu_ws_gluon (config from the
    device's SM count), fused_wu_launch and one kernel[grid](...) call; here the kernel is a stand-in that records
    the call and runs the schedule model on the tensors behind the launcher's own descriptors, so o and the final
    state come out as the Triton forward's."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import rel_rms
    if not _GLUON_OK:
        pytest.skip(_GLUON_REASON)
    calls = []

    class StandIn:
        arg_names = fw.chunk_fused_wu_ws_kernel.arg_names

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append((grid, args, kwargs))
                q_d, k_d, v_d, t_d, beta, gcum, o, h0, final, cu, offs, scale, sel, seg = args
                plan = seen["plan"]
                B, T = o.shape[:2]
                H, HV = kwargs["H"], kwargs["HV"]
                view = lambda d, *shape: d.base.reshape(*shape)                # noqa: E731
                fw.emulate_fused_wu_ws(view(q_d, B, T, H, 128), view(k_d, B, T, H, 128),
                                       view(v_d, B, T, HV, 128), beta, gcum, view(t_d, plan.T_total, HV, 64), o,
                                       h0, final, plan, scale, BV=kwargs["BV"], stages=kwargs["STAGES"],
                                       nwu=kwargs["NWU"], npub=kwargs["NPUB"], areg=kwargs["WU_AREG"],
                                       out_pipe=kwargs["OUT_PIPE"], select=sel, seg=seg)
            return run
    seen = {}
    real_launch = fw.fused_wu_launch

    def spy_launch(*a):
        seen["plan"] = a[9]
        return real_launch(*a)
    monkeypatch.setattr(fw, "chunk_fused_wu_ws_kernel", StandIn())
    monkeypatch.setattr(fw, "fused_wu_launch", spy_launch)
    x, cu = _inputs(1, 150, [1, 100, 49], torch.bfloat16, True, seed=3)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True, cu)
    ref = chunk_gated_delta_rule_fwd(*args)
    res = fw.chunk_gated_delta_rule_fwd_fused_wu(*args)
    assert len(calls) == 1
    grid, kargs, kwargs = calls[0]
    cfg = fw.fused_wu_config(3, 2, 128, 2)                               # the CPU's device facts: 2 "SMs"
    assert grid == (128 // cfg.BV, 3 * 2) and kwargs["STAGES"] == cfg.stages and kwargs["BV"] == cfg.BV
    assert kargs[0].base.data_ptr() == x["q"].data_ptr() and kargs[2].base.data_ptr() == x["v"].data_ptr()
    assert kargs[4].data_ptr() == x["beta"].data_ptr() and kargs[6] is res.o and kargs[8] is res.final_state
    assert kargs[7] is x["initial_state"] and kargs[3].base.dtype == torch.bfloat16
    assert rel_rms(res.o, ref.o) < 3e-3 and rel_rms(res.final_state, ref.final_state) < 3e-3


if __name__ == "__main__" and sys.argv[1:] == ["jit"]:
    _jit_compile_main()
    sys.exit(0)


# ---------------------------------------------------------------- the per-CTA schedule, modelled in torch

def _inputs(B, T, lens, dtype, h0, H=1, HV=2, seed=0):
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(seed)
    N = B if lens is None else len(lens)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, num_states=N, initial_state=h0, generator=gen)
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    return x, cu


MODEL_CASES = [  # (B, T, lens, dtype, initial state, H, HV, BV, stages, nwu, npub)
    (1, 1, None, torch.bfloat16, True, 1, 2, 32, 3, 2, 2),
    (1, 63, None, torch.bfloat16, False, 1, 2, 64, 2, 2, 2),
    (2, 65, None, torch.float16, True, 1, 2, 32, 3, 2, 2),
    (1, 300, None, torch.bfloat16, True, 2, 4, 64, 2, 2, 2),
    (1, 260, [1, 63, 1, 130, 64, 1], torch.bfloat16, True, 1, 2, 32, 3, 2, 2),
    (1, 200, [65, 1, 64, 70], torch.float16, False, 1, 2, 64, 2, 2, 2),
    (1, 257, None, torch.bfloat16, True, 1, 2, 32, 1, 1, 1),          # every buffer single: still correct
    (1, 200, None, torch.float16, False, 1, 2, 64, 3, 1, 2),
]


@pytest.mark.parametrize("B,T,lens,dtype,h0,H,HV,BV,stages,nwu,npub", MODEL_CASES)
def test_schedule_model_matches_triton_forward(device, B, T, lens, dtype, h0, H, HV, BV, stages, nwu, npub):
    """The fused-wu forward (kkt_solve under the interpreter, then the schedule model with the partitions interleaved
    at random) on fresh random inputs, every output NaN-poisoned first: W and U equal to wu_kernel's rows < eos but
    for rare 1-ulp differences (accumulation order); o and final bit-equal to the current fused path's model on
    the same W and U, and within 1e-3 of it on wu_kernel's; within 3e-3 of the Triton
    forward, and within TOL of the fp64 recurrence. Covers T = 1, 63, 65, 200-300 (T not a multiple of 64), B2,
    varlen with 1-token sequences, GVA (HV = 2H), with and without h0, bf16 and fp16, BV 32/64, ring depths 1-3,
    NWU 1-2, NPUB 1-2."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import emulate_fused_ws
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (chunk_gated_delta_rule_fwd_fused_wu,
                                                                      emulate_fused_wu_ws)
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))              # fresh inputs and interleaving every run
    x, cu = _inputs(B, T, lens, dtype, h0, H, HV, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    with poisoned_allocations():
        ref = chunk_gated_delta_rule_fwd(*args)
    seen = {}

    def fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_):
        assert torch.isnan(o).all() and torch.isnan(final).all()          # poisoned by the allocator
        assert tinv.dtype == dtype and gcum.dtype == torch.float32
        seen["w"], seen["u"] = torch.full_like(ref.w, float("nan")), torch.full_like(ref.u, float("nan"))
        emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_, BV=BV, stages=stages,
                            nwu=nwu, npub=npub, w_out=seen["w"], u_out=seen["u"], seed=seed, stats=seen)
    with poisoned_allocations():
        res = chunk_gated_delta_rule_fwd_fused_wu(*args, fused_pass=fused)
    assert seen["steps"] > 0 and res.w is None and res.u is None and res.h is None and res.vnew is None
    # W and U: wu_kernel's rounding points, so equal to its W and U up to the fp32 accumulation order of the two
    # products (an element now and then one 16-bit ulp apart): fewer than 1e-3 of the elements differ, and none by
    # more than one ulp at the tensor's largest magnitude (in its dtype)
    for mine, theirs in ((seen["w"], ref.w), (seen["u"], ref.u)):
        assert torch.isfinite(mine).all()
        top = theirs.abs().max()
        ulp_top = (torch.nextafter(top, torch.full_like(top, float("inf"))).float() - top.float())
        diff = (mine.float() - theirs.float()).abs()
        assert (diff <= ulp_top).all(), (diff.max(), ulp_top, rel_rms(mine, theirs))
        assert (mine != theirs).float().mean() < 1e-3
    assert torch.equal(res.gcum, ref.gcum)
    # the state chain and the output are the current fused path's: chunk_fused_ws's model on these W and U gives
    # the same bits, and on wu_kernel's W and U the same o up to those ulps
    o_ws, f_ws = torch.full_like(ref.o, float("nan")), torch.full_like(ref.final_state, float("nan"))
    emulate_fused_ws(x["q"], x["k"], seen["w"], seen["u"], ref.gcum, o_ws, x["initial_state"], f_ws, ref.plan,
                     scale, BV=BV, stages=stages, npub=npub, seed=seed)
    assert torch.equal(res.o, o_ws) and torch.equal(res.final_state, f_ws)
    emulate_fused_ws(x["q"], x["k"], ref.w, ref.u, ref.gcum, o_ws, x["initial_state"], f_ws, ref.plan,
                     scale, BV=BV, stages=stages, npub=npub, seed=seed)
    assert rel_rms(res.o, o_ws) < 1e-3 and rel_rms(res.final_state, f_ws) < 1e-3
    assert rel_rms(res.o, ref.o) < 3e-3 and rel_rms(res.final_state, ref.final_state) < 3e-3
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True, cu_seqlens=cu)
    assert rel_rms(res.o, o64) < TOL[dtype] and rel_rms(res.final_state, f64) < TOL[dtype]
    assert rel_rms(ref.o, o64) < TOL[dtype]


def _small_call(T=200, seed=0, lens=None):
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import kkt_solve
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    x, cu = _inputs(1, T, lens, torch.bfloat16, True, seed=seed)
    plan = make_chunk_plan(1, T, cu, 64, "cpu")
    gcum, tinv = kkt_solve(x["k"], x["g"], x["beta"], plan, 2)
    o = torch.full_like(x["v"], float("nan"))
    final = torch.full_like(x["initial_state"], float("nan"))
    return x, plan, (x["q"], x["k"], x["v"], x["beta"], gcum, tinv, o, x["initial_state"], final, plan, 128 ** -0.5)


def test_schedule_model_detects_a_deadlock():
    """The model is able to hang: the ring's empty barriers (count 3, the only ones) read with the wrong parity
    never let the producer start."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    _, _, call = _small_call()
    orig = fw._MBar.passes
    try:
        fw._MBar.passes = lambda self, parity: (self.done & 1) == parity if self.count == 3 else orig(self, parity)
        with pytest.raises(RuntimeError, match="deadlock"):
            fw.emulate_fused_wu_ws(*call, BV=32, stages=2)
    finally:
        fw._MBar.passes = orig


def test_schedule_model_detects_a_race_on_the_w_buffers():
    """The model sees in-place hazards: with the wu partition's wait on wu_empty dropped (its barriers pass at once),
    it rewrites wk_s[j] with a later chunk's W (or its scaled k) before product 1 has read it, so o goes wrong, or
    wu_full[j] completes twice ahead of the state partition (which then hangs on its parity), for some
    interleaving. Barriers are created per CTA in the kernel's order: ready, empty (STAGES each), wu_full,
    wu_empty (NWU each), then the published buffers' (3 NPUB)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    from linattn.testing import rel_rms
    x, plan, call = _small_call(T=640)
    stages, nwu, npub = 3, 2, 2
    fw.emulate_fused_wu_ws(*call, BV=64, stages=stages, nwu=nwu, npub=npub, seed=1)
    good = call[6].clone()
    per_cta = 2 * stages + 2 * nwu + 3 * npub
    first, last = 2 * stages + nwu, 2 * stages + 2 * nwu          # the wu_empty barriers' creation indices
    real = fw._MBar
    made = [0]

    class NoWuEmpty(real):
        def __init__(self, count):
            super().__init__(count)
            self.skip = first <= made[0] % per_cta < last
            made[0] += 1

        def passes(self, parity):
            return True if self.skip else super().passes(parity)
    wrong = 0
    try:
        fw._MBar = NoWuEmpty
        for seed in range(4):
            made[0] = 0
            call[6].fill_(float("nan"))
            try:
                fw.emulate_fused_wu_ws(*call, BV=64, stages=stages, nwu=nwu, npub=npub, seed=seed)
            except (RuntimeError, AssertionError, TypeError):
                wrong += 1          # wu_full completed twice ahead of its waiter (a hang), or no W yet
                continue
            wrong += rel_rms(call[6], good) > 1e-2
    finally:
        fw._MBar = real
    assert wrong >= 1


# ---------------------------------------------------------------- the wiring (gluon/launcher.py, runtime/settings.py)

def test_switch_is_on_by_default(monkeypatch):
    """On unless "0" (round 15: faster than wu_kernel + fused-ws at every production row, gate green)."""
    import importlib
    settings_mod = importlib.import_module("linattn.runtime.settings")
    monkeypatch.delenv("LINATTN_GDN_GLUON_FUSED_WU", raising=False)
    assert settings_mod.settings.gdn_gluon_fused_wu is True
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WU", "0")
    assert settings_mod.settings.gdn_gluon_fused_wu is False
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WU", "1")
    assert settings_mod.settings.gdn_gluon_fused_wu is True
    assert "LINATTN_GDN_GLUON_FUSED_WU" in settings_mod.__doc__


def op_against_triton_forward(seed: int):
    """The op linattn::chunk_gdn_fwd_gluon (o and final) and the Triton forward (its FwdResult) on one varlen call
    with 1-token sequences, H1/HV2, bf16, initial state: the switch tests' common call."""
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    x, cu = _inputs(1, 150, [1, 80, 69], torch.bfloat16, True, seed=seed)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True, cu)
    o, final = torch.ops.linattn.chunk_gdn_fwd_gluon(*args, "wgmma")
    return o, final, chunk_gated_delta_rule_fwd(*args)


def test_switch_takes_the_fused_wu_path(device, monkeypatch):
    """LINATTN_GDN_GLUON_FUSED_WU unset (the default) or "1": the op linattn::chunk_gdn_fwd_gluon (o and final only)
    goes through chunk_gated_delta_rule_fwd_fused_wu: one fused-wu launch (model stand-in), o and final as the
    Triton forward's; "0": the fused-ws path (model stand-in), never the fused-wu one."""
    if device != "cpu":
        pytest.skip("CPU stand-in check")
    from linattn.ops.gated_delta_rule.gluon import backend  # noqa: F401  (registers the op)
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws, chunk_fused_wu_ws
    from linattn.testing import rel_rms
    calls, ws_calls = [], []

    def stand_in(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale):
        calls.append(plan)
        chunk_fused_wu_ws.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=64, stages=2)

    def ws_stand_in(q, k, w, u, gcum, o, h0, final, plan, scale):
        ws_calls.append(plan)
        chunk_fused_ws.emulate_fused_ws(q, k, w, u, gcum, o, h0, final, plan, scale, BV=64, stages=2)
    monkeypatch.setattr(chunk_fused_wu_ws, "chunk_fused_wu_ws_gluon", stand_in)
    monkeypatch.setattr(chunk_fused_ws, "chunk_fused_ws_gluon", ws_stand_in)
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WS", "1")
    monkeypatch.setenv("LINATTN_GDN_GLUON_GF128", "0")       # the W/U kernel, not the gate-free one (test_gluon_fused_gf)
    for switch, on in (("1", True), ("0", False), (None, True)):      # None: unset, the default
        if switch is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_FUSED_WU", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WU", switch)
        calls.clear()
        ws_calls.clear()
        o, final, ref = op_against_triton_forward(seed=5)
        assert (len(calls), len(ws_calls)) == ((1, 0) if on else (0, 1)), switch
        assert rel_rms(o, ref.o) < 3e-3 and rel_rms(final, ref.final_state) < 3e-3


# ---------------------------------------------------------------- the GPU round's dry run

def test_gpu_round_dry_run(tmp_path):
    # LINATTN_GDN_GLUON_WU_AREG=0: the timing rows' o-vs-fused-ws bound (3e-3) holds for the copy path, whose W / U are
    # wu_kernel's to the ulp; with WU_AREG (the BV=32 default since round 16) W / U round differently and the two o
    # differ by about their own error (~3.2e-3 in this dry run). WU_AREG's accuracy: test_schedule_model_areg_*.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               LINATTN_GDN_GLUON_WU_AREG="0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_fused_wu_round.py"),
                           "--out", str(tmp_path), "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gluon_fused_wu.json").read_text())
    assert res["dry_run"] is True and res["stand_ins"]
    cases = res["gate"]["cases"]
    assert res["gate"]["passed"] and len(cases) == 5 and all(c["ok"] for c in cases)
    ran = [c for c in cases if "skipped" not in c]
    assert len(ran) >= 4 and all(c["fused_wu_launches"] == 1 and c["fused_ws_launches"] == 1 for c in ran)
    assert all(c["o_vs_current"] <= c["tol"] and c["o_vs_fp64"] <= c["tol"] for c in ran)
    assert res["launcher_wired"] and not any("skipped" in c for c in cases)
    assert len(res["timing"]) == 3 and [r["varlen"] for r in res["timing"]] == [False, False, True]
    assert all("fused_wu_ms" in r and "wu_plus_ws_ms" in r and "fwd_fused_wu_ms" in r and r["wu_o_vs_ws"] < 3e-3
               for r in res["timing"])
    swept = res["timing"][0]                                     # the config sweep row (DRY_SWEEP)
    assert swept["fused_wu_ms_bv32_s2_nwu1"] > 0 and swept["o_vs_ws_bv32_s2_nwu1"] < 3e-3
    # the round-16 sweep row: WU_AREG at BV=64 with its registers (o differs from the copy path by about its error)
    assert swept["fused_wu_ms_bv64_s2_nwu2_areg_o136_w192"] > 0 and swept["o_vs_ws_bv64_s2_nwu2_areg_o136_w192"] < 1e-2
    # round 17's sweep rows: OUT_PIPE at BV=32 and 64 (on top of WU_AREG: o differs from the copy path by about its
    # error)
    assert swept["fused_wu_ms_bv32_s3_nwu2_areg_opipe"] > 0 and swept["o_vs_ws_bv32_s3_nwu2_areg_opipe"] < 1e-2
    tag = "bv64_s2_nwu2_areg_opipe_o152_w176"
    assert swept[f"fused_wu_ms_{tag}"] > 0 and swept[f"o_vs_ws_{tag}"] < 1e-2


def test_gpu_round_reports_a_hang(tmp_path):
    """A case that never returns (as a barrier hang would) is reported as a timeout; the next cases still run."""
    env = dict(os.environ, TRITON_INTERPRET="1", FUSED_WU_ROUND_FAKE_HANG="T65",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_fused_wu_round.py"),
                           "--out", str(tmp_path), "--dry-run", "--no-timing", "--case-timeout", "20"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gluon_fused_wu.json").read_text())
    by = {c["case"]: c for c in res["gate"]["cases"]}
    assert not by["T65"]["ok"] and "timeout" in by["T65"]["error"]
    assert by["T1"]["ok"] and by["varlen"]["ok"] and res["gate"]["passed"] is False


def test_switch_ab_round_fwdbwd_dry_run(tmp_path):
    """switch_ab_round.py with AB_MODE=fwdbwd (round 22: the backward recompute's decay on Vnew against on K) on the
    CPU: the forward is the same on both sides (o bit-equal), the gradients differ by the rounding's place only
    (relative RMS above 0 and below 1e-2), finite, the JSON written with its mode."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               AB_MODE="fwdbwd", AB_SIDES="k:LINATTN_GDN_STATE_DECAY_V_BWD=0,v:LINATTN_GDN_STATE_DECAY_V_BWD=1")
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "switch_ab_round.py"), "--out",
                           str(tmp_path), "--dry-run"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "switch_ab.json").read_text())
    assert res["passed"] and res["mode"] == "fwdbwd" and len(res["rows"]) == 2, res
    for r in res["rows"]:
        assert r["o_v_vs_k"] == 0.0 and 0.0 < r["final_v_vs_k"] < 1e-2 and r["finite"], r
