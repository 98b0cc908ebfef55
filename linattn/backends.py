"""The backend registry.

Each op owns an `OpBackends` table. A backend registers an implementation and a `supports(**call)` function
that answers `(ok, reason)`. `backend="auto"` takes the first backend, in priority order, that accepts the call
and remembers each rejection reason (printed once with LINATTN_LOG=1, with the choice, and always listed by
`linattn doctor`); an explicitly requested backend that rejects the call raises with its reason. LINATTN_BACKEND
replaces "auto" by a backend name for every call.

The backend named "reference" (plain PyTorch) is registered by name only (auto=False), with one exception: for
CPU tensors in a process where Triton does not interpret (TRITON_INTERPRET was not set before `import linattn`),
no kernel can run, so `auto` falls back to it last. Under the interpreter and on a GPU `auto` never picks it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from linattn.runtime.settings import settings

REFERENCE = "reference"
SupportsFn = Callable[..., Tuple[bool, str]]


class BackendError(ValueError):
    """An explicitly requested backend cannot run this call."""


@dataclass
class Backend:
    name: str
    impl: Callable
    supports: SupportsFn
    priority: int            # lower runs first under "auto"
    auto: bool = True        # False: only when asked for by name (the reference)
    not_auto_reason: str = "only when requested by name"    # what doctor says of an auto=False backend
    # auto=True backends may narrow what `auto` hands them (where they were measured faster) without narrowing
    # what they accept by name: auto_filter(**call) -> (ok, reason), asked only after supports() said yes
    auto_filter: Optional[SupportsFn] = None
    # direct(q, k, v, g, beta, scale, initial_state, output_final_state) -> Optional[Callable], asked by the op
    # after a plain eager call this backend ran on the caller's own tensors: a function of a repeat call's (q, k, v,
    # g, beta, initial_state) giving its result, or None where it declines; the op keeps it by the call's signature
    direct: Optional[Callable] = None

    def accepts(self, **call) -> Tuple[bool, str]:
        """supports(), plus the one process-wide refusal: a Triton kernel on CPU tensors where TRITON_INTERPRET=1
        was set after triton was imported (it would fail inside Triton with a bare error)."""
        ok, reason = self.supports(**call)
        if ok and self.name != REFERENCE and settings.interpret and _on_cpu(call):
            from linattn.runtime.device import interpreter_mismatch
            late = interpreter_mismatch()
            if late:
                return False, late
        return ok, reason

    def auto_accepts(self, **call) -> Tuple[bool, str]:
        ok, reason = self.accepts(**call)
        if ok and not self.auto:
            if self.name == REFERENCE and _on_cpu(call):
                from linattn.runtime.device import triton_interprets
                if not triton_interprets():
                    return True, ("CPU tensors and no Triton interpreter in this process: the plain-PyTorch "
                                  "reference runs (set TRITON_INTERPRET=1 before importing linattn to run the "
                                  "Triton kernels on the CPU)")
            return False, self.not_auto_reason
        if ok and self.auto_filter is not None:
            ok, reason = self.auto_filter(**call)
        return ok, reason


@dataclass
class OpBackends:
    op: str
    backends: Dict[str, Backend] = field(default_factory=dict)
    _logged: set = field(default_factory=set)
    last_rejections: Dict[str, str] = field(default_factory=dict)

    def register(self, name: str, impl: Callable, supports: SupportsFn, priority: int, auto: bool = True,
                 not_auto_reason: str = "only when requested by name", auto_filter: Optional[SupportsFn] = None,
                 direct: Optional[Callable] = None):
        self.backends[name] = Backend(name, impl, supports, priority, auto, not_auto_reason, auto_filter, direct)

    def unregister(self, name: str):
        self.backends.pop(name, None)

    def names(self) -> List[str]:
        return [b.name for b in sorted(self.backends.values(), key=lambda b: b.priority)]

    def explain(self, **call) -> List[Tuple[str, bool, str]]:
        """(name, ok, reason) for every backend, in auto order: what `doctor` prints."""
        out = []
        for b in sorted(self.backends.values(), key=lambda b: b.priority):
            ok, reason = b.auto_accepts(**call)
            out.append((b.name, ok, reason))
        return out

    def select(self, backend: str, **call) -> Backend:
        if backend == "auto":
            backend = settings.default_backend
        if backend != "auto":
            if backend not in self.backends:
                raise BackendError(f"{self.op}: unknown backend {backend!r}; known: {self.names()}")
            b = self.backends[backend]
            ok, reason = b.accepts(**call)
            if not ok:
                raise BackendError(f"{self.op}: backend {backend!r} cannot run this call: {reason}")
            return b
        for b in sorted(self.backends.values(), key=lambda b: b.priority):
            if not b.auto and b.name != REFERENCE:
                continue
            ok, reason = b.auto_accepts(**call)
            if not ok:
                self.last_rejections[b.name] = reason
            if settings.log_choices and (b.name, ok, reason) not in self._logged:
                self._logged.add((b.name, ok, reason))
                what = f"auto picks backend {b.name!r}" if ok else f"skipping backend {b.name!r}"
                print(f"[linattn] {self.op}: {what}" + (f": {reason}" if reason else ""), file=sys.stderr)
            if ok:
                return b
        raise BackendError(f"{self.op}: no backend accepts this call: {self.last_rejections}")


_REGISTRY: Dict[str, OpBackends] = {}


def op_backends(op: str) -> OpBackends:
    if op not in _REGISTRY:
        _REGISTRY[op] = OpBackends(op)
    return _REGISTRY[op]


def all_ops() -> Dict[str, OpBackends]:
    return dict(_REGISTRY)


def _on_cpu(call) -> bool:
    """Whether the call's first tensor argument (q, or a for matmul) lives on the CPU."""
    import torch
    t = next((v for v in call.values() if isinstance(v, torch.Tensor)), None)
    return t is not None and t.device.type == "cpu"


class CheckedCalls:
    """Calls of one op whose argument checks passed and whose backend choice was made, remembered by signature, so
    that a repeat call (a decode step: the same shapes every token) skips both: the checks and the choice cost more
    host time than a small kernel. `key` returns None for a call that must be checked afresh every time: one traced
    by torch.compile, a tensor subclass, or one whose checks read tensor values (the caller says so). Bounded:
    cleared when full (the signatures of a real workload are few)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._impls: Dict[tuple, Callable] = {}

    @staticmethod
    def key(backend: str, tensors, values=()) -> Optional[tuple]:
        """What the checks and the choice read: per tensor (or None) its shape, dtype, device, strides and whether
        it requires grad; the grad mode, the backend asked for and the process default, and `values` (the other
        arguments, hashable). A tensor must be a plain tensor or an nn.Parameter (a layer's weights)."""
        import torch
        if not isinstance(backend, str) or torch.compiler.is_compiling():
            return None
        parts = [backend, settings.default_backend, torch.is_grad_enabled(), values]
        for t in tensors:
            if t is None:
                parts.append(None)
            elif type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
                parts.append((t.shape, t.dtype, t.device, t.stride(), t.requires_grad))
            else:
                return None
        return tuple(parts)

    def get(self, key: Optional[tuple]) -> Optional[Callable]:
        return None if key is None else self._impls.get(key)

    def put(self, key: Optional[tuple], impl: Callable) -> None:
        if key is None:
            return
        if len(self._impls) >= self.limit:
            self._impls.clear()
        self._impls[key] = impl

    def clear(self) -> None:
        self._impls.clear()

    def __len__(self) -> int:
        return len(self._impls)
