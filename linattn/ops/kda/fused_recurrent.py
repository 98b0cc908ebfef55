"""Kimi Delta Attention decode for serving: `fused_recurrent_kda`, FLA 0.6's signature.

It runs Gated DeltaNet's decode stack with the decay on the per-key-channel path (decode_kernels.py, GK_MODE): the
same Triton kernels (the one-tile kernel; the persistent walk at large batch), custom ops (`linattn::fused_recurrent_gdn[_inplace]` with gk), state-pool and serving
conventions (state_indices, inplace, pad_slot_id, state_v_first, speculative decoding), and the same reference
(fused_recurrent_reference with gk). Forward only, as GDN's decode.
"""
from typing import Optional, Tuple

import torch

from linattn.backends import op_backends
from linattn.ops.gated_delta_rule import fused_recurrent as gdn_decode
from linattn.ops.gated_delta_rule.validation import check_channel_decay, fla_state_v_first
from linattn.runtime import call_memo

OP = "fused_recurrent_kda"
_backends = op_backends(OP)


def gate_mode(use_gate_in_kernel: bool, A_log, lower_bound) -> str:
    """The kernels' GK_MODE for KDA's g: a log decay, or FLA's KDA gate on the raw input (softplus form, or the
    lower-bound form with or without A_log)."""
    if not use_gate_in_kernel:
        return "log"
    if lower_bound is None:
        return "softplus"
    return "lower_bound" if A_log is not None else "lower_bound_no_a"


def check_kda_gate_args(op: str, dims: dict, q, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    """FLA's KDA gate arguments: A_log [HV] (optional only with lower_bound), dt_bias [HV * K] (or [HV, K]),
    lower_bound < 0. A_log and dt_bias only with use_gate_in_kernel=True (ValueError otherwise: FLA ignores them
    there). lower_bound without the gate in the kernel is FLA's safe_gate promise that g >= lower_bound, accepted
    (the kernels are exact for any decay) and checked only for its type and sign."""
    HV, K = dims["HV"], dims["K"]
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not lower_bound < 0):
        raise ValueError(f"{op}: lower_bound must be a negative float (a log decay bound), got {lower_bound!r}")
    if not use_gate_in_kernel:
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None:
                raise ValueError(f"{op}: {name} is used only with use_gate_in_kernel=True")
        return
    if A_log is None and lower_bound is None:
        raise ValueError(f"{op}: use_gate_in_kernel=True needs A_log [HV] (or lower_bound), as in FLA")
    for name, t, numel in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV * K)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.numel() != numel or not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a float tensor of {numel} elements "
                             f"({'[HV]' if name == 'A_log' else '[HV * K]'}), got {tuple(getattr(t, 'shape', ()))}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")


def _triton_impl(q, k, v, g, beta, A_log=None, dt_bias=None, gk_mode="log", lower_bound=None, **call):
    return gdn_decode._triton_impl(q, k, v, None, beta, A_log=A_log, dt_bias=dt_bias, gk=g, gk_mode=gk_mode,
                                   lower_bound=0.0 if lower_bound is None else lower_bound, **call)


def _reference_impl(q, k, v, g, beta, A_log=None, dt_bias=None, gk_mode="log", lower_bound=None, **call):
    return gdn_decode.fused_recurrent_reference(q, k, v, None, beta, A_log=A_log, dt_bias=dt_bias, gk=g,
                                                gk_mode=gk_mode, lower_bound=lower_bound, **call)


def _triton_supports(q=None, k=None, v=None, g=None, beta=None, **call):
    return gdn_decode._triton_supports(q, k, v, None, beta, gk=g, **call)


_backends.register("triton", _triton_impl, _triton_supports, priority=10)
_backends.register("reference", _reference_impl, lambda **_: (True, ""), priority=100, auto=False)


