"""`rms_norm_gated`: FLA's fused gated RMS norm (fla.modules.fused_norm_gate.rms_norm_gated, the norm of
FusedRMSNormGated), with the group-wise norm and the gate-first order of FLA's layernorm_gated.RMSNormGated.

Backends: "triton" (the torch custom op "linattn::rms_norm_gated_fwd" with a fake implementation and registered
autograd, whose backward is "linattn::rms_norm_gated_bwd"; no host synchronisation) and "reference" (plain
PyTorch, by name only, except on the CPU without the Triton interpreter).

A decode step calls it once per layer with the same shapes: a call whose signature passed the checks before skips
them and the backend choice (_CHECKED), and a call that records no autograd graph runs the launcher without the
custom op's dispatch (which costs more host time than the kernel), a repeat one through its signature's launch list
(runtime/op_lists.py)."""
from typing import Optional, Tuple

import torch

from linattn.backends import CheckedCalls, op_backends
from linattn.ops.norm.reference import rms_norm_gated_reference
from linattn.runtime import eager_ops
from linattn.runtime.settings import settings

OP = "rms_norm_gated"
ACTIVATIONS = ("swish", "silu", "sigmoid")
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MAX_GROUP = 65536            # one group is one register tile of the kernels
_backends = op_backends(OP)


def _fail(msg: str, exc=ValueError):
    raise exc(f"{OP}: {msg}")


