"""Run transformers' Qwen3-Next linear-attention layers (Qwen3NextGatedDeltaNet) on linattn's ops.

    import linattn.integrations.transformers as lt

    lt.enable()            # every Qwen3-Next model built from now on runs its GatedDeltaNet layers on linattn
    lt.enable(model)       # the same, and switch `model` (built before) too
    lt.disable()           # transformers' own choice again for models built afterwards
    lt.disable(model)      # ... and give `model` its own functions back

transformers (tested: 4.57.3) resolves its fast kernels once, when `modeling_qwen3_next` is imported (FLA's
`chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule`, `FusedRMSNormGated`; causal-conv1d's
`causal_conv1d_fn`, `causal_conv1d_update`; torch fallbacks where those libraries are missing), and each
Qwen3NextGatedDeltaNet copies them onto itself in __init__. enable() replaces those module globals, so a model built
afterwards runs:

- the prefill / training path on `linattn.chunk_gated_delta_rule` (differentiable) and `causal_conv1d_fn` below
  (causal-conv1d's API on `linattn.causal_conv1d`, differentiable);
- one-token decode steps on `recurrent_gated_delta_rule` below (`linattn.fused_recurrent_gated_delta_rule`) and
  `causal_conv1d_update` below (`linattn.causal_conv1d_update`, the cache's conv state updated in place);
- the gated RMSNorm on `linattn.rms_norm_gated`: enable() sets `FusedRMSNormGated` to None and replaces
  `Qwen3NextRMSNormGated` by `RMSNormGated` (a subclass with its constructor and its "weight", so checkpoints load
  unchanged). transformers builds FLA's FusedRMSNormGated with device=torch.cuda.current_device(), which fails on a
  machine without a GPU; its own module builds anywhere.

A model built before enable() keeps the functions it copied: pass it to enable(model). The cache layout is
transformers' own: conv states [B, D, W] (the last W inputs, oldest first, linattn's layout) and fp32 recurrent
states [B, HV, K, V] (linattn's and FLA's). Works on CUDA and on the CPU (the Triton kernels under
TRITON_INTERPRET=1, else linattn's PyTorch reference).
"""
import importlib
from typing import Optional

import torch
import torch.nn.functional as F

from linattn.ops.conv1d import causal_conv1d as _la_conv
from linattn.ops.conv1d import causal_conv1d_update as _la_conv_update
from linattn.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from linattn.ops.norm import rms_norm_gated

MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"
TESTED_VERSION = "4.57.3"
# the module globals enable() replaces, and the classes it needs
GLOBALS = ("causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "FusedRMSNormGated", "is_fast_path_available", "Qwen3NextRMSNormGated")
CLASSES = ("Qwen3NextGatedDeltaNet",)
# the attributes each Qwen3NextGatedDeltaNet copies in __init__ (enable(model) replaces them on live layers)
LAYER_ATTRS = ("causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule", "recurrent_gated_delta_rule",
               "norm")
# transformers' torch fallbacks, which disable(model) gives back where FLA / causal-conv1d are missing
FALLBACKS = ("torch_causal_conv1d_update", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
CONV_ACTIVATIONS = (None, "silu", "swish")

_saved: dict = {}           # the module's original globals while enabled
_norm_classes: dict = {}    # original Qwen3NextRMSNormGated -> its linattn subclass


# ---------------------------------------------------------------------------------------------- forward-only ops

class _NoBackward(torch.autograd.Function):
    """Marks the output of a forward-only op called with grad mode on: the forward passes through, a backward
    raises (as FLA's fused recurrent op does) instead of silently dropping gradients."""

    @staticmethod
    def forward(ctx, op, out, *inputs):
        ctx.op = op
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(f"{ctx.op} has no backward (it is the decode step); train through the chunked "
                                  "path (a forward without a cache, or with more than one token)")


def _forward_only(op, fn, *args, **kwargs):
    """fn(*args, **kwargs) -> (out, ...rest): linattn's decode ops refuse inputs that require grad; transformers calls
    them with grad mode on whenever a user steps a model without torch.no_grad(). Run them without autograd and mark
    the first output so that only a backward through it fails."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return fn(*args, **kwargs)
    with torch.no_grad():
        res = fn(*args, **kwargs)
    out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, None)
    out = _NoBackward.apply(op, out, *[t for t in tensors if t.requires_grad])
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

def _module():
    """transformers' modeling_qwen3_next, with every name enable() needs; ImportError naming what is missing."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("linattn.integrations.transformers needs transformers (tested with "
                          f"transformers=={TESTED_VERSION}): pip install transformers=={TESTED_VERSION}") from e
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as e:
        raise ImportError(f"transformers {transformers.__version__} has no {MODULE} (Qwen3-Next); linattn is tested "
                          f"with transformers=={TESTED_VERSION}") from e
    missing = [n for n in GLOBALS + CLASSES if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"transformers {transformers.__version__}'s {MODULE} lacks {', '.join(missing)}: its "
                          f"kernel hooks changed; linattn is tested with transformers=={TESTED_VERSION}")
    return mod


def is_enabled() -> bool:
    return bool(_saved)


def _layers(mod, model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Qwen3-Next model or layer), got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, mod.Qwen3NextGatedDeltaNet)]
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) holds no Qwen3NextGatedDeltaNet layer")
    for layer in layers:
        missing = [a for a in LAYER_ATTRS if not hasattr(layer, a)]
        if missing:
            raise ImportError(f"Qwen3NextGatedDeltaNet lacks {', '.join(missing)}: its kernel hooks changed; "
                              f"linattn is tested with transformers=={TESTED_VERSION}")
    return layers


