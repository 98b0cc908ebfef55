"""The "gluon" backend of chunk_gated_delta_rule: the fused Gluon forward on sm_90a (launcher.py), registered with
op_backends("chunk_gated_delta_rule") when this module is imported (api.py imports it).

`auto` takes it only for the calls where it is faster than the Triton forward (_auto_filter: few sequence-heads,
and an eager call of 256 tokens or more, or a CUDA-graph capture); by name (backend="gluon" or
LINATTN_BACKEND=gluon) it takes every call supports() accepts. The forward is the torch custom op
"linattn::chunk_gdn_fwd_gluon"; under autograd it keeps its stage 2a's outputs, gcum and Tinv (in k's dtype: 132 bytes
per token and value head, as FLA keeps its A and cumulative gate), beside the inputs. Its backward,
"linattn::chunk_gdn_bwd_gluon", is the Triton backward (it recomputes the other intermediates from the saved inputs)
with its recompute of h and Vnew in the gate-free form (chunk_state_gf.py: no U), its reverse state pass (stage 1) in
Gluon (chunk_state_bwd.py), both in segments where a B1-B2 batch leaves SMs idle, and its local and WY stages (2, 3)
in one Gluon kernel (chunk_local_wy_bwd.py); a fixed-length call outside CUDA-graph capture goes
through the backward's launch list (triton/backward.py bwd_eager).

Nothing here imports Gluon at import time: supports() asks gluon_compat, the impl imports the launcher.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from linattn.backends import op_backends
from linattn.ops.gated_delta_rule import autograd
from linattn.ops.gated_delta_rule.validation import gluon_grid_problem
from linattn.runtime import eager_ops
from linattn.runtime.capture import stream_capturing
from linattn.runtime.device import eager_without_autograd

OP = "chunk_gated_delta_rule"
DTYPES = (torch.bfloat16, torch.float16)


@eager_ops.custom_op("linattn::chunk_gdn_fwd_gluon")
def _chunk_gdn_fwd_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
                         cu_seqlens: Optional[torch.Tensor]
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o, the final state (an empty [0] without it), and stage 2a's gcum [T_tot, HV] fp32 and Tinv [T_tot, HV, 64]
    in k's dtype (kept for the backward by setup_context)."""
    from linattn.ops.gated_delta_rule.gluon import launcher
    from linattn.runtime.capture import capturing
    if cu_seqlens is None and not capturing(q):                   # through the signature's launch list
        o, final, gcum, tinv = launcher.fwd_eager(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                  keep=True)
    else:
        res = launcher.chunk_gated_delta_rule_fwd_gluon(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                        cu_seqlens)
        o, final, gcum, tinv = res.o, res.final_state, res.gcum, res.tinv
    return o, final if output_final_state else q.new_empty(0, dtype=torch.float32), gcum, tinv


@_chunk_gdn_fwd_gluon.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty((N, HV, K, V) if output_final_state else (0,), dtype=torch.float32)
    return (v.new_empty(B, T, HV, V), final, q.new_empty(B * T, HV, dtype=torch.float32),
            k.new_empty(B * T, HV, 64))


