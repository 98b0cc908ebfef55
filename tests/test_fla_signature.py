"""FLA 0.6's signature of chunk_gated_delta_rule: FLA's parameters in FLA's order with FLA's defaults (read from
fla/ops/gated_delta_rule/chunk.py of fla-core 0.6.0; FLA is not installed here, so its signature is data below),
linattn's `backend` keyword-only after them. FLA's options linattn does not run yet raise an error naming the
argument; at their defaults every option is accepted and changes nothing. Fresh random inputs each run."""
import inspect

import pytest
import torch

import linattn
from linattn.testing import make_gdn_inputs

# fla.ops.gated_delta_rule.chunk_gated_delta_rule (fla-core 0.6.0): positional-or-keyword parameters and defaults
FLA_CHUNK = [("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
             ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
             ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("state_v_first", False),
             ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("chunk_indices", None), ("cp_context", None)]
# ... and the keywords it reads from **kwargs, with their defaults
FLA_CHUNK_KWARGS = {"use_gate_in_kernel": False, "A_log": None, "dt_bias": None, "chunk_size": 64}
NO_DEFAULT = inspect.Parameter.empty


def test_chunk_signature_is_flas():
    params = list(inspect.signature(linattn.chunk_gated_delta_rule).parameters.values())
    head = params[:len(FLA_CHUNK)]
    assert [p.name for p in head] == [n for n, _ in FLA_CHUNK]
    for p, (name, default) in zip(head, FLA_CHUNK):
        assert p.kind == p.POSITIONAL_OR_KEYWORD, name
        assert p.default is (NO_DEFAULT if name in ("q", "k", "v", "g", "beta") else default) or \
            p.default == default, (name, p.default)
    rest = {p.name: p for p in params[len(FLA_CHUNK):]}
    for name, default in FLA_CHUNK_KWARGS.items():
        assert rest[name].kind == rest[name].KEYWORD_ONLY and rest[name].default == default, name
    assert rest["backend"].kind == rest["backend"].KEYWORD_ONLY and rest["backend"].default == "auto"


def _inputs(seed):
    x = make_gdn_inputs(1, 150, 2, 4, 32, 32, dtype=torch.float32, initial_state=True,
                        generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, 70, 150], dtype=torch.int64)
    x["initial_state"] = torch.randn(2, 4, 32, 32)
    return x, cu


def test_fla_keywords_at_their_defaults_change_nothing():
    """FLA's call, every keyword spelled out at its default plus FLA's precomputed metadata (cu_seqlens_cpu,
    chunk_indices: not needed by linattn), gives the plain call's o and final state exactly; FLA's positional order
    puts use_qk_l2norm_in_kernel ninth."""
    x, cu = _inputs(torch.seed() % 2 ** 31)
    o0, h0 = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=True)
    chunk_indices = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    o1, h1 = linattn.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True, True, False, False, False, cu,
        cu.cpu(), chunk_indices, None, use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)
    assert torch.isfinite(o0).all() and o0.abs().max() > 0


@pytest.mark.parametrize("kw,name", [
    (dict(use_beta_sigmoid_in_kernel=True), "use_beta_sigmoid_in_kernel"),
    (dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), "use_beta_sigmoid_in_kernel"),
    (dict(state_v_first=True), "state_v_first"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4)), "use_gate_in_kernel"),
    (dict(cp_context=object()), "cp_context"),
    (dict(chunk_size=32), "chunk_size"),
])
def test_options_linattn_does_not_run_yet_are_refused_by_name(kw, name):
    x, cu = _inputs(1)
    linattn.chunk_gated_delta_rule(**x, cu_seqlens=cu)                # the same call without the option runs
    with pytest.raises(NotImplementedError, match=name):
        linattn.chunk_gated_delta_rule(**x, cu_seqlens=cu, **kw)


@pytest.mark.parametrize("kw,match", [(dict(allow_neg_eigval=True), "use_beta_sigmoid_in_kernel"),
                                      (dict(use_gate_in_kernel=True), "A_log"),
                                      (dict(A_log=torch.zeros(4)), "use_gate_in_kernel"),
                                      (dict(chunk_size=48), "chunk_size")])
def test_flas_argument_errors(kw, match):
    x, cu = _inputs(2)
    with pytest.raises(ValueError, match=match):
        linattn.chunk_gated_delta_rule(**x, cu_seqlens=cu, **kw)
