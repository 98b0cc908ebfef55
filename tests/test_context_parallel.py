"""Context parallelism of chunk_gated_delta_rule, chunk_kda and causal_conv1d (linattn/distributed,
docs/context-parallel.md).

End to end: W processes (forked by torch.multiprocessing, gloo on localhost through a file store) run the op on their
T / W tokens of one packed stream under the Triton interpreter; every rank's output, the final states (returned on
every rank) and every gradient (q, k, v, g, beta on their slices; initial_state summed over ranks) are checked
against the fp64 reference and against the one-process call. The world of 2 has sequences crossing the boundary,
sequences inside one rank, a 1-token sequence and an initial state; the world of 3 has a sequence spanning a whole
rank (the composition through its transition M) and empty sequences. In-process: the context's metadata, the
summary kernel's C and M and the backward's dh0-only pass against fp64, and the argument errors.
"""
import datetime
import os
import tempfile

import pytest
import torch

import linattn
from linattn.distributed import build_cp_context
from linattn.distributed.chunk import compose_incoming, compose_outgoing
from linattn.distributed.comm import SimulatedComm
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.settings import settings
from linattn.testing.compare import TOL, assert_close
from linattn.testing.cp_cases import NAMES, check, expected, make_case, one_process, rank_call
from linattn.testing.inputs import make_gdn_inputs, random_cu_seqlens

pytestmark = pytest.mark.skipif(not settings.interpret, reason="runs the CPU path under TRITON_INTERPRET=1")
H, HV, K, V = 1, 2, 16, 16
# CP against the one-process call in fp32: the same kernels on the same tokens, the incoming state composed by fp32
# products in another order, so the two agree to rounding (measured about 1e-7); 1e-5 leaves room and no more
SAME_CALL_TOL = 1e-5


# ---- the worker of one rank -------------------------------------------------------------------------------------

