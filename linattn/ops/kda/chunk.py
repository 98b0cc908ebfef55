"""Public entry of the chunked KDA op, `chunk_kda` (FLA 0.6's signature): argument checks, backend choice.

Backends: "triton" (KDA's stage 2a, triton/intra.py, then GDN's stages in their per-key-channel form; any device
Triton runs on, the CPU under TRITON_INTERPRET=1), "gluon" (Hopper: KDA's Gluon stage 2a and fused stages 2b-4,
kda/gluon/; the same custom ops and the Triton backward) and "reference" (the token-by-token recurrence in PyTorch,
by name only; differentiable by plain autograd). The Triton path is the torch custom op "linattn::chunk_kda_fwd" with
a fake implementation, so torch.compile(fullgraph=True) traces through it; it reads no device data on the host
(CUDA-graph safe). Its backward is the custom op "linattn::chunk_kda_bwd" (triton/backward.py: GDN's reverse state
pass, KDA's local backward kernels), registered as the forward op's autograd. The autograd forward keeps stage
2a's outputs (gcum, the effective beta, Tinv, Aqk: about FLA's default memory) and the backward rebuilds the rest
from them; with disable_recompute it keeps everything the backward reads, as FLA does.
"""
from typing import List, Optional, Tuple

import torch

from linattn.backends import op_backends
from linattn.ops.norm.l2norm import l2norm
from linattn.ops.gated_delta_rule.validation import (check_channel_decay, check_chunk_size, check_gdn_inputs,
                                                    fla_state_v_first)
from linattn.ops.kda.fused_recurrent import check_kda_gate_args, gate_mode
from linattn.ops.kda.reference import kda_gate, naive_recurrent_kda
from linattn.runtime import call_memo, eager_ops
from linattn.runtime.capture import capturing
from linattn.runtime.device import eager_without_autograd, records_autograd
from linattn.runtime.settings import settings

OP = "chunk_kda"
_backends = op_backends(OP)


# What the autograd forward keeps for the backward (custom op argument `save`): nothing (no autograd), FLA's default
# set (gcum, the effective beta, Tinv, Aqk: stage 2a's outputs, its costly part; the backward rebuilds the rest from
# them; Tinv in fp32 from the Triton stage 2a, in q's dtype from the Gluon one, as FLA keeps its Akk inverse), or with
# disable_recompute everything the backward reads (nothing is recomputed; the Triton stages form it).
SAVE_NONE, SAVE_STAGE2A, SAVE_ALL = 0, 1, 2
_T = torch.Tensor


def _empty(q):
    return q.new_empty(0, dtype=torch.float32)


def _empties(q, n: int):
    """n distinct empty tensors: a custom op's outputs may not alias each other."""
    return tuple(_empty(q) for _ in range(n))


@eager_ops.custom_op("linattn::chunk_kda_fwd")
def _chunk_kda_fwd(q: _T, k: _T, v: _T, g: _T, beta: _T, scale: float, initial_state: Optional[_T],
                   output_final_state: bool, cu_seqlens: Optional[_T], A_log: Optional[_T], dt_bias: Optional[_T],
                   gate: str, lower_bound: float, beta_sigmoid: bool, neg_eigval: bool, state_v_first: bool,
                   save: int, intra: str = "triton") -> Tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T]:
    """(o, final, gcum, beta_eff, tinv, aqk, kdec, qdec, w, h, vnew, pairwise): what `save` does not keep is an
    empty [0] tensor (a custom op's outputs cannot be None). intra: stage 2a's kernels ("triton" or "gluon") where nothing or
    stage 2a's set is saved; with SAVE_ALL the Triton stages run (they form W, h and Vnew)."""
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, gate,
            lower_bound, beta_sigmoid, neg_eigval)
    if save == SAVE_NONE:
        o, final = chunk_kda_fwd(*args, state_v_first=state_v_first, intra=intra)
        return (o, final if final is not None else _empty(q)) + _empties(q, 10)
    if save == SAVE_STAGE2A and intra == "gluon":
        from linattn.ops.kda import eager
        if eager.listed(q, v, cu_seqlens, state_v_first):       # (the fused stages take K-first states only)
            o, final, kept = eager.fwd_eager(q, k, v, g, beta, scale, initial_state, output_final_state, A_log,
                                             dt_bias, gate, lower_bound, beta_sigmoid, neg_eigval, save_stage2a=True)
        else:
            o, final, kept = chunk_kda_fwd(*args, state_v_first=state_v_first, intra=intra, save_stage2a=True)
        return (o, final if final is not None else _empty(q)) + kept + _empties(q, 6)
    o, final, it = chunk_kda_fwd(*args, keep=True, keep_output=True, state_v_first=state_v_first)
    rest = (it.kdec, it.qdec, it.w, it.h, it.vnew, it.pairwise) if save == SAVE_ALL else _empties(q, 6)
    return (o, final if final is not None else _empty(q), it.gcum, it.beta, it.tinv, it.aqk) + rest


