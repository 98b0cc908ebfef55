"""The backend registry.

Each op owns an `OpBackends` table. A backend registers an implementation and a `supports(**call)` function
that answers `(ok, reason)`. `backend="auto"` takes the first backend, in priority order, that accepts the call
and remembers each rejection reason (printed once with LINATTN_LOG=1, always listed by `linattn doctor`); an
explicitly requested backend that rejects the call raises with its reason.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from linattn.runtime.settings import settings

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

    def auto_accepts(self, **call) -> Tuple[bool, str]:
        ok, reason = self.supports(**call)
        if ok and not self.auto:
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
                 not_auto_reason: str = "only when requested by name", auto_filter: Optional[SupportsFn] = None):
        self.backends[name] = Backend(name, impl, supports, priority, auto, not_auto_reason, auto_filter)

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
            ok, reason = b.supports(**call)
            if not ok:
                raise BackendError(f"{self.op}: backend {backend!r} cannot run this call: {reason}")
            return b
        for b in sorted(self.backends.values(), key=lambda b: b.priority):
            if not b.auto:
                continue
            ok, reason = b.auto_accepts(**call)
            if ok:
                return b
            self.last_rejections[b.name] = reason
            key = (b.name, reason)
            if settings.log_choices and key not in self._logged:
                self._logged.add(key)
                print(f"[linattn] {self.op}: skipping backend {b.name!r}: {reason}", file=sys.stderr)
        raise BackendError(f"{self.op}: no backend accepts this call: {self.last_rejections}")


_REGISTRY: Dict[str, OpBackends] = {}


def op_backends(op: str) -> OpBackends:
    if op not in _REGISTRY:
        _REGISTRY[op] = OpBackends(op)
    return _REGISTRY[op]


def all_ops() -> Dict[str, OpBackends]:
    return dict(_REGISTRY)
