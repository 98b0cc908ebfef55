"""The Gluon reverse state pass of the GDN backward (gluon/chunk_state_bwd.py, the gluon backend's stage 1) on a CPU
host: every registered config compiles for sm_90a with WGMMA, TMA loads/store and mbarriers, spills nothing and fits
in shared memory; the launcher's arguments are exactly what was compiled, through the real JIT path too. The kernel
itself runs on the GPU only (benchmarks/gpu/gate.py)."""
import json
import re
import sys

import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

from bwd_cases import HOOK_CASES, assert_same_grads, fp32_bwd_args   # tests/ is on sys.path

SMEM_LIMIT_SM90 = 232448
_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()
NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_bwd_dh_gluon_"))
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


def test_launcher_configs_are_registered():
    from linattn.ops.gated_delta_rule.aot import BWD_DH_CONFIGS, BWD_DH_SEG_CONFIGS, bwd_dh_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import SEG_BV, BwdStateConfig, state_bwd_config
    names = {bwd_dh_kernel_name(*c) for c in BWD_DH_CONFIGS}
    assert names | {bwd_dh_kernel_name(*c) for c in BWD_DH_SEG_CONFIGS} == set(NAMES)
    # the segment launch's config (chunk_state_bwd._segments) and the slow pairs' (B1's plain config, selected)
    assert bwd_dh_kernel_name("bf16", SEG_BV, 8, 2, True, "seg") in NAMES
    assert bwd_dh_kernel_name("bf16", 32, 4, 3, True, "sel") in NAMES
    for N in (1, 8):                      # B1 T65536 and B8 T4096 at H16/HV32 on an H200 (132 SMs)
        for local in (True, False):
            cfg = state_bwd_config(N, 32, 128, 132, local)
            assert bwd_dh_kernel_name("bf16", cfg.BV, cfg.num_warps, cfg.stages, local) in names
    assert state_bwd_config(1, 32, 128, 132) == state_bwd_config(1, 32, 128, 132, True) == BwdStateConfig(32, 4, 3)
    assert state_bwd_config(8, 32, 128, 132) == BwdStateConfig(64, 4, 2)
    assert state_bwd_config(8, 32, 128, 132, True) == BwdStateConfig(64, 8, 2)


