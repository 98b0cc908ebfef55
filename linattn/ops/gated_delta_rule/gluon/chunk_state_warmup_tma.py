"""Stage 3 of the forward in Gluon with the segment warm-up scheme (opt-in: LINATTN_GDN_SEGMENT_WARMUP=1, with the
conditions of the Triton warm-up pass): chunk_state_tma.py's TMA ring and products, on a grid that also runs over
segments, each segment started from a gate-chosen warm-up window (benchmarks/GLUON_WARMUP.md).

Per program (vb, s * N * HV + n * HV + hv), as triton/chunk_state_warmup.py's chunk_state_warmup_kernel:
  - it owns chunks c0 = s * L .. c1 - 1 (c1 = min(c0 + L, nch)) of sequence n; an empty segment (c0 >= nch, s > 0)
    exits; segment 0 always runs (an empty sequence still writes final = h0);
  - window: walk back from c0 over whole chunks summing gcum at each chunk's last row (stage 2 stores the
    within-chunk cumulative gate, so that row is the chunk's total log decay) in fp32, while the sum is > -thresh
    and chunk 0 is not reached: the window starts at cw (the same loop, constant and order as the Triton kernel);
  - the start state is the initial state when cw == 0 (nothing dropped: exact), else zero;
  - one loop over chunks cw .. c1 - 1 through the TMA ring, chunk_state_tma.py's iteration; the TMA store of h and
    the stores of vnew happen only for chunks c >= c0 (the h store under a branch on a scalar, vnew's rows masked);
  - the final state only from the segment holding the sequence's last chunk (c1 >= nch).

The ring runs over the program's own chunk sequence: iteration j = 0 .. c1 - cw - 1 handles chunk cw + j, in ring
slot j % STAGES with phase parity (j // STAGES) & 1, and its boxes start at token base + j * BT with base = bos +
cw * BT. chunk_state_tma._issue_chunk is called on (j, c1 - cw, base) and does exactly that, so the ring's
invariants (prologue of STAGES - 1 issues, refill of the slot read in the previous iteration, drain by predicated-
off issues) are chunk_state_tma.py's, unchanged.

Bound (triton/chunk_state_warmup.py docstring, benchmarks/SEGMENT_WARMUP.md): with ||k|| = 1 and 0 <= beta <= 2
every h and the final state are off by at most e^-thresh ||S(cw)||_F (thresh = 20: 2.1e-9); exact when every
window reaches chunk 0 (weak decay). The launcher here is used only under those conditions (gluon_warmup_wanted).
"""
from __future__ import annotations

from typing import Optional

import torch

from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import (PLANNING_SMS, THRESH, warmup_segments,
                                                                     warmup_state_wanted)
from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, mma_v2, tma_store,
                                          tma_store_wait, warpgroup_mma)

BT = 64
WARMUP_STAGES = 2          # 2 ring stages: 2 CTAs per SM at BV 32 and BV 64 (AOT: RESIDENCY below); 3 stages fit 1

# H100/H200 (sm_90) per-SM limits for the residency of a CTA: registers, shared memory (228 KB per SM, of which
# 1 KB reserved per CTA; 227 KB at most per CTA), threads
SM90_REGS, SM90_SMEM, SM90_SMEM_RESERVED, SM90_THREADS, SM90_MAX_CTAS = 65536, 233472, 1024, 2048, 32

# (variant, BV, stages) -> (registers, shared memory bytes) of the sm_90a AOT builds at 4 warps (bf16, USE_H0,
# STORE_HT; ptxas of the triton 3.6.0 wheel). tests/test_gluon_state_warmup.py recompiles and checks these numbers,
# so the residency the segment count uses is the compiled kernel's.
AOT_USAGE = {
    ("wgmma", 32, 2): (108, 98320), ("wgmma", 64, 2): (167, 114704), ("wgmma", 32, 3): (112, 135192),
    ("wgmma", 32, 1): (114, 61448), ("tma", 32, 2): (163, 98320), ("tma", 64, 2): (228, 114704),
}