def fused_recurrent_kda(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, scale: Optional[float] = None,
        initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
        use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
        lower_bound: Optional[float] = None, state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
        *, transpose_state_layout: Optional[bool] = None, state_indices: Optional[torch.Tensor] = None,
        inplace: bool = False, num_accepted_tokens: Optional[torch.Tensor] = None, pad_slot_id: Optional[int] = None,
        backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KDA over T >= 1 new tokens per sequence from a carried state (decode, speculative decode), with FLA 0.6's
    signature (fla.ops.kda.fused_recurrent_kda), then linattn's serving extras keyword-only.

    q, k [B, T, H, K]; v [B, T, HV, V] (GVA); g [B, T, HV, K]: the log decay per key channel (<= 0), or with
    use_gate_in_kernel=True the gate's raw input, the decay then being FLA's KDA gate: -exp(A_log) * softplus(g +
    dt_bias) with A_log [HV], dt_bias [HV * K] (optional); with lower_bound (< 0): lower_bound * sigmoid(exp(A_log)
    * (g + dt_bias)), or lower_bound * sigmoid(g + dt_bias) without A_log. beta [B, T, HV] (a logit with
    use_beta_sigmoid_in_kernel; 2 sigmoid(beta) with allow_neg_eigval too). scale defaults to K ** -0.5;
    use_qk_l2norm_in_kernel normalises q and k along K.

    States, serving mode, padding, speculative decoding, dtypes and the returned (o, final_state) follow
    fused_recurrent_gated_delta_rule exactly (its docstring): initial_state [N, HV, K, V] ([.., V, K] with
    state_v_first; transpose_state_layout is its deprecated name), or a pool with state_indices [N] / [N, T_max]
    (num_accepted_tokens), inplace, pad_slot_id. backend: "auto" (Triton), "triton" or "reference". Forward only.
    """
    key = None
    if call_memo.memo_applies(q) and transpose_state_layout is None and \
            (lower_bound is None or type(lower_bound) in (float, int)):
        key = call_memo.call_key(backend, (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                         state_indices, num_accepted_tokens), scale, pad_slot_id,
                                 (not output_final_state, not use_qk_l2norm_in_kernel, not use_gate_in_kernel,
                                  not use_beta_sigmoid_in_kernel, not allow_neg_eigval, not state_v_first,
                                  not inplace, lower_bound))
        direct = None if key is None else _DIRECT.get(key)
        if direct is not None:
            out = direct(q, k, v, None, g, beta, A_log, _flat(dt_bias), initial_state, cu_seqlens, state_indices,
                         num_accepted_tokens)
            if out is not None:
                return out
    state_v_first = fla_state_v_first(OP, state_v_first, transpose_state_layout)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{OP}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA)")
    grad_tensors = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    if gdn_decode.requires_grad(**grad_tensors):
        return gdn_decode.forward_only(OP, lambda: fused_recurrent_kda(
            q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens,
            state_indices=state_indices, inplace=inplace, num_accepted_tokens=num_accepted_tokens,
            pad_slot_id=pad_slot_id, backend=backend), not inplace, grad_tensors)
    dims = gdn_decode.check_decode_inputs(q, k, v, None, beta, initial_state, cu_seqlens, state_indices, inplace,
                                          None, None, num_accepted_tokens, pad_slot_id, state_v_first)
    check_channel_decay("g", g, dims, q, op=OP, log_decay=not use_gate_in_kernel)
    check_kda_gate_args(OP, dims, q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    call = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_indices=state_indices, inplace=inplace,
                A_log=A_log, dt_bias=_flat(dt_bias),
                beta_sigmoid=bool(use_beta_sigmoid_in_kernel), num_accepted_tokens=num_accepted_tokens,
                pad_slot_id=pad_slot_id, state_v_first=state_v_first, allow_neg_eigval=allow_neg_eigval,
                gk_mode=gate_mode(use_gate_in_kernel, A_log, lower_bound),
                lower_bound=None if lower_bound is None else float(lower_bound))
    impl = _backends.select(backend, **call).impl
    if key is None or impl is not _triton_impl:
        return impl(**call)
    # the checks passed and Triton runs it: keep the launch for a repeat of this signature (GDN's _DIRECT)
    return gdn_decode.run_and_keep(_DIRECT, key, impl, call, (q, k, v, None, g, beta, A_log, call["dt_bias"],
                                                              initial_state, cu_seqlens, state_indices,
                                                              num_accepted_tokens))


# Per call signature (call_memo.call_key over KDA's arguments and options), the direct launch of a call that passed the
# checks and ran the Triton launcher on the caller's own tensors (direct_decode): a repeat call skips the checks, the
# backend choice and the launcher, which cost ~10x the batch-1 kernel in host time. Plain eager calls on CUDA tensors
# only (call_memo.memo_applies).
_DIRECT: dict = {}


def _flat(dt_bias):
    """dt_bias as the kernels take it, [HV * K]; a 1-D tensor is passed as it is (the direct launch then keeps it)."""
    return dt_bias if dt_bias is None or dt_bias.dim() == 1 else dt_bias.reshape(-1)
