"""The gate-free BV=128 fused forward (stages 2b+3+4, gluon/chunk_fused_gf.py, benchmarks/GLUON_BV128.md; the gluon
forward's default since round 22 where gf_wanted holds) on a CPU host: its sm_90a builds, its launch arguments against the AOT signature, the
schedule model (chunk_fused_wu_ws.emulate_fused_wu_ws with gate_free: the state partition forms Vnew = Tinv diag(beta)
(V - diag(e^gam) K S) from the ring's tiles, no wu partition) against the fp64 recurrence, and the switch. The kernel
itself runs only on a GPU (benchmarks/gpu: the Gluon gate with the switch on)."""
import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernel_asm, kernels
from linattn.runtime.gluon_compat import gluon_status

from test_gluon_fused_wu import SMEM_LIMIT_SM90, _buffers, _inputs, op_against_triton_forward  # tests/ on sys.path

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
GF_NAMES = ["gdn_fwd_fused_gf_gluon_bf16_bv128", "gdn_fwd_fused_gf_gluon_fp16_bv128"]


@needs_gluon
@pytest.mark.parametrize("name", GF_NAMES)
def test_gf_build(name):
    """sm_90a: 12 warps (state and output warpgroups, the producer warp's padded warpgroup), 0 spill and no local
    memory (product 1 in column halves: OPT_LOG 22.5), shared memory in budget, the intended HGMMA / UTMALDG / SYNCS /
    WARPGROUP, and the products' wgmma shapes: 64x128 for q S, att vnew, Tinv x and K^T vnew (M = 128 as two 64-row
    halves), 64x64 for q k^T and the two column halves of K S."""
    rep = inspect_kernel(kernels()[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0 and rep.families["STL"] == 0 and rep.families["LDL"] == 0, (rep.spill_bytes, rep.sass)
    assert rep.num_warps == 12 and 0 < rep.smem <= SMEM_LIMIT_SM90, (rep.num_warps, rep.smem)
    mma = "HGMMA.{}.F32" + (".BF16" if "bf16" in name else "")      # fp16 operands: no suffix in the SASS name
    assert rep.sass.get(mma.format("64x128x16"), 0) == 24 and rep.sass.get(mma.format("64x64x16"), 0) == 32, rep.sass
    assert rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0


@needs_gluon
@pytest.mark.parametrize("B,T,lens,states", [(8, 512, None, True), (1, 3000, [1, 63, 65, 1000, 1871], False)])
def test_gf_launch_matches_aot_signature(B, T, lens, states):
    """fused_gf_launch's arguments mangle to the AOT signature; one CTA per (sequence, value head); v's box [64, 128];
    the default config (round 24): two state partitions, KS_PIPE on the plain launch."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_gf_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_GATE_AT, GF_NPUB, GF_RELEASE_FENCE, GF_STAGES,
                                                                   GF_STATE2_OUTPUT_REGS, GF_STATE2_STATE_REGS,
                                                                   PRODUCER_REGS, fused_gf_launch)
    plan, bufs = _buffers(B, T, 16, 32, lens, states=states)
    kernel, grid, args, kwargs = fused_gf_launch(*bufs, plan, 128 ** -0.5)
    sig = fused_gf_signature("bf16", states)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (plan.N * 32,)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, BV=128, STAGES=GF_STAGES, NPUB=GF_NPUB, USE_H0=states,
                          STORE_HT=states, OUTPUT_REGS=GF_STATE2_OUTPUT_REGS, PRODUCER_REGS=PRODUCER_REGS,
                          OUT_PIPE=True, SPLIT=2, KS_PIPE=True, STATE_WGS=2, STATE_REGS=GF_STATE2_STATE_REGS,
                          GATE_AT=GF_GATE_AT, STATE_T=False, RELEASE_FENCE=GF_RELEASE_FENCE, num_warps=4)
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
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (chunk_gated_delta_rule_fwd_fused_wu,
                                                                      emulate_fused_wu_ws)
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x, cu = _inputs(B, T, lens, dtype, h0, H, HV, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    res = {}
    for gf in (False, True):
        def fused(q, k, v, beta, gcum, tinv, o, h0_, fin, plan, sc):
            emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0_, fin, plan, sc, BV=128 if gf else 32,
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
    """The default's rule (round 22, H200): at least 15/16 of a wave of sequence-heads, N * HV * 16 >= 15 * SMs."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import gf_wanted
    assert gf_wanted(4, 32, 132) and gf_wanted(8, 32, 132) and gf_wanted(24, 32, 132) and gf_wanted(8, 64, 132)
    assert not gf_wanted(2, 32, 132) and not gf_wanted(1, 32, 132) and not gf_wanted(8, 8, 132)
    assert gf_wanted(1, 124, 132) and not gf_wanted(1, 123, 132)


def test_gf_switch(device, monkeypatch):
    """LINATTN_GDN_GLUON_GF128 unset (the default: gf_wanted, which every call meets on a 2-SM CPU host) or "1": the op
    linattn::chunk_gdn_fwd_gluon runs its fused pass through chunk_fused_gf_gluon (a model stand-in here), o and final
    as the Triton forward's; "0", or "1" with LINATTN_GDN_GLUON_SEGMENTS=1 (the W/U kernel's opt-in segment-parallel
    forward, which keeps the W/U kernel for this varlen call), never."""
    if device != "cpu":
        pytest.skip("CPU stand-in check")
    from linattn.ops.gated_delta_rule.gluon import backend  # noqa: F401  (registers the op)
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf, chunk_fused_wu_ws
    from linattn.runtime.device import device_facts
    from linattn.runtime.settings import settings
    from linattn.testing import rel_rms
    gf_calls, wu_calls = [], []

    def gf_stand_in(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, select=None, seg=None):
        gf_calls.append(plan)
        chunk_fused_wu_ws.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=128, stages=2,
                                              npub=1, out_pipe=True, gate_free=True)

    def wu_stand_in(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, select=None, seg=None):
        wu_calls.append(plan)
        chunk_fused_wu_ws.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=64, stages=2)
    monkeypatch.setattr(chunk_fused_gf, "chunk_fused_gf_gluon", gf_stand_in)
    monkeypatch.setattr(chunk_fused_wu_ws, "chunk_fused_wu_ws_gluon", wu_stand_in)
    monkeypatch.delenv("LINATTN_GDN_GLUON_FUSED_WU", raising=False)
    monkeypatch.delenv("LINATTN_GDN_GLUON_SEGMENTS", raising=False)
    assert chunk_fused_gf.gf_wanted(3, 2, device_facts("cpu").num_sms)       # the unset case below takes it
    for switch, segments, want in (("1", None, "gf"), (None, None, "gf"), ("0", None, "wu"), ("1", "1", "wu")):
        for var, val in (("LINATTN_GDN_GLUON_GF128", switch), ("LINATTN_GDN_GLUON_SEGMENTS", segments)):
            if val is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, val)
        assert settings.gdn_gluon_gf128 == {"1": "on", "0": "off", None: "auto"}[switch]
        gf_calls.clear()
        wu_calls.clear()
        o, final, ref = op_against_triton_forward(seed=7)
        assert (len(gf_calls), len(wu_calls)) == ((1, 0) if want == "gf" else (0, 1)), (switch, segments)
        assert rel_rms(o, ref.o) < 3e-3 and rel_rms(final, ref.final_state) < 3e-3


