"""What keeps the Triton kernels running across Triton releases: no block pointers anywhere in linattn (Triton 3.9
removed tl.make_block_ptr and tl.advance, compiled and interpreted), and the interpreter fix that makes the splat of
a scalar comparison a bool mask (Triton 3.9's interpreter rejects the integer mask its own splat made)."""
import re
from pathlib import Path

import torch
import triton
import triton.language as tl

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
