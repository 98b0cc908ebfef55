"""The backward's recompute of the chunk-start states h on sm_90a (gdn-backward-design.md, P3): stage 2a, then the
gate-free kernel's state-only mode (chunk_fused_gf.py: the two state partitions and the TMA producer, no output),
in segments where the forward's segment planner cuts the sequences, so that no W and no U are needed for h.

recompute_h_gluon returns what a backward reads: gcum, beta (the input: the gluon backend takes no FLA option, so
beta is already activated), Tinv in fp32 (the WY stage's precision), h [slots, HV, K, V] in the input dtype and,
for the Triton backward's stages, vnew and W (W by triton/intra_split.wu_kernel, which also writes a U that nothing
reads; a fused backward that asks for neither skips that kernel). Stage 2a is kkt_solve_kernel storing Tinv twice,
fp32 and 16-bit (the gate-free kernel's wgmma operand), in one pass.

Segments (S > 1, fixed-length batches): segment_windows finds each (segment, head)'s gate-truncated warm-up (the
forward's error contract: a start state off by at most e^-20 of its norm; exact where the window reaches the
sequence start); the pairs it flags (slow decay) run unsegmented in a launch of their own (select), the others in
the segment launch, whose CTAs store h only for their own chunks (warm-up chunks store nothing). Both launches run
on the current stream, one after the other (the forward overlaps them on a side stream; here the flagged pairs'
chain is paid after the segment launch's).
No host synchronisation: grids come from shapes and the plans' host-side bounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan

BT = 64


@dataclass
class Recompute:
    gcum: torch.Tensor               # [T_tot, HV] fp32
    beta: torch.Tensor               # [B, T, HV], the input
    tinv: torch.Tensor               # [T_tot, HV, 64] fp32
    h: torch.Tensor                  # [slots, HV, K, V], the input dtype
    vnew: Optional[torch.Tensor]     # [T_tot, HV, V] or None
    w: Optional[torch.Tensor]        # [T_tot, HV, K] or None
    plan: ChunkPlan


def recompute_segments(k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> tuple:
    """(S, L): the forward's segment plan for this call (chunk_fused_gf.gf_segments_wanted)."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import gf_segments_wanted
    from linattn.runtime.capture import capturing
    return gf_segments_wanted(k.shape[0], k.shape[1], v.shape[2], cu_seqlens, k.device, capturing=capturing(k))


def recompute_h_applies(k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> bool:
    """Where the gluon backend's backward recomputes h with recompute_h_gluon: V == 128 (the gate-free kernel holds
    a whole value head) and either the forward's segment plan cuts the sequences or a wave of sequence-heads fills
    the GPU (gf_wanted): where the forward runs the gate-free kernel. Elsewhere (few sequence-heads, short eager
    calls, varlen with few sequences) a whole-sequence chain on N * HV CTAs is longer than the V-split state pass."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import gf_supported, gf_wanted
    from linattn.runtime.device import device_facts
    if not gf_supported(k, v)[0]:
        return False
    if recompute_segments(k, v, cu_seqlens)[0] > 1:
        return True
    N = k.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    facts = device_facts(k.device)
    return gf_wanted(N, v.shape[2], facts.num_sms if facts.kind == "cuda" else 132)


def recompute_h_gluon(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], *,
                      plan: Optional[ChunkPlan] = None, segments: Optional[tuple] = None, store_vnew: bool = True,
                      store_w: bool = True, state_pass: Optional[Callable] = None) -> Recompute:
    """k [B,T,H,K], v [B,T,HV,V] contiguous in one 16-bit dtype (K == V == 128); g, beta [B,T,HV] contiguous (any
    float dtype; activated: no FLA option); initial_state [N,HV,K,V] fp32 contiguous or None. Returns a Recompute.
    plan: the sequence plan (made here when None); segments: (S, L) (None: recompute_segments'); store_vnew /
    store_w: whether vnew / W are produced (the Triton backward's stages read both). state_pass replaces the Gluon
    launch (chunk_fused_gf.chunk_gf_state_only_gluon's arguments; CPU tests pass the schedule model)."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import chunk_gf_state_only_gluon
    from linattn.ops.gated_delta_rule.gluon.host import launches
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.common import dot_precision
    from linattn.ops.gated_delta_rule.triton.intra_split import kkt_order, kkt_solve_kernel, split_intra_config, \
        wu_kernel
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan, segment_windows
    from linattn.runtime.alloc import empty
    if k.dtype not in (torch.bfloat16, torch.float16) or v.dtype != k.dtype:
        raise ValueError(f"k is {k.dtype}, v is {v.dtype}: recompute_h_gluon takes one 16-bit dtype")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    if plan is None:
        plan = make_chunk_plan(B, T, cu_seqlens, BT, dev)
    S, L = segments if segments is not None else recompute_segments(k, v, cu_seqlens)
    if S > 1 and cu_seqlens is not None:
        raise ValueError("segments: fixed-length batches only (cu_seqlens given)")
    T_tot, slots, N = plan.T_total, plan.num_slots, plan.N
    cfg = split_intra_config(K, V)
    gcum = empty(T_tot, HV, dtype=torch.float32, device=dev)
    tinv = empty(T_tot, HV, BT, dtype=torch.float32, device=dev)
    tinv_lo = empty(T_tot, HV, BT, dtype=k.dtype, device=dev)
    launches(kkt_solve_kernel, (slots, HV), (k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, N),
             dict(H=H, HV=HV, K=K, BT=BT, BK=cfg.BK_kkt, DOT_PREC=dot_precision(k.dtype), num_warps=cfg.warps_kkt,
                  tinv_lo_ptr=tinv_lo, **kkt_order(slots)))
    w = None
    if store_w:
        w = empty(T_tot, HV, K, dtype=k.dtype, device=dev)
        u = empty(T_tot, HV, V, dtype=k.dtype, device=dev)
        launches(wu_kernel, (slots, HV), (k, v, beta, gcum, tinv, w, u, plan.cu, plan.chunk_indices, N),
                 dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=cfg.BK, BV=cfg.BV, DOT_PREC=dot_precision(k.dtype),
                      num_warps=cfg.warps_wu))
        del u
    h = empty(slots, HV, K, V, dtype=k.dtype, device=dev)
    vnew = empty(T_tot, HV, V, dtype=k.dtype, device=dev) if store_vnew else None
    run = state_pass or chunk_gf_state_only_gluon
    if S > 1:
        slow, _, segw = segment_windows(k, beta, g, plan, S, L, launch=launches)
        run(k, v, beta, gcum, tinv_lo, h, vnew, initial_state, plan, select=slow)      # the flagged pairs, whole
        splan = segment_plan(B, T, S, L, dev)
        run(k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V), beta.reshape(1, B * T, HV), gcum, tinv_lo, h,
            vnew, initial_state, splan, select=slow, seg=segw)
    else:
        run(k, v, beta, gcum, tinv_lo, h, vnew, initial_state, plan)
    return Recompute(gcum, beta, tinv, h, vnew, w, plan)
