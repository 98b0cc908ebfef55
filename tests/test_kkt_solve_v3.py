"""Stage 2a v3 (the default since round 17; triton/intra_split.py kkt_solve_v3_kernel: kkt_solve_v2_kernel's block
substitution with its tl.gather cross-warp moves replaced by one broadcast per moved tensor and in-register selects) on
a CPU under TRITON_INTERPRET=1, modelled on test_kkt_solve_v2.py and sharing its helpers:
1. gcum torch.equal to kkt_solve_kernel's (v1); Tinv against torch.linalg.inv(I + A) in float64 per chunk and value
   head, v3's worst chunk within 1.5 x v1's worst chunk plus test_kkt_solve_v2's floors (only for chunks both invert
   exactly); and Tinv torch.equal to v2's (the same products in the same order: v3 changes only how operands move
   between warps). All written into NaN-filled buffers. The cases of test_kkt_solve_v2: T = 1, 63, 64, 65, 200, varlen
   [1, 63, 1, 65, 70], GVA and H = HV, k in bf16 / fp16 (TF32 products) / fp32 (IEEE), Tinv in fp32 and k's dtype,
   K = 100, steep gates.
2. The launcher kkt_solve_v3 allocating like gluon's kkt_solve (in test_kkt_solve_v2.py, parametrized over v2 / v3,
   against kkt_solve_kernel); the LINATTN_GDN_KKT=v3 switch in the Triton forward
   and the gluon forward's kkt_solve; the whole Triton forward with v3 against the fp64 recurrent reference (in
   test_kkt_solve_v2.py, parametrized over v1 / v2 / v3); one
   backward case (forward and the backward's stage-2 recompute with v3) against fp64 autograd at
   test_chunk_backward's tolerances.
3. The sm_90a AOT build at H16/HV32 K=128 bf16 (gdn_fwd_triton_split_kkt_solve_v3_w4): the launcher's configuration,
   0 spill, registers <= 96 (5 CTAs of 4 warps per SM, as v2), shared memory no more than v2's.
4. The GPU round's dry run (benchmarks/gpu/kkt_v3_round.py --dry-run: v1, v2 and v3 on the same rows).
Run only this file: `python3 -m pytest -q tests/test_kkt_solve_v3.py`."""
import json
import os
import subprocess
import sys

import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.triton import intra_split as sm
from linattn.testing import make_gdn_inputs

from kkt_inputs import (TINV_CASES, aot_reports_no_spill, assert_aot_build_is_the_launchers, kkt_inputs,
                        launch_kkt_solve, nan_bufs)                      # tests/ is on sys.path
from test_kkt_solve_v2 import FLOOR, _rel_errors, _spy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = "cpu"


def _inputs(*args, **kw):
    return kkt_inputs(*args, device=DEV, **kw)


def _check(k, g, beta, plan, B, T, cu, HV, tinv_dtype=None):
    tinv_dtype = tinv_dtype or k.dtype
    ref_g, ref_t = launch_kkt_solve(k, g, beta, plan, HV, tinv_dtype)
    v2_g, v2_t = sm.kkt_solve_v2(k, g, beta, plan, HV, *nan_bufs(plan, HV, tinv_dtype, DEV))
    gcum, tinv = nan_bufs(plan, HV, tinv_dtype, DEV)
    out_g, out_t = sm.kkt_solve_v3(k, g, beta, plan, HV, gcum=gcum, tinv=tinv)
    assert out_g is gcum and out_t is tinv
    assert torch.isfinite(ref_g).all() and torch.isfinite(ref_t).all()      # the reference wrote every row
    assert torch.isfinite(gcum).all() and torch.isfinite(tinv).all(), "v3 left NaN (an unwritten element)"
    assert torch.equal(gcum, ref_g), (gcum - ref_g).abs().max()
    assert torch.equal(tinv, v2_t), (tinv.double() - v2_t.double()).abs().max()
    e_ref = max(_rel_errors(ref_t, k, g, beta, B, T, cu, HV))
    e_v3 = max(_rel_errors(tinv, k, g, beta, B, T, cu, HV))
    bound = 1.5 * e_ref + FLOOR[tinv_dtype]
    msg = (f"Tinv rel. RMS error vs fp64 (worst chunk): v3 {e_v3:.3e}, kkt_solve_kernel {e_ref:.3e}, "
           f"bound {bound:.3e} (k {k.dtype}, Tinv {tinv_dtype})")
    print(msg)
    assert e_v3 <= bound, msg


@pytest.mark.parametrize("args, kwargs, HV, tinv_dtype, check_inputs", TINV_CASES)
def test_tinv_vs_fp64(args, kwargs, HV, tinv_dtype, check_inputs):
    """kkt_inputs.TINV_CASES (dense T 1-200 with GVA, varlen with 1-token sequences in every dtype, B2 T65, K=100,
    steep gates) through this file's `_check`."""
    k, g, beta, plan, B, T, cu = _inputs(*args, **kwargs)
    if check_inputs is not None:
        check_inputs(plan, g)
    _check(k, g, beta, plan, B, T, cu, HV, tinv_dtype=tinv_dtype)


# The launcher kkt_solve_v3 allocating like gluon's kkt_solve: test_kkt_solve_v2.py::
# test_launcher_allocates_like_fused_wu_kkt_solve[kkt_solve_v3].


