"""Segment windows for the segment-parallel Gluon forward (gluon/chunk_fused_gf.py's segments, and
chunk_fused_wu_ws.py's seg_ptr).

Why: at B1 H16/HV32 the fused kernel walks every chunk of the sequence per (value head, V block) on fewer CTAs than
SMs. Cut each sequence into S segments, give each its own start state, and the kernel sees N*S independent
"sequences": enough CTAs to fill the GPU, the same work in fewer, wider steps (FlashQLA's B1 scheme).

A segment's start state comes from a gate-truncated warm-up: the chain of segment s starts cw <= c0 = s * L chunks
into its sequence, from 0 (from the sequence's initial state when cw = 0: then nothing is dropped), and its o rows
before c0 are not stored. segment_window_kernel finds cw for each (segment, head) -- walking back from c0 over whole
chunks, summing each chunk's log decay (the sum of its tokens' g), until the sum is <= -thresh or chunk 0 is reached
-- and writes it into a segment word (SEGW_*) for the fused kernel, which runs the warm-up chunks itself.

The window may span at most MAX_WINDOW chunks (and the previous segment). Where the decay is too slow for that, the
(segment, head) is flagged (flag[n * S + s, hv] = 1, slow[n, hv] = 1), and the caller runs that head of that
sequence unsegmented. FlashQLA's exact join (the previous segment's affine map S -> M S + h, M [K, K]) costs as much
as the chain itself over the segment (K = V), so at slow decay it cannot beat the unsegmented chain.

The bound: with 0 <= beta_t ||k_t||^2 <= 2 every token's transition I - beta_t k_t k_t^T is a contraction, each
chunk's a contraction times exp(gam_C), so the start state is off by at most exp(-thresh) ||S(cw)||_F (thresh = 20:
e^-20 = 2.1e-9). The kernel checks that condition on every token of a truncated window and flags the (segment, head)
where it fails, so no promise about the keys is needed (normalised keys and beta in [0, 1], as in Qwen3-Next's
layers, always pass).
No host synchronisation: the window is found in the kernel; the grid comes from shapes only.
"""
import torch
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan, make_chunk_plan
from linattn.ops.gated_delta_rule.triton.common import contracts, sequence_span
from linattn.runtime.host_path import next_power_of_2

CHUNK = 64
THRESH = 20.0              # a window ends once its summed log decay is <= -THRESH (e^-20 = 2.1e-9)
MAX_WINDOW = 16            # warm-up windows of at most 16 chunks (a quarter of a segment); longer ones are flagged

# The segment word: one int32 per (segment, head), written by segment_window_kernel, read by the fused kernel's seg_ptr
# (chunk_fused_wu_ws.chunk_fused_wu_ws_kernel) to run the segment with its warm-up:
SEGW_WL_MASK = tl.constexpr(255)   # bits 0-7: the warm-up length in chunks (the chain starts that many chunks early)
SEGW_H0 = tl.constexpr(1 << 8)     # bit 8: the chain starts from its sequence's h0 (the window reaches the sequence
                                   # start), else from 0
SEGW_LAST = tl.constexpr(1 << 9)   # bit 9: the sequence's last segment (its final state is the sequence's)
SEGW_SEQ_SHIFT = tl.constexpr(10)  # bits 10-30: the sequence index n (the h0 / final row)


@triton.jit
def _segment_window(g_ptr, bos, eos, edge, lim, nchunks, hv, thresh, HV: tl.constexpr, BT: tl.constexpr,
                    MAXW: tl.constexpr, REVERSE: tl.constexpr = False):
    """The warm-up window of the segment starting at chunk edge = c0, walking back no further than chunk lim
    (c0 - lim <= MAXW): (cw, whether the window [cw, c0) is usable: its summed log decay reached -thresh, or it
    reached the sequence start, where nothing is dropped). REVERSE (the backward's reverse pass): the window of the
    segment ending at chunk edge = c1 (exclusive), walking forward no further than chunk lim (lim - c1 <= MAXW):
    (cwe, whether [c1, cwe) is usable: it reached -thresh or the sequence end, chunk nchunks; the last chunk may be
    partial, its rows past eos masked). Each chunk's decay is the sum of its tokens' g (the inputs, not kkt_solve's
    gcum: so that the window kernel can run next to kkt_solve), the MAXW chunks next to the edge in one [MAXW, BT]
    load and a cumulative sum (a loop of dependent loads cost ~1 us per chunk walked, all of MAXW at slow decay)."""
    j = tl.arange(0, MAXW)
    if REVERSE:
        inside = j < lim - edge
        c = edge + j                           # chunk c1 + j
    else:
        inside = j < edge - lim
        c = edge - 1 - j                       # chunk c0 - 1 - j (whole: before c0)
    tok = bos + c.to(tl.int64)[:, None] * BT + tl.arange(0, BT)[None, :]
    m = inside[:, None]
    if REVERSE:
        m = m & (tok < eos)
    dec = tl.sum(tl.load(g_ptr + tok * HV + hv, mask=m, other=0.).to(tl.float32), 1)
    hit = inside & (tl.cumsum(dec, 0) <= -thresh)
    first = tl.min(tl.where(hit, j, MAXW), 0)  # the shortest window reaching -thresh (MAXW: none)
    if REVERSE:
        end = tl.where(first < MAXW, edge + first + 1, lim)
    else:
        end = tl.where(first < MAXW, edge - 1 - first, lim)
    end = tl.where(thresh <= 0., edge, end)    # nothing to reach: no window (as the walk's loop test)
    return end, (first < MAXW) | (thresh <= 0.) | (end == (nchunks if REVERSE else 0))