def resident_per_sm(regs: int, smem: int, num_warps: int = 4) -> int:
    """CTAs of one kernel resident per sm_90 SM: the least of the register, shared-memory and thread limits
    (registers allocated per warp in units of 256: regs rounded up to a multiple of 8 per thread)."""
    threads = 32 * num_warps
    by_regs = SM90_REGS // (((regs + 7) // 8) * 8 * threads)
    by_smem = SM90_SMEM // (smem + SM90_SMEM_RESERVED)
    return max(1, min(by_regs, by_smem, SM90_THREADS // threads, SM90_MAX_CTAS))


if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import (_chunk_products, _issue_chunk, _sequence_span,
                                                                     rows_layout,
                                                                     state_acc_layout)

    @gluon.jit
    def _warmup_window(gcum_ptr, bos, c0, hv, thresh, HV: gl.constexpr, BT: gl.constexpr):
        """triton/chunk_state_warmup.py's _warmup_window in Gluon: the first chunk cw of the window before c0 (walk
        back while the fp32 sum of the chunks' total log decays is > -thresh and chunk 0 is not reached)."""
        cw = c0
        acc = gl.to_tensor(0.0)
        while (cw > 0) & (acc > -thresh):
            cw -= 1
            acc += gl.load(gcum_ptr + (bos + cw.to(gl.int64) * BT + BT - 1) * HV + hv)
        return cw

    @gluon.jit
    def chunk_state_warmup_tma_kernel(
        k_desc, w_desc, u_desc,                # TMA over k [T_tot, H*K], w [T_tot, HV*K], u [T_tot, HV*V]
        gcum_ptr,                              # gcum [T_tot, HV] fp32
        h_desc, vnew_ptr,                      # TMA over h [slots*HV*K, V]; vnew [T_tot, HV, V]
        h0_ptr, ht_ptr,                        # initial / final state [N, HV, K, V] fp32
        cu_ptr, chunk_off_ptr,                 # the chunk plan (triton/chunk_indices.py)
        N, seg_chunks, thresh,                 # sequences, segment length L in chunks, warm-up threshold (> 0)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
        BT: gl.constexpr, BV: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
        STAGES: gl.constexpr, USE_WGMMA: gl.constexpr,
    ):
        """Grid (V // BV, S * N * HV). chunk_state_fwd_tma_kernel's body with the segment's window (module
        docstring); the comments there on the ring and the shared buffers hold here with c replaced by j."""
        NW: gl.constexpr = gl.num_warps()
        dt: gl.constexpr = w_desc.dtype
        ACC: gl.constexpr = state_acc_layout(BV, NW, USE_WGMMA)
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)
        LS: gl.constexpr = rows_layout(BV, 32, NW)             # fp32 states [K, BV] in global memory

        vb = gl.program_id(0)
        pid = gl.program_id(1)
        nhv = N * HV
        seg = pid // nhv
        nh = pid % nhv
        n, hv, hk, bos, eos, slot0, nchunks = _sequence_span(nh, cu_ptr, chunk_off_ptr, H, HV, BT)
        c0 = seg * seg_chunks
        if (c0 >= nchunks) & (seg > 0):        # an empty segment past the sequence's end (segment 0 always runs)
            return
        c1 = gl.minimum(c0 + seg_chunks, nchunks)
        cw = _warmup_window(gcum_ptr, bos, c0, hv, thresh, HV, BT)
        base = bos + cw * BT                   # first token of the window's first chunk
        nj = c1 - cw                           # chunks walked: the window's, then the segment's own
        jown = c0 - cw                         # iterations j >= jown are the segment's own chunks

        w_smem = gl.allocate_shared_memory(dt, [STAGES, BT, K], w_desc.layout)
        k_smem = gl.allocate_shared_memory(dt, [STAGES, BT, K], k_desc.layout)
        u_smem = gl.allocate_shared_memory(dt, [STAGES, BT, BV], u_desc.layout)
        s_smem = gl.allocate_shared_memory(dt, [K, BV], h_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()                                     # barrier inits visible to the async proxy
        for i in gl.static_range(STAGES - 1):                    # prologue: iterations 0 .. STAGES-2 in flight
            _issue_chunk(w_desc, k_desc, u_desc, w_smem, k_smem, u_smem, ready, i, nj, base, hv, hk, vb,
                         HV, K, V, BT, BV, STAGES)

        sk = gl.arange(0, K, layout=gl.SliceLayout(1, LS))
        sv = vb * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LS))
        state_off = (n.to(gl.int64) * HV + hv) * K * V + gl.expand_dims(sk, 1) * V + gl.expand_dims(sv, 0)
        if USE_H0:
            # the window reaches the sequence start: the true initial state, nothing dropped (exact)
            if cw == 0:
                s = gl.convert_layout(gl.load(h0_ptr + state_off), ACC)
            else:
                s = gl.zeros([K, BV], gl.float32, ACC)
        else:
            s = gl.zeros([K, BV], gl.float32, ACC)

        r_t = gl.arange(0, BT, layout=ROWS)
        c_v = vb * BV + gl.arange(0, BV, layout=COLS)
        if USE_WGMMA:
            vn_smem = gl.allocate_shared_memory(dt, [BT, BV], u_desc.layout)
            kt_cols = r_t                                        # unused with WGMMA
        else:
            vn_smem = s_smem                                     # unused without WGMMA
            OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
            kt_cols = gl.arange(0, BT, layout=gl.SliceLayout(0, OPA))

        # gates of the window's first chunk, then each iteration loads the next chunk's while this one computes
        gam = gl.load(gcum_ptr + (base + r_t) * HV + hv, mask=(base + r_t) < eos, other=0.)
        gam_last = gl.load(gcum_ptr + (base + gl.minimum(eos - base, BT) - 1) * HV + hv, mask=nj > 0, other=0.)

        for j in range(0, nj):
            t0 = base + j * BT
            own = j >= jown
            # refill the slot read in iteration j - 1 with iteration j + STAGES - 1 (chunk_state_tma.py)
            fence_async_shared()
            gl.thread_barrier()
            _issue_chunk(w_desc, k_desc, u_desc, w_smem, k_smem, u_smem, ready, j + STAGES - 1, nj, base,
                         hv, hk, vb, HV, K, V, BT, BV, STAGES)
            t1 = t0 + BT
            gam_n = gl.load(gcum_ptr + (t1 + r_t) * HV + hv, mask=(t1 + r_t) < eos, other=0.)
            gam_last_n = gl.load(gcum_ptr + (t1 + gl.minimum(eos - t1, BT) - 1) * HV + hv, mask=t1 < eos, other=0.)

            # S through s_smem (product 1's B operand); h[chunk] = S by a TMA store for the segment's own chunks
            tma_store_wait(0)
            gl.thread_barrier()
            s_smem.store(s.to(dt))
            fence_async_shared()
            if own:
                tma_store(h_desc, [((slot0 + cw + j) * HV + hv).to(gl.int32) * K, vb * BV], s_smem)

            s = _chunk_products(w_smem, k_smem, u_smem, s_smem, vn_smem, ready, j, s, gam, gam_last, t0, eos, r_t,
                                c_v, kt_cols, hv, vnew_ptr, own, HV, V, BT, BV, STAGES, USE_WGMMA, ACC, True)
            gam = gam_n
            gam_last = gam_last_n

        tma_store_wait(0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        if STORE_HT:
            if c1 >= nchunks:                  # the segment holding the last chunk writes the final state
                gl.store(ht_ptr + state_off, gl.convert_layout(s, LS))


# ---------------------------------------------------------------- launch

def warmup_config(variant: str, N: int, HV: int, V: int, num_sms: int):
    """The launch config of the warm-up pass: the plain Gluon pass's V split (launcher.state_config) at 4 warps,
    with WARMUP_STAGES ring stages (the split multiplies the programs, and 2 stages keep 2 CTAs per SM where the
    plain pass's 3 stages at BV 32 fit only 1)."""
    from linattn.ops.gated_delta_rule.gluon.launcher import StateConfig, state_config
    if variant not in ("tma", "wgmma"):
        raise ValueError(f"the Gluon warm-up pass is built on the TMA ring: variant 'tma' or 'wgmma', not {variant!r}")
    return StateConfig(state_config(variant, N, HV, V, num_sms).BV, 4, WARMUP_STAGES)


def warmup_residency(variant: str, cfg) -> int:
    """CTAs per SM of the warm-up kernel at cfg, from its AOT registers and shared memory (AOT_USAGE; 2 for a
    config not in the table: warmup_segments clamps per_sm into [2, 4] anyway)."""
    usage = AOT_USAGE.get((variant, cfg.BV, cfg.stages))
    return 2 if usage is None else resident_per_sm(*usage, num_warps=cfg.num_warps)


def _num_sms(device) -> int:
    from linattn.runtime.device import device_facts
    facts = device_facts(device)
    return facts.num_sms if facts.kind == "cuda" else PLANNING_SMS


def plan_gluon_warmup(plan, HV: int, V: int, variant: str, cfg, device, min_seg_chunks: Optional[int] = None):
    """(S, L) for a fixed-length plan: triton/chunk_state_warmup.warmup_segments with this kernel's residency."""
    from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as tw
    nch = plan.num_slots // max(1, plan.N)
    return warmup_segments(nch, plan.N * HV * (V // cfg.BV), _num_sms(device), warmup_residency(variant, cfg),
                           tw.MIN_SEG_CHUNKS if min_seg_chunks is None else min_seg_chunks)


def gluon_warmup_wanted(cu_seqlens, keys_normalised: bool, plan, HV: int, V: int, variant: str, device) -> bool:
    """Whether the gluon backend's state pass takes the warm-up kernel: LINATTN_GDN_SEGMENT_WARMUP=1, a TMA-ring
    variant, the Triton warm-up's conditions (warmup_state_wanted: fixed length, keys known normalised, >= 2
    segments at the Triton launch) and >= 2 segments at this kernel's own config and residency."""
    from linattn.runtime.settings import settings
    if not settings.gdn_segment_warmup or variant not in ("tma", "wgmma"):
        return False
    cfg = warmup_config(variant, plan.N, HV, V, _num_sms(device))
    if not warmup_state_wanted(cu_seqlens, keys_normalised, None, plan, HV, V, cfg.BV, device):
        return False
    S, _ = plan_gluon_warmup(plan, HV, V, variant, cfg, device)
    return S >= 2


def warmup_launch(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gcum: torch.Tensor, h: torch.Tensor,
                  vnew: torch.Tensor, initial_state: Optional[torch.Tensor], final: Optional[torch.Tensor], plan,
                  variant: str, cfg, S: int, L: int, thresh: float = THRESH):
    """(kernel, grid, args, kwargs) of one warm-up launch: launcher.state_launch's descriptors and tensors, then
    N, L and thresh; grid (V // BV, S * N * HV). Separate from the launch so a CPU test can check the arguments
    against the AOT signature (aot.py gluon_warmup_signature)."""
    from linattn.ops.gated_delta_rule.gluon.launcher import state_launch
    _, grid, args, kwargs = state_launch(k, w, u, gcum, h, vnew, initial_state, final, plan, variant, cfg)
    args = tuple(args) + (plan.N, int(L), float(thresh))
    return chunk_state_warmup_tma_kernel, (grid[0], S * grid[1]), args, kwargs


def chunk_state_warmup_gluon(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gcum: torch.Tensor, h: torch.Tensor,
                             vnew: torch.Tensor, initial_state: Optional[torch.Tensor], final: Optional[torch.Tensor],
                             plan, variant: str = "wgmma", config=None, seg_chunks: Optional[int] = None,
                             num_segments: Optional[int] = None, thresh: float = THRESH):
    """The warm-up state pass on sm_90a: launcher.chunk_state_gluon's tensors in and out (h, vnew, final written in
    place). seg_chunks / num_segments override the plan (plan_gluon_warmup); returns (S, L) as launched.
    Launched through the JIT (no cached host path: ~70-150 us of host time per eager call)."""
    N = plan.N
    HV, V = u.shape[1], u.shape[2]
    cfg = config or warmup_config(variant, N, HV, V, _num_sms(k.device))
    nch = plan.num_slots // max(1, N)
    if seg_chunks is not None:
        L = max(1, int(seg_chunks))
        S = -(-max(nch, 1) // L)
    elif num_segments is not None:
        S = max(1, int(num_segments))
        L = -(-max(nch, 1) // S)
    else:
        S, L = plan_gluon_warmup(plan, HV, V, variant, cfg, k.device)
    kernel, grid, args, kwargs = warmup_launch(k, w, u, gcum, h, vnew, initial_state, final, plan, variant, cfg,
                                               S, L, thresh)
    kernel[grid](*args, **kwargs)
    return S, L
