"""linattn.layers.KimiDeltaAttention against a plain-PyTorch fp64 rendering of FLA 0.6's layer written here (forward
and every gradient), FLA's parameter names, prefill + decode against the full forward, padding masks against
varlen."""
import math

import pytest
import torch
import torch.nn.functional as F

from linattn.layers import KimiDeltaAttention, RecurrentCache
from linattn.testing import TOL, assert_close

from layer_checks import check_inference_modes, check_prefill_then_decode   # tests/ is on sys.path

TOL32 = TOL[torch.float32]
CFG = dict(hidden_size=32, head_dim=16, num_heads=1, num_v_heads=2, expand_v=1, conv_size=4, layer_idx=0)


def fla_state_dict_shapes(H, h, d, hv, dv, w, conv_bias=False):
    """fla.layers.KimiDeltaAttention's state dict (FLA 0.6.0), name -> shape, for hidden H, heads h of size d,
    value heads hv of size dv, conv width w."""
    kd, vd = h * d, hv * dv
    shapes = {"A_log": (hv,), "dt_bias": (hv * d,), "q_proj.weight": (kd, H), "k_proj.weight": (kd, H),
              "v_proj.weight": (vd, H), "q_conv1d.weight": (kd, 1, w), "k_conv1d.weight": (kd, 1, w),
              "v_conv1d.weight": (vd, 1, w), "f_proj.0.weight": (dv, H), "f_proj.1.weight": (hv * d, dv),
              "b_proj.weight": (hv, H), "g_proj.0.weight": (dv, H), "g_proj.1.weight": (vd, dv),
              "g_proj.1.bias": (vd,), "o_norm.weight": (dv,), "o_proj.weight": (H, vd)}
    if conv_bias:
        shapes.update({"q_conv1d.bias": (kd,), "k_conv1d.bias": (kd,), "v_conv1d.bias": (vd,)})
    return shapes


def make_layer(**kw):
    """A layer with every parameter drawn at random (norm weight, conv and g_proj biases included)."""
    layer = KimiDeltaAttention(**{**CFG, **kw})
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("weight") and "proj" in name:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
            elif name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(1, 4).log())
            elif name in ("dt_bias", "g_proj.1.bias"):
                p.normal_(0, 1)
            elif "conv1d" in name:
                p.normal_(0, 0.5)
            else:                       # o_norm.weight
                p.uniform_(0.5, 1.5)
    return layer


