"""`causal_conv1d_update`: the decode step of the causal convolution, its states in a pool updated in place.

The Triton path is the torch custom op "linattn::causal_conv1d_update", which declares that it mutates conv_state
(so torch.compile orders it and CUDA graphs capture it); forward only. The reference backend runs by name.

Decode calls it once per layer and token (three times per Gated DeltaNet layer), so an eager call is kept cheap on
the host: a call whose signature passed the checks and chose Triton before skips both (_CHECKED), and a plain eager
call runs the launcher without the custom op's dispatch (which costs more host time than the kernel)."""
from typing import Optional, Tuple

import torch

from linattn.backends import CheckedCalls, op_backends
from linattn.ops.conv1d.reference import causal_conv1d_update_reference
from linattn.ops.conv1d.validation import check_update_inputs
from linattn.runtime.op_lists import as_tuple
from linattn.runtime.settings import settings

OP = "causal_conv1d_update"
_backends = op_backends(OP)


@torch.library.custom_op("linattn::causal_conv1d_update", mutates_args=("conv_state",))
def _update_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               activation: str, state_indices: Optional[torch.Tensor]) -> torch.Tensor:
    from linattn.ops.conv1d.triton.update import conv1d_update
    return conv1d_update(x, conv_state, weight, bias, activation == "silu", state_indices)


@_update_op.register_fake
def _(x, conv_state, weight, bias, activation, state_indices):
    return x.new_empty(x.shape)


def _triton_supports(x=None, conv_state=None, weight=None, bias=None, **_) -> Tuple[bool, str]:
    if x.device.type == "cpu" and not settings.interpret:
        return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton path"
    if x.device.type not in ("cpu", "cuda"):
        return False, f"device {x.device.type} is not supported by the Triton path"
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype == torch.float64:
            return False, f"fp64 {name}: use the reference backend"
    return True, ""


def _eager(x) -> bool:
    """A plain eager call: not traced by torch.compile / export, and x a plain tensor (not a fake, functional or
    other subclass tensor, which need the custom op's fake implementation)."""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling()


def _triton_impl(x, conv_state, weight, bias, activation, state_indices, key=None):
    """key: the call's _CHECKED key (None: not remembered), under which a plain eager call keeps a launch list."""
    if _eager(x):
        from linattn.ops.conv1d.triton.update import LISTS, conv1d_update
        silu = activation is not None
        y = LISTS(key, (x, conv_state, weight, bias, state_indices),
                  lambda: conv1d_update(x, conv_state, weight, bias, silu, state_indices))[0]
        if not conv_state.is_inference():            # inference tensors carry no version counter
            torch.autograd.graph.increment_version(conv_state)      # as the mutating custom op would
        return y
    return _update_op(x, conv_state, weight, bias, "" if activation is None else "silu", state_indices)


_backends.register("triton", _triton_impl, _triton_supports, priority=10)
_backends.register("reference", causal_conv1d_update_reference, lambda **_: (True, ""), priority=100, auto=False)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                         state_indices: Optional[torch.Tensor] = None, *, backend: str = "auto") -> torch.Tensor:
    """One or a few new tokens per row against carried convolution states (decode, speculative decode), in
    causal-conv1d's argument order with FLA's layouts.

    Args:
        x: [N, D] (one token per row) or [N, T, D] (T tokens per row, in order); bf16 / fp16 / fp32.
        conv_state: [slots, D, W], contiguous, any float dtype: each row's last W inputs, oldest first, as
            causal_conv1d's states. Updated IN PLACE: after the call a row's slot holds its last W inputs.
        weight: [D, W]; bias: [D] or None; activation: None, "silu" or "swish".
        state_indices: [N] int32 / int64 pool slots, or None (row n uses slot n; then slots must equal N). A
            negative index is a padded row: its state is neither read nor written and its output is zeros. Indices
            >= slots raise on the CPU; on a GPU (no host sync) the kernel treats them as padded rows. Two live rows
            must not name one slot.
        backend (keyword-only): "auto", "triton" or "reference".
    Returns:
        y with x's shape and dtype: for every token the convolution of the full sequence at that position.
    Forward only (inference): an input that requires grad with grad mode on raises ValueError.
    """
    key = None
    if _eager(x) and (state_indices is None or state_indices.is_cuda) and (activation is None or
                                                                          isinstance(activation, str)):
        key = _CHECKED.key(backend, (x, conv_state, weight, bias, state_indices), (activation,))
    hit = _CHECKED.get(key)
    if hit is not None:
        impl, lists = hit
        out = lists.replay(key, (x, conv_state, weight, bias, state_indices))
        if out is not None:
            if not conv_state.is_inference():        # inference tensors carry no version counter
                torch.autograd.graph.increment_version(conv_state)
            return out[0]
        return impl(x, conv_state, weight, bias, activation, state_indices, key)
    check_update_inputs(OP, x, conv_state, weight, bias, activation, state_indices)
    b = _backends.select(backend, x=x, conv_state=conv_state, weight=weight, bias=bias, state_indices=state_indices)
    if b.name == "triton":
        from linattn.ops.conv1d.triton.update import LISTS
        _CHECKED.put(key, (b.impl, LISTS))
        return b.impl(x, conv_state, weight, bias, activation, state_indices, key)
    return b.impl(x, conv_state, weight, bias, activation, state_indices)


