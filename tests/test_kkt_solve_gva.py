"""The opt-in GVA form of stage 2a (triton/intra_split.py kkt_solve_gva_kernel: one program per (chunk slot, key head),
K K^T once per key head, then a static loop over its G = HV // H value heads) against kkt_solve_kernel (one program
per (chunk slot, value head), the default), on a CPU under TRITON_INTERPRET=1:
1. bit-equality (torch.equal) of gcum and Tinv, both launched into NaN-filled buffers (an unwritten row fails):
   G = 1, 2, 4; T = 1, 63, 64, 65, 200; varlen with 1-token sequences; k in bf16, fp16 (TF32 products) and fp32
   (IEEE); Tinv stored in k's dtype (the forward) and in fp32 (the backward's store_tinv); K = 128 and a K that is
   not a power of two; gates steep enough that exp(gam_i - gam_j) overflows above the diagonal without the mask.
2. the launcher kkt_solve_gva against gluon/chunk_fused_wu_ws.py kkt_solve (kkt_solve_kernel, its frozen config).
3. sm_90a AOT builds of both kernels at H16/HV32 K=128 bf16 (linattn/ops/gated_delta_rule/aot.py): 0 spill, the
   registration's parameters the kernel's, registers and shared memory printed.
4. the GPU round's dry run (benchmarks/gpu/kkt_gva_round.py --dry-run).
The bit-equality on a GPU (TF32 WGMMA, the compiled reductions) is benchmarks/gpu/kkt_gva_round.py's job.
Run only this file: `python3 -m pytest -q tests/test_kkt_solve_gva.py`."""
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from linattn.ops.gated_delta_rule.triton import intra_split as sm

from kkt_inputs import (AOT_REF, aot_reports_no_spill, assert_aot_build_is_the_launchers, kkt_inputs,
                        launch_kkt_solve, nan_bufs)                      # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _inputs(*args, **kw):
    return kkt_inputs(*args, device=DEV, **kw)[:4]


def _nan_bufs(plan, HV, tinv_dtype):
    return nan_bufs(plan, HV, tinv_dtype, DEV)


_reference = launch_kkt_solve


def _check(k, g, beta, plan, HV, tinv_dtype=None):
    tinv_dtype = tinv_dtype or k.dtype
    ref_g, ref_t = _reference(k, g, beta, plan, HV, tinv_dtype)
    gcum, tinv = _nan_bufs(plan, HV, tinv_dtype)
    out_g, out_t = sm.kkt_solve_gva(k, g, beta, plan, HV, gcum=gcum, tinv=tinv)
    assert out_g is gcum and out_t is tinv
    assert torch.isfinite(ref_g).all() and torch.isfinite(ref_t).all()      # the reference wrote every row
    assert torch.equal(gcum, ref_g), (gcum - ref_g).abs().nan_to_num(float("inf")).max()
    assert torch.equal(tinv, ref_t), (tinv.float() - ref_t.float()).abs().nan_to_num(float("inf")).max()


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("H, HV", [(2, 2), (1, 2), (2, 4), (1, 4)], ids=["G1", "G2_H1", "G2_H2", "G4"])
def test_bit_equal_dense(H, HV, T):
    _check(*_inputs(1, T, H, HV, 128, torch.bfloat16, seed=T * 10 + HV), HV)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("H, HV", [(2, 2), (1, 2), (1, 4)], ids=["G1", "G2", "G4"])
def test_bit_equal_varlen_one_token_sequences(H, HV, dtype):
    k, g, beta, plan = _inputs(1, None, H, HV, 128, DT[dtype], lens=[1, 63, 1, 65, 70], seed=HV)
    assert plan.N == 5
    _check(k, g, beta, plan, HV)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_bit_equal_fp32_tinv_batch(dtype):
    """Tinv stored in fp32 (the backward's store_tinv buffer), B = 2 with T not a multiple of 64."""
    _check(*_inputs(2, 65, 1, 2, 128, DT[dtype], seed=3), 2, tinv_dtype=torch.float32)


def test_bit_equal_fp32_tinv_varlen_g4():
    _check(*_inputs(1, None, 1, 4, 128, torch.bfloat16, lens=[1, 63, 1, 65, 70], seed=4), 4,
           tinv_dtype=torch.float32)


def test_bit_equal_k_not_a_power_of_two():
    """K = 100: one K block of 128 with the boundary check (split_intra_config's BK_kkt)."""
    _check(*_inputs(1, 130, 1, 2, 100, torch.bfloat16, seed=5), 2)


