"""Fused state pass + output of the Triton GDN forward (triton/chunk_fused_fwd.py, LINATTN_GDN_FUSED_FWD=1).

The forward with the fused kernel against the fp64 step-by-step recurrence (NaN-poisoned buffers, the tolerances of
test_chunk_forward.py) and against the default (unfused) Triton forward on the same inputs (o and the final state:
same rounding points, so equal up to accumulation order; the interpreter gives 0), the switch and where it is
taken (only for callers that need neither h nor vnew), autograd through a fused forward, the launch-config choice at
H200 shapes, and an ahead-of-time sm_90a build of the configs the launcher picks (registers, no spills).
"""
import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.gated_delta_rule.triton import chunk_fused_fwd as fused_mod
from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens, rel_rms

# fused vs unfused on the same inputs: the same arithmetic and roundings, only accumulation order may differ (GPU)
SAME = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _fp64(x):
    return {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


def _spy(monkeypatch):
    calls = []
    orig = fwd_mod.chunk_fused_fwd

    def spy(*a, **kw):
        calls.append(kw)
        return orig(*a, **kw)
    monkeypatch.setattr(fwd_mod, "chunk_fused_fwd", spy)
    return calls


def _run(monkeypatch, x, fused, cu_seqlens=None, output_final_state=True):
    monkeypatch.setenv("LINATTN_GDN_FUSED_FWD", "1" if fused else "0")
    # the fused kernel scales K by the chunk decay (chunk_state.state_update); the unfused state pass does the same
    # only with LINATTN_GDN_STATE_DECAY_V=0 (its default since round 21 scales Vnew instead, another rounding point):
    # "the same arithmetic and roundings" below needs that form on both sides
    monkeypatch.setenv("LINATTN_GDN_STATE_DECAY_V", "0")
    with torch.no_grad(), poisoned_allocations():
        return linattn.chunk_gated_delta_rule(**x, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                              backend="triton")


def _check(monkeypatch, x, dtype, cu_seqlens=None, output_final_state=True):
    calls = _spy(monkeypatch)
    o, ht = _run(monkeypatch, x, True, cu_seqlens, output_final_state)
    assert len(calls) == 1
    o_d, ht_d = _run(monkeypatch, x, False, cu_seqlens, output_final_state)
    assert len(calls) == 1                                  # the default run did not take the fused kernel
    ref_o, ref_ht = naive_recurrent(**_fp64(x), output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert_close("o", o, ref_o, TOL[dtype])
    assert_close("o vs unfused", o, o_d, SAME[dtype])
    if output_final_state:
        assert ht.dtype == torch.float32 and ht.shape == ref_ht.shape
        assert_close("final_state", ht, ref_ht, TOL[dtype])
        assert_close("final_state vs unfused", ht, ht_d, SAME[dtype])
    else:
        assert ht is None and ht_d is None


# (B, T, H, HV, K, V, dtype, initial state, final state)
CASES = [
    (2, 150, 1, 2, 32, 32, torch.float32, True, True),      # T % 64 != 0, three chunks, B=2
    (1, 130, 2, 4, 64, 64, torch.bfloat16, True, True),     # GVA (2 value heads per key head)
    (2, 100, 1, 2, 32, 32, torch.float16, False, False),    # no states at all
    (1, 65, 2, 2, 32, 32, torch.float32, False, True),      # no initial state, final state; 64 + 1 tokens
    (1, 129, 1, 2, 32, 32, torch.bfloat16, True, False),    # initial state, no final state
    (2, 1, 1, 2, 32, 32, torch.float32, True, True),        # one token
    (1, 70, 1, 2, 60, 100, torch.bfloat16, True, True),     # K, V not powers of two: masked tiles, 2 V blocks
]


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,h0,ht", CASES)
def test_fused_matches_reference_and_unfused(monkeypatch, B, T, H, HV, K, V, dtype, h0, ht):
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, initial_state=h0)
    _check(monkeypatch, x, dtype, output_final_state=ht)


@pytest.mark.parametrize("h0", [True, False])
def test_fused_varlen_gva_one_token_and_empty_sequences(monkeypatch, h0):
    lengths = [1, 70, 1, 64, 0, 129, 1]
    cu = random_cu_seqlens(lengths)
    x = make_gdn_inputs(1, sum(lengths), 2, 4, 32, 32, dtype=torch.bfloat16, num_states=len(lengths),
                        initial_state=h0)
    _check(monkeypatch, x, torch.bfloat16, cu_seqlens=cu)


def test_fused_varlen_int64_offsets_fp32(monkeypatch):
    lengths = [64, 1, 100]
    cu = random_cu_seqlens(lengths).to(torch.int64)
    x = make_gdn_inputs(1, sum(lengths), 1, 1, 16, 16, dtype=torch.float32, num_states=len(lengths))
    _check(monkeypatch, x, torch.float32, cu_seqlens=cu)


def test_default_is_unfused(monkeypatch):
    monkeypatch.delenv("LINATTN_GDN_FUSED_FWD", raising=False)
    calls = _spy(monkeypatch)
    x = make_gdn_inputs(1, 70, 1, 1, 16, 16, dtype=torch.float32)
    with torch.no_grad():
        linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
    assert calls == []


def test_taken_only_where_intermediates_are_not_needed(monkeypatch):
    """With the switch on, chunk_gated_delta_rule_fwd fuses only for need_intermediates=False (what the public op
    passes) with an output and no state_pass hook; every other caller still gets h and vnew."""
    monkeypatch.setenv("LINATTN_GDN_FUSED_FWD", "1")
    monkeypatch.setenv("LINATTN_GDN_SPLIT_STATE", "1")      # the fused kernel takes precedence over the split pass
    calls = _spy(monkeypatch)
    x = make_gdn_inputs(1, 100, 1, 2, 16, 16, dtype=torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 16 ** -0.5, x["initial_state"], True, None)
    with torch.no_grad(), poisoned_allocations():
        fused = fwd_mod.chunk_gated_delta_rule_fwd(*args, need_intermediates=False)
        assert len(calls) == 1 and fused.h is None and fused.vnew is None and fused.o is not None
        for kw in (dict(), dict(compute_output=False, need_intermediates=False)):
            res = fwd_mod.chunk_gated_delta_rule_fwd(*args, **kw)
            assert len(calls) == 1 and res.h is not None and res.vnew is not None
        monkeypatch.setenv("LINATTN_GDN_SPLIT_STATE", "0")
        plain = fwd_mod.chunk_gated_delta_rule_fwd(*args)
    assert rel_rms(fused.o, plain.o) <= 1e-6 and rel_rms(fused.final_state, plain.final_state) <= 1e-6


def test_autograd_through_fused_forward(monkeypatch):
    """The backward recomputes its intermediates unfused: gradients with the switch on equal those with it off."""
    x = make_gdn_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32, requires_grad=True)
    outs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("LINATTN_GDN_FUSED_FWD", on)
        calls = _spy(monkeypatch)
        for t in x.values():
            t.grad = None
        o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
        assert len(calls) == (1 if on == "1" else 0)
        (o.square().sum() + ht.square().sum()).backward()
        outs[on] = [o.detach(), ht.detach()] + [x[n].grad.clone() for n in ("q", "k", "v", "g", "beta",
                                                                            "initial_state")]
    for a, b in zip(outs["1"], outs["0"]):
        assert rel_rms(a, b) <= 1e-6


