"""linattn.integrations.transformers: transformers' Qwen3-Next on linattn's ops (a tiny random model, fp32, CPU).

The model after enable() against transformers' own computation (its torch fallbacks here) and an fp64 forward;
generate() through the cache; no torch fallback runs once enabled; disable() restores everything; training
gradients; the causal-conv1d adapters against fp64 references of causal-conv1d's semantics; clear refusals."""
import contextlib
import copy
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra pins 4.57.3)")

import linattn.integrations.transformers as lt  # noqa: E402
from linattn.integrations.transformers_check import build_tiny_model, check_tiny_model, main, own_path  # noqa: E402
from linattn.ops.gated_delta_rule import reference  # noqa: E402
from linattn.testing import TOL, rel_rms  # noqa: E402

mod = lt._module()
MODULE_HOOKS = lt.hooks(mod) == "module"      # transformers 5.x: the layers call the module's kernel functions
TOL32 = TOL[torch.float32]
# 4.x: layer attribute -> transformers' torch fallback
FALLBACKS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
             "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
             "causal_conv1d_update": "torch_causal_conv1d_update"}
# 5.x: module function -> linattn's hook
CALLED = {"torch_chunk_gated_delta_rule": lt.hf_chunk_gated_delta_rule,
          "torch_recurrent_gated_delta_rule": lt.hf_recurrent_gated_delta_rule,
          "causal_conv1d_fn": lt.hf_causal_conv1d_fn, "causal_conv1d_update": lt.causal_conv1d_update}


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    lt.disable()
    assert not lt.is_enabled()


def _gdn_layers(model):
    return [m for m in model.modules() if isinstance(m, mod.Qwen3NextGatedDeltaNet)]


def _boom(name):
    def f(*args, **kwargs):
        raise AssertionError(f"transformers' fallback {name} ran with linattn enabled")
    return f


def _counting(fn, counts, name):
    def f(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)
    return f


def test_logits_and_generate_match_transformers_and_fp64():
    """Greedy generate() of 8 tokens for a batch of 2 (prefill, then decode steps through transformers' cache) gives
    the same tokens with and without linattn; the step logits, and the logits of a no-cache forward of the whole
    sequence, match transformers' own at fp32 and an fp64 forward (GatedDeltaNet core on linattn's fp64
    reference)."""
    r = check_tiny_model("cpu", torch.float32, new_tokens=8, batch=2, prompt_len=16, seed=torch.seed() % 1000)
    assert r["tokens_equal"], r
    assert set(r["errors"]) == {"decode_vs_own", "forward_vs_own", "forward_vs_fp64", "decode_vs_fp64",
                                "own_forward_vs_fp64"}, r
    for name, err in r["errors"].items():
        assert err <= TOL32, (name, r)
    assert r["passed"] and r["bound"] == TOL32 and len(r["checked"]) == 4


def test_hooks_detected():
    """The hooks follow what the layer's forward calls: module functions on transformers 5.x, per-layer copies on
    4.x (the versions tested)."""
    assert MODULE_HOOKS == (int(transformers.__version__.split(".")[0]) >= 5)


def test_no_torch_fallback_runs_once_enabled(monkeypatch):
    """With enable() a model built afterwards runs its GatedDeltaNet layers only on linattn: transformers' torch
    fallbacks (4.x: the functions the layers would copy; 5.x: the module functions the layers call, replaced
    before enable() saves them), its slow conv path (nn.Conv1d) and its torch gated norm raise if called; each
    linattn function runs (the chunked op and conv on the prefill, the decode op and conv update on each new
    token)."""
    base_norm = mod.Qwen3NextRMSNormGated
    for name in (CALLED if MODULE_HOOKS else FALLBACKS.values()):
        monkeypatch.setattr(mod, name, _boom(name))
    monkeypatch.setattr(base_norm, "forward", _boom("Qwen3NextRMSNormGated.forward"))
    lt.enable()
    try:
        model = build_tiny_model(seed=3)
        counts = {}
        layers = _gdn_layers(model)
        assert layers
        for layer in layers:
            assert type(layer.norm) is lt._norm_class(base_norm)
            layer.conv1d.forward = _boom("the slow conv path (nn.Conv1d)")
            layer.norm.forward = _counting(layer.norm.forward, counts, "norm")
        if MODULE_HOOKS:
            for name, fn in CALLED.items():
                assert getattr(mod, name) is fn, name
                monkeypatch.setattr(mod, name, _counting(fn, counts, name))
        else:
            for layer in layers:
                assert layer.chunk_gated_delta_rule is lt.chunk_gated_delta_rule
                assert layer.recurrent_gated_delta_rule is lt.recurrent_gated_delta_rule
                assert layer.causal_conv1d_fn is lt.causal_conv1d_fn
                assert layer.causal_conv1d_update is lt.causal_conv1d_update
                for attr in ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "causal_conv1d_fn",
                             "causal_conv1d_update"):
                    setattr(layer, attr, _counting(getattr(layer, attr), counts, attr))
        ids = torch.randint(1, 128, (2, 9))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False, pad_token_id=0)
    finally:
        lt.disable()                  # before monkeypatch puts transformers' functions back
    assert out.shape == (2, 12)
    n = len(layers)
    names = list(CALLED) if MODULE_HOOKS else ["chunk_gated_delta_rule", "recurrent_gated_delta_rule",
                                               "causal_conv1d_fn", "causal_conv1d_update"]
    assert counts == {names[0]: n, names[1]: 2 * n, names[2]: n, names[3]: 2 * n, "norm": 3 * n}, counts