def _check(x, g, weight, bias, activation, eps, group_size):
    for name, t in (("x", x), ("g", g)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if x.dim() < 1 or x.shape[-1] < 1:
        _fail(f"x must be [..., D] with D >= 1, got shape {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        _fail(f"x must be bf16, fp16, fp32 or fp64, got {x.dtype}", TypeError)
    if g.shape != x.shape:
        _fail(f"g (the gate) must have x's shape {tuple(x.shape)}, got {tuple(g.shape)}")
    if not g.is_floating_point():
        _fail(f"g must be a float tensor, got {g.dtype}", TypeError)
    if g.device != x.device:
        _fail(f"g is on {g.device} but x is on {x.device}")
    D = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor or None, got {type(t).__name__}", TypeError)
        if tuple(t.shape) != (D,):
            _fail(f"{name} must be [D] = [{D}], got {tuple(t.shape)}")
        if not t.is_floating_point():
            _fail(f"{name} must be a float tensor, got {t.dtype}", TypeError)
        if t.device != x.device:
            _fail(f"{name} is on {t.device} but x is on {x.device}")
    if activation not in ACTIVATIONS:
        _fail(f"activation must be one of {ACTIVATIONS} ('swish' and 'silu' are the same), got {activation!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        _fail(f"eps must be a number >= 0, got {eps!r}")
    G = D if group_size is None else group_size
    if not isinstance(G, int) or G < 1 or D % G:
        _fail(f"group_size must be a positive divisor of D={D} (or None: the whole row), got {group_size!r}")
    if G > MAX_GROUP:
        _fail(f"group_size {G} (D when group_size is None) is over {MAX_GROUP}, the largest group one program "
              "normalises")
    return G


# ---- the Triton path as torch custom ops (a bias or weight gradient that does not exist is an empty [0] tensor)

@eager_ops.custom_op("linattn::rms_norm_gated_fwd")
def _norm_fwd(x: torch.Tensor, g: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
              eps: float, group_size: int, activation: str, norm_before_gate: bool) -> torch.Tensor:
    from linattn.ops.norm.triton.rms_norm_gated import rms_norm_gated_fwd
    return rms_norm_gated_fwd(x, g, weight, bias, eps, group_size, activation, norm_before_gate)


@_norm_fwd.register_fake
def _(x, g, weight, bias, eps, group_size, activation, norm_before_gate):
    return x.new_empty(x.shape)


@eager_ops.custom_op("linattn::rms_norm_gated_bwd")
def _norm_bwd(x: torch.Tensor, g: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
              eps: float, group_size: int, activation: str, norm_before_gate: bool, dy: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from linattn.ops.norm.triton.rms_norm_gated import rms_norm_gated_bwd
    dx, dg, dw, db = rms_norm_gated_bwd(x, g, weight, bias, eps, group_size, activation, norm_before_gate, dy)
    return dx, dg, (dw if dw is not None else x.new_empty(0)), (db if db is not None else x.new_empty(0))


@_norm_bwd.register_fake
def _(x, g, weight, bias, eps, group_size, activation, norm_before_gate, dy):
    return (x.new_empty(x.shape), g.new_empty(g.shape),
            torch.empty_like(weight) if weight is not None else x.new_empty(0),
            torch.empty_like(bias) if bias is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, g, weight, bias, eps, group_size, activation, norm_before_gate = inputs
    ctx.save_for_backward(x, g, weight, bias)
    ctx.args = (eps, group_size, activation, norm_before_gate)


def _backward(ctx, dy):
    x, g, weight, bias = ctx.saved_tensors
    dx, dg, dw, db = _norm_bwd(x, g, weight, bias, *ctx.args, dy)
    return dx, dg, (dw if weight is not None else None), (db if bias is not None else None), None, None, None, None


_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def _triton_supports(x=None, g=None, weight=None, bias=None, **_) -> Tuple[bool, str]:
    if x.device.type == "cpu" and not settings.interpret:
        return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton path"
    if x.device.type not in ("cpu", "cuda"):
        return False, f"device {x.device.type} is not supported by the Triton path"
    for name, t in (("x", x), ("g", g), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype == torch.float64:
            return False, f"fp64 {name}: use the reference backend"
    return True, ""


def _direct(x, g, weight, bias) -> bool:
    """A plain eager call that records no autograd graph (grad mode off, or no input requires grad): the launcher
    runs without the custom op. Traced calls and tensor subclasses keep the custom op (its fake implementation)."""
    if type(x) is not torch.Tensor or type(g) is not torch.Tensor or torch.compiler.is_compiling():
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(t is not None and t.requires_grad for t in (x, g, weight, bias))


def _triton_impl(x, g, weight, bias, activation, eps, group_size, norm_before_gate, key=None):
    """key: the call's _CHECKED key (None: not remembered), under which a plain eager call without autograd keeps a
    launch list (runtime/op_lists.py)."""
    if _direct(x, g, weight, bias):
        from linattn.ops.norm.triton.rms_norm_gated import LISTS, rms_norm_gated_fwd
        return LISTS(key, (x, g, weight, bias), lambda: rms_norm_gated_fwd(x, g, weight, bias, float(eps), group_size,
                                                                          activation, norm_before_gate))[0]
    return _norm_fwd(x, g, weight, bias, float(eps), group_size, activation, norm_before_gate)


_backends.register("triton", _triton_impl, _triton_supports, priority=10)
_backends.register("reference", rms_norm_gated_reference, lambda **_: (True, ""), priority=100, auto=False)


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, activation: str = "swish",
                   residual: Optional[torch.Tensor] = None, prenorm: bool = False, residual_in_fp32: bool = False,
                   eps: float = 1e-6, *, group_size: Optional[int] = None, norm_before_gate: bool = True,
                   backend: str = "auto") -> torch.Tensor:
    """Gated RMS norm with FLA 0.6's signature (fla.modules.fused_norm_gate.rms_norm_gated: its parameters in its
    order with its defaults), then linattn's extras keyword-only. Per row of x and per group of group_size
    columns (the whole last dimension by default; FLA's GatedDeltaNet passes o as [..., HV, V], one group per head):

        norm_before_gate=True (FusedRMSNormGated):  y = (x * rstd(x) * weight + bias) * act(g)
        norm_before_gate=False (RMSNormGated's default):  z = x * act(g);  y = z * rstd(z) * weight + bias

    with rstd(z) = 1 / sqrt(mean(z^2 over the group) + eps) and act = silu ("swish", "silu") or sigmoid.

    Args:
        x: [..., D] bf16 / fp16 / fp32 (fp64 on the reference backend); g: x's shape, any float dtype.
        weight, bias: [D] or None (None: no scale / no shift); any float dtype.
        residual, prenorm (FLA: add a residual first and also return the sum): not supported; a residual or
            prenorm=True raises NotImplementedError. residual_in_fp32 only matters with them and is ignored.
        eps: FLA's functional default 1e-6 (its modules default to 1e-5).
        group_size: D (None) or a divisor of D, at most 65536.
        backend: "auto", "triton" or "reference".
    Returns:
        y in x's dtype, x's shape; the math in fp32. Differentiable in x, g, weight and bias.
    """
    if residual is not None:
        _fail("residual is not supported (add it to x before the call)", NotImplementedError)
    if prenorm:
        _fail("prenorm=True (returning the residual sum) is not supported", NotImplementedError)
    key = None
    if isinstance(activation, str) and isinstance(eps, (int, float)) and (group_size is None or
                                                                         isinstance(group_size, int)):
        key = _CHECKED.key(backend, (x, g, weight, bias), (activation, eps, group_size, bool(norm_before_gate)))
    hit = _CHECKED.get(key)
    if hit is not None:
        impl, G, lists = hit
        out = lists.replay(key, (x, g, weight, bias))
        if out is not None:
            return out[0]
        return impl(x, g, weight, bias, activation, eps, G, norm_before_gate, key)
    G = _check(x, g, weight, bias, activation, eps, group_size)
    b = _backends.select(backend, x=x, g=g, weight=weight, bias=bias)
    if b.name == "triton":
        from linattn.ops.norm.triton.rms_norm_gated import LISTS
        _CHECKED.put(key, (b.impl, G, LISTS))
        return b.impl(x, g, weight, bias, activation, eps, G, norm_before_gate, key)
    return b.impl(x, g, weight, bias, activation, eps, G, norm_before_gate)


# Calls whose checks passed and that chose Triton, with their group size and the Triton launcher's launch lists
# (triton/rms_norm_gated.py LISTS: a repeat call whose signature kept one replays it without entering the impl)
# (backends.CheckedCalls; the checks read no tensor values here, so CPU calls are remembered too).
_CHECKED = CheckedCalls()