@needs_gluon
@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_spill_with_intended_instructions(name):
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    assert 0 < rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
    bv, warps, stages = map(int, re.search(r"_bv(\d+)_w(\d+)_s(\d+)", name).groups())
    local = "_local" in name
    assert rep.num_warps == warps and rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0
    # per warpgroup, n = BV / (warps / 4) columns: dVnew 64 x n x 128 (8 k-steps); dS 128 x n x 64 twice (2 M-halves x
    # 4 k-steps each) -> 24 HGMMA 64xnx16; with stage 1a also K Q^T 64 x 64/(warps/4) x 128 (8) and P^T dO 64 x n x 64 (4)
    sfx = ".F32" + (".BF16" if "_bf16_" in name else "")
    n, nt = bv // (warps // 4), 64 // (warps // 4)
    counts = {}
    for op, c in ((f"HGMMA.64x{n}x16{sfx}", 24 + 4 * local), (f"HGMMA.64x{nt}x16{sfx}", 8 * local)):
        counts[op] = counts.get(op, 0) + c
    assert {op: rep.sass.get(op, 0) for op in counts} == counts, rep.sass
    assert sum(v for op, v in rep.sass.items() if op.startswith("HGMMA.")) == 24 + 12 * local, rep.sass
    # TMA loads per issue: q, k, w, dO and (without stage 1a) dVnew; STAGES-1 prologue issues and one in the loop
    assert rep.sass.get("UTMALDG.2D", 0) == (4 if local else 5) * stages, rep.sass
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
@pytest.mark.parametrize("dv_local", [True, False])
@pytest.mark.parametrize("B,T,lens", [(1, 4096, None), (8, 512, None), (1, 3000, [1, 63, 65, 1000, 1871])])
def test_launch_matches_aot_signature(B, T, lens, dv_local):
    """state_bwd_launch's arguments (descriptors build on CPU tensors) mangle to exactly the AOT signature; grid,
    constexprs, descriptor views and boxes are the intended ones."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import bwd_dh_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_config, state_bwd_launch
    plan, bufs = _plan_and_buffers(B, T, 16, 32, lens)
    cfg = state_bwd_config(plan.N, 32, 128, 132, dv_local)
    kernel, grid, args, kwargs = state_bwd_launch(*bufs, plan, 128 ** -0.5, cfg, dv_local)
    sig = bwd_dh_signature("bf16", cfg.BV)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (128 // cfg.BV, plan.N * 32)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, BV=cfg.BV, USE_DHT=True, STORE_DH0=True,
                          STAGES=cfg.stages, DV_LOCAL=dv_local, DECAY="scalar",
                          num_warps=8 if dv_local and cfg.BV == 64 else 4)
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


@needs_gluon
@pytest.mark.parametrize("B,T,lens", [(1, 4096, None), (1, 3000, [1, 63, 65, 1000, 1871])])
def test_kda_channel_launch_matches_aot_signature(B, T, lens):
    """KDA's reverse pass on the same kernel (decay "channel"): the decayed queries and keys per value head [T_tot, HV,
    K] as q / k (boxes at the value head's columns), gcum [T_tot, HV, K]; the arguments mangle to the AOT signature of
    kda/aot.py's builds, DECAY "channel" and no stage 1a; a call that mixes the forms is refused by name."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import bwd_dh_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_config, state_bwd_launch
    plan, bufs = _plan_and_buffers(B, T, 32, 32, lens)
    q, k, w, gcum, do, dh, dvnew, dht, dh0 = bufs
    T_tot = plan.T_total
    qdec, kdec = (torch.zeros(T_tot, 32, 128, dtype=torch.bfloat16) for _ in range(2))
    gk = torch.zeros(T_tot, 32, 128)
    cfg = state_bwd_config(plan.N, 32, 128, 132)
    kernel, grid, args, kwargs = state_bwd_launch(qdec, kdec, w, gk, do, dh, dvnew, dht, dh0, plan, 0.1, cfg,
                                                  decay="channel")
    sig = bwd_dh_signature("bf16", cfg.BV)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert kwargs["DECAY"] == "channel" and kwargs["DV_LOCAL"] is False and kwargs["H"] == kwargs["HV"] == 32
    assert [list(a.shape) for a in args[:2]] == [[T_tot, 32 * 128]] * 2 and args[5] is gk
    with pytest.raises(ValueError, match="decay 'channel'"):
        state_bwd_launch(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, 0.1, cfg, decay="channel")
    with pytest.raises(ValueError, match="decay 'channel'"):
        state_bwd_launch(qdec, kdec, w, gk, do, dh, dvnew, dht, dh0, plan, 0.1, cfg, True, decay="channel")


@needs_gluon
@pytest.mark.parametrize("launch", ["seg", "sel"])
def test_segment_launches_match_aot_signature(launch):
    """The reverse pass's segment launch (B2 T8192 in 2 segments: the segment plan, select over the sequences, the
    reverse words over the segments, seq_len; dh on the sequence plan's slots) and the slow pairs' unsegmented launch
    (select over the sequences' pairs) mangle to their AOT signatures; grids over the segments / sequences."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import bwd_dh_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import SEG_BV, BwdStateConfig, state_bwd_launch
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    B, T, S, L = 2, 8192, 2, 64
    plan, bufs = _plan_and_buffers(B, T, 16, 32)
    select = torch.zeros(B, 32, dtype=torch.int32)
    if launch == "seg":
        splan = segment_plan(B, T, S, L, "cpu")
        cfg = BwdStateConfig(SEG_BV, 8, 2)
        kernel, grid, args, kwargs = state_bwd_launch(*bufs, splan, 0.1, cfg, True, select=select,
                                                      seg=torch.zeros(B * S * 32, dtype=torch.int32), seq_len=T)
        assert grid == (2, B * S * 32) and args[-1] == T
    else:
        cfg = BwdStateConfig(32, 4, 3)
        kernel, grid, args, kwargs = state_bwd_launch(*bufs, plan, 0.1, cfg, True, select=select)
        assert grid == (4, B * 32) and args[-1] == 0
    sig = bwd_dh_signature("bf16", cfg.BV, launch)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert list(args[6].shape) == [plan.num_slots * 32 * 128, 128]        # dh over the sequence plan's slots


def test_reverse_segment_rule():
    """state_bwd_segments: one wave of SEG_BV CTAs (B1 H16/HV32: 2 segments on 132 SMs, 4 at HV16), none shorter
    than 16 chunks; none for varlen, for B * HV * 2 >= SMs / 2, or for eager calls under 8192 tokens (taken under
    capture)."""
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_segments
    assert state_bwd_segments(1, 65536, 32, 128, None, "cpu") == (2, 512)
    assert state_bwd_segments(1, 65536, 16, 128, None, "cpu") == (4, 256)
    assert state_bwd_segments(1, 8192, 32, 128, None, "cpu") == (2, 64)
    assert state_bwd_segments(1, 8191, 32, 128, None, "cpu") is None
    assert state_bwd_segments(1, 4096, 32, 128, None, "cpu", capturing=True) == (2, 32)
    assert state_bwd_segments(1, 1024, 32, 128, None, "cpu", capturing=True) is None       # 16 chunks: one segment
    assert state_bwd_segments(2, 65536, 32, 128, None, "cpu") is None
    assert state_bwd_segments(1, 65536, 32, 128, torch.tensor([0, 65536]), "cpu") is None


def _jit_compile_main():
    """Child process: the real JIT launch path (binder, specialisation, compile) with the launcher's own arguments on
    CPU tensors, under a stand-in driver that reports sm_90a and never launches (warmup). One JSON line per case."""
    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import state_bwd_config, state_bwd_launch

    use_compile_only_sm90_driver()
    for B, T, dtype, states, local in ((1, 300, torch.bfloat16, True, True), (8, 100, torch.float16, False, True),
                                       (8, 100, torch.bfloat16, True, False)):
        plan, bufs = _plan_and_buffers(B, T, 16, 32, dtype=dtype, dht=states, dh0=states)
        cfg = state_bwd_config(plan.N, 32, 128, 132, local)
        kernel, grid, args, kwargs = state_bwd_launch(*bufs, plan, 128 ** -0.5, cfg, local)
        k = kernel.warmup(*args, grid=grid, **kwargs)
        print(json.dumps(dict(B=B, BV=cfg.BV, stages=cfg.stages, local=local, num_warps=k.metadata.num_warps,
                              shared=k.metadata.shared,
                              tma_boxes=[m["block_size"] for m in (k.metadata.tensordesc_meta or [])],
                              expect_tx=re.findall(r"mbarrier\.arrive\.expect_tx\S*\s+_,\s*\[[^\]]+\],\s*(\d+)",
                                                   k.asm["ptx"]))))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    from compile_only import jit_child_rows      # tests/ is on sys.path
    rows = jit_child_rows(__file__, timeout=900)
    assert [(r["B"], r["BV"], r["stages"], r["local"], r["num_warps"]) for r in rows] == \
        [(1, 32, 3, True, 4), (8, 64, 2, True, 8), (8, 64, 2, False, 4)]
    for r in rows:
        assert 0 < r["shared"] <= SMEM_LIMIT_SM90, r
        # q, k, w [64,128] boxes go as [64,64] messages (128-byte swizzle); dO, dVnew [64,BV]; dh [128,BV]
        assert r["tma_boxes"] == [[64, 64]] * 3 + [[64, r["BV"]]] * 2 + [[128, r["BV"]]], r
        # review 2026-11-29: every expect (STAGES-1 prologue issues + 1 in the loop) counts the full boxes q, k, w
        # [64,128], dO [64,BV] and (without stage 1a in the kernel) dVnew [64,BV]: TMA counts the zero-filled rows
        # past T_tot too, so a clipped last box still completes the phase
        nbytes = 2 * (3 * 64 * 128 + (1 if r["local"] else 2) * 64 * r["BV"])
        assert r["expect_tx"] == [str(nbytes)] * r["stages"], r


def _state_bwd_local_formulas(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale):
    """The DV_LOCAL kernel's formulas (its docstring) in torch, per sequence and value head, chunks last to first;
    the operand roundings are identities on the fp32 inputs of the test below. dvnew's contents are not read."""
    dt = q.dtype
    H, K = q.shape[-2], q.shape[-1]
    HV, V = dvnew.shape[1], dvnew.shape[2]
    T_tot = plan.T_total
    q2, k2, do2 = q.reshape(T_tot, H, K).float(), k.reshape(T_tot, H, K).float(), do.reshape(T_tot, HV, V).float()
    cu, off = plan.cu.tolist(), plan.chunk_offsets.tolist()
    for n in range(plan.N):
        bos, eos = cu[n], cu[n + 1]
        for hv in range(HV):
            hk = hv // (HV // H)
            dS = dht[n, hv].float() if dht is not None else torch.zeros(K, V)
            for c in reversed(range(-(-(eos - bos) // 64))):
                rows = slice(bos + 64 * c, min(bos + 64 * c + 64, eos))
                nt = rows.stop - rows.start
                gam = gcum[rows, hv]
                gl_ = gam[-1]
                Q, Kt, dO, W = q2[rows, hk], k2[rows, hk], do2[rows, hv], w[rows, hv].float()
                dh[off[n] + c, hv] = dS.to(dh.dtype)
                upper = torch.ones(nt, nt).triu().bool()
                pt = torch.where(upper, scale * (Kt @ Q.T) * torch.where(upper, gam[None, :] - gam[:, None],
                                                                         torch.zeros(())).exp(), torch.zeros(()))
                kdec = (Kt * (gl_ - gam).exp()[:, None]).to(dt).float()
                dvn = pt.to(dt).float() @ dO + kdec @ dS.to(dt).float()
                dvnew[rows, hv] = dvn.to(dvnew.dtype)
                qg = (Q * (gam.exp() * scale)[:, None]).to(dt).float()
                dS = gl_.exp() * dS + qg.T @ dO - W.T @ dvn.to(dt).float()
            if dh0 is not None:
                dh0[n, hv] = dS


@pytest.mark.parametrize("B,T,H,HV,lens", HOOK_CASES)
def test_dv_local_formulas_give_the_triton_stages_gradients(B, T, H, HV, lens):
    """fp32 inputs, fresh random values: the DV_LOCAL kernel's formulas as the state_bwd hook with
    state_bwd_dv_local (so chunk_dv_local_kernel is skipped and dvnew reaches the hook NaN-poisoned) against the
    Triton stages 1a + 1 on the same recompute; every gradient, partial last chunks and varlen boundaries included."""
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
    from linattn.runtime.alloc import poisoned_allocations
    args = fp32_bwd_args(B, T, H, HV, lens)
    seen = []

    def hook(q, k, w, gcum, do_, dh, dvnew, dht_, dh0, plan, scale):
        seen.append(bool(torch.isnan(dvnew).all()))
        _state_bwd_local_formulas(q, k, w, gcum, do_, dh, dvnew, dht_, dh0, plan, scale)
    with poisoned_allocations():
        want = chunk_gated_delta_rule_bwd(*args)
        got = chunk_gated_delta_rule_bwd(*args, state_bwd=hook, state_bwd_dv_local=True)
    assert seen == [True]                 # stage 1a did not run: the hook got the poisoned buffer
    assert_same_grads(got, want)


def test_gluon_backward_runs_stage_1a_in_the_state_pass(monkeypatch):
    """The gluon backend's backward asks chunk_gated_delta_rule_bwd to skip stage 1a and its state_bwd hook launches
    the DV_LOCAL kernel; context parallelism's hook (distributed/chunk.py) keeps the two-kernel form."""
    from linattn.ops.gated_delta_rule.gluon import backend
    from linattn.ops.gated_delta_rule.gluon import chunk_state_bwd as sb
    from linattn.ops.gated_delta_rule.triton import backward
    seen = {}

    def fake_bwd(q, k, v, g, beta, scale, h0, cu, do, dht, **hooks):
        seen.update(hooks)
        hooks["state_bwd"](q, k, None, None, do, None, None, None, None, None, scale)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), None, None, None)
    monkeypatch.setattr(backward, "chunk_gated_delta_rule_bwd", fake_bwd)
    monkeypatch.setattr(sb, "chunk_state_bwd_gluon", lambda *a, **kw: seen.update(launch_kwargs=kw))
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    g, beta = torch.rand(1, 64, 4), torch.rand(1, 64, 4)
    gcum, tinv = torch.randn(64, 4), torch.randn(64, 4, 64).to(q.dtype)     # the forward's kept stage 2a outputs
    backend._chunk_gdn_bwd_gluon(q, q, v, g, beta, 0.1, None, None, torch.randn_like(v), None, gcum, tinv)
    kw = seen["launch_kwargs"]
    assert seen["state_bwd_dv_local"] is True and kw["dv_local"] is True
    # 64 tokens: no segments; the window kernel's inputs are the op's own g and beta
    assert kw["segments"] is None and kw["g"] is g and kw["beta"] is beta
    from linattn.distributed import chunk as cp_chunk
    seen.clear()
    cp_chunk._gluon_state_bwd(q, q, None, None, v, None, None, None, None, None, 0.1)
    assert seen["launch_kwargs"] == {}


if __name__ == "__main__":
    if sys.argv[1:] == ["jit"]:
        _jit_compile_main()


@pytest.mark.parametrize("B,T,segs,rsegs,slow_odd", [(1, 64 * 12 - 9, (3, 4), (3, 4), True),
                                                      (2, 64 * 10, (2, 5), (2, 5), False)])
def test_segmented_backward_with_the_kernel_models_gives_the_triton_gradients(B, T, segs, rsegs, slow_odd):
    """The gluon backward's segment paths on a CPU: its recompute (recompute_gf with the chunk_state_gf model) and its
    reverse pass (chunk_state_bwd_gluon's segment launch with the DV_LOCAL kernel's model, testing/state_models.py:
    the window kernel's reverse words, the segment chains past their ends, the flagged pairs' unsegmented launch),
    fresh fp32 inputs at ~-20 of log decay per chunk (one-chunk windows; slow_odd: every odd head ~1000x slower,
    flagged in both passes), outputs NaN-poisoned: every gradient within 1e-4 of the Triton backward's."""
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import chunk_state_bwd_gluon
    from linattn.ops.gated_delta_rule.gluon.chunk_state_gf import recompute_gf
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_windows
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing.state_models import emulate_state_bwd
    from linattn.testing.state_models import emulate_state_gf
    args = list(fp32_bwd_args(B, T, 2, 4, None))
    g = args[3] * 0 - 0.32
    if slow_odd:
        g[..., 1::2] *= 1e-3
    args[3] = g
    q, k, v, g, beta = args[:5]

    def recompute(q_, k_, v_, g_, beta_, h0_, plan):
        return recompute_gf(q_, k_, v_, g_, beta_, h0_, plan, segments=segs, state_pass=emulate_state_gf)

    def state_bwd(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0_, plan, scale_):
        if slow_odd:       # the case reaches the flagged pairs' launch
            slow = segment_windows(k_, beta, g, plan, *rsegs, reverse=True)[0]
            assert slow[:, 1::2].all() and not slow[:, 0::2].any()
        chunk_state_bwd_gluon(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0_, plan, scale_, dv_local=True,
                              segments=rsegs, g=g, beta=beta, run=emulate_state_bwd)
    with poisoned_allocations():
        want = chunk_gated_delta_rule_bwd(*args)
        got = chunk_gated_delta_rule_bwd(*args, recompute=recompute, state_bwd=state_bwd, state_bwd_dv_local=True)
    assert_same_grads(got, want)


def test_an_eager_backward_prepares_the_capture_time_segment_plan():
    """state_bwd_prepare_capture: an eager B1 T4096 H16/HV32 backward (unsegmented eagerly, 2 segments under
    capture) builds the capture's segment plan, so that a capture after the warm-up records none of its
    construction; nothing where a capture would not segment either (B1 T1024: 16 chunks)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_state_bwd as sb
    from linattn.ops.gated_delta_rule.triton import segment_start as ss
    ss._SEG_PLANS.clear()
    sb._PREPARED.clear()
    sb.state_bwd_prepare_capture(1, 4096, 32, 128, "cpu")
    assert ss.segment_plan_cached(1, 4096, 2, 32, "cpu")
    sb.state_bwd_prepare_capture(1, 1024, 32, 128, "cpu")
    assert sb._PREPARED[(1, 1024, 32, 128, "cpu")] is None and len(ss._SEG_PLANS) == 1
    ss._SEG_PLANS.clear()                        # dropped from the plan cache: built again on the next call
    sb.state_bwd_prepare_capture(1, 4096, 32, 128, "cpu")
    assert ss.segment_plan_cached(1, 4096, 2, 32, "cpu")
