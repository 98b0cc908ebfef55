"""The gate-free BV=128 fused forward (stages 2b+3+4, gluon/chunk_fused_gf.py; the gluon forward's kernel where
gf_wanted holds and for the segment launch) on a CPU host: its sm_90a builds, its launch arguments against the AOT
signatures, the schedule model (testing/fused_model.emulate_fused with gate_free: the state partition forms Vnew =
Tinv diag(beta) (V - diag(e^gam) K S) from the ring's tiles, no wu partition) against the fp64 recurrence, the
launcher's rules (gf_wanted, the segment plan) and the host path of the fused launches. The kernel itself runs only
on a GPU (benchmarks/gpu/gate.py)."""
import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

from test_gluon_fused_wu import SMEM_LIMIT_SM90, _buffers, _inputs  # tests/ on sys.path

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
GF_PLAIN = "gdn_fwd_fused_gf_gluon_bf16_bv128_state2_kspipe"


@needs_gluon
def test_gf_build():
    """sm_90a: 16 warps (two state warpgroups, the output warpgroup, the producer warp's padded warpgroup), 0 spill
    and no local memory, shared memory in budget, the intended HGMMA / UTMALDG / SYNCS / WARPGROUP, no mma.sync."""
    rep = inspect_kernel(kernels()[GF_PLAIN])
    assert not rep.missing, f"intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0 and rep.families["STL"] == 0 and rep.families["LDL"] == 0, (rep.spill_bytes, rep.sass)
    assert rep.num_warps == 16 and 0 < rep.smem <= SMEM_LIMIT_SM90, (rep.num_warps, rep.smem)
    assert rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0


@needs_gluon
@pytest.mark.parametrize("B,T,lens,states", [(8, 512, None, True), (1, 3000, [1, 63, 65, 1000, 1871], False)])
def test_gf_launch_matches_aot_signature(B, T, lens, states):
    """fused_gf_launch's arguments mangle to the AOT signature; one CTA per (sequence, value head); v's box [64, 128];
    the launch config's constexprs."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_gf_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_NPUB, GF_OUTPUT_REGS, GF_STAGES, GF_STATE_REGS,
                                                                   PRODUCER_REGS, fused_gf_launch)
    plan, bufs = _buffers(B, T, 16, 32, lens, states=states)
    kernel, grid, args, kwargs = fused_gf_launch(*bufs, plan, 128 ** -0.5)
    sig = fused_gf_signature("bf16", states)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (plan.N * 32,)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, BV=128, STAGES=GF_STAGES, NPUB=GF_NPUB, USE_H0=states,
                          STORE_HT=states, OUTPUT_REGS=GF_OUTPUT_REGS, PRODUCER_REGS=PRODUCER_REGS,
                          OUT_PIPE=True, SPLIT=2, STATE_REGS=GF_STATE_REGS, num_warps=4)
    assert [a.block_shape for a in args[:4]] == [[64, 128]] * 3 + [[64, 64]]
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")


BOUND = 1.15         # gate-free error / the default model's error (measured max 1.056 over 84 pairs, see below)
GF_CASES = [  # (B, T, lens, dtype, initial state, H, HV, stages, npub)
    (1, 1, None, torch.bfloat16, True, 1, 2, 2, 1),
    (1, 260, None, torch.bfloat16, True, 1, 2, 2, 1),
    (2, 65, None, torch.float16, False, 1, 2, 2, 1),
    (1, 200, None, torch.bfloat16, True, 2, 4, 2, 1),
    (1, 260, [1, 63, 1, 130, 64, 1], torch.bfloat16, True, 1, 2, 2, 1),
    (1, 257, None, torch.bfloat16, True, 1, 2, 1, 1),                  # a one-slot ring: still correct
    (1, 200, [65, 1, 64, 70], torch.float16, False, 1, 2, 3, 2),
]


@pytest.mark.parametrize("B,T,lens,dtype,h0,H,HV,stages,npub", GF_CASES)
def test_gf_schedule_model_matches_fp64(device, B, T, lens, dtype, h0, H, HV, stages, npub):
    """The fused-wu forward with the gate-free schedule model at BV=128 (kkt_solve under the interpreter, three
    partitions interleaved at random at their mbarrier waits), fresh inputs and interleaving every run, outputs
    NaN-poisoned: o and the final state within TOL of the fp64 recurrence and within BOUND x the default model's error
    (W/U formed, BV=32, WU_AREG, OUT_PIPE) on the same inputs. Measured before the bound was written: these seven
    shapes x 6 seeds, o and final (84 pairs): gate-free / default error 0.81-1.056 (below 1 on the long rows: fewer
    roundings, no W and no U; up to 1.056 on the T = 1 and T = 65 rows, where a few elements decide).
    T = 1, T not a multiple of 64, B2, GVA, varlen with 1-token sequences, with and without h0, bf16 and fp16, ring
    depths 1-3 and one or two published buffers."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.fused_forward import chunk_gated_delta_rule_fwd_fused_wu
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    from linattn.testing.fused_model import emulate_fused
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x, cu = _inputs(B, T, lens, dtype, h0, H, HV, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    res = {}
    for gf in (False, True):
        def fused(q, k, v, beta, gcum, tinv, o, h0_, fin, plan, sc):
            emulate_fused(q, k, v, beta, gcum, tinv, o, h0_, fin, plan, sc, BV=128 if gf else 32,
                          stages=stages if gf else 3, npub=npub if gf else 2, out_pipe=True, areg=not gf,
                          gate_free=gf, seed=seed)
        with poisoned_allocations():
            res[gf] = chunk_gated_delta_rule_fwd_fused_wu(*args, fused_pass=fused)
    h64 = None if x["initial_state"] is None else x["initial_state"].double()
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=h64, output_final_state=True, cu_seqlens=cu)
    tol = TOL[dtype]
    for name, want in (("o", o64), ("final_state", f64)):
        got, base = getattr(res[True], name), getattr(res[False], name)
        assert torch.isfinite(got).all(), name
        err, err0 = rel_rms(got, want), rel_rms(base, want)
        assert err < tol, (name, err, tol, seed)
        assert err <= BOUND * err0 + 1e-7, (name, err, err0, seed)


