"""Gated DeltaNet decode for serving: `fused_recurrent_gated_delta_rule`.

Stack (DESIGN.md, "One op, one stack"): Triton kernels (triton/decode_kernels.py) -> launcher
(triton/fused_recurrent.py) -> two torch custom ops (`linattn::fused_recurrent_gdn`, out of place, and
`linattn::fused_recurrent_gdn_inplace`, which declares that it mutates the state pool; `mutates_args` is static, hence
two ops) with fake implementations, so the op works under torch.compile(fullgraph=True) and inside CUDA graphs ->
backends in the registry -> the public function below. `fused_recurrent_reference` is the same function in plain PyTorch
(the "reference" backend). Forward only, as FLA's: inputs may require grad, and the outputs' backward raises
NotImplementedError (forward_only).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from linattn.backends import op_backends
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.gated_delta_rule.triton.fused_recurrent import direct_decode, fused_recurrent_gdn_fwd
from linattn.ops.gated_delta_rule.validation import (_fail, check_channel_decay, check_fla_decode_options,
                                                     check_gdn_inputs, fla_state_v_first)
from linattn.ops.kda.reference import kda_gate, naive_recurrent_kda
from linattn.runtime import call_memo
from linattn.runtime.settings import settings

OP = "fused_recurrent_gated_delta_rule"
STATE_DTYPES = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- validation
def requires_grad(**tensors) -> bool:
    """With grad mode on, whether an input requires grad: the call then runs forward only (forward_only)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors.values())


class ForwardOnly(torch.autograd.Function):
    """Outputs of a decode op called on inputs that require grad, as FLA's fused_recurrent returns them: they
    require grad, and their backward raises (decode has no backward). The op itself ran under no_grad."""

    @staticmethod
    def forward(ctx, op, outs, *grad_inputs):
        ctx.op = op
        return tuple(t.clone() for t in outs)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(f"{ctx.op} has no backward (forward only, for inference); train with the chunked "
                                  "op (chunk_gated_delta_rule, chunk_kda)")


