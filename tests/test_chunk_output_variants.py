"""Opt-in launch configs of stage 4 of the Triton GDN forward (triton/chunk_output.py: chunk_output_loop_kernel,
OutputConfig, chunk_output; benchmarks/OUTPUT_STAGE.md). forward.py still launches chunk_output_kernel as before.

1. Every GPU-round candidate (chunk_output.OUTPUT_CANDIDATES) and a few extra configs (K loops with a partial last
   K block, grouped heads with GVA) against the default launch on the same stage-4 inputs (h, vnew, gcum from the
   forward's stages 1-3, o NaN-poisoned): SAME relative RMS. The math is the same, with the same rounding points
   (fp32 accumulators, the attention matrix and vnew in the operand dtype); a K loop only splits the fp32
   accumulation of q S and q k^T into BK-sized dots (the interpreter: ~1e-8 in fp32, and at most a flipped rounding
   of the 16-bit att in a few elements for 16-bit inputs: 2^-8 relative on those elements, far below SAME).
   One-K-block configs (any BV, grouped heads) are bit-identical to the default under the interpreter.
2. o of each against the fp64 step-by-step recurrence at the forward tests' tolerance (TOL).
3. The default launcher config reproduces the forward's o bit for bit.
4. AOT, sm_90a: every candidate compiles with WGMMA (HGMMA) and no spills (numbers: benchmarks/OUTPUT_STAGE.md).
5. benchmarks/gpu/output_stage_round.py --dry-run passes on the CPU.
"""
import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
from linattn.ops.gated_delta_rule.triton.chunk_output import (DEFAULT_OUTPUT, OUTPUT_CANDIDATES, OUTPUT_V2, OutputConfig,
                                                               chunk_output)
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens

SAME = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}
EXTRA = (
    OutputConfig("loop", 32, 64, 4, 2, True, False),     # 2-4 K blocks, partial at K=60/100, grouped heads
    OutputConfig("loop", 16, 32, 4, 3, False, True),     # many K blocks, 3 stages
    OutputConfig("one", 0, 128, 8, 2),
)


def _fp64(x):
    return {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


def stage4_inputs(x, cu=None):
    """The forward's result with its stage-4 inputs (h, vnew, gcum, plan) kept, and its o from forward.py's launch."""
    with torch.no_grad():
        return fwd_mod.chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5,
                                                  x["initial_state"], False, cu)


def run_config(x, res, cfg):
    q = x["q"]
    H, K, HV, V = q.shape[2], q.shape[3], x["v"].shape[2], x["v"].shape[3]
    with torch.no_grad(), poisoned_allocations():
        o = torch.empty_like(x["v"])
        o.fill_(float("nan"))
        chunk_output(q, x["k"], res.vnew, res.h, res.gcum, o, res.plan, K ** -0.5, H=H, HV=HV, K=K, V=V,
                     dot_prec="ieee" if q.dtype == torch.float32 else "tf32", cfg=cfg)
    return o


# (B, T, H, HV, K, V, dtype, varlen lengths)
CASES = [
    pytest.param(1, 130, 1, 2, 128, 128, torch.bfloat16, None, id="T130-K128-bf16"),
    pytest.param(2, 70, 2, 4, 64, 64, torch.float32, None, id="B2-T70-gva-fp32"),
    pytest.param(1, 70, 1, 2, 60, 100, torch.float16, None, id="K60-V100-fp16"),
    pytest.param(1, 200, 2, 8, 32, 32, torch.bfloat16, [1, 70, 1, 64, 63, 1], id="varlen-1tok-gva4-bf16"),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,lengths", CASES)
def test_configs_match_default(B, T, H, HV, K, V, dtype, lengths):
    cu = random_cu_seqlens(lengths) if lengths else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, num_states=len(lengths) if lengths else None)
    res = stage4_inputs(x, cu)
    base = run_config(x, res, DEFAULT_OUTPUT)
    assert torch.equal(run_config(x, res, OUTPUT_V2), res.o), "forward.py's launch (OUTPUT_V2) must reproduce its o"
    ref_o, _ = naive_recurrent(**_fp64(x), output_final_state=True, cu_seqlens=cu)
    assert_close("o default", base, ref_o, TOL[dtype])
    for cfg in OUTPUT_CANDIDATES[1:] + EXTRA:
        o = run_config(x, res, cfg)
        assert not o.isnan().any(), cfg.name
        if cfg.kernel == "one" or cfg.BK == 0 or cfg.BK >= K:
            assert torch.equal(o, base), f"{cfg.name}: one K block must be bit-identical to the default"
        assert_close(f"o {cfg.name} vs default", o, base, SAME[dtype])
        assert_close(f"o {cfg.name} vs fp64", o, ref_o, TOL[dtype])


