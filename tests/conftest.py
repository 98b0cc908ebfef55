"""CPU tests run the Triton kernels under the interpreter; on a machine with a GPU the same tests use it."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import linattn  # noqa: E402,F401  (installs the interpreter fixes when interpreting)
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