def forward_only(op: str, run, new_final: bool, tensors: dict):
    """FLA's decode functions take inputs that require grad and fail only in backward; so does linattn's: `run()`
    computes the call under no_grad, and o (and the final state when it is a new tensor, not the caller's pool) are
    returned attached to a node whose backward raises NotImplementedError naming the op."""
    with torch.no_grad():
        o, final = run()
    grad_inputs = [t for t in tensors.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    if new_final and final is not None:
        return ForwardOnly.apply(op, (o, final), *grad_inputs)
    return ForwardOnly.apply(op, (o,), *grad_inputs)[0], final


def _num_sequences(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _pad_id(pad_slot_id) -> int:
    """The kernels' PAD_SLOT: pad_slot_id when it is >= 0, else -1 (negative indices are padding in any case)."""
    return -1 if pad_slot_id is None or pad_slot_id < 0 else int(pad_slot_id)


def _check_state(name, t, lead, dims, state_v_first, q):
    """A state tensor [lead..., HV, K, V] ([.., HV, V, K] with state_v_first) on q's device, float."""
    HV, K, V = dims["HV"], dims["K"], dims["V"]
    tail = (HV, V, K) if state_v_first else (HV, K, V)
    form = "[.., HV, V, K] (state_v_first)" if state_v_first else "[.., HV, K, V]"
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[1:]) != tail or \
            (lead is not None and t.shape[0] != lead) or t.shape[0] < 1:
        _fail(f"{OP}: {name} must be {form} with (HV, K, V) = {(HV, K, V)} and "
              f"{'N = ' + str(lead) if lead is not None else 'num_slots >= 1'} rows, "
              f"got {tuple(getattr(t, 'shape', ()))}")
    if t.device != q.device:
        _fail(f"{OP}: {name} is on {t.device} but q is on {q.device}")
    if not t.is_floating_point():
        _fail(f"{OP}: {name} must be a float tensor, got {t.dtype}")


def _check_int_tensor(name, t, q):
    if not isinstance(t, torch.Tensor):
        _fail(f"{OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        _fail(f"{OP}: {name} must be int32 or int64, got {t.dtype}")
    if t.device != q.device:
        _fail(f"{OP}: {name} is on {t.device} but q is on {q.device}")


def check_decode_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_indices, inplace, A_log, dt_bias,
                        num_accepted_tokens=None, pad_slot_id=None, state_v_first=False):
    """The shared checks plus the decode-only ones. Reads index values only when they live on the CPU (no
    host synchronisation on a GPU; there the kernel treats out-of-range slots as padded rows)."""
    dims = check_gdn_inputs(q, k, v, g, beta, None, cu_seqlens, op=OP, gate_optional=True, mixed_qkv=True)
    N = dims["N"]
    if pad_slot_id is not None and (isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int)):
        raise TypeError(f"{OP}: pad_slot_id must be an int or None, got {type(pad_slot_id).__name__}")
    if state_indices is None:
        if num_accepted_tokens is not None:
            _fail(f"{OP}: num_accepted_tokens needs a 2-D state_indices [N, T_max] (speculative decoding)")
        if pad_slot_id is not None:
            _fail(f"{OP}: pad_slot_id names a padding index of state_indices; pass state_indices too")
        if initial_state is not None:
            _check_state("initial_state", initial_state, N, dims, state_v_first, q)
    else:
        _check_int_tensor("state_indices", state_indices, q)
        if state_indices.dim() not in (1, 2) or state_indices.shape[0] != N:
            _fail(f"{OP}: state_indices must be [N] = [{N}] (one pool slot per sequence) or [N, T_max] "
                  f"(speculative decoding), got shape {tuple(state_indices.shape)}")
        if state_indices.dim() == 2:
            cols = state_indices.shape[1]
            if cols < 1 or (cu_seqlens is None and cols < dims["T"]):
                _fail(f"{OP}: a 2-D state_indices must be [N, T_max] with T_max >= T = {dims['T']} (a slot for "
                      f"the state after each token), got shape {tuple(state_indices.shape)}")
        if num_accepted_tokens is not None:
            if state_indices.dim() != 2:
                _fail(f"{OP}: num_accepted_tokens needs a 2-D state_indices [N, T_max] (speculative decoding), "
                      f"got state_indices of shape {tuple(state_indices.shape)}")
            _check_int_tensor("num_accepted_tokens", num_accepted_tokens, q)
            if tuple(num_accepted_tokens.shape) != (N,):
                _fail(f"{OP}: num_accepted_tokens must be [N] = [{N}], got {tuple(num_accepted_tokens.shape)}")
        if initial_state is None:
            _fail(f"{OP}: state_indices needs the state pool as initial_state [num_slots, HV, K, V]")
        _check_state("the state pool (initial_state)", initial_state, None, dims, state_v_first, q)
        if state_indices.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_index_values(state_indices, initial_state.shape[0], inplace, _pad_id(pad_slot_id),
                                num_accepted_tokens, cu_seqlens, dims["T"])
    if inplace:
        if initial_state is None:
            _fail(f"{OP}: inplace=True needs initial_state (the state pool to update)")
        if not initial_state.is_contiguous():
            _fail(f"{OP}: inplace=True needs a contiguous initial_state (the kernel writes it in place)")
    if dt_bias is not None and A_log is None:
        _fail(f"{OP}: dt_bias is only used by the fused gate; pass A_log too")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (dims["HV"],):
            _fail(f"{OP}: {name} must be a tensor [HV] = [{dims['HV']}], got {tuple(getattr(t, 'shape', ()))}")
        if not t.is_floating_point():
            _fail(f"{OP}: {name} must be a float tensor, got {t.dtype}")
        if t.device != q.device:
            _fail(f"{OP}: {name} is on {t.device} but q is on {q.device}")
    if A_log is not None and g is None:
        _fail(f"{OP}: the fused gate (A_log) needs the raw gate input g")
    return dims


