"""The reg_prefetch walk of the persistent decode kernel (round 30; the batch-256 fp32 default since then, with
evict_last): no software pipeliner, the next tile's state block loaded into registers by plain 16-byte loads before
the current tile's arithmetic, its slot index a tile further ahead, with an L2 eviction hint on that load.

On the CPU under TRITON_INTERPRET=1: o and the pool (or the out-of-place final state) equal the pipelined default's
bit for bit (the same _decode_token arithmetic), with padded and out-of-range rows, more programs than tiles and
uneven runs, and against fp64; the variant's flag rules; the launcher's choice (reg_prefetch+evict_last by default,
the pipelined walk when LINATTN_GDN_DECODE_VARIANT names one of its variants). Ahead of time for sm_90a: no cp.async
and no shared-memory ring, 16 16-byte state loads with the hint (LDG.E.EL.128 for evict_last) issued before the
tile's first CTA barrier and its 16 state stores, no spill."""
import os
import re

import pytest
import torch

from decode_aot import tile_loop_lines                                   # tests/ is on sys.path
from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
from linattn.ops.gated_delta_rule.triton import fused_recurrent as fr
from linattn.runtime.aot import kernel_asm
from linattn.testing import TOL, assert_close, make_gdn_inputs, poison_

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernel needs TRITON_INTERPRET=1 on a CPU")


def _call(x, pool, idx, cfg, inplace, ht=None):
    o = poison_(torch.empty_like(x["v"]))
    fr.fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, pool, None, idx,
                               x.get("A_log"), x.get("dt_bias"), False, x.get("beta_sigmoid", False), not inplace,
                               inplace, config=cfg, out=o, final_out=ht)
    return o


def test_flags():
    f = fr.persistent_variant_flags("reg_prefetch+evict_last+store_cs")
    assert f["REG_PREFETCH"] and f["LOAD_EVICT"] == "evict_last" and f["STORE_CACHE"] == ".cs"
    with pytest.raises(ValueError, match="add reg_prefetch"):
        fr.persistent_variant_flags("evict_first")
    for other in ("prefetch_qk", "split_tail", "kwarp", "store_first", "fused_reduce"):
        with pytest.raises(ValueError, match="reg_prefetch"):
            fr.persistent_variant_flags("reg_prefetch+" + other)
    assert fr.PERSISTENT_OWN_WALK == {"reg_prefetch", "evict_first", "evict_last"}


@interpreter
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("programs", [None, 5, 7, 200])
@pytest.mark.parametrize("variant", ["reg_prefetch", "reg_prefetch+evict_last", "reg_prefetch+evict_first+store_cs"])
def test_matches_the_pipelined_default_bit_for_bit(inplace, programs, variant):
    """48 tiles of BV=16 (6 sequences x 4 value heads x 2 V-blocks) over 1 "SM": 2, 5, 7 or 200 programs (uneven
    runs; more programs than tiles); slots 7, 0, 3, 5 live, -1 and 11 padded; GVA (H = 2, HV = 4) with the fused
    gate and beta_sigmoid."""
    torch.manual_seed(programs or 0)
    N, H, HV, K, V, slots = 6, 2, 4, 32, 32, 9
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=torch.float32, initial_state=False)
    del x["initial_state"]
    x.update(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV), beta=torch.randn_like(x["beta"]), beta_sigmoid=True)
    pool0 = torch.randn(slots, HV, K, V)
    idx = torch.tensor([7, -1, 0, 3, 11, 5])
    res = {}
    for name, cfg in (("pipelined", (16, 1, 3, 2, programs, "prefetch_qk")), ("reg", (16, 1, 1, 2, programs, variant))):
        pool = pool0.clone()
        ht = None if inplace else poison_(torch.empty(N, HV, K, V))
        o = _call(x, pool, idx, cfg, inplace, ht)
        res[name] = (o, pool if inplace else ht, pool)
    (o_a, s_a, _), (o_b, s_b, p_b) = res["pipelined"], res["reg"]
    assert not torch.isnan(o_b).any() and not torch.isnan(s_b).any()
    assert torch.equal(o_b, o_a) and torch.equal(s_b, s_a)
    if not inplace:
        assert torch.equal(p_b, pool0)                     # out of place: the pool is only read
    assert torch.equal(o_b[[1, 4]], torch.zeros_like(o_b[[1, 4]]))
    live = [0, 2, 3, 5]
    f64 = {n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**f64, initial_state=ref_pool, state_indices=idx, inplace=True)
    assert_close("o", o_b[live].double(), ro[live], TOL[torch.float32])
    got = p_b if inplace else s_b[live]
    want = ref_pool if inplace else ref_pool[idx[live]]
    assert_close("state", got.double(), want, TOL[torch.float32])


def test_default_config():
    sms = 132
    assert fr.decode_persistent_config(256, 32, 128, 128, 1, False, torch.float32, sms) == \
        (64, 4, 1, 2, None, "reg_prefetch+evict_last")
    assert fr.decode_persistent_config(256, 32, 128, 128, 1, False, torch.float32, sms, inplace=False) == \
        (64, 4, 1, 2, None, "reg_prefetch+evict_last+store_cs")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="launches the kernel on CPU tensors: needs "
                                                                       "TRITON_INTERPRET=1")
def test_launcher_default_and_the_pipelined_escape(monkeypatch):
    seen = []
    real = fr.fused_recurrent_gdn_fwd_persistent_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append((kw["REG_PREFETCH"], kw["LOAD_EVICT"], kw["PREFETCH_QK"], kw["NUM_STAGES"]))
                return real[grid](*a, **kw)
            return launch
    monkeypatch.setattr(fr, "fused_recurrent_gdn_fwd_persistent_kernel", Spy())
    monkeypatch.setattr(fr, "device_facts", lambda dev: type("F", (), {"num_sms": 1, "capability": (0, 0)})())
    N, H, HV, K, V = 16, 2, 2, 32, 16
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=torch.float32, initial_state=False)
    pool = torch.randn(N, HV, K, V)
    idx = torch.randperm(N)
    for env, want in ((None, (True, "evict_last", False, 1)), ("store_cs", (True, "evict_last", False, 1)),
                      ("prefetch_qk", (False, "", True, 3)), ("store_first", (False, "", True, 3))):
        if env is None:
            monkeypatch.delenv("LINATTN_GDN_DECODE_VARIANT", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_DECODE_VARIANT", env)
        seen.clear()
        fr.fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, None, None,
                                   False, False, False, True)
        assert seen == [want], (env, seen)


def test_aot_plain_loads_with_the_hint_before_the_arithmetic():
    name = "gdn_decode_persistent_fp32_bv64_w4_s1_reg_prefetch_evict_last"
    sass = kernel_asm(name, "sass")
    loop = tile_loop_lines(sass)
    assert "LDGSTS" not in sass and "LDGDEPBAR" not in sass        # no cp.async
    loads = [i for i, l in enumerate(loop) if re.search(r"\bLDG\.E\.EL\.128\b", l)]
    stores = [i for i, l in enumerate(loop) if re.search(r"\bSTG\.E\.128\b", l)]
    bars = [i for i, l in enumerate(loop) if "BAR.SYNC" in l]
    assert len(loads) == 16 and len(stores) == 16, (len(loads), len(stores))
    assert max(loads) < min(bars) and max(loads) < min(stores)
    plain = tile_loop_lines(kernel_asm("gdn_decode_persistent_fp32_bv64_w4_s1_reg_prefetch", "sass"))
    assert sum(bool(re.search(r"\bLDG\.E\.128\b", l)) for l in plain) == 16
