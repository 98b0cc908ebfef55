"""FLA 0.6's signatures of chunk_gated_delta_rule and fused_recurrent_gated_delta_rule: FLA's parameters in FLA's
order with FLA's defaults (read from fla/ops/gated_delta_rule/chunk.py and fused_recurrent.py of fla-core 0.6.0;
FLA is not installed here, so its signatures are data below), the keywords FLA reads from **kwargs and linattn's
extras keyword-only after them. At their defaults FLA's options change nothing; the ones linattn runs (the chunk op's
in-kernel gate, beta sigmoid and state_v_first; the decode's fused gate and beta sigmoid, beta=None) give the
explicit computation's result (tests/test_fla_options.py checks the chunk op's against fp64, gradients included);
the ones it does not run yet raise an error naming the argument. o comes back in FLA's dtype. Fresh random inputs each run (Triton under the
interpreter on a CPU)."""
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.testing import TOL, assert_close, make_gdn_inputs

F32 = TOL[torch.float32]
REQUIRED = inspect.Parameter.empty

# fla.ops.gated_delta_rule.chunk_gated_delta_rule (fla-core 0.6.0): parameters, in order, with their defaults
FLA_CHUNK = [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", REQUIRED), ("beta", REQUIRED),
             ("scale", None), ("initial_state", None), ("output_final_state", False),
             ("use_qk_l2norm_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
             ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("chunk_indices", None),
             ("cp_context", None)]
# ... and the keywords it reads from **kwargs, with their defaults (transpose_state_layout: absent in FLA)
FLA_CHUNK_KWARGS = {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None, "chunk_size": 64,
                    "transpose_state_layout": None}
CHUNK_EXTRAS = {"backend": "auto"}

# fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule (fla-core 0.6.0)
FLA_DECODE = [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", None), ("gk", None), ("gv", None),
              ("beta", None), ("scale", None), ("initial_state", None), ("output_final_state", False),
              ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False), ("A_log", None), ("dt_bias", None),
              ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("state_v_first", False),
              ("cu_seqlens", None)]
FLA_DECODE_KWARGS = {"transpose_state_layout": None}
DECODE_EXTRAS = {"state_indices": None, "inplace": False, "num_accepted_tokens": None, "pad_slot_id": None,
                 "beta_sigmoid": False, "backend": "auto"}


def _check_signature(fn, fla, fla_kwargs, extras):
    params = list(inspect.signature(fn).parameters.values())
    head = params[:len(fla)]
    assert [p.name for p in head] == [n for n, _ in fla]
    for p, (name, default) in zip(head, fla):
        assert p.kind == p.POSITIONAL_OR_KEYWORD, name
        assert p.default is default or (default is not REQUIRED and p.default == default
                                        and type(p.default) is type(default)), (name, p.default)
    rest = params[len(fla):]
    assert all(p.kind == p.KEYWORD_ONLY for p in rest), [p.name for p in rest]
    assert {p.name: p.default for p in rest} == {**fla_kwargs, **extras}


def test_chunk_signature_is_flas():
    _check_signature(linattn.chunk_gated_delta_rule, FLA_CHUNK, FLA_CHUNK_KWARGS, CHUNK_EXTRAS)


def test_decode_signature_is_flas():
    _check_signature(linattn.fused_recurrent_gated_delta_rule, FLA_DECODE, FLA_DECODE_KWARGS, DECODE_EXTRAS)


# ------------------------------------------------------------------------------------------------------- chunk
def _chunk_inputs():
    x = make_gdn_inputs(1, 90, 2, 4, 16, 16, dtype=torch.float32, num_states=2)
    return x, torch.tensor([0, 40, 90], dtype=torch.int64)


