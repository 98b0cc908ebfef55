"""`causal_conv1d`: the depthwise causal 1-D convolution of FLA 0.6's short convolution (ShortConvolution), forward
and backward, with packed sequences and per-sequence states.

Layouts (FLA's): x [B, T, D], weight [D, W] (nn.Conv1d's [D, 1, W] weight squeezed), bias [D], states [N, D, W]
holding a sequence's last W inputs, oldest first (state[..., W - 1] is the newest token). causal-conv1d and
transformers' Qwen3-Next keep x as [B, D, T] and the same [B, D, W] state: pass x.transpose(1, 2) (and transpose y
back); their states are ours unchanged.

Backends: "triton" (the torch custom op "linattn::causal_conv1d_fwd" with a fake implementation and registered
autograd, whose backward is the custom op "linattn::causal_conv1d_bwd"; no host synchronisation, so it works under
torch.compile(fullgraph=True) and in CUDA graphs) and "reference" (plain PyTorch, by name only, except on the CPU
without the Triton interpreter)."""
from typing import Optional, Tuple

import torch

from linattn.backends import CheckedCalls, op_backends
from linattn.ops.conv1d.reference import causal_conv1d_reference
from linattn.ops.conv1d.validation import check_conv_inputs, fail
from linattn.runtime import eager_ops
from linattn.runtime.device import eager_without_autograd
from linattn.runtime.op_lists import as_tuple
from linattn.runtime.settings import settings

OP = "causal_conv1d"
_backends = op_backends(OP)


def _act(activation: Optional[str]) -> str:
    """The custom ops take the activation as a string: "" for none."""
    return "" if activation is None else "silu"


# ---- the Triton path as torch custom ops. Optional outputs are not allowed in custom-op schemas: a state or a
# gradient that does not exist is returned as an empty [0] tensor and mapped back to None by the caller.

@eager_ops.custom_op("linattn::causal_conv1d_fwd")
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
              initial_state: Optional[torch.Tensor], output_final_state: bool, activation: str,
              cu_seqlens: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    from linattn.ops.conv1d.triton.conv1d import conv1d_fwd
    y, final = conv1d_fwd(x, weight, bias, residual, initial_state, output_final_state, activation == "silu",
                          cu_seqlens)
    return y, (final if final is not None else x.new_empty(0))


@_conv_fwd.register_fake
def _(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    y = x.new_empty(x.shape)
    final = x.new_empty((N, weight.shape[0], weight.shape[1]) if output_final_state else (0,))
    return y, final


@eager_ops.custom_op("linattn::causal_conv1d_bwd")
def _conv_bwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              initial_state: Optional[torch.Tensor], activation: str, cu_seqlens: Optional[torch.Tensor],
              dy: torch.Tensor, dfinal: Optional[torch.Tensor]
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from linattn.ops.conv1d.triton.conv1d import conv1d_bwd
    dx, dw, db, dh0 = conv1d_bwd(x, weight, bias, initial_state, activation == "silu", cu_seqlens, dy, dfinal)
    return dx, dw, (db if db is not None else x.new_empty(0)), (dh0 if dh0 is not None else x.new_empty(0))


@_conv_bwd.register_fake
def _(x, weight, bias, initial_state, activation, cu_seqlens, dy, dfinal):
    return (x.new_empty(x.shape), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty(0),
            torch.empty_like(initial_state) if initial_state is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
    ctx.activation = activation
    ctx.output_final_state = output_final_state
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.set_materialize_grads(False)         # None, not a zero fill, for an output no loss reaches (the final state)


def _backward(ctx, dy, dfinal):
    x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
    if dy is None:                           # only the final state reaches the loss
        dy = torch.zeros_like(x)
    dfinal = dfinal if ctx.output_final_state else None
    dx, dw, db, dh0 = _conv_bwd(x, weight, bias, initial_state, ctx.activation, cu_seqlens, dy, dfinal)
    dres = None if ctx.residual_dtype is None else dy.to(ctx.residual_dtype)
    return (dx, dw, db if bias is not None else None, dres, dh0 if initial_state is not None else None,
            None, None, None)


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def _triton_supports(x=None, weight=None, bias=None, residual=None, initial_state=None, **_) -> Tuple[bool, str]:
    if x.device.type == "cpu" and not settings.interpret:
        return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton path"
    if x.device.type not in ("cpu", "cuda"):
        return False, f"device {x.device.type} is not supported by the Triton path"
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual),
                    ("initial_state", initial_state)):
        if t is not None and t.dtype == torch.float64:
            return False, f"fp64 {name}: use the reference backend"
    return True, ""


def _triton_impl(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens, key=None):
    """key: the call's _CHECKED key (None: not remembered), under which a plain eager call without autograd keeps a
    launch list (runtime/op_lists.py)."""
    if key is not None and eager_without_autograd(x, weight, bias, residual, initial_state):
        from linattn.ops.conv1d.triton.conv1d import LISTS, conv1d_fwd
        silu = activation is not None
        return LISTS(key, (x, weight, bias, residual, initial_state, cu_seqlens),
                     lambda: conv1d_fwd(x, weight, bias, residual, initial_state, output_final_state, silu, cu_seqlens),
                     as_tuple)
    y, final = _conv_fwd(x, weight, bias, residual, initial_state, output_final_state, _act(activation), cu_seqlens)
    return y, (final if output_final_state else None)


