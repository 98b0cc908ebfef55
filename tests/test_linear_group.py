"""LinearGroup (a decode step's projections in one launch) against fp64: bf16 and fp32, 1 to 64 rows, outputs
NaN-poisoned before the kernel writes them; modules the kernel does not take (a bias, a width that is not a multiple
of its column block) and calls it does not take (autograd, more than 64 rows) go through the modules' own calls;
the weight table follows a replaced weight."""
import pytest
import torch

from linattn.ops.matmul.linear_group import MAX_ROWS, LinearGroup
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.settings import settings
from linattn.testing import TOL, assert_close

pytestmark = pytest.mark.skipif(not settings.interpret and not torch.cuda.is_available(),
                                reason="the kernel needs a GPU or TRITON_INTERPRET=1")
K = 48                 # 16-byte rows in bf16 and fp32


def _mods(device, dtype, widths=(64, 32, 96), bias_at=None):
    mods = [torch.nn.Linear(K, n, bias=(i == bias_at)) for i, n in enumerate(widths)]
    return [m.to(device=device, dtype=dtype) for m in mods]


def _ref(x, m):
    y = x.double() @ m.weight.double().t()
    return y + m.bias.double() if m.bias is not None else y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
def test_group_matches_fp64(device, dtype, rows):
    mods = _mods(device, dtype)
    x = torch.randn(rows, 1, K, device=device).to(dtype)
    g = LinearGroup()
    with torch.no_grad(), poisoned_allocations():
        ys = g(x, mods)
    assert g._table is not None and g._table.shape[0] == (64 + 32 + 96) // 32          # the kernel ran
    for i, (y, m) in enumerate(zip(ys, mods)):
        assert y.shape == (rows, 1, m.out_features) and y.dtype == dtype and y.is_contiguous()
        assert_close(f"y{i}", y, _ref(x, m), TOL[dtype])


def test_modules_and_calls_outside_the_kernel(device):
    """A biased module is called on its own (the others, a width of 40 among them, still grouped: its second column
    block is partial); with autograd or more than MAX_ROWS rows every module is called on its own (same values as
    m(x))."""
    mods = _mods(device, torch.float32, widths=(64, 32, 40, 32), bias_at=1)
    g = LinearGroup()
    x = torch.randn(3, K, device=device)
    with torch.no_grad(), poisoned_allocations():
        ys = g(x, mods)
    for i, (y, m) in enumerate(zip(ys, mods)):
        assert_close(f"y{i}", y, _ref(x, m), TOL[torch.float32])
    assert g._table is not None and g._table.shape[0] == 2 + 2 + 1       # blocks of 32 columns of 64, 40 and 32
    xg = torch.randn(3, K, device=device, requires_grad=True)
    for y, m in zip(LinearGroup()(xg, mods), mods):
        assert y.requires_grad and torch.equal(y, m(xg))
    big = torch.randn(MAX_ROWS + 1, K, device=device)
    h = LinearGroup()
    with torch.no_grad():
        for y, m in zip(h(big, mods), mods):
            assert torch.equal(y, m(big))
    assert h._table is None


def test_table_follows_a_replaced_weight(device):
    mods = _mods(device, torch.float32)
    g = LinearGroup()
    x = torch.randn(2, K, device=device)
    with torch.no_grad():
        g(x, mods)
        mods[2].weight = torch.nn.Parameter(torch.randn_like(mods[2].weight))
        ys = g(x, mods)
    assert_close("y2", ys[2], _ref(x, mods[2]), TOL[torch.float32])
