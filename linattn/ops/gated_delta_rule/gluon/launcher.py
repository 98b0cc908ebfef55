"""Launchers of the gluon backend's forward and of its Gluon state pass (stage 3).

`chunk_gated_delta_rule_fwd_gluon` is the forward of the op linattn::chunk_gdn_fwd_gluon: stage 2a (kkt_solve),
then stages 2b + 3 + 4 in one warp-specialised launch (fused_forward.py): the gate-free BV = 128 kernel
(chunk_fused_gf.py) where a wave of sequence-heads fills the GPU (gf_wanted), in segments where the batch leaves
SMs idle (gf_segments_wanted), else the W/U kernel (chunk_fused_wu_ws.py).

`fwd_eager` is that forward for a plain eager fixed-length call (backend.impl): per call signature it records the
call's buffers, launches and event steps once and replays them on later calls with their pointers
(runtime/launch_list.py), so a repeat call costs its allocations and four `run` calls of host time.

`chunk_state_gluon` is a state pass from W and U (triton/forward.py's `state_pass` hook; context parallelism's local
pass, distributed/chunk.py, where few sequence-heads run): the same tensors in (k, w, u, gcum, initial state, chunk
plan) and out (h, vnew, final state) as the Triton state kernel, K == V == 128 and 16-bit operands (backend.py
checks the call). It keeps a launch plan per call
signature (config, grid, constexprs, one descriptor template per TMA operand) and launches through the compiled
kernel's handle after the first call (gluon/host.py), instead of four TensorDescriptor.from_tensor and the JIT's
binding per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from linattn.ops.gated_delta_rule.gluon.host import aligned, gl_dtype, host_path
from linattn.runtime.alloc import poisoning
from linattn.runtime.host_path import DescriptorFactory, PlanCache, current_device, hooks_active, launch
from linattn.runtime.launch_list import SignatureLists, signature

BT = 64


@dataclass(frozen=True)
class StateConfig:
    BV: int
    num_warps: int
    stages: int          # TMA ring depth


def state_config(N: int, HV: int, V: int, num_sms: int) -> StateConfig:
    """V split as the Triton state pass: BV=64 unless that leaves SMs idle, then 32. 4 warps (one warpgroup: wgmma
    needs exactly that). Stages: 3 where one CTA per SM is all there is (<= num_sms programs), 2 otherwise (shared
    memory for 2 CTAs per SM)."""
    bv = 64
    while bv > 32 and N * HV * (V // bv) < num_sms:
        bv //= 2
    programs = N * HV * (V // bv)
    stages = 3 if programs <= num_sms else 2
    return StateConfig(bv, 4, stages)


class StatePlan:
    """What one state-pass launch needs that depends only on the call signature (state_plan_key)."""
    __slots__ = ("kernel", "cfg", "grid", "constexprs", "options", "descs", "views", "handles")


def state_plan_key(k, w, u, gcum, h, vnew, initial_state, final, plan, config, decay: str = "scalar"):
    """Everything the plan and the compiled kernel depend on: the config; k's shape and strides (its descriptor
    view), u's shape (HV, V), the plan's N / T_total / slots (grid, descriptor rows); every tensor argument's dtype
    and 16-byte alignment (the JIT specialises pointers on both); initial/final state present; the device (its SM
    count picks the config)."""
    h0 = initial_state if initial_state is not None else gcum
    ht = final if final is not None else gcum
    cu, offs = plan.cu, plan.chunk_offsets
    # all 16-byte aligned (torch allocations are): one bit; otherwise the bit of each pointer
    aligned_all = not ((k.data_ptr() | w.data_ptr() | u.data_ptr() | gcum.data_ptr() | h.data_ptr()
                        | vnew.data_ptr() | h0.data_ptr() | ht.data_ptr() | cu.data_ptr() | offs.data_ptr()) & 15)
    return (config, decay, k.shape, k.stride(), u.shape, plan.N, plan.T_total, plan.num_slots,
            initial_state is not None, final is not None, k.device,
            k.dtype, w.dtype, u.dtype, gcum.dtype, h.dtype, vnew.dtype, h0.dtype, ht.dtype, cu.dtype, offs.dtype,
            True if aligned_all else tuple(t.data_ptr() % 16 == 0 for t in (k, w, u, gcum, h, vnew, h0, ht, cu, offs)))


def _make_state_plan(k, w, u, h, plan, config, use_h0: bool, store_ht: bool, decay: str = "scalar") -> StatePlan:
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import chunk_state_fwd_tma_kernel as kern
    from linattn.runtime.device import device_facts
    from linattn.runtime.gluon_compat import TensorDescriptor, gl
    H, K = k.shape[-2], k.shape[-1]
    HV, V = u.shape[1], u.shape[2]
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    cfg = config or state_config(N, HV, V, device_facts(k.device).num_sms)
    sp = StatePlan()
    sp.cfg = cfg
    sp.grid = (V // cfg.BV, N * HV, 1)
    consts = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, USE_H0=use_h0, STORE_HT=store_ht, STAGES=cfg.stages,
                  DECAY=decay)
    gdt = gl_dtype(k.dtype)
    # the 2-D views k [T_tot, H*K], w [T_tot, HV*K], u [T_tot, HV*V], h [slots*HV*K, V]; the templates take this
    # call's view strides (k's follow its strides, part of the key; the others are the forward's contiguous
    # buffers) after the alignment copy that the same key's later calls make too
    sp.views = ((T_tot, H * K), (T_tot, HV * K), (T_tot, HV * V), (slots * HV * K, V))
    first = (aligned(k.reshape(sp.views[0])), aligned(w.view(sp.views[1])), aligned(u.view(sp.views[2])),
             h.view(sp.views[3]))
    blocks = ([BT, K], [BT, K], [BT, cfg.BV], [K, cfg.BV])
    sp.descs = tuple(DescriptorFactory(TensorDescriptor, list(t.shape), list(t.stride()), b,
                                       gl.NVMMASharedLayout.get_default_for(b, gdt), host_path)
                     for t, b in zip(first, blocks))
    sp.kernel = kern
    names = kern.arg_names
    first_const = names.index("H")
    assert names[first_const:] == list(consts), (names, list(consts))
    sp.constexprs = tuple(consts.values())
    sp.options = {"num_warps": cfg.num_warps}
    sp.handles = {}
    return sp


_PLANS = PlanCache(host_path)


def cached_state_args(k, w, u, gcum, h, vnew, initial_state, final, plan, config: Optional[StateConfig] = None,
                      decay: str = "scalar"):
    """(plan, args): the cached plan of this call's signature and the kernel's full positional argument list
    (runtime arguments, then the constexprs in the kernel's order). decay "channel": KDA's recompute (k the decayed
    keys per value head, gcum [T_tot, HV, K]; chunk_state_tma.chunk_state_fwd_tma_kernel's DECAY)."""
    HV = u.shape[1]
    if decay == "channel":
        if k.shape[-2] != HV or tuple(gcum.shape) != (plan.T_total, HV, k.shape[-1]):
            raise ValueError(f"decay 'channel' takes k as the decayed keys per value head [..., {HV}, K] and gcum "
                             f"[T_tot, {HV}, K]; got k {tuple(k.shape)}, gcum {tuple(gcum.shape)}")
    elif decay != "scalar":
        raise ValueError(f"decay must be 'scalar' or 'channel', got {decay!r}")
    key = state_plan_key(k, w, u, gcum, h, vnew, initial_state, final, plan, config, decay)
    sp = _PLANS.get(key, lambda: _make_state_plan(k, w, u, h, plan, config, initial_state is not None,
                                                   final is not None, decay))
    h0 = initial_state if initial_state is not None else gcum
    ht = final if final is not None else gcum
    if h.data_ptr() % 16:
        raise ValueError("h must be 16-byte aligned for the TMA store (the forward allocates it)")
    kd, wd, ud, hd = sp.descs
    kv, wv, uv, hv = sp.views
    # descriptors: the template's copy with this call's base where the view's shape and strides are the
    # template's (always, for tensors of this signature); built and validated afresh otherwise
    args = (kd.over(aligned(k.reshape(kv))), wd.over(aligned(w.view(wv))), ud.over(aligned(u.view(uv))), gcum,
            hd.over(h.view(hv)), vnew, h0, ht, plan.cu, plan.chunk_offsets)
    return sp, args + sp.constexprs


def chunk_state_gluon(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gcum: torch.Tensor, h: torch.Tensor,
                      vnew: torch.Tensor, initial_state: Optional[torch.Tensor], final: Optional[torch.Tensor],
                      plan, config: Optional[StateConfig] = None, decay: str = "scalar") -> None:
    """The state pass on sm_90a. k [B,T,H,K]; w [T_tot,HV,K]; u [T_tot,HV,V]; gcum [T_tot,HV] fp32 (all
    contiguous); writes h [slots,HV,K,V] (k's dtype), vnew [T_tot,HV,V] and, if given, final [N,HV,K,V] fp32;
    initial_state [N,HV,K,V] fp32 or None. plan: the ChunkPlan of triton/chunk_indices.py. decay "channel" (KDA):
    k the decayed keys [T_tot,HV,K], gcum [T_tot,HV,K] (cached_state_args)."""
    sp, args = cached_state_args(k, w, u, gcum, h, vnew, initial_state, final, plan, config, decay)
    launch(host_path, sp.kernel, sp.handles, "state", sp.grid, args, sp.options)


def clear_plans() -> None:
    """Forget every state-pass launch plan."""
    _PLANS.clear()


def chunk_gated_delta_rule_fwd_gluon(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                     output_final_state: bool, cu_seqlens: Optional[torch.Tensor]):
    """The gluon forward: o, the final state, stage 2a's gcum and tinv and the plan as a triton/forward.py FwdResult
    (the autograd forward keeps gcum and tinv; the backward recomputes the rest). q, k, v bf16/fp16 with K == V ==
    128 (backend.supports)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf as gfm
    from linattn.ops.gated_delta_rule.gluon.fused_forward import chunk_gated_delta_rule_fwd_fused_wu
    from linattn.runtime.capture import capturing
    from linattn.runtime.device import device_facts
    # The gate-free BV=128 kernel: in segments where the batch leaves SMs idle (gf_segments_wanted; the pairs the
    # window kernel flags run unsegmented on the W/U kernel), else where a wave of sequence-heads fills the GPU
    # (gf_wanted); the W/U kernel otherwise.
    if gfm.gf_supported(q, v)[0]:
        cap = capturing(q)
        S, L = gfm.gf_segments_wanted(q.shape[0], q.shape[1], v.shape[2], cu_seqlens, q.device, capturing=cap)
        if S > 1:
            return chunk_gated_delta_rule_fwd_fused_wu(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       cu_seqlens, segments=(S, L),
                                                       segment_pass=gfm.chunk_fused_gf_gluon)
        if not cap and cu_seqlens is None:
            gfm.gf_prepare_capture(q.shape[0], q.shape[1], v.shape[2], q.device)
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if gfm.gf_wanted(N, v.shape[2], device_facts(q.device).num_sms):
            return chunk_gated_delta_rule_fwd_fused_wu(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       cu_seqlens, fused_pass=gfm.chunk_fused_gf_gluon)
    return chunk_gated_delta_rule_fwd_fused_wu(q, k, v, g, beta, scale, initial_state, output_final_state,
                                               cu_seqlens)


# Per call signature of a plain eager fixed-length forward: its launch list (runtime/launch_list.py). A repeat call
# then allocates its buffers and makes the recorded launches and event steps with its own pointers: ~4 launches'
# worth of host time instead of the host path's plans, descriptors and launch keys.
EAGER_LISTS = SignatureLists(host_path, current_device, hooks_active, poisoning)


def fwd_eager(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
              keep: bool = False):
    """(o, final state or None) of chunk_gated_delta_rule_fwd_gluon for a plain eager call without cu_seqlens (not
    under CUDA-graph capture; the caller checks), through the signature's launch list when it has one. keep: (o,
    final state or None, gcum, tinv), stage 2a's outputs too (what the autograd forward keeps for the backward)."""
    h0 = initial_state
    key = _eager_key(q, k, v, g, beta, scale, h0, output_final_state, keep)

    def outputs(res):
        out = (res.o, res.final_state if output_final_state else None)
        return out + (res.gcum, res.tinv) if keep else out
    return EAGER_LISTS(key, (q, k, v, g, beta, h0),
                       lambda: chunk_gated_delta_rule_fwd_gluon(q, k, v, g, beta, scale, h0, output_final_state, None),
                       outputs)


def _eager_key(q, k, v, g, beta, scale: float, h0, output_final_state: bool, keep: bool) -> tuple:
    return (q.shape, q.stride(), k.stride(), v.shape, v.stride(), g.stride(), beta.stride(), q.dtype, k.dtype,
            v.dtype, g.dtype, beta.dtype, q.device, signature(h0), scale, output_final_state, keep)


def eager_direct(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool):
    """A replay of the LaunchList fwd_eager keeps for this call's signature (keep False), as a function of a repeat
    call's (q, k, v, g, beta, initial_state) returning (o, final state or None), or None where there is no list
    (SignatureLists.direct)."""
    return EAGER_LISTS.direct(_eager_key(q, k, v, g, beta, scale, initial_state, output_final_state, False))
