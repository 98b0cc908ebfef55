"""Launcher of the Triton backward (gdn-math.md, "Backward").

Stages: (0) recompute the forward's intermediates (gam, Tinv, W, U, the chunk-start states h and Vnew) with the
forward's own kernels, skipping its output stage; (1a) the intra-chunk part of dVnew, P^T dO, parallel over
chunks (backward_dv_local.py); (1) the reverse state pass (backward_state.py: dS per chunk, adds the state term
to dVnew, d initial_state); (2) the chunk-parallel local terms (backward_local.py: dQ, the first part of dK, dW, the
gate terms of O and S_next); (3) back through the WY representation (backward_wy.py: dV, the rest of dK, dbeta,
dg with its in-chunk reverse cumsum).

Memory choice: the forward keeps nothing but its inputs; the backward recomputes h and the rest. At B=1,
T=65536, HV=32, K=V=128 the intermediates are h 1 GB (bf16) plus W, U, Vnew 0.5 GB each and Tinv 0.5 GB (fp32):
about 3 GB per layer if kept from the forward until the backward, times the number of layers in a model. Recomputing
them costs about one forward without its output stage (roughly 70% of a forward, under 20% of forward+backward)
and they live only while this backward runs.

No host synchronisation: grids come from shapes and the chunk plan's host-side bound, varlen indices stay on the
device, so the backward can be captured in a CUDA graph.
"""
from dataclasses import dataclass
from typing import Hashable, Optional

import torch

from linattn.ops.col_sum import col_sum
from linattn.ops.gated_delta_rule.triton.backward_dv_local import chunk_dv_local_kernel
from linattn.ops.gated_delta_rule.triton.backward_local import STAGES_LOCAL, WARPS_LOCAL, chunk_local_bwd_kernel
from linattn.ops.gated_delta_rule.triton.backward_state import chunk_state_bwd_kernel
from linattn.ops.gated_delta_rule.triton.backward_wy import STAGES_WY, WARPS_WY, chunk_wy_bwd_kernel
from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
from linattn.ops.gated_delta_rule.triton.common import dot_precision
from linattn.ops.gated_delta_rule.triton.forward import CHUNK, chunk_gated_delta_rule_fwd
from linattn.ops.gated_delta_rule.triton.host import host_path, launches
from linattn.runtime.alloc import empty, poisoning
from linattn.runtime.device import device_facts
from linattn.runtime.host_path import cdiv, current_device, hooks_active, next_power_of_2
from linattn.runtime.launch_list import SignatureLists, keep, signature


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, next_power_of_2(n))


@dataclass
class BwdConfig:
    BK_state: int
    BV_state: int
    BK: int            # K block of the local and WY stages
    BV: int            # V block of the local and WY stages
    warps_state: int
    stages_state: int
    warps_dv_local: int


def _configs(K: int, V: int, N: int, HV: int, device) -> BwdConfig:
    """Chosen from ptxas register/spill reports of sm_90a builds (bf16, K and V from 16 to 256). Reverse state pass,
    8 warps: no spills at BV = 64 when K is a power of two up to 128, else at BV = 32 (one stage at K = 256). As in
    the forward, V is split no finer than 32: every V-block program re-reads the chunk's Q, K and W tiles. Local and
    WY stages in [64, 64] blocks at their own frozen warps and stages (backward_local.py, backward_wy.py)."""
    facts = device_facts(device)
    BK = _pow2(K)
    BV = _pow2(V)
    bv_state = min(BV, 64 if (K == BK and BK <= 128) else 32)
    sms = facts.num_sms if facts.kind == "cuda" else 1
    while bv_state > 32 and N * HV * cdiv(V, bv_state) < sms:
        bv_state //= 2
    return BwdConfig(BK_state=BK, BV_state=bv_state, BK=min(BK, 64), BV=min(BV, 64),
                     warps_state=8, stages_state=2 if BK <= 128 else 1, warps_dv_local=4)


