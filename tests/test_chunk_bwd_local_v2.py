"""Restructured local stage of the Triton GDN backward (triton/backward_local_v2.py, LINATTN_GDN_BWD_LOCAL=v2).

1. The whole backward with the switch on against the same backward with it off, on the same inputs (every buffer
   NaN-poisoned): every gradient agrees to SAME: 1e-5 relative RMS in fp32 (reassociated fp32 sums: the gate terms
   come from rowsum(Q * dQ_h) and rowsum(K * dK_h) instead of a Q K^T tile), 2e-3 in bf16 (there the gate sums take
   dP * Gam rounded to bf16, as dQ and dK do in both kernels; measured 4e-4 to 1.3e-3 on dg, the rest identical).
   Covers T not a multiple of 64, varlen with 1-token sequences, GVA (HV = 2H, 3H), K = V in {32, 64, 128}, K != V.
2. The whole backward with the switch on against the fp64 reference (tests/test_chunk_backward.py's helper and
   tolerances), alone and with the WY v2 switch too.
3. The switch: default off (spied), "v2" takes the new kernel.
4. AOT: the registration gdn_bwd_triton_local_v2_w4 names the kernel's parameters and matches the launcher's config
   (the generic AOT test in test_aot_gluon.py compiles it for sm_90a: HGMMA, no spill, no local memory).
5. The GPU round's dry run (benchmarks/gpu/bwd_local_round.py).
"""
import inspect

import pytest
import torch

from linattn.ops.gated_delta_rule.triton import backward as bw
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import assert_close, make_gdn_inputs, random_cu_seqlens
from launch_spy import spy_kernel                                              # tests/ is on sys.path
from test_chunk_backward import _check as backward_check, needs_interpreter   # tests/ is on sys.path

SAME = {torch.float32: 1e-5, torch.bfloat16: 2e-3}
ENV = "LINATTN_GDN_BWD_LOCAL"


def _spy(monkeypatch):
    return spy_kernel(monkeypatch, bw, "local_v2", "chunk_local_bwd_v2_kernel")


def _backward(monkeypatch, x, do, dht, cu, switch):
    monkeypatch.setenv("LINATTN_GDN_BWD_WY", "v1")
    monkeypatch.setenv(ENV, switch)
    K = x["q"].shape[-1]
    with torch.no_grad(), poisoned_allocations():
        return bw.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5,
                                             x["initial_state"], cu, do, dht)


# (B, T, H, HV, K, V, dtype, varlen lengths)
CASES = [
    pytest.param(2, 150, 1, 2, 32, 32, torch.float32, None, id="T150-B2-gva-K32-fp32"),
    pytest.param(1, 130, 2, 4, 64, 64, torch.bfloat16, None, id="T130-gva-K64-bf16"),
    pytest.param(1, 70, 1, 2, 128, 128, torch.float32, None, id="T70-gva-K128-fp32"),
    pytest.param(1, 100, 2, 4, 128, 128, torch.bfloat16, None, id="T100-gva-K128-bf16"),
    pytest.param(1, 100, 2, 2, 128, 64, torch.bfloat16, None, id="K128-V64-bf16"),
    pytest.param(1, 90, 1, 3, 64, 100, torch.float32, None, id="gva3-K64-V100-fp32"),
    pytest.param(1, 77, 1, 2, 48, 32, torch.float32, None, id="gva-K48-V32-fp32"),
    pytest.param(1, 267, 2, 4, 64, 32, torch.float32, [1, 70, 1, 64, 129, 1, 1], id="varlen-1tok-gva-fp32"),
    pytest.param(1, 131, 1, 2, 32, 64, torch.bfloat16, [1, 64, 65, 1], id="varlen-1tok-K32-bf16"),
]


@needs_interpreter
@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,lengths", CASES)
def test_v2_matches_current_kernel(monkeypatch, B, T, H, HV, K, V, dtype, lengths):
    gen = torch.Generator().manual_seed(3)
    cu = random_cu_seqlens(lengths) if lengths else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, num_states=len(lengths) if lengths else None, generator=gen)
    do = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    dht = torch.randn(x["initial_state"].shape, generator=gen)
    calls = _spy(monkeypatch)
    one = _backward(monkeypatch, x, do, dht, cu, "v1")
    assert calls == []
    two = _backward(monkeypatch, x, do, dht, cu, "v2")
    assert calls == [K]
    assert torch.equal(two[5], one[5])                             # d initial_state: not the local stage's
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), two[:5], one[:5]):
        assert a.dtype == b.dtype and a.shape == b.shape and not a.isnan().any(), name
        assert_close(name, a, b, SAME[dtype])


