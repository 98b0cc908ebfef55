"""The Triton forward's state pass at BV=16: where it is taken, and that the forward computes the same thing with it.

1. forward._configs_for: BV_state 16 only where 32-column blocks leave SMs idle and 16-column ones still fit one wave
   (B1-B2 at H2/HV8 K=V=128 on 132 SMs), never on a CPU (one "SM").
2. The Triton forward with the 16-column config forced (the launcher's _configs patched: on a CPU the rule never
   takes it) under the interpreter: o and the final state against the fp64 recurrence within linattn.testing.TOL,
   and against the default config's forward on the same inputs, with every buffer it allocates NaN-poisoned;
   dense, GVA, varlen with 1-token sequences, V = 48 and 40 (not multiples of 32; 40 not of 16), without an
   initial state.
Fresh random inputs each run."""
import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens, rel_rms


def test_config_rule():
    cfg = fwd_mod._configs_for
    assert cfg(128, 128, 1, 8, "cuda", 132).BV_state == 16            # 32 programs at BV=32, 64 at 16
    assert cfg(128, 128, 2, 8, "cuda", 132).BV_state == 16            # 64 / 128
    assert cfg(128, 128, 3, 8, "cuda", 132).BV_state == 32            # 96 / 192: 16 would need two waves
    assert cfg(128, 128, 1, 32, "cuda", 132).BV_state == 32           # 128 / 256
    assert cfg(128, 128, 8, 32, "cuda", 132).BV_state == 64
    assert cfg(128, 128, 1, 8, "cpu", 132).BV_state == 64             # a CPU counts as one SM: no split
    assert cfg(256, 256, 1, 2, "cuda", 132).BV_state == 16            # K = 256 starts at 32: then 16


def _forced_bv16(monkeypatch):
    """The launcher's config with BV_state = 16 whatever the device (the rule of _configs_for as on an H200 for
    these small head counts)."""
    real = fwd_mod._configs

    def configs(K, V, N, HV, device):
        c = real(K, V, N, HV, device)
        return type(c)(**{**c.__dict__, "BV_state": 16})
    monkeypatch.setattr(fwd_mod, "_configs", configs)


def _fp64(x):
    return {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


@pytest.mark.parametrize("B,T,H,HV,K,V,lens,h0", [
    (1, 130, 1, 2, 64, 64, None, True),
    (2, 65, 2, 4, 32, 48, None, False),
    (1, None, 1, 2, 32, 40, [1, 63, 1, 66], True),
])
def test_forward_at_bv16(monkeypatch, B, T, H, HV, K, V, lens, h0):
    cu = random_cu_seqlens(lens) if lens else None
    x = make_gdn_inputs(B, sum(lens) if lens else T, H, HV, K, V, dtype=torch.bfloat16, initial_state=h0,
                        num_states=len(lens) if lens else B)
    with torch.no_grad(), poisoned_allocations():
        o32, h32 = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend="triton")
        _forced_bv16(monkeypatch)
        assert fwd_mod._configs(K, V, B, HV, "cpu").BV_state == 16
        o16, h16 = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend="triton")
    ref_o, ref_ht = naive_recurrent(**_fp64(x), output_final_state=True, cu_seqlens=cu)
    assert_close("o", o16, ref_o, TOL[torch.bfloat16])
    assert_close("final_state", h16, ref_ht, TOL[torch.bfloat16])
    # the V split changes no column's arithmetic: the two configs agree far below the bf16 tolerance
    assert rel_rms(o16, o32) < 1e-6 and rel_rms(h16, h32) < 1e-6, (rel_rms(o16, o32), rel_rms(h16, h32))


def test_aot_build_no_spill():
    """gdn_fwd_triton_state_bv16_w4 (sm_90a, ptxas): 0 spill, no local memory, the products on WGMMA, and no more
    registers than the BV=32 build's."""
    from linattn.runtime.aot import inspect_kernel, kernels
    reg = kernels()
    rep, ref = (inspect_kernel(reg[f"gdn_fwd_triton_state_bv{bv}_w4"]) for bv in (16, 32))
    assert rep.spill_bytes == 0 and rep.families["LDL"] == 0 and rep.families["STL"] == 0, rep.sass
    assert not rep.missing and rep.families["HGMMA"] > 0, rep.sass
    assert rep.regs <= ref.regs, (rep.regs, ref.regs)


def test_backward_recompute_at_bv16(monkeypatch):
    """The Triton backward recomputes the forward's state pass with the forward's config (_configs): with BV=16
    forced there, every gradient agrees with the default config's on the same inputs and upstream gradients (the
    V split changes no column's arithmetic), and is finite."""
    x = make_gdn_inputs(1, 130, 1, 2, 32, 48, dtype=torch.float32, initial_state=True)
    do = torch.randn_like(x["v"])
    dht = torch.randn(1, 2, 32, 48)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def grads():
        leaves = {n: x[n].detach().clone().requires_grad_(True) for n in names}
        o, ht = linattn.chunk_gated_delta_rule(**{**x, **leaves}, output_final_state=True, backend="triton")
        torch.autograd.backward([o, ht], [do, dht])
        return {n: leaves[n].grad for n in names}
    ref = grads()
    _forced_bv16(monkeypatch)
    got = grads()
    for n in names:
        assert torch.isfinite(got[n]).all(), n
        assert rel_rms(got[n], ref[n]) < 1e-6, (n, rel_rms(got[n], ref[n]))