def test_gf_refuses_a_selection_without_segment_words():
    """The gate-free kernel reads a selection only with segment words (its segment launch); the unsegmented pairs of
    the segment-parallel forward run on the W/U kernel."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import chunk_fused_gf_gluon, gf_supported
    with pytest.raises(ValueError, match="only with segment words"):
        chunk_fused_gf_gluon(*([None] * 11), select=torch.zeros(2, dtype=torch.int32))
    assert gf_supported(torch.empty(1, 1, 1, 128), torch.empty(1, 1, 2, 128))[0]
    ok, why = gf_supported(torch.empty(1, 1, 1, 128), torch.empty(1, 1, 2, 64))
    assert not ok and "V=64" in why


GF_WARM = "gdn_fwd_fused_gf_gluon_bf16_bv128_warm"


@needs_gluon
def test_gf_segment_build():
    """The segment launch's build (seg_ptr and sel_ptr): as the plain build, 0 spill and no local memory (a pair the
    selection skips runs no chunk instead of returning early: the early return spilled 8 bytes), the same wgmma
    shapes and shared memory."""
    rep = inspect_kernel(kernels()[GF_WARM])
    plain = inspect_kernel(kernels()[GF_NAMES[0]])
    assert not rep.missing, rep.missing
    assert rep.spill_bytes == 0 and rep.families["STL"] == 0 and rep.families["LDL"] == 0, (rep.spill_bytes, rep.sass)
    assert rep.num_warps == 12 and rep.smem == plain.smem
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


def test_gf_segments_switch(device, monkeypatch):
    """LINATTN_GDN_GLUON_GF_SEGMENTS "1": a fixed-length call whose segment plan splits runs the segment launch on the
    gate-free kernel (seg and select given: model stand-in) and the unsegmented pairs' launch on the W/U kernel
    (select only), o and final within TOL of the fp64 recurrence; unset (GF_SEGMENTS_AUTO off), "0", a varlen call, or
    LINATTN_GDN_GLUON_SEGMENTS=1 (the W/U kernel's own segments): no gate-free segment launch. The plan's minimum
    segment length is lowered to 2 chunks so that a CPU-sized sequence splits (B1 T260: 2 segments of 3 chunks)."""
    if device != "cpu":
        pytest.skip("CPU stand-in check")
    from linattn.ops.gated_delta_rule.gluon import backend  # noqa: F401  (registers the op)
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf, chunk_fused_wu_ws
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.testing import TOL, rel_rms
    calls = []

    def gf_stand_in(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, select=None, seg=None):
        calls.append(("gf", select is not None, seg is not None))
        chunk_fused_wu_ws.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=128, stages=2,
                                              npub=1, out_pipe=True, gate_free=True, select=select, seg=seg)

    def wu_stand_in(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, config=None, select=None, seg=None):
        calls.append(("wu", select is not None, seg is not None))
        chunk_fused_wu_ws.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=64, stages=2,
                                              select=select, seg=seg)
    monkeypatch.setattr(chunk_fused_gf, "chunk_fused_gf_gluon", gf_stand_in)
    monkeypatch.setattr(chunk_fused_wu_ws, "chunk_fused_wu_ws_gluon", wu_stand_in)
    monkeypatch.setattr(chunk_fused_gf, "GF_SEG_MIN_CHUNKS", 2)
    for var in ("LINATTN_GDN_GLUON_FUSED_WU", "LINATTN_GDN_GLUON_GF128"):
        monkeypatch.delenv(var, raising=False)
    assert chunk_fused_gf.gf_segment_plan(1, 260, 2, 132) == (2, 3)
    x, _ = _inputs(1, 260, None, torch.bfloat16, True, seed=11)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True, None)
    xv, cu = _inputs(1, 150, [1, 80, 69], torch.bfloat16, True, seed=11)
    vargs = (xv["q"], xv["k"], xv["v"], xv["g"], xv["beta"], 128 ** -0.5, xv["initial_state"], True, cu)

    def fp64(a):
        return naive_recurrent(*(t.double() for t in a[:5]), scale=a[5], initial_state=a[6].double(),
                               output_final_state=True, cu_seqlens=a[8])
    refs = {False: fp64(args), True: fp64(vargs)}
    for switch, wu_segments, varlen, want in (("1", None, False, [("wu", True, False), ("gf", True, True)]),
                                              (None, None, False, [("gf", False, False)]),
                                              ("0", None, False, [("gf", False, False)]),
                                              ("1", None, True, [("gf", False, False)]),
                                              ("1", "1", False, [("wu", True, False), ("wu", True, True)])):
        for var, val in (("LINATTN_GDN_GLUON_GF_SEGMENTS", switch), ("LINATTN_GDN_GLUON_SEGMENTS", wu_segments)):
            if val is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, val)
        if wu_segments:       # the W/U kernel's segment plan: segments of 2 chunks (plan_segments: >= 4 of them)
            monkeypatch.setattr(chunk_fused_wu_ws, "segments_wanted", lambda *a: (3, 2))
        calls.clear()
        o, final = torch.ops.linattn.chunk_gdn_fwd_gluon(*(vargs if varlen else args), "wgmma")
        assert sorted(calls) == sorted(want), (switch, wu_segments, varlen, calls)
        o64, f64 = refs[varlen]
        tol = TOL[torch.bfloat16]
        assert torch.isfinite(o).all() and torch.isfinite(final).all()
        assert rel_rms(o, o64) < tol and rel_rms(final, f64) < tol, (switch, wu_segments, varlen)


def test_gf_segments_wanted(monkeypatch):
    """The switch and the default's rule: "1" wherever gf_segment_plan splits; "0", or a varlen call, never; unset,
    only where GF_SEGMENTS_AUTO holds and the call is captured into a CUDA graph or has at least
    GF_SEG_MIN_EAGER_TOKENS tokens (the eager host-time floor, round 23). Off a GPU the plan assumes 132 SMs."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf as gfm
    assert gfm.GF_SEG_MIN_EAGER_TOKENS == 32768
    cu = torch.tensor([0, 65536])
    monkeypatch.setenv("LINATTN_GDN_GLUON_GF_SEGMENTS", "1")
    assert gfm.gf_segments_wanted(1, 8192, 32, None, "cpu") == (4, 32)
    assert gfm.gf_segments_wanted(1, 65536, 32, None, "cpu") == (4, 256)
    assert gfm.gf_segments_wanted(1, 65536, 32, cu, "cpu") == (1, 1024)
    assert gfm.gf_segments_wanted(8, 4096, 32, None, "cpu") == (1, 64)
    monkeypatch.setenv("LINATTN_GDN_GLUON_GF_SEGMENTS", "0")
    assert gfm.gf_segments_wanted(1, 65536, 32, None, "cpu", capturing=True) == (1, 1024)
    monkeypatch.delenv("LINATTN_GDN_GLUON_GF_SEGMENTS")
    for auto in (False, True):
        monkeypatch.setattr(gfm, "GF_SEGMENTS_AUTO", auto)
        want = (lambda plan, nch: plan if auto else (1, nch))
        assert gfm.gf_segments_wanted(1, 65536, 32, None, "cpu") == want((4, 256), 1024)
        assert gfm.gf_segments_wanted(1, 32768, 32, None, "cpu") == want((4, 128), 512)
        assert gfm.gf_segments_wanted(2, 16384, 32, None, "cpu") == want((2, 128), 256)
        assert gfm.gf_segments_wanted(1, 16384, 32, None, "cpu") == (1, 256)                # eager, too short
        assert gfm.gf_segments_wanted(1, 16384, 32, None, "cpu", capturing=True) == want((4, 64), 256)
        assert gfm.gf_segments_wanted(1, 8192, 8, None, "cpu", capturing=True) == want((8, 16), 128)
        assert gfm.gf_segments_wanted(1, 65536, 32, cu, "cpu", capturing=True) == (1, 1024)
        assert gfm.gf_segments_wanted(8, 4096, 32, None, "cpu", capturing=True) == (1, 64)


@needs_gluon
def test_gf_ks_pipe_switch(monkeypatch):
    """LINATTN_GDN_GLUON_GF_KS_PIPE unset (the default since round 23): the plain launch passes KS_PIPE with the output
    warpgroup at 232 registers, the segment launch neither (0.989-1.001x there on the H200); "1" both, "0" neither
    (KS_PIPE=False at 240: the constexpr's default, the round-22 kernel). The registered KS_PIPE builds compile without
    spill (8 bytes at 240) and keep the plain build's wgmma shapes. One state partition (LINATTN_GDN_GLUON_GF_STATE2=0;
    test_gf_state2_builds_and_switch has the two-partition config)."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_KS_PIPE_OUTPUT_REGS, GF_OUTPUT_REGS,
                                                                   fused_gf_launch)
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    plan, bufs = _buffers(1, 4096, 16, 32)
    splan = segment_plan(1, 4096, 4, 16, "cpu")
    seg = dict(select=torch.zeros(1, 32, dtype=torch.int32), seg=torch.zeros(4, 32, dtype=torch.int32))
    monkeypatch.setenv("LINATTN_GDN_GLUON_GF_STATE2", "0")
    for switch, plain_on, seg_on in ((None, True, False), ("1", True, True), ("0", False, False)):
        if switch is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_GF_KS_PIPE", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_GF_KS_PIPE", switch)
        for kwargs, on in ((fused_gf_launch(*bufs, plan, 128 ** -0.5)[3], plain_on),
                           (fused_gf_launch(*bufs, splan, 128 ** -0.5, **seg)[3], seg_on)):
            assert kwargs["KS_PIPE"] is on, switch
            assert kwargs["OUTPUT_REGS"] == (GF_KS_PIPE_OUTPUT_REGS if on else GF_OUTPUT_REGS) and \
                GF_KS_PIPE_OUTPUT_REGS == 232
    for name in ("gdn_fwd_fused_gf_gluon_bf16_bv128_kspipe", "gdn_fwd_fused_gf_gluon_bf16_bv128_kspipe_warm"):
        rep = inspect_kernel(kernels()[name])
        assert rep.spill_bytes == 0 and rep.families["LDL"] == 0 and not rep.missing, (name, rep.spill_bytes)
        assert rep.sass.get("HGMMA.64x128x16.F32.BF16") == 24 and rep.sass.get("HGMMA.64x64x16.F32.BF16") == 32


@needs_gluon
def test_gf_state2_builds_and_switch(monkeypatch):
    """LINATTN_GDN_GLUON_GF_STATE2 unset or "1" (the default since round 24): the launch passes STATE_WGS=2 with the
    output at 176 and the worker state partition at 152 registers, SPLIT=2, KS_PIPE as its own switch decides (plain
    launch and, since round 24 part G, the segment launch too), and its arguments still mangle to the AOT signature;
    "0": STATE_WGS=1 (the round-23 kernel).
    The four registered state2 builds: 16 warps (two state warpgroups, output, the producer's padded warpgroup), 0 spill
    and no local memory, shared memory in budget, and each state partition's products at N = 64 (Tinv x, K^T d vnew as
    two m64 halves) and N = 32 (K S in two column quarters), the output's unchanged (q S, att vnew 64x128; q k^T
    64x64)."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_gf_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_STATE2_OUTPUT_REGS, GF_STATE2_STATE_REGS,
                                                                   fused_gf_launch)
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    monkeypatch.delenv("LINATTN_GDN_GLUON_GF_KS_PIPE", raising=False)
    plan, bufs = _buffers(1, 4096, 16, 32)
    splan = segment_plan(1, 4096, 4, 16, "cpu")
    seg = dict(select=torch.zeros(1, 32, dtype=torch.int32), seg=torch.zeros(4, 32, dtype=torch.int32))
    for switch, on in ((None, True), ("0", False), ("1", True)):
        if switch is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_GF_STATE2", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_GF_STATE2", switch)
        for launch, segments in ((fused_gf_launch(*bufs, plan, 128 ** -0.5), False),
                                 (fused_gf_launch(*bufs, splan, 128 ** -0.5, **seg), True)):
            kernel, grid, args, kwargs = launch
            assert kwargs["KS_PIPE"] is (on or not segments), switch      # one partition: the plain launch only
            if not on:
                assert kwargs["STATE_WGS"] == 1 and kwargs["STATE_REGS"] == 0, switch
                continue
            assert kwargs["STATE_WGS"] == 2 and kwargs["STATE_REGS"] == GF_STATE2_STATE_REGS == 152
            assert kwargs["OUTPUT_REGS"] == GF_STATE2_OUTPUT_REGS == 176 and kwargs["SPLIT"] == 2
            assert kwargs["num_warps"] == 4 and grid[0] == (splan.N * 32 if segments else plan.N * 32)
            sig = fused_gf_signature("bf16", select=segments, warm=segments)
            assert len(args) == len(sig)
            for (name, want), arg in zip(sig.items(), args):
                assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
            names = list(kernel.arg_names)
            assert sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")
    for suffix in ("", "_kspipe", "_warm", "_kspipe_warm"):
        name = "gdn_fwd_fused_gf_gluon_bf16_bv128_state2" + suffix
        rep = inspect_kernel(kernels()[name])
        assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
        assert rep.spill_bytes == 0 and rep.families["STL"] == 0 and rep.families["LDL"] == 0, (name, rep.spill_bytes)
        assert rep.num_warps == 16 and 0 < rep.smem <= SMEM_LIMIT_SM90, (name, rep.num_warps, rep.smem)
        assert rep.sass.get("HGMMA.64x128x16.F32.BF16") == 12 and rep.sass.get("HGMMA.64x64x16.F32.BF16") == 40 \
            and rep.sass.get("HGMMA.64x32x16.F32.BF16") == 32, (name, rep.sass)
        # the wgmmas are not serialised (ptxas C7514, which the output's loop-carried in-flight q k^T caused here
        # before QK_DONE): only the last HGMMA of each of the 12 wgmma groups (4 per state partition, 4 in the
        # output) waits on its scoreboard
        sass = kernel_asm(name, "sass")
        hgmma = [line for line in sass.splitlines() if "HGMMA." in line]
        assert len(hgmma) == 84 and sum("gsb0" in line for line in hgmma) == 12, (name, len(hgmma))