@_chunk_kda_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, gate, lower_bound,
      beta_sigmoid, neg_eigval, state_v_first, save, intra="triton"):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = ((N, HV, V, K) if state_v_first else (N, HV, K, V)) if output_final_state else (0,)
    out = (v.new_empty(B, T, HV, V), q.new_empty(shape, dtype=torch.float32))
    if save == SAVE_NONE:
        return out + _empties(q, 10)
    T_tot, f32 = B * T, torch.float32
    tinv_dtype = q.dtype if save == SAVE_STAGE2A and intra == "gluon" else f32
    out += (q.new_empty(T_tot, HV, K, dtype=f32), q.new_empty(T_tot, HV, dtype=f32),
            q.new_empty(T_tot, HV, 64, dtype=tinv_dtype), q.new_empty(T_tot, HV, 64))
    if save != SAVE_ALL:
        return out + _empties(q, 6)
    slots = max(B * -(-T // 64) if cu_seqlens is None else T // 64 + N, 1)      # make_chunk_plan's num_slots
    return out + (q.new_empty(T_tot, HV, K), q.new_empty(T_tot, HV, K), q.new_empty(T_tot, HV, K),
                  q.new_empty(slots, HV, K, V), q.new_empty(T_tot, HV, V), q.new_empty(slots, HV, dtype=torch.int8))


@eager_ops.custom_op("linattn::chunk_kda_bwd")
def _chunk_kda_bwd(q: _T, k: _T, v: _T, g: _T, beta: _T, scale: float, initial_state: Optional[_T],
                   cu_seqlens: Optional[_T], A_log: Optional[_T], dt_bias: Optional[_T], gate: str,
                   lower_bound: float, beta_sigmoid: bool, neg_eigval: bool, state_v_first: bool, do: _T,
                   dht: Optional[_T], saved: List[_T],
                   gluon_state: bool = False) -> Tuple[_T, _T, _T, _T, _T, _T, _T, _T]:
    """saved: the forward's kept tensors in _chunk_kda_fwd's order from gcum on (4 or 10 of them), or none (then the
    forward is recomputed). gluon_state: the recompute's state pass, the reverse state pass and the WY stage on
    Hopper's Gluon kernels where the call fits them (kda/gluon/state.py, wy_bwd.py; the gluon backend's backward),
    else Triton's."""
    from linattn.ops.kda import eager
    from linattn.ops.kda.triton.backward import chunk_kda_bwd
    from linattn.ops.kda.triton.forward import KdaIntermediates, kda_recompute
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.runtime.launch_list import keep as keep_for_lists
    state_pass = state_bwd = wy_bwd = None
    if gluon_state and not state_v_first:
        from linattn.ops.kda.gluon.state import kda_state_bwd_gluon as state_bwd
        from linattn.ops.kda.gluon.state import kda_state_fwd_gluon as state_pass
        from linattn.ops.kda.gluon.wy_bwd import kda_wy_bwd_gluon as wy_bwd
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous()

    def run():
        it = None
        if len(saved) == 10:
            plan = make_chunk_plan(q.shape[0], q.shape[1], cu_seqlens, 64, q.device)
            if cu_seqlens is None:               # a cached plan: a launch list may keep its tensors
                keep_for_lists(plan)
            it = KdaIntermediates(plan, *saved)
        elif len(saved) == 4:
            it = kda_recompute(q, k, v, scale, initial_state, cu_seqlens, *saved, state_v_first=state_v_first,
                               state_pass=state_pass)
        return chunk_kda_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, gate, lower_bound,
                             beta_sigmoid, neg_eigval, do, dht, state_v_first=state_v_first, saved=it,
                             state_bwd=state_bwd, wy_bwd=wy_bwd)
    grads = eager.bwd_eager(run, q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, gate, lower_bound,
                            beta_sigmoid, neg_eigval, state_v_first, do, dht, saved, gluon_state)
    # a gradient that does not exist comes back as an empty [0] tensor (optional outputs are not allowed)
    return tuple(t if t is not None else q.new_empty(0, dtype=torch.float32) for t in grads)


@_chunk_kda_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, gate, lower_bound, beta_sigmoid,
      neg_eigval, state_v_first, do, dht, saved, gluon_state=False):
    empty0 = q.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta),
            torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else empty0,
            torch.empty_like(A_log) if gate and A_log is not None else empty0,
            torch.empty_like(dt_bias) if gate and dt_bias is not None else empty0)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, gate, lower_bound,
     beta_sigmoid, neg_eigval, state_v_first, save, intra) = inputs
    kept = output[2:6] if save == SAVE_STAGE2A else output[2:] if save == SAVE_ALL else ()
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *kept)
    ctx.args = (scale, gate, lower_bound, beta_sigmoid, neg_eigval, state_v_first, output_final_state)
    ctx.gluon_state = intra == "gluon"
    # outputs that no loss reaches (the kept intermediates always, o or the final state sometimes) get None in the
    # backward instead of zero-filled gradients: at B1 T32768 H32 those fills wrote ~0.8 GB per backward
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht, *_):
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *saved = ctx.saved_tensors
    scale, gate, lower_bound, beta_sigmoid, neg_eigval, state_v_first, output_final_state = ctx.args
    use_dht = output_final_state and dht is not None and dht.numel() > 0
    if do is None:                                   # only the final state reaches the loss
        do = v.new_zeros(v.shape)
    dq, dk, dv, dg, dbeta, dh0, dA, dbias = _chunk_kda_bwd(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, gate, lower_bound, beta_sigmoid,
        neg_eigval, state_v_first, do, dht if use_dht else None, saved, ctx.gluon_state)
    return (dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None,
            dA if A_log is not None and gate else None, dbias if dt_bias is not None and gate else None,
            None, None, None, None, None, None, None)


_chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)


def _triton_supports(q=None, **_) -> Tuple[bool, str]:
    if q.device.type == "cpu" and not settings.interpret:
        return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton path"
    if q.device.type not in ("cpu", "cuda"):
        return False, f"device {q.device.type} is not supported by the Triton path"
    return True, ""


def _direct(intra: str):
    """A backend's direct path for a repeat plain eager call (Backend.direct): the replay of the launch list its
    no-autograd forward on intra's stages kept (kda/eager.py), or None where that call took another path (autograd, a
    traced call, CUDA-graph capture, the gluon backend's Triton stages 2b-4) or left no list."""
    def direct(q, k, v, g, beta, scale, initial_state, output_final_state):
        from linattn.ops.kda import eager
        if not eager_without_autograd(q, k, v, g, beta, initial_state) or not eager.listed(q, v, None, False, intra):
            return None
        return eager.eager_direct(q, k, v, g, beta, scale, initial_state, output_final_state, intra)
    return direct


def _triton_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, gate,
                 lower_bound, beta_sigmoid, neg_eigval, state_v_first, disable_recompute=False, intra="triton"):
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, gate,
            lower_bound, beta_sigmoid, neg_eigval, state_v_first)
    if eager_without_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias):
        from linattn.ops.kda import eager
        if eager.listed(q, v, cu_seqlens, state_v_first, intra):
            return eager.fwd_eager(q, k, v, g, beta, scale, initial_state, output_final_state, A_log, dt_bias, gate,
                                   lower_bound, beta_sigmoid, neg_eigval, state_v_first=state_v_first, intra=intra)
        from linattn.ops.kda.triton.forward import chunk_kda_fwd
        return chunk_kda_fwd(*args[:-1], state_v_first=state_v_first, intra=intra)
    grad = records_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias)
    save = (SAVE_ALL if disable_recompute else SAVE_STAGE2A) if grad else SAVE_NONE
    o, final = _chunk_kda_fwd(*args, save, intra)[:2]
    return o, (final if output_final_state else None)