def test_chunk_fla_keywords_at_their_defaults_change_nothing():
    """FLA's positional call, every keyword spelled out at its default plus FLA's precomputed metadata
    (cu_seqlens_cpu, chunk_indices: ignored), gives the plain keyword call's o and final state bit for bit."""
    x, cu = _chunk_inputs()
    o0, h0 = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=True)
    chunk_indices = torch.tensor([[0, 0], [1, 0]])       # FLA's (sequence, chunk) table at chunk_size 64
    o1, h1 = linattn.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True, True, False, False, False, cu,
        cu.cpu(), chunk_indices, None, use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64)
    assert_close("o", o1, o0, 0.0)
    assert_close("final state", h1, h0, 0.0)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("kw", [
    dict(use_beta_sigmoid_in_kernel=True), dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    dict(use_gate_in_kernel=True, A_log=torch.randn(4)), dict(use_gate_in_kernel=True, A_log=torch.randn(4),
                                                              dt_bias=torch.randn(4)),
], ids=["beta-sigmoid", "neg-eigval", "gate", "gate-dt-bias"])
def test_chunk_gate_and_beta_options_run(kw, backend):
    """FLA's in-kernel options run (on each backend): the explicit gate / sigmoid on the default path's result."""
    x, cu = _chunk_inputs()
    gate = kw.get("use_gate_in_kernel", False)
    raw_g = torch.randn_like(x["g"]) if gate else x["g"]           # the raw gate input, else the log decay
    logits = torch.randn_like(x["beta"]) * 2 if kw.get("use_beta_sigmoid_in_kernel") else x["beta"]
    o, h = linattn.chunk_gated_delta_rule(**dict(x, g=raw_g, beta=logits), output_final_state=True, cu_seqlens=cu,
                                          backend=backend, **kw)
    g, beta = raw_g, logits
    if gate:
        g = -torch.exp(kw["A_log"]) * F.softplus(raw_g + kw.get("dt_bias", 0.))
    if kw.get("use_beta_sigmoid_in_kernel"):
        beta = torch.sigmoid(logits) * (2 if kw.get("allow_neg_eigval") else 1)
    o0, h0 = linattn.chunk_gated_delta_rule(**dict(x, g=g, beta=beta), output_final_state=True, cu_seqlens=cu,
                                            backend=backend)
    assert_close("o", o, o0, F32)
    assert_close("final state", h, h0, F32)


@pytest.mark.parametrize("kw,match", [(dict(allow_neg_eigval=True), "allow_neg_eigval.*use_beta_sigmoid_in_kernel"),
                                      (dict(use_gate_in_kernel=True), "use_gate_in_kernel.*A_log"),
                                      (dict(A_log=torch.zeros(4)), "A_log.*use_gate_in_kernel"),
                                      (dict(chunk_size=8), "`chunk_size` must be one of 16, 32 or 64.*got 8"),
                                      (dict(chunk_size=48), "`chunk_size` must be one of 16, 32 or 64.*got 48")])
def test_chunk_argument_errors(kw, match):
    x, cu = _chunk_inputs()
    with pytest.raises(ValueError, match=match):
        linattn.chunk_gated_delta_rule(**x, cu_seqlens=cu, **kw)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_fla_chunk_sizes_give_the_64_token_result(chunk_size):
    """FLA's other chunk sizes run linattn's 64-token chunks: the same output and final state, bit for bit."""
    x, cu = _chunk_inputs()
    o0, h0 = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu)
    o1, h1 = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, chunk_size=chunk_size)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)


@pytest.mark.parametrize("fn", ["chunk", "decode"])
def test_transpose_state_layout_is_state_v_first(fn):
    """FLA's deprecated name: warns as FLA; True is state_v_first (both ops run it); both at once are refused; False
    changes nothing."""
    if fn == "chunk":
        x, cu = _chunk_inputs()
        op = lambda **kw: linattn.chunk_gated_delta_rule(**x, cu_seqlens=cu, **kw)   # noqa: E731
    else:
        x = make_gdn_inputs(2, 1, 1, 2, 16, 16, dtype=torch.float32)
        op = lambda **kw: linattn.fused_recurrent_gated_delta_rule(**x, **kw)        # noqa: E731
    x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()     # the V-first states
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o_t, h_t = op(transpose_state_layout=True, output_final_state=True)
    o_v, h_v = op(state_v_first=True, output_final_state=True)
    assert torch.equal(o_t, o_v) and torch.equal(h_t, h_v)
    x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    with pytest.raises(ValueError, match="transpose_state_layout"):
        op(transpose_state_layout=True, state_v_first=True)
    with pytest.warns(DeprecationWarning):
        o1, _ = op(transpose_state_layout=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        o0, _ = op()
    assert not [w for w in seen if "transpose_state_layout" in str(w.message)]
    assert torch.equal(o0, o1)


# ------------------------------------------------------------------------------------------------------ decode
def test_decode_fla_keywords_at_their_defaults_change_nothing():
    x = make_gdn_inputs(3, 2, 1, 2, 16, 16, dtype=torch.float32)
    o0, h0 = linattn.fused_recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, h1 = linattn.fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], None, None, x["beta"], None, x["initial_state"], True, True, False, None,
        None, False, False, False, None)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)
    assert_close("o", o1, o0, 0.0)