BWD_CASES = [
    pytest.param(1, 63, 1, 1, 60, 100, dict(dtype=torch.bfloat16, dht=False), id="T63-K60-bf16-nodht"),
    pytest.param(1, 200, 2, 4, 64, 64, dict(dtype=torch.float32), id="T200-gva-fp32"),
    pytest.param(1, 130, 1, 2, 128, 128, dict(dtype=torch.bfloat16), id="T130-gva-K128-bf16"),
    pytest.param(1, 200, 1, 3, 64, 60, dict(dtype=torch.bfloat16, lengths=[1, 63, 1, 70, 65], l2norm=True),
                 id="varlen-gva3-bf16-l2norm"),
    pytest.param(1, 131, 2, 4, 16, 128, dict(dtype=torch.float32, lengths=[1, 64, 65, 1], h0=False),
                 id="varlen-noh0-K16"),
]


@needs_interpreter
@pytest.mark.parametrize("B,T,H,HV,K,V,extra", BWD_CASES)
@pytest.mark.parametrize("wy", ["v1", "v2"], ids=["wy-v1", "wy-v2"])
def test_backward_with_v2_matches_fp64_reference(monkeypatch, device, B, T, H, HV, K, V, extra, wy):
    monkeypatch.setenv(ENV, "v2")
    monkeypatch.setenv("LINATTN_GDN_BWD_WY", wy)
    calls = _spy(monkeypatch)
    backward_check(B, T, H, HV, K, V, device=device, **extra)
    assert calls == [K]


def test_default_is_v2_and_v1_selectable(monkeypatch):
    """v2 is the default since round 13 (gate green on an H200, backward 18.63 -> 17.71 ms alone, 14.62 with WY v2)."""
    from linattn.runtime.settings import settings
    monkeypatch.delenv(ENV, raising=False)
    assert settings.gdn_bwd_local == "v2"
    for off in (" V1 ", "0", "off"):
        monkeypatch.setenv(ENV, off)
        assert settings.gdn_bwd_local == "v1"
    monkeypatch.setenv(ENV, " V2 ")
    assert settings.gdn_bwd_local == "v2"


def test_same_launch_arguments_as_v1():
    """v2 is a drop-in: the same runtime parameters, in the same order, as chunk_local_bwd_kernel."""
    from linattn.ops.gated_delta_rule.triton.backward_local import chunk_local_bwd_kernel as v1
    from linattn.ops.gated_delta_rule.triton.backward_local_v2 import chunk_local_bwd_v2_kernel as v2
    assert v1.arg_names == v2.arg_names


# ---- AOT registration (compile and spill bound: test_aot_gluon.py's generic test over every registration) --------

def test_aot_registration_matches_the_launcher():
    import unittest.mock as um
    from linattn.ops.gated_delta_rule import aot as gdn_aot
    from linattn.ops.gated_delta_rule.triton import backward_local_v2 as m
    from linattn.runtime.aot import kernels
    from linattn.runtime.device import DeviceFacts
    spec = kernels()["gdn_bwd_triton_local_v2_w4"]
    assert spec.known_spill_bytes == 0
    fn, sig, const, opts = spec.build()
    params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    runtime = [n for n in sig if sig[n] != "constexpr"]
    assert sorted(sig) == sorted(params) and runtime == params[:len(runtime)]
    assert opts == {"num_warps": m.WARPS_LOCAL_V2, "num_stages": m.STAGES_LOCAL_V2}
    h200 = DeviceFacts("cuda", "NVIDIA H200", (9, 0), 132, 232448, 141 << 30)
    for B in (1, 8):                                   # B1 T65536 and B8 T4096: the same local config
        with um.patch.object(bw, "device_facts", lambda device: h200):
            cfg = bw._configs(128, 128, B, 32, "cuda")
        assert (const["BK"], const["BV"]) == (cfg.BK, cfg.BV)
    assert gdn_aot.H == 16 and gdn_aot.HV == 32 and const["DOT_PREC"] == "tf32"


def test_gpu_round_dry_run(tmp_path):
    """benchmarks/gpu/bwd_local_round.py --dry-run: gate (switch on vs fp64 and vs off, v2 launch counted) and the
    timing rows' logic on the CPU under the interpreter."""
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo)
    env.pop(ENV, None)
    env.pop("LINATTN_GDN_BWD_WY", None)
    proc = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "gpu", "bwd_local_round.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "bwd_local.json").read_text())
    assert res["gate_passed"] and res["gate_complete"] and len(res["gate"]) == 3
    assert all(c["v2_taken"] == 1 for c in res["gate"])
    assert [(r["B"], r["T"]) for r in res["timing"]] == [(1, 130), (2, 65)]
    assert all(r["bwd_v1_ms"] > 0 and r["bwd_v2_ms"] > 0 and r["bwd_both_ms"] > 0 for r in res["timing"])
