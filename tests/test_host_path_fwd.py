"""The host path of the public Triton GDN forward (benchmarks/OPT_LOG.md, "Host path of the Triton forward"):
fixed-length chunk plans are cached per (B, T, chunk size, device[, stream]) and give exactly the results of a
fresh plan; varlen plans are never cached; and a steady-state fixed-length call dispatches no small torch kernels
(only its buffer allocations). Counted on CPU tensors with the Triton launches stubbed out (the interpreter's own
copies are not the host path's), by the counter of linattn/ops/gated_delta_rule/triton/hostsim.py."""
import dataclasses

import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.triton import chunk_indices as ci
from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
from linattn.ops.gated_delta_rule.triton.forward import CHUNK, chunk_gated_delta_rule_fwd
from linattn.ops.gated_delta_rule.triton.hostsim import count_torch_ops, stub_interpreted_launches
from linattn.runtime.settings import settings
from linattn.testing import make_gdn_inputs, random_cu_seqlens

pytestmark = pytest.mark.skipif(not settings.interpret, reason="CPU tensors under TRITON_INTERPRET=1")

# torch ops per steady-state call of the public forward (fixed length, initial and final state): only the
# allocations (gcum, tinv, w, u, final, h, vnew, o); before the plan cache: 28, 16 of them device kernels
# (benchmarks/OPT_LOG.md). The value checks of g and beta on CPU tensors (validation.check_gate_values) are left
# out: a GPU call skips them.
MAX_OPS = 8
LAUNCHES = ["kkt_solve_kernel", "wu_kernel", "chunk_state_fwd_kernel", "chunk_output_kernel"]


def _public(x, cu=None):
    return lambda: linattn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                  initial_state=x["initial_state"], output_final_state=True,
                                                  cu_seqlens=cu, backend="triton")


def _same_plan(a, b):
    for f in dataclasses.fields(ci.ChunkPlan):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.shape == vb.shape and torch.equal(va, vb), f.name
        else:
            assert va == vb, f.name


@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_torch_ops_per_call(monkeypatch, requires_grad):
    from linattn.ops.gated_delta_rule import validation
    monkeypatch.setattr(validation, "check_gate_values", lambda *a, **k: None)
    x = make_gdn_inputs(2, 200, 2, 4, 32, 32, dtype=torch.bfloat16, requires_grad=requires_grad)
    fn = _public(x)
    ci.clear_chunk_plans()
    with stub_interpreted_launches() as launches:
        first = count_torch_ops(fn)                  # builds and caches the plan
        del launches[:]
        steady = count_torch_ops(fn)
    assert launches == LAUNCHES
    assert first["device"] > 0                       # the plan's own ops, once
    assert steady["device"] == 0, steady["device_ops"]
    assert steady["aten"] <= MAX_OPS, steady
    # an eager call runs without the custom op's dispatch: the launcher directly when it records no autograd graph,
    # the op's torch.autograd.Function when it does (runtime/eager_ops.py)
    assert steady["custom"] == []


def test_varlen_plans_are_built_per_call():
    cu = random_cu_seqlens([1, 63, 65, 71])
    x = make_gdn_inputs(1, 200, 2, 4, 32, 32, dtype=torch.bfloat16, num_states=4)
    ci.clear_chunk_plans()
    a = ci.make_chunk_plan(1, 200, cu, CHUNK, "cpu")
    b = ci.make_chunk_plan(1, 200, cu, CHUNK, "cpu")
    assert a is not b and len(ci._PLANS) == 0
    _same_plan(a, b)
    with stub_interpreted_launches():
        ops = count_torch_ops(_public(x, cu))
    assert ops["device"] > 0 and len(ci._PLANS) == 0


def test_cached_plan_is_shared_bounded_and_equals_fresh():
    ci.clear_chunk_plans()
    for B, T in [(1, 1), (1, 63), (2, 64), (3, 65), (2, 300)]:
        p = ci.make_chunk_plan(B, T, None, CHUNK, "cpu")
        assert ci.make_chunk_plan(B, T, None, CHUNK, torch.device("cpu")) is p
        _same_plan(p, ci.build_chunk_plan(B, T, None, CHUNK, "cpu"))
    assert ci.make_chunk_plan(2, 300, None, 32, "cpu") is not ci.make_chunk_plan(2, 300, None, CHUNK, "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.cu = p.cu.clone()
    for T in range(1, ci.MAX_CACHED_PLANS + 10):
        ci.make_chunk_plan(1, T, None, CHUNK, "cpu")
    assert len(ci._PLANS) == ci.MAX_CACHED_PLANS
    ci.clear_chunk_plans()


@pytest.mark.parametrize("cu_lens", [None, [1, 63, 65, 171]])
def test_cached_plan_results_identical_to_fresh(cu_lens):
    """o, the final state and every gradient are bit-identical with the (cached) plan the op picks and with a fresh
    plan; a forward + backward leaves the cached plan's tensors as built."""
    B, T = (2, 150) if cu_lens is None else (1, sum(cu_lens))
    cu = None if cu_lens is None else random_cu_seqlens(cu_lens)
    x = make_gdn_inputs(B, T, 2, 4, 32, 32, dtype=torch.bfloat16, num_states=None if cu is None else len(cu_lens))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"])
    ci.clear_chunk_plans()
    default = chunk_gated_delta_rule_fwd(*args, True, cu)          # cached (fixed length) or built (varlen)
    fresh = chunk_gated_delta_rule_fwd(*args, True, cu, plan=ci.build_chunk_plan(B, T, cu, CHUNK, "cpu"))
    again = chunk_gated_delta_rule_fwd(*args, True, cu)            # a cache hit for fixed length
    for r in (fresh, again):
        assert torch.equal(r.o, default.o) and torch.equal(r.final_state, default.final_state)
    do = torch.randn_like(default.o)
    grads = [chunk_gated_delta_rule_bwd(*args, cu, do, None) for _ in range(2)]
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.equal(a, b)
    if cu is None:
        assert len(ci._PLANS) == 1 and again.plan is default.plan
        _same_plan(default.plan, ci.build_chunk_plan(B, T, None, CHUNK, "cpu"))
    else:
        assert len(ci._PLANS) == 0