def _check_index_values(state_indices, num_slots, inplace, pad, num_accepted_tokens, cu_seqlens, T):
    """CPU tensors only. The entries the kernel reads (every row's read slot) and writes (a live row's slot per
    token, 2-D) must be padding or in [0, num_slots); num_accepted_tokens in [1, T_max]; each sequence at most
    T_max tokens; with inplace=True no slot touched by two live rows."""
    idx = state_indices.to(torch.int64)
    is_pad = (idx < 0) | (idx == pad) if pad >= 0 else idx < 0
    if idx.dim() == 1:
        read, read_pad, used = idx, is_pad, ~is_pad
    else:
        n, cols = idx.shape
        lengths = (cu_seqlens.to("cpu", torch.int64).diff() if cu_seqlens is not None
                   else torch.full((n,), T, dtype=torch.int64))
        if bool((lengths > cols).any()):
            _fail(f"{OP}: cu_seqlens has a sequence of {int(lengths.max())} tokens, more than the {cols} columns "
                  f"of state_indices (one slot per token)")
        col = torch.zeros(n, dtype=torch.int64)
        if num_accepted_tokens is not None:
            col = num_accepted_tokens.to(torch.int64) - 1
            if bool(((col < 0) | (col >= cols)).any()):
                _fail(f"{OP}: num_accepted_tokens must be in [1, T_max = {cols}] (the state is read from column "
                      f"num_accepted_tokens - 1 of state_indices), got {(col + 1).tolist()[:8]}")
        read = idx.gather(1, col[:, None])[:, 0]
        read_pad = is_pad.gather(1, col[:, None])[:, 0]
        pos = torch.arange(cols)[None, :]
        written = (pos < lengths[:, None]) if inplace else torch.zeros_like(is_pad)
        used = ((pos == col[:, None]) | written) & ~is_pad & ~read_pad[:, None]
    bad_read, bad_used = ~read_pad & (read >= num_slots), used & (idx >= num_slots)
    if bool(bad_read.any()) or bool(bad_used.any()):
        vals = torch.cat([read[bad_read], idx[bad_used]]).unique()
        _fail(f"{OP}: state_indices {vals.tolist()[:8]} out of range for a pool of {num_slots} slots "
              f"(use a negative index{'' if pad < 0 else ' or pad_slot_id'} for a padded row)")
    if inplace:
        if idx.dim() == 1:
            live = idx[used]
        else:                               # each live row's distinct slots; no slot may appear in two rows
            live = torch.cat([idx[r][used[r]].unique() for r in range(idx.shape[0])])
        if live.unique().numel() != live.numel():
            _fail(f"{OP}: state_indices name a slot twice; with inplace=True two sequences would write one slot")


