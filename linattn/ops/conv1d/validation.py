"""Argument checks of the causal convolution ops: every bad input gets a clear error naming the argument.

Shapes, dtypes and devices are always checked; values (cu_seqlens, state_indices) only for CPU tensors outside a
torch.compile trace, where reading them costs no host synchronisation. On a GPU the kernels clamp malformed offsets
so that they never read or write out of bounds, and treat out-of-range pool slots as padded rows."""
import torch

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ACTIVATIONS = (None, "silu", "swish")


def fail(op: str, msg: str, exc=ValueError):
    raise exc(f"{op}: {msg}")


def _tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)


def _float_on(op, name, t, device):
    _tensor(op, name, t)
    if not t.is_floating_point():
        fail(op, f"{name} must be a float tensor, got {t.dtype}", TypeError)
    if t.device != device:
        fail(op, f"{name} is on {t.device} but x is on {device}")


def check_activation(op: str, activation):
    if activation not in ACTIVATIONS:
        fail(op, f"activation must be None, 'silu' or 'swish' (the same), got {activation!r}")


def check_weight_bias(op: str, x, weight, bias):
    """weight [D, W] (nn.Conv1d's [D, 1, W] squeezed), bias [D] or None; returns (D, W)."""
    D = x.shape[-1]
    _float_on(op, "weight", weight, x.device)
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        fail(op, f"weight must be [D, W] = [{D}, W >= 1] (nn.Conv1d's weight.squeeze(1)), "
                 f"got {tuple(weight.shape)}")
    if bias is not None:
        _float_on(op, "bias", bias, x.device)
        if tuple(bias.shape) != (D,):
            fail(op, f"bias must be [D] = [{D}], got {tuple(bias.shape)}")
    return D, weight.shape[1]


def check_cu_seqlens(op: str, x, cu_seqlens) -> int:
    """Returns N, the number of sequences."""
    if cu_seqlens is None:
        return x.shape[0]
    _tensor(op, "cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        fail(op, f"cu_seqlens must be [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        fail(op, f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}", TypeError)
    if cu_seqlens.device != x.device:
        fail(op, f"cu_seqlens is on {cu_seqlens.device} but x is on {x.device}")
    if x.shape[0] != 1:
        fail(op, f"with cu_seqlens the sequences are packed along T: x must be [1, T, D], got {tuple(x.shape)}")
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        cu = cu_seqlens.to(torch.int64)
        T = x.shape[1]
        if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
            fail(op, f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cu.tolist()[:16]}")
    return cu_seqlens.shape[0] - 1


def check_conv_inputs(op: str, x, weight, bias, residual, initial_state, cu_seqlens, activation) -> dict:
    _tensor(op, "x", x)
    if x.dim() != 3:
        fail(op, f"x must be [B, T, D], got shape {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        fail(op, f"x must be bf16, fp16, fp32 or fp64, got {x.dtype}", TypeError)
    D, W = check_weight_bias(op, x, weight, bias)
    check_activation(op, activation)
    N = check_cu_seqlens(op, x, cu_seqlens)
    if residual is not None:
        _float_on(op, "residual", residual, x.device)
        if residual.shape != x.shape:
            fail(op, f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if initial_state is not None:
        _float_on(op, "initial_state", initial_state, x.device)
        if tuple(initial_state.shape) != (N, D, W):
            fail(op, f"initial_state must be [N, D, W] = [{N}, {D}, {W}] (one state per sequence), "
                     f"got {tuple(initial_state.shape)}")
    return dict(B=x.shape[0], T=x.shape[1], D=D, W=W, N=N)


def check_index_values(op: str, state_indices, num_slots: int):
    """CPU tensors only (reading them on a GPU would synchronise the host): every index a padded row (< 0) or a slot
    of the pool, and no slot named by two rows."""
    idx = state_indices.to(torch.int64)
    bad = idx >= num_slots
    if bool(bad.any()):
        fail(op, f"state_indices {idx[bad].tolist()[:8]} out of range for a pool of {num_slots} slots (use a "
                 "negative index for a padded row)")
    live = idx[idx >= 0]
    if live.unique().numel() != live.numel():
        fail(op, "state_indices name a slot twice: two rows would update one state")


def check_update_inputs(op: str, x, conv_state, weight, bias, activation, state_indices) -> dict:
    _tensor(op, "x", x)
    if x.dim() not in (2, 3):
        fail(op, f"x must be [N, D] (one token per row) or [N, T, D], got shape {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        fail(op, f"x must be bf16, fp16, fp32 or fp64, got {x.dtype}", TypeError)
    D, W = check_weight_bias(op, x, weight, bias)
    check_activation(op, activation)
    N = x.shape[0]
    _float_on(op, "conv_state", conv_state, x.device)
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (D, W) or conv_state.shape[0] < 1:
        fail(op, f"conv_state must be [slots >= 1, D, W] = [slots, {D}, {W}], got {tuple(conv_state.shape)}")
    if not conv_state.is_contiguous():
        fail(op, "conv_state must be contiguous (the kernel updates it in place)")
    if state_indices is None:
        if conv_state.shape[0] != N:
            fail(op, f"without state_indices conv_state holds one state per row: [N, D, W] = [{N}, {D}, {W}], "
                     f"got {tuple(conv_state.shape)}")
    else:
        _tensor(op, "state_indices", state_indices)
        if state_indices.dim() != 1 or state_indices.shape[0] != N:
            fail(op, f"state_indices must be [N] = [{N}] (one pool slot per row), got {tuple(state_indices.shape)}")
        if state_indices.dtype not in (torch.int32, torch.int64):
            fail(op, f"state_indices must be int32 or int64, got {state_indices.dtype}", TypeError)
        if state_indices.device != x.device:
            fail(op, f"state_indices is on {state_indices.device} but x is on {x.device}")
        if state_indices.device.type == "cpu" and not torch.compiler.is_compiling():
            check_index_values(op, state_indices, conv_state.shape[0])
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight), ("bias", bias)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                fail(op, f"{name} requires grad, but the update step has no backward (inference only); call it "
                         f"under torch.no_grad() or pass {name}.detach()")
    return dict(N=N, T=1 if x.dim() == 2 else x.shape[1], D=D, W=W, slots=conv_state.shape[0])
