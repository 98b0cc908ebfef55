"""The decode op's serving conventions on the Triton path (TRITON_INTERPRET=1 on a CPU): speculative decoding
(a 2-D state_indices with num_accepted_tokens, every intermediate state written in place), the padding slot in
both conventions (negative indices; vLLM's pad_slot_id=0), state_v_first pools and states, bf16 pools,
allow_neg_eigval, FLA's mixed q/k/v dtypes and FLA's fp32 final state; bad serving inputs raising errors that
name the argument. Expectations are written out from the fp64 token-by-token reference (naive_recurrent); pools
start as NaN except for the slots that are read, so a wrong read shows as NaN and a wrong write changes the bits
of a slot that must stay untouched. Fresh random inputs every run."""
import os

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.gated_delta_rule.fused_recurrent import (
    fused_recurrent_gated_delta_rule as decode, fused_recurrent_reference)
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.gated_delta_rule.triton.fused_recurrent import fused_recurrent_gdn_fwd
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, poison_, random_cu_seqlens

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernel needs TRITON_INTERPRET=1 on a CPU")

F32 = TOL[torch.float32]
BF16_STATE = 4e-3            # one bf16 rounding of a freshly written state (< 2^-9 relative), as test_fused_recurrent
H, HV, K, V = 2, 4, 16, 32   # GVA; K != V so that a transposed layout cannot pass by accident


@pytest.fixture(autouse=True)
def _poisoned():
    with poisoned_allocations():
        yield


def _f64(d):
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in d.items()}


def _inputs(B, T, dtype=torch.float32):
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, initial_state=False)
    del x["initial_state"]
    return x


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _stored(s, v_first):
    """A [.., K, V] state in the stored layout."""
    return s.transpose(-1, -2) if v_first else s


def _nan_pool(slots, dtype, v_first, live):
    """A pool of NaN with random finite states in the slots of `live` (the ones the call reads)."""
    shape = (slots, HV, V, K) if v_first else (slots, HV, K, V)
    pool = torch.full(shape, float("nan"), dtype=dtype)
    for s in live:
        pool[s] = (torch.randn(shape[1:]) * 0.5).to(dtype)
    return pool


def _sequence(x, n, cu, T):
    """Sequence n's inputs as a batch of one."""
    s, e = (int(cu[n]), int(cu[n + 1])) if cu is not None else (0, T)
    b = 0 if cu is not None else n
    return {name: x[name][b:b + 1, s:e] for name in ("q", "k", "v", "g", "beta")}


