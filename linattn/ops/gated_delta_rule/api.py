"""Public entry of the chunked Gated DeltaNet op: argument checks, backend choice, dtype plumbing.

Backends: "triton" (portable; every device Triton runs on, and the CPU under TRITON_INTERPRET=1) and "reference"
(plain PyTorch, by name only; differentiable by plain autograd), registered here; "gluon" (gluon/backend.py: the
fused Gluon forward on sm_90a), which registers itself when imported below.

The Triton path is the torch custom op "linattn::chunk_gdn_fwd", with a fake (meta) implementation and autograd
(autograd.py: the backward op "linattn::chunk_gdn_bwd"), so torch.compile(fullgraph=True) traces a model through it
without graph breaks. A plain eager call that records no autograd graph runs the launcher directly
(runtime/device.eager_without_autograd): the custom op's dispatch is host time an eager user pays on every call. Neither op reads device data on the host (no .item(), .cpu(), .tolist()): the forward and
the backward can be captured in a CUDA graph. Everything differentiable outside the kernels (the L2 norm of q and
k, dtype casts of initial_state, contiguity) stays in plain torch ops, so autograd carries it.
"""
from typing import Optional, Tuple

import torch

from linattn.backends import op_backends
from linattn.ops.gated_delta_rule import autograd
from linattn.ops.gated_delta_rule import reference as _ref
from linattn.ops.gated_delta_rule.triton import forward as _tf
from linattn.ops.gated_delta_rule.validation import (check_fla_gate_params, check_fla_options, check_gdn_inputs,
                                                     fla_state_v_first)
from linattn.ops.norm.l2norm import l2norm
from linattn.runtime import call_memo, eager_ops
from linattn.runtime.capture import capturing, stream_capturing
from linattn.runtime.device import eager_without_autograd
from linattn.runtime.settings import settings

OP = "chunk_gated_delta_rule"
_backends = op_backends(OP)


# ---- Triton path as a torch custom op
# Optional outputs are not allowed in custom-op schemas: a state that does not exist is returned as an empty
# [0] tensor and mapped back to None by the caller.

# FLA's options travel as A_log / dt_bias ([HV] contiguous, or None: use_gate_in_kernel), beta_scale (0: beta as
# given; 1 or 2: use_beta_sigmoid_in_kernel, 2 with allow_neg_eigval) and state_v_first.

@eager_ops.custom_op("linattn::chunk_gdn_fwd")
def _chunk_gdn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
                   cu_seqlens: Optional[torch.Tensor], A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                   beta_scale: int, state_v_first: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd, fwd_eager
    if cu_seqlens is None and not capturing(q):                       # through the signature's launch list
        o, final = fwd_eager(q, k, v, g, beta, scale, initial_state, output_final_state, A_log, dt_bias, beta_scale,
                             state_v_first)
    else:
        res = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                         A_log=A_log, dt_bias=dt_bias, beta_scale=beta_scale,
                                         state_v_first=state_v_first)
        o, final = res.o, res.final_state
    return o, final if output_final_state else q.new_empty(0, dtype=torch.float32)


@_chunk_gdn_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, beta_scale,
      state_v_first):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = v.new_empty(B, T, HV, V)
    shape = ((N, HV, V, K) if state_v_first else (N, HV, K, V)) if output_final_state else (0,)
    final = q.new_empty(shape, dtype=torch.float32)
    return o, final


_chunk_gdn_fwd.register_autograd(autograd.backward, setup_context=autograd.setup_context)


def _triton_supports(q=None, **_) -> Tuple[bool, str]:
    if q is None:
        return True, ""
    if q.device.type == "cpu" and not settings.interpret:
        return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton path"
    if q.device.type not in ("cpu", "cuda"):
        return False, f"device {q.device.type} is not supported by the Triton path"
    return True, ""


def _triton_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log=None, dt_bias=None,
                 beta_scale=0, state_v_first=False):
    if eager_without_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias):
        # (not traced: eager_without_autograd asked; under CUDA-graph capture the host path is captured instead)
        if cu_seqlens is None and not stream_capturing(q):
            return _tf.fwd_eager(q, k, v, g, beta, scale, initial_state, output_final_state, A_log, dt_bias,
                                 beta_scale, state_v_first)
        res = _tf.chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                         A_log=A_log, dt_bias=dt_bias, beta_scale=beta_scale,
                                         state_v_first=state_v_first)
        return res.o, (res.final_state if output_final_state else None)
    o, final = _chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias,
                              beta_scale, state_v_first)
    return o, (final if output_final_state else None)


def _triton_direct(q, k, v, g, beta, scale, initial_state, output_final_state):
    """The Triton backend's direct path (Backend.direct): the replay of the launch list this call's fwd_eager kept,
    or None where the call did not take fwd_eager (autograd, a traced call, CUDA-graph capture) or left no list."""
    if not eager_without_autograd(q, k, v, g, beta, initial_state) or stream_capturing(q):
        return None
    return _tf.eager_direct(q, k, v, g, beta, scale, initial_state, output_final_state)


