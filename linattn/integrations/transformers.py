"""Run transformers' Qwen3-Next linear-attention layers (Qwen3NextGatedDeltaNet) on linattn's ops.

    import linattn.integrations.transformers as lt

    lt.enable()            # Qwen3-Next models run their GatedDeltaNet layers on linattn (4.x: those built from now on)
    lt.enable(model)       # the same, and switch `model` (built before) too
    lt.disable()           # transformers' own choice again (4.x: for models built afterwards)
    lt.disable(model)      # ... and give `model` its own functions (5.x: its norm) back

Tested with transformers 4.57.3 (the CI pin), 5.17.0 and 5.25.0. The two major versions resolve Qwen3-Next's
kernels differently; enable() finds out which way from what Qwen3NextGatedDeltaNet.forward calls (not from a version
number):

- 4.x ("layer" hooks): `modeling_qwen3_next` imports FLA's `chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule`,
  `FusedRMSNormGated` and causal-conv1d's `causal_conv1d_fn`, `causal_conv1d_update` into module globals once, at
  import (None where missing), and each Qwen3NextGatedDeltaNet copies them (or torch fallbacks) onto itself in
  __init__. enable() replaces the globals, so models built afterwards run linattn; enable(model) also replaces the
  copies of a model built before.
- 5.x ("module" hooks): the layer's forward calls module functions by name at each call:
  `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`, `causal_conv1d_update`
  (5.25 reaches the last two through `causal_conv1d_forward`, which reads and updates the cache's conv state). Each
  is transformers' torch code wrapped by `use_kernel_func_from_hub_with_fallback`, which picks FLA / causal-conv1d
  at import when installed (and, with the `kernels` package, makes the function a hub-kernel module). enable()
  replaces those module functions, so every Qwen3-Next model in the process, built before or after, runs its ops on
  linattn; the gated norm is a module built in __init__, so a model built before enable() keeps transformers' norm
  unless passed to enable(model). The ops cannot be chosen per model here: disable(model) gives that model its
  norm back, and the ops follow enable() / disable().

What runs on linattn:

- the prefill / training path on `linattn.chunk_gated_delta_rule` (differentiable) and `causal_conv1d_fn` below
  (causal-conv1d's API on `linattn.causal_conv1d`, differentiable);
- one-token decode steps on `recurrent_gated_delta_rule` below (`linattn.fused_recurrent_gated_delta_rule`) and
  `causal_conv1d_update` below (`linattn.causal_conv1d_update`, the cache's conv state updated in place);
- the gated RMSNorm on `linattn.rms_norm_gated`: enable() replaces `Qwen3NextRMSNormGated` by `RMSNormGated` (a
  subclass with its constructor and its "weight", so checkpoints load unchanged) and, on 4.x, sets
  `FusedRMSNormGated` to None: 4.x builds FLA's FusedRMSNormGated with device=torch.cuda.current_device(), which
  fails on a machine without a GPU; transformers' own module builds anywhere.

On 5.x, transformers passes its per-call keyword arguments (position_ids, cu_seq_lens_q, ...) on to the kernel
functions and drops those a kernel does not take; the 5.x hooks here do the same against linattn's signatures.
Packed sequences that reach the convolution as `seq_idx` are refused (NotImplementedError), as on 4.x.
`kernelize()` / `use_kernels=True` replaces transformers' functions and norm forward with hub kernels: use one or
the other.

On 4.x a model built before enable() keeps the functions it copied: pass it to enable(model). The cache layout is
transformers' own: conv states [B, D, W] (the last W inputs, oldest first, linattn's layout) and fp32 recurrent
states [B, HV, K, V] (linattn's and FLA's). Works on CUDA and on the CPU (the Triton kernels under
TRITON_INTERPRET=1, else linattn's PyTorch reference).
"""
import functools
import importlib
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from linattn.ops.conv1d import causal_conv1d as _la_conv
from linattn.ops.conv1d import causal_conv1d_update as _la_conv_update
from linattn.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from linattn.ops.gated_delta_rule.fused_recurrent import ForwardOnly
from linattn.ops.norm import rms_norm_gated

MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"
TESTED_VERSIONS = ("4.57.3", "5.17.0", "5.25.0")
# 4.x: the module globals enable() replaces (each layer copies them in __init__)
GLOBALS = ("causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "FusedRMSNormGated", "is_fast_path_available", "Qwen3NextRMSNormGated")
# 5.x: the module functions the layer's forward calls by name, and the norm class its __init__ builds
CALLED_GLOBALS = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                  "torch_recurrent_gated_delta_rule", "Qwen3NextRMSNormGated")
# the names in Qwen3NextGatedDeltaNet.forward that mark 5.x's hooks
CALLED_IN_FORWARD = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
CLASSES = ("Qwen3NextGatedDeltaNet",)
# 4.x: the attributes each Qwen3NextGatedDeltaNet copies in __init__ (enable(model) replaces them on live layers)
LAYER_ATTRS = ("causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule", "recurrent_gated_delta_rule",
               "norm")
# 4.x: transformers' torch fallbacks, which disable(model) gives back where FLA / causal-conv1d are missing
FALLBACKS = ("torch_causal_conv1d_update", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
CONV_ACTIVATIONS = (None, "silu", "swish")

_saved: dict = {}           # the module's original globals while enabled
_norm_classes: dict = {}    # original Qwen3NextRMSNormGated -> its linattn subclass


# ---------------------------------------------------------------------------------------------- forward-only ops

def _forward_only(op, fn, *args, **kwargs):
    """fn(*args, **kwargs) -> (out, ...rest): transformers calls the decode-step ops with grad mode on whenever a user
    steps a model without torch.no_grad(); the conv update refuses inputs that require grad. Run them without autograd
    and mark the first output so that only a backward through it fails (the decode op does this itself too)."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return fn(*args, **kwargs)
    with torch.no_grad():
        res = fn(*args, **kwargs)
    out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, None)
    out = ForwardOnly.apply(op, (out,), *[t for t in tensors if t.requires_grad])[0]
    return out if rest is None else (out, *rest)


def recurrent_gated_delta_rule(*args, **kwargs):
    """`linattn.fused_recurrent_gated_delta_rule` (FLA's signature, which transformers calls) that, called with grad
    mode on, runs without autograd and fails only if a backward reaches its output (FLA's op has no backward
    either)."""
    return _forward_only("fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule, *args, **kwargs)


# ---------------------------------------------------------------------------------------- causal-conv1d's API

def _fail(op, msg, exc=ValueError):
    raise exc(f"{op}: {msg}")


def _check_activation(op, activation):
    if activation not in CONV_ACTIVATIONS:
        _fail(op, f"activation must be None, 'silu' or 'swish' (causal-conv1d's), got {activation!r}",
              NotImplementedError)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     seq_idx: Optional[torch.Tensor] = None, initial_states: Optional[torch.Tensor] = None,
                     return_final_states: bool = False, final_states_out: Optional[torch.Tensor] = None,
                     activation: Optional[str] = None):
    """causal-conv1d's `causal_conv1d_fn` on `linattn.causal_conv1d` (differentiable in x, weight, bias and
    initial_states).

    x: [B, D, T] (any strides); weight [D, W]; bias [D] or None; activation None, "silu" or "swish".
    initial_states: [B, D, W - 1] or None, causal-conv1d's state (the last W - 1 inputs, oldest first).
    return_final_states: also return the final [B, D, W - 1] state, written into final_states_out when given.
    seq_idx (packed sequences by per-token index): not supported, NotImplementedError (linattn packs sequences by
    cu_seqlens offsets; converting would need a host read).
    Returns y [B, D, T] in x's dtype (a view of a [B, T, D] tensor), or (y, final_states).
    """
    op = "causal_conv1d_fn"
    if seq_idx is not None:
        _fail(op, "seq_idx (packed sequences) is not supported; call linattn.causal_conv1d with cu_seqlens",
              NotImplementedError)
    _check_activation(op, activation)
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if x.dim() != 3:
        _fail(op, f"x must be [B, D, T] (causal-conv1d's layout), got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        _fail(op, f"weight must be [D, W], got shape {tuple(weight.shape)}")
    B, D, _ = x.shape
    W = weight.shape[1]
    h0 = None
    if initial_states is not None:
        if not isinstance(initial_states, torch.Tensor) or tuple(initial_states.shape) != (B, D, W - 1):
            _fail(op, f"initial_states must be a [B, D, W - 1] = [{B}, {D}, {W - 1}] tensor, got "
                      f"{getattr(initial_states, 'shape', type(initial_states).__name__)}")
        # linattn's state holds the last W inputs; a W-wide kernel never reads its oldest column
        h0 = F.pad(initial_states, (1, 0))
    if final_states_out is not None and return_final_states:
        if not isinstance(final_states_out, torch.Tensor) or tuple(final_states_out.shape) != (B, D, W - 1):
            _fail(op, f"final_states_out must be a [B, D, W - 1] = [{B}, {D}, {W - 1}] tensor, got "
                      f"{getattr(final_states_out, 'shape', type(final_states_out).__name__)}")
    y, final = _la_conv(x.transpose(1, 2), weight, bias, initial_state=h0, output_final_state=return_final_states,
                        activation=activation)
    y = y.transpose(1, 2)
    if not return_final_states:
        return y
    final = final[..., 1:]
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return y, final


def _conv_update(x, conv_state, weight, bias, activation, conv_state_indices):
    T_last = x.dim() == 3
    pool = conv_state if conv_state.is_contiguous() else conv_state.contiguous()
    y = _la_conv_update(x.transpose(1, 2) if T_last else x, pool, weight, bias, activation, conv_state_indices)
    if pool is not conv_state:
        conv_state.copy_(pool)
    return y.transpose(1, 2) if T_last else y


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                         cache_seqlens: Optional[torch.Tensor] = None,
                         conv_state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """causal-conv1d's `causal_conv1d_update` on `linattn.causal_conv1d_update`.

    x: [B, D] (one token per row) or [B, D, T]; conv_state [B, D, W] (or a pool [slots, D, W] with
    conv_state_indices [B] int32/int64, a negative index marking a padded row), the last W inputs oldest first,
    updated IN PLACE (a non-contiguous state, such as the channel-last one transformers' prefill stores, goes
    through a contiguous copy that is written back). weight [D, W]; bias [D] or None; activation None, "silu" or
    "swish".
    Not supported (NotImplementedError): cache_seqlens (a circular-buffer state) and states of other than W
    columns (causal-conv1d allows any state_len >= W - 1).
    Returns y with x's shape and dtype. Forward only: called with grad mode on it runs without autograd and a
    backward through y raises.
    """
    op = "causal_conv1d_update"
    if cache_seqlens is not None:
        _fail(op, "cache_seqlens (a circular-buffer conv_state) is not supported: keep the state as the last W "
                  "inputs, oldest first", NotImplementedError)
    _check_activation(op, activation)
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if x.dim() not in (2, 3):
        _fail(op, f"x must be [B, D] or [B, D, T] (causal-conv1d's layout), got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        _fail(op, f"weight must be [D, W], got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[-1] != W:
        _fail(op, f"conv_state must be [B, D, W] with W = {W} columns (the last W inputs); got "
                  f"{tuple(conv_state.shape)} (other state lengths are not supported)", NotImplementedError)
    return _forward_only(op, _conv_update, x, conv_state, weight, bias, activation, conv_state_indices)


# ---------------------------------------------------------------------------- transformers 5.x's call sites

def _params(fn) -> frozenset:
    return frozenset(n for n, p in inspect.signature(fn).parameters.items()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def drop_unknown_kwargs(fn, signature_of=None):
    """fn, called the way transformers 5.x calls a kernel function: the keyword arguments fn (or signature_of) does
    not take (transformers' per-call ones: position_ids, output_attentions, ...) are dropped, as transformers' own
    wrapper (`use_kernel_func_from_hub_with_fallback`) drops them for FLA's and causal-conv1d's functions."""
    params = _params(signature_of or fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})
    return call


# transformers 5.x's `torch_chunk_gated_delta_rule`: q/k with H heads and v with HV (a multiple of H, as 5.25 passes
# them) or already repeated to HV (as 5.17 does)
hf_chunk_gated_delta_rule = drop_unknown_kwargs(chunk_gated_delta_rule)
# transformers 5.x's `torch_recurrent_gated_delta_rule` (a forward-only decode step, see recurrent_gated_delta_rule)
hf_recurrent_gated_delta_rule = drop_unknown_kwargs(recurrent_gated_delta_rule, fused_recurrent_gated_delta_rule)
# transformers 5.x's `causal_conv1d_fn`, called without states (its cache prepends the conv state's columns to x);
# `seq_idx` (packed sequences) goes through, and is refused
hf_causal_conv1d_fn = drop_unknown_kwargs(causal_conv1d_fn)


# ---------------------------------------------------------------------------------------------- the gated norm

def _norm_class(base):
    """The subclass of transformers' Qwen3NextRMSNormGated (`base`) whose forward is linattn.rms_norm_gated: its
    constructor, parameter ("weight") and eps ("variance_epsilon") are base's; `backend` (a class attribute,
    "auto") is rms_norm_gated's."""
    cls = _norm_classes.get(base)
    if cls is None:
        def forward(self, hidden_states, gate=None):
            if gate is None:
                raise ValueError("RMSNormGated: gate is required (Qwen3-Next's gated norm multiplies by silu(gate))")
            return rms_norm_gated(hidden_states, gate, self.weight, eps=self.variance_epsilon, activation="silu",
                                  backend=self.backend)

        cls = type("RMSNormGated", (base,), {
            "forward": forward, "backend": "auto", "__module__": __name__,
            "__doc__": "Qwen3-Next's gated RMSNorm on linattn.rms_norm_gated: (rmsnorm(x) * weight) * silu(gate)."})
        _norm_classes[base] = cls
    return cls


# ------------------------------------------------------------------------------------------- enable / disable

def _tested() -> str:
    return "transformers " + " / ".join(TESTED_VERSIONS)


def hooks(mod) -> str:
    """How this transformers' Qwen3NextGatedDeltaNet reaches its kernels: "module" when its forward calls the
    module's kernel functions by name (CALLED_IN_FORWARD, transformers 5.x), else "layer" (the copies each layer
    makes in __init__, 4.x)."""
    forward = getattr(getattr(mod, "Qwen3NextGatedDeltaNet", None), "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return "module" if code is not None and set(CALLED_IN_FORWARD) <= set(code.co_names) else "layer"


def _globals(mod) -> tuple:
    return CALLED_GLOBALS if hooks(mod) == "module" else GLOBALS


def _module():
    """transformers' modeling_qwen3_next, with every name enable() needs; ImportError naming what is missing."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"linattn.integrations.transformers needs transformers (tested: {_tested()}): "
                          f"pip install transformers=={TESTED_VERSIONS[-1]}") from e
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as e:
        raise ImportError(f"transformers {transformers.__version__} has no {MODULE} (Qwen3-Next); linattn is tested "
                          f"with {_tested()}") from e
    missing = [n for n in _globals(mod) + CLASSES if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"transformers {transformers.__version__}'s {MODULE} lacks {', '.join(missing)}: its "
                          f"kernel hooks changed; linattn is tested with {_tested()}")
    return mod


def is_enabled() -> bool:
    return bool(_saved)


def _layers(mod, model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Qwen3-Next model or layer), got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, mod.Qwen3NextGatedDeltaNet)]
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) holds no Qwen3NextGatedDeltaNet layer")
    attrs = LAYER_ATTRS if hooks(mod) == "layer" else ("norm",)
    for layer in layers:
        missing = [a for a in attrs if not hasattr(layer, a)]
        if missing:
            raise ImportError(f"Qwen3NextGatedDeltaNet lacks {', '.join(missing)}: its kernel hooks changed; "
                              f"linattn is tested with {_tested()}")
    return layers


def _originals(mod) -> dict:
    """transformers' own values of the hooked globals (saved by enable(), or the module's while not enabled)."""
    return dict(_saved) if _saved else {n: getattr(mod, n) for n in _globals(mod)}


def _patch_norm(layer, base):
    norm_cls = _norm_class(base)
    if isinstance(layer.norm, base):
        layer.norm.__class__ = norm_cls        # the same module (parameter, eps, hooks), linattn's forward
    else:                                      # FLA's FusedRMSNormGated (4.x): a new module on its weight and eps
        weight = layer.norm.weight
        layer.norm = norm_cls(weight.shape[0], eps=layer.norm.eps)
        layer.norm.weight = weight


def _patch_layer(layer, base):
    """4.x: linattn's functions in place of the copies the layer made in __init__, and linattn's gated norm."""
    layer.causal_conv1d_fn = causal_conv1d_fn
    layer.causal_conv1d_update = causal_conv1d_update
    layer.chunk_gated_delta_rule = chunk_gated_delta_rule
    layer.recurrent_gated_delta_rule = recurrent_gated_delta_rule
    _patch_norm(layer, base)


def _restore_norm(layer, orig):
    base = orig["Qwen3NextRMSNormGated"]
    norm = layer.norm
    if not isinstance(norm, base) or type(norm) is base:
        return
    if orig.get("FusedRMSNormGated") is None:
        norm.__class__ = base
    else:                                      # 4.x with FLA: transformers builds FLA's module
        weight = norm.weight
        layer.norm = orig["FusedRMSNormGated"](weight.shape[0], eps=norm.variance_epsilon,
                                               activation=layer.activation, device=weight.device,
                                               dtype=weight.dtype)
        layer.norm.weight = weight


def _restore_layer(mod, layer, orig):
    """4.x: what Qwen3NextGatedDeltaNet.__init__ picks from transformers' own globals."""
    fallbacks = [n for n in FALLBACKS if not hasattr(mod, n)]
    if fallbacks:
        raise ImportError(f"{MODULE} lacks {', '.join(fallbacks)}; linattn is tested with {_tested()}")
    layer.causal_conv1d_fn = orig["causal_conv1d_fn"]
    layer.causal_conv1d_update = orig["causal_conv1d_update"] or mod.torch_causal_conv1d_update
    layer.chunk_gated_delta_rule = orig["chunk_gated_delta_rule"] or mod.torch_chunk_gated_delta_rule
    layer.recurrent_gated_delta_rule = (orig["fused_recurrent_gated_delta_rule"]
                                        or mod.torch_recurrent_gated_delta_rule)
    _restore_norm(layer, orig)


def _linattn_globals(mod, originals) -> dict:
    """The values enable() gives the hooked globals."""
    norm_cls = _norm_class(originals["Qwen3NextRMSNormGated"])
    if hooks(mod) == "module":
        return dict(causal_conv1d_fn=hf_causal_conv1d_fn, causal_conv1d_update=causal_conv1d_update,
                    torch_chunk_gated_delta_rule=hf_chunk_gated_delta_rule,
                    torch_recurrent_gated_delta_rule=hf_recurrent_gated_delta_rule, Qwen3NextRMSNormGated=norm_cls)
    return dict(causal_conv1d_fn=causal_conv1d_fn, causal_conv1d_update=causal_conv1d_update,
                chunk_gated_delta_rule=chunk_gated_delta_rule,
                fused_recurrent_gated_delta_rule=recurrent_gated_delta_rule, FusedRMSNormGated=None,
                Qwen3NextRMSNormGated=norm_cls, is_fast_path_available=True)


def enable(model: Optional[torch.nn.Module] = None):
    """Make transformers' Qwen3-Next run its linear-attention layers on linattn (see the module docstring).

    Replaces the kernel globals of transformers.models.qwen3_next.modeling_qwen3_next. On 4.x models built after
    the call use linattn, and a model built before keeps the functions it copied in __init__ unless passed here,
    which switches each of its Qwen3NextGatedDeltaNet layers too. On 5.x every model's ops switch (the layers call
    the module's functions), and passing a model built before switches its gated norm too. A norm switched here
    becomes linattn's, sharing the weight. Calling it again is harmless. Returns `model`.
    Raises ImportError when transformers or one of the names it hooks (GLOBALS on 4.x, CALLED_GLOBALS on 5.x,
    CLASSES) is missing.
    """
    mod = _module()
    layers = None if model is None else _layers(mod, model)      # a bad model is refused before any change
    if not _saved:
        originals = {n: getattr(mod, n) for n in _globals(mod)}
        for n, v in _linattn_globals(mod, originals).items():
            setattr(mod, n, v)
        _saved.update(originals)
    for layer in layers or ():
        if hooks(mod) == "layer":
            _patch_layer(layer, _saved["Qwen3NextRMSNormGated"])
        else:
            _patch_norm(layer, _saved["Qwen3NextRMSNormGated"])
    return model


def disable(model: Optional[torch.nn.Module] = None):
    """Undo enable(): the module globals get transformers' own values back, and `model`'s layers, when given, what
    transformers itself picks: on 4.x its functions (its fast kernels where installed, else its torch fallbacks;
    models built while enabled and not passed here keep linattn), on both the norm back to Qwen3NextRMSNormGated
    (or FLA's FusedRMSNormGated where 4.x builds that). On 5.x the ops follow the module, so disable() alone
    switches every model's ops back, and disable(model) alone only that model's norm. Harmless when not enabled.
    Returns `model`."""
    if model is not None:
        mod = _module()
        orig = _originals(mod)
        for layer in _layers(mod, model):
            if hooks(mod) == "layer":
                _restore_layer(mod, layer, orig)
            else:
                _restore_norm(layer, orig)
    if _saved:
        mod = importlib.import_module(MODULE)
        for n, v in _saved.items():
            setattr(mod, n, v)
        _saved.clear()
    return model