@eager_ops.custom_op("linattn::chunk_gdn_bwd_gluon")
def _chunk_gdn_bwd_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                         do: torch.Tensor, dht: Optional[torch.Tensor], gcum: torch.Tensor, tinv: torch.Tensor
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton backward with its recompute in the gate-free form (gluon/chunk_state_gf.py: h and Vnew without U,
    segmented as the forward where recompute_segments says so; gcum and Tinv the forward's, kept, where the Gluon
    local/WY stage reads Tinv in k's dtype, else the Triton stage 2a's with an fp32 Tinv), its stages 1a + 1 (P^T dO
    and the reverse state pass, one kernel; segmented where chunk_state_bwd.state_bwd_segments says so) and its local
    and WY stages (2, 3) in Gluon."""
    from linattn.ops.gated_delta_rule.gluon import chunk_local_wy_bwd as gluon_local_wy
    from linattn.runtime import gluon_compat
    from linattn.ops.gated_delta_rule.gluon import chunk_state_bwd as gluon_bwd
    from linattn.ops.gated_delta_rule.triton.backward import bwd_eager
    from linattn.runtime.capture import capturing

    def state_bwd_pass(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0_, plan, scale_):
        gluon_bwd.chunk_state_bwd_gluon(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0_, plan, scale_, dv_local=True,
                                        segments=reverse_segments, g=g, beta=beta)

    def local_wy_pass(q_, k_, v_, vnew, h, dh, gcum, beta_, tinv, do_, dvnew, dq, dk, dv, dg, dbeta, plan, scale_):
        gluon_local_wy.chunk_local_wy_bwd_gluon(q_, k_, v_, vnew, h, dh, gcum, beta_, tinv,
                                                do_ if do_.dtype == q_.dtype else do_.to(q_.dtype), dvnew, dq, dk, dv,
                                                dg, dbeta, plan, scale_)
    local_wy = gluon_compat.async_copy is not None
    cap = capturing(q)
    segments = recompute_segments(q, v, cu_seqlens, cap)
    reverse_segments = gluon_bwd.state_bwd_segments(q.shape[0], q.shape[1], v.shape[2], v.shape[3], cu_seqlens,
                                                    q.device, cap)
    if reverse_segments is None and cu_seqlens is None and not cap:
        gluon_bwd.state_bwd_prepare_capture(q.shape[0], q.shape[1], v.shape[2], v.shape[3], q.device)

    def recompute(q_, k_, v_, g_, beta_, h0_, plan):
        from linattn.ops.gated_delta_rule.gluon.chunk_state_gf import recompute_gf
        # the Gluon local/WY stage reads the forward's 16-bit Tinv; the Triton WY stage an fp32 one of its own
        return recompute_gf(q_, k_, v_, g_, beta_, h0_, plan, segments=segments,
                            stage2a=(gcum, tinv) if local_wy else None)
    dq, dk, dv, dg, dbeta, dh0, _, _ = bwd_eager(
        q, k, v, g, beta, scale, initial_state, do.contiguous(), None if dht is None else dht.contiguous(),
        variant=("gluon", local_wy, segments, reverse_segments), cu_seqlens=cu_seqlens, kept=(gcum, tinv),
        recompute=recompute,
        state_bwd=state_bwd_pass, local_wy=local_wy_pass if local_wy else None, state_bwd_dv_local=True)
    if dh0 is None:
        dh0 = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dg, dbeta, dh0


@_chunk_gdn_bwd_gluon.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, gcum, tinv):
    return autograd.fake_grads(q, k, v, g, beta, initial_state)


# Context parallelism's local state pass (distributed/chunk.py) goes to the Gluon W/U state pass
# (launcher.chunk_state_gluon) where it beats Triton's: N*HV <= 64 sequence-heads (1.05x at B1 T8192-65536 H16/HV32;
# at B8 T4096, N*HV = 256, 0.92x; benchmarks/RESULTS.md).
GLUON_BWD_STATE_MAX_SEQ_HEADS = 64


def recompute_state_in_gluon(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> bool:
    """Whether context parallelism's state pass runs on the Gluon W/U kernel."""
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return N * v.shape[2] <= GLUON_BWD_STATE_MAX_SEQ_HEADS