def _gluon_supports(q=None, **_) -> Tuple[bool, str]:
    from linattn.ops.kda.gluon.intra import kda_intra_gluon_supported
    from linattn.runtime.device import hopper_gluon_ready
    ok, reason = hopper_gluon_ready(q, "the Gluon KDA stage 2a")
    if not ok:
        return False, reason
    return kda_intra_gluon_supported(q)


def _gluon_impl(*args, **kwargs):
    """The Triton path's launcher with the Gluon stage 2a (and, where the shapes fit, the fused Gluon stages 2b-4),
    with autograd too; disable_recompute's forward (W, h and Vnew kept) runs the Triton stages."""
    return _triton_impl(*args, **kwargs, intra="gluon")


def _reference_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, gate,
                    lower_bound, beta_sigmoid, neg_eigval, state_v_first, disable_recompute=False):
    if gate:
        g = kda_gate(g, None if gate == "lower_bound_no_a" else A_log, dt_bias,
                     lower_bound if gate.startswith("lower_bound") else None)
    if beta_sigmoid:
        beta = torch.sigmoid(beta.float() if beta.dtype != torch.float64 else beta) * (2 if neg_eigval else 1)
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    o, final = naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return o, (final.transpose(-1, -2).contiguous() if state_v_first and final is not None else final)


_backends.register("triton", _triton_impl, _triton_supports, priority=10, direct=_direct("triton"))
_backends.register("reference", _reference_impl, lambda **_: (True, ""), priority=100, auto=False)


def _gluon_auto_filter(q=None, k=None, v=None, g=None, beta=None, initial_state=None, A_log=None, dt_bias=None,
                       disable_recompute=False, **_) -> Tuple[bool, str]:
    """auto leaves disable_recompute's autograd forward to the Triton backend: it keeps W, h and Vnew, which only
    the Triton stages form, so that is what runs and what auto names."""
    if disable_recompute and records_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return False, "disable_recompute's autograd forward keeps W, h and Vnew, which the Triton stages form"
    return True, ""


_backends.register("gluon", _gluon_impl, _gluon_supports, priority=5, auto_filter=_gluon_auto_filter,
                   direct=_direct("gluon"))


