"""Checks every recurrent layer (GatedDeltaNet, KimiDeltaAttention) must pass, each against the test file's own FLA
reference: fla_reference(layer, x, ...) -> (o, final recurrent state, conv windows). tests/ is on sys.path."""
import torch

from linattn.layers import RecurrentCache
from linattn.testing import TOL, assert_close

TOL32 = TOL[torch.float32]


def check_inference_modes(layer, fla_reference, T: int):
    """No grad: T <= 64 runs the recurrent op, longer inputs the chunked op; both equal FLA's forward."""
    torch.manual_seed(1)
    layer = layer.eval()
    x = torch.randn(2, T, layer.hidden_size)
    with torch.no_grad():
        o, _, _ = layer(x)
    assert_close("o", o, fla_reference(layer, x)[0], TOL32)


def check_prefill_then_decode(layer, fla_reference):
    """A prefill with a cache, then tokens one at a time, equals the full forward; the cache (the one the layer
    returns) holds FLA's states and conv windows."""
    torch.manual_seed(2)
    layer = layer.eval()
    x = torch.randn(2, 69, layer.hidden_size)
    ref, ref_state, ref_conv = fla_reference(layer, x)
    cache = RecurrentCache()
    with torch.no_grad():
        o0, _, cache = layer(x[:, :66], past_key_values=cache, use_cache=True)
        outs = [o0]
        for t in range(66, 69):
            o, _, cache = layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            outs.append(o)
    assert_close("o", torch.cat(outs, 1), ref, TOL32)
    assert cache.get_seq_length(0) == 69
    assert_close("recurrent_state", cache[0]["recurrent_state"], ref_state, TOL32)
    for got, want in zip(cache[0]["conv_state"], ref_conv):
        assert_close("conv_state", got, want, TOL32)