# ---------------------------------------------------------------------------------------- speculative decoding
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("state_dtype,v_first", [(torch.float32, False), (torch.bfloat16, True)])
def test_spec_decode_in_place_writes_every_token_state(varlen, state_dtype, v_first):
    """5 sequences, T_max = 4 index columns, num_accepted_tokens 1..4 across the rows: each live row starts from
    slot idx[n, nat[n] - 1] and leaves the state after its token t in slot idx[n, t]. Row 3 is padded (its read
    slot is -1); row 1 has a padded write entry (its token 1's state goes nowhere). Every other slot stays NaN,
    bit for bit."""
    lengths = [3, 2, 1, 4, 3] if varlen else [3] * 5
    N, T_max, slots = len(lengths), 4, 24
    cu = random_cu_seqlens(lengths) if varlen else None
    x = _inputs(1, sum(lengths)) if varlen else _inputs(N, 3)
    T = x["q"].shape[1]
    perm = torch.randperm(slots)
    idx = perm[:N * T_max].view(N, T_max).clone()
    nat = torch.tensor([1, 4, 2, 3, 3])
    idx[1, 1] = -1                                   # a padded write entry in a live row
    idx[3, nat[3] - 1] = -1                          # row 3 reads from a padded entry: a padded row
    reads = [int(idx[n, nat[n] - 1]) for n in range(N) if n != 3]
    pool = _nan_pool(slots, state_dtype, v_first, reads)
    before = pool.clone()

    o, ret = decode(**x, initial_state=pool, state_indices=idx, num_accepted_tokens=nat, inplace=True,
                    cu_seqlens=cu, state_v_first=v_first)
    assert ret is pool

    written = set()
    tol_s = F32 if state_dtype == torch.float32 else BF16_STATE
    for n in range(N):
        seq = _sequence(x, n, cu, T)
        s, e = (int(cu[n]), int(cu[n + 1])) if varlen else (0, T)
        b = 0 if varlen else n
        if n == 3:
            assert torch.equal(o[b, s:e], torch.zeros_like(o[b, s:e])), "a padded row's output is zeros"
            continue
        h0 = _stored(before[int(idx[n, nat[n] - 1])].double(), v_first)[None]
        ro, _, states = naive_recurrent(**_f64(seq), initial_state=h0, output_final_state=True,
                                        output_token_states=True)
        assert_close(f"o of sequence {n}", o[b:b + 1, s:e], ro, F32)
        for t in range(e - s):
            slot = int(idx[n, t])
            if slot < 0:
                continue
            written.add(slot)
            assert_close(f"slot {slot} (sequence {n}, token {t})", _stored(pool[slot].double(), v_first),
                         states[0][t], tol_s)
    assert written, "the case must write slots"
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(_bits(pool[untouched]), _bits(before[untouched])), "a slot that must stay untouched changed"

    # the reference backend implements the same convention
    ref_pool = before.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, num_accepted_tokens=nat,
                                      inplace=True, cu_seqlens=cu, state_v_first=v_first)
    assert_close("o vs the reference backend", o, ro, F32)
    assert_close("pool vs the reference backend", pool[sorted(written)].double(), ref_pool[sorted(written)], tol_s)
    assert torch.allclose(ref_pool[untouched], before[untouched].double(), rtol=0, atol=0, equal_nan=True)


def test_spec_decode_without_num_accepted_reads_column_zero_and_out_of_place_returns_last_states():
    """2-D indices without num_accepted_tokens read column 0. Out of place the pool is only read (bit for bit)
    and final_state is a new fp32 [N, HV, V, K] tensor (state_v_first) with each sequence's last state; a padded
    row's final state and output are zeros. Without cu_seqlens T_max may exceed T."""
    N, T, T_max, slots = 3, 2, 3, 12
    x = _inputs(N, T)
    idx = torch.randperm(slots)[:N * T_max].view(N, T_max).clone()
    idx[2, 0] = -1
    pool = _nan_pool(slots, torch.float32, True, [int(idx[0, 0]), int(idx[1, 0])])
    before = pool.clone()
    o = poison_(torch.empty_like(x["v"]))
    ht = poison_(torch.empty(N, HV, V, K))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, None, None, False,
                            False, True, False, out=o, final_out=ht, state_v_first=True)
    assert torch.equal(_bits(pool), _bits(before))
    for n in range(2):
        h0 = _stored(before[int(idx[n, 0])].double(), True)[None]
        ro, rht = naive_recurrent(**_f64(_sequence(x, n, None, T)), initial_state=h0, output_final_state=True)
        assert_close(f"o {n}", o[n:n + 1], ro, F32)
        assert_close(f"final state {n}", _stored(ht[n].double(), True), rht[0], F32)
    assert torch.equal(o[2], torch.zeros_like(o[2])) and torch.equal(ht[2], torch.zeros_like(ht[2]))
    _, ht2 = decode(**x, initial_state=pool, state_indices=idx, output_final_state=True, state_v_first=True)
    assert ht2.dtype == torch.float32 and ht2.shape == (N, HV, V, K) and torch.equal(ht2, ht)