@triton.jit
def _segment_of(cu_ptr, chunk_off_ptr, ns, S, seg_chunks, BT: tl.constexpr):
    """Segment ns = n * S + s: (n, its sequence's first token, end, chunk count, the segment's first chunk c0)."""
    n = ns // S
    bos, eos, slot0, nchunks = sequence_span(cu_ptr, chunk_off_ptr, n, BT)
    return n, bos, eos, nchunks, tl.minimum((ns % S) * seg_chunks, nchunks)


@triton.jit
def segment_window_kernel(
    k_ptr, beta_ptr, g_ptr,                       # k [T_tot, H, K], beta / g [T_tot, HV] (the inputs)
    slow_ptr, flag_ptr, segw_ptr,                 # out: slow [N, HV] int32 (zeroed by the caller; 1 stored where a
                                                  # segment of (n, hv) is flagged), flag / segw [N * S, HV] int32
    cu_ptr, chunk_off_ptr, S, seg_chunks, thresh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, MAXW: tl.constexpr,
    REVERSE: tl.constexpr = False,
):
    """Program (n * S + s) * HV + hv finds the window of segment s of sequence n for head hv and its flag, and stores
    the segment word (SEGW_*: the window's length wl = c0 - cw, 0 where flagged; whether the window reaches the
    sequence start, cw == 0, so that the chain starts from h0; whether s is the last segment; n) for the fused kernel
    to run the warm-up itself (chunk_fused_wu_ws's seg_ptr), and slow[n, hv] = 1 where flagged. Loads only: the
    window's chunk decays, then k and beta of its tokens for the contraction check.
    REVERSE (the backward's reverse state pass, gluon/chunk_state_bwd.py): the window follows the segment's end c1,
    [c1, cwe), and the word's bits mirror: SEGW_WL_MASK the window's length cwe - c1, SEGW_H0 that it reaches the
    sequence end (the chain starts from d final_state), SEGW_LAST that s is the first segment (the only one storing
    d initial_state)."""
    hv = tl.program_id(0) % HV
    ns = tl.program_id(0) // HV
    hk = hv // (HV // H)
    n, bos, eos, nchunks, c0 = _segment_of(cu_ptr, chunk_off_ptr, ns, S, seg_chunks, BT)
    if REVERSE:
        c1 = tl.minimum(c0 + seg_chunks, nchunks)
        lo = c1
        hi, usable = _segment_window(g_ptr, bos, eos, c1, tl.minimum(c1 + tl.minimum(seg_chunks, MAXW), nchunks),
                                     nchunks, hv, thresh, HV, BT, MAXW, REVERSE=True)
        wl, edge, own = hi - c1, hi == nchunks, ns % S == 0
    else:
        lo, usable = _segment_window(g_ptr, bos, eos, c0, tl.maximum(c0 - tl.minimum(seg_chunks, MAXW), 0), nchunks,
                                     hv, thresh, HV, BT, MAXW)
        hi = c0
        wl, edge, own = c0 - lo, lo == 0, ns % S == S - 1
    expansive = 0
    if usable:
        expansive = tl.where(contracts(k_ptr, beta_ptr, bos, eos, lo, hi, hv, hk, H, HV, K, BT, BK, 0), 0, 1)
    flagged = (~usable) | ((expansive != 0) & (~edge))
    tl.store(flag_ptr + ns * HV + hv, flagged.to(tl.int32))
    word = (tl.where(flagged, 0, wl) | tl.where(edge, SEGW_H0, 0) | tl.where(own, SEGW_LAST, 0)
            | (n << SEGW_SEQ_SHIFT))
    tl.store(segw_ptr + ns * HV + hv, word)
    tl.store(slow_ptr + n * HV + hv, 1, mask=flagged)   # every writer stores 1: no atomic needed


