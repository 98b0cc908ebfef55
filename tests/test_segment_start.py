"""The segment windows of the gluon forward's gate-free segments (triton/segment_start.py), on a CPU under
TRITON_INTERPRET=1:

1. the window kernel against a Python rendering of its rule (windows, flags, segment words), and the windows it picks
   against the exact state at each segment start (the Triton forward's final state on the sequence prefix ending
   there): a chain started at the window equals it to rounding where the window reaches the sequence start, and is
   within the e^-thresh bound on steep gates (short windows); flagged where the decay is too slow for a window of at
   most max_window chunks within the previous segment, or where a transition is not a contraction;
2. the whole forward with the gate-free kernel's segment launch (kkt_solve, the window kernel, the fused kernel's
   schedule model on the segment plan for the heads never flagged, each segment's chain started at its window, the
   W/U kernel's model for the others) against the fp64 recurrence and against the same forward without segments.
"""
import pytest
import torch

from linattn.ops.gated_delta_rule.gluon import fused_forward as fw
from linattn.testing.fused_model import emulate_fused
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


def _windows(x, S, L, thresh=20.0, max_window=ss.MAX_WINDOW):
    """segment_windows on x (poisoned allocations): (slow, flag, segw) and the per-(segment, head) warm-up lengths."""
    B, T = x["q"].shape[:2]
    plan = make_chunk_plan(B, T, None, 64, "cpu")
    with poisoned_allocations():
        slow, flag, segw = ss.segment_windows(x["k"], x["beta"], x["g"], plan, S, L, thresh=thresh,
                                              max_window=max_window)
    return slow, flag, segw, segw & ss.SEGW_WL_MASK.value


def _window_start(x, n, c0, wl, from_h0):
    """The state at chunk c0 of sequence n reached by the Triton forward over the window of wl chunks before c0,
    from the initial state (from_h0: the window starts at the sequence start) or from 0."""
    pre = {k: (t[n:n + 1, (c0 - wl) * 64:c0 * 64].contiguous() if k != "initial_state" else
               (None if t is None or not from_h0 else t[n:n + 1].contiguous())) for k, t in x.items()}
    if wl == 0:
        h0 = pre["initial_state"]
        return torch.zeros(x["v"].shape[2], 128, 128) if h0 is None else h0[0].float()
    res = chunk_gated_delta_rule_fwd(pre["q"], pre["k"], pre["v"], pre["g"], pre["beta"], 128 ** -0.5,
                                     pre["initial_state"], True, None)
    return res.final_state[0]


def _exact_start(x, n, c0):
    """The state at chunk c0 of sequence n: the chain over the whole prefix from the initial state."""
    return _window_start(x, n, c0, c0, True)