def test_decode_fused_gate_and_beta_sigmoid_spellings():
    """FLA's spelling (use_gate_in_kernel + A_log / dt_bias, use_beta_sigmoid_in_kernel) runs linattn's fused path:
    bit for bit the linattn spelling (A_log alone, beta_sigmoid), and the explicit gate and sigmoid's result."""
    x = make_gdn_inputs(3, 2, 1, 2, 16, 16, dtype=torch.float32)
    x["g"] = torch.randn(3, 2, 2)                      # the raw gate input
    A_log, dt_bias = torch.randn(2) * 0.5, torch.randn(2)
    o_fla, h_fla = linattn.fused_recurrent_gated_delta_rule(
        **x, output_final_state=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True)
    o_old, h_old = linattn.fused_recurrent_gated_delta_rule(**x, output_final_state=True, A_log=A_log,
                                                            dt_bias=dt_bias, beta_sigmoid=True)
    assert torch.equal(o_fla, o_old) and torch.equal(h_fla, h_old)
    explicit = dict(x, g=-torch.exp(A_log) * F.softplus(x["g"] + dt_bias), beta=torch.sigmoid(x["beta"]))
    o_ref, h_ref = linattn.fused_recurrent_gated_delta_rule(**explicit, output_final_state=True)
    assert_close("o (fused gate, beta sigmoid)", o_fla, o_ref, F32)
    assert_close("final state", h_fla, h_ref, F32)


def test_decode_beta_none_is_ones():
    x = make_gdn_inputs(2, 3, 1, 2, 16, 16, dtype=torch.float32)
    del x["beta"]
    o0, h0 = linattn.fused_recurrent_gated_delta_rule(**x, output_final_state=True)
    o1, h1 = linattn.fused_recurrent_gated_delta_rule(**x, beta=torch.ones(2, 3, 2), output_final_state=True)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)
    assert_close("o", o0, o1, 0.0)


@pytest.mark.parametrize("kw,name", [(dict(gv=torch.zeros(2, 1, 2, 16)), "gv")])
def test_decode_options_not_run_yet_are_refused_by_name(kw, name):
    x = make_gdn_inputs(2, 1, 1, 2, 16, 16, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match=f"{name} is not supported yet"):
        linattn.fused_recurrent_gated_delta_rule(**x, **kw)


@pytest.mark.parametrize("case,match", [("neg_eig", "allow_neg_eigval.*use_beta_sigmoid_in_kernel"),
                                        ("gate_no_A_log", "use_gate_in_kernel.*A_log"),
                                        ("gate_no_g", "use_gate_in_kernel.*g"),
                                        ("beta_fifth", "gk must be.*beta=")])
def test_decode_argument_errors(case, match):
    x = make_gdn_inputs(2, 1, 1, 2, 16, 16, dtype=torch.float32)
    fn = linattn.fused_recurrent_gated_delta_rule
    with pytest.raises(ValueError, match=match):
        if case == "neg_eig":
            fn(**x, allow_neg_eigval=True)
        elif case == "gate_no_A_log":
            fn(**x, use_gate_in_kernel=True)
        elif case == "gate_no_g":
            fn(**dict(x, g=None), use_gate_in_kernel=True, A_log=torch.zeros(2))
        else:                                          # linattn's old positional order: beta lands in gk
            fn(x["q"], x["k"], x["v"], x["g"], x["beta"])


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", ["chunk", "decode"])
def test_output_dtypes_are_flas(op, backend, dtype):
    """FLA: o in q's (= v's) dtype; the final state fp32, whatever the initial state's dtype."""
    if op == "chunk":
        x = make_gdn_inputs(1, 20, 1, 2, 16, 16, dtype=dtype, state_dtype=dtype)
        fn = linattn.chunk_gated_delta_rule
    else:
        x = make_gdn_inputs(2, 1, 1, 2, 16, 16, dtype=dtype, initial_state=False)
        fn = linattn.fused_recurrent_gated_delta_rule
    o, ht = fn(**x, output_final_state=True, backend=backend)
    assert o.dtype == x["q"].dtype == x["v"].dtype == dtype and ht.dtype == torch.float32
    if op == "decode":          # FLA's decode returns an fp32 final state for a bf16 initial state too
        h0 = torch.randn(2, 2, 16, 16).to(torch.bfloat16)
        _, ht = fn(**dict(x, initial_state=h0), output_final_state=True, backend=backend)
        assert ht.dtype == torch.float32
