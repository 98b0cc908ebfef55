"""linattn.layers.GatedDeltaNet against a plain-PyTorch fp64 rendering of FLA 0.6's layer written here (forward and
every gradient), FLA's parameter names, prefill + decode against the full forward, padding masks against varlen."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from linattn.layers import GatedDeltaNet, RecurrentCache
from linattn.testing import TOL, assert_close

from layer_checks import check_inference_modes, check_prefill_then_decode   # tests/ is on sys.path

TOL32 = TOL[torch.float32]

# fla.layers.GatedDeltaNet's state dict (FLA 0.6.0), name -> shape, for hidden H, heads h of size d, value heads
# hv of size dv, conv width w; conv biases with conv_bias=True, g_proj with use_gate=True
def fla_state_dict_shapes(H, h, d, hv, dv, w, use_gate=True, conv_bias=False):
    kd, vd = h * d, hv * dv
    shapes = {"A_log": (hv,), "dt_bias": (hv,), "q_proj.weight": (kd, H), "k_proj.weight": (kd, H),
              "v_proj.weight": (vd, H), "a_proj.weight": (hv, H), "b_proj.weight": (hv, H),
              "q_conv1d.weight": (kd, 1, w), "k_conv1d.weight": (kd, 1, w), "v_conv1d.weight": (vd, 1, w),
              "o_norm.weight": (dv,), "o_proj.weight": (H, vd)}
    if conv_bias:
        shapes.update({"q_conv1d.bias": (kd,), "k_conv1d.bias": (kd,), "v_conv1d.bias": (vd,)})
    if use_gate:
        shapes["g_proj.weight"] = (vd, H)
    return shapes


CFG = dict(hidden_size=32, head_dim=16, num_heads=1, num_v_heads=2, expand_v=2, conv_size=4, layer_idx=0)


def make_layer(**kw):
    """A layer with every parameter drawn at random (norm weights and conv biases included), so that each one
    changes the output."""
    cfg = {**CFG, **kw}
    layer = GatedDeltaNet(**cfg)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("proj.weight"):
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
            elif name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name == "dt_bias":
                p.normal_(0, 1)
            elif "conv1d" in name:
                p.normal_(0, 0.5)
            else:                       # o_norm.weight
                p.uniform_(0.5, 1.5)
    return layer


def fla_reference(layer, x, cu_seqlens=None, state=None, conv=None):
    """FLA's GatedDeltaNet forward for packed or batched x [B, T, hidden], written out in fp64 from the layer's
    parameters: short convolutions with SiLU, L2-normalised q/k, gate and beta, the recurrence one token at a
    time, the gated RMSNorm, o_proj. Returns (o, final recurrent states [N, HV, K, V], conv windows)."""
    p = {n: t.double() for n, t in layer.state_dict().items()}
    x = x.double()
    B, T, _ = x.shape
    h, d, hv, dv, W = layer.num_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim, layer.conv_size
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    out = torch.zeros(B, T, layer.hidden_size, dtype=torch.float64)
    states, windows = [], []
    for n, (b, s, e) in enumerate(bounds):
        xs = x[b, s:e]                                                    # [L, hidden]
        feats, wins = [], []
        for i, name in enumerate("qkv"):
            y = xs @ p[f"{name}_proj.weight"].T
            if layer.use_short_conv:
                prev = conv[i][n].T if conv is not None else y.new_zeros(W, y.shape[1])   # [W, D], oldest first
                full = torch.cat([prev, y])                                               # FLA's [N, D, W] window
                wins.append(full[-W:].T)
                wgt = p[f"{name}_conv1d.weight"][:, 0]                                    # [D, W]
                y = torch.stack([(full[t + 1:t + 1 + W] * wgt.T).sum(0) for t in range(y.shape[0])]) \
                    if y.shape[0] else y
                if f"{name}_conv1d.bias" in p:
                    y = y + p[f"{name}_conv1d.bias"]
            feats.append(F.silu(y))
        q, k = (f.view(-1, h, d) for f in feats[:2])
        v = feats[2].view(-1, hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        g = -p["A_log"].exp() * F.softplus(xs @ p["a_proj.weight"].T + p["dt_bias"])
        beta = torch.sigmoid(xs @ p["b_proj.weight"].T) * (2.0 if layer.allow_neg_eigval else 1.0)
        S = state[n].double() if state is not None else x.new_zeros(hv, d, dv)
        heads = torch.arange(hv) // (hv // h)                               # value head j reads q/k head j // G
        o = []
        for t in range(e - s):
            qh, kh = q[t, heads] * d ** -0.5, k[t, heads]                   # [HV, K]
            S = S * g[t].exp()[:, None, None]
            u = beta[t, :, None] * (v[t] - torch.einsum("jkv,jk->jv", S, kh))
            S = S + kh[:, :, None] * u[:, None, :]
            o.append(torch.einsum("jkv,jk->jv", S, qh))
        o = torch.stack(o) if o else x.new_zeros(0, hv, dv)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * p["o_norm.weight"]
        if layer.use_gate:
            gate = (xs @ p["g_proj.weight"].T).view(-1, hv, dv)
            act = layer.o_norm.activation
            o = o * (torch.sigmoid(gate) if act == "sigmoid" else F.silu(gate))
        out[b, s:e] = o.flatten(-2) @ p["o_proj.weight"].T
        states.append(S)
        windows.append(wins)
    conv_out = [torch.stack([w[i] for w in windows]) for i in range(3)] if layer.use_short_conv else None
    return out, torch.stack(states), conv_out


def test_state_dict_names_are_flas():
    for kw in [dict(), dict(use_gate=False, conv_bias=True, num_v_heads=None, expand_v=1.5)]:
        layer = GatedDeltaNet(**{**CFG, **kw})
        shapes = fla_state_dict_shapes(32, 1, 16, layer.num_v_heads, layer.head_v_dim, 4,
                                       use_gate=kw.get("use_gate", True), conv_bias=kw.get("conv_bias", False))
        got = {n: tuple(t.shape) for n, t in layer.state_dict().items()}
        assert got == shapes
        assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32
        if not kw.get("use_gate", True):
            assert layer.o_norm.weight.dtype == torch.float32       # FLA's RMSNorm(dtype=torch.float32)


def test_init_matches_flas_ranges():
    layer = GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=4, num_v_heads=512, expand_v=1)
    A = layer.A_log.detach().exp()
    assert A.min() >= 0 and A.max() <= 16 and A.std() > 1
    dt = F.softplus(layer.dt_bias.detach())
    assert dt.min() >= 1e-4 - 1e-7 and dt.max() <= 0.1 + 1e-6
    assert torch.equal(layer.o_norm.weight.detach(), torch.ones(16))


def test_state_dict_round_trip():
    """An FLA-named state dict (fresh random values) loads strict into the layer and gives FLA's output."""
    src = make_layer(conv_bias=True)
    sd = {n: torch.randn_like(t) if n not in ("A_log",) else t.clone() for n, t in src.state_dict().items()}
    sd["o_norm.weight"] = sd["o_norm.weight"].abs() + 0.5
    dst = GatedDeltaNet(**CFG, conv_bias=True)
    dst.load_state_dict(sd, strict=True)
    for n, t in dst.state_dict().items():
        assert torch.equal(t, sd[n]), n
    with pytest.raises(RuntimeError):
        GatedDeltaNet(**CFG).load_state_dict(sd, strict=True)          # conv biases the layer does not have
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        o, _, _ = dst(x)
    assert_close("o", o, fla_reference(dst, x)[0], TOL32)


