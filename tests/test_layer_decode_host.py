"""The host path of GatedDeltaNet's eager decode step: what one token costs the host besides its kernels. Counted on
CPU tensors with the Triton launches stubbed out (linattn/ops/gated_delta_rule/triton/hostsim.py): the torch ops it
dispatches (only o_proj's matmul launches device work besides the four Triton kernels), no custom-op
dispatch, no host synchronisation (with a padding mask too: padded rows become padded slots instead of packing the
batch), and the ops' repeat-call shortcuts (checks and backend choice remembered per signature). The padded-slot
step is checked against the fp64 rendering of FLA's layer."""
import pytest
import torch

from linattn.layers import RecurrentCache
from linattn.ops.conv1d import update as conv_update
from linattn.ops.conv1d import validation as conv_validation
from linattn.ops.gated_delta_rule import fused_recurrent, validation
from linattn.ops.gated_delta_rule.triton.hostsim import count_torch_ops, stub_interpreted_launches
from linattn.ops.norm import api as norm_api
from linattn.runtime.settings import settings
from linattn.testing import TOL, assert_close
from test_layer_gated_deltanet import fla_reference, make_layer  # tests/ on sys.path

pytestmark = pytest.mark.skipif(not settings.interpret, reason="CPU tensors under TRITON_INTERPRET=1")

# the six input projections in one launch (LinearGroup), the q, k and v convolution windows in one
# (causal_conv1d_update3), then the decode op and the gated norm
LAUNCHES = ["linear_group_kernel", "conv1d_update3_kernel", "fused_recurrent_gdn_fwd_kernel",
            "rms_norm_gated_fwd_kernel"]
# aten ops per decode step: 7 projections (t, view, mm, _unsafe_view each), 5 output allocations and 14 views
# (heads split and merged, conv weights squeezed); with a mask 3 more (the slots: select, ne, where). Device work:
# the 7 matmuls (+ ne and where). Before the layer's host path was cut: 56 aten ops, 4 custom-op dispatches, and
# with a mask 85 aten ops (37 of them device work) and 4 host syncs (benchmarks/OPT_LOG.md).
MAX_ATEN = 47


def _padded_batch(B, T):
    """A 0/1 mask [B, T] with a left-padded and a right-padded row (row 0 full)."""
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, T - 1:] = 0
    return mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(allow_neg_eigval=True, conv_bias=True)])
