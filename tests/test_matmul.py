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


# ------------------------------------------------------------------ split-K, the launch plans and the host path

@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,split_k,row_stride", [(1, 8, 2, 8), (67, 136, 4, 136), (130, 40, 2, 48)])
def test_splitk_reduce_sums_the_slices(M, N, split_k, row_stride, dtype):
    """The split-K epilogue: slices of M_pad rows (BM-rounded; the padding rows hold garbage the sum must skip)."""
    from linattn.ops.matmul.triton.splitk_reduce import splitk_reduce
    m_pad = -(-M // 128) * 128
    ws = torch.randn(split_k * m_pad, N)
    for s in range(split_k):
        ws[s * m_pad + M:(s + 1) * m_pad] = float("nan")          # padding rows: never read
    out = poison_(torch.empty(M, row_stride, dtype=dtype))[:, :N]
    splitk_reduce(ws, out, split_k)
    ref = sum(ws[s * m_pad:s * m_pad + M].double() for s in range(split_k))
    assert_close(f"splitk_reduce {M}x{N}/{split_k}", out, ref, TOL[dtype])


def test_gluon_pick_config_splits_k_only_when_it_fills_idle_sms():
    from linattn.ops.matmul.gluon.matmul import CONFIGS, pick_config
    assert pick_config(16384, 128, 16384, 132).split_k == 1     # 128 tiles on 132 SMs: a split only adds waves
    assert pick_config(4096, 128, 16384, 132).split_k == 4      # 32 tiles: 4 slices fill 128 SMs
    assert pick_config(4096, 128, 2048, 132).split_k == 1       # K too short for the partials to pay
    assert pick_config(8192, 8192, 8192, 132) is CONFIGS["128x256x64_s3_w8"]
    for name, cfg in CONFIGS.items():
        assert cfg.smem_bytes() <= 232448 - 1024, name           # leaves room for the compiler's own bytes


def test_gluon_configs_match_their_names():
    from linattn.ops.matmul.gluon.matmul import CONFIGS
    for name, c in CONFIGS.items():
        base = f"{c.BM}x{c.BN}x{c.BK}_s{c.stages}_w{c.num_warps}"
        suffix = (f"_k{c.split_k}" if c.split_k > 1 else "")
        assert name == base + suffix, (name, c)


@needs_interpreter
def test_backend_choice_is_cached_per_signature_and_follows_the_environment(monkeypatch):
    from linattn.ops.matmul import api
    from linattn.ops.matmul.launch import host_path_options
    a, b = torch.randn(24, 16).bfloat16(), torch.randn(16, 40).bfloat16()
    api._SELECTED.clear()
    matmul(a, b)
    assert [v.name for v in api._SELECTED.values()] == ["triton"]
    calls = []
    monkeypatch.setattr(api._backends.backends["triton"], "supports", lambda **kw: calls.append(1) or (True, "ok"))
    matmul(a, b)
    assert not calls                                  # a hit: no supports() call
    matmul(torch.randn(24, 16).bfloat16(), b)         # same signature, new tensors: still a hit
    assert not calls
    monkeypatch.setenv("LINATTN_BACKEND", "reference")
    out = matmul(a, b)                                # the env default is part of the key
    assert torch.equal(out, matmul_reference(a, b))
    monkeypatch.delenv("LINATTN_BACKEND")
    with host_path_options(plan_cache=False):
        matmul(a, b)
    assert calls                                      # cache off: supports() asked again
    with pytest.raises(ValueError, match="inner dimensions"):   # errors are never cached away
        matmul(a, a)
    with pytest.raises(ValueError, match="inner dimensions"):
        matmul(a, a)


@needs_interpreter
def test_triton_plan_cache_keys_on_alignment_and_config():
    from linattn.ops.matmul.triton import matmul as tm
    tm.clear_plans()
    a, b = torch.randn(33, 20).half(), torch.randn(20, 17).half()
    base = torch.empty(33 * 17 + 1, dtype=torch.float16)
    aligned, misaligned = base[:33 * 17].view(33, 17), base[1:].view(33, 17)
    for out in (aligned, misaligned):
        tm.matmul_triton(a, b, out=out)
        assert_close("plan reuse", out, a.double() @ b.double(), TOL[torch.float16])
    assert len(tm._PLANS) == 2                        # pointer alignment changes the JIT's specialisation
    tm.matmul_triton(a, b, out=aligned, config=tm.CONFIGS["64x64x64_s4_w4"])
    assert len(tm._PLANS) == 3


def test_host_paths_launch_identically():
    """Under a stand-in sm_90 driver (linattn.ops.matmul.hostsim; a child process without TRITON_INTERPRET,
    which would turn the Triton kernels into interpreted functions): with the plan cache off, on, and on with
    the compiled-handle launch, every launch gets the same kernel, grid and arguments, and the handle path
    skips the JIT's run entirely."""
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "linattn.ops.matmul.hostsim", "--check"], capture_output=True,
                          text=True, env=env, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(res) == {"triton", "gluon", "gluon_auto"}
    assert res["gluon_auto"]["kernels"] == ["matmul_ws_persistent", "matmul_splitk_reduce"]
    for name, r in res.items():
        assert r["same"], (name, r)
        assert r["jit_runs"]["plan+handle"] == 0 and r["jit_runs"]["jit"] == r["n_launches"], (name, r)


