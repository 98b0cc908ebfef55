"""chunk_gated_delta_rule's signature memo (api.py _CHECKED, call_memo.py): a repeat plain eager call on CUDA tensors
skips the input checks and the backend choice. Here on CPU tensors under the interpreter, with the memo switched on
as it is for CUDA ones: the repeat call runs neither, gives the same result as a call checked afresh, and every change
the checks or the choice read (dtype, shape, an option, grad requirement or mode, the backend asked for, CUDA-graph
capture) is checked afresh; a bad call still raises naming its argument. CPU calls themselves are never remembered
(their values are read on the host)."""
import pytest
import torch

from linattn.ops.gated_delta_rule import api
from linattn.runtime import call_memo
from linattn.runtime.settings import settings
from linattn.testing import make_gdn_inputs

pytestmark = pytest.mark.skipif(not settings.interpret, reason="CPU tensors under TRITON_INTERPRET=1")


def test_cpu_calls_are_never_remembered():
    assert not call_memo.memo_applies(torch.randn(2))


def test_repeat_calls_skip_checks_and_choice(monkeypatch):
    monkeypatch.setattr(call_memo, "memo_applies", lambda q: True)
    counts = {"checks": 0, "select": 0}
    real_check, real_select = api.check_gdn_inputs, api._backends.select

    def check(*a, **kw):
        counts["checks"] += 1
        return real_check(*a, **kw)

    def select(*a, **kw):
        counts["select"] += 1
        return real_select(*a, **kw)
    monkeypatch.setattr(api, "check_gdn_inputs", check)
    monkeypatch.setattr(api._backends, "select", select)
    api._CHECKED.clear()
    x = make_gdn_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32)
    keys = ("q", "k", "v", "g", "beta", "initial_state")

    def call(**kw):
        before = dict(counts)
        args = {n: x[n] for n in keys}
        args.update(kw)
        args.setdefault("output_final_state", True)
        with torch.no_grad():
            o, ht = api.chunk_gated_delta_rule(**args)
        return (o, ht), counts["checks"] - before["checks"], counts["select"] - before["select"]

    first, c1, s1 = call()
    second, c2, s2 = call()
    assert (c1, s1) == (1, 1) and (c2, s2) == (0, 0)
    api._CHECKED.clear()
    fresh, c3, _ = call()
    assert c3 == 1
    for a, b, c in zip(first, second, fresh):
        assert torch.equal(a, b) and torch.equal(a, c)
    # every change the checks or the choice read: checked afresh once, then remembered
    variants = {
        "dtype": dict(q=x["q"].bfloat16(), k=x["k"].bfloat16(), v=x["v"].bfloat16()),
        "shape": {n: x[n][:, :64] for n in ("q", "k", "v", "g", "beta")},
        "no_final": dict(output_final_state=False),
        "l2norm": dict(use_qk_l2norm_in_kernel=True),
        "scale": dict(scale=0.5),
        "backend": dict(backend="reference"),
        "chunk_size": dict(chunk_size=32),
    }
    for name, kw in variants.items():
        runs = [call(**kw)[1] for _ in range(2)]
        assert runs == [1, 0], (name, runs)
    monkeypatch.setattr(api, "capturing", lambda t: True)            # under CUDA-graph capture: its own entry
    assert [call()[1] for _ in range(2)] == [1, 0]
    monkeypatch.setattr(api, "capturing", lambda t: False)
    with torch.enable_grad():
        args = {n: x[n] for n in keys}
        args["v"] = x["v"].clone().requires_grad_()
        before = counts["checks"]
        api.chunk_gated_delta_rule(**args, output_final_state=True)
        assert counts["checks"] == before + 1                        # grad mode and requires_grad in the key
    with pytest.raises(ValueError, match="g"):
        call(g=x["g"][..., :1])
