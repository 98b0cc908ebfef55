"""The gluon forward's fused path: stage 2a (kkt_solve), then stages 2b + 3 + 4 in one warp-specialised launch
(chunk_fused_wu_ws.py at BV = 16 / 32 / 64, or the gate-free chunk_fused_gf.py at BV = 128, which the launcher
passes as fused_pass / segment_pass), and the segment-parallel form of that launch (_segments). Launch configs,
argument checks and TMA descriptors of the W/U kernel; every launch goes through the host path (gluon/host.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import NWU, WU_REGS
from linattn.ops.gated_delta_rule.gluon.ws_partitions import BT, NPUB, OUTPUT_REGS, PRODUCER_REGS
from linattn.ops.gated_delta_rule.triton.common import dot_precision


@dataclass(frozen=True)
class FusedWuConfig:
    BV: int
    stages: int            # TMA ring depth
    nwu: int = NWU         # W buffers
    num_warps: int = 4     # the default (state) partition; the kernel launches 16 warps (4 warpgroups)
    output_regs: int = OUTPUT_REGS   # setmaxnreg of the output / wu warpgroups (the state's follows: 512 - 24 - both)
    wu_regs: int = WU_REGS
    out_pipe: bool = False           # OUT_PIPE: the output warpgroup issues q k^T one chunk ahead (_output_pipelined)


def fused_wu_config(N: int, HV: int, V: int, num_sms: int) -> FusedWuConfig:
    """BV=64 unless N*HV*V/64 programs would leave SMs idle, then 32; BV=16 where N*HV*V/16 programs still fit the
    SMs in one wave (B1-B2 at H2/HV8: twice the CTAs of BV=32, each with half the V-dependent work).
    Ring depth 3 at BV=16 / 32, 2 at BV=64 (3 stages would need ~246 KB of shared memory).
    BV=64: the output / wu warpgroups at 136 / 192 registers (state 160; sm_90a 0 spill), the plain output partition
    (OUT_PIPE there is slower at B4 and varlen, benchmarks/RESULTS.md). BV=16 / 32: OUT_PIPE, wu at 160 registers."""
    bv = 64
    while bv > 32 and N * HV * (V // bv) < num_sms:
        bv //= 2
    if bv == 64:
        return FusedWuConfig(64, 2, output_regs=136, wu_regs=192)
    if N * HV * (V // 16) <= num_sms:
        return FusedWuConfig(16, 3, out_pipe=True, wu_regs=160)
    return FusedWuConfig(32, 3, out_pipe=True, wu_regs=160)


def fused_wu_supported(q: torch.Tensor, v: torch.Tensor, beta: Optional[torch.Tensor] = None,
                       cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[bool, str]:
    """Whether the fused-wu kernel takes this call (on top of the gluon backend's supports(): sm_90a, no
    interpreter). Varlen is taken (the kernels mask every row past a sequence's end)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False, f"dtype {q.dtype}: the fused-wu kernel takes bf16 or fp16"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"K={q.shape[-1]}, V={v.shape[-1]}: the fused-wu kernel is built for K == V == 128"
    if q.shape[0] * q.shape[1] == 0:
        return False, "no tokens: the TMA descriptors need a non-empty [T, heads*dim] view"
    if v.shape[2] % q.shape[2]:
        return False, "HV must be a multiple of H"
    if beta is not None and not beta.is_floating_point():
        return False, f"beta is {beta.dtype}: a float dtype is needed"
    return True, ""


def _selection(t: Optional[torch.Tensor], n: Optional[int], name: str = "select",
               per: str = "sequence") -> Optional[torch.Tensor]:
    """The kernel's sel_ptr (or seg_ptr): None, or the tensor as a contiguous int32 of n elements (n None: any size,
    the caller checks the shape; checked, never copied from host)."""
    if t is None:
        return None
    if t.dtype != torch.int32 or not t.is_contiguous() or (n is not None and t.numel() != n):
        raise ValueError(f"{name} must be a contiguous int32 tensor of {n if n is not None else '[sequences, HV]'} "
                         f"elements (one per {per} and value head), got {t.dtype} {tuple(t.shape)}")
    return t


def selection_args(select: Optional[torch.Tensor], seg: Optional[torch.Tensor], N: int, HV: int) -> tuple:
    """The kernels' (sel_ptr, seg_ptr), checked (_selection): without seg, select is [N, HV] over the plan's
    sequences; with seg ([N, HV] segment words over the plan's segments), select is [sequences, HV]."""
    if seg is not None and select is not None and (select.dim() != 2 or select.shape[1] != HV):
        raise ValueError(f"select is {tuple(select.shape)}: with segment words it is [sequences, HV={HV}]")
    return _selection(select, None if seg is not None else N * HV), _selection(seg, N * HV, "seg", "segment")


def fused_wu_args(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float, BV: int) -> tuple:
    """The kernel arguments up to scale shared by chunk_fused_wu_ws_kernel and chunk_fused_gf_kernel: TMA descriptors
    over q, k ([BT, K] boxes), v ([BT, BV]) and Tinv ([BT, BT]), then beta, gcum, o, the states, the plan, scale."""
    from linattn.ops.gated_delta_rule.gluon.host import aligned, fused_desc, gl_dtype
    from linattn.runtime.gluon_compat import TensorDescriptor
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    T_tot = plan.T_total
    dt = q.dtype
    for name, t in (("k", k), ("v", v), ("tinv", tinv)):
        if t.dtype != dt:
            raise ValueError(f"{name} is {t.dtype}, q is {dt}: the fused-wu kernel takes one 16-bit dtype")
    if tuple(tinv.shape) != (T_tot, HV, BT):
        raise ValueError(f"tinv is {tuple(tinv.shape)}, expected {(T_tot, HV, BT)}")
    gdt = gl_dtype(dt)

    def desc(t2d, block):
        return fused_desc(TensorDescriptor, aligned(t2d), block, gdt)

    return (desc(q.reshape(T_tot, H * K), [BT, K]), desc(k.reshape(T_tot, H * K), [BT, K]),
            desc(v.reshape(T_tot, HV * V), [BT, BV]), desc(tinv.reshape(T_tot, HV * BT), [BT, BT]),
            beta.reshape(T_tot, HV), gcum, o, initial_state, final, plan.cu, plan.chunk_offsets, float(scale))


def fused_wu_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float, cfg: FusedWuConfig,
                    select: Optional[torch.Tensor] = None):
    """(kernel, grid, args, kwargs) of one launch of chunk_fused_wu_ws_kernel (separate from the launch so that a
    CPU test can check the arguments against the AOT signature, aot.py fused_wu_signature).
    q, k [B,T,H,K]; v [B,T,HV,V]; beta [B,T,HV] (any float dtype, contiguous); gcum [T_tot,HV] fp32 and
    tinv [T_tot,HV,64] in q's dtype (kkt_solve_kernel's outputs); o [B,T,HV,V] (written); initial_state / final
    [N,HV,K,V] fp32 or None; select [N, HV] int32 or None: only the (sequence, head) pairs where it is != 0 run (the
    others' CTAs exit at once: no o row, no final state written)."""
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    N = plan.N
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import chunk_fused_wu_ws_kernel
    args = fused_wu_args(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, cfg.BV) + (
        _selection(select, N * HV),)
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, STAGES=cfg.stages, NWU=cfg.nwu, NPUB=NPUB,
                  USE_H0=initial_state is not None, STORE_HT=final is not None, OUTPUT_REGS=cfg.output_regs,
                  WU_REGS=cfg.wu_regs, PRODUCER_REGS=PRODUCER_REGS, OUT_PIPE=cfg.out_pipe, num_warps=cfg.num_warps)
    return chunk_fused_wu_ws_kernel, (V // cfg.BV, N * HV), args, kwargs


def chunk_fused_wu_ws_gluon(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale: float,
                            config: Optional[FusedWuConfig] = None, select: Optional[torch.Tensor] = None,
                            stream=None) -> None:
    """Stages 2b + 3 + 4 on sm_90a: writes o (and final when given) from q, k, v, beta and kkt_solve's gcum and
    Tinv. Launched through the host path (host.launches: the compiled kernel's handle; descriptors from templates),
    on `stream` (None: the current one)."""
    from linattn.ops.gated_delta_rule.gluon.host import launches
    from linattn.runtime.device import device_facts
    cfg = config or fused_wu_config(plan.N, v.shape[-2], v.shape[-1], device_facts(q.device).num_sms)
    kernel, grid, args, kwargs = fused_wu_launch(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, cfg,
                                                 select)
    launches(kernel, grid, args, kwargs, stream=stream)


def kkt_solve(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan, HV: int):
    """Stage 2a: gcum fp32 [T_tot, HV] and Tinv [T_tot, HV, 64] in k's dtype, the precision the fused kernels
    multiply it at. The Gluon kernel (gluon/kkt_solve.py) where kkt_gluon_supported takes the call (bf16, K = 128:
    faster than the Triton kernel at every production row, benchmarks/RESULTS.md), else the Triton kernel
    (triton/intra_split.py, its frozen config and kkt_order's program order)."""
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    from linattn.ops.gated_delta_rule.gluon.host import launches
    from linattn.ops.gated_delta_rule.triton.intra_split import kkt_order, kkt_solve_kernel, split_intra_config
    from linattn.runtime.alloc import empty
    if gk.kkt_gluon_supported(k, HV, plan.T_total)[0]:
        return gk.kkt_solve_gluon(k, g, beta, plan, HV)
    H, K = k.shape[-2], k.shape[-1]
    cfg = split_intra_config(K, K)
    gcum = empty(plan.T_total, HV, dtype=torch.float32, device=k.device)
    tinv = empty(plan.T_total, HV, BT, dtype=k.dtype, device=k.device)
    launches(kkt_solve_kernel, (plan.num_slots, HV), (k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N),
             dict(H=H, HV=HV, K=K, BT=BT, BK=cfg.BK_kkt, DOT_PREC=dot_precision(k.dtype),
                  num_warps=cfg.warps_kkt, **kkt_order(plan.num_slots)))
    return gcum, tinv


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> tuple:
    """(side stream, four events) per device for the segment-parallel forward. The stream has the highest priority
    (-100, mapped to the highest valid): the unsegmented heads' launch (their chains are the critical path) and, with
    the warm-up in the kernel, the window kernel before it (_segments). The two launches overlap cleanly (both = the
    longer + 13 us at mixed decay); their order and priority move the time by ~10-20 us (benchmarks/OPT_LOG.md).
    The events are reused by every call: a wait orders against the event's latest record, made by the same call
    just before (the host path is one thread per device), and that holds inside a CUDA-graph capture too."""
    key = torch.device(device).index
    if key is None:
        key = torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = (torch.cuda.Stream(device=key, priority=-100),) + tuple(
            torch.cuda.Event() for _ in range(4))
    return _SIDE_STREAMS[key]


def prepare_segments(B: int, T: int, S: int, L: int, device) -> None:
    """Build the segment launch's kept state for (B, T, S, L) on device: the segment plan (segment_start's cache)
    and, on a GPU, the side stream and its events (chunk_fused_gf.gf_prepare_capture calls it before a capture)."""
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    segment_plan(B, T, S, L, device)
    if torch.device(device).type == "cuda":
        _side_stream(device)


def chunk_gated_delta_rule_fwd_fused_wu(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                        output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                                        fused_pass=None, segments=None, segment_pass=None):
    """The whole forward: kkt_solve (stage 2a), then stages 2b + 3 + 4 in one launch. Same arguments as
    triton/forward.py chunk_gated_delta_rule_fwd; returns its FwdResult with o, final_state, gcum, tinv (stage 2a's,
    in k's dtype) and the plan (w, u, h, vnew None: never stored). For the op linattn::chunk_gdn_fwd_gluon, whose
    backward keeps gcum and tinv and recomputes the rest from the saved inputs. fused_pass(q, k, v, beta, gcum, tinv,
    o, h0, final, plan, scale, select=None) replaces the W/U kernel's launch (the gate-free kernel; CPU tests pass the
    schedule model).
    segments = (S, L) (chunk_fused_gf.gf_segments_wanted): each sequence is cut into S segments of L chunks, each
    started a gate-truncated warm-up early (exact where the window reaches the sequence start; segment_start.py).
    A (sequence, head) none of whose segments is flagged (every warm-up window short enough) runs as S independent
    segments: one launch of segment_pass (the gate-free kernel; same arguments as fused_pass, with select and seg) on
    the segment plan (segment_start.segment_plan), whose CTAs read their segment word (the warm-up length, h0 or 0,
    last segment or not); the others (slow decay somewhere) run unsegmented: one launch of fused_pass on the
    sequence plan, selected to them, on a side stream so that both run at once (no host synchronisation: the
    selection is read in the kernels). Both launches read h0 and write the final state straight from / into the
    caller's tensors; _segments gives the order on the GPU."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.forward import FwdResult
    from linattn.runtime.alloc import empty
    from linattn.runtime.launch_list import keep
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    plan = make_chunk_plan(B, T, cu_seqlens, BT, q.device)
    if cu_seqlens is None:                     # a cached plan: a launch list may keep its tensors (launcher.py)
        keep(plan)
    run = fused_pass or chunk_fused_wu_ws_gluon
    S, L = segments or (1, -(-T // BT))
    if S > 1:
        if cu_seqlens is not None:
            raise ValueError("segments: fixed-length batches only (cu_seqlens given)")
        o, final, gcum, tinv = _segments(run, segment_pass or run, q, k, v, g, beta, scale, initial_state,
                                         output_final_state, plan, S, L)
        return FwdResult(o, final, gcum, None, None, None, None, tinv, plan)
    gcum, tinv = kkt_solve(k, g, beta, plan, HV)
    o = empty(B, T, HV, V, dtype=v.dtype, device=q.device)
    final = empty(plan.N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    run(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale)
    return FwdResult(o, final, gcum, None, None, None, None, tinv, plan)


def _segments(run, seg_run, q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, plan, S: int,
              L: int):
    """The segment-parallel forward, each segment's warm-up inside the fused kernel: (o, final, gcum, tinv); `run`
    launches the unsegmented pairs (sequence plan, select), `seg_run` the segments (segment plan, select and seg).
    Order on the GPU (no host synchronisation; two streams joined at the end):
      side stream (highest priority): segment_window_kernel (segment words, slow; slow zeroed on the main stream) from the inputs k,
                    beta and g, next to kkt_solve (its CTAs dispatched ahead of kkt_solve's pending ones); then, once
                    kkt_solve is done, the unsegmented launch of the pairs with slow != 0 (sequence plan): their
                    chains are the critical path wherever a pair is slow, so they take the SMs first
      main stream:  kkt_solve; then, once the window kernel is done, the segment launch (segment plan; its segments
                    of the pairs with slow != 0 exit at once)
    Two other orders were measured (the window kernel after kkt_solve on the main stream; the window kernel and the
    segment launch on a default-priority side stream); neither was faster (benchmarks/OPT_LOG.md).
    Both launches read h0 and store the final state straight from / into the caller's [B, HV, K, V] tensors."""
    from linattn.ops.gated_delta_rule.gluon.host import launches
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan, segment_window_buffers, segment_windows
    from linattn.runtime.alloc import empty
    from linattn.runtime.launch_list import keep, record_event, wait_event
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    splan = segment_plan(B, T, S, L, q.device)
    keep(splan)
    o = empty(B, T, HV, V, dtype=v.dtype, device=q.device)
    final = empty(B, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None

    def segment_launch():
        seg_run(q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V),
                beta.reshape(1, B * T, HV), gcum, tinv, o.view(1, B * T, HV, V), initial_state, final, splan, scale,
                select=slow, seg=segw)

    if not q.is_cuda:                          # one stream (CPU tests: the interpreter, the schedule model)
        slow, _, segw = segment_windows(k, beta, g, plan, S, L, launch=launches)
        gcum, tinv = kkt_solve(k, g, beta, plan, HV)
        run(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, select=slow)
        segment_launch()
        return o, final, gcum, tinv
    # Every buffer is allocated on the current stream, which waits for the side stream before returning: a buffer
    # freed after the call is reused only after the side stream's work. Launches name their stream (no switch of the
    # current stream, no per-call event or stream objects: they cost more host time than the launches).
    # (the event steps through launch_list, which records them for a launch list of the call: launcher.py)
    side, inputs_ready, window_done, kkt_done, side_done = _side_stream(q.device)
    cur = torch.cuda.current_stream(q.device)
    slow, flag, segw = segment_window_buffers(plan.N, S, HV, q.device)
    record_event(inputs_ready, cur)
    wait_event(side, inputs_ready)
    segment_windows(k, beta, g, plan, S, L, launch=launches, out=(slow, flag, segw), stream=side)
    record_event(window_done, side)
    gcum, tinv = kkt_solve(k, g, beta, plan, HV)
    record_event(kkt_done, cur)
    wait_event(side, kkt_done)
    run(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale, select=slow, stream=side)
    record_event(side_done, side)
    wait_event(cur, window_done)
    segment_launch()
    wait_event(cur, side_done)
    return o, final, gcum, tinv