# ------------------------------------------------------------------------------------------------------ padding
@pytest.mark.parametrize("kernel", ["one_tile", "persistent"])
@pytest.mark.parametrize("pad_slot_id", [None, 0])
def test_padding_conventions(kernel, pad_slot_id):
    """Default: negative indices are padding and slot 0 is a live slot. pad_slot_id=0 (vLLM's null block): index
    0 is padding too, and negative indices still are. A padded row's output is zeros and it reads and writes no
    slot (slot 0 starts as NaN in the vLLM convention, so a read of it would show)."""
    N, slots = 5, 8
    x = _inputs(N, 1)
    idx = torch.tensor([3, 0, -1, 6, 0 if pad_slot_id == 0 else 5])
    padded = [n for n in range(N) if idx[n] < 0 or (pad_slot_id == 0 and idx[n] == 0)]
    live = [n for n in range(N) if n not in padded]
    pool = _nan_pool(slots, torch.float32, False, [int(idx[n]) for n in live])
    before = pool.clone()
    o = poison_(torch.empty_like(x["v"]))
    config = (16, 1, 1, 1) if kernel == "persistent" else None
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, None, None,
                            False, False, False, True, config=config, out=o,
                            pad_slot_id=-1 if pad_slot_id is None else pad_slot_id)
    for n in padded:
        assert torch.equal(o[n], torch.zeros_like(o[n]))
    for n in live:
        ro, rht = naive_recurrent(**_f64(_sequence(x, n, None, 1)), initial_state=before[int(idx[n])].double()[None],
                                  output_final_state=True)
        assert_close(f"o {n}", o[n:n + 1], ro, F32)
        assert_close(f"slot {int(idx[n])}", pool[int(idx[n])], rht[0], F32)
    untouched = [s for s in range(slots) if s not in {int(idx[n]) for n in live}]
    assert torch.equal(_bits(pool[untouched]), _bits(before[untouched]))
    # the public function (and the reference backend) under the same convention
    pool2 = before.clone()
    o2, _ = decode(**x, initial_state=pool2, state_indices=idx, inplace=True, pad_slot_id=pad_slot_id)
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=before.double(), state_indices=idx, inplace=True,
                                      pad_slot_id=pad_slot_id)
    assert_close("o (public)", o2[live], ro[live], F32)
    assert torch.equal(o2[padded], torch.zeros_like(o2[padded]))
    assert torch.equal(ro[padded], torch.zeros_like(ro[padded]))
    assert torch.equal(_bits(pool2[untouched]), _bits(before[untouched]))


