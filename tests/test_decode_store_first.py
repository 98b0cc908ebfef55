"""The store_first variant of the persistent decode kernel (round 29, opt-in): the updated state is stored before the
second reduction over K and o is computed from it, o = S'^T q (the default: o = S^T q + u (k . q), the same quantity
rounded otherwise). On the CPU under TRITON_INTERPRET=1: the state equal to the default's bit for bit (the update is
the same arithmetic), o within fp32 rounding of the default's, both against fp64, in place and out of place, padded
and out-of-range rows; ahead of time for sm_90a: the state stores before the second reduction's CTA barriers."""
import os

import pytest
import torch

from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
from linattn.ops.gated_delta_rule.triton.fused_recurrent import (PERSISTENT_REORDERING, fused_recurrent_gdn_fwd,
                                                                 persistent_variant_flags)
from decode_aot import tile_loop_lines                                   # tests/ is on sys.path
from linattn.runtime.aot import kernel_asm
from linattn.testing import TOL, assert_close, make_gdn_inputs, poison_, rel_rms

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernel needs TRITON_INTERPRET=1 on a CPU")


def _call(x, pool, idx, cfg, inplace, ht=None):
    o = poison_(torch.empty_like(x["v"]))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, pool, None, idx,
                            x.get("A_log"), x.get("dt_bias"), False, x.get("beta_sigmoid", False), not inplace,
                            inplace, config=cfg, out=o, final_out=ht)
    return o


def test_flags():
    assert "store_first" in PERSISTENT_REORDERING
    assert persistent_variant_flags("prefetch_qk+store_first")["STORE_FIRST"]
    with pytest.raises(ValueError, match="store_first"):
        persistent_variant_flags("kwarp+store_first")


@interpreter
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("programs", [None, 5])
def test_store_first_matches_default_and_fp64(inplace, gate, programs):
    N, H, HV, K, V, slots = 6, 2, 4, 32, 32, 9
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=torch.float32, initial_state=False)
    del x["initial_state"]
    if gate:
        x.update(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV), beta=torch.randn_like(x["beta"]),
                 beta_sigmoid=True)
    pool0 = torch.randn(slots, HV, K, V)
    idx = torch.tensor([7, -1, 0, 3, 11, 5])
    res = {}
    for name, cfg in (("default", (16, 1, 2, 1, programs, "prefetch_qk")),
                      ("store_first", (16, 1, 2, 1, programs, "prefetch_qk+store_first"))):
        pool = pool0.clone()
        ht = None if inplace else poison_(torch.empty(N, HV, K, V))
        o = _call(x, pool, idx, cfg, inplace, ht)
        res[name] = (o, pool if inplace else ht, pool)
    (o_a, s_a, p_a), (o_b, s_b, p_b) = res["default"], res["store_first"]
    assert torch.equal(s_b, s_a)                       # the state update is the same arithmetic
    if not inplace:
        assert torch.equal(p_b, pool0)
    live = [0, 2, 3, 5]
    assert torch.equal(o_b[[1, 4]], torch.zeros_like(o_b[[1, 4]]))
    assert rel_rms(o_b[live], o_a[live]) < 1e-5 and not torch.isnan(o_b).any()
    f64 = {n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**f64, initial_state=ref_pool, state_indices=idx, inplace=True)
    assert_close("o", o_b[live].double(), ro[live], TOL[torch.float32])
    if inplace:
        assert_close("pool", p_b.double(), ref_pool, TOL[torch.float32])


def test_aot_state_stores_before_the_second_reduction():
    """sm_90a: in the tile loop the 16 state stores (STG.E.128) come before more of the CTA barriers than in the
    default (the second reduction over K now follows them), and the build keeps 2 programs per SM, no spill."""
    from linattn.runtime.aot import inspect_kernel, kernels
    counts = {}
    for n in ("gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk_store_first",
              "gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk"):
        loop = tile_loop_lines(kernel_asm(n, "sass"))
        st = [i for i, l in enumerate(loop) if "STG.E.128" in l]
        assert len(st) == 16
        counts[n] = sum(1 for i, l in enumerate(loop) if "BAR.SYNC" in l and i > max(st))
        r = inspect_kernel(kernels()[n])
        assert r.regs <= 255 and r.spill_bytes == 0
    sf, base = counts.values()
    assert sf >= base + 3, counts


@interpreter
def test_environment_switch_adds_variants_to_the_default_config(monkeypatch):
    """LINATTN_GDN_DECODE_VARIANT adds opt-in variants to the default persistent config (here store_first: state
    bit-equal, o within rounding, not bit-equal); discard_l2, which cannot run off a GPU, is left out silently, so
    the call equals the default's bit for bit; an unknown name fails with the known ones listed."""
    from linattn.ops.gated_delta_rule.triton.fused_recurrent import decode_persistent_config
    N, H, HV, K, V = 4, 2, 8, 32, 128                  # N * HV * V/64 = 64 tiles >= 32 per "SM" of this host (2)
    assert decode_persistent_config(N, HV, K, V, 1, False, torch.float32, 2) is not None
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=torch.float32, initial_state=False)
    del x["initial_state"]
    pool0 = torch.randn(N + 2, HV, K, V)
    idx = torch.tensor([5, 0, -1, 2])
    res = {}
    for name, env in (("default", None), ("store_first", "store_first"), ("discard", "discard_l2")):
        if env is None:
            monkeypatch.delenv("LINATTN_GDN_DECODE_VARIANT", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_DECODE_VARIANT", env)
        pool = pool0.clone()
        res[name] = (_call(x, pool, idx, None, True), pool)
    (o0, p0), (o1, p1), (o2, p2) = res["default"], res["store_first"], res["discard"]
    assert torch.equal(p1, p0) and not torch.equal(o1, o0) and rel_rms(o1, o0) < 1e-5
    assert torch.equal(o2, o0) and torch.equal(p2, p0)
    monkeypatch.setenv("LINATTN_GDN_DECODE_VARIANT", "nope")
    with pytest.raises(ValueError, match="unknown persistent decode variant"):
        _call(x, pool0.clone(), idx, None, True)