def _worker(rank, world, init_file, cases, out_dir, run_case):
    """One rank: joins the gloo group, runs run_case(rank, case) on every case, saves each result."""
    import torch.distributed as dist
    torch.set_num_threads(1)            # a forked child: no inherited intra-op thread pool
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for i, case in enumerate(cases):
            torch.save(run_case(rank, case), os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _chunk_case(rank, case):
    """The chunked op on this rank's slice: o, the final states and every gradient."""
    return rank_call(rank, case)


def _case(lengths, world, dtype, with_h0, final, op="gdn", fla_options=False):
    return make_case(lengths, world, dtype, with_h0, final, op=op, fla_options=fla_options, dims=(H, HV, K, V))


def _run_world(world, cases, run_case=_chunk_case):
    """Every rank's results of every case. The ranks are forked from this process, after _check's one-process calls
    have run the same kernels here: the interpreter's per-kernel start-up is then paid once, not once per rank."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, os.path.join(d, "store"), cases, d, run_case), nprocs=world,
                           start_method="fork")
        return [[torch.load(os.path.join(d, f"case{i}_rank{r}.pt")) for r in range(world)]
                for i in range(len(cases))]


def _expected(case):
    """The fp64 reference, and in fp32 the one-process call too (computed before the ranks are forked)."""
    return expected(case, same_call=case["q"].dtype == torch.float32)


def _check(case, exp, ranks, world):
    """Against the fp64 reference (the dtype's tolerance) and, in fp32, the one-process call (SAME_CALL_TOL)."""
    res = check(case, ranks, world, SAME_CALL_TOL if "one-process call" in exp else None, exp=exp)
    assert not res["failures"], "\n".join(res["failures"])


def test_two_ranks_match_the_one_process_call():
    """World 2, 2 x 110 tokens (not a multiple of the chunk): fp32 with initial and final states and sequences
    [0, 40) (inside rank 0), [40, 150) (crosses), 1 token, [151, 220) (inside rank 1); bf16 with one sequence
    crossing the boundary, no initial state, no final state."""
    cases = [_case([40, 110, 1, 69], 2, torch.float32, True, True),
             _case([220], 2, torch.bfloat16, False, False)]
    exps = [_expected(case) for case in cases]
    for case, exp, ranks in zip(cases, exps, _run_world(2, cases)):
        _check(case, exp, ranks, 2)


def test_three_ranks_with_a_rank_spanned_by_one_sequence():
    """World 3, 3 x 80 tokens: [0, 30) inside rank 0, [30, 190) spans rank 1 whole (its incoming state goes
    through rank 1's transition M, its final-state gradient back through M^T), a 1-token sequence, an empty one
    inside rank 2, [191, 240), and an empty one at the end; fp32, initial and final states."""
    case = _case([30, 160, 1, 0, 49, 0], 3, torch.float32, True, True)
    exp = _expected(case)
    _check(case, exp, _run_world(3, [case])[0], 3)


def test_kda_three_ranks():
    """chunk_kda over the same pass, world 3 (the case above: crossing, a spanned rank, 1-token and empty
    sequences), fp32, initial and final states; and world 2 in bf16 with one crossing sequence."""
    cases3 = [_case([30, 160, 1, 0, 49, 0], 3, torch.float32, True, True, op="kda")]
    cases2 = [_case([220], 2, torch.bfloat16, False, True, op="kda")]
    for world, cases in ((3, cases3), (2, cases2)):
        exps = [_expected(case) for case in cases]
        for case, exp, ranks in zip(cases, exps, _run_world(world, cases)):
            _check(case, exp, ranks, world)


def test_fla_options_three_ranks():
    """FLA's in-kernel gate, beta sigmoid (allow_neg_eigval) and state_v_first under CP, as FLA's KDA layer calls
    chunk_kda, and chunk_gated_delta_rule with the same options: world 3 with a spanned rank, fp32, initial and final
    states [N, HV, V, K]; outputs, states and every gradient (A_log and dt_bias summed over ranks) against FLA's
    options written out in fp64, and all but A_log's and dt_bias's against the one-process call."""
    lengths = [30, 160, 1, 0, 49, 0]
    cases = [_case(lengths, 3, torch.float32, True, True, op=op, fla_options=True) for op in ("kda", "gdn")]
    exps = [_expected(case) for case in cases]
    for case, exp, ranks in zip(cases, exps, _run_world(3, cases)):
        _check(case, exp, ranks, 3)


def _conv_case(rank, case):
    """causal_conv1d on this rank's slice: y and every gradient."""
    cp = build_cp_context(case["cu"])
    P = cp.part_len
    x = case["x"][:, rank * P:(rank + 1) * P].clone().requires_grad_(True)
    w, b = case["w"].clone().requires_grad_(True), case["b"].clone().requires_grad_(True)
    with poisoned_allocations():
        y, fin = linattn.causal_conv1d(x, w, b, activation="silu", cp_context=cp)
        (y * case["dy"][:, rank * P:(rank + 1) * P]).sum().backward()
    assert fin is None
    return dict(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad)


@pytest.mark.parametrize("world,lengths", [
    (2, [5, 50, 1, 24]),          # [5, 55) crosses the boundary at 40
    (4, [1, 9, 2]),               # 3 tokens per rank (= W - 1): the 9-token sequence spans ranks 1 and 2 whole
    (3, [6]),                     # 2 tokens per rank < W - 1: rank 2's halo reaches back to rank 0
])
def test_causal_conv1d_context_parallel(world, lengths):
    """causal_conv1d(cp_context=...) on every rank against the one-process call: y, dx, and dweight / dbias summed
    over ranks, W = 4, SiLU, fp32, sequences crossing ranks (and, with two tokens per rank, a halo from two ranks
    back)."""
    cu = random_cu_seqlens(lengths)
    T, D, W = int(cu[-1]), 6, 4
    case = dict(cu=cu, x=torch.randn(1, T, D), w=torch.randn(D, W), b=torch.randn(D), dy=torch.randn(1, T, D))
    x, w, b = (case[n].clone().requires_grad_(True) for n in ("x", "w", "b"))
    y, _ = linattn.causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)
    (y * case["dy"]).sum().backward()
    (ranks,) = _run_world(world, [case], _conv_case)
    assert_close("y", torch.cat([r["y"] for r in ranks], 1), y, SAME_CALL_TOL)
    assert_close("dx", torch.cat([r["dx"] for r in ranks], 1), x.grad, SAME_CALL_TOL)
    assert_close("dweight (summed over ranks)", sum(r["dw"] for r in ranks), w.grad, SAME_CALL_TOL)
    assert_close("dbias (summed over ranks)", sum(r["db"] for r in ranks), b.grad, SAME_CALL_TOL)


# ---- in process ---------------------------------------------------------------------------------------------------

def test_context_metadata():
    cu = torch.tensor([0, 30, 190, 191, 191, 240, 240])
    ctxs = [build_cp_context(cu, rank=r, world_size=3) for r in range(3)]
    assert [c.cu_seqlens_cpu.tolist() for c in ctxs] == [[0, 30, 80], [0, 80], [0, 30, 31, 31, 80, 80]]
    assert [c.seq_offset for c in ctxs] == [0, 1, 1]
    assert [(c.pre_num_ranks, c.post_num_ranks) for c in ctxs] == [(0, 2), (1, 1), (2, 0)]
    assert [(c.is_first_rank, c.is_last_rank) for c in ctxs] == [(True, False), (False, False), (False, True)]
    assert [c.pre_num_conv_tokens for c in ctxs] == [0, 50, 130]
    assert all(c.any_crossing and c.part_len == 80 and c.num_seqs_global == 6 for c in ctxs)
    # an empty sequence on a boundary belongs to the rank that starts there; nothing crosses
    ctxs = [build_cp_context(torch.tensor([0, 4, 4, 8]), rank=r, world_size=2) for r in range(2)]
    assert [c.cu_seqlens_cpu.tolist() for c in ctxs] == [[0, 4], [0, 0, 4]]
    assert [c.seq_offset for c in ctxs] == [0, 1] and not any(c.any_crossing for c in ctxs)


@pytest.mark.parametrize("kw,err,match", [
    (dict(cu_seqlens=torch.tensor([0, 5, 9]), world_size=2), ValueError, "multiple of the world size"),
    (dict(cu_seqlens=torch.tensor([0, 6, 4, 8]), world_size=2), ValueError, "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0]), world_size=2), ValueError, "int32/int64"),
    (dict(cu_seqlens=torch.tensor([0, 8]), world_size=2, layout="zigzag"), NotImplementedError, "zigzag"),
    (dict(cu_seqlens=torch.tensor([0, 8]), world_size=2, rank=2), ValueError, "rank must be"),
    (dict(cu_seqlens=torch.tensor([0, 8])), ValueError, "not initialised"),
])
def test_context_argument_errors(kw, err, match):
    kw = dict(kw)
    if "world_size" in kw:
        kw.setdefault("rank", 0)
    with pytest.raises(err, match=match):
        build_cp_context(kw.pop("cu_seqlens"), **kw)


def _recurrent_map(x, lo, hi, h0):
    """fp64 final state of tokens lo:hi from h0 [1, HV, K, V] (naive_recurrent)."""
    args = [x[n][:, lo:hi].double() for n in NAMES]
    return naive_recurrent(*args, K ** -0.5, h0, True)[1][0]


@pytest.mark.parametrize("with_h0", [False, True])
def test_summary_kernel_c_and_m(with_h0):
    """[C | M] of tokens 37:150 (three chunks, the last partial) against fp64: C the state from h0 (or zero), M by
    its action on a random state, S_out = M S_in + C."""
    from linattn.ops.gated_delta_rule.triton.cp_summary import launch_state_summary
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    T, lo = 150, 37
    x = make_gdn_inputs(1, T, H, HV, K, V, dtype=torch.float32, num_states=1)
    h0 = x["initial_state"][0] if with_h0 else None
    hm = torch.full((HV, K, V + K), float("nan"))

    def state_pass(k, w, u, gcum, h, vnew, init, final, plan):
        launch_state_summary(k, w, u, gcum, h0, hm, plan.cu[1:], with_transition=True)

    chunk_gated_delta_rule_fwd(*(x[n] for n in NAMES), K ** -0.5, None, False, torch.tensor([0, lo, T]),
                               compute_output=False, state_pass=state_pass)
    zero = torch.zeros(1, HV, K, V, dtype=torch.float64)
    c_ref = _recurrent_map(x, lo, T, zero if h0 is None else h0[None].double())
    assert_close("C", hm[:, :, :V], c_ref, TOL[torch.float32])
    s = torch.randn(1, HV, K, V, dtype=torch.float64)
    m_ref_action = _recurrent_map(x, lo, T, s) - _recurrent_map(x, lo, T, zero)
    assert_close("M S", hm[:, :, V:].double() @ s[0], m_ref_action, TOL[torch.float32])


def _fast_decay(x, rate=0.5):
    """g = -rate per token: a chunk's decay reaches e^-20 within a chunk or two (the summaries' windows)."""
    x["g"] = torch.full_like(x["g"], -rate)
    return x


@pytest.mark.parametrize("expansive", [False, True])
def test_summary_tail_window(expansive):
    """Under fast decay the summary runs only the tail window (tokens before it poisoned with NaN: C stays finite,
    equal to the fp64 state of the whole range, M below e^-20); a token in the window whose transition expands
    (beta ||k||^2 > 2) makes every head run the whole range (the poison then reaches C)."""
    from linattn.ops.gated_delta_rule.triton.cp_summary import launch_state_summary
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    T, lo, win = 300, 37, 229                  # chunks of [37, 300) start at 37, 101, 165, 229, 293
    x = _fast_decay(make_gdn_inputs(1, T, H, HV, K, V, dtype=torch.float32, num_states=1))
    if expansive:
        x["beta"][0, 250] = 3.0
    h0 = x["initial_state"][0]
    hm = torch.full((HV, K, V + K), float("nan"))

    def state_pass(k, w, u, gcum, h, vnew, init, final, plan):
        k = k.clone()                          # the call's own k: the reference reads it
        for t in (w, u, k):
            t.reshape(T, -1)[lo:win] = float("nan")
        launch_state_summary(k, w, u, gcum, h0, hm, plan.cu[1:], with_transition=True, beta=x["beta"])

    chunk_gated_delta_rule_fwd(*(x[n] for n in NAMES), K ** -0.5, None, False, torch.tensor([0, lo, T]),
                               compute_output=False, state_pass=state_pass)
    if expansive:
        assert hm.isnan().all()
        return
    assert_close("C", hm[:, :, :V], _recurrent_map(x, lo, T, h0[None].double()), TOL[torch.float32])
    assert hm[:, :, V:].abs().max() < 2e-9


@pytest.mark.parametrize("case", ["fast", "slow", "expansive"])
def test_head_window_range(case):
    """The backward's dh0-only pass covers the head window of the first sequence: fast decay cuts [0, 300) to its
    first chunk (64 tokens: -32 in log decay); slow decay (-3 over the sequence) or an expanding transition in the
    window keep it whole."""
    from linattn.ops.gated_delta_rule.triton.cp_summary import head_window_range
    T = 300
    x = make_gdn_inputs(1, T, H, HV, K, V, dtype=torch.float32, num_states=1)
    x = _fast_decay(x, 0.01 if case == "slow" else 0.5)
    if case == "expansive":
        x["beta"][0, 10, 1] = 3.0
    # gcum: the within-chunk cumulative log decay, as stage 2 writes it
    g = x["g"][0]
    gcum = torch.cat([g[i:i + 64].cumsum(0) for i in range(0, T, 64)])
    cu = torch.tensor([0, T])
    out = head_window_range(gcum, x["k"][0], x["beta"][0], cu)
    assert out.tolist() == ([0, 64] if case == "fast" else [0, T])


def test_windows_under_fast_decay_match_the_one_process_call():
    """The pass end to end with both windows taken (fast decay: the summary's tail and the dh0-only pass's head
    window), world 3 with a crossing sequence and one spanning rank 1: fp32 against fp64 and the one-process call
    (the truncation is bounded by e^-20 of the state)."""
    case = _case([40, 560, 48], 3, torch.float32, True, False)
    case["g"] = -0.3 - 0.4 * torch.rand_like(case["g"])
    exp = _expected(case)
    _check(case, exp, _run_world(3, [case])[0], 3)


def test_state_bwd_dh0_only_pass():
    """launch_state_bwd(store_dh=False) gives the full pass's dh0 and leaves dh and dvnew untouched."""
    from linattn.ops.gated_delta_rule.triton import backward
    x = make_gdn_inputs(1, 150, H, HV, K, V, dtype=torch.float32, num_states=1)
    do = torch.randn(1, 150, HV, V)
    dht = torch.randn(1, HV, K, V)
    seen = {}

    def state_bwd(q, k, w, gcum, do_, dh, dvnew, dht_, dh0, plan, scale):
        before = (dh.clone(), dvnew.clone())
        only = torch.full_like(dh0, float("nan"))
        backward.launch_state_bwd(q, k, w, gcum, do_, dh, dvnew, dht_, only, plan, scale, store_dh=False)
        assert torch.equal(dh.nan_to_num(7.0), before[0].nan_to_num(7.0)) and torch.equal(dvnew, before[1])
        backward.launch_state_bwd(q, k, w, gcum, do_, dh, dvnew, dht_, dh0, plan, scale)
        seen["only"], seen["full"] = only, dh0

    with poisoned_allocations():
        backward.chunk_gated_delta_rule_bwd(*(x[n] for n in NAMES), K ** -0.5, x["initial_state"], None, do, dht,
                                            state_bwd=state_bwd)
    assert_close("dh0 of the dh0-only pass", seen["only"], seen["full"], 0.0)


def test_composition_is_the_sequential_chain():
    """compose_incoming / compose_outgoing against the explicit chain over a world of 5."""
    W, Vd = 5, 3
    ag = torch.randn(W, HV, K, Vd + K, dtype=torch.float64)
    s = ag[1, :, :, :Vd]
    for j in (2, 3):
        s = ag[j, :, :, Vd:] @ s + ag[j, :, :, :Vd]
    assert_close("incoming", compose_incoming(ag, 4, 3, Vd), s, 1e-12)
    ag_d = torch.randn(W, HV, K, Vd, dtype=torch.float64)
    m_next = ag[2:4, :, :, Vd:]
    gr = ag_d[4]
    for j in (3, 2):
        gr = ag[j, :, :, Vd:].transpose(-1, -2) @ gr + ag_d[j]
    assert_close("outgoing", compose_outgoing(ag_d, m_next, 1, 3), gr, 1e-12)


def test_world_of_one_is_the_plain_call():
    """A one-rank world (nothing crosses, no exchange) gives the plain call's results bit for bit."""
    cu = random_cu_seqlens([70, 1, 57])
    case = _case([70, 1, 57], 1, torch.float32, True, True)
    cp = build_cp_context(cu, rank=0, world_size=1, comm=SimulatedComm(0, 1))
    x = {n: case[n].clone().requires_grad_(True) for n in NAMES}
    h0 = case["h0"].clone().requires_grad_(True)
    o, fin = linattn.chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cp_context=cp)
    ((o * case["do"]).sum() + (fin * case["dfin"][0]).sum()).backward()
    o1, fin1, grads = one_process(case, reference=False)
    assert torch.equal(o, o1) and torch.equal(fin, fin1)
    for n in NAMES:
        assert torch.equal(x[n].grad, grads["d" + n]), n
    assert torch.equal(h0.grad, grads["dh0"])


@pytest.mark.parametrize("what,err,match", [
    ("not a context", TypeError, "cp_context must be built by"),
    ("global cu_seqlens", ValueError, "cu_seqlens must be omitted"),
    ("reference backend", NotImplementedError, "backend='reference'"),
    ("wrong length", ValueError, "T / W = 64 tokens"),
    ("initial_state rows", ValueError, "initial_state must be"),
])
def test_cp_argument_errors(what, err, match):
    cu = torch.tensor([0, 100, 128])
    cp = build_cp_context(cu, rank=0, world_size=2, comm=SimulatedComm(0, 2))
    T = 32 if what == "wrong length" else 64
    x = make_gdn_inputs(1, T, H, HV, K, V, dtype=torch.float32, num_states=1 if what == "initial_state rows" else 2)
    kw = dict(cp_context=object() if what == "not a context" else cp)
    if what == "global cu_seqlens":
        kw["cu_seqlens"] = cu
    if what == "reference backend":
        kw["backend"] = "reference"
    with pytest.raises(err, match=match):
        linattn.chunk_gated_delta_rule(**x, **kw)


def test_scaling_model_dry_run(tmp_path, capsys):
    """The one-GPU scaling model (linattn/distributed/model.py) at tiny sizes: every role of a world of 3 timed
    through the real path with a simulated peer, the bytes per pass as the model states them."""
    import json
    from linattn.distributed import model
    path = tmp_path / "model.json"
    assert model.main(["--dry-run", "--final", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    (row,) = res["worlds"]
    assert row["W"] == 3 and sorted(row["per_rank_s"]) == ["0", "1", "2"]
    HV_, K_, V_ = res["HV"], res["K"], res["V"]
    state = HV_ * K_ * V_ * 4
    assert row["bytes_fwd"] == 2 * HV_ * K_ * (V_ + K_) * 4 + int(4 / 3 * state)
    assert row["bytes_bwd"] == 2 * state + int(4 / 3 * state)
    for key in ("local_fwd_s", "local_fwd_bwd_s", "model_fwd_s", "model_fwd_bwd_s", "one_device_fwd_s"):
        assert 0 < res.get(key, row.get(key)) < 1e3, key
    assert "model f+b ms" in capsys.readouterr().out
    # chunk_kda's model: the same roles and exchange
    assert model.main(["--dry-run", "--final", "--op", "kda", "--json", str(path)]) == 0
    kda = json.loads(path.read_text())
    assert kda["op"] == "kda" and kda["worlds"][0]["bytes_fwd"] == row["bytes_fwd"]
    assert 0 < kda["worlds"][0]["local_fwd_bwd_s"] < 1e3
    # the production row's exchange: 7 peers' [HV, K, V + K] fp32 summaries in the forward, [HV, K, V] backward
    c = model.comm_model(8, 32, 128, 128, 1, False, 400e9, 20e-6)
    assert c["bytes_fwd"] == 7 * 32 * 128 * 256 * 4 and c["bytes_bwd"] == 7 * 32 * 128 * 128 * 4
    assert abs(c["comm_fwd_s"] - (20e-6 + c["bytes_fwd"] / 400e9)) < 1e-12


def test_cp_kernel_choice(monkeypatch):
    """The pass's kernels: Triton by name and wherever the gluon backend declines the call (on a CPU always), with
    the reason; LINATTN_BACKEND=triton applies to backend='auto' as to the one-process call."""
    from linattn.distributed.chunk import GDN, gdn_cp_op
    cp = build_cp_context(torch.tensor([0, 128]), rank=0, world_size=2, comm=SimulatedComm(0, 2))
    x = make_gdn_inputs(1, 64, H, HV, K, V, dtype=torch.bfloat16)
    op, why = gdn_cp_op(x["q"], x["v"], cp, "triton")
    assert op is GDN and "'triton'" in why
    op, why = gdn_cp_op(x["q"], x["v"], cp, "auto")
    assert op is GDN and why.startswith("the Triton kernels: ") and len(why) > len("the Triton kernels: ")
    monkeypatch.setenv("LINATTN_BACKEND", "triton")
    assert gdn_cp_op(x["q"], x["v"], cp, "auto")[1] == "backend 'triton': the Triton kernels"


@pytest.mark.parametrize("fla_options", [False, True])
def test_local_forward_after_the_exchange(monkeypatch, fla_options):
    """The pass's other form (CPOp.local_fwd, the gluon backend's fused forward on sm_90a): stage 2 for the summary
    alone, the exchange, then the rank's whole forward with its incoming state. Here the local forward is the Triton
    forward (the Gluon one does not run on a CPU): world 3 with a spanned rank, 1-token and empty sequences, fp32,
    initial and final states (with FLA's options: its gate and beta sigmoid, states [N, HV, V, K]); against fp64 and
    the one-process call."""
    import dataclasses
    from linattn.distributed import chunk
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd

    def local_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, A_log, dt_bias, opts, n_loc):
        res = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, h0, output_final_state, None if n_loc == 1 else cu,
                                         A_log=A_log, dt_bias=dt_bias, **opts)
        return res.o, res.final_state

    op = dataclasses.replace(chunk.GDN, local_fwd=local_fwd)
    monkeypatch.setattr(chunk, "gdn_cp_op", lambda q, v, cp, backend: (op, "test: the local forward"))
    case = _case([30, 160, 1, 0, 49, 0], 3, torch.float32, True, True, fla_options=fla_options)
    exp = _expected(case)
    _check(case, exp, _run_world(3, [case])[0], 3)


def test_summary_stage2_allocates_no_state_buffers():
    """The summary's stage 2 (chunk_gated_delta_rule_fwd with state_buffers=False): the hook gets the same k, w, u and
    gcum as a call with the buffers and None for h and vnew (at B1 T131072 HV32 K = V = 128 those would be 3.2 GB
    allocated for nothing); state_buffers=False without a hook, or with the output asked for, is refused."""
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    x = make_gdn_inputs(1, 150, H, HV, K, V, dtype=torch.float32, device="cpu")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"], False, None)
    got = {}

    def hook(name):
        def state_pass(k_, w, u, gcum, h, vnew, h0, final, plan):
            got[name] = (w.clone(), u.clone(), gcum.clone(), h, vnew)
        return state_pass

    chunk_gated_delta_rule_fwd(*args, compute_output=False, state_buffers=False, state_pass=hook("bare"))
    chunk_gated_delta_rule_fwd(*args, compute_output=False, state_pass=hook("full"))
    w, u, gcum, h, vnew = got["bare"]
    assert h is None and vnew is None
    assert got["full"][3] is not None and got["full"][4] is not None
    for a, b in zip((w, u, gcum), got["full"][:3]):
        assert torch.equal(a, b)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    with pytest.raises(ValueError, match="state_buffers"):
        chunk_gated_delta_rule_fwd(*args, compute_output=False, state_buffers=False)
    with pytest.raises(ValueError, match="state_buffers"):
        chunk_gated_delta_rule_fwd(*args, state_buffers=False, state_pass=hook("x"))