_backends.register("triton", _triton_impl, _triton_supports, priority=10)
_backends.register("reference", causal_conv1d_reference, lambda **_: (True, ""), priority=100, auto=False)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  residual: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False, activation: Optional[str] = None, backend: str = "auto",
                  cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_cpu: Optional[torch.Tensor] = None,
                  chunk_indices: Optional[torch.Tensor] = None, cp_context=None
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Depthwise causal convolution with FLA 0.6's signature (fla.modules.causal_conv1d.causal_conv1d: its
    parameters in its order with its defaults):

        y[t, d] = act(sum_j weight[d, j] * x[t - (W - 1) + j, d] + bias[d]) + residual[t, d]

    where positions before a sequence's start read its initial state (zeros without one).

    Args:
        x: [B, T, D] bf16 / fp16 / fp32 (fp64 on the reference backend); any strides.
        weight: [D, W], any float dtype (nn.Conv1d's depthwise weight [D, 1, W] squeezed).  bias: [D] or None.
        residual: [B, T, D] or None, added after the activation (FLA's Canon option).
        initial_state: [N, D, W] or None: per sequence its last W inputs before this call, oldest first; the
            convolution reads columns 1 .. W - 1 (column 0 would only matter to a longer kernel). Any float dtype.
        output_final_state: also return the state after the last token, [N, D, W] in x's dtype (as FLA): the
            sequence's last W inputs, the initial state's newest columns where the sequence is shorter than W.
        activation: None, "silu" or "swish" (the same).
        backend: "auto", "triton" or "reference" (FLA's "cuda" and "mix" name its other implementations and are
            refused as unknown backends).
        cu_seqlens: [N + 1] int32 / int64 offsets of packed sequences (x is [1, T, D]): no sequence reads another's
            tokens, each has its own initial and final state. Zero-length sequences are allowed (their final
            state is their initial state). Checked on the host for CPU tensors only.
        cu_seqlens_cpu, chunk_indices: FLA's precomputed varlen metadata, accepted and ignored (the kernels find
            each token's sequence on the device).
        cp_context: context parallelism (linattn.distributed.build_cp_context, FLA's contiguous layout; the conv
            halo of W - 1 inputs comes from the earlier ranks, linattn/distributed/conv.py): x [1, T / W, D] this
            rank's tokens, cu_seqlens omitted (or the context's); no initial_state or output_final_state (as FLA).
    Returns:
        (y [B, T, D] in x's dtype, final state or None).
    Differentiable in x, weight, bias, residual and initial_state (the final state's gradient flows in).
    """
    if cp_context is not None:
        return _context_parallel(x, weight, bias, residual, initial_state, output_final_state, activation, backend,
                                 cu_seqlens, cp_context)
    key = None
    if (cu_seqlens is None or type(cu_seqlens) is torch.Tensor and cu_seqlens.is_cuda) and \
            (activation is None or type(activation) is str) and type(output_final_state) is bool:
        key = _CHECKED.key(backend, (x, weight, bias, residual, initial_state, cu_seqlens),
                           (activation, output_final_state))
    hit = _CHECKED.get(key)
    if hit is not None:
        impl, lists = hit
        out = lists.replay(key, (x, weight, bias, residual, initial_state, cu_seqlens))
        if out is not None:
            return out
        return impl(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens, key)
    check_conv_inputs(OP, x, weight, bias, residual, initial_state, cu_seqlens, activation)
    b = _backends.select(backend, x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                         cu_seqlens=cu_seqlens)
    if b.name == "triton":
        from linattn.ops.conv1d.triton.conv1d import LISTS
        _CHECKED.put(key, (b.impl, LISTS))
        return b.impl(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens, key)
    return b.impl(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens)


# Calls whose checks passed and that chose Triton, with the Triton launcher's launch lists (triton/conv1d.py LISTS)
# (backends.CheckedCalls): a repeat call of one signature skips the checks and the backend choice, and replays the
# signature's list where it kept one (without entering the impl). Not remembered: traced calls, and calls with
# cu_seqlens on the CPU, whose values the checks read.
_CHECKED = CheckedCalls()


def _context_parallel(x, weight, bias, residual, initial_state, output_final_state, activation, backend, cu_seqlens,
                      cp):
    """The cp_context call: checks against the context, then linattn/distributed/conv.py."""
    from linattn.distributed.context import check_cp_call
    from linattn.distributed.conv import cp_causal_conv1d
    if initial_state is not None or output_final_state:
        fail(OP, "initial_state and output_final_state are not supported with cp_context (as in FLA): the first "
                 "sequence's state comes from the earlier ranks", NotImplementedError)
    if x.dim() != 3 or x.shape[0] != 1:
        fail(OP, f"with cp_context, x must be [1, T / W, D] (this rank's tokens), got {tuple(x.shape)}")
    check_cp_call(OP, x, cu_seqlens, cp, backend, lambda q: _triton_supports(x=q))
    check_conv_inputs(OP, x, weight, bias, residual, None, cp.cu_seqlens, activation)
    return cp_causal_conv1d(causal_conv1d, x, weight, bias, residual, activation, backend, cp)
