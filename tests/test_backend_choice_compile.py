"""Backend choice inside torch.compile(fullgraph=True): `auto` runs each backend's supports() (and auto filter)
while Dynamo traces the model, so everything they read must be traceable (the Gluon probe's globals() and a pool's
data_ptr() % 16 broke the trace once). Here, on the CPU, the Gluon backends' device check is faked to say "Hopper" so that the
whole of their supports() runs under the trace, as it does on an H200."""
import pytest
import torch

from linattn.backends import op_backends


@pytest.fixture
def hopper(monkeypatch):
    from linattn.runtime import device
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    monkeypatch.setattr(device, "hopper_gluon_ready", lambda t, what, needs="": (True, ""))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decode_call(B, state_dtype, misalign=False):
    H = HV = 2
    K = V = 128
    e = lambda *s, dt=torch.bfloat16: torch.randn(*s).to(dt)  # noqa: E731
    n = (B + 2) * HV * K * V
    flat = torch.randn(n + 1).to(state_dtype)
    pool = (flat[1:] if misalign else flat[:-1]).view(B + 2, HV, K, V)
    return dict(q=e(B, 1, H, K), k=e(B, 1, H, K), v=e(B, 1, HV, V), g=-torch.rand(B, 1, HV),
                beta=torch.rand(B, 1, HV), initial_state=pool, state_indices=torch.arange(B, dtype=torch.int32),
                inplace=True, cu_seqlens=None)


def _traced_choice(op, call):
    """The backend `auto` picks for `call`, decided inside a fullgraph trace (and eagerly, for comparison)."""
    table = op_backends(op)
    names = table.names()
    tensors = {k: v for k, v in call.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in call.items() if not isinstance(v, torch.Tensor)}

    def f(marker, **ts):
        b = table.select("auto", **ts, **rest)
        return marker + names.index(b.name)

    eager = names[int(f(torch.zeros(()), **tensors).item())]
    traced = names[int(torch.compile(f, fullgraph=True)(torch.zeros(()), **tensors).item())]
    return eager, traced


def test_decode_choice_traces(hopper):
    eager, traced = _traced_choice("fused_recurrent_gated_delta_rule", _decode_call(32, torch.bfloat16))
    assert eager == traced == "gluon"
    eager, traced = _traced_choice("fused_recurrent_gated_delta_rule", _decode_call(32, torch.float32))
    assert eager == traced == "triton"


def test_decode_misaligned_pool(hopper):
    """Eagerly a pool TMA cannot address is refused with the reason; under a trace the address is unknown, so
    the Gluon op itself sends such a pool through the Triton kernel at run time, with the same result."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    from linattn.ops.gated_delta_rule.gluon import decode as gdec
    call = _decode_call(32, torch.bfloat16, misalign=True)
    assert call["initial_state"].data_ptr() % 16 != 0
    ok, why = op_backends("fused_recurrent_gated_delta_rule").backends["gluon"].supports(**call)
    assert not ok and "16-byte" in why
    pool_ref = call["initial_state"].clone()
    o_ref, _ = decode(**dict(call, initial_state=pool_ref), backend="triton")
    o = gdec._gluon_decode_op(call["q"], call["k"], call["v"], call["g"], call["beta"], 128 ** -0.5,
                              call["initial_state"], call["state_indices"], None, None, False)
    assert torch.equal(o, o_ref) and torch.equal(call["initial_state"], pool_ref)


def test_chunk_choice_traces(hopper):
    from linattn.ops.gated_delta_rule.gluon import backend
    T = backend.GLUON_AUTO_MIN_EAGER_TOKENS
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt)  # noqa: E731

    def call(T, HV, B=1):
        return dict(q=e(B, T, 2, 128), k=e(B, T, 2, 128), v=e(B, T, HV, 128), g=e(B, T, HV, dt=torch.float32),
                    beta=e(B, T, HV, dt=torch.float32), initial_state=None, cu_seqlens=None)

    assert _traced_choice("chunk_gated_delta_rule", call(T, 32)) == ("gluon", "gluon")
    assert _traced_choice("chunk_gated_delta_rule", call(T // 4, 32)) == ("triton", "triton")
    # more sequence-heads than GLUON_AUTO_MAX_SEQ_HEADS (768): 32 sequences x 32 heads
    assert 32 * 32 > backend.GLUON_AUTO_MAX_SEQ_HEADS
    assert _traced_choice("chunk_gated_delta_rule", call(T // 32, 32, B=32)) == ("triton", "triton")
