"""pytest markers shared by the test files (tests/ is on sys.path)."""
import pytest
import torch

from linattn.runtime.settings import settings

needs_triton = pytest.mark.skipif(not settings.interpret and not torch.cuda.is_available(),
                                  reason="the Triton kernels need TRITON_INTERPRET=1 on a CPU")

from linattn.runtime.gluon_compat import gluon_status  # noqa: E402

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
SMEM_LIMIT_SM90 = 232448


def built(name: str, max_spill: int = 0):
    """The AOT report of registered kernel `name` after the checks every Gluon build test makes: its intended
    instructions present, at most max_spill bytes spilled, shared memory within sm_90's."""
    from linattn.runtime.aot import inspect_kernel, kernels
    rep = inspect_kernel(kernels()[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes <= max_spill, f"{name}: {rep.spill_bytes} B spilled ({rep.regs} registers)"
    assert 0 < rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
    return rep
