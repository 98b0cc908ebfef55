"""The segment-parallel fused-wu forward (opt-in LINATTN_GDN_GLUON_SEGMENTS=1), on a CPU under TRITON_INTERPRET=1:

1. triton/segment_start.py's start states against the exact state at each segment start (the Triton forward's final
   state on the sequence prefix ending there): equal to rounding without truncation (windows reaching the sequence
   start), within the e^-thresh bound on steep gates (short windows), and flagged where the decay is too slow for a
   window of at most max_window chunks within the previous segment;
2. the whole forward with segments (kkt_solve, the start states, the fused kernel's schedule model on the segment
   plan for the heads never flagged, on the sequence plan for the others) against the fp64 recurrence and against
   the same forward without segments (bit-equal on the unsegmented heads);
3. when the switch takes segments (fixed-length, normalised keys, a batch too small to fill the GPU at BV = 64) and
   when it does not.
"""
import pytest
import torch

from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
from linattn.ops.gated_delta_rule.triton import segment_start as ss
from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.settings import settings
from linattn.testing import TOL, make_gdn_inputs, rel_rms

pytestmark = pytest.mark.skipif(not settings.interpret, reason="CPU tensors under TRITON_INTERPRET=1")


def _inputs(B, T, H, HV, seed, steep=False, h0=True, dtype=torch.bfloat16):
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, initial_state=h0,
                        generator=torch.Generator().manual_seed(seed))
    if steep:                                   # ~-20 of log decay per chunk: warm-up windows of one or two chunks
        x["g"] = x["g"] * 0 - 0.32
    return x


def _start_states(x, S, L, thresh):
    B, T = x["q"].shape[:2]
    HV = x["v"].shape[2]
    plan = make_chunk_plan(B, T, None, 64, "cpu")
    gcum, tinv = fw.kkt_solve(x["k"], x["g"], x["beta"], plan, HV)
    with poisoned_allocations():
        return ss.segment_start_states(x["k"], x["v"], x["beta"], x["g"], gcum, tinv, x["initial_state"], plan, S,
                                       L, dot_prec="tf32", thresh=thresh)


def _exact_start(x, n, c0):
    """The state at chunk c0 of sequence n: the Triton forward's final state on the prefix (the initial state at 0)."""
    if c0 == 0:
        h0 = x["initial_state"]
        return torch.zeros(x["v"].shape[2], 128, 128) if h0 is None else h0[n].float()
    pre = {k: (t[n:n + 1, :c0 * 64].contiguous() if k != "initial_state" else
               (None if t is None else t[n:n + 1].contiguous())) for k, t in x.items()}
    res = chunk_gated_delta_rule_fwd(pre["q"], pre["k"], pre["v"], pre["g"], pre["beta"], 128 ** -0.5,
                                     pre["initial_state"], True, None)
    return res.final_state[0]


