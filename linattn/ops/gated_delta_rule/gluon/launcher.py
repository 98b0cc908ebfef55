"""Launchers of the Gluon state pass (stage 3) and of the forward that uses it.

`chunk_state_gluon` is a drop-in for the Triton launch of `chunk_state_fwd_kernel` in triton/forward.py: the
same tensors in (k, w, u, gcum, initial state, chunk plan) and out (h, vnew, final state).
`chunk_gated_delta_rule_fwd_gluon` runs the Triton intra-chunk and output stages around it.

Variants (benchmarks/GLUON_FWD.md): "literal" (masked global loads, mma.sync), "tma" (TMA ring, mma.sync),
"wgmma" (TMA ring, warpgroup_mma). All need K == V == 128 and 16-bit q/k/v (backend.py checks the call).

Host path (linattn/runtime/host_path.py, as the matmul's): `chunk_state_gluon` keeps a launch plan per call
signature (kernel, config, grid, constexprs, one descriptor template per TMA operand) and launches through the
compiled kernel's handle after the first call, instead of four TensorDescriptor.from_tensor and the JIT's
binding per call (~70 us per call on this CPU's simulation, ~150 us on the H200's host). `state_launch` is the
uncached path: LINATTN_GLUON_HOST_CACHE=0 (read at import) or `host_path.options(plan_cache=False,
handle=False)` takes it; tests/test_gluon_state_host.py checks that both give the kernel the same arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from linattn.runtime.host_path import DescriptorFactory, HostPath, LaunchCache, PlanCache, launch
from linattn.runtime.settings import settings

VARIANTS = ("literal", "tma", "wgmma")
DEFAULT_VARIANT = "wgmma"
BT = 64


@dataclass(frozen=True)
class StateConfig:
    BV: int
    num_warps: int
    stages: int          # TMA ring depth (unused by "literal")


def state_config(variant: str, N: int, HV: int, V: int, num_sms: int) -> StateConfig:
    """V split as the Triton state pass (forward._configs): BV=64 unless that leaves SMs idle, then 32.
    Warps: 8 for "literal" at BV=64 (4 warps spill: its tiles pass through registers), else 4 (one warpgroup;
    wgmma needs exactly that, and "tma" at 4 warps leaves room for 2 CTAs per SM).
    Stages: 3 where one CTA per SM is all there is (<= num_sms programs), 2 otherwise (smem for 2 CTAs/SM at 4
    warps; AOT numbers in GLUON_FWD.md)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Gluon state-pass variant {variant!r}; choose one of {VARIANTS}")
    bv = 64
    while bv > 32 and N * HV * (V // bv) < num_sms:
        bv //= 2
    programs = N * HV * (V // bv)
    warps = 8 if (variant == "literal" and bv == 64) else 4
    stages = 3 if programs <= num_sms else 2
    return StateConfig(bv, warps, stages)


def _gl_dtype(dtype: torch.dtype):
    from linattn.runtime.gluon_compat import gl
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a 16-byte aligned base; a contiguous view at an odd offset is copied."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def state_launch(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gcum: torch.Tensor, h: torch.Tensor,
                 vnew: torch.Tensor, initial_state: Optional[torch.Tensor], final: Optional[torch.Tensor], plan,
                 variant: str, cfg: StateConfig):
    """(kernel, grid, args, kwargs) of one state-pass launch. Separate from the launch itself so that a CPU test
    can check the arguments (descriptor types) against the AOT signatures of aot.py."""
    H, K = k.shape[-2], k.shape[-1]
    HV, V = u.shape[1], u.shape[2]
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    h0 = initial_state if initial_state is not None else gcum
    ht = final if final is not None else gcum
    kwargs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, USE_H0=initial_state is not None,
                  STORE_HT=final is not None, num_warps=cfg.num_warps)
    grid = (V // cfg.BV, N * HV)
    if variant == "literal":
        from linattn.ops.gated_delta_rule.gluon.chunk_state_literal import chunk_state_fwd_literal_kernel
        args = (k, w, u, gcum, h, vnew, h0, ht, plan.cu, plan.chunk_offsets)
        return chunk_state_fwd_literal_kernel, grid, args, kwargs
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import chunk_state_fwd_tma_kernel
    from linattn.runtime.gluon_compat import TensorDescriptor, gl
    gdt = _gl_dtype(k.dtype)

    def desc(t2d, block):
        return TensorDescriptor.from_tensor(_aligned(t2d), block, gl.NVMMASharedLayout.get_default_for(block, gdt))

    if h.data_ptr() % 16:
        raise ValueError("h must be 16-byte aligned for the TMA store (the forward allocates it)")
    args = (desc(k.reshape(T_tot, H * K), [BT, K]), desc(w.view(T_tot, HV * K), [BT, K]),
            desc(u.view(T_tot, HV * V), [BT, cfg.BV]), gcum, desc(h.view(slots * HV * K, V), [K, cfg.BV]),
            vnew, h0, ht, plan.cu, plan.chunk_offsets)
    kwargs.update(STAGES=cfg.stages, USE_WGMMA=variant == "wgmma")
    return chunk_state_fwd_tma_kernel, grid, args, kwargs


def chunk_state_gluon(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gcum: torch.Tensor, h: torch.Tensor,
                      vnew: torch.Tensor, initial_state: Optional[torch.Tensor], final: Optional[torch.Tensor],
                      plan, variant: str = DEFAULT_VARIANT, config: Optional[StateConfig] = None) -> None:
    """The state pass on sm_90a. k [B,T,H,K]; w [T_tot,HV,K]; u [T_tot,HV,V]; gcum [T_tot,HV] fp32 (all
    contiguous); writes h [slots,HV,K,V] (k's dtype), vnew [T_tot,HV,V] and, if given, final [N,HV,K,V] fp32;
    initial_state [N,HV,K,V] fp32 or None. plan: the ChunkPlan of triton/chunk_indices.py."""
    if not host_path.plan_cache:
        from linattn.runtime.device import device_facts
        cfg = config or state_config(variant, plan.N, u.shape[1], u.shape[2], device_facts(k.device).num_sms)
        kernel, grid, args, kwargs = state_launch(k, w, u, gcum, h, vnew, initial_state, final, plan, variant, cfg)
        kernel[grid](*args, **kwargs)
        return
    sp, args = cached_state_args(k, w, u, gcum, h, vnew, initial_state, final, plan, variant, config)
    launch(host_path, sp.kernel, sp.handles, "state", sp.grid, args, sp.options)


# ---------------------------------------------------------------- cached host path

host_path = HostPath(plan_cache=settings.gluon_host_cache, handle=settings.gluon_host_cache)
# The fused forward's other launches (chunk_fused_wu_ws / chunk_fused_gf, stage 2a's kkt_solve, the segment window
# kernel) through the same host path since round 24: the compiled kernel per launch signature, launched through its
# handle (host_path.LaunchCache); their TMA descriptors from templates (chunk_fused_wu_ws._fused_desc).
launches = LaunchCache(host_path)


class StatePlan:
    """What one state-pass launch needs that depends only on the call signature (state_plan_key)."""
    __slots__ = ("kernel", "cfg", "grid", "constexprs", "options", "descs", "views", "handles")


def state_plan_key(k, w, u, gcum, h, vnew, initial_state, final, plan, variant, config):
    """Everything the plan and the compiled kernel depend on: the variant and config; k's shape and strides (its
    descriptor view), u's shape (HV, V), the plan's N / T_total / slots (grid, descriptor rows); every tensor
    argument's dtype and 16-byte alignment (the JIT specialises pointers on both); initial/final state present;
    the device (its SM count picks the config)."""
    h0 = initial_state if initial_state is not None else gcum
    ht = final if final is not None else gcum
    cu, offs = plan.cu, plan.chunk_offsets
    # all 16-byte aligned (torch allocations are): one bit; otherwise the bit of each pointer
    aligned = not ((k.data_ptr() | w.data_ptr() | u.data_ptr() | gcum.data_ptr() | h.data_ptr() | vnew.data_ptr()
                    | h0.data_ptr() | ht.data_ptr() | cu.data_ptr() | offs.data_ptr()) & 15)
    return (variant, config, k.shape, k.stride(), u.shape, plan.N, plan.T_total, plan.num_slots,
            initial_state is not None, final is not None, k.device,
            k.dtype, w.dtype, u.dtype, gcum.dtype, h.dtype, vnew.dtype, h0.dtype, ht.dtype, cu.dtype, offs.dtype,
            True if aligned else tuple(t.data_ptr() % 16 == 0 for t in (k, w, u, gcum, h, vnew, h0, ht, cu, offs)))


def _make_state_plan(k, w, u, h, plan, variant, config, use_h0: bool, store_ht: bool) -> StatePlan:
    from linattn.runtime.device import device_facts
    H, K = k.shape[-2], k.shape[-1]
    HV, V = u.shape[1], u.shape[2]
    N, T_tot, slots = plan.N, plan.T_total, plan.num_slots
    cfg = config or state_config(variant, N, HV, V, device_facts(k.device).num_sms)
    sp = StatePlan()
    sp.cfg = cfg
    sp.grid = (V // cfg.BV, N * HV, 1)
    consts = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg.BV, USE_H0=use_h0, STORE_HT=store_ht)
    if variant == "literal":
        from linattn.ops.gated_delta_rule.gluon.chunk_state_literal import chunk_state_fwd_literal_kernel as kern
        sp.descs = sp.views = None
    else:
        from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import chunk_state_fwd_tma_kernel as kern
        from linattn.runtime.gluon_compat import TensorDescriptor, gl
        consts.update(STAGES=cfg.stages, USE_WGMMA=variant == "wgmma")
        gdt = _gl_dtype(k.dtype)
        # the 2-D views k [T_tot, H*K], w [T_tot, HV*K], u [T_tot, HV*V], h [slots*HV*K, V]; the templates take
        # this call's view strides (k's follow its strides, part of the key; the others are the forward's
        # contiguous buffers) after the alignment copy that the same key's later calls make too
        sp.views = ((T_tot, H * K), (T_tot, HV * K), (T_tot, HV * V), (slots * HV * K, V))
        first = (_aligned(k.reshape(sp.views[0])), _aligned(w.view(sp.views[1])), _aligned(u.view(sp.views[2])),
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


def cached_state_args(k, w, u, gcum, h, vnew, initial_state, final, plan, variant: str = DEFAULT_VARIANT,
                      config: Optional[StateConfig] = None):
    """(plan, args): the cached plan of this call's signature and the kernel's full positional argument list
    (runtime arguments, then the constexprs in the kernel's order), equal to state_launch's args and kwargs."""
    key = state_plan_key(k, w, u, gcum, h, vnew, initial_state, final, plan, variant, config)
    sp = _PLANS.get(key, lambda: _make_state_plan(k, w, u, h, plan, variant, config, initial_state is not None,
                                                   final is not None))
    h0 = initial_state if initial_state is not None else gcum
    ht = final if final is not None else gcum
    if sp.descs is None:
        return sp, (k, w, u, gcum, h, vnew, h0, ht, plan.cu, plan.chunk_offsets) + sp.constexprs
    if h.data_ptr() % 16:
        raise ValueError("h must be 16-byte aligned for the TMA store (the forward allocates it)")
    kd, wd, ud, hd = sp.descs
    kv, wv, uv, hv = sp.views
    # descriptors: the template's copy with this call's base where the view's shape and strides are the
    # template's (always, for tensors of this signature); built and validated afresh otherwise
    args = (kd.over(_aligned(k.reshape(kv))), wd.over(_aligned(w.view(wv))), ud.over(_aligned(u.view(uv))), gcum,
            hd.over(h.view(hv)), vnew, h0, ht, plan.cu, plan.chunk_offsets)
    return sp, args + sp.constexprs


def clear_plans() -> None:
    """Forget every state-pass launch plan."""
    _PLANS.clear()


def chunk_gated_delta_rule_fwd_gluon(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                     output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                                     variant: str = DEFAULT_VARIANT, state_pass=None, keys_normalised: bool = False,
                                     need_intermediates: bool = True):
    """The forward of triton/forward.py with the state pass (stage 3) in Gluon: Triton intra-chunk (stage 2),
    Gluon state pass, Triton output (stage 4), through chunk_gated_delta_rule_fwd's `state_pass` hook, so the
    Triton stages are launched by the one launcher they have. Same arguments and result (a FwdResult) as
    chunk_gated_delta_rule_fwd; q, k, v bf16/fp16 with K == V == 128.
    state_pass(k, w, u, gcum, h, vnew, initial_state, final, plan) replaces the Gluon state pass (a CPU test
    runs this orchestration with the Triton state kernel under the interpreter).
    keys_normalised (use_qk_l2norm_in_kernel): with LINATTN_GDN_SEGMENT_WARMUP=1 the state pass may run segment-
    parallel with warm-ups (chunk_state_warmup_tma.gluon_warmup_wanted); otherwise unused.
    need_intermediates=False (the op linattn::chunk_gdn_fwd_gluon: it returns only o and the final state): with
    LINATTN_GDN_GLUON_FUSED_WS on (the default since round 14; "0" turns it off), no state_pass and a call
    chunk_fused_ws.fused_ws_supported takes, stages 3 and 4
    run as the warp-specialised Gluon kernel (gluon/chunk_fused_ws.py; result's h and vnew None); with
    LINATTN_GDN_GLUON_FUSED_WU on (the default since round 15; "0" turns it off) W and U are formed inside that
    kernel instead (gluon/chunk_fused_wu_ws.py: kkt_solve, then the fused kernel; no wu_kernel); with the opt-in
    gate-free BV=128 kernel (gluon/chunk_fused_gf.py) where chunk_fused_gf.gf_wanted holds (default since round 22;
    LINATTN_GDN_GLUON_GF128: "1" always, "0" never), and in segments where chunk_fused_gf.gf_segments_wanted splits
    (default since round 23: fixed-length calls whose sequence-heads leave SMs idle, under CUDA-graph capture or from
    32768 tokens; LINATTN_GDN_GLUON_GF_SEGMENTS); the W/U kernel's opt-in segments (LINATTN_GDN_GLUON_SEGMENTS=1)
    take precedence over both."""
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, chunk_gated_delta_rule_fwd
    assert CHUNK == BT
    if settings.gdn_gluon_fused_wu and not need_intermediates and state_pass is None:
        from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws
        if chunk_fused_wu_ws.fused_wu_supported(q, v, beta, cu_seqlens)[0]:
            from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf as gfm
            gf = None
            if settings.gdn_gluon_gf128 != "off" and not settings.gdn_gluon_segments and gfm.gf_supported(q, v)[0]:
                # stages 2b+3+4 at BV=128 in the gate-free form (gluon/chunk_fused_gf.py): in segments where its
                # segment launch is on and the batch leaves SMs idle (gf_segments_wanted; the pairs the window
                # kernel flags run unsegmented on the W/U kernel); else by default where a wave of sequence-heads
                # fills the GPU (gf_wanted), everywhere with "1"
                from linattn.ops.gated_delta_rule.gluon.backend import _capturing
                from linattn.runtime.device import device_facts
                S, L = gfm.gf_segments_wanted(q.shape[0], q.shape[1], v.shape[2], cu_seqlens, q.device,
                                              capturing=_capturing(q))
                if S > 1:
                    return chunk_fused_wu_ws.chunk_gated_delta_rule_fwd_fused_wu(
                        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, segments=(S, L),
                        segment_pass=gfm.chunk_fused_gf_gluon)
                N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
                if settings.gdn_gluon_gf128 == "on" or gfm.gf_wanted(N, v.shape[2], device_facts(q.device).num_sms):
                    gf = gfm.chunk_fused_gf_gluon
            return chunk_fused_wu_ws.chunk_gated_delta_rule_fwd_fused_wu(q, k, v, g, beta, scale, initial_state,
                                                                          output_final_state, cu_seqlens,
                                                                          fused_pass=gf)
    fused_pass = None
    if settings.gdn_gluon_fused_ws and not need_intermediates and state_pass is None:
        from linattn.ops.gated_delta_rule.gluon import chunk_fused_ws
        if chunk_fused_ws.fused_ws_supported(q, v, cu_seqlens)[0]:
            fused_pass = chunk_fused_ws.chunk_fused_ws_gluon
    if state_pass is None:
        def state_pass(k, w, u, gcum, h, vnew, h0, final, plan):
            if settings.gdn_segment_warmup:    # opt-in: the warm-up pass (benchmarks/GLUON_WARMUP.md)
                from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
                if gw.gluon_warmup_wanted(cu_seqlens, keys_normalised, plan, u.shape[1], u.shape[2], variant,
                                          k.device):
                    gw.chunk_state_warmup_gluon(k, w, u, gcum, h, vnew, h0, final, plan, variant)
                    return
            chunk_state_gluon(k, w, u, gcum, h, vnew, h0, final, plan, variant)
    return chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                      state_pass=state_pass, fused_pass=fused_pass)
