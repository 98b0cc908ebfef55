"""pytest markers shared by the test files (tests/ is on sys.path)."""
import pytest
import torch

from linattn.runtime.settings import settings

needs_triton = pytest.mark.skipif(not settings.interpret and not torch.cuda.is_available(),
                                  reason="the Triton kernels need TRITON_INTERPRET=1 on a CPU")