def test_gf_wanted():
    """The rule: at least 15/16 of a wave of sequence-heads, N * HV * 16 >= 15 * SMs."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import gf_wanted
    assert gf_wanted(4, 32, 132) and gf_wanted(8, 32, 132) and gf_wanted(24, 32, 132) and gf_wanted(8, 64, 132)
    assert not gf_wanted(2, 32, 132) and not gf_wanted(1, 32, 132) and not gf_wanted(8, 8, 132)
    assert gf_wanted(1, 124, 132) and not gf_wanted(1, 123, 132)


def test_gf_refuses_a_selection_without_segment_words():
    """The gate-free kernel reads a selection only with segment words (its segment launch); the unsegmented pairs of
    the segment-parallel forward run on the W/U kernel."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import chunk_fused_gf_gluon, gf_supported
    with pytest.raises(ValueError, match="only with segment words"):
        chunk_fused_gf_gluon(*([None] * 11), select=torch.zeros(2, dtype=torch.int32))
    assert gf_supported(torch.empty(1, 1, 1, 128), torch.empty(1, 1, 2, 128))[0]
    ok, why = gf_supported(torch.empty(1, 1, 1, 128), torch.empty(1, 1, 2, 64))
    assert not ok and "V=64" in why


GF_WARM = GF_PLAIN + "_warm"


@needs_gluon
def test_gf_segment_build():
    """The segment launch's build (seg_ptr and sel_ptr): as the plain build, 0 spill and no local memory (a pair the
    selection skips runs no chunk instead of returning early: the early return spilled 8 bytes), the same wgmma
    shapes and shared memory."""
    rep = inspect_kernel(kernels()[GF_WARM])
    plain = inspect_kernel(kernels()[GF_PLAIN])
    assert not rep.missing, rep.missing
    assert rep.spill_bytes == 0 and rep.families["STL"] == 0 and rep.families["LDL"] == 0, (rep.spill_bytes, rep.sass)
    assert rep.num_warps == 16 and rep.smem == plain.smem
    assert {k: v for k, v in rep.sass.items() if k.startswith("HGMMA")} == \
        {k: v for k, v in plain.sass.items() if k.startswith("HGMMA")}