def test_disable_restores_the_originals():
    """enable() replaces the module globals (twice is harmless), disable() puts back the very same objects; a model
    built after disable() takes transformers' own functions; enable(model) switches a model built before (4.x: its
    functions and norm; 5.x: its norm, its ops follow the module) and disable(model) gives its layers back what
    transformers picks, the norm keeping its weight."""
    originals = {n: getattr(mod, n) for n in lt._globals(mod)}
    model = build_tiny_model(seed=1)
    layer = _gdn_layers(model)[0]
    attrs = ("norm",) if MODULE_HOOKS else lt.LAYER_ATTRS
    own = {a: getattr(layer, a) for a in attrs}
    weight = layer.norm.weight
    base = originals["Qwen3NextRMSNormGated"]

    lt.enable()
    lt.enable()
    assert lt.is_enabled()
    assert mod.causal_conv1d_update is lt.causal_conv1d_update
    assert mod.Qwen3NextRMSNormGated is lt._norm_class(base)
    if MODULE_HOOKS:
        for name, fn in CALLED.items():
            assert getattr(mod, name) is fn, name
    else:
        assert mod.chunk_gated_delta_rule is lt.chunk_gated_delta_rule
        assert mod.fused_recurrent_gated_delta_rule is lt.recurrent_gated_delta_rule
        assert mod.causal_conv1d_fn is lt.causal_conv1d_fn
        assert mod.FusedRMSNormGated is None and mod.is_fast_path_available is True
        assert layer.chunk_gated_delta_rule is own["chunk_gated_delta_rule"]   # built before: unchanged
    assert type(layer.norm) is type(own["norm"])                               # built before: unchanged

    assert lt.enable(model) is model
    if not MODULE_HOOKS:
        assert layer.chunk_gated_delta_rule is lt.chunk_gated_delta_rule
        assert layer.recurrent_gated_delta_rule is lt.recurrent_gated_delta_rule
    assert layer.norm is own["norm"] and layer.norm.weight is weight    # the same module, linattn's forward
    assert type(layer.norm) is lt._norm_class(base) and isinstance(layer.norm, base)

    lt.disable()
    for n, v in originals.items():
        assert getattr(mod, n) is v, n
    after = _gdn_layers(build_tiny_model(seed=1))[0]
    if not MODULE_HOOKS:
        for attr, fallback in FALLBACKS.items():
            fast = {"recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}.get(attr, attr)
            assert getattr(after, attr) is (originals[fast] or getattr(mod, fallback)), attr
        assert layer.chunk_gated_delta_rule is lt.chunk_gated_delta_rule    # disable() alone leaves the live model
    assert type(after.norm) is base or originals.get("FusedRMSNormGated") is not None
    assert type(layer.norm) is lt._norm_class(base)                        # ... and its norm

    assert lt.disable(model) is model
    for a in attrs:
        assert getattr(layer, a) is own[a], a
    assert layer.norm is own["norm"] and type(layer.norm) is type(own["norm"]) and layer.norm.weight is weight
    lt.disable()                                                         # harmless when not enabled
    assert all(getattr(mod, n) is v for n, v in originals.items())


def test_training_gradients_match_transformers():
    """A training step without a cache (the chunked op, the conv and the gated norm with their backward): the loss
    and every parameter's gradient match transformers' own torch computation at fp32."""
    own = build_tiny_model(seed=torch.seed() % 1000).train()
    lin = lt.enable(copy.deepcopy(own))
    ids = torch.randint(1, 128, (2, 21))
    grads = []
    for m, path in ((own, own_path()), (lin, contextlib.nullcontext())):
        m.zero_grad(set_to_none=True)
        with path:
            out = m(ids, labels=ids)
            out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (loss_own, g_own), (loss_lin, g_lin) = grads
    assert rel_rms(loss_lin, loss_own) <= TOL32
    gdn = [n for n in g_own if ".linear_attn." in n]
    assert {n.split(".linear_attn.")[1] for n in gdn} >= {"conv1d.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
                                                            "dt_bias", "A_log", "norm.weight", "out_proj.weight"}
    for n, g in g_own.items():
        if g is None:
            assert g_lin[n] is None, n
            continue
        assert rel_rms(g_lin[n], g) <= TOL32, (n, rel_rms(g_lin[n], g))


def test_decode_step_with_grad_mode_on():
    """A user's decode loop without torch.no_grad(): the step runs (linattn's decode ops have no backward, so they run
    without autograd) and matches the same step under no_grad; a backward through it raises, as FLA's does."""
    lt.enable()
    model = build_tiny_model(seed=5)
    ids = torch.randint(1, 128, (2, 7))
    nxt = torch.randint(1, 128, (2, 1))
    logits = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            cache = model(ids, use_cache=True).past_key_values
            logits.append(model(nxt, past_key_values=cache, use_cache=True).logits)
    assert logits[1].requires_grad
    assert rel_rms(logits[1], logits[0]) <= TOL32
    with pytest.raises(NotImplementedError, match="no backward"):
        logits[1].sum().backward()


def _conv_fn_ref(x, weight, bias, h0, activation):
    """causal-conv1d's semantics in fp64: x [B, D, T], state [B, D, W - 1]; returns (y, final [B, D, W - 1])."""
    W = weight.shape[1]
    xx = torch.cat([h0, x], -1) if h0 is not None else F.pad(x, (W - 1, 0))
    y = F.conv1d(xx, weight.unsqueeze(1), bias, groups=x.shape[1])
    final = F.pad(xx, (W - 1 - xx.shape[-1], 0))
    return (F.silu(y) if activation else y), final


@pytest.mark.parametrize("T", [1, 2, 37])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_fn_adapter(T, activation):
    """x [B, D, T] (a transposed view, as Qwen3-Next passes it), initial and final states [B, D, W - 1] (T < W - 1
    too), final_states_out written in place; outputs and every gradient against fp64."""
    B, D, W = 2, 24, 4
    x = torch.randn(B, T, D).transpose(1, 2).requires_grad_()
    w = torch.randn(D, W, requires_grad=True)
    b = torch.randn(D, requires_grad=True)
    h0 = torch.randn(B, D, W - 1, requires_grad=True)
    out_buf = torch.full((B, D, W - 1), float("nan"))
    y, fin = lt.causal_conv1d_fn(x, w, b, initial_states=h0, return_final_states=True, final_states_out=out_buf,
                                 activation=activation)
    assert fin is out_buf and y.shape == (B, D, T)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, b, h0)]
    y64, fin64 = _conv_fn_ref(*leaves64[:2], leaves64[2], leaves64[3], activation)
    assert rel_rms(y, y64) <= TOL32 and rel_rms(fin, fin64) <= TOL32
    dy, dfin = torch.randn_like(y), torch.randn_like(fin)
    grads = torch.autograd.grad((y, fin), (x, w, b, h0), (dy, dfin))
    grads64 = torch.autograd.grad((y64, fin64), leaves64, (dy.double(), dfin.double()))
    for name, g, g64 in zip(("x", "weight", "bias", "initial_states"), grads, grads64):
        assert rel_rms(g, g64) <= TOL32, name
    y2 = lt.causal_conv1d_fn(x.detach(), w.detach(), None, activation=activation)        # no state, no bias
    assert rel_rms(y2, _conv_fn_ref(x.detach().double(), w.detach().double(), None, None, activation)[0]) <= TOL32


