"""Autograd of the chunked GDN forward ops, shared by the Triton (api.py) and Gluon (gluon/backend.py) backends.

The backward is the torch custom op "linattn::chunk_gdn_bwd" (the Triton backward, with a fake implementation): it
recomputes the forward's intermediates from the saved inputs, so it serves every forward op whose inputs are
(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens), optionally followed by FLA's options
(A_log, dt_bias, beta_scale, state_v_first: the Triton op's; the Gluon op takes the defaults only). It reads no device
data on the host, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from linattn.runtime import eager_ops


# Optional outputs are not allowed in custom-op schemas: a gradient that does not exist is returned as an empty
# [0] tensor and mapped back to None by the caller.
@eager_ops.custom_op("linattn::chunk_gdn_bwd")
def chunk_gdn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  do: torch.Tensor, dht: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
                  dt_bias: Optional[torch.Tensor], beta_scale: int, state_v_first: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor]:
    from linattn.ops.gated_delta_rule.triton.backward import bwd_eager
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = bwd_eager(
        q, k, v, g, beta, scale, initial_state, do.contiguous(), None if dht is None else dht.contiguous(),
        A_log, dt_bias, beta_scale, state_v_first, cu_seqlens=cu_seqlens)
    def empty0():                  # one tensor per absent output: outputs of a custom op may not alias each other
        return q.new_empty(0, dtype=torch.float32)
    return (dq, dk, dv, dg, dbeta, empty0() if dh0 is None else dh0,
            empty0() if dA_log is None else dA_log.to(A_log.dtype),
            empty0() if ddt_bias is None else ddt_bias.to(dt_bias.dtype))


@chunk_gdn_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, A_log, dt_bias, beta_scale, state_v_first):
    return fake_grads(q, k, v, g, beta, initial_state) + tuple(
        q.new_empty(0, dtype=torch.float32) if t is None else torch.empty_like(t) for t in (A_log, dt_bias))


def fake_grads(q, k, v, g, beta, initial_state):
    """The fake (meta) outputs of a backward op: the gradients' shapes and dtypes."""
    dh0 = (q.new_empty(0, dtype=torch.float32) if initial_state is None
           else initial_state.new_empty(initial_state.shape, dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def setup_context(ctx, inputs, output, kept=()):
    """Saves the forward op's inputs, then `kept` (a backend's own intermediates, last in ctx.saved_tensors)."""
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *options = inputs
    A_log, dt_bias, beta_scale, state_v_first = options if options else (None, None, 0, False)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *kept)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.beta_scale = beta_scale
    ctx.state_v_first = state_v_first
    ctx.num_inputs = len(inputs)
    # an output no loss reaches (the final state when not returned or not used, o sometimes) gets None in the backward
    # instead of a zero-filled gradient (a memset per call)
    ctx.set_materialize_grads(False)


def final_state_grad(ctx, dfinal):
    """The gradient of the final state flows in only when the state was returned (and used)."""
    return dfinal if (ctx.output_final_state and dfinal is not None) else None


def input_grads(ctx, dq, dk, dv, dg, dbeta, dh0, dA_log=None, ddt_bias=None):
    """The gradients of the forward op's inputs (nine, then FLA's four options where the op takes them)."""
    saved = ctx.saved_tensors
    grads = (dq, dk, dv, dg, dbeta, None, (dh0 if saved[5] is not None else None), None, None)
    if ctx.num_inputs > 9:
        grads += ((dA_log if saved[7] is not None else None), (ddt_bias if saved[8] is not None else None), None, None)
    return grads


def backward(ctx, do, dfinal):
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias = ctx.saved_tensors
    if do is None:                                   # only the final state reaches the loss
        do = v.new_zeros(v.shape)
    grads = chunk_gdn_bwd(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do, final_state_grad(ctx, dfinal),
                          A_log, dt_bias, ctx.beta_scale, ctx.state_v_first)
    return input_grads(ctx, *grads)