def test_decode_step_ops_and_syncs(monkeypatch, masked, kw):
    # the CPU-only value checks of the decode op (a GPU call makes none): left out, as tests/test_host_path_fwd.py
    monkeypatch.setattr(validation, "check_gate_values", lambda *a, **k: None)
    monkeypatch.setattr(fused_recurrent, "_check_index_values", lambda *a, **k: None)
    monkeypatch.setattr(conv_validation, "check_index_values", lambda *a, **k: None)
    torch.manual_seed(5)
    B, T = 3, 6
    layer = make_layer(**kw).eval()
    mask = _padded_batch(B, T + 1) if masked else None
    x, nxt = torch.randn(B, T, 32), torch.randn(B, 1, 32)
    cache = RecurrentCache()
    with torch.no_grad():
        layer(x, attention_mask=None if mask is None else mask[:, :T], past_key_values=cache, use_cache=True)

        def step():
            return layer(nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
        with stub_interpreted_launches() as launches:
            step()                                   # fills the repeat-call shortcuts
            del launches[:]
            ops = count_torch_ops(step)
    assert launches == LAUNCHES
    assert ops["syncs"] == [], ops["syncs"]
    assert ops["custom"] == []                       # eager: launchers called without the custom ops' dispatch
    extra = ["aten.ne.Scalar", "aten.where.self"] if masked else []
    assert sorted(ops["device_ops"]) == sorted(["aten.mm.default"] + extra), ops["device_ops"]      # o_proj
    assert ops["aten"] <= MAX_ATEN + (3 if masked else 0), ops


@pytest.mark.parametrize("kw", [dict(), dict(allow_neg_eigval=True, conv_bias=True)])
def test_masked_decode_step_leaves_padded_rows_alone(kw):
    """A decode step whose mask pads one row (its last column 0): the live rows continue their sequences (FLA's
    output and states), the padded row's output is zeros and its recurrent state and convolution windows are left
    as they were, all without packing the batch."""
    torch.manual_seed(6)
    B, T = 3, 6
    layer = make_layer(**kw).eval()
    mask = _padded_batch(B, T)
    step_mask = torch.cat([mask, torch.tensor([[1], [1], [0]])], 1)       # row 2 padded in the step
    x, nxt = torch.randn(B, T, 32), torch.randn(B, 1, 32)
    cache = RecurrentCache()
    with torch.no_grad():
        layer(x, attention_mask=mask, past_key_values=cache, use_cache=True)
        state0 = cache[0]["recurrent_state"].clone()
        conv0 = [c.clone() for c in cache[0]["conv_state"]]
        out = torch.full((B, 1, 32), float("nan"))
        out.copy_(layer(nxt, attention_mask=step_mask, past_key_values=cache, use_cache=True)[0])
    assert torch.equal(out[2], torch.zeros(1, 32))
    assert torch.equal(cache[0]["recurrent_state"][2], state0[2])
    for got, before in zip(cache[0]["conv_state"], conv0):
        assert torch.equal(got[2], before[2])
    # the live rows against FLA's layer on their whole sequences (packed)
    seqs = [torch.cat([x[b][mask[b].bool()], nxt[b]]) for b in range(2)]
    cu = torch.tensor([0, len(seqs[0]), len(seqs[0]) + len(seqs[1])], dtype=torch.int32)
    ref, ref_state, ref_conv = fla_reference(layer, torch.cat(seqs).unsqueeze(0), cu_seqlens=cu)
    tol = TOL[torch.float32]
    assert_close("o", out[:2, 0], ref[0, cu[1:] - 1], tol)
    assert_close("recurrent_state", cache[0]["recurrent_state"][:2], ref_state, tol)
    for got, want in zip(cache[0]["conv_state"], ref_conv):
        assert_close("conv_state", got[:2], want, tol)


def test_repeat_calls_skip_checks_but_not_for_a_new_signature(monkeypatch):
    """causal_conv1d_update and rms_norm_gated remember a call signature whose checks passed: a repeat call skips the
    checks, a call with another shape or dtype is checked (and a bad one refused) as before; the conv state's
    version counter moves with each in-place update, as through the mutating custom op."""
    calls = []
    orig_conv, orig_norm = conv_update.check_update_inputs, norm_api._check
    monkeypatch.setattr(conv_update, "check_update_inputs", lambda *a: calls.append("conv") or orig_conv(*a))
    monkeypatch.setattr(norm_api, "_check", lambda *a: calls.append("norm") or orig_norm(*a))
    conv_update._CHECKED.clear()
    norm_api._CHECKED.clear()
    D, W = 24, 4
    x, state, w = torch.randn(2, D), torch.randn(2, D, W), torch.randn(D, W)
    y = torch.randn(5, 16)
    g, nw = torch.randn(5, 16), torch.randn(16)
    with stub_interpreted_launches():
        for _ in range(3):
            v = state._version
            conv_update.causal_conv1d_update(x, state, w, None, "silu")
            assert state._version == v + 1
            norm_api.rms_norm_gated(y, g, nw)
        assert calls == ["conv", "norm"]
        conv_update.causal_conv1d_update(x.double(), state, w, None, "silu", backend="reference")
        norm_api.rms_norm_gated(y[:3], g[:3], nw)
        assert calls == ["conv", "norm", "conv", "norm"]
        with pytest.raises(ValueError, match="conv_state"):
            conv_update.causal_conv1d_update(x, state[:1], w, None, "silu")
        with pytest.raises(ValueError, match="group_size"):
            norm_api.rms_norm_gated(y, g, nw, group_size=5)