def _reference_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, **options):
    return _ref.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                       **options)


_backends.register("triton", _triton_impl, _triton_supports, priority=10, direct=_triton_direct)
_backends.register("reference", _reference_impl, lambda **_: (True, ""), priority=100, auto=False)

# the "gluon" backend registers itself with op_backends(OP) (gluon/backend.py)
from linattn.ops.gated_delta_rule.gluon import backend as _gluon_backend  # noqa: E402,F401


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                           cu_seqlens_cpu: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
                           cp_context=None, *, use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
                           dt_bias: Optional[torch.Tensor] = None, chunk_size: int = 64,
                           transpose_state_layout: Optional[bool] = None, backend: str = "auto"
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet, chunked (shared/gdn-math.md), with FLA 0.6's signature: FLA's parameters in FLA's order and
    with FLA's defaults (a call written for fla.ops.gated_delta_rule.chunk_gated_delta_rule runs unchanged where
    linattn supports its options), FLA's **kwargs as keywords, then linattn's `backend`, keyword-only.

    Args:
        q, k: [B, T, H, K] (bf16, fp16 or fp32; one dtype with v).
        v: [B, T, HV, V], HV a multiple of H (GVA: value head j reads q/k head j // (HV // H)).
        g: [B, T, HV] log decay (<= 0), any float dtype (the raw gate input with use_gate_in_kernel).
        beta: [B, T, HV] any float dtype, post-sigmoid (a logit with use_beta_sigmoid_in_kernel).
            Values are checked for CPU tensors (g finite and <= 0, or free of NaN with use_gate_in_kernel; no NaN in
            beta: ValueError); on a GPU they are the caller's contract (no host sync), checked only with
            LINATTN_CHECK_INPUTS=1 (validation.py).
        scale: query scale, default K ** -0.5.
        initial_state: [N, HV, K, V] ([N, HV, V, K] with state_v_first), any float dtype (the math is fp32); N = B,
            or the number of sequences.
        output_final_state: also return the fp32 state after the last token, [N, HV, K, V] ([N, HV, V, K] with
            state_v_first).
        use_qk_l2norm_in_kernel: L2-normalise q and k along K first (eps 1e-6).
        use_beta_sigmoid_in_kernel: beta is a logit and sigmoid(beta) is used, or 2 * sigmoid(beta) with
            allow_neg_eigval (as FLA); formed inside the kernels (stage 2a), the gradient taken to the logit inside
            the backward's WY stage. allow_neg_eigval=True without use_beta_sigmoid_in_kernel raises ValueError, as
            in FLA.
        state_v_first: initial_state and the final state are [N, HV, V, K] (FLA's V-first layout), read and written
            in that layout by the state passes (forward and backward; no transposed copy).
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (B must be 1); starts at 0, sorted, ends at T.
            Checked on the host when it lives on the CPU; on a GPU it is not read back (no sync) and malformed
            offsets are clamped so that they can never cause out-of-bounds accesses.
        cu_seqlens_cpu, chunk_indices: FLA's precomputed varlen metadata (a host copy of cu_seqlens, from which FLA
            builds its chunk table without a device-to-host copy; FLA's [num_chunks, 2] table of (sequence, chunk)
            pairs). Accepted and ignored: linattn builds its own chunk plan on the device from cu_seqlens (no host
            sync), so neither changes the result.
        cp_context: context parallelism (linattn.distributed.build_cp_context; docs/context-parallel.md): q, k, v,
            g, beta are this rank's T / W tokens of one packed stream, B = 1; the context's local cu_seqlens is used
            (cu_seqlens may be omitted, or be that same tensor; the global offsets are refused). Unlike FLA,
            initial_state ([N, HV, K, V], N the global sequences, the same on every rank) and output_final_state
            (all N final states on every rank) are supported; initial_state's gradient on a rank holds the rows of
            the sequences starting there. Triton kernels only, eager (a graph break under torch.compile).
    Keyword-only (FLA reads these from **kwargs):
        use_gate_in_kernel, A_log, dt_bias: g is the raw gate input and the decay is -exp(A_log) * softplus(g +
            dt_bias) in fp32 (as FLA), formed inside the kernels before the chunk cumsum; A_log and dt_bias (optional)
            are float tensors of HV elements, differentiable (their gradients are summed over tokens from a
            per-token term the backward's WY stage writes). use_gate_in_kernel=True without A_log raises ValueError,
            as in FLA; A_log / dt_bias without it raise ValueError (FLA ignores them there).
        chunk_size: FLA's 16, 32 or 64, all computed in 64-token chunks (the same result up to rounding); any
            other value raises ValueError.
        transpose_state_layout: FLA's deprecated name of state_v_first (a DeprecationWarning, as in FLA).
        backend: "auto", "triton", "reference" (or "gluon" where registered; it declines the gate and beta options
            and state_v_first, which run on the Triton path).
    Returns:
        o [B, T, HV, V] in q's dtype (as FLA; q, k and v share one dtype here), and the final state (fp32, as FLA)
        or None.
    Differentiable in q, k, v, g, beta, initial_state, A_log and dt_bias (the gradient of the final state flows
    in); each gradient comes back in its input's dtype.
    """
    key = b = None
    if cp_context is None and transpose_state_layout is None and type(chunk_size) is int and \
            call_memo.memo_applies(q):
        # the auto choice reads CUDA-graph capture (gluon's auto filter), so the key does too
        key = call_memo.call_key(backend, (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias), scale, None,
                                 (not output_final_state, not use_qk_l2norm_in_kernel, not use_beta_sigmoid_in_kernel,
                                  not allow_neg_eigval, not state_v_first, not use_gate_in_kernel, chunk_size,
                                  capturing(q)))
        if key is not None:
            out = call_memo.run_direct(_DIRECT, key, (q, k, v, g, beta, initial_state))
            if out is not None:
                return out
        b = None if key is None else _CHECKED.get(key)
    if b is None:
        state_v_first = fla_state_v_first(OP, state_v_first, transpose_state_layout)
        check_fla_options(OP, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size)
        if cp_context is not None:
            return _context_parallel(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, cu_seqlens, cp_context, backend, use_gate_in_kernel,
                                     A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first)
        dims = check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens, op=OP, raw_gate=use_gate_in_kernel,
                                state_v_first=state_v_first)
        if use_gate_in_kernel:
            check_fla_gate_params(OP, A_log, dt_bias, dims["HV"], q.device)
        b = _backends.select(backend, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                             cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                             use_gate_in_kernel=use_gate_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel,
                             state_v_first=state_v_first)
        if key is not None:
            call_memo.remember(_CHECKED, key, b)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # FLA's options, passed on only when set (the Gluon impl, which declines them, takes the nine plain arguments);
    # A_log / dt_bias flattened to [HV] by torch ops, so autograd carries their gradients back to the given shapes
    options = {}
    if use_gate_in_kernel:
        options.update(A_log=A_log.reshape(-1).contiguous(),
                       dt_bias=None if dt_bias is None else dt_bias.reshape(-1).contiguous())
    if use_beta_sigmoid_in_kernel:
        options["beta_scale"] = 2 if allow_neg_eigval else 1
    if state_v_first:
        options["state_v_first"] = True
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    if b.name == "reference":
        return b.impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, **options)
    given = (q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    out = b.impl(q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens, **options)
    if not options and cu_seqlens is None and not use_qk_l2norm_in_kernel:
        call_memo.keep_direct(_DIRECT, key, b, given, (q, k, v, g, beta, initial_state), scale, output_final_state)
    return out


# Calls whose checks passed, by signature (call_memo.call_key), with the backend chosen: a repeat plain eager call on
# CUDA tensors skips the checks and the choice (~25 us of host time on this project's CPU).
_CHECKED: dict = {}
# Per signature, a backend's direct path (Backend.direct) for a repeat plain eager call on the caller's own tensors
# (no FLA option, no cu_seqlens, no in-kernel l2norm): the gluon backend's launch-list replay, reached without the
# option handling, the contiguity and dtype normalisation (the signature says they change nothing) and the backend's
# own dispatch. A direct path that declines (None) sends the call down the full path.
_DIRECT: dict = {}


def _context_parallel(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                      cu_seqlens, cp, backend, use_gate_in_kernel, A_log, dt_bias, beta_sigmoid, neg_eigval,
                      state_v_first):
    """The cp_context call: checks against the context, then linattn/distributed/chunk.py."""
    from linattn.distributed.chunk import cp_chunk_gated_delta_rule
    from linattn.distributed.context import check_cp_call
    check_cp_call(OP, q, cu_seqlens, cp, backend, _triton_supports)
    dims = check_gdn_inputs(q, k, v, g, beta, initial_state, cp.cu_seqlens, op=OP, num_states=cp.num_seqs_global,
                            raw_gate=use_gate_in_kernel, state_v_first=state_v_first)
    if use_gate_in_kernel:
        check_fla_gate_params(OP, A_log, dt_bias, dims["HV"], q.device)
        A_log = A_log.reshape(-1).contiguous()
        dt_bias = None if dt_bias is None else dt_bias.reshape(-1).contiguous()
    else:
        A_log = dt_bias = None
    if scale is None:
        scale = dims["K"] ** -0.5
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    return cp_chunk_gated_delta_rule(q, k, v, g, beta, float(scale), initial_state, output_final_state, cp, A_log,
                                     dt_bias, (2 if neg_eigval else 1) if beta_sigmoid else 0, state_v_first,
                                     backend)
