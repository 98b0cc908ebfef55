"""KDA's eager forward without autograd on the Gluon stages, through per-signature launch lists.

A plain eager call of chunk_kda's gluon backend (no cu_seqlens, not under CUDA-graph capture; without autograd, or the
autograd forward's custom op, which keeps stage 2a's outputs) whose shapes take the fused Gluon stages 2b-4 makes two
launches (stage 2a, kda/gluon/intra.py; the fused stages,
kda/gluon/fused_forward.py), both through the Gluon host path. Its Python around them (the chunk plan, nine buffers,
six TensorDescriptors, two launch keys) costs several times the launches' own host time. Per call signature the
first calls are recorded and later ones replay the recorded launches with their own pointers
(runtime/launch_list.py).

Only the fused path is listed: the others launch Triton kernels through the JIT (wu_kernel, the Triton state pass
and output stage), which a recording does not see, so a replay would skip them.
"""
from __future__ import annotations

from typing import Optional

import torch

from linattn.ops.gated_delta_rule.gluon.host import host_path
from linattn.runtime.alloc import poisoning
from linattn.runtime.host_path import current_device, hooks_active
from linattn.runtime.launch_list import SignatureLists, signature

FWD_LISTS = SignatureLists(host_path, current_device, hooks_active, poisoning)


def listed(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor], state_v_first: bool) -> bool:
    """Whether a no-autograd eager call of the gluon backend takes the launch lists: fixed length, not under CUDA-graph
    capture (the caller ruled out tracing), the fused Gluon stages (kda_fused_supported)."""
    from linattn.ops.kda.gluon.fused_forward import kda_fused_supported
    from linattn.runtime.capture import stream_capturing
    return cu_seqlens is None and not stream_capturing(q) and kda_fused_supported(q, v, state_v_first)[0]


def _key(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, A_log, dt_bias, gate: str,
         lower_bound: float, beta_sigmoid: bool, neg_eigval: bool, save_stage2a: bool) -> tuple:
    return (tuple([signature(t) for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)]), q.device, scale,
            output_final_state, gate, lower_bound, beta_sigmoid, neg_eigval, save_stage2a)


def fwd_eager(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
              A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], gate: str, lower_bound: float,
              beta_sigmoid: bool, neg_eigval: bool, save_stage2a: bool = False):
    """(o, final state or None) of chunk_kda_fwd(intra="gluon") for a call `listed` accepted, through the signature's
    launch list when it has one; save_stage2a (the autograd forward, chunk.py's custom op): (o, final, (gcum, the
    effective beta, Tinv, Aqk)) as chunk_kda_fwd returns them."""
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    key = _key(q, k, v, g, beta, scale, initial_state, output_final_state, A_log, dt_bias, gate, lower_bound,
               beta_sigmoid, neg_eigval, save_stage2a)
    out = FWD_LISTS(key, (q, k, v, g, beta, initial_state, A_log, dt_bias),
                    lambda: chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, None, A_log,
                                          dt_bias, gate, lower_bound, beta_sigmoid, neg_eigval, intra="gluon",
                                          save_stage2a=save_stage2a),
                    lambda res: res[:2] + res[2] if save_stage2a else res)
    return out[:2] + (out[2:],) if save_stage2a else out


def eager_direct(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool):
    """A replay of the list fwd_eager keeps for this signature without FLA's gate and beta options, as a function of a
    repeat call's (q, k, v, g, beta, initial_state) returning (o, final state or None), or None where there is no
    list (SignatureLists.direct)."""
    return FWD_LISTS.direct(_key(q, k, v, g, beta, scale, initial_state, output_final_state, None, None, "", 0.0,
                                 False, False, False), pad=2)
