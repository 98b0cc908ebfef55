"""host_path.LaunchCache and arg_key (the fused forward's launches, stage 2a and the fused kernels, through
compiled-kernel handles): the plan key separates what the JIT specialises on, the first launch of a key goes through
the JIT with every parameter positional (defaults filled in as the JIT's binder does) and the launch options as
keywords, later ones through the kept handle with the same argument list; what the cache cannot key launches through
the JIT every time. A stand-in kernel records the calls (no Triton compile); the real kernels' launches are checked
under the stand-in driver in tests/test_gluon_fused_gf.py."""
from dataclasses import dataclass

import pytest
import torch

from linattn.runtime.host_path import HostPath, LaunchCache, arg_key


def test_arg_key_follows_what_the_jit_specialises_on():
    t = torch.randn(64, dtype=torch.float32)
    b = torch.randn(64).to(torch.bfloat16)
    assert arg_key(t) == (torch.float32, True) and arg_key(b) == (torch.bfloat16, True)
    assert arg_key(t[1:]) == (torch.float32, False)            # 4 bytes in: not 16-byte aligned
    assert arg_key(t[4:]) == (torch.float32, True)
    assert arg_key(None) is None and arg_key(0.5) == ("f",) and arg_key(3) == ("i", 3) != arg_key(4)
    assert arg_key(True) == ("b", True) != arg_key(1)
    with pytest.raises(TypeError):
        arg_key("a string")


@dataclass
class _Param:
    name: str
    has_default: bool = False
    default: object = None


class _Compiled:
    """A stand-in CompiledKernel: launches as k[grid](*args)."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("handle", grid, args))

    def run(self, *args):           # pragma: no cover - only its presence matters (host_path.usable_handle)
        raise AssertionError


class _Kernel:
    """A stand-in JIT function with parameters (x, n, A, B=7) recording launches; returns a _Compiled."""

    def __init__(self):
        self.params = [_Param("x"), _Param("n"), _Param("A"), _Param("B", True, 7)]
        self.arg_names = [p.name for p in self.params]
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)
        return run


def test_launch_cache_first_through_the_jit_then_the_handle(monkeypatch):
    import linattn.runtime.host_path as hp_mod
    monkeypatch.setattr(hp_mod, "current_device", lambda: 0)
    kern, cache = _Kernel(), LaunchCache(HostPath())
    x = torch.randn(32)
    for _ in range(3):
        cache(kern, (4, 2), (x, 5), dict(A=3, num_warps=8))
    jit = [e for e in kern.log if e[0] == "jit"]
    handle = [e for e in kern.log if e[0] == "handle"]
    # every parameter positional (B's default filled in), the options as keywords, the grid padded to 3-D
    assert jit == [("jit", (4, 2, 1), (x, 5, 3, 7), {"num_warps": 8})]
    assert handle == [("handle", (4, 2, 1), (x, 5, 3, 7))] * 2
    assert len(cache) == 1 and cache.jit_launches == 1
    # a new key per misaligned pointer, integer value, constexpr and option
    for args, kw in (((x[1:], 5), dict(A=3, num_warps=8)), ((x, 6), dict(A=3, num_warps=8)),
                     ((x, 5), dict(A=4, num_warps=8)), ((x, 5), dict(A=3, num_warps=4)),
                     ((x, 5), dict(A=3, B=7, num_warps=8))):
        cache(kern, (4, 2), args, kw)
    assert len(cache) == 5 and cache.jit_launches == 5       # B=7 given equals the default: the first plan


def test_launch_cache_falls_back_to_the_jit(monkeypatch):
    import linattn.runtime.host_path as hp_mod
    monkeypatch.setattr(hp_mod, "current_device", lambda: 0)
    kern, x = _Kernel(), torch.randn(32)
    # a parameter without a default left out, an unknown keyword, an argument without a key: the JIT every time
    cache = LaunchCache(HostPath())
    for kwargs, args in ((dict(num_warps=4), (x, 5)), (dict(A=3, Z=1), (x, 5)), (dict(A=3), (x, "s"))):
        kern.log.clear()
        for _ in range(2):
            cache(kern, (1,), args, kwargs)
        assert [e[0] for e in kern.log] == ["jit", "jit"] and kern.log[0][2:] == (args, kwargs)
    assert len(cache) == 0
    # the host path's handle (or plan cache) off: the JIT every time, with the caller's own arguments
    cache = LaunchCache(HostPath(plan_cache=True, handle=False))
    kern.log.clear()
    for _ in range(2):
        cache(kern, (1,), (x, 5), dict(A=3))
    assert [e[0] for e in kern.log] == ["jit", "jit"] and kern.log[0][2:] == ((x, 5), dict(A=3))


class _CompiledDirect(_Compiled):
    """A stand-in CompiledKernel whose `run` (what its launcher ends in) records the direct launches."""
    function, packed_metadata = "function", "packed"

    def run(self, *args):
        self.log.append(("direct",) + args)


def test_handle_launches_call_run_directly_unless_a_launch_hook_is_registered(monkeypatch):
    """After the JIT's first launch, a launch calls the compiled kernel's `run` with the launcher's own argument list
    (grid, stream, function, packed metadata, no launch metadata or hooks, then the kernel's arguments); while a
    launch hook is registered (a profiler), the CompiledKernel's launcher runs, so the hook sees the launch."""
    from types import SimpleNamespace

    import linattn.runtime.host_path as hp_mod
    monkeypatch.setattr(hp_mod, "current_device", lambda: 0)
    monkeypatch.setattr(hp_mod, "direct_launch",
                        lambda k: (k.run, k.function, k.packed_metadata, lambda dev: f"stream of {dev}"))
    no_hooks = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=SimpleNamespace(calls=[]))
    monkeypatch.setattr(hp_mod, "_HOOKS", no_hooks)
    kern, cache, x = _Kernel(), LaunchCache(HostPath()), torch.randn(32)
    kern.__class__ = type("_KernelDirect", (_Kernel,), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (self.log.append(("jit", grid, a, kw)), _CompiledDirect(self.log))[1])})
    for _ in range(2):
        cache(kern, (4, 2), (x, 5), dict(A=3, num_warps=8))
    assert kern.log[1] == ("direct", 4, 2, 1, "stream of 0", "function", "packed", None, None, None, x, 5, 3, 7)
    monkeypatch.setattr(hp_mod, "_HOOKS", SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[print]),
                                                          launch_exit_hook=SimpleNamespace(calls=[])))
    cache(kern, (4, 2), (x, 5), dict(A=3, num_warps=8))
    assert kern.log[2] == ("handle", (4, 2, 1), (x, 5, 3, 7))


