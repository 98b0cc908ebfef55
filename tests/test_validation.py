"""Every bad input to chunk_gated_delta_rule gets a clear ValueError naming the problem."""
import pytest
import torch

import linattn
from linattn.backends import BackendError
from linattn.testing import make_gdn_inputs


def _x(**kw):
    return make_gdn_inputs(1, 8, 2, 4, 16, 16, dtype=torch.float32, **kw)


def _call(x, **kw):
    with torch.no_grad():
        return linattn.chunk_gated_delta_rule(**x, **kw)


def test_wrong_rank():
    x = _x()
    x["q"] = x["q"][0]
    with pytest.raises(ValueError, match="ranks"):
        _call(x)


def test_q_k_shape_mismatch():
    x = _x()
    x["k"] = x["k"][:, :, :1]
    with pytest.raises(ValueError, match="same shape"):
        _call(x)


def test_hv_not_multiple_of_h():
    x = make_gdn_inputs(1, 8, 2, 3, 16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        _call(x)


def test_head_size_too_large():
    x = make_gdn_inputs(1, 4, 1, 1, 300, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="head size K=300"):
        _call(x)


def test_gate_shape():
    x = _x()
    x["g"] = x["g"][:, :, :2]
    with pytest.raises(ValueError, match="g must be"):
        _call(x)


def test_mixed_qkv_dtypes():
    x = _x()
    x["v"] = x["v"].to(torch.float16)
    with pytest.raises(ValueError, match="one dtype"):
        _call(x)


def test_integer_qkv():
    x = _x()
    for n in ("q", "k", "v"):
        x[n] = x[n].to(torch.int32)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        _call(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_mismatched_devices():
    x = _x()
    x["v"] = x["v"].cuda()
    with pytest.raises(ValueError, match="is on"):
        _call(x)


def test_mismatched_devices_meta():
    # the meta device stands in for a second device on a CPU-only machine
    x = _x()
    x["beta"] = x["beta"].to("meta")
    with pytest.raises(ValueError, match="beta is on meta"):
        _call(x)


def test_initial_state_shape():
    x = _x()
    x["initial_state"] = x["initial_state"][:, :2]
    with pytest.raises(ValueError, match="initial_state must be"):
        _call(x)


def test_cu_seqlens_with_batch():
    x = make_gdn_inputs(2, 8, 1, 1, 16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="batch size must be 1"):
        _call(x, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))


@pytest.mark.parametrize("cu,msg", [([1, 4, 8], "start at 0"), ([0, 6, 4, 8], "sorted"), ([0, 4, 7], "end at T"),
                                    ([0.0, 8.0], "int32 or int64")])
def test_cu_seqlens_values(cu, msg):
    n = len(cu) - 1
    x = make_gdn_inputs(1, 8, 1, 1, 16, 16, dtype=torch.float32, num_states=n)
    dtype = torch.float32 if isinstance(cu[0], float) else torch.int32
    with pytest.raises(ValueError, match=msg):
        _call(x, cu_seqlens=torch.tensor(cu, dtype=dtype))


def test_initial_state_count_varlen():
    x = make_gdn_inputs(1, 8, 1, 1, 16, 16, dtype=torch.float32, num_states=1)
    with pytest.raises(ValueError, match="initial_state must be"):
        _call(x, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))


def test_unknown_backend():
    with pytest.raises(BackendError, match="unknown backend"):
        _call(_x(), backend="nope")


def _empty_call(B, T, H, HV, K, cu=None, backend="triton"):
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16)  # noqa: E731  (never read: refused before any kernel)
    x = dict(q=e(B, T, H, K), k=e(B, T, H, K), v=e(B, T, HV, K), g=torch.zeros(B, T, HV), beta=torch.ones(B, T, HV))
    with torch.no_grad():
        return linattn.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)


def test_gluon_declines_more_sequence_heads_than_its_grid_y(monkeypatch):
    """N * HV > 65535 (CUDA's grid-y limit, the Gluon state passes' axis 1): the gluon backend declines with the reason
    (so `auto` takes the Triton path, which numbers them on axis 0); 2047 sequences x 32 heads pass."""
    from linattn.ops.gated_delta_rule.gluon import backend as gluon_backend
    from linattn.ops.gated_delta_rule.validation import GLUON_GRID_Y_MAX, gluon_grid_problem
    import linattn.runtime.device as device
    N = GLUON_GRID_Y_MAX // 32 + 1                              # 2048 sequences of one token at HV = 32
    assert "2048 sequences x 32 value heads = 65536 sequence-heads > 65535" in gluon_grid_problem(N, 32)
    assert gluon_grid_problem(N - 1, 32) == ""
    monkeypatch.setattr(device, "hopper_gluon_ready", lambda *a, **kw: (True, ""))
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16)  # noqa: E731
    ok, reason = gluon_backend.supports(q=e(1, N, 2, 128), v=e(1, N, 32, 128), cu_seqlens=torch.arange(N + 1))
    assert not ok and "grid-y limit of the Gluon state passes" in reason
    ok, reason = gluon_backend.supports(q=e(1, N, 2, 128), v=e(1, N, 32, 128), cu_seqlens=torch.arange(N))
    assert ok, reason


def test_reference_backend_has_no_grid_limit():
    """The plain-PyTorch reference launches no kernel: the grid check does not apply to it."""
    N = 2048
    cu = torch.arange(N + 1, dtype=torch.int64)
    o, _ = _empty_call(1, N, 1, 32, 2, cu, backend="reference")
    assert o.shape == (1, N, 32, 2)


@pytest.mark.parametrize("name, value, match", [
    ("g", 0.5, r"g must be finite and <= 0 .* 1 > 0"),
    ("g", float("nan"), r"g must be finite and <= 0 .* 1 NaN"),
    ("g", float("-inf"), r"g must be finite and <= 0 .* 1 -inf"),
    ("beta", float("nan"), r"beta has 1 NaN"),
])
def test_invalid_gate_values_on_cpu(name, value, match):
    """CPU tensors: the gate values are read (no sync to avoid) and a bad one is refused by name before any kernel;
    g = 0 (no decay) is valid."""
    x = _x()
    x[name][0, 3, 1] = value
    with pytest.raises(ValueError, match=match):
        _call(x)
    x = _x()
    x["g"].zero_()
    from linattn.ops.gated_delta_rule.validation import check_gate_values
    check_gate_values(x["g"], x["beta"])


def test_decode_gate_may_be_a_raw_input():
    """The decode op's g may be the raw gate input of A_log: only NaN is refused there."""
    from linattn.ops.gated_delta_rule.validation import check_gdn_inputs
    x = _x()
    x["g"].fill_(2.0)
    check_gdn_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], gate_optional=True)
    x["g"][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="g must be free of NaN"):
        check_gdn_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], gate_optional=True)


def test_check_inputs_switch_reads_gpu_values(monkeypatch):
    """Off a CPU the gate values are read only with LINATTN_CHECK_INPUTS=1 (CHECK_GPU_VALUES, read at import):
    meta tensors stand in for GPU ones, a spy for the check."""
    from linattn.ops.gated_delta_rule import validation
    seen = []
    monkeypatch.setattr(validation, "check_gate_values", lambda g, beta, op, log_decay: seen.append(op))
    x = {k: (t.to("meta") if t is not None else None) for k, t in _x().items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    monkeypatch.setattr(validation, "CHECK_GPU_VALUES", False)
    validation.check_gdn_inputs(*args)
    assert seen == []
    monkeypatch.setattr(validation, "CHECK_GPU_VALUES", True)
    validation.check_gdn_inputs(*args)
    assert seen == ["chunk_gated_delta_rule"]