def test_handle_launch_is_the_default_and_options_turn_it_off_for_a_block():
    """The compiled-handle launch is gated on the H200 (every gate case, both paths, same errors as the JIT
    launch), so it is always on; host_path_options turns it off for a block (A/B timing) and restores it."""
    from linattn.ops.matmul import launch as L
    assert L.HostPath().handle is True and L.host_path.handle is True
    with L.host_path_options(handle=False) as hp:
        assert hp.handle is False
    assert L.host_path.handle is True


@needs_interpreter
def test_default_handle_launch_under_the_interpreter_keeps_using_the_jit(monkeypatch):
    """The interpreter returns no CompiledKernel: with the handle launch on (the default) the Triton path keeps
    launching through the JIT, stores no handle and never asks the (absent) GPU driver for its device."""
    from linattn.ops.matmul import launch as L
    from linattn.ops.matmul.triton import matmul as tm

    def no_driver():
        raise AssertionError("the handle path asked for the current device without a handle")
    monkeypatch.setattr(L, "_current_device", no_driver)
    a, b = torch.randn(40, 24).bfloat16(), torch.randn(24, 56).bfloat16()
    tm.clear_plans()
    with L.host_path_options(handle=True):
        for _ in range(2):
            out = tm.matmul_triton(a, b)
            assert_close("handle default, interpreter", out, a.double() @ b.double(), TOL[torch.bfloat16])
    assert len(tm._PLANS) == 1
    assert all(not p.handles for p in tm._PLANS._plans.values())


def test_descriptor_factory_copies_equal_constructed_descriptors():
    """The per-call descriptor copied from the plan's validated template has the fields the constructor gives,
    with the new base; and it keeps no tensor alive between calls."""
    from linattn.runtime.gluon_compat import GLUON_OK, TensorDescriptor, gl
    if not GLUON_OK:
        pytest.skip("no Gluon in this Triton")
    from linattn.ops.matmul.launch import DescriptorFactory
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    make = DescriptorFactory(TensorDescriptor, [96, 136], [144, 1], [64, 64], layout)
    first = make(torch.empty(96, 144, dtype=torch.bfloat16))
    assert make.fields is not None and all(not isinstance(v, torch.Tensor) for v in make.fields.values())
    t = torch.empty(96, 144, dtype=torch.bfloat16)
    copied, built = make(t), TensorDescriptor(t, [96, 136], [144, 1], [64, 64], layout)
    assert copied is not first and copied.base is t
    for name in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(copied, name) == getattr(built, name), name
    assert type(copied) is TensorDescriptor
