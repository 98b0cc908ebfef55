"""Launcher of KDA's chunked forward on Triton: KDA's own stage 2a (intra.py), then GDN's stages with their
per-key-channel form (DECAY "channel"): W and U (intra_split.wu_kernel), the state pass (chunk_state), the output
(chunk_output)."""
from dataclasses import dataclass
from typing import Optional

import torch

from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
from linattn.ops.gated_delta_rule.triton.chunk_output import chunk_output
from linattn.ops.gated_delta_rule.triton.common import dot_precision, ftz_exp2
from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _pow2, launch_state_pass
from linattn.ops.gated_delta_rule.triton.host import launches
from linattn.ops.gated_delta_rule.triton.intra_split import split_intra_config, wu_kernel
from linattn.ops.kda.triton.intra import (kda_cumsum_kernel, kda_diag_kernel, kda_inter_solve_kernel,
                                          kda_recompute_wu_kernel)
from linattn.runtime.alloc import empty
from linattn.runtime.launch_list import keep as keep_for_lists

# kda_recompute_wu_kernel's key channels per block: 32 at 4 warps, 163 registers (3 CTAs per SM) against 255 and a
# spill at 64 (sm_90a, K = V = 128, Triton 3.6.0). W's columns are the same products either way (wu_kernel's at 64).
RECOMPUTE_BK = 32
# Stage 2a's three kernels: the gates' cumsum, the decayed keys / queries and the pairwise flag in blocks of CUMSUM_BK
# key channels (64 at 4 warps: 255 registers, no spill, the fastest block on an H100); the in-block pairs token by
# token where a chunk is flagged, DIAG_BH value heads per program (a head's key row in one warp, so its sums stay in
# the warp); the pairs across blocks and the inverse in blocks of INTRA_BK channels (at 4 warps, the Akk layout
# tinv_blocks is written for: 16 leaves no spill at K = 128 on sm_90a)
CUMSUM_BK = 64
DIAG_BH = 4
INTRA_BK = 16


@dataclass
class KdaIntermediates:
    """What the backward reads from a recomputed forward (chunk_kda_fwd with keep=True)."""
    plan: object
    gcum: torch.Tensor       # [T_tot, HV, K] fp32
    beta: torch.Tensor       # [T_tot, HV] fp32, the effective beta
    tinv: torch.Tensor       # [T_tot, HV, 64] fp32
    aqk: torch.Tensor        # [T_tot, HV, 64]
    kdec: torch.Tensor       # K * exp(gam_C - gam) [T_tot, HV, K]
    qdec: torch.Tensor       # Q * exp(gam) [T_tot, HV, K]
    w: torch.Tensor
    h: torch.Tensor          # chunk-start states [slots, HV, K, V]
    vnew: torch.Tensor
    pairwise: torch.Tensor   # [slots, HV] int8: 1 where a chunk's in-block pairs go one by one (the forward's test)