@pytest.mark.parametrize("T", [None, 3])
def test_causal_conv1d_update_adapter(T):
    """x [B, D] or [B, D, T]; a contiguous and a channel-last conv state (what transformers' prefill stores) both
    updated in place; a pool with conv_state_indices and a padded (-1) row; against fp64."""
    B, D, W = 3, 20, 4
    w, b = torch.randn(D, W), torch.randn(D)
    x = torch.randn(B, D) if T is None else torch.randn(B, T, D).transpose(1, 2)
    for state in (torch.randn(B, D, W), torch.randn(B, W, D).transpose(1, 2)):
        st64 = state.double()
        xx = torch.cat([st64, x.double().unsqueeze(-1) if T is None else x.double()], -1)
        ref = F.silu(F.conv1d(xx, w.double().unsqueeze(1), b.double(), groups=D))[..., -(T or 1):]
        ref = ref.squeeze(-1) if T is None else ref
        y = lt.causal_conv1d_update(x, state, w, b, "silu")
        assert y.shape == x.shape
        assert rel_rms(y, ref) <= TOL32
        assert rel_rms(state, xx[..., -W:]) <= TOL32
    pool = torch.randn(5, D, W)
    before = pool.clone()
    idx = torch.tensor([4, -1, 1])
    y = lt.causal_conv1d_update(x, pool, w, None, None, conv_state_indices=idx)
    xs = x.double().unsqueeze(-1) if T is None else x.double()
    for row, slot in ((0, 4), (2, 1)):
        xx = torch.cat([before[slot].double(), xs[row]], -1)
        ref = F.conv1d(xx[None], w.double().unsqueeze(1), groups=D)[0, :, -(T or 1):]
        assert rel_rms(y[row], ref.squeeze(-1) if T is None else ref) <= TOL32
        assert rel_rms(pool[slot], xx[..., -W:]) <= TOL32
    assert torch.count_nonzero(y[1]) == 0
    assert torch.equal(pool[[0, 2, 3]], before[[0, 2, 3]])