def recompute_segments(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor], capturing: bool):
    """(S, L) of the backward's segmented recompute (the forward's segment plan: chunk_fused_gf.gf_segments_wanted),
    or None where it runs unsegmented."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import gf_segments_wanted
    S, L = gf_segments_wanted(q.shape[0], q.shape[1], v.shape[2], cu_seqlens, q.device, capturing=capturing)
    return (S, L) if S > 1 else None


def _setup_context(ctx, inputs, output):
    # (no gradient reaches the kept gcum and Tinv: None for them, as for any output no loss reaches, instead of
    # zero-filled [T_tot, HV, 64] tensors; autograd.setup_context turns materialising off)
    autograd.setup_context(ctx, inputs, output, kept=output[2:])


def _backward(ctx, do, dfinal, *_):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors[:7]
    gcum, tinv = ctx.saved_tensors[-2:]
    if do is None:                                   # only the final state reaches the loss
        do = v.new_zeros(v.shape)
    grads = _chunk_gdn_bwd_gluon(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do,
                                 autograd.final_state_grad(ctx, dfinal), gcum, tinv)
    return autograd.input_grads(ctx, *grads)


_chunk_gdn_fwd_gluon.register_autograd(_backward, setup_context=_setup_context)


def supports(q=None, v=None, cu_seqlens=None, state_v_first=False, **_) -> Tuple[bool, str]:
    if q is None:
        return False, "the Gluon forward needs the call's tensors to decide"
    # the Gluon state passes load and store states [N, HV, K, V] by TMA; FLA's gate and beta sigmoid run as one
    # elementwise pass before the Gluon kernels, which read activated values (impl, triton/gate_prologue.py)
    if state_v_first:
        return False, "state_v_first=True runs on the Triton path only (the Gluon kernels store [N, HV, K, V] states)"
    from linattn.runtime.device import hopper_gluon_ready
    ok, reason = hopper_gluon_ready(q, "the Gluon forward")
    if not ok:
        return False, reason
    if q.dtype not in DTYPES:
        return False, f"dtype {q.dtype}: the Gluon forward takes bf16 or fp16 q/k/v"
    K, V = q.shape[-1], v.shape[-1]
    if K != 128 or V != 128:
        return False, f"K={K}, V={V}: the Gluon forward is built for K == V == 128"
    if q.shape[0] * q.shape[1] == 0:
        return False, "no tokens: the TMA descriptors need a non-empty [T, heads*dim] view"
    HV = v.shape[2]
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    problem = gluon_grid_problem(N, HV)
    if problem:
        return False, problem
    slots_bound = q.shape[0] * q.shape[1] // 64 + N          # chunk_indices.py's bound on the chunk slots
    if slots_bound * HV * K >= 2 ** 31:
        return False, "too many chunks for the 32-bit TMA row coordinate of the h store"
    return True, ""


_launcher_module = None


def _launcher():
    """gluon/launcher.py, imported at the first call (it imports Gluon) and kept (an import statement per call costs
    the import machinery's lookup)."""
    global _launcher_module
    if _launcher_module is None:
        from linattn.ops.gated_delta_rule.gluon import launcher
        _launcher_module = launcher
    return _launcher_module


def impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log=None, dt_bias=None,
         beta_scale=0):
    """The Gluon forward (backward by its custom op's autograd). FLA's in-kernel gate (A_log, dt_bias) and beta
    sigmoid (beta_scale 1 or 2) become g and beta in fp32 by gate_prologue.activate first, differentiably."""
    if A_log is not None or beta_scale:
        from linattn.ops.gated_delta_rule.triton.gate_prologue import activate
        g, beta = activate(g, beta, A_log, dt_bias, beta_scale)
    if eager_without_autograd(q, k, v, g, beta, initial_state):     # no custom-op dispatch (api.py says why)
        launcher = _launcher()
        # (not traced: eager_without_autograd asked; under CUDA-graph capture the host path is captured instead)
        if cu_seqlens is None and not stream_capturing(q):
            return launcher.fwd_eager(q, k, v, g, beta, scale, initial_state, output_final_state)
        res = launcher.chunk_gated_delta_rule_fwd_gluon(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                        cu_seqlens)
        return res.o, (res.final_state if output_final_state else None)
    o, final, _, _ = _chunk_gdn_fwd_gluon(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return o, (final if output_final_state else None)


# Where `auto` sends a call the Gluon forward supports (H200, benchmarks/RESULTS.md):
# - N*HV <= 768 sequence-heads: gluon / triton forward 1.35-1.45x from N*HV = 32 to 768 (B1 T8192-65536, B8 T4096,
#   B4 T16384, the varlen mix of 24 sequences). More sequence-heads were not timed and stay on Triton.
# - an eager call (not under CUDA-graph capture) also needs T_total >= 256 tokens. Eager, H100, H16/HV32, each in
#   a fresh process: gluon 0.07-0.14 ms against Triton's 0.09-0.29 from 256 to 4096 tokens (B1-B16), B1 T8192 1.36x;
#   below 256 tokens both are host-bound (~0.1 ms a call, kernels 0.035 ms) and neither wins in every process.
GLUON_AUTO_MAX_SEQ_HEADS = 768
GLUON_AUTO_MIN_EAGER_TOKENS = 256


def _auto_filter(q=None, v=None, cu_seqlens=None, **_) -> Tuple[bool, str]:
    from linattn.runtime.capture import capturing
    HV = v.shape[2]
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if N * HV > GLUON_AUTO_MAX_SEQ_HEADS:
        return False, (f"N*HV = {N * HV} > {GLUON_AUTO_MAX_SEQ_HEADS} sequence-heads: not timed there (Gluon "
                       f"1.35-1.45x Triton up to N*HV = 768); backend='gluon' by name")
    tokens = q.shape[0] * q.shape[1]
    if tokens < GLUON_AUTO_MIN_EAGER_TOKENS and not capturing(q):
        return False, (f"eager call with {tokens} < {GLUON_AUTO_MIN_EAGER_TOKENS} tokens: host-bound, no faster "
                       f"eagerly there; taken under CUDA-graph capture; backend='gluon' by name")
    return True, ""


def direct(q, k, v, g, beta, scale, initial_state, output_final_state):
    """The op's direct path for a repeat plain eager call (Backend.direct): the replay of the launch list this call's
    fwd_eager kept (launcher.eager_direct), or None where the call did not take fwd_eager (autograd, a traced call,
    CUDA-graph capture) or left no list."""
    if not eager_without_autograd(q, k, v, g, beta, initial_state) or stream_capturing(q):
        return None
    return _launcher().eager_direct(q, k, v, g, beta, scale, initial_state, output_final_state)


op_backends(OP).register("gluon", impl, supports, priority=0, auto=True, auto_filter=_auto_filter, direct=direct)