@pytest.mark.parametrize("kw,T", [
    (dict(conv_bias=True), 66),                                            # GVA, T past one chunk
    (dict(use_gate=False, allow_neg_eigval=True, num_v_heads=None), 33),
    (dict(use_short_conv=False, output_gate_activation="sigmoid"), 1),
])
def test_forward_and_gradients(kw, T):
    torch.manual_seed(0)
    with pytest.warns(UserWarning) if not kw.get("use_short_conv", True) else contextlib.nullcontext():
        layer = make_layer(**kw)
    layer.train()
    x = torch.randn(2, T, 32, requires_grad=True)
    o, _, _ = layer(x)
    do = torch.randn_like(o)
    o.backward(do)
    x64 = x.detach().double().requires_grad_()
    params = dict(layer.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    p64 = {n: t.double().requires_grad_() for n, t in saved.items()}
    o64 = _reference_with_params(layer, p64, x64)
    o64.backward(do.double())
    assert_close("o", o, o64, TOL32)
    assert_close("dx", x.grad, x64.grad, TOL32)
    for n, p in params.items():
        assert p.grad is not None, n
        assert_close(f"d{n}", p.grad, p64[n].grad, TOL32)


def _reference_with_params(layer, p64, x64, **kw):
    """fla_reference with the parameters taken from p64 (fp64 leaves), so that its gradients are the reference's."""
    orig = layer.state_dict
    layer.state_dict = lambda: p64
    try:
        return fla_reference(layer, x64, **kw)[0]
    finally:
        layer.state_dict = orig


@pytest.mark.parametrize("T", [5, 66])
def test_inference_modes(T):
    check_inference_modes(make_layer(), fla_reference, T)


@pytest.mark.parametrize("kw", [dict(), dict(allow_neg_eigval=True, conv_bias=True)])
def test_prefill_then_decode(kw):
    check_prefill_then_decode(make_layer(**kw), fla_reference)


def test_padding_mask_equals_varlen():
    """A left- and right-padded batch with a 0/1 mask gives each sequence's own output (zeros at padding), the same
    as the packed varlen call, and FLA's output; forward and gradients."""
    torch.manual_seed(3)
    layer = make_layer(conv_bias=True)
    T = 7                        # sequences of 7, 1 and 5 tokens
    mask = torch.zeros(3, T, dtype=torch.long)
    mask[0, :7] = 1
    mask[1, -1:] = 1             # left padding
    mask[2, :5] = 1              # right padding
    x = torch.randn(3, T, 32, requires_grad=True)
    o, _, _ = layer(x, attention_mask=mask)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    idx = mask.flatten().nonzero().flatten()
    packed = x.detach().reshape(-1, 32)[idx].unsqueeze(0).requires_grad_()
    cu = torch.tensor([0, 7, 8, 13], dtype=torch.int32)
    o_packed, _, _ = layer(packed, cu_seqlens=cu)
    (o_packed * do.reshape(-1, 32)[idx].unsqueeze(0)).sum().backward()
    assert torch.equal(o.detach().reshape(-1, 32)[mask.flatten() == 0], torch.zeros(int((mask == 0).sum()), 32))
    assert_close("o", o.detach().reshape(-1, 32)[idx], o_packed[0].detach(), 1e-6)
    assert_close("dx", x.grad.reshape(-1, 32)[idx], packed.grad[0], 1e-6)
    assert torch.equal(x.grad.reshape(-1, 32)[mask.flatten() == 0], torch.zeros(int((mask == 0).sum()), 32))
    for n, p in layer.named_parameters():
        assert_close(f"d{n}", grads[n], p.grad, 1e-6)
    ref = fla_reference(layer, packed.detach(), cu_seqlens=cu)[0]
    assert_close("o vs FLA", o_packed.detach(), ref, TOL32)


def test_decode_after_padded_prefill():
    """A left- and right-padded prefill with a cache, then a decode step whose mask grows by a column of ones,
    continues each sequence from its own states."""
    torch.manual_seed(4)
    layer = make_layer(conv_bias=True).eval()
    T = 7
    mask = torch.zeros(3, T, dtype=torch.long)
    mask[0, :7] = 1
    mask[1, -1:] = 1
    mask[2, :5] = 1
    x = torch.randn(3, T, 32)
    cache = RecurrentCache()
    nxt = torch.randn(3, 1, 32)
    with torch.no_grad():
        layer(x, attention_mask=mask, past_key_values=cache, use_cache=True)
        o1, _, _ = layer(nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                         past_key_values=cache, use_cache=True)
    seqs = [x[b][mask[b].bool()] for b in range(3)]
    full = torch.cat([torch.cat([s, nxt[b]]) for b, s in enumerate(seqs)]).unsqueeze(0)
    cu2 = torch.tensor([0, 8, 10, 16], dtype=torch.int32)
    ref2 = fla_reference(layer, full, cu_seqlens=cu2)[0][0, cu2[1:] - 1]
    assert_close("decode after padding", o1[:, 0], ref2, TOL32)


def test_bad_inputs():
    layer = make_layer()
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(1, 4, 32), attention_mask=torch.ones(1, 4, 4))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 4, 32), attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="layer_idx"):
        GatedDeltaNet(**{**CFG, "layer_idx": None})(torch.randn(1, 4, 32), past_key_values=RecurrentCache())
    with pytest.raises(ValueError, match="mode"):
        GatedDeltaNet(**CFG, mode="parallel")
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(**{**CFG, "num_heads": 2, "num_v_heads": 3})
    with pytest.raises(ValueError, match="expand_v"):
        GatedDeltaNet(**{**CFG, "expand_v": 0.3})
    with pytest.raises(ValueError, match="output_gate_activation"):
        GatedDeltaNet(**CFG, output_gate_activation="relu")
