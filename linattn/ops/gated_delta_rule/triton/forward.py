"""Launcher of the Triton forward: allocates the intermediates, picks launch configs, runs the four stages.

Launch configs are a small frozen heuristic (no autotuning on the first call): see `_configs`.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import torch
import triton

from linattn.ops.gated_delta_rule.triton.chunk_fused_fwd import chunk_fused_fwd, fused_fwd_wanted
from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan, make_chunk_plan
from linattn.ops.gated_delta_rule.triton.chunk_output import OUTPUT_V2, chunk_output, chunk_output_kernel
from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
from linattn.ops.gated_delta_rule.triton.chunk_state_split import chunk_state_split, split_state_wanted
from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import chunk_state_warmup, warmup_state_wanted
from linattn.ops.gated_delta_rule.triton.intra_chunk import intra_chunk_wy_kernel
from linattn.ops.gated_delta_rule.triton.intra_split import intra_split
from linattn.runtime.alloc import empty
from linattn.runtime.device import device_facts
from linattn.runtime.settings import settings

CHUNK = 64


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


@dataclass(frozen=True)
class FwdConfig:
    BK_intra: int
    BV_intra: int
    BV_state: int
    BV_out: int
    warps_intra: int
    warps_state: int
    warps_out: int
    stages: int


def _configs(K: int, V: int, N: int, HV: int, device) -> FwdConfig:
    facts = device_facts(device)
    return _configs_for(K, V, N, HV, facts.kind, facts.num_sms, settings.gdn_state_bv16)


@lru_cache(maxsize=1024)
def _configs_for(K: int, V: int, N: int, HV: int, kind: str, num_sms: int, bv16: bool = False) -> FwdConfig:
    # a pure function of the shape, the device's kind and SM count and the switches passed in, cached: the host path
    # of every call runs it
    BK = _pow2(K)
    BV = _pow2(V)
    # state pass: [BK, BV] fp32 state in registers; split V so that N*HV*(V/BV) programs cover the SMs
    bv_state = min(BV, 64 if BK <= 128 else 32)
    sms = num_sms if kind == "cuda" else 1
    while bv_state > 32 and N * HV * triton.cdiv(V, bv_state) < sms:
        bv_state //= 2
    if bv16 and bv_state == 32 and N * HV * triton.cdiv(V, 16) <= sms:
        # LINATTN_GDN_STATE_BV16 (default since round 21; H200: gate green, bit-equal, 1.05-1.10x at B1-B2 H2/HV8):
        # 16 columns where even they fit one wave
        bv_state = 16
    return FwdConfig(BK_intra=BK, BV_intra=min(BV, 64), BV_state=bv_state, BV_out=min(BV, 64),
                     warps_intra=4, warps_state=8 if BK >= 256 else 4, warps_out=4, stages=2)


@dataclass
class FwdResult:
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    # intermediates the backward may reuse (vnew and h are None after the fused stage 3+4: never stored)
    gcum: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    vnew: Optional[torch.Tensor]
    h: Optional[torch.Tensor]
    tinv: Optional[torch.Tensor]
    plan: ChunkPlan


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                               output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                               store_tinv: bool = False, plan: Optional[ChunkPlan] = None,
                               compute_output: bool = True, state_pass: Optional[Callable] = None,
                               need_intermediates: bool = True, keys_normalised: bool = False,
                               fused_pass: Optional[Callable] = None) -> FwdResult:
    """q, k [B,T,H,K], v [B,T,HV,V] contiguous in one dtype; g, beta [B,T,HV] any float dtype (contiguous);
    initial_state [N,HV,K,V] fp32 contiguous or None. Returns o [B,T,HV,V] in v's dtype and the fp32 final state.
    compute_output=False skips stage 4 (o is None): the backward recomputes only the intermediates.
    state_pass(k, w, u, gcum, h, vnew, initial_state, final, plan), when given, replaces stage 3 (the Gluon
    backend's state pass plugs in here; it must write h, vnew and final exactly as chunk_state_fwd_kernel does).
    need_intermediates=False says the caller reads only o and the final state: then, with LINATTN_GDN_FUSED_FWD=1,
    compute_output, no state_pass and a shape the fused kernel takes (chunk_fused_fwd.fused_fwd_wanted), stages 3
    and 4 run as one kernel (chunk_fused_fwd.py) and the result's h and vnew are None.
    keys_normalised=True says every ||k|| = 1 (the api's use_qk_l2norm_in_kernel); with LINATTN_GDN_SEGMENT_WARMUP=1
    it lets stage 3 run segment-parallel with gate-truncated warm-ups (chunk_state_warmup.warmup_state_wanted).
    fused_pass(q, k, w, u, gcum, o, initial_state, final, plan, scale), when given with compute_output, replaces
    stages 3 and 4 (the Gluon backend's warp-specialised fused kernel plugs in here; it writes o and final); the
    result's h and vnew are then None."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    if plan is None:
        plan = make_chunk_plan(B, T, cu_seqlens, CHUNK, dev)
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    cfg = _configs(K, V, N, HV, dev)
    BK = cfg.BK_intra            # _pow2(K)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dt = q.dtype

    gcum = empty(T_tot, HV, dtype=torch.float32, device=dev)
    w = empty(T_tot, HV, K, dtype=dt, device=dev)
    u = empty(T_tot, HV, V, dtype=dt, device=dev)
    tinv = empty(T_tot, HV, CHUNK, dtype=torch.float32, device=dev) if store_tinv else None
    if settings.gdn_split_intra:
        # default (LINATTN_GDN_SPLIT_INTRA=0 turns it off): stage 2 as two kernels (Tinv, then W and U), same
        # outputs; round 12 on the H200: stage 2 1.32-1.47x, forward 1.09-1.18x (benchmarks/SPLIT_INTRA.md)
        intra_split(k, v, g, beta, gcum, w, u, tinv, plan, H=H, HV=HV, K=K, V=V, dot_prec=dot_prec)
    else:
        intra_chunk_wy_kernel[(slots, HV)](
            k, v, g, beta, gcum, w, u, tinv if tinv is not None else gcum,
            plan.cu, plan.chunk_indices, N,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK_intra, BV=cfg.BV_intra,
            STORE_TINV=store_tinv, DOT_PREC=dot_prec, num_warps=cfg.warps_intra)

    final = empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    if fused_pass is not None and compute_output:
        o = empty(B, T, HV, V, dtype=v.dtype, device=dev)
        fused_pass(q, k, w, u, gcum, o, initial_state, final, plan, scale)
        return FwdResult(o, final, gcum, w, u, None, None, tinv, plan)
    if (settings.gdn_fused_fwd and compute_output and state_pass is None and not need_intermediates
            and fused_fwd_wanted(dt, K, dev)):
        # opt-in (LINATTN_GDN_FUSED_FWD=1): stages 3 and 4 in one kernel, h and vnew never stored
        o = empty(B, T, HV, V, dtype=v.dtype, device=dev)
        chunk_fused_fwd(q, k, w, u, gcum, o, initial_state, final, plan, scale, H=H, HV=HV, K=K, V=V,
                        dot_prec=dot_prec)
        return FwdResult(o, final, gcum, w, u, None, None, tinv, plan)

    h = empty(slots, HV, K, V, dtype=dt, device=dev)
    vnew = empty(T_tot, HV, V, dtype=dt, device=dev)
    if state_pass is not None:
        state_pass(k, w, u, gcum, h, vnew, initial_state, final, plan)
    elif settings.gdn_segment_warmup and warmup_state_wanted(cu_seqlens, keys_normalised, state_pass, plan, HV, V,
                                                             cfg.BV_state, dev):
        # opt-in (LINATTN_GDN_SEGMENT_WARMUP=1): segments started a gate-chosen warm-up before them (approximate:
        # error <= e^-20 of the state; benchmarks/SEGMENT_WARMUP.md), same outputs
        chunk_state_warmup(k, w, u, gcum, h, vnew, initial_state, final, plan, H=H, HV=HV, K=K, V=V,
                           dot_prec=dot_prec, BV=cfg.BV_state, num_warps=cfg.warps_state, num_stages=cfg.stages)
    elif settings.gdn_split_state and split_state_wanted(plan, HV, V, dev):
        # opt-in (LINATTN_GDN_SPLIT_STATE=1): segment-parallel state pass, same outputs
        chunk_state_split(k, w, u, gcum, h, vnew, initial_state, final, plan, H=H, HV=HV, K=K, V=V,
                          dot_prec=dot_prec)
    else:
        chunk_state_fwd_kernel[(triton.cdiv(V, cfg.BV_state), N * HV)](
            k, w, u, gcum, h, vnew,
            initial_state if initial_state is not None else gcum, final if final is not None else gcum,
            plan.cu, plan.chunk_offsets,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=cfg.BV_state,
            USE_H0=initial_state is not None, STORE_HT=output_final_state, DOT_PREC=dot_prec,
            # the backward's recompute (compute_output False) too unless LINATTN_GDN_STATE_DECAY_V_BWD=0 (round 22)
            DECAY_V=settings.gdn_state_decay_v and (compute_output or settings.gdn_state_decay_v_bwd),
            num_warps=cfg.warps_state, num_stages=cfg.stages)

    if not compute_output:
        return FwdResult(None, final, gcum, w, u, vnew, h, tinv, plan)
    o = empty(B, T, HV, V, dtype=v.dtype, device=dev)
    if settings.gdn_output == "v1":             # before round 13: one K block, BV 64, 4 warps
        chunk_output_kernel[(triton.cdiv(V, cfg.BV_out), slots, HV)](
            q, k, vnew, h, gcum, o, plan.cu, plan.chunk_indices, plan.chunk_offsets, N, scale,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=cfg.BV_out, DOT_PREC=dot_prec,
            num_warps=cfg.warps_out, num_stages=cfg.stages)
    else:                                       # K loop, BV 128, 8 warps, heads grouped (benchmarks/OUTPUT_STAGE.md)
        chunk_output(q, k, vnew, h, gcum, o, plan, scale, H=H, HV=HV, K=K, V=V, dot_prec=dot_prec, cfg=OUTPUT_V2,
                     BT=CHUNK)
    return FwdResult(o, final, gcum, w, u, vnew, h, tinv, plan)