class _KernelPtrAfter(_Kernel):
    """A stand-in JIT function with parameters (x, n, A, B=7, p=None, C=0): an optional pointer after constexprs."""

    def __init__(self):
        super().__init__()
        self.params += [_Param("p", True, None), _Param("C", True, 0)]
        self.arg_names = [q.name for q in self.params]


def test_launch_cache_takes_runtime_tensors_by_keyword(monkeypatch):
    """`tensors`: pointer parameters passed by keyword go in their place in the argument list, keyed as positional
    ones (dtype, alignment), so a new tensor of the same kind takes the same plan; a tensor among the constexpr
    keywords instead launches through the JIT every time and keeps no entry per tensor."""
    import linattn.runtime.host_path as hp_mod
    monkeypatch.setattr(hp_mod, "current_device", lambda: 0)
    kern, cache = _KernelPtrAfter(), LaunchCache(HostPath())
    x = torch.randn(32)
    ps = [torch.randn(8) for _ in range(3)]
    for p in ps:
        cache(kern, (2,), (x, 5), dict(A=3, C=1), tensors=dict(p=p))
    assert kern.log[0] == ("jit", (2, 1, 1), (x, 5, 3, 7, ps[0], 1), {})
    assert kern.log[1:] == [("handle", (2, 1, 1), (x, 5, 3, 7, p, 1)) for p in ps[1:]]
    assert len(cache) == 1 and cache.jit_launches == 1
    cache(kern, (2,), (x, 5), dict(A=3, C=1), tensors=dict(p=ps[0].double()))       # another dtype: a new plan
    cache(kern, (2,), (x, 5), dict(A=3, C=1), tensors=dict(p=ps[0][1:]))            # unaligned: a new plan
    assert len(cache) == 3 and cache.jit_launches == 3
    kern.log.clear()
    derived = len(cache._derived)
    for p in ps:
        cache(kern, (2,), (x, 5), dict(A=3, C=1, p=p))
    assert [e[0] for e in kern.log] == ["jit"] * 3 and len(cache._derived) == derived
    assert kern.log[0][3] == dict(A=3, C=1, p=ps[0])