# ------------------------------------------------------------------------------------------------ state layout
@pytest.mark.parametrize("kernel", ["one_tile", "persistent"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_v_first_pool(kernel, state_dtype):
    """A [slots, HV, V, K] pool (FLA's and vLLM's layout) in fp32 and bf16, updated in place: the kernel reads
    and writes the transposed state; the [K, V] result transposed is the reference's."""
    N, slots = 4, 7
    x = _inputs(N, 1)
    idx = torch.tensor([5, 0, -1, 2])
    pool = _nan_pool(slots, state_dtype, True, [5, 0, 2])
    before = pool.clone()
    o = poison_(torch.empty_like(x["v"]))
    config = (16, 1, 1, 1) if kernel == "persistent" else None
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, None, None,
                            False, False, False, True, config=config, out=o, state_v_first=True)
    tol_s = F32 if state_dtype == torch.float32 else BF16_STATE
    for n, s in ((0, 5), (1, 0), (3, 2)):
        h0 = _stored(before[s].double(), True)[None]
        ro, rht = naive_recurrent(**_f64(_sequence(x, n, None, 1)), initial_state=h0, output_final_state=True)
        assert_close(f"o {n}", o[n:n + 1], ro, F32)
        assert_close(f"slot {s}", _stored(pool[s].double(), True), rht[0], tol_s)
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    assert torch.equal(_bits(pool[[1, 3, 4, 6]]), _bits(before[[1, 3, 4, 6]]))


@pytest.mark.parametrize("inplace", [False, True])
def test_state_v_first_without_indices_and_fla_final_state_dtype(inplace):
    """initial_state [N, HV, V, K] in bf16: out of place the final state is a new fp32 [N, HV, V, K] tensor (FLA
    returns fp32 whatever the initial state's dtype); in place the bf16 initial state is overwritten."""
    N, T = 2, 3
    x = _inputs(N, T)
    h0 = (torch.randn(N, HV, V, K) * 0.5).to(torch.bfloat16)
    h = h0.clone()
    o, ht = decode(**x, initial_state=h, output_final_state=True, inplace=inplace, state_v_first=True)
    ro, rht = naive_recurrent(**_f64(x), initial_state=_stored(h0.double(), True), output_final_state=True)
    assert_close("o", o, ro, F32)
    if inplace:
        assert ht is h and h.dtype == torch.bfloat16
        assert_close("state in place", _stored(h.double(), True), rht, BF16_STATE)
    else:
        assert ht.dtype == torch.float32 and ht.shape == (N, HV, V, K)
        assert_close("final state", _stored(ht.double(), True), rht, F32)
        assert torch.equal(h, h0)


def test_transpose_state_layout_is_state_v_first():
    x = _inputs(2, 1)
    h0 = torch.randn(2, HV, V, K)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o1, h1 = decode(**x, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    o2, h2 = decode(**x, initial_state=h0, output_final_state=True, state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


# ------------------------------------------------------------------------------------- beta and input dtypes
@pytest.mark.parametrize("kernel", ["one_tile", "persistent"])
def test_allow_neg_eigval(kernel):
    """FLA's allow_neg_eigval with the beta sigmoid: beta = 2 sigmoid(logit), in (0, 2), through the fused gate."""
    N, slots = 4, 6
    x = _inputs(N, 1)
    x["beta"] = torch.randn_like(x["beta"]) * 2                      # logits
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    x["g"] = torch.randn_like(x["g"])                                # the raw gate input
    idx = torch.tensor([4, 1, 0, 3])
    pool = torch.randn(slots, HV, K, V)
    ref_pool = pool.double()
    if kernel == "persistent":
        o = poison_(torch.empty_like(x["v"]))
        fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, A_log, dt_bias,
                                False, True, False, True, config=(16, 1, 1, 1), out=o, allow_neg_eigval=True)
    else:
        o, _ = decode(**x, initial_state=pool, state_indices=idx, inplace=True, use_gate_in_kernel=True, A_log=A_log,
                      dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    x64 = _f64(x)
    x64["g"] = -torch.exp(A_log.double()) * F.softplus(x64["g"] + dt_bias.double())
    x64["beta"] = 2 * torch.sigmoid(x64["beta"])
    ro, rht = naive_recurrent(**x64, initial_state=ref_pool[idx], output_final_state=True)
    assert_close("o", o, ro, F32)
    assert_close("pool", pool[idx].double(), rht, F32)
    wo, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True,
                                      A_log=A_log.double(), dt_bias=dt_bias.double(), beta_sigmoid=True,
                                      allow_neg_eigval=True)
    assert_close("reference backend o", wo, ro, 1e-12)


@pytest.mark.parametrize("qk,v,beta", [(torch.float32, torch.float16, torch.float16),     # FLA's test mix
                                       (torch.bfloat16, torch.float32, torch.float32)])
def test_mixed_input_dtypes(qk, v, beta):
    """q/k and v of different dtypes, as FLA accepts: read and computed in fp32; o in v's dtype, the final state
    fp32. Against fp64 from the same (rounded) inputs, at the tolerance of o's dtype."""
    N, T = 3, 2
    x = make_gdn_inputs(N, T, H, HV, K, V, dtype=torch.float32)
    x["q"], x["k"], x["v"], x["beta"] = x["q"].to(qk), x["k"].to(qk), x["v"].to(v), x["beta"].to(beta)
    o, ht = decode(**x, output_final_state=True)
    assert o.dtype == v and ht.dtype == torch.float32
    ro, rht = naive_recurrent(**_f64(x), output_final_state=True)
    assert_close("o", o, ro, TOL[v])
    assert_close("final state", ht, rht, F32)


def test_serving_options_through_the_custom_ops():
    """The traced path (torch custom ops with their fake implementations) takes the serving options:
    torch.compile(fullgraph=True) of a speculative in-place step with pad_slot_id=0 and state_v_first equals the
    eager call bit for bit."""
    N, T, T_max, slots = 3, 2, 3, 12
    x = _inputs(N, T)
    idx = torch.randperm(slots - 1)[:N * T_max].view(N, T_max) + 1
    idx[2, 1] = 0                                          # a padded row: it reads column 1 (num_accepted 2)
    nat = torch.tensor([3, 1, 2])
    pool0 = torch.randn(slots, HV, V, K)
    want = pool0.clone()
    wo, _ = decode(**x, initial_state=want, state_indices=idx, num_accepted_tokens=nat, inplace=True, pad_slot_id=0,
                   state_v_first=True)

    def step(q, k, v, g, beta, pool, idx, nat):
        o, _ = decode(q, k, v, g, beta=beta, initial_state=pool, state_indices=idx, num_accepted_tokens=nat,
                      inplace=True, pad_slot_id=0, state_v_first=True)
        return o

    torch._dynamo.reset()
    pool = pool0.clone()
    o = torch.compile(step, fullgraph=True)(**x, pool=pool, idx=idx, nat=nat)
    assert torch.equal(o, wo) and torch.equal(pool, want)
    assert torch.equal(o[2], torch.zeros_like(o[2]))


# -------------------------------------------------------------------------------------------------- bad inputs
def test_bad_serving_inputs_name_the_argument():
    N, T = 2, 2
    x = _inputs(N, T)
    pool = torch.randn(6, HV, K, V)
    i2 = torch.tensor([[0, 1], [2, 3]])
    cases = [
        (dict(state_indices=torch.zeros(2, 2, 1, dtype=torch.int64)), ValueError, r"state_indices must be \[N\]"),
        (dict(state_indices=torch.tensor([[0], [1]])), ValueError, "T_max >= T"),
        (dict(state_indices=torch.tensor([0, 1]), num_accepted_tokens=torch.tensor([1, 1])), ValueError,
         "num_accepted_tokens needs a 2-D state_indices"),
        (dict(state_indices=i2, num_accepted_tokens=torch.tensor([1, 1, 1])), ValueError,
         r"num_accepted_tokens must be \[N\]"),
        (dict(state_indices=i2, num_accepted_tokens=torch.tensor([1.0, 1.0])), ValueError,
         "num_accepted_tokens must be int32 or int64"),
        (dict(state_indices=i2, num_accepted_tokens=torch.tensor([0, 1])), ValueError,
         r"num_accepted_tokens must be in \[1, T_max"),
        (dict(state_indices=i2, num_accepted_tokens=torch.tensor([1, 3])), ValueError,
         r"num_accepted_tokens must be in \[1, T_max"),
        (dict(state_indices=torch.tensor([[0, 1], [2, 6]]), inplace=True), ValueError,
         r"state_indices \[6\] out of range"),
        (dict(state_indices=torch.tensor([[0, 1], [2, 1]]), inplace=True), ValueError, "twice"),
        (dict(state_indices=torch.tensor([0, 1]), pad_slot_id=1.0), TypeError, "pad_slot_id must be an int"),
        (dict(state_indices=torch.tensor([0, 7]), pad_slot_id=0), ValueError, "out of range.*pad_slot_id"),
        (dict(initial_state=torch.randn(N, HV, K, V), state_v_first=True), ValueError,
         r"initial_state must be \[.., HV, V, K\] \(state_v_first\)"),
        (dict(state_indices=torch.tensor([0, 1]), state_v_first=True), ValueError,
         r"state pool \(initial_state\) must be \[.., HV, V, K\]"),
    ]
    for extra, err, msg in cases:
        kw = dict(initial_state=pool) if "state_indices" in extra else {}
        kw.update(extra)
        before = pool.clone()
        with pytest.raises(err, match=msg):
            decode(**x, **kw)
        assert torch.equal(pool, before), msg
    with pytest.raises(ValueError, match="num_accepted_tokens needs a 2-D state_indices"):
        decode(**x, num_accepted_tokens=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="pad_slot_id names a padding index of state_indices"):
        decode(**x, pad_slot_id=0)
    # varlen: a sequence longer than the index row
    xv = _inputs(1, 4)
    with pytest.raises(ValueError, match="cu_seqlens has a sequence of 3 tokens"):
        decode(**xv, cu_seqlens=random_cu_seqlens([1, 3]), initial_state=pool, state_indices=i2, inplace=True)
    with pytest.raises(ValueError, match="persistent decode kernel"):
        fused_recurrent_gdn_fwd(x["q"][:, :1], x["k"][:, :1], x["v"][:, :1], x["g"][:, :1], x["beta"][:, :1], 0.25,
                                pool, None, i2, None, None, False, False, False, True, config=(16, 1, 1, 1))