def test_config_at_h200_shapes(monkeypatch):
    """BV and warps the launcher picks with 132 SMs (K=V=128: BV=32 always, the only width without spills; 4 warps,
    the faster on the H200 in round 12), and where the forward takes the fused kernel on a GPU."""
    from linattn.runtime.device import DeviceFacts
    h200 = DeviceFacts("cuda", "H200", (9, 0), 132, 232448, 0)
    monkeypatch.setattr(fused_mod, "device_facts", lambda device=None: h200)
    cfg = fused_mod.fused_config
    assert cfg(128, 128, 1, 32, "cuda") == fused_mod.FusedConfig(BV=32, warps=4, stages=1)    # 128 programs
    assert cfg(128, 128, 8, 32, "cuda") == fused_mod.FusedConfig(BV=32, warps=4, stages=1)    # 1024 programs
    assert cfg(128, 128, 4, 32, "cuda").warps == 4
    assert cfg(64, 64, 8, 32, "cuda") == fused_mod.FusedConfig(BV=64, warps=4, stages=1)      # 256 programs
    assert cfg(64, 64, 1, 32, "cuda") == fused_mod.FusedConfig(BV=32, warps=4, stages=1)      # 64 programs
    wanted = fused_mod.fused_fwd_wanted
    assert wanted(torch.bfloat16, 128, "cuda") and wanted(torch.float16, 64, "cuda")
    assert not wanted(torch.float32, 128, "cuda") and not wanted(torch.bfloat16, 256, "cuda")


