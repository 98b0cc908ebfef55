"""Launcher of the Triton forward: allocates the intermediates, picks launch configs, runs the stages: (2) gcum, Tinv,
W and U (intra_split.py, two kernels); (3) the sequential state pass (chunk_state.py: h, Vnew, the final state);
(4) the output (chunk_output.py).

Launch configs are a small frozen heuristic (no autotuning on the first call): see `_configs`.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import torch

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan, make_chunk_plan
from linattn.ops.gated_delta_rule.triton.chunk_output import chunk_output
from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
from linattn.ops.gated_delta_rule.triton.common import dot_precision
from linattn.ops.gated_delta_rule.triton.host import host_path, launches
from linattn.ops.gated_delta_rule.triton.intra_split import intra_split
from linattn.runtime.alloc import empty, poisoning
from linattn.runtime.device import device_facts
from linattn.runtime.host_path import cdiv, current_device, hooks_active, next_power_of_2
from linattn.runtime.launch_list import SignatureLists, keep, signature

CHUNK = 64


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, next_power_of_2(n))


@dataclass(frozen=True)
class FwdConfig:
    BV_state: int
    warps_state: int
    stages: int


def _configs(K: int, V: int, N: int, HV: int, device) -> FwdConfig:
    facts = device_facts(device)
    return _configs_for(K, V, N, HV, facts.kind, facts.num_sms)


@lru_cache(maxsize=1024)
def _configs_for(K: int, V: int, N: int, HV: int, kind: str, num_sms: int) -> FwdConfig:
    # a pure function of the shape and the device's kind and SM count, cached: the host path of every call runs it
    BK = _pow2(K)
    BV = _pow2(V)
    # state pass: [BK, BV] fp32 state in registers; split V so that N*HV*(V/BV) programs cover the SMs
    bv_state = min(BV, 64 if BK <= 128 else 32)
    sms = num_sms if kind == "cuda" else 1
    while bv_state > 32 and N * HV * cdiv(V, bv_state) < sms:
        bv_state //= 2
    if bv_state == 32 and N * HV * cdiv(V, 16) <= sms:
        # 16 columns where even they fit one wave (bit-equal; forward 1.05-1.10x at B1-B2 H2/HV8 on an H200)
        bv_state = 16
    return FwdConfig(BV_state=bv_state, warps_state=8 if BK >= 256 else 4, stages=2)


@dataclass
class FwdResult:
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    # intermediates the backward may reuse (vnew and h are None after a fused_pass: never stored)
    gcum: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    vnew: Optional[torch.Tensor]
    h: Optional[torch.Tensor]
    tinv: Optional[torch.Tensor]
    plan: ChunkPlan
    beta: Optional[torch.Tensor] = None    # the beta the later stages read: the input, or the activated fp32 copy


def launch_state_pass(k, w, u, gcum, h, vnew, initial_state: Optional[torch.Tensor], final: Optional[torch.Tensor],
                      plan: ChunkPlan, state_v_first: bool = False, decay: str = "scalar"):
    """Stage 3 by chunk_state_fwd_kernel over the plan's sequences (the default of chunk_gated_delta_rule_fwd's
    state_pass hook, which the context-parallel pass also calls): h, vnew, and final where it is not None.
    state_v_first: initial_state and final are [N, HV, V, K]. decay "channel" (KDA): k the decayed keys [T_tot, HV,
    K] and gcum per key channel."""
    H, K = k.shape[-2], k.shape[-1]
    HV, V = u.shape[1], u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)
    launches(chunk_state_fwd_kernel, (cdiv(V, cfg.BV_state) * plan.N * HV,),
             (k, w, u, gcum, h, vnew, initial_state if initial_state is not None else gcum,
              final if final is not None else gcum, plan.cu, plan.chunk_offsets),
             dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state,
                  USE_H0=initial_state is not None, STORE_HT=final is not None,
                  DOT_PREC=dot_precision(w.dtype), DECAY=decay,
                  num_warps=cfg.warps_state, num_stages=cfg.stages, **({"V_FIRST": True} if state_v_first else {})))


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                               output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                               store_tinv: bool = False, plan: Optional[ChunkPlan] = None,
                               compute_output: bool = True, state_pass: Optional[Callable] = None,
                               fused_pass: Optional[Callable] = None, A_log: Optional[torch.Tensor] = None,
                               dt_bias: Optional[torch.Tensor] = None, beta_scale: int = 0,
                               state_v_first: bool = False, state_buffers: bool = True) -> FwdResult:
    """q, k [B,T,H,K], v [B,T,HV,V] contiguous in one dtype; g, beta [B,T,HV] any float dtype (contiguous);
    initial_state [N,HV,K,V] fp32 contiguous or None. Returns o [B,T,HV,V] in v's dtype and the fp32 final state.
    compute_output=False skips stage 4 (o is None): the backward recomputes only the intermediates.
    state_pass(k, w, u, gcum, h, vnew, initial_state, final, plan), when given, replaces stage 3 (the Gluon
    backend's state pass plugs in here; it must write h, vnew and final exactly as chunk_state_fwd_kernel does).
    fused_pass(q, k, w, u, gcum, o, initial_state, final, plan, scale), when given with compute_output, replaces
    stages 3 and 4 (the Gluon backend's warp-specialised fused kernel plugs in here; it writes o and final); the
    result's h and vnew are then None.
    FLA's options: A_log / dt_bias [HV] contiguous (use_gate_in_kernel: g is the raw gate input, the decay
    -exp(A_log) * softplus(g + dt_bias) is formed by stage 2a before its cumsum); beta_scale 1 or 2
    (use_beta_sigmoid_in_kernel, 2 with allow_neg_eigval: beta is a logit, stage 2a forms beta_scale * sigmoid(beta)
    and stores it for the later stages); state_v_first: initial_state and the final state are [N, HV, V, K], read and
    written through transposed strides by the state pass. The Gluon hooks (state_pass, fused_pass) take only the
    default layout. state_buffers=False (with a state_pass hook and compute_output=False): h and vnew are not
    allocated and the hook gets None for both (context parallelism's summary reads only k, w, u and gcum)."""
    if not state_buffers and (state_pass is None or compute_output):
        raise ValueError("state_buffers=False needs a state_pass hook and compute_output=False")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    if plan is None:
        plan = make_chunk_plan(B, T, cu_seqlens, CHUNK, dev)
        if cu_seqlens is None:
            keep(plan)                  # cached per (B, T, device, stream): a launch list may pass its tensors on
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    dot_prec = dot_precision(q.dtype)
    dt = q.dtype

    gcum = empty(T_tot, HV, dtype=torch.float32, device=dev)
    w = empty(T_tot, HV, K, dtype=dt, device=dev)
    u = empty(T_tot, HV, V, dtype=dt, device=dev)
    tinv = empty(T_tot, HV, CHUNK, dtype=torch.float32, device=dev) if store_tinv else None
    beta_eff = empty(T_tot, HV, dtype=torch.float32, device=dev) if beta_scale else None
    intra_split(k, v, g, beta, gcum, w, u, tinv, plan, H=H, HV=HV, K=K, V=V, dot_prec=dot_prec, A_log=A_log,
                dt_bias=dt_bias, beta_scale=beta_scale, beta_out=beta_eff)
    beta_used = beta_eff if beta_scale else beta
    if state_v_first and (state_pass is not None or fused_pass is not None):
        raise NotImplementedError("state_v_first: the Gluon state passes take the [N, HV, K, V] layout only")

    final = None
    if output_final_state:
        final = empty(N, HV, *((V, K) if state_v_first else (K, V)), dtype=torch.float32, device=dev)
    if fused_pass is not None and compute_output:
        o = empty(B, T, HV, V, dtype=v.dtype, device=dev)
        fused_pass(q, k, w, u, gcum, o, initial_state, final, plan, scale)
        return FwdResult(o, final, gcum, w, u, None, None, tinv, plan, beta_used)

    h = empty(slots, HV, K, V, dtype=dt, device=dev) if state_buffers else None
    vnew = empty(T_tot, HV, V, dtype=dt, device=dev) if state_buffers else None
    if state_pass is not None:
        if state_v_first:
            raise NotImplementedError("state_v_first with a custom state pass (the Gluon state pass, context "
                                      "parallelism): only the Triton state pass stores [N, HV, V, K] states")
        state_pass(k, w, u, gcum, h, vnew, initial_state, final, plan)
    else:
        launch_state_pass(k, w, u, gcum, h, vnew, initial_state, final, plan, state_v_first=state_v_first)

    if not compute_output:
        return FwdResult(None, final, gcum, w, u, vnew, h, tinv, plan, beta_used)
    o = empty(B, T, HV, V, dtype=v.dtype, device=dev)
    chunk_output(q, k, vnew, h, gcum, o, plan, scale, H=H, HV=HV, K=K, V=V, dot_prec=dot_prec, BT=CHUNK)
    return FwdResult(o, final, gcum, w, u, vnew, h, tinv, plan, beta_used)


# Per call signature of a plain eager fixed-length forward: its launch list (runtime/launch_list.py). A repeat call
# allocates its buffers and makes the four recorded launches with its own pointers, instead of the chunk plan lookup,
# the configs and the host path's launch keys.
EAGER_LISTS = SignatureLists(host_path, current_device, hooks_active, poisoning)


def _eager_key(ins: tuple, scale: float, output_final_state: bool, beta_scale: int, state_v_first: bool) -> tuple:
    return (tuple([signature(t) for t in ins]), ins[0].device, scale, output_final_state, beta_scale, state_v_first)


def eager_direct(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool):
    """A replay of the LaunchList fwd_eager keeps for a plain call's signature (no A_log / dt_bias, no beta scale,
    K-first states), as a function of a repeat call's (q, k, v, g, beta, initial_state) returning (o, final state
    or None), or None where there is no list (SignatureLists.direct)."""
    ins = (q, k, v, g, beta, initial_state, None, None)
    return EAGER_LISTS.direct(_eager_key(ins, scale, output_final_state, 0, False), pad=2)


def fwd_eager(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
              A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, beta_scale: int = 0,
              state_v_first: bool = False):
    """(o, final state or None) of chunk_gated_delta_rule_fwd for a plain eager call without cu_seqlens (not under
    CUDA-graph capture; the caller checks), through the signature's launch list when it has one."""
    ins = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    key = _eager_key(ins, scale, output_final_state, beta_scale, state_v_first)
    return EAGER_LISTS(key, ins,
                       lambda: chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                          None, A_log=A_log, dt_bias=dt_bias, beta_scale=beta_scale,
                                                          state_v_first=state_v_first),
                       lambda res: (res.o, res.final_state if output_final_state else None))
