"""The decode launcher's host path (triton/fused_recurrent.py): launches through the compiled kernel's handle once a
signature has been seen. Under a stand-in sm_90 driver (linattn.runtime.hostsim; a child process without
TRITON_INTERPRET, which would turn the kernels into interpreted functions), for the one-tile and the persistent
kernel, in place and out of place: the handle path makes the same launches (kernel, grid, every argument) as the
JIT path, and skips the JIT's run on repeated calls."""
import pytest

from children import run_json_child   # tests/ is on sys.path
from linattn.runtime.settings import settings

CHILD = r"""
import json, torch
from linattn.runtime.hostsim import count_jit_runs, fake_hopper, normalise
from linattn.ops.gated_delta_rule.triton import fused_recurrent as fr

def case(N, state_dtype, inplace):
    H, HV, K, V, slots = 2, 4, 32, 32, 2 * N + 1
    q = torch.randn(N, 1, H, K, dtype=torch.bfloat16)
    k = torch.randn(N, 1, H, K, dtype=torch.bfloat16)
    v = torch.randn(N, 1, HV, V, dtype=torch.bfloat16)
    g, beta = -torch.rand(N, 1, HV), torch.rand(N, 1, HV)
    pool = torch.randn(slots, HV, K, V).to(state_dtype)
    idx = torch.randperm(slots)[:N]
    o, ht = torch.empty_like(v), (None if inplace else torch.empty(N, HV, K, V, dtype=state_dtype))
    def call():                                        # preallocated outputs: every pointer the same in each call
        return fr.fused_recurrent_gdn_fwd(q, k, v, g, beta, K ** -0.5, pool, None, idx, None, None, False, False,
                                          not inplace, inplace, out=o, final_out=ht)
    return call

out = {}
with fake_hopper() as drv:
    fr.device_facts = lambda device=None: type("F", (), {"num_sms": 2})()    # the persistent kernel from N * HV >= 64
    for name, args in {"one_tile_fp32_inplace": (3, torch.float32, True),
                       "one_tile_bf16_out_of_place": (3, torch.bfloat16, False),
                       "persistent_fp32_inplace": (64, torch.float32, True),
                       "persistent_fp32_out_of_place": (64, torch.float32, False)}.items():
        call = case(*args)
        rec = {}
        for path, opts in (("jit", dict(plan_cache=False, handle=False)), ("handle", {})):
            with fr.host_path.options(**opts):
                call()                                 # compiles, and keeps the handle on the handle path
                del drv.launches[:]
                with count_jit_runs() as runs:
                    res = call()
                rec[path] = dict(launches=[(kn, list(gr), [repr(normalise(a)) for a in a_]) for kn, gr, a_ in
                                           drv.launches], jit_runs=runs[0])
                del res
        out[name] = rec
print(json.dumps(out))
"""


def test_decode_handle_path_launches_as_the_jit():
    res = run_json_child(CHILD)
    assert len(res) == 4
    kernels = set()
    for name, rec in res.items():
        jit, handle = rec["jit"], rec["handle"]
        assert len(jit["launches"]) == 1 and jit["jit_runs"] == 1, (name, jit)
        assert handle["launches"] == jit["launches"], name              # kernel, grid and every argument
        assert handle["jit_runs"] == 0, (name, handle)
        kernels.add(jit["launches"][0][0])
    assert kernels == {"fused_recurrent_gdn_fwd_kernel", "fused_recurrent_gdn_fwd_persistent_kernel"}, kernels


def _decode_inputs(N=3, H=2, HV=4, K=32, V=32, slots=7):
    import torch

    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=torch.bfloat16, initial_state=False)
    x.pop("initial_state", None)                       # the pool goes in as initial_state
    return x, torch.randn(slots, HV, K, V), torch.randperm(slots)[:N]


@pytest.mark.skipif(not settings.interpret, reason="CPU tensors run the Triton decode under TRITON_INTERPRET=1")
def test_eager_in_place_call_bumps_the_pools_version_and_equals_the_custom_op():
    """An eager call runs the launcher without the custom op: in place it bumps the pool's version counter as the
    mutating custom op does, and o and the pool equal the custom op's bit for bit (same kernel, same inputs);
    under inference_mode (no version counter) it runs too."""
    import torch

    import linattn
    from linattn.ops.gated_delta_rule import fused_recurrent as F
    x, pool, idx = _decode_inputs()
    p_eager, p_op = pool.clone(), pool.clone()
    v0 = p_eager._version
    o_eager, ret = linattn.fused_recurrent_gated_delta_rule(**x, initial_state=p_eager, state_indices=idx,
                                                            inplace=True, backend="triton")
    assert ret is p_eager and p_eager._version > v0
    o_op = torch.ops.linattn.fused_recurrent_gdn_inplace(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, p_op,
                                                         None, idx, None, None, False, False)
    assert torch.equal(o_eager, o_op) and torch.equal(p_eager, p_op)
    assert not torch.equal(p_eager, pool)
    with torch.inference_mode():
        p_inf = pool.clone()
        o_inf, _ = linattn.fused_recurrent_gated_delta_rule(**x, initial_state=p_inf, state_indices=idx, inplace=True,
                                                            backend="triton")
    assert torch.equal(o_inf, o_eager) and torch.equal(p_inf, p_eager)
    assert F._eager(x["q"]) and not F._eager(torch.nn.Parameter(x["q"].float()))


@pytest.mark.skipif(not settings.interpret, reason="CPU tensors run the Triton decode under TRITON_INTERPRET=1")
def test_repeat_signature_skips_the_checks_and_keeps_refusing_bad_calls(monkeypatch):
    """A repeat call of a signature whose checks passed skips them and the backend choice (the memo applies to CUDA
    tensors; here it is switched on for CPU ones): same results as a checked call; a new shape or a new dtype is
    checked afresh, an input that requires grad takes the forward-only path, and a bad call still raises."""
    import torch

    import linattn
    from linattn.runtime import call_memo
    from linattn.ops.gated_delta_rule import fused_recurrent as F
    monkeypatch.setattr(call_memo, "memo_applies", lambda q: True)
    monkeypatch.setattr(F, "_CHECKED", {})
    checks = []
    real = F.check_decode_inputs
    monkeypatch.setattr(F, "check_decode_inputs", lambda *a, **k: (checks.append(1), real(*a, **k))[1])
    x, pool, idx = _decode_inputs()

    def call(**over):
        kw = dict(x, initial_state=pool, state_indices=idx, output_final_state=True, backend="triton")
        kw.update(over)
        return linattn.fused_recurrent_gated_delta_rule(**kw)
    o1, h1 = call()
    o2, h2 = call()
    assert len(checks) == 1
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    call(q=x["q"].float(), k=x["k"].float())                  # another dtype: checked afresh
    assert len(checks) == 2
    with pytest.raises(ValueError, match="state_indices"):
        call(state_indices=idx[:2])                            # another shape: checked, and refused
    o3, _ = call(v=x["v"].clone().requires_grad_())            # requires grad: the forward-only path, not the memo
    assert o3.requires_grad and torch.equal(o3.detach(), o1)
    with pytest.raises(NotImplementedError, match="no backward"):
        o3.float().sum().backward()
    assert len(checks) == 4           # the bad shape went through check_decode_inputs, and the forward-only call's
    call()                            # no_grad run (a signature of its own)
    assert len(checks) == 4           # the repeat of the first signature: not checked again
