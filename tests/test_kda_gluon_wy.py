"""KDA's WY backward stage in Gluon (kda/gluon/wy_bwd.py) on a CPU host: the registered build compiles for sm_90a
with its products on warpgroup_mma and fits in shared memory; the launcher passes what was compiled, in the
signature's order; the backward's wy_bwd hook runs the Triton kernel where the Gluon one does not apply (here: CPU
tensors), with the default's values bit for bit. The kernel itself runs on the GPU only (benchmarks/gpu/gate.py)."""
import json
import sys

import pytest
import torch

from linattn.runtime.aot import kernels

from markers import SMEM_LIMIT_SM90, built, needs_gluon   # tests/ is on sys.path

NAME = "kda_bwd_gluon_wy_w8"


@needs_gluon
def test_compiles_with_wgmma_and_fits():
    rep = built(NAME, kernels()[NAME].known_spill_bytes)
    assert rep.num_warps == 8 and rep.families["HGMMA"] > 0 and rep.families["HMMA"] == 0
    assert rep.families["LDGSTS"] > 0                    # the chunk's tiles by cp.async


def _plan_and_buffers(B, T, lens, H=16, HV=32, K=128, V=128, dt=torch.bfloat16, tinv_dt=torch.bfloat16):
    """A chunk plan and the WY stage's tensors in launch_kda_wy_bwd's order (empty: nothing runs)."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, slots = plan.T_total, plan.num_slots
    f32 = torch.float32
    bufs = (torch.empty(B, T, H, K, dtype=dt), torch.empty(B, T, H, K, dtype=dt), torch.empty(B, T, HV, V, dtype=dt),
            torch.empty(T_tot, HV, K, dtype=f32), torch.empty(T_tot, HV, dtype=f32),
            torch.empty(T_tot, HV, 64, dtype=tinv_dt), torch.empty(slots, HV, K, V, dtype=dt),
            torch.empty(T_tot, HV, V, dtype=dt), torch.empty(B, T, HV, V, dtype=dt),
            torch.empty(slots, HV, K, V, dtype=dt), torch.empty(T_tot, HV, V, dtype=dt),
            torch.empty(T_tot, HV, K, dtype=f32), torch.empty(T_tot, HV, K, dtype=f32),
            torch.empty(B, T, HV, V, dtype=dt), torch.empty(T_tot, HV, K, dtype=f32), torch.empty(T_tot, HV, dtype=f32),
            torch.empty(T_tot, HV, 64, dtype=f32), torch.empty(T_tot, HV, 64, dtype=f32))
    return plan, bufs


@needs_gluon
@pytest.mark.parametrize("B,T,lens", [(1, 300, None), (1, 1000, [1, 63, 65, 871])])
def test_launch_matches_aot_signature(B, T, lens):
    from triton.runtime.jit import mangle_type

    from linattn.ops.kda.gluon.wy_bwd import kda_wy_bwd_gluon_launch
    HV, K = 32, 128
    plan, bufs = _plan_and_buffers(B, T, lens)
    slots = plan.num_slots
    kernel, grid, args, kwargs = kda_wy_bwd_gluon_launch(*bufs, plan, K ** -0.5)
    _, sig, const, opts = kernels()[NAME].build()
    runtime = {n: t for n, t in sig.items() if t != "constexpr"}
    assert len(args) == len(runtime)
    for (name, want), arg in zip(runtime.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (slots, HV)
    assert {k: v for k, v in kwargs.items() if k != "num_warps"} == const and kwargs["num_warps"] == opts["num_warps"]
    assert all(a is b for a, b in zip(args[:18], bufs))
    assert args[18] is plan.cu and args[19] is plan.chunk_indices and args[20] is plan.chunk_offsets


def test_hook_runs_the_triton_stage_off_cuda(monkeypatch):
    """chunk_kda_bwd with wy_bwd = the Gluon hook on CPU tensors: the Triton WY kernel, the default's gradients bit
    for bit (varlen with a 1-token sequence, initial and final states); the support check says why."""
    from linattn.ops.kda.gluon.wy_bwd import kda_wy_bwd_gluon, kda_wy_bwd_gluon_supported
    from linattn.ops.kda.triton.backward import chunk_kda_bwd
    torch.manual_seed(0)
    H = HV = 2
    K = V = 32
    lens = [1, 70, 29]
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    q = torch.randn(1, T, H, K)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1)
    v = torch.randn(1, T, HV, V)
    g = -(0.05 + 0.2 * torch.rand(1, T, HV, K))
    beta = torch.rand(1, T, HV)
    h0 = torch.randn(N, HV, K, V)
    do, dht = torch.randn(1, T, HV, V), torch.randn(N, HV, K, V)
    ok, why = kda_wy_bwd_gluon_supported(q, v, do, torch.empty(0), v)
    assert not ok and ("CUDA" in why or "Gluon" in why)
    from linattn.runtime.gluon_compat import GLUON_OK
    if GLUON_OK:                                         # the reasons before the device's
        b = torch.empty(2, 3, 2, 128, dtype=torch.bfloat16)
        assert "bf16" in kda_wy_bwd_gluon_supported(b.half(), b.half(), b.half(), b.half(), b.half())[1]
        assert "K=64" in kda_wy_bwd_gluon_supported(b[..., :64], b, b, b, b)[1]
        assert "Tinv" in kda_wy_bwd_gluon_supported(b, b, b, b.half(), b)[1]
        assert "CUDA" in kda_wy_bwd_gluon_supported(b, b, b, b.float(), b)[1]
    args = (q, k, v, g, beta, K ** -0.5, h0, cu, None, None, "", 0.0, False, False, do, dht)
    ref = chunk_kda_bwd(*args)
    from linattn.ops.kda.triton import backward as bw
    calls = []
    real = bw.launch_kda_wy_bwd
    monkeypatch.setattr(bw, "launch_kda_wy_bwd", lambda *a: calls.append(1) or real(*a))
    hook = []
    got = chunk_kda_bwd(*args, wy_bwd=lambda *a: hook.append(1) or kda_wy_bwd_gluon(*a))
    assert hook == [1] and calls == [1]                  # the hook, which fell back to the Triton stage
    for r, t in zip(ref, got):
        assert (r is None) == (t is None)
        if r is not None:
            assert not torch.isnan(r).any() and torch.equal(r, t)


def _jit_compile_main():
    """Child process: the real JIT path (binder, specialisation, compile) with the launcher's own arguments on CPU
    tensors under a stand-in driver that reports sm_90a and never launches: bf16 with Tinv from the Gluon stage 2a
    (bf16) and from the Triton one (fp32). One JSON line per case."""
    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.kda.gluon.wy_bwd import kda_wy_bwd_gluon_launch

    use_compile_only_sm90_driver()
    for dt, tinv_dt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)):
        plan, bufs = _plan_and_buffers(1, 300, None, dt=dt, tinv_dt=tinv_dt)
        kernel, grid, args, kwargs = kda_wy_bwd_gluon_launch(*bufs, plan, 128 ** -0.5)
        k = kernel.warmup(*args, grid=grid, **kwargs)
        print(json.dumps(dict(dt=str(dt), tinv=str(tinv_dt), num_warps=k.metadata.num_warps,
                              shared=k.metadata.shared)))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    from compile_only import jit_child_rows      # tests/ is on sys.path
    rows = jit_child_rows(__file__, timeout=900)
    assert len(rows) == 2
    for r in rows:
        assert r["num_warps"] == 8 and 0 < r["shared"] <= SMEM_LIMIT_SM90, r


if __name__ == "__main__" and sys.argv[1:] == ["jit"]:
    _jit_compile_main()
