"""Every environment variable linattn reads, in one place (`linattn doctor` lists those set and rejects unknown
LINATTN_* names).

TRITON_INTERPRET      Triton's own switch: "1" runs @triton.jit kernels on the CPU through the interpreter. Must be
                      set before Python starts (Triton reads it at import).
LINATTN_BACKEND       the backend that replaces backend="auto" for every call: "auto", "triton", "gluon" or
                      "reference".
LINATTN_LOG           "1" prints each op's backend choice and every rejection reason once (stderr).
LINATTN_CHECK_INPUTS  "1" also checks the values of g and beta of GPU tensors (finite, g <= 0), at the cost of one
                      host synchronisation per call; CPU tensors are always checked. Read at import.
LINATTN_COMMIT        the commit a bench result records where the tree is not a git checkout (linattn/bench/env.py).
"""
import os
from dataclasses import dataclass

# os.environ.get(name) goes through the Mapping machinery, and the eager ops read LINATTN_BACKEND on every call: the
# value is read from os.environ's own dict, which every change through os.environ updates (the same value, a fraction
# of the cost). A Python whose os.environ lacks those internals reads it through os.environ.get.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_FAST = isinstance(_ENV_DATA, dict) and callable(getattr(os.environ, "encodekey", None)) and \
    callable(getattr(os.environ, "decodevalue", None))


_ENV_KEYS: dict = {}      # name -> os.environ.encodekey(name)


def _env(name: str, default: str) -> str:
    if _ENV_FAST:
        key = _ENV_KEYS.get(name)
        if key is None:
            key = _ENV_KEYS[name] = os.environ.encodekey(name)
        raw = _ENV_DATA.get(key)
        return default if raw is None else os.environ.decodevalue(raw)
    return os.environ.get(name, default)


def _flag(name: str) -> bool:
    return _env(name, "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class _Settings:
    @property
    def interpret(self) -> bool:
        return _flag("TRITON_INTERPRET")

    @property
    def default_backend(self) -> str:
        return _env("LINATTN_BACKEND", "auto")

    @property
    def log_choices(self) -> bool:
        return _flag("LINATTN_LOG")

    @property
    def check_inputs(self) -> bool:
        return _flag("LINATTN_CHECK_INPUTS")


settings = _Settings()