def fla_reference(layer, x, p=None, cu_seqlens=None, state=None, conv=None):
    """FLA's KimiDeltaAttention forward for packed or batched x [B, T, hidden] in fp64 from the layer's parameters
    (or p, fp64 leaves): short convolutions with SiLU, L2-normalised q/k, the KDA gate and beta, the recurrence one
    token at a time, the sigmoid-gated RMSNorm, o_proj. Returns (o, final states [N, HV, V, K], conv windows)."""
    p = p if p is not None else {n: t.double() for n, t in layer.state_dict().items()}
    x = x.double()
    B, T, _ = x.shape
    h, d, hv, dv, W = layer.num_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim, layer.conv_size
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    out = torch.zeros(B, T, layer.hidden_size, dtype=torch.float64)
    states, windows = [], []
    for n, (b, s, e) in enumerate(bounds):
        xs = x[b, s:e]
        feats, wins = [], []
        for i, name in enumerate("qkv"):
            y = xs @ p[f"{name}_proj.weight"].T
            prev = conv[i][n].T if conv is not None else y.new_zeros(W, y.shape[1])
            full = torch.cat([prev, y])
            wins.append(full[-W:].T)
            wgt = p[f"{name}_conv1d.weight"][:, 0]
            y = torch.stack([(full[t + 1:t + 1 + W] * wgt.T).sum(0) for t in range(y.shape[0])])
            if f"{name}_conv1d.bias" in p:
                y = y + p[f"{name}_conv1d.bias"]
            feats.append(F.silu(y))
        q, k = (f.view(-1, h, d) for f in feats[:2])
        v = feats[2].view(-1, hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        graw = ((xs @ p["f_proj.0.weight"].T) @ p["f_proj.1.weight"].T).view(-1, hv, d) + p["dt_bias"].view(hv, d)
        if layer.lower_bound is None:
            g = -p["A_log"].exp()[:, None] * F.softplus(graw)
        else:
            g = layer.lower_bound * torch.sigmoid(p["A_log"].exp()[:, None] * graw)
        beta = torch.sigmoid(xs @ p["b_proj.weight"].T) * (2.0 if layer.allow_neg_eigval else 1.0)
        S = state[n].double().transpose(-1, -2) if state is not None else x.new_zeros(hv, d, dv)   # [HV, K, V]
        heads = torch.arange(hv) // (hv // h)
        o = []
        for t in range(e - s):
            qh, kh = q[t, heads] * d ** -0.5, k[t, heads]
            S = S * g[t].exp()[:, :, None]                                  # the decay per key channel
            u = beta[t, :, None] * (v[t] - torch.einsum("jkv,jk->jv", S, kh))
            S = S + kh[:, :, None] * u[:, None, :]
            o.append(torch.einsum("jkv,jk->jv", S, qh))
        o = torch.stack(o)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * p["o_norm.weight"]
        gate = ((xs @ p["g_proj.0.weight"].T) @ p["g_proj.1.weight"].T + p["g_proj.1.bias"]).view(-1, hv, dv)
        out[b, s:e] = (o * torch.sigmoid(gate)).flatten(-2) @ p["o_proj.weight"].T
        states.append(S.transpose(-1, -2))
        windows.append(wins)
    return out, torch.stack(states), [torch.stack([w[i] for w in windows]) for i in range(3)]


def test_state_dict_names_are_flas():
    for kw in [dict(), dict(conv_bias=True, num_v_heads=None, expand_v=2)]:
        layer = KimiDeltaAttention(**{**CFG, **kw})
        shapes = fla_state_dict_shapes(32, 1, 16, layer.num_v_heads, layer.head_v_dim, 4, kw.get("conv_bias", False))
        assert {n: tuple(t.shape) for n, t in layer.state_dict().items()} == shapes
        assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32


def test_init_matches_flas_ranges():
    layer = KimiDeltaAttention(hidden_size=64, head_dim=16, num_heads=4, num_v_heads=256)
    A = layer.A_log.detach().exp()
    assert A.min() >= 1 and A.max() <= 16 and A.std() > 1
    dt = F.softplus(layer.dt_bias.detach())
    assert dt.min() >= 1e-4 - 1e-7 and dt.max() <= 0.1 + 1e-6
    assert torch.equal(KimiDeltaAttention(**CFG, safe_gate=True, lower_bound=-5.0).A_log.detach(), torch.zeros(2))


@pytest.mark.parametrize("kw,T", [
    (dict(conv_bias=True), 66),                                            # GVA, T past one chunk
    (dict(allow_neg_eigval=True, num_v_heads=None, lower_bound=-5.0, safe_gate=True), 33),
])
def test_forward_and_gradients(kw, T):
    """Training (the chunked op): the output, dx and every parameter's gradient against the fp64 rendering."""
    torch.manual_seed(0)
    layer = make_layer(**kw).train()
    x = torch.randn(2, T, 32, requires_grad=True)
    o, _, _ = layer(x)
    do = torch.randn_like(o)
    o.backward(do)
    x64 = x.detach().double().requires_grad_()
    params = dict(layer.named_parameters())
    p64 = {n: t.detach().double().requires_grad_() for n, t in params.items()}
    o64 = fla_reference(layer, x64, p=p64)[0]
    o64.backward(do.double())
    assert_close("o", o, o64, TOL32)
    assert_close("dx", x.grad, x64.grad, TOL32)
    for n, p in params.items():
        assert p.grad is not None, n
        assert_close(f"d{n}", p.grad, p64[n].grad, TOL32)


@pytest.mark.parametrize("T", [5, 66])
def test_inference_modes(T):
    check_inference_modes(make_layer(), fla_reference, T)


def test_prefill_then_decode():
    """In place on the fp32 states; the cache holds FLA's states ([N, HV, V, K]) and conv windows."""
    check_prefill_then_decode(make_layer(conv_bias=True), fla_reference)


def test_padding_mask_equals_varlen_and_padded_decode():
    """A left-padded batch equals each sequence alone, in a prefill and in a decode step after it (padded rows of
    the step keep their states and give zeros)."""
    torch.manual_seed(3)
    layer = make_layer().eval()
    lens = [7, 3]
    x = torch.randn(2, 8, 32)
    mask = torch.zeros(2, 8, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, 8 - n:] = 1
    cache = RecurrentCache()
    with torch.no_grad():
        o, _, _ = layer(x, attention_mask=mask, past_key_values=cache, use_cache=True)
        step = torch.randn(2, 1, 32)
        mask2 = torch.cat([mask, torch.tensor([[1], [0]])], 1)
        o2, _, _ = layer(step, attention_mask=mask2, past_key_values=cache, use_cache=True)
    for b, n in enumerate(lens):
        ref, state, conv = fla_reference(layer, x[b:b + 1, 8 - n:])
        assert_close(f"o[{b}]", o[b, 8 - n:], ref[0], TOL32)
        assert torch.equal(o[b, :8 - n], torch.zeros_like(o[b, :8 - n]))
        if b == 0:
            ref2, state2, _ = fla_reference(layer, step[:1], state=state, conv=conv)
            assert_close("decode o[0]", o2[0], ref2[0], TOL32)
            assert_close("decode state[0]", cache[0]["recurrent_state"][0], state2[0], TOL32)
        else:
            assert torch.equal(o2[1], torch.zeros_like(o2[1]))
            assert_close("untouched state[1]", cache[0]["recurrent_state"][1], state[0], TOL32)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="lower_bound"):
        KimiDeltaAttention(**CFG, safe_gate=True)
    with pytest.raises(ValueError, match="num_v_heads"):
        KimiDeltaAttention(**{**CFG, "num_v_heads": 3, "num_heads": 2})
    with pytest.raises(ValueError, match="hidden_states"):
        KimiDeltaAttention(**CFG)(torch.randn(2, 3, 31))