# ------------------------------------------------------------------------------------------------ reference
def fused_recurrent_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                              cu_seqlens=None, use_qk_l2norm_in_kernel=False, state_indices=None, inplace=False,
                              A_log=None, dt_bias=None, beta_sigmoid=False, num_accepted_tokens=None,
                              pad_slot_id=None, state_v_first=False, allow_neg_eigval=False, gk=None, gk_mode="",
                              lower_bound=0.0):
    """The op in plain PyTorch: gating formulas, pool gather/scatter, padding and the speculative-decoding slots done
    explicitly, then `naive_recurrent` (with gk: the per-key-channel recurrence of KDA's reference, decay g + gk per key
    channel; gk_mode as the kernel's, the KDA gates by linattn.ops.kda.reference.kda_gate). Computes in fp32 (fp64 when
    q is fp64); the state is kept in that precision over the T tokens of the call and rounded to the pool's dtype only
    when written back, as the kernel does. An out-of-place final state comes back in the compute dtype (fp32, as
    FLA)."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    if g is None:
        g_eff = torch.zeros(B, T, HV, dtype=dt, device=q.device)
    elif A_log is not None:
        x = g.to(dt) + (0 if dt_bias is None else dt_bias.to(dt))
        g_eff = -torch.exp(A_log.to(dt)) * F.softplus(x)
    else:
        g_eff = g.to(dt)
    beta_eff = beta.to(dt)
    if beta_sigmoid:
        beta_eff = torch.sigmoid(beta_eff) * (2 if allow_neg_eigval else 1)
    layout = (lambda s: s.transpose(-1, -2)) if state_v_first else (lambda s: s)     # stored <-> [K, V]
    pad = _pad_id(pad_slot_id)
    N = state_indices.shape[0] if state_indices is not None else _num_sequences(q, cu_seqlens)
    valid = [True] * N
    h0 = None
    spec = state_indices is not None and state_indices.dim() == 2
    if state_indices is not None:
        pool = initial_state
        rows = state_indices.tolist()
        is_slot = lambda s: 0 <= s < pool.shape[0] and s != pad        # noqa: E731
        if spec:
            cols = [0] * N if num_accepted_tokens is None else [int(a) - 1 for a in num_accepted_tokens.tolist()]
            slots = [r[c] if 0 <= c < len(r) else -1 for r, c in zip(rows, cols)]
        else:
            slots = [int(i) for i in rows]
        valid = [is_slot(s) for s in slots]
        h0 = torch.stack([layout(pool[s]).to(dt) if ok else torch.zeros_like(layout(pool[0]), dtype=dt)
                          for s, ok in zip(slots, valid)])
    elif initial_state is not None:
        h0 = layout(initial_state).to(dt)
    if gk is None:
        o, ht, states = naive_recurrent(q.to(dt), k.to(dt), v.to(dt), g_eff, beta_eff, scale, h0, True, cu_seqlens,
                                        use_qk_l2norm_in_kernel, output_token_states=True)
    else:
        gk_eff = gk.to(dt) if gk_mode in ("", "log") else kda_gate(
            gk.to(dt), None if gk_mode == "lower_bound_no_a" else A_log,
            dt_bias, lower_bound if gk_mode.startswith("lower_bound") else None)
        o, ht, states = naive_recurrent_kda(q.to(dt), k.to(dt), v.to(dt), g_eff[..., None] + gk_eff, beta_eff, scale,
                                            h0, True, cu_seqlens, use_qk_l2norm_in_kernel, output_token_states=True)
    o = o.clone()
    if cu_seqlens is None:
        spans = [(n, 0, T) for n in range(N)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1]) for n in range(N)]
    for n, ok in enumerate(valid):
        if not ok:                           # padded row: zero output, zero out-of-place state, pool untouched
            b, s, e = spans[n]
            o[b, s:e] = 0
            ht[n] = 0
    o = o.to(v.dtype)
    if inplace:
        if state_indices is None:
            initial_state.copy_(layout(ht).to(initial_state.dtype))
        elif spec:                           # the state after token t into slot state_indices[n, t]
            for n, ok in enumerate(valid):
                for t in range(states[n].shape[0] if ok else 0):
                    if t < len(rows[n]) and is_slot(rows[n][t]):
                        initial_state[rows[n][t]] = layout(states[n][t]).to(initial_state.dtype)
        else:
            for n, (s, ok) in enumerate(zip(slots, valid)):
                if ok:
                    initial_state[s] = layout(ht[n]).to(initial_state.dtype)
        return o, initial_state
    if not output_final_state:
        return o, None
    return o, layout(ht).contiguous()


# ----------------------------------------------------------------------------------------------- custom ops
def _fake_outputs(q, v, cu_seqlens, state_indices, output_final_state, state_v_first):
    B, _, HV, V = v.shape
    K = q.shape[-1]
    N = state_indices.shape[0] if state_indices is not None else (
        B if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    ht = q.new_empty(*shape, dtype=torch.float32) if output_final_state else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(v), ht


@torch.library.custom_op("linattn::fused_recurrent_gdn", mutates_args=())
def _gdn_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                   beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                   cu_seqlens: Optional[torch.Tensor], state_indices: Optional[torch.Tensor],
                   A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool,
                   beta_sigmoid: bool, output_final_state: bool, num_accepted_tokens: Optional[torch.Tensor] = None,
                   pad_slot_id: int = -1, state_v_first: bool = False,
                   allow_neg_eigval: bool = False, gk: Optional[torch.Tensor] = None, gk_mode: str = "",
                   lower_bound: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    o, ht = fused_recurrent_gdn_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_indices, A_log,
                                    dt_bias, use_qk_l2norm, beta_sigmoid, output_final_state, inplace=False,
                                    num_accepted_tokens=num_accepted_tokens, pad_slot_id=pad_slot_id,
                                    state_v_first=state_v_first, allow_neg_eigval=allow_neg_eigval, gk=gk,
                                    gk_mode=gk_mode, lower_bound=lower_bound)
    if ht is None:     # a custom op returns tensors only: an empty one stands for "no final state"
        ht = q.new_empty(0, dtype=torch.float32)
    return o, ht


@_gdn_decode_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_indices, A_log, dt_bias, use_qk_l2norm,
      beta_sigmoid, output_final_state, num_accepted_tokens=None, pad_slot_id=-1, state_v_first=False,
      allow_neg_eigval=False, gk=None, gk_mode="", lower_bound=0.0):
    return _fake_outputs(q, v, cu_seqlens, state_indices, output_final_state, state_v_first)


@torch.library.custom_op("linattn::fused_recurrent_gdn_inplace", mutates_args=("initial_state",))
def _gdn_decode_inplace_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                           beta: torch.Tensor, scale: float, initial_state: torch.Tensor,
                           cu_seqlens: Optional[torch.Tensor], state_indices: Optional[torch.Tensor],
                           A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool,
                           beta_sigmoid: bool, num_accepted_tokens: Optional[torch.Tensor] = None,
                           pad_slot_id: int = -1, state_v_first: bool = False,
                           allow_neg_eigval: bool = False, gk: Optional[torch.Tensor] = None, gk_mode: str = "",
                           lower_bound: float = 0.0) -> torch.Tensor:
    o, _ = fused_recurrent_gdn_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_indices, A_log,
                                   dt_bias, use_qk_l2norm, beta_sigmoid, output_final_state=False, inplace=True,
                                   num_accepted_tokens=num_accepted_tokens, pad_slot_id=pad_slot_id,
                                   state_v_first=state_v_first, allow_neg_eigval=allow_neg_eigval, gk=gk,
                                   gk_mode=gk_mode, lower_bound=lower_bound)
    return o


@_gdn_decode_inplace_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_indices, A_log, dt_bias, use_qk_l2norm,
      beta_sigmoid, num_accepted_tokens=None, pad_slot_id=-1, state_v_first=False, allow_neg_eigval=False,
      gk=None, gk_mode="", lower_bound=0.0):
    return torch.empty_like(v)


# ------------------------------------------------------------------------------------------------- backends
def _eager(q) -> bool:
    """A plain eager call: not traced by torch.compile / export, and q a plain tensor (not a fake, functional or
    other subclass tensor, which need the custom op's fake implementation)."""
    return type(q) is torch.Tensor and not torch.compiler.is_compiling()


def _triton_impl(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                 use_qk_l2norm_in_kernel=False, state_indices=None, inplace=False, A_log=None, dt_bias=None,
                 beta_sigmoid=False, num_accepted_tokens=None, pad_slot_id=None, state_v_first=False,
                 allow_neg_eigval=False, gk=None, gk_mode="", lower_bound=0.0, record=None):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    pad = _pad_id(pad_slot_id)
    gk_mode = (gk_mode or "log") if gk is not None else ""      # GDN's gk: a log decay
    lower_bound = float(lower_bound or 0.0)
    if _eager(q):
        # An eager call on plain tensors runs the launcher directly: the custom op's dispatch costs more host time
        # than the batch-1 kernel (~30 us against ~3.5 us on an H200). Traced calls keep the custom ops.
        o, ht = fused_recurrent_gdn_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_indices, A_log,
                                        dt_bias, use_qk_l2norm_in_kernel, beta_sigmoid, output_final_state, inplace,
                                        num_accepted_tokens=num_accepted_tokens, pad_slot_id=pad,
                                        state_v_first=state_v_first, allow_neg_eigval=allow_neg_eigval, gk=gk,
                                        gk_mode=gk_mode, lower_bound=lower_bound, record=record)
        if inplace:
            if not initial_state.is_inference():              # inference tensors carry no version counter
                torch.autograd.graph.increment_version(initial_state)     # as the mutating custom op would
            return o, initial_state
        return o, ht
    if inplace:
        o = torch.ops.linattn.fused_recurrent_gdn_inplace(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                          state_indices, A_log, dt_bias,
                                                          use_qk_l2norm_in_kernel, beta_sigmoid, num_accepted_tokens,
                                                          pad, state_v_first, allow_neg_eigval, gk, gk_mode,
                                                          lower_bound)
        return o, initial_state
    o, ht = torch.ops.linattn.fused_recurrent_gdn(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                  state_indices, A_log, dt_bias, use_qk_l2norm_in_kernel,
                                                  beta_sigmoid, output_final_state, num_accepted_tokens, pad,
                                                  state_v_first, allow_neg_eigval, gk, gk_mode, lower_bound)
    return o, ht if output_final_state else None


