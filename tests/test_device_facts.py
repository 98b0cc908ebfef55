"""linattn.runtime.device.device_facts: the launchers ask it on every call, so a tensor's and an explicit
torch.device's facts are kept (by index / by device), while "cuda" without an index (the current device, which a
later torch.cuda.set_device changes) and None are resolved afresh each time."""
import torch

from linattn.runtime import device as D


def test_facts_kept_per_named_device_only(monkeypatch):
    cpu = torch.device("cpu")
    facts = D.device_facts(cpu)
    assert facts.kind == "cpu" and D._FACTS_BY_DEVICE[cpu] is facts
    assert D.device_facts(torch.empty(1)) is facts and D.device_facts("cpu") is facts
    # the current CUDA device is asked each time: resolved through _facts on every call, never kept
    calls = []
    real = D._facts
    monkeypatch.setattr(D, "_facts", lambda d: calls.append(d) or real(d))
    for _ in range(2):
        D.device_facts(torch.device("cuda"))
        D.device_facts(None)
    assert len(calls) == 4 and torch.device("cuda") not in D._FACTS_BY_DEVICE
    D.device_facts(cpu)                              # kept: no new resolution
    assert len(calls) == 4
