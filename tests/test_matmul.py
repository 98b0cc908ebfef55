"""matmul on the CPU: the Triton kernel under TRITON_INTERPRET=1 against an fp64 product, and argument checks.

Tolerance: linattn.testing.TOL per dtype. The kernel accumulates in fp32 and rounds once to the output dtype,
so its error is the output rounding (about 3e-3 relative RMS for bf16, 4e-4 for fp16), like torch's own.
"""
import pytest
import torch

from linattn.backends import BackendError, op_backends
from linattn.ops.matmul import matmul, matmul_reference
from linattn.testing import TOL, assert_close, poison_

needs_interpreter = pytest.mark.skipif(
    not __import__("linattn.runtime.settings", fromlist=["settings"]).settings.interpret,
    reason="the Triton path runs on the CPU only under TRITON_INTERPRET=1")


def _operand(rows, cols, layout, dtype):
    """Fresh random [rows, cols] operand: row-major, or the transposed view of a [cols, rows] tensor."""
    if layout == "row":
        return torch.randn(rows, cols).to(dtype)
    t = torch.randn(cols, rows).to(dtype).T
    assert t.stride(0) == 1 and (min(rows, cols) == 1 or not t.is_contiguous())
    return t


# Small, tile-aligned and ragged (no size a multiple of 16), 1-element and a K longer than one k-block.
SHAPES = [(32, 32, 32), (67, 45, 33), (1, 1, 1), (1, 19, 70), (130, 17, 96)]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layouts", [("row", "row"), ("col", "col"), ("row", "col"), ("col", "row")])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_fp64(shape, layouts, dtype):
    from linattn.ops.matmul.triton.matmul import matmul_triton
    M, N, K = shape
    a = _operand(M, K, layouts[0], dtype)
    b = _operand(K, N, layouts[1], dtype)
    out = poison_(torch.empty(M, N, dtype=dtype))
    matmul_triton(a, b, out=out)
    ref = a.double() @ b.double()
    assert_close(f"triton {shape} {layouts} {dtype}", out, ref, TOL[dtype])


@needs_interpreter
def test_public_function_picks_triton_on_cpu():
    a, b = torch.randn(40, 24).bfloat16(), torch.randn(24, 56).bfloat16()
    chosen = op_backends("matmul").select("auto", a=a, b=b).name
    assert chosen == "triton"
    out = matmul(a, b)
    assert out.dtype == torch.bfloat16 and out.shape == (40, 56) and out.is_contiguous()
    assert_close("matmul auto", out, a.double() @ b.double(), TOL[torch.bfloat16])


def test_gluon_says_why_not_on_cpu():
    a, b = torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    ok, reason = op_backends("matmul").backends["gluon"].supports(a=a, b=b)
    assert not ok and ("TRITON_INTERPRET" in reason or "sm_90" in reason), reason
    with pytest.raises(BackendError, match="gluon"):
        matmul(a, b, backend="gluon")


def test_reference_backend():
    a, b = torch.randn(9, 7).half(), torch.randn(7, 5).half()
    out = matmul(a, b, backend="reference")
    assert_close("reference", out, a.double() @ b.double(), TOL[torch.float16])
    assert torch.equal(out, matmul_reference(a, b))


def test_empty_inner_dimension_gives_zeros():
    out = matmul(torch.empty(3, 0, dtype=torch.bfloat16), torch.empty(0, 4, dtype=torch.bfloat16))
    assert out.shape == (3, 4) and torch.count_nonzero(out) == 0


@pytest.mark.parametrize("a,b,exc,match", [
    (torch.randn(2, 3, 4).bfloat16(), torch.randn(4, 5).bfloat16(), ValueError, "2-D"),
    (torch.randn(4, 3).bfloat16(), torch.randn(4, 5).bfloat16(), ValueError, "inner dimensions"),
    (torch.randn(4, 3), torch.randn(3, 5), TypeError, "not supported"),
    (torch.randn(4, 3).half(), torch.randn(3, 5).bfloat16(), TypeError, "same dtype"),
    (torch.randn(4, 3).bfloat16(), torch.randn(3, 5).bfloat16().to("meta"), ValueError, "meta"),
])
def test_bad_inputs_raise(a, b, exc, match):
    with pytest.raises(exc, match=match):
        matmul(a, b)


def test_unknown_backend_raises():
    with pytest.raises(BackendError, match="unknown backend"):
        matmul(torch.randn(2, 2).half(), torch.randn(2, 2).half(), backend="cutlass")


def test_config_cache_roundtrip_and_invalidation(tmp_path, monkeypatch):
    from linattn.runtime import config_cache
    from linattn.runtime.device import DeviceFacts
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    h200 = DeviceFacts("cuda", "NVIDIA H200", (9, 0), 132, 232448, 0)
    cfg = {"BM": 128, "BN": 128, "BK": 64, "num_stages": 4, "num_warps": 8, "group_m": 8}
    path = config_cache.store("matmul_triton", "hashA", "4096x4096x4096:bfloat16", cfg, h200.name)
    assert path.parent == tmp_path / "linattn" / "configs" and path.exists()
    assert config_cache.lookup("matmul_triton", "hashA", "4096x4096x4096:bfloat16", h200) == cfg
    assert config_cache.lookup("matmul_triton", "hashB", "4096x4096x4096:bfloat16", h200) is None   # source changed
    other = DeviceFacts("cuda", "NVIDIA A100", (8, 0), 108, 166912, 0)
    assert config_cache.lookup("matmul_triton", "hashA", "4096x4096x4096:bfloat16", other) is None  # other GPU
    assert not config_cache.fits_shared_memory(240000, h200) and config_cache.fits_shared_memory(200000, h200)