def _triton_supports(q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, gk=None,
                     **_) -> Tuple[bool, str]:
    if q.device.type == "cpu" and not settings.interpret:
        return False, "CPU tensors need TRITON_INTERPRET=1"
    if q.device.type not in ("cpu", "cuda"):
        return False, f"device {q.device.type} is not supported"
    if q.dtype == torch.float64:
        return False, "fp64 q/k/v: use the reference backend"
    if initial_state is not None and initial_state.dtype not in STATE_DTYPES:
        return False, f"state dtype {initial_state.dtype}: the kernel keeps states in fp32 or bf16"
    for name, t in (("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias), ("gk", gk)):
        if t is not None and t.dtype == torch.float64:
            return False, f"fp64 {name}: use the reference backend"
    return True, ""


def _reference_supports(**_) -> Tuple[bool, str]:
    return True, ""


_backends = op_backends(OP)
_backends.register("triton", _triton_impl, _triton_supports, priority=10)
_backends.register("reference", fused_recurrent_reference, _reference_supports, priority=100, auto=False)


# Where `auto` hands a call to the Gluon decode: where it measured faster than the Triton kernels on an H200, on
# identical inputs (benchmarks/OPT_LOG.md, "Decode, iteration 3"): a bf16 state pool at batch 32 (23.0 vs 33.0 us)
# and 256 (162.9 vs 241.4 us; 158 against the Triton walk's 205-220 us later, "the decode pool's tile"). With an fp32
# pool the Triton kernels are faster (41.9 vs 45.5 us at batch 32; at batch 256 the persistent walk runs 93% of copy
# against the Gluon decode's 85%), and batch < 32 was not timed: those stay on Triton.
GLUON_AUTO_MIN_BATCH = 32


def _gluon_auto_filter(q=None, initial_state=None, **_) -> Tuple[bool, str]:
    if initial_state.dtype != torch.bfloat16:
        return False, (f"{initial_state.dtype} state pool: the Triton kernel measured faster (batch 256 on an "
                       f"H200: 271.2 vs 295-298 us); backend='gluon' by name")
    if q.shape[0] < GLUON_AUTO_MIN_BATCH:
        return False, (f"batch {q.shape[0]} < {GLUON_AUTO_MIN_BATCH}: the Gluon decode is timed only at batch 32 "
                       f"and 256; backend='gluon' by name")
    return True, ""


def typical_calls(device):
    """[(label, call)] for `linattn doctor`: a serving decode step (T = 1, H = HV = 32, K = V = 128, bf16 q/k/v,
    pool updated in place) at batch 256 with an fp32 and with a bf16 pool, and at batch 1 with an fp32 pool.
    Uninitialised tensors and a 2-slot pool: supports() reads shapes, dtypes, strides and alignment only."""
    dev = torch.device(device)
    H = HV = 32 if dev.type == "cuda" else 2
    K = V = 128 if dev.type == "cuda" else 32
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    out = []
    for B, sd in ((256, torch.float32), (256, torch.bfloat16), (1, torch.float32)):
        call = dict(q=e(B, 1, H, K), k=e(B, 1, H, K), v=e(B, 1, HV, V), g=e(B, 1, HV, dt=torch.float32),
                    beta=e(B, 1, HV, dt=torch.float32), initial_state=e(2, HV, K, V, dt=sd),
                    state_indices=torch.zeros(B, dtype=torch.int32, device=dev), inplace=True, cu_seqlens=None)
        out.append((f"decode step, batch {B}, {str(sd).replace('torch.', '')} pool", call))
    return out


def _register_gluon():
    """Backend "gluon" (gluon/decode.py: T = 1 pool decode on sm_90a). `auto` picks it only where it was measured
    faster (_gluon_auto_filter); by name it takes every call its supports() accepts. The module (and Gluon) is
    imported at the first supports/impl call, never at `import linattn`."""
    def supports(**call):
        from linattn.ops.gated_delta_rule.gluon import decode
        return decode.supports(**call)

    def impl(**call):
        from linattn.ops.gated_delta_rule.gluon import decode
        return decode.impl(**call)

    _backends.register("gluon", impl, supports, priority=5, auto=True, auto_filter=_gluon_auto_filter)


_register_gluon()


# --------------------------------------------------------------------------------------------- public function
def fused_recurrent_gated_delta_rule(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None,
        gk: Optional[torch.Tensor] = None, gv: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
        scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
        A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
        use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, state_v_first: bool = False,
        cu_seqlens: Optional[torch.Tensor] = None, *, transpose_state_layout: Optional[bool] = None,
        state_indices: Optional[torch.Tensor] = None, inplace: bool = False,
        num_accepted_tokens: Optional[torch.Tensor] = None, pad_slot_id: Optional[int] = None,
        beta_sigmoid: bool = False, backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet over T >= 1 new tokens per sequence from a carried state (decode, speculative decode), with
    FLA 0.6's signature: FLA's parameters in FLA's order and with FLA's defaults (a call written for
    fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule runs unchanged where linattn supports its options;
    note that FLA's order puts gk, gv before beta: pass beta by keyword), then linattn's extras, keyword-only.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head j reads q/k head j // (HV // H));
    g: [B, T, HV], the log decay (or, with the fused gate, the raw gate input); None: no decay.
    beta: [B, T, HV]; None means all ones, as in FLA (an all-ones fp32 [B, T, HV] tensor is made on the device: fp32
    is the beta dtype the AOT-built kernels take; the value 1 is exact in every dtype).
    cu_seqlens: [N + 1] int, packed sequences with B = 1; otherwise N = B sequences of T tokens.
    scale: defaults to K ** -0.5. use_qk_l2norm_in_kernel: L2-normalise q and k along K first (eps 1e-6).
    gk [B, T, HV, K]: FLA's per-key-channel log decay (<= 0), applied after g's: S <- diag(exp(gk_t)) exp(g_t) S
    (the one-tile Triton kernel; a 3-D gk, a beta passed fifth in linattn's old order, raises ValueError saying so).
    gv [B, T, HV, V] (FLA's per-value decay): not supported yet; a tensor raises NotImplementedError naming it.

    Fused gating (Qwen3-Next): use_gate_in_kernel=True with A_log [HV] (and optionally dt_bias [HV]): g is the raw
    gate input and the decay used is g_eff = -exp(A_log) * softplus(g + dt_bias), computed in the kernel (as FLA;
    without A_log or g: ValueError, as FLA). linattn's older spelling, A_log without use_gate_in_kernel, still
    selects the fused gate (FLA would ignore A_log / dt_bias there). use_beta_sigmoid_in_kernel=True (or linattn's
    beta_sigmoid=True, the same): beta is a logit and sigmoid(beta) is used, in the kernel.
    allow_neg_eigval=True (needs the beta sigmoid, else ValueError, as FLA): beta = 2 * sigmoid(beta), in (0, 2).
    q, k and v may differ in dtype (bf16, fp16, fp32 each, as FLA accepts, e.g. fp32 q/k with fp16 v): everything
    is read and computed in fp32, and o comes back in v's dtype (FLA's rule).

    States, fp32 or bf16 (read, computed in fp32, written back in the pool's dtype), laid out [.., HV, K, V], or
    [.., HV, V, K] with state_v_first=True (FLA's and vLLM's layout; transpose_state_layout is FLA's deprecated
    name of it) for initial_state, the pool and final_state alike:
    - without state_indices: initial_state is [N, HV, K, V] (or None: zeros). final_state, if output_final_state,
      is a new fp32 [N, HV, K, V] tensor whatever initial_state's dtype (FLA's rule), else None;
      with inplace=True the final states overwrite initial_state and final_state is initial_state.
    - serving mode (state_indices, keyword-only): initial_state is a pool [num_slots, HV, K, V] and state_indices
      [N] (int32/int64, on q's device) gives each sequence's slot. With inplace=True the updated states go back
      into their slots, no extra copy, and final_state is the pool; otherwise the pool is only read and
      final_state (if output_final_state) is a new fp32 [N, HV, K, V] tensor.
    - speculative decoding (vLLM's / SGLang's convention): state_indices [N, T_max] (T_max >= T; with cu_seqlens
      T_max >= each sequence's length) and num_accepted_tokens [N] (int32/int64, keyword-only, optional): sequence
      n starts from slot state_indices[n, num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens) and,
      with inplace=True, the state after its token t is written to slot state_indices[n, t] (every intermediate
      state, in place; the read slot may be among them). Out of place, final_state holds the state after each
      sequence's last token. num_accepted_tokens must be in [1, T_max].
    - padding: a negative index is a padded row, and so is pad_slot_id when given (keyword-only; vLLM passes 0,
      its null block): nothing is read or written for a padded row, its output rows are 0 and its rows of an
      out-of-place final_state are 0. With a 2-D state_indices the row is padded when the slot it reads from is;
      a padded entry among a live row's write slots skips that token's write. Indices >= num_slots and
      num_accepted_tokens outside [1, T_max] raise on the CPU; on a GPU (where checking would need a host sync)
      the kernel treats them as padding. With inplace=True no slot may be used by two live sequences.

    Returns (o [B, T, HV, V] in v's dtype, final_state).
    backend (keyword-only): "auto" (the Gluon decode for a bf16 pool at batch >= 32 on a Hopper GPU, else Triton),
    "triton", "gluon" or "reference".
    Works under torch.compile and in CUDA graphs (the Triton path is a torch custom op, host-sync free).
    Forward only, as FLA's: inputs may require grad (the op then runs under no_grad and returns o, and a new
    final_state, attached to a node whose backward raises NotImplementedError; train with chunk_gated_delta_rule).
    """
    key = None
    if call_memo.memo_applies(q) and gv is None and transpose_state_layout is None:
        key = call_memo.call_key(backend, (q, k, v, g, gk, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                           state_indices, num_accepted_tokens), scale, pad_slot_id,
                                 (not output_final_state, not use_qk_l2norm_in_kernel, not use_gate_in_kernel,
                                  not use_beta_sigmoid_in_kernel, not allow_neg_eigval, not state_v_first, not inplace,
                                  not beta_sigmoid))
        if key is not None:
            direct = _DIRECT.get(key)
            if direct is not None:
                out = direct(q, k, v, g, gk, beta, A_log, dt_bias, initial_state, cu_seqlens, state_indices,
                             num_accepted_tokens)
                if out is not None:
                    return out
    state_v_first = fla_state_v_first(OP, state_v_first, transpose_state_layout)
    beta_sigmoid = bool(beta_sigmoid or use_beta_sigmoid_in_kernel)
    check_fla_decode_options(OP, g=g, gk=gk, gv=gv, beta=beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                             beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval)
    if beta is None and isinstance(v, torch.Tensor) and v.dim() == 4:
        beta = torch.ones(v.shape[:3], dtype=torch.float32, device=v.device)
    call = dict(q=q, k=k, v=v, g=g, gk=gk, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_indices=state_indices, inplace=inplace,
                A_log=A_log, dt_bias=dt_bias, beta_sigmoid=beta_sigmoid, num_accepted_tokens=num_accepted_tokens,
                pad_slot_id=pad_slot_id, state_v_first=state_v_first, allow_neg_eigval=allow_neg_eigval)
    impl = _CHECKED.get(key) if key is not None else None
    if impl is None:
        grad_tensors = dict(q=q, k=k, v=v, g=g, gk=gk, beta=beta, initial_state=initial_state, A_log=A_log,
                            dt_bias=dt_bias)
        if requires_grad(**grad_tensors):
            return forward_only(OP, lambda: fused_recurrent_gated_delta_rule(
                q, k, v, g, gk, None, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, A_log, dt_bias, False, allow_neg_eigval, state_v_first, cu_seqlens,
                state_indices=state_indices, inplace=inplace, num_accepted_tokens=num_accepted_tokens,
                pad_slot_id=pad_slot_id, beta_sigmoid=beta_sigmoid, backend=backend), not inplace, grad_tensors)
        dims = check_decode_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_indices, inplace, A_log,
                                   dt_bias, num_accepted_tokens, pad_slot_id, state_v_first)
        if gk is not None:
            check_channel_decay("gk", gk, dims, q, op=OP, log_decay=True)
        b = _backends.select(backend, **call)
        impl = b.impl
        if key is not None and b.name == "triton":
            call_memo.remember(_CHECKED, key, impl)
    if key is None or impl is not _triton_impl:
        return impl(**call)
    return run_and_keep(_DIRECT, key, impl, call, (q, k, v, g, gk, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                                  state_indices, num_accepted_tokens))


def run_and_keep(cache: dict, key, impl, call: dict, tensors: tuple):
    """impl(**call) (a Triton decode impl taking `record`), keeping in cache[key] the direct launch of the call
    (direct_decode) when it has one; tensors: the call's tensors in CALL_TENSORS order, as the launcher took them.
    Returns impl's (o, final_state)."""
    record = []
    o, final = impl(**call, record=record)
    inplace, output_final_state = call["inplace"], call["output_final_state"]
    direct = direct_decode(record, tensors, o, None if inplace or not output_final_state else final,
                           "pool" if inplace else "final" if output_final_state else "none")
    if direct is not None:
        call_memo.remember(cache, key, direct)
    return o, final


# Calls whose checks passed and whose backend choice was Triton, by signature (call_memo.call_key): a repeat call
# skips the checks and the choice, which cost more host time than the batch-1 kernel. Only for CUDA tensors (CPU
# calls read index and gate values on the host, which a signature cannot vouch for) in plain eager calls. The Gluon
# decode is never remembered: its supports() also reads pointer alignment, which the signature leaves out. _DIRECT
# holds, per signature, the direct launch of a call that ran the Triton launcher on the caller's own tensors
# (direct_decode): a repeat call then allocates its outputs and calls the compiled kernel's `run` with no other Python
# in between.
_CHECKED: dict = {}
_DIRECT: dict = {}
