"""Two-kernel stage 2 of the Triton GDN forward (triton/intra_split.py, LINATTN_GDN_SPLIT_INTRA=1).

1. Its outputs (gcum, w, u and the fp32 Tinv kept for the backward) against intra_chunk_wy_kernel's on the same inputs,
   every buffer NaN-poisoned. The two compute the same math with the same rounding points (Tinv rounded to the
   operand dtype before W and U in both); they differ only in how the inverse's block substitution is associated
   ((I - M)(I + M^2) D against X_ij = -D_i sum A_im X_mj) and in the accumulation order of the products. So: gcum
   to 1e-6 (the same summation order), the rest to SAME: 1e-6 in fp32 (round-off of reassociated fp32 sums; the
   interpreter gives ~1e-8), 2e-3 for 16-bit inputs (on a GPU both inverses run at TF32, whose 2^-11 round-off lands
   differently under the two associations and flips some roundings of w and u to the 16-bit type, 2^-9 relative;
   under the interpreter, which computes TF32 products in fp32, they agree to ~1e-8).
2. The whole forward (o, final state) and backward (every gradient) with the switch on against the fp64 references of
   tests/test_chunk_forward.py and tests/test_chunk_backward.py (their helpers, hence their tolerances), covering T
   not a multiple of 64, varlen with 1-token sequences, GVA, fp32 and bf16.
3. The switch: default off, and with it on the forward takes the split kernels (spied).
"""
import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
from linattn.ops.gated_delta_rule.triton import intra_split as split_mod
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens
from test_chunk_backward import _check as backward_check          # tests/ is on sys.path (no __init__.py)

SAME = {torch.float32: 1e-6, torch.bfloat16: 2e-3, torch.float16: 2e-3}


def _spy(monkeypatch):
    calls = []
    orig = fwd_mod.intra_split

    def spy(*a, **kw):
        calls.append(a[7])                                  # tinv: the fp32 buffer, or None (forward only)
        return orig(*a, **kw)
    monkeypatch.setattr(fwd_mod, "intra_split", spy)
    return calls


def _stage2(monkeypatch, x, split, cu_seqlens, store_tinv):
    monkeypatch.setenv("LINATTN_GDN_SPLIT_INTRA", "1" if split else "0")
    B, T = x["q"].shape[:2]
    with torch.no_grad(), poisoned_allocations():
        return fwd_mod.chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5,
                                                  x["initial_state"], False, cu_seqlens, store_tinv=store_tinv,
                                                  compute_output=False)


