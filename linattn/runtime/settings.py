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


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class _Settings:
    @property
    def interpret(self) -> bool:
        return _flag("TRITON_INTERPRET")

    @property
    def default_backend(self) -> str:
        return os.environ.get("LINATTN_BACKEND", "auto")

    @property
    def log_choices(self) -> bool:
        return _flag("LINATTN_LOG")

    @property
    def check_inputs(self) -> bool:
        return _flag("LINATTN_CHECK_INPUTS")


settings = _Settings()