@needs_gluon
def test_gf_segment_launch_matches_aot_signature():
    """fused_gf_launch with segment words and the per-sequence selection mangles to the warm build's signature; one
    CTA per (segment, value head); a selection of the wrong shape is refused."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_gf_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import fused_gf_launch
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    plan, bufs = _buffers(1, 4096, 16, 32)
    splan = segment_plan(1, 4096, 4, 16, "cpu")
    seg = torch.zeros(4, 32, dtype=torch.int32)
    sel = torch.zeros(1, 32, dtype=torch.int32)
    kernel, grid, args, kwargs = fused_gf_launch(*bufs, splan, 128 ** -0.5, select=sel, seg=seg)
    sig = fused_gf_signature("bf16", select=True, warm=True)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (4 * 32,)
    with pytest.raises(ValueError, match="with segment words it is"):
        fused_gf_launch(*bufs, splan, 128 ** -0.5, select=torch.zeros(4 * 32, dtype=torch.int32), seg=seg)


def test_gf_segment_plan():
    """One wave of CTAs (B * HV * S <= SMs), no segment under GF_SEG_MIN_CHUNKS chunks, none empty; no split where
    fewer than two segments result."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import GF_SEG_MIN_CHUNKS, gf_segment_plan
    assert GF_SEG_MIN_CHUNKS == 16
    assert gf_segment_plan(1, 65536, 32, 132) == (4, 256)
    assert gf_segment_plan(1, 8192, 32, 132) == (4, 32)
    assert gf_segment_plan(2, 32768, 32, 132) == (2, 256)
    assert gf_segment_plan(1, 65536, 8, 132) == (16, 64)
    assert gf_segment_plan(1, 8192, 8, 132) == (8, 16)
    assert gf_segment_plan(1, 2048 + 64, 32, 132) == (2, 17)          # 33 chunks: 17 + 16
    assert gf_segment_plan(1, 2047, 32, 132) == (2, 16)               # 32 chunks (the last one short)
    assert gf_segment_plan(1, 70000, 4, 132) == (33, 34)              # 1094 chunks, 33 segments: 132 CTAs
    for B, T, HV in ((1, 65536, 32), (2, 32768, 32), (1, 8192, 8), (3, 5000, 16), (1, 70000, 4)):
        S, L = gf_segment_plan(B, T, HV, 132)
        nch = -(-T // 64)
        assert S >= 2 and B * HV * S <= 132 and L >= GF_SEG_MIN_CHUNKS and (S - 1) * L < nch <= S * L, (B, T, HV)
    for B, T, HV in ((4, 65536, 32), (8, 4096, 32), (1, 1984, 32), (1, 1, 32), (3, 65536, 32)):
        assert gf_segment_plan(B, T, HV, 132) == (1, -(-T // 64)), (B, T, HV)


def test_gf_segments_wanted():
    """gf_segment_plan's split where the call is captured into a CUDA graph or has at least GF_SEG_MIN_EAGER_TOKENS
    tokens (the eager host-time floor); a varlen call never. Off a GPU the plan assumes 132 SMs."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf as gfm
    assert gfm.GF_SEG_MIN_EAGER_TOKENS == 8192
    cu = torch.tensor([0, 65536])
    assert gfm.gf_segments_wanted(1, 65536, 32, None, "cpu") == (4, 256)
    assert gfm.gf_segments_wanted(1, 32768, 32, None, "cpu") == (4, 128)
    assert gfm.gf_segments_wanted(2, 16384, 32, None, "cpu") == (2, 128)
    assert gfm.gf_segments_wanted(1, 16384, 32, None, "cpu") == (4, 64)
    assert gfm.gf_segments_wanted(2, 8192, 32, None, "cpu") == (2, 64)
    assert gfm.gf_segments_wanted(1, 8192, 32, None, "cpu") == (4, 32)
    assert gfm.gf_segments_wanted(1, 4096, 32, None, "cpu") == (1, 64)                  # eager, too short
    assert gfm.gf_segments_wanted(1, 4096, 32, None, "cpu", capturing=True) == (4, 16)
    assert gfm.gf_segments_wanted(1, 16384, 32, None, "cpu", capturing=True) == (4, 64)
    assert gfm.gf_segments_wanted(1, 8192, 8, None, "cpu", capturing=True) == (8, 16)
    assert gfm.gf_segments_wanted(1, 65536, 32, cu, "cpu", capturing=True) == (1, 1024)
    assert gfm.gf_segments_wanted(8, 4096, 32, None, "cpu", capturing=True) == (1, 64)


def test_gf_prepare_capture_builds_the_segment_plan_once():
    """An eager call too short to segment builds the segment plan that a CUDA-graph capture of the same call will
    read (so the capture records none of its construction), once per (B, T, HV, device) while the plan cache keeps
    it; nothing where capture would not segment either (a full wave of sequence-heads)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf as gfm
    from linattn.ops.gated_delta_rule.triton import segment_start as ss
    dev = torch.device("cpu")
    gfm._PREPARED.clear()
    ss._SEG_PLANS.clear()
    gfm.gf_prepare_capture(1, 8192, 32, dev)
    S, L = gfm.gf_segments_wanted(1, 8192, 32, None, dev, capturing=True)
    assert (S, L) == (4, 32)
    key = (1, 8192, S, L, str(dev))
    assert list(ss._SEG_PLANS) == [key]
    plan = ss._SEG_PLANS[key]
    assert plan.N == S and plan.cu.tolist() == [0, 2048, 4096, 6144, 8192]
    gfm.gf_prepare_capture(1, 8192, 32, dev)                   # a repeat: the kept plan, not a new one
    assert ss._SEG_PLANS[key] is plan
    assert ss.segment_plan(1, 8192, S, L, dev) is plan        # what the captured call will take
    gfm.gf_prepare_capture(8, 4096, 32, dev)                   # capture would not segment: nothing built
    assert list(ss._SEG_PLANS) == [key]
    ss._SEG_PLANS.clear()                                      # the plan cache dropped it: built again
    gfm.gf_prepare_capture(1, 8192, 32, dev)
    assert list(ss._SEG_PLANS) == [key] and ss._SEG_PLANS[key] is not plan
    gfm._PREPARED.clear()


@needs_gluon
def test_fused_descriptors_from_templates_equal_fresh():
    """The fused launches' TMA descriptors through the host path's templates (host.fused_desc):
    field by field (type and value) those of TensorDescriptor.from_tensor, the base being this call's tensor; new
    tensors of the same signature copy the template (no template added) and take their own bases; another T adds one
    template per descriptor; with the host path's plan cache off every descriptor is built afresh
    and nothing is stored."""
    from linattn.ops.gated_delta_rule.gluon import host as fw
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import fused_gf_launch
    from linattn.ops.gated_delta_rule.gluon.host import host_path

    def fields(d):
        return {k: (type(v), v) for k, v in d.__dict__.items() if k != "base"}

    fw.clear_desc_templates()
    try:
        with host_path.options(plan_cache=False):
            plan, bufs = _buffers(2, 300, 16, 32)
            fresh = fused_gf_launch(*bufs, plan, 128 ** -0.5)[2][:4]
            assert len(fw._DESC_TEMPLATES) == 0
        with host_path.options(plan_cache=True):
            first = fused_gf_launch(*bufs, plan, 128 ** -0.5)[2][:4]
            n = len(fw._DESC_TEMPLATES)
            assert n == 3                       # q and k share one (same view and box), v, Tinv
            plan2, bufs2 = _buffers(2, 300, 16, 32)
            second = fused_gf_launch(*bufs2, plan2, 128 ** -0.5)[2][:4]
            assert len(fw._DESC_TEMPLATES) == n
            for a, b, c, t1, t2 in zip(fresh, first, second, (bufs[0], bufs[1], bufs[2], bufs[5]),
                                       (bufs2[0], bufs2[1], bufs2[2], bufs2[5])):
                assert type(a) is type(b) is type(c) and fields(a) == fields(b) == fields(c)
                assert a.base.data_ptr() == b.base.data_ptr() == t1.data_ptr() and c.base.data_ptr() == t2.data_ptr()
            plan3, bufs3 = _buffers(2, 301, 16, 32)
            fused_gf_launch(*bufs3, plan3, 128 ** -0.5)
            assert len(fw._DESC_TEMPLATES) == n + 3
    finally:
        fw.clear_desc_templates()


@needs_gluon
def test_fused_launches_through_the_stand_in_driver():
    """Child process (no TRITON_INTERPRET) under the stand-in sm_90 driver (python -m
    linattn.ops.gated_delta_rule.gluon.hostsim --check-fused): the gate-free kernel's plain and segment launches,
    the W/U kernel with a selection, stage 2a and the segment window kernel (host.launches) give the
    launcher the same kernel, grid and arguments with the host cache off, descriptor templates only and templates +
    handle; the handle path never enters the JIT; new tensors of the same signature reuse the kept kernel and the
    templates (nothing added) and reach the launcher with their own pointers, as the uncached path passes them
    (pointers of tensors the call allocates itself, stage 2a's outputs, compared as "alloc")."""
    from test_gluon_state_host import hostsim_child  # tests/ on sys.path
    res = hostsim_child("--check-fused", 900)
    from linattn.ops.gated_delta_rule.gluon.hostsim import FUSED_CASES
    assert set(res) == set(FUSED_CASES)
    for name, r in res.items():
        assert r["same"] and r["n_launches"] == 1, (name, r)
        assert r["jit_runs"] == {"jit": 1, "plan": 1, "plan+handle": 0}, (name, r)
        assert r["hit"] == dict(plans_added=0, templates_added=0, jit_runs=0, new_pointers=True,
                                same_as_uncached=True), (name, r)