def _not_yet(name: str):
    raise NotImplementedError(f"{OP}: {name} is not supported yet by linattn's chunked KDA (only its default)")


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
              disable_recompute: bool = False, return_intermediate_states: bool = False, state_v_first: bool = False,
              cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_cpu: Optional[torch.Tensor] = None,
              cp_context=None, use_graph: bool = False, max_num_seqs: Optional[int] = None, *,
              A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, chunk_size: int = 64,
              chunk_indices: Optional[torch.Tensor] = None, transpose_state_layout: Optional[bool] = None,
              backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention, chunked, with FLA 0.6's signature (fla.ops.kda.chunk_kda: its parameters in its order
    and with its defaults, its **kwargs as keywords), then linattn's `backend`, keyword-only.

    q, k [B, T, H, K]; v [B, T, HV, V] (one dtype: bf16, fp16 or fp32; GVA: value head j reads q/k head
    j // (HV // H)); g [B, T, HV, K]: the log decay per key channel (finite, <= 0), or with use_gate_in_kernel the
    raw input of FLA's KDA gate, -exp(A_log) * softplus(g + dt_bias) (A_log [HV], dt_bias [HV * K] optional), or
    with lower_bound (< 0) lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (A_log optional there: then
    lower_bound * sigmoid(g + dt_bias)); beta [B, T, HV] (a logit with use_beta_sigmoid_in_kernel, 2 sigmoid(beta)
    with allow_neg_eigval too). scale: default K ** -0.5. initial_state [N, HV, K, V] (fp32 math); output_final_state
    returns the fp32 state after the last token. state_v_first: both states [N, HV, V, K] (FLA's V-first layout;
    transpose_state_layout is its deprecated name). cu_seqlens [N + 1]: packed sequences, B = 1. use_qk_l2norm_in_kernel:
    q and k L2-normalised along K first (eps 1e-6). Values of CPU tensors are checked (g, beta); on a GPU they are the
    caller's contract (LINATTN_CHECK_INPUTS=1 checks them).

    Accepted without effect on the result: safe_gate (FLA's faster path for gates bounded by lower_bound; FLA's
    argument checks are kept: with use_gate_in_kernel it needs lower_bound in [-5, 0)), lower_bound without
    use_gate_in_kernel (there FLA's promise that g >= lower_bound; linattn's kernels need no bound), cu_seqlens_cpu
    and chunk_indices (FLA's varlen metadata; linattn builds its own). disable_recompute (as FLA): the autograd
    forward keeps every intermediate the backward reads (W, h, Vnew, the decayed keys and queries besides stage 2a's
    gcum, Tinv and Aqk), so the backward recomputes nothing; the kept bytes per token and value head go from ~900 to
    ~2400 at K = V = 128 in bf16.
    cp_context: context parallelism (linattn.distributed.build_cp_context; docs/context-parallel.md), as for
    chunk_gated_delta_rule: this rank's T / W tokens of the packed stream, every option above included.
    return_intermediate_states (inference only: no input may require grad while grad is on, as FLA asks for
    torch.inference_mode()): a third item h, the state at the start of every 64-token chunk in q's dtype, [B, NT, HV,
    K, V] ([.., V, K] with state_v_first), NT = ceil(T / 64); with cu_seqlens [1, NT, HV, K, V] over every sequence's
    chunks in order (NT from cu_seqlens_cpu when given, else one host read of cu_seqlens, as FLA).
    use_graph, max_num_seqs: FLA's CUDA-graph mode for varlen calls (cu_seqlens padded with zero-length tail
    sequences to max_num_seqs + 1 entries, states [max_num_seqs, ...]); linattn's chunk plan is built on the device
    from shapes alone, so every call is capture-safe and use_graph changes nothing but the max_num_seqs check.
    chunk_size: FLA's 32 or 64, both computed in 64-token chunks (the same result up to rounding; ValueError for
    other values, and for 32 with return_intermediate_states, whose states are per chunk).
    backend: "auto" (on Hopper "gluon" for bf16 with K = 64 or 128 unless disable_recompute under autograd, else
        "triton"), "triton", "gluon" (KDA's Gluon stage 2a, then at K = V = 128 with K-first states its fused Gluon
        stages 2b-4; the backward is Triton's, from the Gluon stage 2a's saved outputs; disable_recompute's forward
        under autograd runs the Triton stages) or "reference".

    Returns (o [B, T, HV, V] in v's dtype, final_state or None). Differentiable in q, k, v, g, beta,
    initial_state, and with the gate in the kernel A_log and dt_bias (the gradient of the final state flows in);
    each gradient comes back in its input's dtype.
    """
    key = b = None
    if cp_context is None and transpose_state_layout is None and not return_intermediate_states and \
            type(chunk_size) is int and (lower_bound is None or type(lower_bound) in (int, float)) and \
            (max_num_seqs is None or type(max_num_seqs) is int) and call_memo.memo_applies(q):
        key = call_memo.call_key(backend, (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias), scale, None,
                                 (not output_final_state, not use_qk_l2norm_in_kernel, not use_gate_in_kernel,
                                  not use_beta_sigmoid_in_kernel, not allow_neg_eigval, not safe_gate, lower_bound,
                                  not disable_recompute, not state_v_first, not use_graph, max_num_seqs, chunk_size,
                                  capturing(q)))
        if key is not None:
            out = call_memo.run_direct(_DIRECT, key, (q, k, v, g, beta, initial_state))
            if out is not None:
                return out
            b = _CHECKED.get(key)
    if b is None:
        state_v_first = fla_state_v_first(OP, state_v_first, transpose_state_layout)
        if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
            raise ValueError(f"{OP}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA)")
        check_chunk_size(OP, chunk_size, (32, 64))
        if return_intermediate_states and chunk_size != 64:
            raise ValueError(f"{OP}: return_intermediate_states gives the states of linattn's 64-token chunks; "
                             f"chunk_size={chunk_size} would ask for others (pass 64 or leave it out)")
        if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"{OP}: safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0) (as in "
                             f"FLA), got {lower_bound!r}")
        if use_graph and cu_seqlens is not None and max_num_seqs is not None and \
                cu_seqlens.shape[0] - 1 != max_num_seqs:
            raise ValueError(f"{OP}: with use_graph, cu_seqlens must be padded with zero-length tail sequences to "
                             f"max_num_seqs + 1 = {max_num_seqs + 1} entries, got {cu_seqlens.shape[0]} (as in FLA)")
        if cp_context is not None:
            if return_intermediate_states:
                _not_yet("return_intermediate_states with cp_context")
            return _context_parallel(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     use_qk_l2norm_in_kernel, cu_seqlens, cp_context, backend, use_gate_in_kernel,
                                     A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                     state_v_first)
        dims = check_gdn_inputs(q, k, v, None, beta, initial_state, cu_seqlens, op=OP, gate_optional=True,
                                state_v_first=state_v_first)
        check_channel_decay("g", g, dims, q, op=OP, log_decay=not use_gate_in_kernel)
        check_kda_gate_args(OP, dims, q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
        if return_intermediate_states:
            scale = dims["K"] ** -0.5 if scale is None else scale
            return _with_intermediate_states(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                             allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu,
                                             A_log, dt_bias, backend)
        b = _backends.select(backend, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                             cu_seqlens=cu_seqlens, output_final_state=output_final_state, A_log=A_log,
                             dt_bias=dt_bias, disable_recompute=bool(disable_recompute))
        if key is not None:
            call_memo.remember(_CHECKED, key, b)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    gate = gate_mode(use_gate_in_kernel, A_log, lower_bound) if use_gate_in_kernel else ""
    lb = float(lower_bound) if lower_bound is not None else 0.0
    if dt_bias is not None:
        dt_bias = dt_bias.reshape(-1)
    if b.name == "reference":
        return b.impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, A_log, dt_bias, gate,
                      lb, bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), state_v_first)
    given = (q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    A_log = None if A_log is None else A_log.contiguous()
    dt_bias = None if dt_bias is None else dt_bias.contiguous()
    out = b.impl(q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens, A_log, dt_bias,
                 gate, lb, bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), state_v_first,
                 bool(disable_recompute))
    if not (gate or use_beta_sigmoid_in_kernel or state_v_first or use_qk_l2norm_in_kernel) and cu_seqlens is None \
            and A_log is None and dt_bias is None:
        call_memo.keep_direct(_DIRECT, key, b, given, (q, k, v, g, beta, initial_state), scale, output_final_state)
    return out


# Calls whose checks passed, by signature (call_memo.call_key), with the backend chosen: a repeat plain eager call on
# CUDA tensors skips the checks and the choice.
_CHECKED: dict = {}
# Per signature, a backend's direct path (Backend.direct) for a repeat plain eager call on the caller's own tensors
# (no gate or beta option, no cu_seqlens, no in-kernel l2norm, K-first states): the backend's launch-list replay
# (kda/eager.py). A direct path that declines (None) sends the call down the full path.
_DIRECT: dict = {}



def _kernel_inputs(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                   lower_bound):
    """The Triton kernels' inputs of the CP and intermediate-states calls: q and k L2-normalised where asked, every
    tensor contiguous, the initial state fp32, the gate mode string, A_log (only with the gate) and dt_bias flat."""
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    gate = gate_mode(use_gate_in_kernel, A_log, lower_bound) if use_gate_in_kernel else ""
    A_log = None if A_log is None or not use_gate_in_kernel else A_log.contiguous()
    dt_bias = None if dt_bias is None else dt_bias.reshape(-1).contiguous()
    return q, k, v, g, beta, initial_state, A_log, dt_bias, gate


def _context_parallel(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                      cu_seqlens, cp, backend, use_gate_in_kernel, A_log, dt_bias, lower_bound, beta_sigmoid,
                      neg_eigval, state_v_first):
    """The cp_context call: checks against the context, then linattn/distributed/chunk.py."""
    from linattn.distributed.chunk import cp_chunk_kda
    from linattn.distributed.context import check_cp_call
    check_cp_call(OP, q, cu_seqlens, cp, backend, _triton_supports)
    dims = check_gdn_inputs(q, k, v, None, beta, initial_state, cp.cu_seqlens, op=OP, gate_optional=True,
                            num_states=cp.num_seqs_global, state_v_first=state_v_first)
    check_channel_decay("g", g, dims, q, op=OP, log_decay=not use_gate_in_kernel)
    check_kda_gate_args(OP, dims, q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    if scale is None:
        scale = dims["K"] ** -0.5
    q, k, v, g, beta, initial_state, A_log, dt_bias, gate = _kernel_inputs(
        q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    return cp_chunk_kda(q, k, v, g, beta, float(scale), initial_state, output_final_state, cp, A_log, dt_bias, gate,
                        float(lower_bound) if lower_bound is not None else 0.0, bool(beta_sigmoid), bool(neg_eigval),
                        state_v_first)


def _with_intermediate_states(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                              use_gate_in_kernel, beta_sigmoid, neg_eigval, lower_bound, state_v_first, cu_seqlens,
                              cu_seqlens_cpu, A_log, dt_bias, backend):
    """chunk_kda with return_intermediate_states=True on checked inputs: (o, final_state or None, h)."""
    if records_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias):
        raise ValueError(f"{OP}: return_intermediate_states=True is for inference (no autograd): call it under "
                         f"torch.inference_mode() or torch.no_grad(), as FLA requires")
    if backend not in ("auto", "triton"):
        raise NotImplementedError(f"{OP}: return_intermediate_states runs the Triton kernels; backend={backend!r} "
                                  f"is not supported")
    ok, why = _triton_supports(q=q)
    if not ok:
        raise NotImplementedError(f"{OP}: return_intermediate_states runs the Triton kernels: {why}")
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    q, k, v, g, beta, initial_state, A_log, dt_bias, gate = _kernel_inputs(
        q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    o, final, h = chunk_kda_fwd(q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens,
                                A_log, dt_bias, gate, float(lower_bound) if lower_bound is not None else 0.0,
                                bool(beta_sigmoid), bool(neg_eigval), state_v_first=state_v_first, return_h=True)
    B, T = q.shape[:2]
    if cu_seqlens is None:
        h = h.view(B, -(-T // 64), *h.shape[1:])
    else:
        offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).to("cpu", torch.int64)
        nt = int(((offsets[1:] - offsets[:-1]).clamp_min(0) + 63).div(64, rounding_mode="floor").sum())
        h = h[:nt].unsqueeze(0)
    if state_v_first:
        h = h.transpose(-1, -2).contiguous()
    return o, final, h