def chunk_kda_fwd(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
                  cu_seqlens: Optional[torch.Tensor], A_log: Optional[torch.Tensor] = None,
                  dt_bias: Optional[torch.Tensor] = None, gate: str = "", lower_bound: float = 0.0,
                  beta_sigmoid: bool = False, neg_eigval: bool = False, keep: bool = False, state_v_first: bool = False,
                  state_pass=None, return_h: bool = False, keep_output: bool = False, intra: str = "triton",
                  save_stage2a: bool = False):
    """q, k [B, T, H, K], v [B, T, HV, V] contiguous, one dtype; g [B, T, HV, K] (the log decay, or with gate the
    raw input of FLA's KDA gate: "softplus", "lower_bound", "lower_bound_no_a"); beta [B, T, HV] (a logit with
    beta_sigmoid); initial_state [N, HV, K, V] ([N, HV, V, K] with state_v_first, as the final state) fp32
    contiguous or None. Returns (o [B, T, HV, V] in v's dtype, the fp32 final state or None); with keep=True (None,
    final, KdaIntermediates): Tinv kept in fp32 (the backward's form), and no output stage unless keep_output (then
    o in place of None: the autograd forward, which saves what the backward reads). state_pass: replaces stage 3
    (GDN's hook, called as state_pass(kdec, w, u, gcum, h, vnew, initial_state, final, plan); the context-parallel
    pass's). return_h: (o, final, h) with h the chunk-start states [slots, HV, K, V] in q's dtype (rows
    chunk_offsets[n] + c; FLA's return_intermediate_states). intra: "triton" (the three kernels below) or "gluon"
    (kda/gluon/intra.py, one Hopper kernel with the same outputs; its caller checks kda_intra_gluon_supported),
    followed where nothing is kept (K = V = 128, [N, HV, K, V] states) by the fused Gluon stages 2b-4
    (kda/gluon/fused_forward.py) instead of the Triton ones. save_stage2a (intra "gluon", keep False: the autograd
    forward on the Gluon stages): (o, final, (gcum, effective beta, Tinv, Aqk)), what kda_recompute rebuilds the
    backward's intermediates from, gcum at every row and Tinv in q's dtype (as FLA keeps its Akk inverse)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    dev = q.device
    plan = make_chunk_plan(B, T, cu_seqlens, CHUNK, dev)
    if cu_seqlens is None:                     # a cached plan: a launch list may keep its tensors (kda/eager.py)
        keep_for_lists(plan)
    T_tot, slots = plan.T_total, plan.num_slots
    dt = q.dtype
    gcum = empty(T_tot, HV, K, dtype=torch.float32, device=dev)
    beta_eff = empty(T_tot, HV, dtype=torch.float32, device=dev)
    tinv = empty(T_tot, HV, CHUNK, dtype=torch.float32 if keep else dt, device=dev)
    aqk = empty(T_tot, HV, CHUNK, dtype=dt, device=dev)
    kdec = empty(T_tot, HV, K, dtype=dt, device=dev)
    qdec = empty(T_tot, HV, K, dtype=dt, device=dev)
    if intra == "gluon":
        if keep:
            raise ValueError("chunk_kda_fwd: keep=True takes the Triton stage 2a (its fp32 Tinv and pairwise flags); "
                             "the Gluon one keeps stage 2a's outputs with save_stage2a")
        from linattn.ops.kda.gluon.fused_forward import kda_fused_forward, kda_fused_supported
        from linattn.ops.kda.gluon.intra import kda_intra_gluon
        fused = (not keep and not return_h and state_pass is None
                 and kda_fused_supported(q, v, state_v_first)[0])
        kg = empty(T_tot, HV, K, dtype=dt, device=dev) if fused else None
        kda_intra_gluon(q, k, g, beta, A_log, dt_bias, gate, lower_bound, beta_sigmoid, neg_eigval, plan, HV, gcum,
                        beta_eff, tinv, aqk, kdec, qdec, kg, gcum_last=fused and not save_stage2a)
        kept = ((gcum, beta_eff, tinv, aqk),) if save_stage2a else ()
        if fused:
            # stages 2b-4 in one warp-specialised kernel (kda/gluon/fused_forward.py)
            V = v.shape[3]
            o = empty(B, T, HV, V, dtype=v.dtype, device=dev)
            final = empty(plan.N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
            kda_fused_forward(qdec, kdec, kg, v, tinv, aqk, beta_eff, gcum, o, initial_state, final, plan, scale)
            return (o, final) + kept
        return _after_intra(q, k, v, scale, initial_state, output_final_state, plan, gcum, beta_eff, tinv, aqk,
                            kdec, qdec, state_v_first, state_pass, output=not keep or keep_output, keep=keep,
                            return_h=return_h) + kept
    pairwise = empty(slots, HV, dtype=torch.int8, device=dev)
    cu, idx, N = plan.cu, plan.chunk_indices, plan.N
    launches(kda_cumsum_kernel, (slots, HV),
             (q, k, g, beta, A_log, dt_bias, gcum, beta_eff, kdec, qdec, pairwise, cu, idx, N),
             dict(H=H, HV=HV, K=K, BT=CHUNK, BK=min(_pow2(K), CUMSUM_BK), GATE=gate, HAS_DT_BIAS=dt_bias is not None,
                  LOWER_BOUND=float(lower_bound) if gate.startswith("lower_bound") else 0.0,
                  BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=neg_eigval, num_warps=4))
    akkd = empty(T_tot, HV, 16, dtype=torch.float32, device=dev)
    aqkd = empty(T_tot, HV, 16, dtype=torch.float32, device=dev)
    ftz = ftz_exp2(q)
    launches(kda_diag_kernel, (slots * (CHUNK // 16), -(-HV // DIAG_BH)),
             (q, k, gcum, pairwise, akkd, aqkd, cu, idx, N),
             dict(H=H, HV=HV, K=K, BT=CHUNK, BK=_pow2(K), BH=DIAG_BH, FTZ=ftz, num_warps=DIAG_BH))
    launches(kda_inter_solve_kernel, (slots, HV),
             (q, k, gcum, beta_eff, pairwise, akkd, aqkd, tinv, aqk, cu, idx, N),
             dict(H=H, HV=HV, K=K, BT=CHUNK, BK=min(_pow2(K), INTRA_BK), DOT_PREC=dot_precision(dt), FTZ=ftz,
                  num_warps=4))
    return _after_intra(q, k, v, scale, initial_state, output_final_state, plan, gcum, beta_eff, tinv, aqk, kdec,
                        qdec, state_v_first, state_pass, output=not keep or keep_output, keep=keep, return_h=return_h,
                        pairwise=pairwise)


def kda_recompute(q, k, v, scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  gcum: torch.Tensor, beta_eff: torch.Tensor, tinv: torch.Tensor, aqk: torch.Tensor,
                  state_v_first: bool = False, state_pass=None) -> KdaIntermediates:
    """The backward's intermediates from the forward's saved gcum, effective beta, Tinv (fp32 from the Triton stage
    2a, q's dtype from the Gluon one) and Aqk (what stage 2a writes, its costly part): the decayed keys and queries
    and the chunks' pairwise flags again, with W / U in the same pass (kda_recompute_wu_kernel: wu_kernel's
    operations), then the state pass as chunk_kda_fwd(keep=True) runs it, so the backward reads the same values."""
    B, T, H, K = q.shape
    plan = make_chunk_plan(B, T, cu_seqlens, CHUNK, q.device)
    if cu_seqlens is None:                     # a cached plan: a launch list may keep its tensors (kda/eager.py)
        keep_for_lists(plan)
    HV, V = v.shape[2], v.shape[3]
    T_tot, dt, dev = plan.T_total, q.dtype, q.device
    kdec = empty(T_tot, HV, K, dtype=dt, device=dev)
    qdec = empty(T_tot, HV, K, dtype=dt, device=dev)
    w = empty(T_tot, HV, K, dtype=dt, device=dev)
    u = empty(T_tot, HV, V, dtype=dt, device=dev)
    pairwise = empty(plan.num_slots, HV, dtype=torch.int8, device=dev)
    cfg = split_intra_config(K, V)
    launches(kda_recompute_wu_kernel, (plan.num_slots, HV),
             (q, k, v, gcum, beta_eff, tinv, kdec, qdec, w, u, pairwise, plan.cu, plan.chunk_indices, plan.N),
             dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=min(cfg.BK, RECOMPUTE_BK), BV=cfg.BV, DOT_PREC=dot_precision(dt),
                  num_warps=cfg.warps_wu))
    return _after_intra(q, k, v, scale, initial_state, False, plan, gcum, beta_eff, tinv, aqk, kdec, qdec,
                        state_v_first, state_pass, output=False, keep=True, pairwise=pairwise, wu=(w, u))[2]


def _after_intra(q, k, v, scale, initial_state, output_final_state, plan, gcum, beta_eff, tinv, aqk, kdec, qdec,
                 state_v_first, state_pass, output: bool, keep: bool, return_h: bool = False, pairwise=None,
                 wu=None):
    """Stages 2b-4 of chunk_kda_fwd after stage 2a: W and U (or wu = (W, U) formed already), the state pass, the
    output where asked; with keep the intermediates (pairwise: the Triton stage 2a's flags, kept with them for the
    backward)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    dt = q.dtype
    dot_prec = dot_precision(dt)
    cfg = split_intra_config(K, V)
    if wu is None:
        w = empty(T_tot, HV, K, dtype=dt, device=dev)
        u = empty(T_tot, HV, V, dtype=dt, device=dev)
        launches(wu_kernel, (slots, HV), (k, v, beta_eff, gcum, tinv, w, u, plan.cu, plan.chunk_indices, N),
                 dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, BV=cfg.BV, DOT_PREC=dot_prec, DECAY="channel",
                      num_warps=cfg.warps_wu))
    else:
        w, u = wu

    final = empty(*((N, HV, V, K) if state_v_first else (N, HV, K, V)), dtype=torch.float32,
                  device=dev) if output_final_state else None
    h = empty(slots, HV, K, V, dtype=dt, device=dev)
    vnew = empty(T_tot, HV, V, dtype=dt, device=dev)
    if state_pass is None:
        launch_state_pass(kdec, w, u, gcum, h, vnew, initial_state, final, plan, state_v_first, decay="channel")
    else:
        state_pass(kdec, w, u, gcum, h, vnew, initial_state, final, plan)

    o = None
    if output:
        o = empty(B, T, HV, V, dtype=v.dtype, device=dev)
        chunk_output(qdec, kdec, vnew, h, gcum, o, plan, scale, H=HV, HV=HV, K=K, V=V, dot_prec=dot_prec, BT=CHUNK,
                     aqk=aqk)
    if keep:
        return o, final, KdaIntermediates(plan, gcum, beta_eff, tinv, aqk, kdec, qdec, w, h, vnew, pairwise)
    return (o, final, h) if return_h else (o, final)
