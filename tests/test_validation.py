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