def test_default_unchanged():
    """DEFAULT_OUTPUT is forward.py's v1 launch (LINATTN_GDN_OUTPUT=v1: BV = min(V, 64), 4 warps, 2 stages, one K
    block); forward.py's default since round 13 is OUTPUT_V2, itself a candidate."""
    from linattn.ops.gated_delta_rule.triton.forward import _configs_for
    cfg = _configs_for(128, 128, 1, 32, "cuda", 132)
    assert (DEFAULT_OUTPUT.kernel, DEFAULT_OUTPUT.BK, DEFAULT_OUTPUT.BV, DEFAULT_OUTPUT.warps, DEFAULT_OUTPUT.stages) \
        == ("one", 0, cfg.BV_out, cfg.warps_out, cfg.stages)
    assert OUTPUT_CANDIDATES[0] == DEFAULT_OUTPUT and len(set(OUTPUT_CANDIDATES)) == len(OUTPUT_CANDIDATES)
    assert OUTPUT_V2 in OUTPUT_CANDIDATES and OUTPUT_V2.name == "loop_bk64_bv128_w8_s2_gh"


@pytest.mark.parametrize("cfg", OUTPUT_CANDIDATES, ids=lambda c: c.name)
def test_candidates_compile_sm90a(cfg):
    from linattn.ops.gated_delta_rule.aot_output import report
    r = report(cfg)
    assert r["spill_bytes"] == 0 and r["local"] == 0, r
    assert r["hgmma"] > 0 and r["hmma"] == 0, r
    assert r["ctas"] >= 2 and r["smem"] <= 232448, r
    if cfg.kernel == "loop" and cfg.BK < 128:
        assert r["ldgsts"] > 0, r          # the K loop's loads are pipelined cp.async copies


def test_gpu_round_dry_run(tmp_path):
    """benchmarks/gpu/output_stage_round.py --dry-run: every candidate checked against the default and timed."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "output_stage_round.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "output_stage.json").read_text())
    assert res["check_passed"], res
    assert len(res["rows"]) == 2
    for row in res["rows"]:
        assert "error" not in row, row
        assert [c["config"] for c in row["candidates"]] == [c.name for c in OUTPUT_CANDIDATES] + ["default_again"]
        for c in row["candidates"]:
            assert c["passed"] and c["ms"] > 0, c


@pytest.mark.parametrize("switch,expected", [(None, "v2"), ("v1", "v1")])
def test_forward_launches_the_selected_stage4(monkeypatch, switch, expected):
    """LINATTN_GDN_OUTPUT: unset -> OUTPUT_V2 through chunk_output(); v1 -> chunk_output_kernel. Both against fp64."""
    if switch:
        monkeypatch.setenv("LINATTN_GDN_OUTPUT", switch)
    else:
        monkeypatch.delenv("LINATTN_GDN_OUTPUT", raising=False)
    seen = []
    real_launcher, real_v1 = fwd_mod.chunk_output, fwd_mod.chunk_output_kernel

    def launcher(*a, cfg, **kw):
        seen.append(("v2", cfg))
        return real_launcher(*a, cfg=cfg, **kw)

    class V1:
        def __getitem__(self, grid):
            seen.append(("v1", grid))
            return real_v1[grid]

    monkeypatch.setattr(fwd_mod, "chunk_output", launcher)
    monkeypatch.setattr(fwd_mod, "chunk_output_kernel", V1())
    x = make_gdn_inputs(1, 100, 2, 4, 64, 48, dtype=torch.float32)
    res = stage4_inputs(x)
    assert [s[0] for s in seen] == [expected]
    if expected == "v2":
        assert seen[0][1] == OUTPUT_V2
    ref_o, _ = naive_recurrent(**_fp64(x), output_final_state=True)
    assert_close(f"o {expected} vs fp64", res.o, ref_o, TOL[torch.float32])