def test_bit_equal_steep_gates():
    """g x 60: gam_i - gam_j reaches ~ +1000 above the diagonal, where exp overflows; both mask before exp (the
    outputs stay finite) and agree bit for bit."""
    k, g, beta, plan = _inputs(1, 130, 1, 2, 128, torch.bfloat16, seed=6, g_scale=60.0)
    assert float(g.min()) * 63 < -100
    _check(k, g, beta, plan, 2)


def test_launcher_matches_fused_wu_kkt_solve(monkeypatch):
    """kkt_solve_gva (allocating its outputs) against chunk_fused_wu_ws.kkt_solve, the kkt_solve_kernel launch of the
    gluon forward (LINATTN_GDN_KKT=v1: the kernel the GVA variant is meant bit-equal to): the same dtypes and
    bit-equal values."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import kkt_solve
    monkeypatch.setenv("LINATTN_GDN_KKT", "v1")
    k, g, beta, plan = _inputs(1, None, 1, 2, 128, torch.bfloat16, lens=[1, 64, 1, 65], seed=7)
    ref_g, ref_t = kkt_solve(k, g, beta, plan, 2)
    out_g, out_t = sm.kkt_solve_gva(k, g, beta, plan, 2)
    assert out_g.dtype == ref_g.dtype == torch.float32 and out_t.dtype == ref_t.dtype == torch.bfloat16
    assert out_t.shape == ref_t.shape == (plan.T_total, 2, 64)
    assert torch.equal(out_g, ref_g) and torch.equal(out_t, ref_t)


def test_launcher_rejects_hv_not_a_multiple_of_h():
    k, g, beta, plan = _inputs(1, 64, 2, 4, 128, torch.bfloat16)
    with pytest.raises(ValueError):
        sm.kkt_solve_gva(k, g[..., :3].contiguous(), beta[..., :3].contiguous(), plan, 3)


def test_default_forward_does_not_launch_the_variant(monkeypatch):
    """Opt-in and not wired: the forward's stage 2 (intra_split) launches sm.kkt_kernel(), which is kkt_solve_kernel
    with LINATTN_GDN_KKT=v1, kkt_solve_v2_kernel with v2, kkt_solve_v3_kernel with v3 (kkt_solve_v4_kernel by default
    since round 20) and never the GVA variant."""
    src = inspect.getsource(sm.intra_split)
    assert "kernel = kkt_kernel()" in src and "kernel[" in src and "gva" not in src
    monkeypatch.delenv("LINATTN_GDN_KKT", raising=False)
    assert sm.kkt_kernel() is sm.kkt_solve_v4_kernel
    monkeypatch.setenv("LINATTN_GDN_KKT", "v3")
    assert sm.kkt_kernel() is sm.kkt_solve_v3_kernel
    monkeypatch.setenv("LINATTN_GDN_KKT", "v1")
    assert sm.kkt_kernel() is sm.kkt_solve_kernel
    monkeypatch.setenv("LINATTN_GDN_KKT", "v2")
    assert sm.kkt_kernel() is sm.kkt_solve_v2_kernel


# ---------------------------------------------------------------- sm_90a AOT builds

AOT_GVA = "gdn_fwd_triton_split_kkt_solve_gva_w4"


def test_aot_registration_is_the_launchers():
    assert_aot_build_is_the_launchers(AOT_GVA, sm.kkt_solve_gva_kernel)


def test_aot_sm90a_no_spill():
    """Both kernels compiled for sm_90a (ptxas): 0 spill, WGMMA, shared memory in budget. The GVA kernel holds K K^T
    across its value heads and the compiler keeps the heads' shared address arithmetic live: about 225 registers
    against 122 (2 CTAs per SM instead of 4 at 4 warps); the bound below only catches a spill-prone regression."""
    reps = aot_reports_no_spill(AOT_GVA)
    assert reps[AOT_GVA].regs <= 255 and reps[AOT_GVA].smem <= reps[AOT_REF].smem + 1024


# ---------------------------------------------------------------- the GPU round's logic

def test_gpu_round_dry_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "kkt_gva_round.py"),
                           "--out", str(tmp_path), "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "kkt_gva.json").read_text())
    assert res["dry_run"] is True and res["passed"] and res["all_bit_equal"] and not res["skipped"]
    rows = res["rows"]
    assert [r["varlen"] for r in rows] == [False, False, True] and all("error" not in r for r in rows)
    for r in rows:
        assert r["bit_equal"] and all(r[f"{w}_{t}"]["equal"] for w in ("gcum", "tinv") for t in ("bf16", "fp32"))
        assert all(r[f"{w}_ms_{t}"] > 0 for w in ("ref", "gva") for t in ("bf16", "fp32"))