@pytest.mark.parametrize("B,T,S,L,h0", [(1, 450, 3, 3, True), (2, 260, 2, 3, False), (1, 64 * 12, 4, 3, True)])
def test_start_states_exact_without_truncation(B, T, S, L, h0):
    """thresh = inf, nothing truncated: segments 0 and 1 walk back to chunk 0 and start from the initial state (the
    same W / U rounding points and state update as the Triton forward's: bit-equal under the interpreter over 12
    seeds; 1e-6 allowed), unflagged. Later ones would need a window beyond the previous segment: flagged, for every
    head, their start states not written."""
    x = _inputs(B, T, 1, 2, seed=int(torch.randint(0, 2 ** 31 - 1, ())), h0=h0)
    hseg, flag = _start_states(x, S, L, float("inf"))
    assert hseg.shape == (B * S, 2, 128, 128) and flag.shape == (B * S, 2) and flag.dtype == torch.int32
    for n in range(B):
        for s in range(S):
            if s < 2:
                want = _exact_start(x, n, min(s * L, -(-T // 64)))
                assert flag[n * S + s].tolist() == [0, 0]
                assert rel_rms(hseg[n * S + s], want) < 1e-6, (n, s, rel_rms(hseg[n * S + s], want))
            else:
                assert flag[n * S + s].tolist() == [1, 1], (n, s)


def test_start_states_truncated_within_the_bound_on_steep_gates():
    """thresh = 20 with ~-20 of log decay per chunk: each window is about one chunk, far from the sequence start, and
    the start state differs from the exact one by <= e^-20 of the state (the contraction bound, normalised keys;
    3e-9 in a CPU run; 1e-7 allowed), while a window of 0 chunks (thresh 0: starting from 0 at the segment) is off by
    the whole state; segment 0 is the initial state itself."""
    x = _inputs(1, 64 * 9, 1, 2, seed=int(torch.randint(0, 2 ** 31 - 1, ())), steep=True)
    hseg, flag = _start_states(x, 3, 3, 20.0)
    assert torch.equal(hseg[0], x["initial_state"][0]) and not flag.any()
    for s in (1, 2):
        assert rel_rms(hseg[s], _exact_start(x, 0, 3 * s)) < 1e-7
    assert rel_rms(_start_states(x, 3, 3, 0.0)[0][2], _exact_start(x, 0, 6)) > 0.5


@pytest.mark.parametrize("decay", ["slow", "none", "mixed"])
def test_flags_where_the_decay_is_slow(decay):
    """g x 0.01, g = 0, or head 0 steep and head 1 without decay, 4 segments of 3 chunks: a window of at most the
    previous segment reaches the sequence start from segment 1 (exact, unflagged), not from segments 2 and 3, which
    are flagged on the slow heads; with max_window = 2 segment 1 is flagged there too (its window may not reach
    chunk 0). A steep head is never flagged, and its start states are exact to the e^-20 bound."""
    x = _inputs(1, 64 * 12, 1, 2, seed=int(torch.randint(0, 2 ** 31 - 1, ())))
    if decay == "slow":
        x["g"] = x["g"] * 0.01
    elif decay == "none":
        x["g"] = x["g"] * 0
    else:
        x["g"][..., 0] = -0.32
        x["g"][..., 1] = 0.
    slow_heads = [0, 1] if decay != "mixed" else [1]
    want = [[0, 0]] * 4
    for s in (2, 3):
        want[s] = [int(h in slow_heads) for h in range(2)]
    hseg, flag = _start_states(x, 4, 3, 20.0)
    assert flag.tolist() == want
    assert rel_rms(hseg[1], _exact_start(x, 0, 3)) < 1e-6
    if decay == "mixed":
        for s in (2, 3):
            assert rel_rms(hseg[s, 0], _exact_start(x, 0, 3 * s)[0]) < 1e-7
    plan = make_chunk_plan(1, 64 * 12, None, 64, "cpu")
    gcum, tinv = fw.kkt_solve(x["k"], x["g"], x["beta"], plan, 2)
    _, flag2 = ss.segment_start_states(x["k"], x["v"], x["beta"], x["g"], gcum, tinv, x["initial_state"], plan, 4,
                                       3, dot_prec="tf32", thresh=20.0, max_window=2)
    want[1] = [int(h in slow_heads) for h in range(2)]
    assert flag2.tolist() == want


def _forward(x, segments, seed):
    def fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, select=None, seg=None):
        fw.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, BV=64, stages=2,
                               seed=seed, areg=True, select=select, seg=seg)
    with poisoned_allocations():
        return fw.chunk_gated_delta_rule_fwd_fused_wu(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5,
                                                      x["initial_state"], True, None, fused_pass=fused,
                                                      segments=segments)


def _segmented_and_plain(x, S, L, seed):
    """The forward with S segments of L chunks and without (the schedule model, same seed): both results, the
    segmented one checked finite and within TOL of the fp64 recurrence (o and the final state)."""
    res = _forward(x, (S, L), seed)
    ref = _forward(x, None, seed)
    o64, f64 = naive_recurrent(*(x[k].double() for k in ("q", "k", "v", "g", "beta")), scale=128 ** -0.5,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True)
    assert torch.isfinite(res.o).all() and torch.isfinite(res.final_state).all()
    assert rel_rms(res.o, o64) < TOL[torch.bfloat16] and rel_rms(res.final_state, f64) < TOL[torch.bfloat16]
    return res, ref


@pytest.mark.parametrize("B,T,S,L,h0,decay", [(1, 700, 4, 3, True, "fast"), (2, 390, 2, 4, False, "fast"),
                                               (1, 700, 4, 3, True, "slow"), (2, 700, 4, 3, True, "mixed")])
def test_forward_with_segments_matches_fp64(monkeypatch, B, T, S, L, h0, decay):
    """LINATTN_GDN_GLUON_SEGMENT_WARM=0: kkt_solve, the start states, the fused kernel's schedule model on the segment
    plan for the heads never flagged and on the sequence plan for the others (T not a multiple of 64: a short last
    segment; B2; with and without h0; slow decay, where every head runs unsegmented; mixed, head 0 segmented and head
    1 not): o and the final state within TOL of the fp64 recurrence; the unsegmented heads bit-equal to the forward
    without segments (the same computation); the segmented ones within 3e-3 of it: the truncation costs e^-20, but
    the start states carry the Triton recurrence's rounding (decay on k) where the fused chain rounds its own way
    (decay on vnew): o 9e-4 apart in a CPU run.
    """
    monkeypatch.setenv("LINATTN_GDN_GLUON_SEGMENT_WARM", "0")
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x = _inputs(B, T, 1, 2, seed=seed, h0=h0)
    if decay == "slow":                         # g x 0.01: segments 2 and 3 flagged on both heads
        x["g"] = x["g"] * 0.01
    elif decay == "mixed":                      # head 1 without decay: flagged; head 0 as generated
        x["g"][..., 1] = 0.
    res, ref = _segmented_and_plain(x, S, L, seed)
    unseg = {"fast": [], "slow": [0, 1], "mixed": [1]}[decay]
    for hv in range(2):
        if hv in unseg:
            assert torch.equal(res.o[:, :, hv], ref.o[:, :, hv]), hv
            assert torch.equal(res.final_state[:, hv], ref.final_state[:, hv]), hv
        else:
            assert rel_rms(res.o[:, :, hv], ref.o[:, :, hv]) < 3e-3, hv
            assert rel_rms(res.final_state[:, hv], ref.final_state[:, hv]) < 3e-3, hv
    assert res.final_state.shape == (B, 2, 128, 128)


def test_switch(monkeypatch):
    """LINATTN_GDN_GLUON_SEGMENTS=1 takes segments for a fixed-length batch whose sequence-heads leave the GPU short
    at BV = 64 (B1 HV32 T65536 on 132 SMs: 16 segments of 64 chunks); not without the switch, not for varlen, not at
    B8 (512 CTAs at BV = 64), not for a sequence of < 4 segments. Nothing about the inputs: the window kernels
    check their bound themselves (test_flags_where_a_transition_is_not_a_contraction). Within segments the warm-up
    runs in the fused kernel unless LINATTN_GDN_GLUON_SEGMENT_WARM=0."""
    monkeypatch.delenv("LINATTN_GDN_GLUON_SEGMENTS", raising=False)
    monkeypatch.delenv("LINATTN_GDN_GLUON_SEGMENT_WARM", raising=False)
    assert settings.gdn_gluon_segment_warm          # within segments, the in-kernel warm-up by default (round 19)
    monkeypatch.setenv("LINATTN_GDN_GLUON_SEGMENT_WARM", "0")
    assert not settings.gdn_gluon_segment_warm
    assert fw.segments_wanted(1, 65536, 32, 128, None, "cpu") == (1, 1024)
    monkeypatch.setenv("LINATTN_GDN_GLUON_SEGMENTS", "1")
    assert fw.segments_wanted(1, 65536, 32, 128, None, "cpu") == (16, 64)
    assert fw.segments_wanted(1, 65536, 32, 128, torch.tensor([0, 65536]), "cpu")[0] == 1
    assert fw.segments_wanted(8, 4096, 32, 128, None, "cpu")[0] == 1
    assert fw.segments_wanted(1, 64 * 64, 32, 128, None, "cpu")[0] == 1
    assert fw.segments_wanted(1, 8192, 32, 128, None, "cpu")[0] == 1          # 2 segments lost (round 18)
    assert fw.segments_wanted(1, 16384, 32, 128, None, "cpu") == (4, 64)


def test_flags_where_a_transition_is_not_a_contraction():
    """Steep gates (windows of one chunk, truncated), keys of norm 1.5, beta in [0, 1) with 1 on each chunk's last
    token: there beta ||k||^2 = 2.25 > 2, so the truncation bound does not hold and every truncated segment is
    flagged; segment 0 (the initial state) is not. With the keys back at norm 1 nothing is flagged. The forward then
    runs every head unsegmented: o and the final state equal to the forward without segments."""
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x = _inputs(1, 64 * 9, 1, 2, seed=seed, steep=True)
    x["k"] = (x["k"].float() * 1.5).to(torch.bfloat16)
    x["beta"] = torch.rand(x["beta"].shape, generator=torch.Generator().manual_seed(seed))
    x["beta"][:, 63::64] = 1.
    hseg, flag = _start_states(x, 3, 3, 20.0)
    assert flag.tolist() == [[0, 0], [1, 1], [1, 1]]
    x_ok = dict(x, k=(x["k"].float() / 1.5).to(torch.bfloat16))       # norm 1 again: nothing flagged
    assert not _start_states(x_ok, 3, 3, 20.0)[1].any()
    res, ref = _forward(x, (3, 3), seed), _forward(x, None, seed)
    assert torch.equal(res.o, ref.o) and torch.equal(res.final_state, ref.final_state)


def test_segment_plan():
    """Segments as sequences: chunk-aligned starts, each sequence's last segment ending with it, sequence-major."""
    plan = ss.segment_plan(2, 700, 4, 3, "cpu")
    assert plan.N == 8 and plan.T_total == 1400
    assert plan.cu.tolist() == [0, 192, 384, 576, 700, 892, 1084, 1276, 1400]


def test_launch_matches_aot_signature(monkeypatch):
    """segment_start_states' arguments mangle to the registered sm_90a build's signature (its compile and spill are
    checked by test_aot_gluon.py over the whole registry), with the intended constexprs and grid."""
    from triton.runtime.jit import mangle_type

    from linattn.runtime.aot import kernels
    spec = kernels()["gdn_fwd_triton_segment_start_bv64_w4"]
    _, sig, const, opts = spec.build()
    seen = {}

    class StandIn:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
            return run
    monkeypatch.setattr(ss, "segment_start_kernel", StandIn())
    x = _inputs(1, 64 * 6, 16, 32, seed=1)
    plan = make_chunk_plan(1, 64 * 6, None, 64, "cpu")
    gcum = torch.zeros(plan.T_total, 32)
    tinv = torch.zeros(plan.T_total, 32, 64, dtype=torch.bfloat16)
    ss.segment_start_states(x["k"], x["v"], x["beta"], x["g"], gcum, tinv, x["initial_state"], plan, 2, 3,
                            dot_prec="tf32")
    runtime = [n for n in sig if sig[n] != "constexpr"]
    assert [mangle_type(a) for a in seen["args"]] == [sig[n] for n in runtime]
    assert {k: v for k, v in seen["kwargs"].items() if k in const} == const
    assert seen["kwargs"]["num_warps"] == opts["num_warps"] and seen["grid"] == (2, 2 * 32)


@pytest.mark.parametrize("decay", ["fast", "steep", "slow", "mixed"])
def test_windows_as_the_start_states(decay):
    """segment_windows (the load-only kernel of LINATTN_GDN_GLUON_SEGMENT_WARM=1), two sequences: the same flags as
    segment_start_states on the same inputs; slow[n, hv] = 1 exactly where a segment of (n, hv) is flagged; the
    segment words: a warm-up of 0 chunks where flagged and for segment 0, at most 3; h0 where the window reaches the
    sequence start (segment 0, and segment 1 whose window of at most 3 chunks may reach chunk 0); the last-segment bit
    on segment 3 only; the sequence index; on steep gates windows of one chunk."""
    B, S, L, HV = 2, 4, 3, 2
    x = _inputs(B, 64 * 12, 1, HV, seed=int(torch.randint(0, 2 ** 31 - 1, ())), steep=decay == "steep")
    if decay == "slow":
        x["g"] = x["g"] * 0.01
    elif decay == "mixed":
        x["g"][..., 1] = 0.
    plan = make_chunk_plan(B, 64 * 12, None, 64, "cpu")
    gcum, tinv = fw.kkt_solve(x["k"], x["g"], x["beta"], plan, HV)
    with poisoned_allocations():
        _, flag = ss.segment_start_states(x["k"], x["v"], x["beta"], x["g"], gcum, tinv, x["initial_state"], plan,
                                          S, L, dot_prec="tf32")
        slow, flag_w, segw = ss.segment_windows(x["k"], x["beta"], x["g"], plan, S, L)
    assert torch.equal(flag_w, flag)
    assert torch.equal(slow, flag.view(B, S, HV).amax(1))
    wl = segw & ss.SEGW_WL_MASK.value
    assert (wl[flag != 0] == 0).all() and (wl.view(B, S, HV)[:, 0] == 0).all() and ((wl >= 0) & (wl <= L)).all()
    for n in range(B):
        for s in range(S):
            for hv in range(HV):
                word = int(segw[n * S + s, hv])
                assert word >> ss.SEGW_SEQ_SHIFT.value == n
                assert bool(word & ss.SEGW_LAST.value) == (s == S - 1)
                if flag[n * S + s, hv] == 0:
                    assert bool(word & ss.SEGW_H0.value) == (int(wl[n * S + s, hv]) == L * s), (n, s, hv)
    if decay == "steep":
        assert wl.view(B, S, HV)[:, 1:].flatten().tolist() == [1] * (B * (S - 1) * HV)
    if decay == "slow":
        assert slow.all()


@pytest.mark.parametrize("B,T,S,L,h0,decay", [(1, 700, 4, 3, True, "fast"), (2, 390, 2, 4, False, "fast"),
                                               (1, 700, 4, 3, True, "steep"), (2, 700, 4, 3, True, "mixed")])
def test_forward_with_the_warm_up_in_the_kernel(monkeypatch, B, T, S, L, h0, decay):
    """LINATTN_GDN_GLUON_SEGMENT_WARM=1: the schedule model runs each segment's chain from its window's first chunk
    (its segment word), storing o only from the segment's first row, with the chain's own roundings: o and the final
    state within TOL of the fp64 recurrence and next to equal to the forward without segments (over 6 seeds per
    case: o <= 9.8e-6 apart, the final state bit-equal; 3e-4 and 1e-5 allowed: a truncation of e^-20 can flip a
    16-bit rounding of the published state); unsegmented heads bit-equal to it."""
    monkeypatch.setenv("LINATTN_GDN_GLUON_SEGMENT_WARM", "1")
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x = _inputs(B, T, 1, 2, seed=seed, h0=h0, steep=decay == "steep")
    if decay == "mixed":
        x["g"][..., 1] = 0.
    res, ref = _segmented_and_plain(x, S, L, seed)
    for hv in range(2):
        if decay == "mixed" and hv == 1:
            assert torch.equal(res.o[:, :, hv], ref.o[:, :, hv]) and torch.equal(res.final_state[:, hv],
                                                                                 ref.final_state[:, hv])
        else:
            assert rel_rms(res.o[:, :, hv], ref.o[:, :, hv]) < 3e-4, hv
            assert rel_rms(res.final_state[:, hv], ref.final_state[:, hv]) < 1e-5, hv

