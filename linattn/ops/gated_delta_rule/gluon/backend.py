"""The "gluon" backend of chunk_gated_delta_rule: Triton intra-chunk and output stages, Gluon state pass (sm_90a).

Registered by api.py with auto=True and an auto filter (_auto_filter): `auto` takes it only for the calls where it
was measured faster than the Triton forward (few sequence-heads, and either a long call or a CUDA-graph capture);
by name (backend="gluon" or LINATTN_BACKEND=gluon) it takes every call supports() accepts. The forward is the torch custom op
"linattn::chunk_gdn_fwd_gluon" (fake impl and autograd as the Triton op's); its backward is the Triton backward
("linattn::chunk_gdn_bwd"), which recomputes the intermediates from the saved inputs, so gradients do not depend
on the variant. The state-pass variant comes from LINATTN_GDN_GLUON_VARIANT (literal | tma | wgmma), read per
call; unset means the launcher's default. Gluon pieces of that backward ("linattn::chunk_gdn_bwd_gluon"), read per
backward: the reverse state pass (stage 1) runs gluon/chunk_state_bwd.py (LINATTN_GDN_GLUON_BWD_DH, on by default
since round 14), and the recompute of the forward's state pass takes the Gluon kernel where N*HV <= 64
(LINATTN_GDN_GLUON_BWD_STATE unset; "1" always, "0" never).

Nothing here imports Gluon at import time: supports() asks gluon_compat, the impl imports the launcher.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from linattn.runtime.settings import settings

DTYPES = (torch.bfloat16, torch.float16)


def selected_variant() -> str:
    from linattn.ops.gated_delta_rule.gluon.launcher import DEFAULT_VARIANT
    return settings.gdn_gluon_variant or DEFAULT_VARIANT


@torch.library.custom_op("linattn::chunk_gdn_fwd_gluon", mutates_args=())
def _chunk_gdn_fwd_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
                         cu_seqlens: Optional[torch.Tensor], variant: str, keys_normalised: bool = False
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    # keys_normalised: k was L2-normalised (use_qk_l2norm_in_kernel); lets LINATTN_GDN_SEGMENT_WARMUP=1 apply
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    res = chunk_gated_delta_rule_fwd_gluon(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                           variant, keys_normalised=keys_normalised, need_intermediates=False)
    final = res.final_state if output_final_state else q.new_empty(0, dtype=torch.float32)
    return res.o, final


@_chunk_gdn_fwd_gluon.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, variant, keys_normalised=False):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty((N, HV, K, V) if output_final_state else (0,), dtype=torch.float32)
    return v.new_empty(B, T, HV, V), final


@torch.library.custom_op("linattn::chunk_gdn_bwd_gluon", mutates_args=())
def _chunk_gdn_bwd_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                         do: torch.Tensor, dht: Optional[torch.Tensor], variant: str, recompute_state: bool,
                         state_bwd: bool
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton backward with its recomputed state pass in Gluon (recompute_state: LINATTN_GDN_GLUON_BWD_STATE=1)
    and/or its reverse state pass (stage 1) in Gluon (state_bwd: LINATTN_GDN_GLUON_BWD_DH=1)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_state_bwd as gluon_bwd
    from linattn.ops.gated_delta_rule.gluon import launcher
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd

    def state_pass(k_, w, u, gcum, h, vnew, h0, final, plan):
        launcher.chunk_state_gluon(k_, w, u, gcum, h, vnew, h0, final, plan, variant)

    def state_bwd_pass(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0_, plan, scale_):
        gluon_bwd.chunk_state_bwd_gluon(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0_, plan, scale_)
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, do.contiguous(),
        None if dht is None else dht.contiguous(), state_pass=state_pass if recompute_state else None,
        state_bwd=state_bwd_pass if state_bwd else None)
    if dh0 is None:
        dh0 = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dg, dbeta, dh0


@_chunk_gdn_bwd_gluon.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, variant, recompute_state, state_bwd):
    dh0 = (q.new_empty(0, dtype=torch.float32) if initial_state is None
           else initial_state.new_empty(initial_state.shape, dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    from linattn.ops.gated_delta_rule.api import _fwd_setup_context
    _fwd_setup_context(ctx, inputs[:9], output)          # the variant does not change what the backward needs
    ctx.variant = inputs[9]


# The backward's recompute of the forward state pass goes to the Gluon kernel (LINATTN_GDN_GLUON_BWD_STATE unset)
# where the Gluon state pass beats Triton's: N*HV <= 64 sequence-heads. Round 14 on an H200 (with the Gluon dh pass,
# results/2026-11-30_r14b_gluon_bwd_dh.json): backward 1.05x at B1 T8192/32768/65536 H16/HV32 (13.70 -> 13.03 ms at
# T65536); at B8 T4096 (N*HV = 256) 5.92 -> 5.95 ms, the state pass there 0.92x Triton's, so Triton.
GLUON_BWD_STATE_MAX_SEQ_HEADS = 64


def recompute_state_in_gluon(mode: str, q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> bool:
    """Whether the backward recomputes the state pass with the Gluon kernel: mode is settings.gdn_gluon_bwd_state."""
    if mode != "auto":
        return mode == "on"
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    return N * v.shape[2] <= GLUON_BWD_STATE_MAX_SEQ_HEADS


def _backward(ctx, do, dfinal):
    from linattn.ops.gated_delta_rule.api import _fwd_backward
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    recompute_state = recompute_state_in_gluon(settings.gdn_gluon_bwd_state, q, v, cu_seqlens)
    state_bwd = settings.gdn_gluon_bwd_dh
    if not (recompute_state or state_bwd):
        return (*_fwd_backward(ctx, do, dfinal), None, None)     # none for variant and keys_normalised
    dht = dfinal if (ctx.output_final_state and dfinal is not None) else None
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.linattn.chunk_gdn_bwd_gluon(q, k, v, g, beta, ctx.scale, initial_state,
                                                                       cu_seqlens, do, dht, ctx.variant,
                                                                       recompute_state, state_bwd)
    return dq, dk, dv, dg, dbeta, None, (dh0 if initial_state is not None else None), None, None, None, None


_chunk_gdn_fwd_gluon.register_autograd(_backward, setup_context=_setup_context)


def supports(q=None, v=None, cu_seqlens=None, **_) -> Tuple[bool, str]:
    if q is None:
        return False, "the Gluon state pass needs the call's tensors to decide"
    from linattn.runtime.device import hopper_gluon_ready
    ok, reason = hopper_gluon_ready(q, "the Gluon state pass")
    if not ok:
        return False, reason
    from linattn.ops.gated_delta_rule.gluon.launcher import VARIANTS
    variant = selected_variant()
    if variant not in VARIANTS:
        return False, f"LINATTN_GDN_GLUON_VARIANT={variant!r}: choose one of {', '.join(VARIANTS)}"
    if q.dtype not in DTYPES:
        return False, f"dtype {q.dtype}: the Gluon state pass takes bf16 or fp16 q/k/v"
    K, V = q.shape[-1], v.shape[-1]
    if K != 128 or V != 128:
        return False, f"K={K}, V={V}: the Gluon state pass is built for K == V == 128"
    if q.shape[0] * q.shape[1] == 0:
        return False, "no tokens: the TMA descriptors need a non-empty [T, heads*dim] view"
    HV = v.shape[2]
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    slots_bound = q.shape[0] * q.shape[1] // 64 + N          # chunk_indices.py's bound on the chunk slots
    if slots_bound * HV * K >= 2 ** 31:
        return False, "too many chunks for the 32-bit TMA row coordinate of the h store"
    return True, ""


def impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, keys_normalised=False):
    extra = dict(keys_normalised=True) if keys_normalised else {}     # the api's use_qk_l2norm_in_kernel
    o, final = _chunk_gdn_fwd_gluon(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                    selected_variant(), **extra)
    return o, (final if output_final_state else None)


# Where `auto` sends a call the Gluon forward supports (measured on the H200, benchmarks/RESULTS.md):
# - N*HV <= 768 sequence-heads. Round 14, with the fused warp-specialised stages 3+4 (CUDA-graph replay, one run,
#   results/2026-11-30_r14b_gdn_production_hv32_fwd.json): gluon / triton forward 1.44x at B1 T8192, 1.45x at B1
#   T32768 and T65536 (N*HV = 32), 1.35x at B8 T4096 (256), 1.35x at B4 T16384 (128), 1.37x on the varlen mix of 24
#   sequences (768). Round 11-13 (unfused Gluon state pass) kept N*HV > 64 on Triton (0.96-0.98x at 256). More
#   sequence-heads than 768 were not timed and stay on Triton.
# - an eager call (not under CUDA-graph capture) also needs T_total >= 8192 tokens. Round 12 set 32768: eager B1
#   T8192 took 1.235 ms against Triton's 1.054 (both host-bound, ~1.1 ms of host time per call). Round 13, with the
#   chunk plan cached (host path ~100 us per call), eager B1 T8192 took 0.486 ms against Triton's 0.569 (1.17x,
#   results/2026-11-29_r13_gdn_gluon.json); round 14 with the fused stages 0.401 vs 0.547 ms (1.36x). Shorter eager
#   calls were not timed and stay on Triton.
GLUON_AUTO_MAX_SEQ_HEADS = 768
GLUON_AUTO_MIN_EAGER_TOKENS = 8192


def _capturing(q: torch.Tensor) -> bool:
    """Whether this call is being captured into a CUDA graph (a host-side flag: no synchronisation). A CPU build of
    torch raises on the query, hence the device test first. Under torch.compile the choice is made at trace time,
    where no capture is under way (a later cudagraph of the compiled graph is not known): the eager rule holds."""
    from linattn.runtime.device import under_torch_compile
    if q.device.type != "cuda" or under_torch_compile():
        return False
    return torch.cuda.is_current_stream_capturing()


def _auto_filter(q=None, v=None, cu_seqlens=None, **_) -> Tuple[bool, str]:
    HV = v.shape[2]
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if N * HV > GLUON_AUTO_MAX_SEQ_HEADS:
        return False, (f"N*HV = {N * HV} > {GLUON_AUTO_MAX_SEQ_HEADS} sequence-heads: not timed there (round 14: "
                       f"Gluon 1.35-1.45x Triton up to N*HV = 768); backend='gluon' by name")
    tokens = q.shape[0] * q.shape[1]
    if tokens < GLUON_AUTO_MIN_EAGER_TOKENS and not _capturing(q):
        return False, (f"eager call with {tokens} < {GLUON_AUTO_MIN_EAGER_TOKENS} tokens: not timed eager below "
                       f"that (round 13, eager B1 T8192: 1.17x Triton); taken under CUDA-graph capture; "
                       f"backend='gluon' by name")
    return True, ""


def register(backends) -> None:
    backends.register("gluon", impl, supports, priority=0, auto=True, auto_filter=_auto_filter)
