"""KDA's eager forward through per-signature launch lists (runtime/launch_list.py), on the Gluon stages and on the
Triton ones.

A plain eager fixed-length call (no cu_seqlens, not under CUDA-graph capture) makes the same launches per call
signature: on the gluon backend where the fused Gluon stages 2b-4 run, two (stage 2a, kda/gluon/intra.py; the fused
stages, kda/gluon/fused_forward.py) through the Gluon host path, without autograd or as the autograd forward's custom
op (which keeps stage 2a's outputs); on the triton backend without autograd, six (stage 2a's three kernels, W and U,
the state pass, the output) through the Triton host path. The Python around them (the chunk plan, the buffers, the
descriptors, each launch's key over its arguments) costs several times the launches' own host time. Per call
signature the first calls are recorded and later ones replay the recorded launches with their own pointers.

Not listed: the gluon backend's calls that take the Triton stages 2b-4 through its own stage 2a (K = 64,
state_v_first), and the Triton backend's autograd forward (it keeps the intermediates of KdaIntermediates).

The backward (chunk.py's custom op chunk_kda_bwd) goes through lists of its own (bwd_eager): the recompute and the
backward's launches (GVA's sums and the in-kernel gate's parameter sums included: Triton kernels), on the Triton host
path and, for the gluon backend's state passes and WY stage, the Gluon one, recorded per signature of a fixed-length
call.
"""
from __future__ import annotations

from typing import Optional

import torch

from linattn.runtime.alloc import poisoning
from linattn.runtime.host_path import current_device, hooks_active
from linattn.runtime.launch_list import SignatureLists, signature

_LISTS: dict = {}         # "gluon" / "triton": the forward's lists on those stages; "backward": the backward's


def fwd_lists(intra: str) -> SignatureLists:
    """The lists of the forward on intra's stages ("gluon" or "triton"), each kept with its host path."""
    lists = _LISTS.get(intra)
    if lists is None:
        if intra == "gluon":
            from linattn.ops.gated_delta_rule.gluon.host import host_path
        else:
            from linattn.ops.gated_delta_rule.triton.host import host_path
        lists = _LISTS[intra] = SignatureLists(host_path, current_device, hooks_active, poisoning)
    return lists


def listed(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor], state_v_first: bool,
           intra: str = "gluon") -> bool:
    """Whether an eager call (the caller ruled out tracing) takes the launch lists: fixed length, not under CUDA-graph
    capture, and on the Gluon stages the fused stages 2b-4 (kda_fused_supported)."""
    from linattn.runtime.capture import stream_capturing
    if cu_seqlens is not None or stream_capturing(q):
        return False
    if intra != "gluon":
        return True
    from linattn.ops.kda.gluon.fused_forward import kda_fused_supported
    return kda_fused_supported(q, v, state_v_first)[0]


def _key(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, A_log, dt_bias, gate: str,
         lower_bound: float, beta_sigmoid: bool, neg_eigval: bool, state_v_first: bool, save_stage2a: bool) -> tuple:
    return (tuple([signature(t) for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)]), q.device, scale,
            output_final_state, gate, lower_bound, beta_sigmoid, neg_eigval, state_v_first, save_stage2a)


def fwd_eager(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
              A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], gate: str, lower_bound: float,
              beta_sigmoid: bool, neg_eigval: bool, save_stage2a: bool = False, state_v_first: bool = False,
              intra: str = "gluon"):
    """(o, final state or None) of chunk_kda_fwd(intra=intra) for a call `listed` accepted, through the signature's
    launch list when it has one; save_stage2a (the Gluon stages' autograd forward, chunk.py's custom op): (o, final,
    (gcum, the effective beta, Tinv, Aqk)) as chunk_kda_fwd returns them."""
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    key = _key(q, k, v, g, beta, scale, initial_state, output_final_state, A_log, dt_bias, gate, lower_bound,
               beta_sigmoid, neg_eigval, state_v_first, save_stage2a)
    out = fwd_lists(intra)(
        key, (q, k, v, g, beta, initial_state, A_log, dt_bias),
        lambda: chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, None, A_log, dt_bias, gate,
                              lower_bound, beta_sigmoid, neg_eigval, state_v_first=state_v_first, intra=intra,
                              save_stage2a=save_stage2a),
        lambda res: res[:2] + res[2] if save_stage2a else res)
    return out[:2] + (out[2:],) if save_stage2a else out


def eager_direct(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
                 intra: str = "gluon"):
    """A replay of the list fwd_eager keeps for this signature without FLA's gate and beta options and with K-first
    states, as a function of a repeat call's (q, k, v, g, beta, initial_state) returning (o, final state or None), or
    None where there is no list (SignatureLists.direct)."""
    return fwd_lists(intra).direct(_key(q, k, v, g, beta, scale, initial_state, output_final_state, None, None, "",
                                        0.0, False, False, False, False), pad=2)


class _BothHostPaths:
    """The host-path options a backward list replays under: the Triton and the Gluon host paths' (the backward
    launches through both), each option on only where it is on in both."""
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    @property
    def plan_cache(self) -> bool:
        return self.a.plan_cache and self.b.plan_cache

    @property
    def handle(self) -> bool:
        return self.a.handle and self.b.handle


def bwd_lists() -> SignatureLists:
    """The backward's lists (one SignatureLists over both host paths)."""
    lists = _LISTS.get("backward")
    if lists is None:
        from linattn.ops.gated_delta_rule.gluon.host import host_path as gluon_hp
        from linattn.ops.gated_delta_rule.triton.host import host_path as triton_hp
        lists = _LISTS["backward"] = SignatureLists(_BothHostPaths(triton_hp, gluon_hp), current_device,
                                                    hooks_active, poisoning)
    return lists


def bwd_eager(run, q, k, v, g, beta, scale: float, initial_state, cu_seqlens, A_log, dt_bias, gate: str,
              lower_bound: float, beta_sigmoid: bool, neg_eigval: bool, state_v_first: bool, do, dht, saved,
              gluon_state: bool) -> tuple:
    """run()'s gradients (chunk_kda_bwd's eight outputs) for the backward op's call, through the signature's launch
    list where one applies: fixed length, not under CUDA-graph capture, at most GDN's BWD_LIST_MAX_TOKEN_HEADS (a
    replay holds every buffer of the backward for the whole call); every other call runs run(). do and dht as the
    backward takes them (contiguous)."""
    from linattn.ops.gated_delta_rule.triton.backward import BWD_LIST_MAX_TOKEN_HEADS
    from linattn.runtime.capture import capturing
    if cu_seqlens is not None or q.shape[0] * q.shape[1] * v.shape[2] > BWD_LIST_MAX_TOKEN_HEADS or capturing(q):
        return run()
    ins = (q, k, v, g, beta, initial_state, do, dht, A_log, dt_bias) + tuple(saved)
    key = (tuple([signature(t) for t in ins]), q.device, scale, gate, lower_bound, beta_sigmoid, neg_eigval,
           state_v_first, gluon_state)
    return bwd_lists()(key, ins, run, tuple)