@pytest.mark.parametrize("B,T,S,L,h0", [(1, 450, 3, 3, True), (2, 260, 2, 3, False), (1, 64 * 12, 4, 3, True)])
def test_windows_reach_the_start_without_truncation(B, T, S, L, h0):
    """thresh = inf, nothing can be truncated: segments 0 and 1 walk back to chunk 0 (their words: a warm-up of
    s * L chunks from the initial state: the chain over it is the exact one), unflagged. Later ones would need a
    window beyond the previous segment: flagged, for every head, and their pairs marked slow."""
    x = _inputs(B, T, 1, 2, seed=int(torch.randint(0, 2 ** 31 - 1, ())), h0=h0)
    slow, flag, segw, wl = _windows(x, S, L, thresh=float("inf"))
    assert flag.shape == (B * S, 2) and segw.shape == (B * S, 2) and slow.shape == (B, 2) and flag.dtype == torch.int32
    for n in range(B):
        for s in range(S):
            if s < 2:
                c0 = min(s * L, -(-T // 64))
                assert flag[n * S + s].tolist() == [0, 0] and wl[n * S + s].tolist() == [c0, c0]
                assert all(int(w) & ss.SEGW_H0.value for w in segw[n * S + s])
            else:
                assert flag[n * S + s].tolist() == [1, 1], (n, s)
        assert slow[n].tolist() == [int(S > 2)] * 2


def test_windows_truncated_within_the_bound_on_steep_gates():
    """thresh = 20 with ~-20 of log decay per chunk: each window is about one chunk, far from the sequence start, and
    a chain started from 0 there reaches the segment start within e^-20 of the exact state (the contraction bound,
    normalised keys; 1e-7 allowed), while a window of 0 chunks (thresh 0: starting from 0 at the segment) is off by
    the whole state; segment 0 starts from the initial state itself. fp32 inputs: the claim is the truncation's
    bound, and with 16-bit operands the state pass rounds the state to bf16 before each product, where two chains
    whose states differ by e^-20 can round one element differently (a seed of CI gave 1.08e-7 in bf16; fp32 stays
    near 7e-9 over seeds)."""
    x = _inputs(1, 64 * 9, 1, 2, seed=int(torch.randint(0, 2 ** 31 - 1, ())), steep=True, dtype=torch.float32)
    slow, flag, segw, wl = _windows(x, 3, 3)
    assert not flag.any() and not slow.any() and wl[0].tolist() == [0, 0]
    h0_bits = (segw & ss.SEGW_H0.value) != 0
    assert h0_bits[0].all() and not h0_bits[1:].any()
    for s in (1, 2):
        for hv in range(2):
            w = int(wl[s, hv])
            assert 1 <= w <= 2
            assert rel_rms(_window_start(x, 0, 3 * s, w, False)[hv], _exact_start(x, 0, 3 * s)[hv]) < 1e-7
    _, _, _, wl0 = _windows(x, 3, 3, thresh=0.0)
    assert wl0.eq(0).all()
    assert rel_rms(_window_start(x, 0, 6, 0, False), _exact_start(x, 0, 6)) > 0.5


@pytest.mark.parametrize("decay", ["slow", "none", "mixed"])
def test_flags_where_the_decay_is_slow(decay):
    """g x 0.01, g = 0, or head 0 steep and head 1 without decay, 4 segments of 3 chunks: a window of at most the
    previous segment reaches the sequence start from segment 1 (exact, unflagged), not from segments 2 and 3, which
    are flagged on the slow heads; with max_window = 2 segment 1 is flagged there too (its window may not reach
    chunk 0). A steep head is never flagged, and the chains from its windows are exact to the e^-20 bound."""
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
    slow, flag, segw, wl = _windows(x, 4, 3)
    assert flag.tolist() == want and slow[0].tolist() == [int(h in slow_heads) for h in range(2)]
    for h in slow_heads:                        # segment 1 of a slow head: its window is the whole prefix
        assert int(wl[1, h]) == 3 and int(segw[1, h]) & ss.SEGW_H0.value
    if decay == "mixed":
        for s in (2, 3):
            w = int(wl[s, 0])
            assert rel_rms(_window_start(x, 0, 3 * s, w, w == 3 * s)[0], _exact_start(x, 0, 3 * s)[0]) < 1e-7
    want[1] = [int(h in slow_heads) for h in range(2)]
    assert _windows(x, 4, 3, max_window=2)[1].tolist() == want


def test_flags_where_a_transition_is_not_a_contraction():
    """Steep gates (windows of one chunk, truncated), keys of norm 1.5, beta in [0, 1) with 1 on each chunk's last
    token: there beta ||k||^2 = 2.25 > 2, so the truncation bound does not hold and every truncated segment is
    flagged; segment 0 (the initial state) is not. With the keys back at norm 1 nothing is flagged. The forward then
    runs every head unsegmented (on the W/U kernel's model): o and the final state equal to the forward without
    segments on that model."""
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x = _inputs(1, 64 * 9, 1, 2, seed=seed, steep=True)
    x["k"] = (x["k"].float() * 1.5).to(torch.bfloat16)
    x["beta"] = torch.rand(x["beta"].shape, generator=torch.Generator().manual_seed(seed))
    x["beta"][:, 63::64] = 1.
    slow, flag, _, _ = _windows(x, 3, 3)
    assert flag.tolist() == [[0, 0], [1, 1], [1, 1]] and slow.tolist() == [[1, 1]]
    x_ok = dict(x, k=(x["k"].float() / 1.5).to(torch.bfloat16))       # norm 1 again: nothing flagged
    assert not _windows(x_ok, 3, 3)[1].any()
    res, ref = _forward_gf(x, (3, 3), seed), _forward_gf(x, None, seed, plain="wu")
    assert torch.equal(res.o, ref.o) and torch.equal(res.final_state, ref.final_state)


def test_segment_plan():
    """Segments as sequences: chunk-aligned starts, each sequence's last segment ending with it, sequence-major."""
    plan = ss.segment_plan(2, 700, 4, 3, "cpu")
    assert plan.N == 8 and plan.T_total == 1400
    assert plan.cu.tolist() == [0, 192, 384, 576, 700, 892, 1084, 1276, 1400]


def _reference_windows(x, S, L, thresh=20.0, max_window=ss.MAX_WINDOW, reverse=False):
    """The window rule in Python (fp64 sums): per (sequence n, segment s, head hv), (cw, flagged). Walk back from
    c0 = min(s * L, chunks) over whole chunks, no further than lim = max(c0 - min(L, max_window), 0), summing each
    chunk's log decay, to the first chunk where the sum is <= -thresh (cw = lim if none); usable if found or cw == 0;
    flagged if not usable, or if a token of a truncated window (cw > 0) has beta ||k||^2 outside [0, 2].
    reverse (the backward's reverse pass): mirrored, (cwe, flagged): walk forward from the segment's end c1 =
    min((s + 1) * L, chunks) (the last chunk may be partial), no further than lim = min(c1 + min(L, max_window),
    chunks), to the first chunk c where the sum over [c1, c] is <= -thresh (cwe = c + 1; lim if none); the edge is
    the sequence end (cwe == chunks)."""
    B, T, H = x["k"].shape[:3]
    HV = x["g"].shape[-1]
    nch = -(-T // 64)
    g, beta = x["g"].double(), x["beta"].double()
    out = {}
    for n in range(B):
        for s in range(S):
            if reverse:
                edge = min((s + 1) * L, nch)
                lim = min(edge + min(L, max_window), nch)
                walk = range(edge, lim)
            else:
                edge = min(s * L, nch)
                lim = max(edge - min(L, max_window), 0)
                walk = range(edge - 1, lim - 1, -1)
            for hv in range(HV):
                acc, end, found = 0.0, lim, False
                for c in walk:
                    acc += float(g[n, c * 64:(c + 1) * 64, hv].sum())
                    if acc <= -thresh:
                        end, found = (c + 1 if reverse else c), True
                        break
                at_edge = end == (nch if reverse else 0)
                usable = found or at_edge or thresh <= 0
                if thresh <= 0:
                    end = edge
                lo, hi = (edge, end) if reverse else (end, edge)
                kk = x["k"][n, lo * 64:hi * 64, hv // (HV // H)].double().pow(2).sum(-1)
                bkk = beta[n, lo * 64:hi * 64, hv] * kk
                expansive = bool(((bkk < 0) | (bkk > 2)).any())
                out[n, s, hv] = (end, (not usable) or (expansive and not at_edge))
    return out


@pytest.mark.parametrize("decay", ["fast", "steep", "slow", "mixed"])
def test_windows_follow_the_rule(decay):
    """segment_windows on two sequences against _reference_windows: the flags; slow[n, hv] = 1 exactly where a
    segment of (n, hv) is flagged; the segment words: the warm-up c0 - cw (0 where flagged), the h0 bit exactly where
    an unflagged window reaches the sequence start (cw == 0), the last-segment bit on segment 3 only, the sequence
    index. On steep gates windows of one chunk; at slow decay every pair slow. (Sums in fp32 in the kernel, fp64
    here: a window sum within ~1e-5 of -20 could differ; the fresh random gates put that at ~1e-5 per run.)"""
    B, S, L, HV = 2, 4, 3, 2
    x = _inputs(B, 64 * 12, 1, HV, seed=int(torch.randint(0, 2 ** 31 - 1, ())), steep=decay == "steep")
    if decay == "slow":
        x["g"] = x["g"] * 0.01
    elif decay == "mixed":
        x["g"][..., 1] = 0.
    slow, flag, segw, wl = _windows(x, S, L)
    ref = _reference_windows(x, S, L)
    for n in range(B):
        for s in range(S):
            for hv in range(HV):
                cw, flagged = ref[n, s, hv]
                word = int(segw[n * S + s, hv])
                assert int(flag[n * S + s, hv]) == int(flagged), (n, s, hv)
                assert word >> ss.SEGW_SEQ_SHIFT.value == n
                assert bool(word & ss.SEGW_LAST.value) == (s == S - 1)
                if not flagged:
                    assert int(wl[n * S + s, hv]) == s * L - cw, (n, s, hv)
                    assert bool(word & ss.SEGW_H0.value) == (cw == 0), (n, s, hv)
                else:
                    assert int(wl[n * S + s, hv]) == 0
    assert torch.equal(slow, flag.view(B, S, HV).amax(1))
    if decay == "steep":
        assert wl.view(B, S, HV)[:, 1:].flatten().tolist() == [1] * (B * (S - 1) * HV)
    if decay == "slow":
        assert slow.all()


@pytest.mark.parametrize("decay,T", [("fast", 64 * 12), ("steep", 64 * 12 - 20), ("slow", 64 * 12), ("mixed", 700)])
def test_reverse_windows_follow_the_rule(decay, T):
    """segment_windows(reverse=True) (the backward's reverse state pass) against _reference_windows(reverse=True)
    on two sequences, fresh gates each run: the flags, slow, and the mirrored segment words: the warm-up cwe - c1 after the
    segment's end (0 where flagged), the H0 bit exactly where an unflagged window reaches the sequence end (d
    final_state enters there), the LAST bit on the first segment only (it alone stores d initial_state), the
    sequence index. T not a multiple of 64: the last chunk's rows past the end are not summed."""
    B, S, L, HV = 2, 4, 3, 2
    x = _inputs(B, T, 1, HV, seed=int(torch.randint(0, 2 ** 31 - 1, ())), steep=decay == "steep")
    if decay == "slow":
        x["g"] = x["g"] * 0.01
    elif decay == "mixed":
        x["g"][..., 1] = 0.
    plan = make_chunk_plan(B, T, None, 64, "cpu")
    with poisoned_allocations():
        slow, flag, segw = ss.segment_windows(x["k"], x["beta"], x["g"], plan, S, L, reverse=True)
    nch = -(-T // 64)
    ref = _reference_windows(x, S, L, reverse=True)
    for n in range(B):
        for s in range(S):
            c1 = min((s + 1) * L, nch)
            for hv in range(HV):
                cwe, flagged = ref[n, s, hv]
                word = int(segw[n * S + s, hv])
                assert int(flag[n * S + s, hv]) == int(flagged), (n, s, hv)
                assert word >> ss.SEGW_SEQ_SHIFT.value == n
                assert bool(word & ss.SEGW_LAST.value) == (s == 0)
                wl = word & ss.SEGW_WL_MASK.value
                if not flagged:
                    assert wl == cwe - c1, (n, s, hv, wl, cwe, c1)
                    assert bool(word & ss.SEGW_H0.value) == (cwe == nch), (n, s, hv)
                else:
                    assert wl == 0
    assert torch.equal(slow, flag.view(B, S, HV).amax(1))
    if decay == "steep":      # one chunk of ~-20 after each segment's end but the last one's (at the end: none)
        wls = (segw.view(B, S, HV) & ss.SEGW_WL_MASK.value)
        assert wls[:, :S - 1].flatten().tolist() == [1] * (B * (S - 1) * HV)
        assert wls[:, S - 1].flatten().tolist() == [0] * (B * HV)
    if decay == "slow":
        assert slow.all()


def _forward_gf(x, segments, seed, plain="gf"):
    """The forward with the gate-free kernel's segment launch (the schedule model with gate_free at BV = 128, a
    2-stage ring and one published buffer, seg and select) and the unsegmented pairs on the W/U kernel's model at the
    BV = 32 default (WU_AREG, OUT_PIPE, select); segments None: the plain forward on `plain` ("gf" or "wu")."""
    def wu(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, select=None, seg=None):
        assert seg is None
        emulate_fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, BV=32, stages=3,
                               seed=seed, areg=True, out_pipe=True, select=select)

    def gf(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, select=None, seg=None):
        assert (seg is None) == (segments is None)
        emulate_fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, BV=128, stages=2,
                               npub=1, seed=seed, out_pipe=True, gate_free=True, select=select, seg=seg)
    with poisoned_allocations():
        return fw.chunk_gated_delta_rule_fwd_fused_wu(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5,
                                                      x["initial_state"], True, None,
                                                      fused_pass=gf if segments is None and plain == "gf" else wu,
                                                      segments=segments,
                                                      segment_pass=gf)


@pytest.mark.parametrize("B,T,S,L,h0,decay", [(1, 700, 4, 3, True, "fast"), (2, 390, 2, 4, False, "fast"),
                                               (1, 700, 4, 3, True, "steep"), (1, 700, 4, 3, True, "slow"),
                                               (2, 700, 4, 3, True, "mixed")])
def test_forward_with_gf_segments(B, T, S, L, h0, decay):
    """The gate-free kernel's segment launch: each segment's chain from its window's
    first chunk in the gate-free form, o stored from the segment's first row, the flagged pairs on the W/U kernel's
    model. o and the final state within TOL of the fp64 recurrence; segmented heads next to equal to the plain
    gate-free forward (o within 3e-4, the final state within 1e-5: a truncation of e^-20 can flip a 16-bit rounding of
    the published state), unsegmented heads bit-equal to the plain W/U forward (the same model and roundings). Which
    heads run unsegmented is the window kernel's slow[n, hv]: where no window of at most L = 3 chunks reaches a log
    decay of -20, which production-like gates (about -7.4 per chunk) miss at random, so at "fast" decay a head may be
    flagged; at steep decay (-20.5 per chunk) none is, at slow decay both are, at mixed at least head 1."""
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x = _inputs(B, T, 1, 2, seed=seed, h0=h0, steep=decay == "steep")
    if decay == "slow":
        x["g"] = x["g"] * 0.01
    elif decay == "mixed":
        x["g"][..., 1] = 0.
    res = _forward_gf(x, (S, L), seed)
    ref_gf = _forward_gf(x, None, seed)
    ref_wu = _forward_gf(x, None, seed, plain="wu")
    slow = _windows(x, S, L)[0]
    o64, f64 = naive_recurrent(*(x[k].double() for k in ("q", "k", "v", "g", "beta")), scale=128 ** -0.5,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True)
    assert torch.isfinite(res.o).all() and torch.isfinite(res.final_state).all()
    assert rel_rms(res.o, o64) < TOL[torch.bfloat16] and rel_rms(res.final_state, f64) < TOL[torch.bfloat16], seed
    if decay == "steep":
        assert not slow.any(), slow
    assert set({"fast": [], "steep": [], "slow": [0, 1], "mixed": [1]}[decay]) <= set(slow.nonzero()[:, 1].tolist())
    for n in range(B):
        for hv in range(2):
            got, want = (res.o[n, :, hv], res.final_state[n, hv]), (ref_wu if slow[n, hv] else ref_gf)
            if slow[n, hv]:
                assert torch.equal(got[0], want.o[n, :, hv]) and torch.equal(got[1], want.final_state[n, hv])
            else:
                assert rel_rms(got[0], want.o[n, :, hv]) < 3e-4, (n, hv, seed)
                assert rel_rms(got[1], want.final_state[n, hv]) < 1e-5, (n, hv, seed)