def _originals(mod) -> dict:
    """transformers' own values of GLOBALS (saved by enable(), or the module's while not enabled)."""
    return dict(_saved) if _saved else {n: getattr(mod, n) for n in GLOBALS}


def _patch_layer(layer, base):
    layer.causal_conv1d_fn = causal_conv1d_fn
    layer.causal_conv1d_update = causal_conv1d_update
    layer.chunk_gated_delta_rule = chunk_gated_delta_rule
    layer.recurrent_gated_delta_rule = recurrent_gated_delta_rule
    norm_cls = _norm_class(base)
    if isinstance(layer.norm, base):
        layer.norm.__class__ = norm_cls        # the same module (parameter, eps, hooks), linattn's forward
    else:                                      # FLA's FusedRMSNormGated: a new module on its weight and eps
        weight = layer.norm.weight
        layer.norm = norm_cls(weight.shape[0], eps=layer.norm.eps)
        layer.norm.weight = weight


def _restore_layer(mod, layer, orig):
    """What Qwen3NextGatedDeltaNet.__init__ picks from transformers' own globals."""
    fallbacks = [n for n in FALLBACKS if not hasattr(mod, n)]
    if fallbacks:
        raise ImportError(f"{MODULE} lacks {', '.join(fallbacks)}; linattn is tested with "
                          f"transformers=={TESTED_VERSION}")
    layer.causal_conv1d_fn = orig["causal_conv1d_fn"]
    layer.causal_conv1d_update = orig["causal_conv1d_update"] or mod.torch_causal_conv1d_update
    layer.chunk_gated_delta_rule = orig["chunk_gated_delta_rule"] or mod.torch_chunk_gated_delta_rule
    layer.recurrent_gated_delta_rule = (orig["fused_recurrent_gated_delta_rule"]
                                        or mod.torch_recurrent_gated_delta_rule)
    base = orig["Qwen3NextRMSNormGated"]
    norm = layer.norm
    if isinstance(norm, base) and type(norm) is not base and orig["FusedRMSNormGated"] is None:
        norm.__class__ = base
    elif isinstance(norm, base) and type(norm) is not base:
        weight = norm.weight
        layer.norm = orig["FusedRMSNormGated"](weight.shape[0], eps=norm.variance_epsilon,
                                               activation=layer.activation, device=weight.device,
                                               dtype=weight.dtype)
        layer.norm.weight = weight


def enable(model: Optional[torch.nn.Module] = None):
    """Make transformers' Qwen3-Next run its linear-attention layers on linattn (see the module docstring).

    Replaces the kernel globals of transformers.models.qwen3_next.modeling_qwen3_next, so models built after the
    call use linattn; a model built before keeps the functions it copied in __init__ unless passed here, which
    switches each of its Qwen3NextGatedDeltaNet layers too (its gated norm becomes linattn's, sharing the weight).
    Calling it again is harmless. Returns `model`.
    Raises ImportError when transformers or one of the names it hooks (GLOBALS, CLASSES) is missing.
    """
    mod = _module()
    layers = None if model is None else _layers(mod, model)      # a bad model is refused before any change
    if not _saved:
        originals = {n: getattr(mod, n) for n in GLOBALS}
        norm_cls = _norm_class(originals["Qwen3NextRMSNormGated"])
        mod.causal_conv1d_fn = causal_conv1d_fn
        mod.causal_conv1d_update = causal_conv1d_update
        mod.chunk_gated_delta_rule = chunk_gated_delta_rule
        mod.fused_recurrent_gated_delta_rule = recurrent_gated_delta_rule
        mod.FusedRMSNormGated = None
        mod.Qwen3NextRMSNormGated = norm_cls
        mod.is_fast_path_available = True
        _saved.update(originals)
    for layer in layers or ():
        _patch_layer(layer, _saved["Qwen3NextRMSNormGated"])
    return model


def disable(model: Optional[torch.nn.Module] = None):
    """Undo enable(): the module globals get transformers' own values back (models built afterwards use them), and
    `model`'s layers, when given, what transformers itself picks (its fast kernels where installed, else its torch
    fallbacks; the norm back to Qwen3NextRMSNormGated, or FLA's FusedRMSNormGated where transformers builds that).
    Models built while enabled and not passed here keep linattn. Harmless when not enabled. Returns `model`."""
    if model is not None:
        mod = _module()
        orig = _originals(mod)
        for layer in _layers(mod, model):
            _restore_layer(mod, layer, orig)
    if _saved:
        mod = importlib.import_module(MODULE)
        for n, v in _saved.items():
            setattr(mod, n, v)
        _saved.clear()
    return model