@needs_gluon
def test_fused_descriptors_from_templates_equal_fresh():
    """The fused launches' TMA descriptors through the host path's templates (chunk_fused_wu_ws._fused_desc, round 24):
    field by field (type and value) those of TensorDescriptor.from_tensor, the base being this call's tensor; new
    tensors of the same signature copy the template (no template added) and take their own bases; another T adds one
    template per descriptor; with the host cache off (LINATTN_GLUON_HOST_CACHE=0) every descriptor is built afresh
    and nothing is stored."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import fused_gf_launch
    from linattn.ops.gated_delta_rule.gluon.launcher import host_path

    def fields(d):
        return {k: (type(v), v) for k, v in d.__dict__.items() if k != "base"}

    fw.clear_desc_templates()
    try:
        with host_path.options(plan_cache=False):
            plan, bufs = _buffers(2, 300, 16, 32)
            fresh = fused_gf_launch(*bufs, plan, 128 ** -0.5)[2][:4]
            assert fw._DESC_TEMPLATES is None or len(fw._DESC_TEMPLATES) == 0
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
    the W/U kernel with a selection, stage 2a and the segment window kernel (launcher.launches, round 24) give the
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


def _state_fence_gaps(name):
    """Per state partition of a state2 build: the gate loads (32-bit LDG) before its first fence_async_shared
    (MEMBAR), between the first and second, and between the second and third. The SASS is read as a sequence of
    markers; a state partition is a run between two setmaxnreg instructions holding four MEMBARs and >= 10 LDGs (5
    gate loads before the loop, 5 in it: gam, beta of two rows per thread and gam at the chunk's last row)."""
    import re
    seq = []
    for line in kernel_asm(name, "sass").splitlines():
        if "USETMAXREG" in line:
            seq.append("|")
        elif "MEMBAR" in line:
            seq.append("M")
        elif re.search(r"LDG\.E ", line):
            seq.append("L")
    gaps = []
    for part in "".join(seq).split("|"):
        if part.count("M") == 4 and part.count("L") >= 10:
            pieces = part.split("M")
            gaps.append(tuple(p.count("L") for p in pieces[:3]))
    return gaps


@needs_gluon
def test_gf_gate_at_builds_and_switch(monkeypatch):
    """GATE_AT moves only the next chunk's gate loads (round 28: each fence_async_shared waits for the loads in
    flight, and GATE_AT = 0 issued them right before S's publication fence). Both state partitions of the default
    build (two partitions, KS_PIPE, plain and segment launch) issue the 5 loop loads before the first fence (with the
    prologue's 5), GATE_AT = 1 between the first (S's publication) and the second (x's), GATE_AT = 2 between the
    second and the third; the same instruction count within 1%, 0 spill. LINATTN_GDN_GLUON_GF_GATE_AT "0" / "1" /
    "2" sets the launch's GATE_AT, anything else leaves chunk_fused_gf.GF_GATE_AT."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import GF_GATE_AT, fused_gf_launch
    want = {0: (10, 0, 0), 1: (5, 5, 0), 2: (5, 0, 5)}
    for warm in ("", "_warm"):
        base = "gdn_fwd_fused_gf_gluon_bf16_bv128_state2_kspipe"
        n0 = inspect_kernel(kernels()[base + warm]).instructions
        for at in (0, 1, 2):
            name = base + (f"_gate{at}" if at else "") + warm
            assert _state_fence_gaps(name) == [want[at]] * 2, (name, _state_fence_gaps(name))
            rep = inspect_kernel(kernels()[name])
            assert rep.spill_bytes == 0 and rep.families["LDL"] == 0 and not rep.missing, (name, rep.spill_bytes)
            assert abs(rep.instructions - n0) <= 0.01 * n0, (name, rep.instructions, n0)
    plan, bufs = _buffers(8, 512, 16, 32)
    for value, at in (("0", 0), ("1", 1), ("2", 2), ("3", GF_GATE_AT), (None, GF_GATE_AT)):
        if value is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_GF_GATE_AT", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_GF_GATE_AT", value)
        assert fused_gf_launch(*bufs, plan, 128 ** -0.5)[3]["GATE_AT"] == at, value


@needs_gluon
def test_gf_release_fence_builds_and_switch(monkeypatch):
    """RELEASE_FENCE = False drops exactly one fence_async_shared per state partition (the one before the ring slot's
    release; the fence after d * vnew's store still follows the chunk's generic loads of the v tile): four MEMBARs per
    state partition become three, the rest of the SASS within 1%, 0 spill. LINATTN_GDN_GLUON_GF_RELEASE_FENCE "0" /
    "1" sets the launch's RELEASE_FENCE, unset leaves chunk_fused_gf.GF_RELEASE_FENCE."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import GF_RELEASE_FENCE, fused_gf_launch
    for warm in ("", "_warm"):
        base = "gdn_fwd_fused_gf_gluon_bf16_bv128_state2_kspipe"
        with_fence = kernel_asm(base + warm, "sass").count("MEMBAR")
        without = kernel_asm(base + "_nofence" + warm, "sass").count("MEMBAR")
        assert with_fence - without == 2, (warm, with_fence, without)
        rep, rep0 = inspect_kernel(kernels()[base + "_nofence" + warm]), inspect_kernel(kernels()[base + warm])
        assert rep.spill_bytes == 0 and rep.families["LDL"] == 0 and not rep.missing
        assert abs(rep.instructions - rep0.instructions) <= 0.01 * rep0.instructions
    plan, bufs = _buffers(8, 512, 16, 32)
    for value, want in (("0", False), ("1", True), (None, GF_RELEASE_FENCE)):
        if value is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_GF_RELEASE_FENCE", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_GF_RELEASE_FENCE", value)
        assert fused_gf_launch(*bufs, plan, 128 ** -0.5)[3]["RELEASE_FENCE"] is want, value