def test_switch_selects_v3(monkeypatch):
    """LINATTN_GDN_KKT=v3 (any case, spaces) -> kkt_solve_v3_kernel in the Triton forward's stage 2 (intra_split) and
    in the gluon forward's kkt_solve, and nothing else; unset and an unknown value are v4 (the default since round
    20), "v2" another opt-out."""
    import importlib
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import kkt_solve
    settings_mod = importlib.import_module("linattn.runtime.settings")
    calls = []
    for name in ("kkt_solve_kernel", "kkt_solve_v2_kernel", "kkt_solve_v3_kernel", "kkt_solve_v4_kernel"):
        _spy(monkeypatch, name, calls)
    monkeypatch.setenv("LINATTN_GDN_SPLIT_INTRA", "1")
    for value, want in ((" V3 ", "v3"), ("v9", "v4"), (None, "v4"), ("v2", "v2")):
        if value is None:
            monkeypatch.delenv("LINATTN_GDN_KKT", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_KKT", value)
        assert settings_mod.settings.gdn_kkt == want
        assert sm.kkt_kernel() is {"v2": sm.kkt_solve_v2_kernel, "v3": sm.kkt_solve_v3_kernel,
                                   "v4": sm.kkt_solve_v4_kernel}[want]
    monkeypatch.setenv("LINATTN_GDN_KKT", "v3")
    x = make_gdn_inputs(1, 70, 1, 2, 64, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
        k, g, beta, plan = _inputs(1, 70, 1, 2, 64, torch.bfloat16, seed=4)[:4]
        kkt_solve(k, g, beta, plan, 2)
    assert [c[0] for c in calls] == ["kkt_solve_v3_kernel", "kkt_solve_v3_kernel"], calls


# The whole Triton forward with LINATTN_GDN_KKT=v3 against fp64:
# test_kkt_solve_v2.py::test_forward_with_v2_matches_fp64_reference[v3].


def test_backward_with_v3_matches_fp64_reference(monkeypatch):
    """LINATTN_GDN_KKT=v3 through the Triton forward AND backward (which recomputes stage 2 with an fp32 Tinv), bf16
    (TF32 products), varlen with GVA 3 and l2norm: every gradient against fp64 autograd of the chunked reference at
    test_chunk_backward's tolerances (its own check, reused), and only the v3 kernel launched, in both passes."""
    from test_chunk_backward import CASES, _check as backward_check      # tests/ is on sys.path
    (B, T, H, HV, K, V, extra), = [c.values for c in CASES if c.id == "varlen-gva3-bf16-l2norm"]
    calls = []
    for name in ("kkt_solve_kernel", "kkt_solve_v2_kernel", "kkt_solve_v3_kernel"):
        _spy(monkeypatch, name, calls)
    monkeypatch.setenv("LINATTN_GDN_SPLIT_INTRA", "1")
    monkeypatch.setenv("LINATTN_GDN_KKT", "v3")
    backward_check(B, T, H, HV, K, V, **extra)
    names = [c[0] for c in calls]
    assert len(names) >= 2 and set(names) == {"kkt_solve_v3_kernel"}, names


# ---------------------------------------------------------------- sm_90a AOT build

AOT_V2 = "gdn_fwd_triton_split_kkt_solve_v2_w4"
AOT_V3 = "gdn_fwd_triton_split_kkt_solve_v3_w4"


def test_aot_registration_is_the_launchers():
    assert_aot_build_is_the_launchers(AOT_V3, sm.kkt_solve_v3_kernel)


def test_aot_sm90a_no_spill():
    """v3 compiled for sm_90a (ptxas): 0 spill, WGMMA for K K^T, <= 96 registers (5 CTAs of 4 warps per SM, as v2's
    95; 85 when written), shared memory no more than v2's."""
    from linattn.runtime.aot import inspect_kernel, kernels
    reps = aot_reports_no_spill(AOT_V3)
    v2 = inspect_kernel(kernels()[AOT_V2])
    assert reps[AOT_V3].regs <= 96 and reps[AOT_V3].smem <= v2.smem, (reps[AOT_V3], v2.regs, v2.smem)


# ---------------------------------------------------------------- the GPU round's logic

def test_gpu_round_dry_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "kkt_v3_round.py"),
                           "--out", str(tmp_path), "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "kkt_v3.json").read_text())
    assert res["dry_run"] is True and res["passed"] and not res["skipped"] and res["variants"] == ["v2", "v3"]
    rows = res["rows"]
    assert [r["varlen"] for r in rows] == [False, False, True] and all("error" not in r for r in rows)
    for r in rows:
        assert r["gcum_equal"] and r["tinv_ok"] and r["ref_ms"] > 0 and r["v2_ms"] > 0 and r["v3_ms"] > 0
        for t in ("bf16", "fp32"):
            assert set(r[f"tinv_err_{t}"]) == {"ref", "v2", "v3"} and r[f"tinv_equal_v2_v3_{t}"] is True
            assert r[f"v2_over_v3_ms_{t}"] > 0
    assert res["forward"]["ok"] and res["forward"]["v3_launched"] and res["forward"]["v3"]["within_tol"]