# (B, T, H, HV, K, V, dtype, varlen lengths)
CASES = [
    pytest.param(2, 150, 1, 2, 32, 32, torch.float32, None, id="T150-B2-fp32"),
    pytest.param(1, 130, 2, 4, 64, 64, torch.bfloat16, None, id="T130-gva-bf16"),
    pytest.param(1, 70, 1, 2, 60, 100, torch.float16, None, id="K60-V100-fp16"),
    pytest.param(1, 267, 2, 4, 32, 32, torch.bfloat16, [1, 70, 1, 64, 129, 1, 1], id="varlen-1tok-gva-bf16"),
    pytest.param(1, 3, 1, 1, 16, 16, torch.float32, [1, 1, 1], id="varlen-all-1tok-fp32"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,lengths", CASES)
def test_stage2_matches_one_kernel(monkeypatch, B, T, H, HV, K, V, dtype, lengths):
    cu = random_cu_seqlens(lengths) if lengths else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, num_states=len(lengths) if lengths else None)
    calls = _spy(monkeypatch)
    for store_tinv in (True, False):
        one = _stage2(monkeypatch, x, False, cu, store_tinv)
        n = len(calls)
        two = _stage2(monkeypatch, x, True, cu, store_tinv)
        assert len(calls) == n + 1
        assert_close("gcum", two.gcum, one.gcum, 1e-6)
        for name in ("w", "u"):
            a, b = getattr(two, name), getattr(one, name)
            assert a.dtype == b.dtype == dtype and not a.isnan().any()
            assert_close(name, a, b, SAME[dtype])
        if store_tinv:
            assert two.tinv.dtype == torch.float32 and two.tinv.shape == one.tinv.shape
            assert_close("tinv", two.tinv, one.tinv, SAME[dtype])
        else:
            assert two.tinv is None and one.tinv is None


def _fp64(x):
    return {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


FWD_CASES = [
    pytest.param(2, 65, 1, 2, 16, 32, torch.float32, None, id="T65-fp32"),
    pytest.param(1, 130, 2, 4, 64, 64, torch.bfloat16, None, id="T130-gva-bf16"),
    pytest.param(1, 70, 1, 2, 60, 100, torch.bfloat16, None, id="K60-V100-bf16"),
    pytest.param(1, 261, 2, 4, 32, 32, torch.bfloat16, [1, 63, 1, 65, 130, 1], id="varlen-1tok-gva-bf16"),
    pytest.param(1, 165, 1, 1, 16, 16, torch.float32, [64, 1, 100], id="varlen-fp32"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,lengths", FWD_CASES)
def test_forward_matches_fp64_reference(monkeypatch, B, T, H, HV, K, V, dtype, lengths):
    monkeypatch.setenv("LINATTN_GDN_SPLIT_INTRA", "1")
    calls = _spy(monkeypatch)
    cu = random_cu_seqlens(lengths) if lengths else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, num_states=len(lengths) if lengths else None)
    with torch.no_grad(), poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend="triton")
    assert len(calls) == 1
    ref_o, ref_ht = naive_recurrent(**_fp64(x), output_final_state=True, cu_seqlens=cu)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape and ht.dtype == torch.float32
    assert_close("o", o, ref_o, TOL[dtype])
    assert_close("final_state", ht, ref_ht, TOL[dtype])


BWD_CASES = [
    pytest.param(1, 65, 1, 2, 32, 32, dict(dtype=torch.float32), id="T65-gva-fp32"),
    pytest.param(1, 130, 2, 4, 64, 64, dict(dtype=torch.bfloat16, h0=False), id="T130-gva-bf16-noh0"),
    pytest.param(1, 200, 1, 3, 64, 60, dict(dtype=torch.bfloat16, lengths=[1, 63, 1, 70, 65], l2norm=True),
                 id="varlen-1tok-gva3-bf16-l2norm"),
    pytest.param(1, 131, 2, 4, 16, 64, dict(dtype=torch.float32, lengths=[1, 64, 65, 1]), id="varlen-1tok-fp32"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,extra", BWD_CASES)
def test_backward_matches_fp64_reference(monkeypatch, B, T, H, HV, K, V, extra):
    """The backward recomputes its intermediates through chunk_gated_delta_rule_fwd with store_tinv=True: with the
    switch on, its fp32 Tinv comes from kkt_solve."""
    monkeypatch.setenv("LINATTN_GDN_SPLIT_INTRA", "1")
    calls = _spy(monkeypatch)
    backward_check(B, T, H, HV, K, V, **extra)
    assert len(calls) == 2                                  # the forward, then the backward's recompute
    assert calls[0] is None and calls[1].dtype == torch.float32


def test_default_is_split_and_zero_turns_it_off(monkeypatch):
    """Default on since round 12 (faster on the H200, GPU gate green); LINATTN_GDN_SPLIT_INTRA=0 gives the one-kernel
    stage back."""
    monkeypatch.delenv("LINATTN_GDN_SPLIT_INTRA", raising=False)
    calls = _spy(monkeypatch)
    x = make_gdn_inputs(1, 70, 1, 1, 16, 16, dtype=torch.float32)
    with torch.no_grad():
        linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
    assert len(calls) == 1
    monkeypatch.setenv("LINATTN_GDN_SPLIT_INTRA", "0")
    with torch.no_grad():
        linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
    assert len(calls) == 1


def test_config_at_production_shape():
    cfg = split_mod.split_intra_config(128, 128)
    assert cfg == split_mod.SplitIntraConfig(BK_kkt=128, BK=64, BV=64, warps_kkt=4, warps_wu=4)
    assert split_mod.split_intra_config(256, 60) == split_mod.SplitIntraConfig(128, 64, 64, 4, 4)
    assert split_mod.split_intra_config(16, 16) == split_mod.SplitIntraConfig(16, 16, 16, 4, 4)


def test_gpu_round_dry_run(tmp_path):
    """benchmarks/gpu/split_intra_round.py --dry-run: its gate (split taken, must pass) and timing logic on the CPU."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    env.pop("LINATTN_GDN_SPLIT_INTRA", None)
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "split_intra_round.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "split_intra.json").read_text())
    assert res["gate_passed"] and res["gate_complete"] and all(c["split_taken"] == 1 for c in res["gate"])
    assert len(res["timing"]) == 2
    for row in res["timing"]:
        assert "error" not in row and row["w_vs_one_kernel"] <= 2e-3 and row["u_vs_one_kernel"] <= 2e-3, row