# Calls whose checks passed and that chose Triton (backends.CheckedCalls), with the Triton launcher's launch lists
# (triton/update.py LISTS; LISTS3 for causal_conv1d_update3's fused calls): a repeat call whose signature kept one
# replays it without entering the impl. Not remembered: traced calls, and calls with state_indices on the CPU, whose
# values the checks read.
_CHECKED = CheckedCalls()
_CHECKED3 = CheckedCalls()


@torch.library.custom_op("linattn::causal_conv1d_update3", mutates_args=("s0", "s1", "s2"))
def _update3_op(x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor,
                s2: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b0: Optional[torch.Tensor],
                b1: Optional[torch.Tensor], b2: Optional[torch.Tensor], activation: str,
                state_indices: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from linattn.ops.conv1d.triton.update import conv1d_update3
    return tuple(conv1d_update3((x0, x1, x2), (s0, s1, s2), (w0, w1, w2), (b0, b1, b2), activation == "silu",
                                state_indices))


@_update3_op.register_fake
def _(x0, x1, x2, s0, s1, s2, w0, w1, w2, b0, b1, b2, activation, state_indices):
    return x0.new_empty(x0.shape), x1.new_empty(x1.shape), x2.new_empty(x2.shape)


def _same_launch(xs, conv_states, weights, biases) -> bool:
    """Whether three updates can share one launch: the same rows and tokens, one dtype per role, one W, biases all
    present or all absent."""
    x0, s0, w0 = xs[0], conv_states[0], weights[0]
    return (all(x.dim() == x0.dim() and x.shape[:-1] == x0.shape[:-1] and x.dtype == x0.dtype for x in xs)
            and all(c.dtype == s0.dtype for c in conv_states) and all(c.shape[0] == s0.shape[0] for c in conv_states)
            and all(w.dtype == w0.dtype and w.dim() == 2 and w.shape[-1] == w0.shape[-1] for w in weights)
            and len({b is None for b in biases}) == 1 and all(b is None or b.dtype == biases[0].dtype for b in biases))


def causal_conv1d_update3(xs, conv_states, weights, biases=(None, None, None), activation: Optional[str] = None,
                          state_indices: Optional[torch.Tensor] = None, *, backend: str = "auto"):
    """Three causal_conv1d_update calls with the same rows and slots (a layer's q, k and v convolutions in a decode
    step) in one kernel launch where they share dtypes and W; each triple element as causal_conv1d_update's
    argument, every check of it applied. Returns the three outputs."""
    xs, conv_states, weights, biases = tuple(xs), tuple(conv_states), tuple(weights), tuple(biases)
    if not (len(xs) == len(conv_states) == len(weights) == len(biases) == 3):
        raise ValueError("causal_conv1d_update3: xs, conv_states, weights and biases must be triples")
    key = None
    if all(_eager(x) for x in xs) and (state_indices is None or state_indices.is_cuda) and (
            activation is None or isinstance(activation, str)):
        key = _CHECKED3.key(backend, xs + conv_states + weights + biases + (state_indices,), (activation,))
    lists3 = _CHECKED3.get(key)         # the Triton launcher's LISTS3: a signature whose three share one launch
    fused = lists3 is not None
    if fused:
        out = lists3.replay(key, xs + conv_states + weights + biases + (state_indices,))
        if out is not None:
            for c in conv_states:
                if not c.is_inference():             # as the mutating custom op would
                    torch.autograd.graph.increment_version(c)
            return list(out)
    else:
        for x, c, w, b in zip(xs, conv_states, weights, biases):
            check_update_inputs(OP, x, c, w, b, activation, state_indices)
        choices = {_backends.select(backend, x=x, conv_state=c, weight=w, bias=b, state_indices=state_indices).name
                   for x, c, w, b in zip(xs, conv_states, weights, biases)}
        fused = choices == {"triton"} and _same_launch(xs, conv_states, weights, biases)
        if fused:
            from linattn.ops.conv1d.triton.update import LISTS3
            _CHECKED3.put(key, LISTS3)
    if not fused:
        return [causal_conv1d_update(x, c, w, b, activation, state_indices, backend=backend)
                for x, c, w, b in zip(xs, conv_states, weights, biases)]
    act = "" if activation is None else "silu"
    if all(_eager(x) for x in xs):
        from linattn.ops.conv1d.triton.update import LISTS3, conv1d_update3
        ys = list(LISTS3(key, xs + conv_states + weights + biases + (state_indices,),
                         lambda: conv1d_update3(xs, conv_states, weights, biases, act == "silu", state_indices),
                         as_tuple))
        for c in conv_states:
            if not c.is_inference():                 # as the mutating custom op would
                torch.autograd.graph.increment_version(c)
        return ys
    return list(_update3_op(*xs, *conv_states, *weights, *biases, act, state_indices))