def test_refusals_name_the_argument():
    x, w = torch.randn(2, 8, 5), torch.randn(8, 4)
    with pytest.raises(NotImplementedError, match="seq_idx"):
        lt.causal_conv1d_fn(x, w, seq_idx=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="activation"):
        lt.causal_conv1d_fn(x, w, activation="gelu")
    with pytest.raises(ValueError, match="x must be"):
        lt.causal_conv1d_fn(x[0], w)
    with pytest.raises(ValueError, match="initial_states"):
        lt.causal_conv1d_fn(x, w, initial_states=torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match="final_states_out"):
        lt.causal_conv1d_fn(x, w, return_final_states=True, final_states_out=torch.randn(2, 8, 4))
    with pytest.raises(NotImplementedError, match="cache_seqlens"):
        lt.causal_conv1d_update(x[:, :, 0], torch.randn(2, 8, 4), w, cache_seqlens=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="conv_state"):
        lt.causal_conv1d_update(x[:, :, 0], torch.randn(2, 8, 3), w)
    with pytest.raises(NotImplementedError, match="activation"):
        lt.causal_conv1d_update(x[:, :, 0], torch.randn(2, 8, 4), w, activation="relu")
    with pytest.raises(TypeError, match="model"):
        lt.enable("not a model")
    with pytest.raises(ValueError, match="no Qwen3NextGatedDeltaNet"):
        lt.enable(torch.nn.Linear(2, 2))
    assert not lt.is_enabled()                     # a refused model changes nothing
    norm = lt._norm_class(mod.Qwen3NextRMSNormGated)(16)
    with pytest.raises(ValueError, match="gate"):
        norm(torch.randn(3, 16))


def test_missing_transformers_or_hooks_raise_clear_errors(monkeypatch):
    hooked = lt._globals(mod)
    with monkeypatch.context() as m:
        m.delattr(mod, hooked[2])
        m.delattr(mod, hooked[4])
        with pytest.raises(ImportError, match=f"lacks {hooked[2]}, {hooked[4]}"):
            lt.enable()
    assert not lt.is_enabled()
    with monkeypatch.context() as m:
        m.setitem(__import__("sys").modules, "transformers", None)
        with pytest.raises(ImportError, match="needs transformers"):
            lt.enable()