def test_gpu_round_dry_run(tmp_path):
    """benchmarks/gpu/fused_fwd_round.py --dry-run: its gate (fused kernel taken, must pass) and timing logic (every
    sweep config run and checked against the unfused stages) on the CPU at tiny shapes."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    env.pop("LINATTN_GDN_FUSED_FWD", None)
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "fused_fwd_round.py"), "--dry-run",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "fused_fwd.json").read_text())
    assert res["gate_passed"] and res["gate_complete"] and all(c["fused_taken"] == 1 for c in res["gate"])
    assert len(res["timing"]) == 2
    for row in res["timing"]:
        assert "error" not in row and len(row["fused"]) == 6
        for ent in row["fused"]:
            assert ent["o_vs_unfused"] <= 1e-6 and ent["state_vs_unfused"] <= 1e-6, ent


# ---- ahead-of-time build for sm_90a (no GPU needed) ---------------------------------------------------------------

# (name, K=V, dtype, BV, warps): every config fused_config picks for 16-bit inputs at K=V=128 and 64
AOT_CONFIGS = [("fused_k128_bf16_bv32_w4", 128, "bf16", 32, 4), ("fused_k128_bf16_bv32_w8", 128, "bf16", 32, 8),
               ("fused_k128_fp16_bv32_w4", 128, "fp16", 32, 4), ("fused_k64_bf16_bv64_w4", 64, "bf16", 64, 4),
               ("fused_k64_bf16_bv32_w8", 64, "bf16", 32, 8)]


def _aot_specs(H: int = 16, HV: int = 32):
    """(name, jit fn, signature, constexprs, options) of each config as the launcher configures it."""
    out = []
    for name, K, dt, BV, warps in AOT_CONFIGS:
        x, f, i64 = f"*{dt}", "*fp32", "*i64"
        sig = dict(q_ptr=x, k_ptr=x, w_ptr=x, u_ptr=x, gcum_ptr=f, o_ptr=x, h0_ptr=f, ht_ptr=f, cu_ptr=i64,
                   chunk_off_ptr=i64, scale="fp32")
        const = dict(H=H, HV=HV, K=K, V=K, BT=64, BK=K, BV=BV, USE_H0=True, STORE_HT=True, DOT_PREC="tf32")
        out.append((name, fused_mod.chunk_fused_fwd_kernel, sig, const, dict(num_warps=warps, num_stages=1)))
    return out


def _aot_main():
    """Child process (TRITON_INTERPRET unset): compile each config for sm_90a, print one JSON line per kernel."""
    from linattn.testing.aot import print_reports
    for spec in _aot_specs():
        print_reports([spec], spec[3]["K"], spec[3]["V"])


def test_aot_sm90a_compiles_without_spills():
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))     # this checkout, not an install
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, __file__, "aot"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in reports:
        print(r)
    assert sorted(r["name"] for r in reports) == sorted(c[0] for c in AOT_CONFIGS)
    for r in reports:
        assert r["spill_bytes"] == 0, r


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 2 and sys.argv[1] == "aot":
        _aot_main()
