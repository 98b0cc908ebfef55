"""Selecting the backward's path in a test: "fused" (backward_fused.py, the default for K, V <= 128: the selection
rule itself is left in place and checked to have taken it) or "four" (stages 1a-3, by the rule patched to decline),
optionally with the fused kernel's V block forced (its V-split form). Returns the list of the fused launcher's calls,
for the test to check after the backward ran (tests/ is on sys.path)."""
from linattn.ops.gated_delta_rule.triton import backward


def force_bwd_path(monkeypatch, path: str, block_v=None) -> list:
    assert path in ("fused", "four"), path
    calls = []
    real = backward._bwd_fused

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(backward, "_bwd_fused", spy)
    if path == "four":
        monkeypatch.setattr(backward, "use_fused_backward", lambda K, V: False)
    if block_v is not None:
        monkeypatch.setattr(backward, "_fused_bv", lambda V, N, HV, device: block_v)
    return calls


def check_path_taken(path: str, calls: list) -> None:
    assert bool(calls) == (path == "fused"), f"the {path} path was asked for, the fused kernel ran {len(calls)} times"
