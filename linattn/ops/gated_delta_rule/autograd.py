"""Autograd of the chunked GDN forward ops, shared by the Triton (api.py) and Gluon (gluon/backend.py) backends.

The backward is the torch custom op "linattn::chunk_gdn_bwd" (the Triton backward, with a fake implementation): it
recomputes the forward's intermediates from the saved inputs, so it serves every forward op whose inputs are
(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens). It reads no device data on the host, so
it can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


# Optional outputs are not allowed in custom-op schemas: a gradient that does not exist is returned as an empty
# [0] tensor and mapped back to None by the caller.
@torch.library.custom_op("linattn::chunk_gdn_bwd", mutates_args=())
def chunk_gdn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  do: torch.Tensor, dht: Optional[torch.Tensor]
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, do.contiguous(),
        None if dht is None else dht.contiguous())
    if dh0 is None:
        dh0 = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dg, dbeta, dh0


@chunk_gdn_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht):
    return fake_grads(q, k, v, g, beta, initial_state)


def fake_grads(q, k, v, g, beta, initial_state):
    """The fake (meta) outputs of a backward op: the gradients' shapes and dtypes."""
    dh0 = (q.new_empty(0, dtype=torch.float32) if initial_state is None
           else initial_state.new_empty(initial_state.shape, dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.output_final_state = output_final_state


def final_state_grad(ctx, dfinal):
    """The gradient of the final state flows in only when the state was returned (and used)."""
    return dfinal if (ctx.output_final_state and dfinal is not None) else None


def input_grads(ctx, dq, dk, dv, dg, dbeta, dh0):
    """The gradients of the forward op's nine inputs."""
    has_h0 = ctx.saved_tensors[5] is not None
    return dq, dk, dv, dg, dbeta, None, (dh0 if has_h0 else None), None, None


def backward(ctx, do, dfinal):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    grads = chunk_gdn_bwd(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do, final_state_grad(ctx, dfinal))
    return input_grads(ctx, *grads)
