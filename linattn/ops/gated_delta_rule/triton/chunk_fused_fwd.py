"""Stages 3 and 4 of the forward in one kernel (gdn-math.md, chunk form): the state pass with the output on the way.

Per chunk, with S the state at the chunk's start (fp32, in registers, never written to memory):
    Vnew   = U - W S                                                         (kept in registers, operand dtype)
    O      = diag(exp(gam)) (scale Q) S + ((scale Q K^T) * Gam * lower_incl) Vnew
    S      = exp(gam_C) S + (diag(exp(gam_C - gam)) K)^T Vnew
One program per (V block, sequence * value head), like chunk_state_fwd_kernel; it walks its sequence's chunks in
order and writes only o (and the final state). The unfused path writes every chunk-start state h [slots, HV, K, V]
and Vnew to memory in stage 3 and reads both back in stage 4; here neither exists. The price: the output's work
(q S, q k^T and its mask, att Vnew) joins the sequential chain of each program instead of running parallel over
chunks, and q k^T is computed once per V block of the state pass (cdiv(V, BV) times per chunk and head).

Same arithmetic and rounding points as the two kernels it replaces (it calls their shared helpers): S is rounded to
the operand dtype once per chunk (there it was the stored h) for W S and q S; Vnew is rounded to the operand dtype
(there it was the stored vnew) for att Vnew and the state update. So on the same inputs it matches the unfused
forward to accumulation-order round-off.

Opt-in: LINATTN_GDN_FUSED_FWD=1 (runtime/settings.py), taken by triton/forward.py only where the caller needs
neither h nor vnew (the public forward; the backward recomputes its intermediates unfused) and, on a GPU, only for
16-bit inputs with K <= 128 (fused_fwd_wanted). Not yet run on a GPU: benchmarks/FUSED_FWD.md.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan
from linattn.ops.gated_delta_rule.triton.chunk_output import chunk_attention, chunk_output_combine, chunk_output_inter
from linattn.ops.gated_delta_rule.triton.chunk_state import state_chunk_inputs, state_update
from linattn.ops.gated_delta_rule.triton.common import sequence_span, state_tile
from linattn.runtime.device import device_facts

CHUNK = 64


@triton.jit
def chunk_fused_fwd_kernel(
    q_ptr, k_ptr,                              # q, k [T_tot, H, K]
    w_ptr, u_ptr, gcum_ptr,                    # w [T_tot, HV, K], u [T_tot, HV, V], gcum [T_tot, HV] fp32
    o_ptr,                                     # o [T_tot, HV, V] (v's dtype)
    h0_ptr, ht_ptr,                            # initial / final state [N, HV, K, V] fp32
    cu_ptr, chunk_off_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    vb = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // (HV // H)                       # GVA: the query/key head this value head reads
    bos, eos, slot0, nchunks = sequence_span(cu_ptr, chunk_off_ptr, n, BT)

    rk, rv, mkv, state_off = state_tile(n, hv, vb, HV, K, V, BK, BV)
    if USE_H0:
        s = tl.load(h0_ptr + state_off, mask=mkv, other=0.).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)

    for c in range(0, nchunks):
        t0 = bos + c * BT                      # int64: cu is int64 (token offsets times strides can pass 2^31)
        b_w, b_u, b_k, gam, gam_last = state_chunk_inputs(k_ptr, w_ptr, u_ptr, gcum_ptr, t0, eos, hv, hk, vb,
                                                          H, HV, K, V, BT, BK, BV)
        p_q = tl.make_block_ptr(q_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        s_op = s.to(b_w.dtype)                 # the unfused path's h[chunk]
        vnew_op = (b_u - tl.dot(b_w, s_op, input_precision=DOT_PREC)).to(b_w.dtype)   # its stored vnew
        # the attention before q S: fewer live registers than stage 4's order (0 spills at BV=32 with 4 or 8 warps)
        att = chunk_attention(b_q, b_k, gam, BT, DOT_PREC)
        o = chunk_output_combine(chunk_output_inter(b_q, s_op, gam, DOT_PREC), att, vnew_op, scale, DOT_PREC)
        p_o = tl.make_block_ptr(o_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV),
                                (1, 0))
        tl.store(p_o, o.to(o_ptr.dtype.element_ty), boundary_check=(0, 1))
        s = state_update(s, b_k, vnew_op, gam, gam_last, DOT_PREC)

    if STORE_HT:
        tl.store(ht_ptr + state_off, s, mask=mkv)


@dataclass(frozen=True)
class FusedConfig:
    BV: int
    warps: int
    stages: int


def fused_config(K: int, V: int, N: int, HV: int, device) -> FusedConfig:
    """Launch config from shapes and the device (no autotuning), from the sm_90a AOT table of benchmarks/FUSED_FWD.md
    (ptxas of triton 3.6.0, bf16): everything of a chunk is live at once (the [K, BV] state, q, k, w tiles, q k^T and
    its decay mask, Vnew, the o accumulator), so at K=128 only BV=32 compiles without spills (4 warps: 254
    registers; 8 warps: 230; BV=64 spills 96-260 bytes at any warps/stages), and software pipelining
    (num_stages=2) spills too. K <= 64: BV=64 (242 registers at 4 warps), halved to 32 while the grid
    N * HV * cdiv(V, BV) leaves SMs idle. 4 warps: round 12 on the H200 (B1 H16/HV32 K=V=128, stages 3+4) timed
    bv32 w4 at 0.503 / 1.997 / 3.990 ms (T 8k / 32k / 64k) against 0.645 / 2.568 / 5.131 for the 8 warps this
    picked before at one program per SM; B >= 4 was not timed."""
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), 64 if BK <= 64 else 32)
    facts = device_facts(device)
    sms = facts.num_sms if facts.kind == "cuda" else 1
    while BV > 32 and N * HV * triton.cdiv(V, BV) < sms:
        BV //= 2
    return FusedConfig(BV=BV, warps=4, stages=1)


def fused_fwd_wanted(dtype: torch.dtype, K: int, device) -> bool:
    """Whether the forward takes the fused kernel when LINATTN_GDN_FUSED_FWD=1: always off the GPU (so the
    interpreter tests exercise it at every shape); on a GPU for 16-bit inputs with K <= 128 only, the shapes where
    it compiles without spills (fp32 inputs spill kilobytes at K=128, K=256 spills at every config)."""
    if device_facts(device).kind != "cuda":
        return True
    return dtype in (torch.bfloat16, torch.float16) and K <= 128


def chunk_fused_fwd(q, k, w, u, gcum, o, initial_state: Optional[torch.Tensor], final_state: Optional[torch.Tensor],
                    plan: ChunkPlan, scale: float, *, H: int, HV: int, K: int, V: int, dot_prec: str,
                    cfg: Optional[FusedConfig] = None) -> FusedConfig:
    """Stages 3+4: from stage 2's w [T_tot, HV, K], u [T_tot, HV, V], gcum [T_tot, HV] fp32 and q, k [B, T, H, K]
    (all contiguous), writes o [B, T, HV, V] and, when given, final_state [N, HV, K, V] fp32, in place;
    initial_state [N, HV, K, V] fp32 or None. Returns the config it launched with."""
    cfg = cfg or fused_config(K, V, plan.N, HV, q.device)
    BK = max(16, triton.next_power_of_2(K))
    chunk_fused_fwd_kernel[(triton.cdiv(V, cfg.BV), plan.N * HV)](
        q, k, w, u, gcum, o,
        initial_state if initial_state is not None else gcum, final_state if final_state is not None else gcum,
        plan.cu, plan.chunk_offsets, scale,
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=cfg.BV,
        USE_H0=initial_state is not None, STORE_HT=final_state is not None, DOT_PREC=dot_prec,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return cfg