_SEG_PLANS: dict = {}


def _seg_plan_key(B: int, T: int, S: int, L: int, device) -> tuple:
    return (B, T, S, L, str(torch.device(device)))


def segment_plan(B: int, T: int, S: int, L: int, device) -> ChunkPlan:
    """The chunk plan of the N * S segments as sequences (sequence-major: segment s of sequence n is n * S + s): each
    starts at a chunk boundary of its sequence, the last one of each sequence ends with it. Device ops only (no host
    copy: capturable), cached per (B, T, S, L, device) as make_chunk_plan caches fixed-length plans."""
    key = _seg_plan_key(B, T, S, L, device)
    plan = _SEG_PLANS.get(key)
    if plan is None:
        starts = (torch.arange(B, device=device, dtype=torch.int64)[:, None] * T
                  + (torch.arange(S, device=device, dtype=torch.int64)[None, :] * (L * CHUNK)).clamp(max=T))
        cu = torch.cat([starts.reshape(-1), torch.full((1,), B * T, device=device, dtype=torch.int64)])
        plan = make_chunk_plan(1, B * T, cu, CHUNK, device)
        if len(_SEG_PLANS) >= 16:
            _SEG_PLANS.pop(next(iter(_SEG_PLANS)))
        _SEG_PLANS[key] = plan
    return plan


def segment_plan_cached(B: int, T: int, S: int, L: int, device) -> bool:
    """Whether segment_plan(B, T, S, L, device) is in the plan cache (a call would not build it)."""
    return _seg_plan_key(B, T, S, L, device) in _SEG_PLANS


def segment_window_buffers(N: int, S: int, HV: int, device) -> tuple:
    """(slow [N, HV] zeroed, flag [N * S, HV], segw [N * S, HV]), int32: segment_window_kernel's outputs."""
    from linattn.runtime.alloc import empty, zeros
    return (zeros(N, HV, dtype=torch.int32, device=device), empty(N * S, HV, dtype=torch.int32, device=device),
            empty(N * S, HV, dtype=torch.int32, device=device))


def segment_windows(k, beta, g, plan: ChunkPlan, S: int, L: int, *, thresh: float = THRESH,
                    max_window: int = MAX_WINDOW, num_warps: int = 4, launch=None, out=None, stream=None,
                    reverse: bool = False):
    """(slow [N, HV] int32, flag [N * S, HV] int32, segw [N * S, HV] int32): segment_window_kernel's outputs for the
    segment-parallel forward (chunk_fused_wu_ws._segments): slow[n, hv] = 1 where any segment of (n, hv) is flagged
    (that pair runs unsegmented), the flags, the segment words (SEGW_*). k [B,T,H,K], beta / g [B,T,HV] (g: the
    per-token log decays, whose chunk sums choose the windows); plan: the per-sequence chunk plan. launch: None (the
    JIT) or a launcher called as launch(kernel, grid, args, kwargs[, stream=stream]) (the gluon forward's host
    path, gluon/host.launches). out: the buffers (segment_window_buffers), allocated here when None. stream: where
    `launch` runs the kernel (None: the current stream). reverse: the windows after each segment's end, for the
    backward's reverse state pass (segment_window_kernel's REVERSE)."""
    if max_window > SEGW_WL_MASK.value:
        raise ValueError(f"max_window={max_window}: the segment word holds at most {SEGW_WL_MASK.value} chunks")
    if plan.N >= 1 << (31 - SEGW_SEQ_SHIFT.value):
        raise ValueError(f"{plan.N} sequences: the segment word holds fewer than {1 << (31 - SEGW_SEQ_SHIFT.value)}")
    H, K = k.shape[-2], k.shape[-1]
    HV = g.shape[-1]
    N = plan.N
    slow, flag, segw = out if out is not None else segment_window_buffers(N, S, HV, k.device)
    args = (k, beta, g, slow, flag, segw, plan.cu, plan.chunk_offsets, S, L, float(thresh))
    kwargs = dict(H=H, HV=HV, K=K, BT=CHUNK, BK=max(16, next_power_of_2(K)), MAXW=int(max_window),
                  num_warps=num_warps, **({"REVERSE": True} if reverse else {}))
    if launch is None:
        segment_window_kernel[(N * S * HV,)](*args, **kwargs)
    elif stream is None:
        launch(segment_window_kernel, (N * S * HV,), args, kwargs)
    else:
        launch(segment_window_kernel, (N * S * HV,), args, kwargs, stream=stream)
    return slow, flag, segw