def test_gpu_check_script_dry_run(tmp_path):
    """linattn/integrations/transformers_check.py, the lead's GPU script, at tiny sizes on the CPU: the model check
    passes and every layer row has its time (FLA's rows only where FLA imports)."""
    path = tmp_path / "check.json"
    assert main(["--dry-run", "--out", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["passed"] and res["model"][0]["passed"] and res["model"][0]["tokens_equal"]
    layer = res["layer"]
    assert [(r["B"], r["T"]) for r in layer["train"]] == [(1, 40), (2, 24)]
    assert [r["batch"] for r in layer["decode"]] == [1, 3]
    for row in layer["train"]:
        assert row["linattn_ms"] > 0, row
    for row in layer["decode"]:
        assert row["linattn_eager_ms"] > 0 and "linattn_graph_ms" not in row, row
    assert ("fla" in layer["errors"]) != any("fla_ms" in r for r in layer["train"])


def test_gpu_check_script_times_the_kda_layer(tmp_path):
    """--kda adds the KimiDeltaAttention layer's rows (linattn's timed; FLA's only where FLA imports)."""
    path = tmp_path / "check.json"
    assert main(["--dry-run", "--skip-model", "--skip-layer", "--kda", "--out", str(path)]) == 0
    layer = json.loads(path.read_text())["layer_kda"]
    assert layer["kind"] == "kda" and len(layer["train"]) == 2 and len(layer["decode"]) == 2
    for row in layer["train"]:
        assert row["linattn_ms"] > 0, row
    for row in layer["decode"]:
        assert row["linattn_eager_ms"] > 0, row
    assert ("fla" in layer["errors"]) != any("fla_ms" in r for r in layer["train"])


def test_5x_call_sites_drop_transformers_kwargs_and_take_gva():
    """The hooks transformers 5.x calls: the kwargs it passes on (position_ids, output_attentions, ...) are dropped,
    the ones linattn takes kept (cu_seqlens); q/k with H heads and v with HV = 2H (as 5.25 passes them) against an
    fp64 reference of q/k repeated per value head (transformers' repeat_interleave, as 5.17 passes them): outputs,
    final state and every gradient; a sequence not a multiple of the chunk; a 1-token decode step; seq_idx refused."""
    B, T, H, HV, K, V = 1, 23, 1, 2, 16, 16
    extra = dict(position_ids=torch.arange(T)[None], output_attentions=False, max_length_q=T, is_causal=True)
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g = -torch.rand(B, T, HV)
    beta = torch.rand(B, T, HV)
    h0 = torch.randn(2, HV, K, V)                                  # one state per sequence of cu
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    cu = torch.tensor([0, 9, T])
    o, fin = lt.hf_chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4], initial_state=leaves[5],
                                          output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                          **extra)
    l64 = [t.detach().double().requires_grad_() for t in (q, k, v, g, beta, h0)]
    qr, kr = (x.repeat_interleave(HV // H, dim=2) for x in l64[:2])
    o64, fin64 = reference.chunk_gated_delta_rule(qr, kr, *l64[2:5], initial_state=l64[5],
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                  cu_seqlens=cu)
    assert rel_rms(o, o64) <= TOL32 and rel_rms(fin, fin64) <= TOL32
    do, dfin = torch.randn_like(o), torch.randn_like(fin)
    grads = torch.autograd.grad((o, fin), leaves, (do, dfin))
    grads64 = torch.autograd.grad((o64, fin64), l64, (do.double(), dfin.double()))
    for name, gr, gr64 in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads64):
        assert rel_rms(gr, gr64) <= TOL32, name

    with torch.no_grad():                                          # the decode step, as the 5.x layer calls it
        o1, s1 = lt.hf_recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g=g[:, :1], beta=beta[:, :1],
                                                  initial_state=h0[:1], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens=None, **extra)
    o1_64, s1_64 = reference.naive_recurrent(*(x[:, :1].double().repeat_interleave(HV // H, dim=2) for x in (q, k)),
                                             v[:, :1].double(), g[:, :1].double(), beta[:, :1].double(),
                                             initial_state=h0[:1].double(), output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    assert rel_rms(o1, o1_64) <= TOL32 and rel_rms(s1, s1_64) <= TOL32

    x, w = torch.randn(2, 8, 5), torch.randn(8, 4)
    y = lt.hf_causal_conv1d_fn(x, w, None, activation="silu", **extra)
    assert rel_rms(y, _conv_fn_ref(x.double(), w.double(), None, None, "silu")[0]) <= TOL32
    with pytest.raises(NotImplementedError, match="seq_idx"):
        lt.hf_causal_conv1d_fn(x, w, None, activation="silu", seq_idx=torch.zeros(2, 5, dtype=torch.int32), **extra)
