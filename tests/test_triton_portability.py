"""What keeps the Triton kernels running across Triton releases: no block pointers anywhere in linattn (Triton 3.9
removed tl.make_block_ptr and tl.advance, compiled and interpreted), and the interpreter fix that makes the splat of
a scalar comparison a bool mask (Triton 3.9's interpreter rejects the integer mask its own splat made); and the
interpreter's helper calls without a re-patch of triton.language each (a CI cost, not a bug)."""
import re
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from linattn.runtime.settings import settings

PKG = Path(__file__).resolve().parents[1] / "linattn"


def test_no_block_pointers():
    pattern = re.compile(r"make_block_ptr|tl\.advance\(|boundary_check")
    hits = [f"{p.relative_to(PKG.parent)}:{i}" for p in sorted(PKG.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


@triton.jit
def _masked_copy(x_ptr, o_ptr, lim_ptr, n, N: tl.constexpr):
    lim = tl.load(lim_ptr)
    c = tl.arange(0, N)
    # a vector mask and a scalar comparison: the scalar is splat to the vector's shape
    m = (c < n) & (lim < n)
    tl.store(o_ptr + c, tl.load(x_ptr + c, mask=m, other=-1.), mask=m | (c >= 0))


def test_vector_and_scalar_comparison_mask(device):
    x = torch.arange(8, dtype=torch.float32, device=device) + 1
    for lim, want in ((2, [1., 2., 3., 4., 5., -1., -1., -1.]), (9, [-1.] * 8)):
        o = torch.zeros(8, dtype=torch.float32, device=device)
        _masked_copy[(1,)](x, o, torch.tensor([lim], dtype=torch.int64, device=device), 5, N=8)
        assert o.tolist() == want


@triton.jit
def _times(x, f):
    return x * f


@triton.jit
def _helper_calls(x_ptr, o_ptr, N: tl.constexpr):
    c = tl.arange(0, N)
    p = tl.program_id(0)
    x = tl.load(x_ptr + p * N + c)
    tl.store(o_ptr + p * N + c, _times(_times(x, 2.), 3.) + 1.)


@pytest.mark.skipif(not settings.interpret, reason="the interpreter's launch only")
def test_interpreter_helper_calls_inside_a_launch():
    """Under the interpreter: a kernel calling @triton.jit helpers gives their values; triton.language is patched
    once per launch, not again at each helper call (interpreter_fixes), and is back to its builtins after the launch,
    also after a launch that raised."""
    from triton.runtime import interpreter as interp
    calls = []
    original = interp._patch_lang_core

    def count(lang, scope):
        calls.append(lang)
        return original(lang, scope)

    interp._patch_lang_core = count
    try:
        x = torch.randn(3, 8)
        o = torch.full((3, 8), float("nan"))
        _helper_calls[(3,)](x, o, N=8)
        assert torch.equal(o, x * 2. * 3. + 1.)
        assert len(calls) == 1, calls                  # the launch's own patch: tl; no helper call's
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)
        with pytest.raises(Exception):
            _helper_calls[(3,)](x, o, N=7)               # arange of a length not a power of two: raises in the launch
        calls.clear()
        _helper_calls[(3,)](x, o, N=8)
        assert len(calls) == 1 and tl.core.is_builtin(tl.load)
    finally:
        interp._patch_lang_core = original
