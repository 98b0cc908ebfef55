"""The L2 norm of q and k (use_qk_l2norm_in_kernel; linattn/ops/norm/l2norm.py): the Triton pass forward and
backward against fp64 autograd through the plain expression, NaN-poisoned outputs, odd row lengths and row counts
around a program's block, gradients in the input's dtype, the no-autograd launcher path equal to the custom op's
forward, and the chunk ops' use_qk_l2norm_in_kernel equal to normalising q and k first."""
import pytest
import torch

import linattn
from linattn.ops.norm.l2norm import l2norm
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.settings import settings
from linattn.testing.compare import TOL, assert_close
from linattn.testing.inputs import make_gdn_inputs

pytestmark = pytest.mark.skipif(not settings.interpret, reason="runs the CPU path under TRITON_INTERPRET=1")


def _ref64(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape,dtype", [
    ((2, 37, 3, 64), torch.float32),          # 222 rows: three programs of 64 rows, the last one partial
    ((1, 9, 2, 100), torch.bfloat16),         # D not a power of 2 (columns masked)
    ((3, 5, 1, 128), torch.float16),
    ((4, 7), torch.float32),                  # a 2-D input, D = 7
])
def test_forward_and_backward_against_fp64(shape, dtype):
    x = (torch.randn(shape) * 3).to(dtype).requires_grad_(True)
    dy = torch.randn(shape).to(dtype)
    with poisoned_allocations():
        y = l2norm(x)
        (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = _ref64(x64)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    tol = TOL[dtype] if dtype != torch.float32 else 1e-5
    assert_close("y", y, y64, tol)
    assert_close("dx", dx, dx64, tol)


def test_no_autograd_path_equals_the_custom_op():
    x = torch.randn(3, 11, 2, 32)
    with poisoned_allocations():
        with torch.no_grad():
            y0 = l2norm(x)
        y1 = l2norm(x.clone().requires_grad_(True))
    assert torch.equal(y0, y1.detach())
    assert_close("y", y0, _ref64(x.double()), 1e-5)


def test_fp64_takes_the_plain_expression_in_fp64():
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    y = l2norm(x)
    assert y.dtype == torch.float64
    assert_close("y", y, _ref64(x.detach()), 1e-14)


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_chunk_ops_normalise_q_and_k(op):
    """use_qk_l2norm_in_kernel=True equals passing l2norm(q), l2norm(k) (outputs and the raw q / k gradients)."""
    B, T, H, HV, K, V = 1, 70, 1, 2, 32, 32
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=torch.float32, normalize_k=False)
    if op == "kda":
        x["g"] = x["g"][..., None].expand(-1, -1, -1, K).contiguous()
    fn = linattn.chunk_kda if op == "kda" else linattn.chunk_gated_delta_rule
    do = torch.randn(B, T, HV, V)
    grads = []
    for fused in (True, False):
        q, k = (t.clone().requires_grad_(True) for t in (x["q"], x["k"]))
        qn, kn = (q, k) if fused else (_ref64(q.double()).float(), _ref64(k.double()).float())
        o, _ = fn(qn, kn, x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                  use_qk_l2norm_in_kernel=fused)
        grads.append((o.detach(), *torch.autograd.grad((o * do).sum(), (q, k))))
    for name, a, b in zip(("o", "dq", "dk"), *grads):
        assert_close(name, a, b, 1e-5)