@needs_gluon
def test_gf_state_t_builds_and_switch(monkeypatch):
    """LINATTN_GDN_GLUON_GF_STATE_T=1 (opt-in, round 28): the launch passes STATE_T with the output at 168 and the
    worker state partition at 160 registers, and its arguments mangle to the AOT signature (plain and segment
    launch); unset: STATE_T off with the state2 registers. The two STATE_T builds: 16 warps, shared memory in budget
    (no vn_s: less than the state2 build's), spill within the registered known bytes, the v tile read transposed by
    ldmatrix (LDSM.16.MT88), and the wgmmas not serialised: only the last HGMMA of each of the 20 wgmma groups (8 per
    state partition: ks^T in two halves, vnew^T as two halves of two, the S update in two; 4 in the output) waits."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_gf_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_STATE2_STATE_REGS, GF_STATE_T_OUTPUT_REGS,
                                                                   GF_STATE_T_STATE_REGS, fused_gf_launch)
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    plan, bufs = _buffers(1, 4096, 16, 32)
    splan = segment_plan(1, 4096, 4, 16, "cpu")
    seg = dict(select=torch.zeros(1, 32, dtype=torch.int32), seg=torch.zeros(4, 32, dtype=torch.int32))
    for switch in (None, "1"):
        if switch is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_GF_STATE_T", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_GF_STATE_T", switch)
        for launch, segments in ((fused_gf_launch(*bufs, plan, 128 ** -0.5), False),
                                 (fused_gf_launch(*bufs, splan, 128 ** -0.5, **seg), True)):
            kernel, grid, args, kwargs = launch
            if switch is None:
                assert kwargs["STATE_T"] is False and kwargs["STATE_REGS"] == GF_STATE2_STATE_REGS
                continue
            assert kwargs["STATE_T"] is True and kwargs["STATE_WGS"] == 2
            assert kwargs["OUTPUT_REGS"] == GF_STATE_T_OUTPUT_REGS == 168
            assert kwargs["STATE_REGS"] == GF_STATE_T_STATE_REGS == 160
            sig = fused_gf_signature("bf16", select=segments, warm=segments)
            assert len(args) == len(sig)
            for (name, want), arg in zip(sig.items(), args):
                assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    base = inspect_kernel(kernels()["gdn_fwd_fused_gf_gluon_bf16_bv128_state2_kspipe"])
    for suffix in ("", "_warm"):
        name = "gdn_fwd_fused_gf_gluon_bf16_bv128_state2t" + suffix
        spec = kernels()[name]
        rep = inspect_kernel(spec)
        assert not rep.missing and rep.num_warps == 16, (name, rep.missing)
        assert 0 < rep.smem < base.smem <= SMEM_LIMIT_SM90, (name, rep.smem, base.smem)
        assert rep.spill_bytes <= spec.known_spill_bytes, (name, rep.spill_bytes, spec.known_spill_bytes)
        sass = kernel_asm(name, "sass")
        hgmma = [line for line in sass.splitlines() if "HGMMA." in line]
        assert len(hgmma) == 84 and sum("gsb0" in line for line in hgmma) == 20, (name, len(hgmma))
        assert "LDSM.16.MT88" in sass, name