def launch_state_bwd(q, k, w, gcum, do, dh, dvnew, dht: Optional[torch.Tensor], dh0: Optional[torch.Tensor], plan,
                     scale: float, store_dh: bool = True, state_v_first: bool = False):
    """Stage 1 by chunk_state_bwd_kernel over the plan's sequences (the default of chunk_gated_delta_rule_bwd's
    state_bwd hook). store_dh=False writes only dh0 (dh and dvnew are left as they are): the context-parallel
    pass's boundary summary, which must not add the state term to dvnew twice. state_v_first: dht and dh0 are
    [N, HV, V, K]."""
    H, K = q.shape[-2], q.shape[-1]
    HV, V = do.shape[-2], do.shape[-1]
    cfg = _configs(K, V, plan.N, HV, q.device)
    launches(chunk_state_bwd_kernel, (cdiv(V, cfg.BV_state) * plan.N * HV,),
             (q, k, w, gcum, do, dh, dvnew, dht if dht is not None else gcum, dh0 if dh0 is not None else gcum,
              plan.cu, plan.chunk_offsets, scale),
             dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK_state, BV=cfg.BV_state,
                  USE_DHT=dht is not None, STORE_DH0=dh0 is not None, STORE_DH=store_dh,
                  DOT_PREC=dot_precision(q.dtype),
                  num_warps=cfg.warps_state, num_stages=cfg.stages_state,
                  **({"V_FIRST": True} if state_v_first else {})))


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                               cu_seqlens: Optional[torch.Tensor], do: torch.Tensor, dht: Optional[torch.Tensor],
                               state_pass=None, state_bwd=None, A_log: Optional[torch.Tensor] = None,
                               dt_bias: Optional[torch.Tensor] = None, beta_scale: int = 0,
                               state_v_first: bool = False, local_wy=None, state_bwd_dv_local: bool = False,
                               free_u: bool = True, recompute=None):
    """q, k [B,T,H,K], v [B,T,HV,V] contiguous in one dtype; g, beta [B,T,HV] contiguous, any float dtype;
    initial_state [N,HV,K,V] fp32 contiguous or None; do [B,T,HV,V] contiguous; dht [N,HV,K,V] or None.
    Returns dq, dk, dv, dg, dbeta in their inputs' dtypes, d initial_state (fp32) or None, and dA_log, d dt_bias
    (fp32 [HV]; None without them).
    FLA's options as chunk_gated_delta_rule_fwd takes them (A_log, dt_bias, beta_scale, state_v_first): dg and dbeta
    are then the gradients of the raw g and of the beta logits, and dht / d initial_state are [N, HV, V, K] with
    state_v_first.
    state_pass: replaces the recompute's Triton state pass (chunk_gated_delta_rule_fwd's hook; the gluon backend
    plugs its Gluon state pass in here).
    state_bwd: replaces the launch of stage 1 (chunk_state_bwd_kernel), called as state_bwd(q, k, w, gcum, do, dh,
    dvnew, dht, dh0, plan, scale) with the same tensors the Triton launch gets (the gluon backend plugs its Gluon
    state backward, gluon/chunk_state_bwd.py, in here).
    state_bwd_dv_local: the state_bwd hook forms stage 1a's P^T dO itself and writes dvnew whole (the gluon kernel's
    dv_local), so chunk_dv_local_kernel is not launched and dvnew reaches the hook uninitialised.
    recompute: replaces stage 0, called as recompute(q, k, v, g, beta, initial_state, plan) for a FwdResult with gcum,
    w, vnew, h, tinv (fp32) and beta (the gluon backend's gate-free recompute, gluon/chunk_state_gf.py); not with
    FLA's options."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    plan = make_chunk_plan(B, T, cu_seqlens, CHUNK, dev)
    if cu_seqlens is None:
        keep(plan)                  # cached per (B, T, device, stream): a launch list may pass its tensors on
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    cfg = _configs(K, V, N, HV, dev)
    dot_prec = dot_precision(q.dtype)
    dt = q.dtype
    NK = cdiv(K, cfg.BK)

    if recompute is not None:
        if A_log is not None or beta_scale or state_v_first:
            raise NotImplementedError("a recompute hook takes the default options only (no in-kernel gate or beta "
                                      "sigmoid, [N, HV, K, V] states)")
        fwd = recompute(q, k, v, g, beta, initial_state, plan)
    else:
        fwd = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, False, cu_seqlens,
                                         store_tinv=True, plan=plan, compute_output=False, state_pass=state_pass,
                                         A_log=A_log, dt_bias=dt_bias, beta_scale=beta_scale,
                                         state_v_first=state_v_first)
    if free_u:
        fwd.u = None        # consumed by the recomputed state pass; freed before the backward's own buffers

    dh = empty(slots, HV, K, V, dtype=dt, device=dev)
    dvnew = empty(T_tot, HV, V, dtype=dt, device=dev)
    dh0 = empty(*initial_state.shape, dtype=torch.float32, device=dev) if initial_state is not None else None
    if not (state_bwd_dv_local and state_bwd is not None):
        launches(chunk_dv_local_kernel, (slots, HV), (q, k, fwd.gcum, do, dvnew, plan.cu, plan.chunk_indices, N, scale),
                 dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, BV=cfg.BV, DOT_PREC=dot_prec,
                      num_warps=cfg.warps_dv_local, num_stages=2))
    if state_bwd is not None:
        if state_v_first:
            raise NotImplementedError("state_v_first with a custom reverse state pass (the Gluon one, context "
                                      "parallelism): only the Triton pass reads and writes [N, HV, V, K] states")
        state_bwd(q, k, fwd.w, fwd.gcum, do, dh, dvnew, dht, dh0, plan, scale)
    else:
        launch_state_bwd(q, k, fwd.w, fwd.gcum, do, dh, dvnew, dht, dh0, plan, scale, state_v_first=state_v_first)

    if local_wy is not None and A_log is None and not beta_scale:
        dq = empty(B, T, H, K, dtype=q.dtype, device=dev)
        dk = empty(B, T, H, K, dtype=k.dtype, device=dev)
        dv = empty(B, T, HV, V, dtype=v.dtype, device=dev)
        dg = empty(B, T, HV, dtype=g.dtype, device=dev)
        dbeta = empty(B, T, HV, dtype=beta.dtype, device=dev)
        local_wy(q, k, v, fwd.vnew, fwd.h, dh, fwd.gcum, fwd.beta, fwd.tinv, do, dvnew, dq, dk, dv, dg, dbeta, plan,
                 scale)
        return dq, dk, dv, dg, dbeta, dh0, None, None

    dq = empty(B, T, H, K, dtype=q.dtype, device=dev)
    dk_part = empty(T_tot, H, K, dtype=torch.float32, device=dev)
    dw = empty(T_tot, HV, K, dtype=dt, device=dev)
    dgam = empty(NK, T_tot, HV, dtype=torch.float32, device=dev)
    launches(chunk_local_bwd_kernel, (NK * slots, H),
             (q, k, fwd.vnew, fwd.h, fwd.gcum, do, dvnew, dh, dq, dk_part, dw, dgam,
              plan.cu, plan.chunk_indices, plan.chunk_offsets, N, T_tot, scale),
             dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, BV=cfg.BV, DOT_PREC=dot_prec,
                  num_warps=WARPS_LOCAL, num_stages=STAGES_LOCAL))

    dk = empty(B, T, H, K, dtype=k.dtype, device=dev)
    dv = empty(B, T, HV, V, dtype=v.dtype, device=dev)
    dg = empty(B, T, HV, dtype=g.dtype, device=dev)
    dbeta = empty(B, T, HV, dtype=beta.dtype, device=dev)
    # dk_part is consumed. M^T goes through dk's own rows, else through a [slots, H, 64, 64] scratch
    m_in_dk = K >= CHUNK
    scratch = dk if m_in_dk else empty(slots, H, CHUNK, CHUNK, dtype=k.dtype, device=dev)
    # FLA's options: the WY stage reads the activated beta of the recompute's stage 2a and takes dbeta / dg on to
    # the raw inputs; dA_log and d dt_bias come per chunk slot (dgate) and are summed over the slots here
    opts, tensors, dgate = {}, {}, None
    if A_log is not None:
        dgate = empty(2 if dt_bias is not None else 1, slots, HV, dtype=torch.float32, device=dev)
        tensors.update(g_raw_ptr=g, A_log_ptr=A_log, dgate_ptr=dgate)
        opts.update(GATE_IN_KERNEL=True)
        if dt_bias is not None:
            tensors.update(dt_bias_ptr=dt_bias)
            opts.update(HAS_DT_BIAS=True)
    if beta_scale:
        tensors.update(beta_raw_ptr=beta)
        opts.update(BETA_SCALE=beta_scale)
    launches(chunk_wy_bwd_kernel, (slots, H),
             (k, v, fwd.beta, fwd.gcum, fwd.tinv, dvnew, dw, dk_part, dgam, dk, dv, dg, dbeta, scratch,
              plan.cu, plan.chunk_indices, N, T_tot),
             dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, BV=cfg.BV, NK=NK, NKP=NK, M_IN_DK=m_in_dk,
                  DOT_PREC=dot_prec, num_warps=WARPS_WY, num_stages=STAGES_WY, **opts), tensors=tensors or None)
    dA_log = col_sum(dgate[0], (HV,), torch.float32, launches) if dgate is not None else None
    ddt_bias = col_sum(dgate[1], (HV,), torch.float32, launches) if dt_bias is not None else None
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


# Per call signature of a fixed-length backward outside CUDA-graph capture: its launch list (runtime/launch_list.py).
# A repeat call allocates the recorded buffers and makes the seven recorded launches (the recompute's three, stages
# 1a to 3) with its own pointers, instead of the chunk plan lookup, the configs and the host path's launch keys.
# A replay holds every buffer for the whole call (U included), so lists serve calls up to BWD_LIST_MAX_TOKEN_HEADS
# token-heads (B * T * HV; U is then at most 64 MB at V = 128 in bf16): the host-bound sizes, where a training step's
# eager backward waits on its host path. With FLA's in-kernel gate the list holds two more launches, the column sums of
# dA_log and d dt_bias.
BWD_LISTS = SignatureLists(host_path, current_device, hooks_active, poisoning)
BWD_LIST_MAX_TOKEN_HEADS = 1 << 18


def bwd_eager(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], do: torch.Tensor,
              dht: Optional[torch.Tensor], A_log: Optional[torch.Tensor] = None,
              dt_bias: Optional[torch.Tensor] = None, beta_scale: int = 0, state_v_first: bool = False,
              variant: Hashable = None, cu_seqlens: Optional[torch.Tensor] = None, kept: tuple = (), **hooks):
    """chunk_gated_delta_rule_bwd's outputs, through the signature's launch list where one applies: a fixed-length
    call (no cu_seqlens) outside CUDA-graph capture, small enough (above); every other call takes the host path.
    hooks: chunk_gated_delta_rule_bwd's state_pass / state_bwd / local_wy / state_bwd_dv_local / recompute, made
    afresh per call by a backend; variant names what they launch (it keys the lists with the signature). kept: the
    tensors the forward kept that the hooks read (inputs of the list like q or do: a replay moves their pointers)."""
    from linattn.runtime.capture import capturing

    def run(free_u=True):
        return chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, A_log=A_log,
                                          dt_bias=dt_bias, beta_scale=beta_scale, state_v_first=state_v_first,
                                          free_u=free_u, **hooks)
    if (cu_seqlens is not None or q.shape[0] * q.shape[1] * v.shape[2] > BWD_LIST_MAX_TOKEN_HEADS
            or capturing(q)):
        return run()
    ins = (q, k, v, g, beta, initial_state, do, dht, A_log, dt_bias) + tuple(kept)
    key = (variant, tuple([signature(t) for t in ins]), q.device, scale, beta_scale, state_v_first)
    return BWD_LISTS(key, ins, lambda: run(free_u=False), lambda res: res)
