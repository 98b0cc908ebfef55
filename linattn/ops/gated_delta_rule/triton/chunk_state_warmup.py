"""Stage 3 of the forward, segment-parallel with a gate-truncated warm-up (opt-in: LINATTN_GDN_SEGMENT_WARMUP=1).

The plain pass (chunk_state.py) is one chain of nch dependent chunk updates per (V block, sequence * head). Here
each sequence is cut into S segments of L chunks, and the program for (segment s, head, V block) computes its own
start state instead of waiting for segment s - 1 (FlashQLA's scheme, benchmarks/FLASHQLA_NOTES.md section 2):

  1. warm-up window: walk back from the segment's first chunk c0 over whole chunks, summing each chunk's total
     log decay gam_C (gcum at the chunk's last token: stage 2 stores the within-chunk cumulative gate), until the
     sum is <= -thresh or chunk 0 is reached. The window is chunks cw .. c0 - 1.
  2. from S = 0 at chunk cw (or from the initial state when cw == 0: then nothing is dropped and the result is the
     plain pass's, bit for bit on the interpreter), run the plain chunk update over the window, writing nothing;
  3. continue over chunks c0 .. c0 + L - 1 exactly as chunk_state_fwd_kernel does: h at every chunk start, vnew
     for every token, and the final state from the segment holding the sequence's last chunk.

What is dropped: the exact state at c0 is P S(cw) + (the window's pass from 0), P the product of the window's
chunk transitions. Per token the transition is S -> exp(g_t) (I - beta_t k_t k_t^T) S, whose 2-norm is
exp(g_t) max(1, |1 - beta_t ||k_t||^2|) <= exp(g_t) when ||k_t|| = 1 and 0 <= beta_t <= 2. So ||P||_2 <= exp(sum of
the window's gam_C) <= exp(-thresh), and, the later transitions being contractions too, every h of the segment and
the final state are off by at most exp(-thresh) ||S(cw)||_F in Frobenius norm (thresh = 20: e^-20 = 2.1e-9, below
fp32 rounding of the state). Without normalised keys the bound does not hold: forward.py takes this pass only when
the caller's keys are known to be normalised (warmup_state_wanted).

No host synchronisation: the window is found inside the kernel by a scalar loop over the chunk decays; the grid is
(cdiv(V, BV), S * N * HV), from shapes only. Fixed-length batches only (every sequence the same number of chunks;
forward.py does not take it with cu_seqlens), though the kernel reads each sequence's span from the chunk plan.
"""
from typing import Optional

import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan
from linattn.ops.gated_delta_rule.triton.chunk_state import state_chunk_inputs, state_update
from linattn.ops.gated_delta_rule.triton.common import sequence_span, state_tile
from linattn.runtime.device import device_facts

CHUNK = 64
THRESH = 20.0              # warm-up stops once the window's summed log decay is <= -THRESH (e^-20 = 2.1e-9)
MIN_SEG_CHUNKS = 16        # segments of at least 16 chunks (1024 tokens)
PLANNING_SMS = 132         # off the GPU (interpreter) plan as for an H200
# programs of the default launch (BV 32, 4 warps, 2 stages at K=V=128 bf16) resident per SM on sm_90a: registers
# and shared memory of the AOT build (benchmarks/SEGMENT_WARMUP.md); the segment count aims at one wave of them
RESIDENT_PER_SM = 2


def warmup_segments(nch: int, progs_per_segment: int, num_sms: int, per_sm: int = RESIDENT_PER_SM,
                    min_seg_chunks: int = MIN_SEG_CHUNKS):
    """(S, L): the number of segments per sequence and their length in chunks, from shapes only.

    One segment's programs are progs_per_segment = N * HV * cdiv(V, BV). S is the largest count whose programs
    still fit one wave of per_sm resident programs on each of num_sms SMs (per_sm clamped into [2, 4]: the aim is
    2-4 programs per SM, and a second wave would cost a whole segment's chain again), limited so that segments keep
    at least min_seg_chunks chunks; L = cdiv(nch, S). S = 1 means: do not split (the caller runs the plain pass).
    The last segment may be shorter; with L = cdiv(nch, S) none is empty when nch >= S * (L - 1) + 1 (always here,
    since S <= nch // min_seg_chunks), but the kernel tolerates empty ones."""
    per_sm = min(4, max(2, int(per_sm)))
    by_fill = (per_sm * max(1, num_sms)) // max(1, progs_per_segment)
    by_len = nch // max(1, min_seg_chunks)
    S = max(1, min(by_fill, by_len))
    L = triton.cdiv(max(nch, 1), S)
    return S, L


@triton.jit
def _warmup_window(gcum_ptr, bos, c0, hv, thresh, HV: tl.constexpr, BT: tl.constexpr):
    """First chunk cw of the warm-up window ending before chunk c0: walk back while the summed chunk decays stay
    above -thresh and chunk 0 is not reached. Chunks before c0 are full (only a sequence's last chunk can be short),
    so a chunk's total log decay is gcum at its row BT - 1."""
    cw = c0
    acc = 0.0
    while (cw > 0) & (acc > -thresh):
        cw -= 1
        acc += tl.load(gcum_ptr + (bos + cw.to(tl.int64) * BT + BT - 1) * HV + hv)
    return cw


@triton.jit
def warmup_start(h0_ptr, gcum_ptr, bos, c0, n, hv, vb, thresh, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr):
    """The warm-up window before chunk c0 and the state it starts from: (cw, S, the state tile's rk, rv, mask and
    offsets). S is the initial state when the window reaches the sequence start (nothing dropped: exact), else 0.
    Shared with segment_start.py."""
    rk, rv, mkv, state_off = state_tile(n, hv, vb, HV, K, V, BK, BV)
    cw = _warmup_window(gcum_ptr, bos, c0, hv, thresh, HV, BT)
    if USE_H0:
        s = tl.load(h0_ptr + state_off, mask=mkv & (cw == 0), other=0.).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    return cw, s, rk, rv, mkv, state_off


@triton.jit
def chunk_state_warmup_kernel(
    k_ptr, w_ptr, u_ptr, gcum_ptr,             # k [T_tot, H, K], w [T_tot, HV, K], u [T_tot, HV, V], gcum [T_tot, HV]
    h_ptr, vnew_ptr,                           # h [slots, HV, K, V] (chunk-start states), vnew [T_tot, HV, V]
    h0_ptr, ht_ptr,                            # initial / final state [N, HV, K, V] fp32
    cu_ptr, chunk_off_ptr,
    N, seg_chunks, thresh,                     # sequences, segment length L in chunks, warm-up threshold (> 0)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (cdiv(V, BV), S * N * HV): program (vb, s * N * HV + n * HV + hv)."""
    vb = tl.program_id(0)
    pid = tl.program_id(1)
    nhv = N * HV
    seg = pid // nhv
    nh = pid % nhv
    n = nh // HV
    hv = nh % HV
    hk = hv // (HV // H)
    bos, eos, slot0, nchunks = sequence_span(cu_ptr, chunk_off_ptr, n, BT)
    c0 = seg * seg_chunks
    if (c0 >= nchunks) & (seg > 0):            # an empty segment past the sequence's end (segment 0 always runs)
        return
    c1 = tl.minimum(c0 + seg_chunks, nchunks)

    cw, s, rk, rv, mkv, state_off = warmup_start(h0_ptr, gcum_ptr, bos, c0, n, hv, vb, thresh, HV, K, V, BT, BK, BV,
                                                 USE_H0)

    # chunks cw .. c0 - 1: the warm-up, nothing written (stores masked off); chunks c0 .. c1 - 1: the segment,
    # chunk_state_fwd_kernel's loop body (h at each chunk start, vnew for each token). One loop with masked stores:
    # two loops, or the stores under a branch, take 246-255 registers at BV=32 with 2 stages (SEGMENT_WARMUP.md)
    rows = tl.arange(0, BT)
    for c in range(cw, c1):
        t0 = bos + c * BT
        own = c >= c0
        slot = (slot0 + c).to(tl.int64)
        tl.store(h_ptr + (slot * HV + hv) * K * V + rk[:, None] * V + rv[None, :],
                 s.to(h_ptr.dtype.element_ty), mask=mkv & own)
        b_w, b_u, b_k, gam, gam_last = state_chunk_inputs(k_ptr, w_ptr, u_ptr, gcum_ptr, t0, eos, hv, hk, vb,
                                                          H, HV, K, V, BT, BK, BV)
        vnew = b_u - tl.dot(b_w, s.to(b_w.dtype), input_precision=DOT_PREC)
        vnew_op = vnew.to(vnew_ptr.dtype.element_ty)
        tl.store(vnew_ptr + (t0 + rows)[:, None] * HV * V + hv * V + rv[None, :], vnew_op,
                 mask=((t0 + rows) < eos)[:, None] & (rv < V)[None, :] & own)
        s = state_update(s, b_k, vnew_op, gam, gam_last, DOT_PREC)

    if STORE_HT:
        if c1 >= nchunks:                      # the segment holding the last chunk writes the final state
            tl.store(ht_ptr + state_off, s, mask=mkv)


def plan_warmup(plan: ChunkPlan, HV: int, V: int, BV: int, device, per_sm: int = RESIDENT_PER_SM,
                min_seg_chunks: Optional[int] = None):
    """(S, L) for a fixed-length plan (every sequence num_slots / N chunks) on `device` (warmup_segments)."""
    facts = device_facts(device)
    sms = facts.num_sms if facts.kind == "cuda" else PLANNING_SMS
    nch = plan.num_slots // max(1, plan.N)
    return warmup_segments(nch, plan.N * HV * triton.cdiv(V, BV), sms, per_sm,
                           MIN_SEG_CHUNKS if min_seg_chunks is None else min_seg_chunks)


def warmup_state_wanted(cu_seqlens, keys_normalised: bool, state_pass, plan: ChunkPlan, HV: int, V: int, BV: int,
                        device) -> bool:
    """Whether forward.py's stage 3 takes the warm-up pass (with LINATTN_GDN_SEGMENT_WARMUP=1 checked by the
    caller): fixed-length batch (cu_seqlens None), keys known normalised (use_qk_l2norm_in_kernel, or
    LINATTN_GDN_KEYS_NORMALISED=1: the caller guarantees ||k|| = 1 and 0 <= beta <= 2), the Triton state pass
    (no state_pass hook), and at least two segments (S >= 2, so each sequence has >= 2 * MIN_SEG_CHUNKS chunks)."""
    from linattn.runtime.settings import settings
    if cu_seqlens is not None or state_pass is not None:
        return False
    if not (keys_normalised or settings.gdn_keys_normalised):
        return False
    S, _ = plan_warmup(plan, HV, V, BV, device)
    return S >= 2


def chunk_state_warmup(k, w, u, gcum, h, vnew, initial_state, final_state, plan: ChunkPlan, *,
                       H: int, HV: int, K: int, V: int, dot_prec: str, BV: int, num_warps: int = 4,
                       num_stages: int = 2, seg_chunks: Optional[int] = None, num_segments: Optional[int] = None,
                       thresh: float = THRESH):
    """Stage 3 with segments and gate-truncated warm-ups: same inputs and outputs as chunk_state_fwd_kernel's
    launch (h [slots, HV, K, V], vnew [T_tot, HV, V], final_state [N, HV, K, V] fp32 when given, written in place).
    seg_chunks / num_segments override the plan (plan_warmup); returns (S, L) as launched."""
    N = plan.N
    nch = plan.num_slots // max(1, N)
    if seg_chunks is not None:
        L = max(1, int(seg_chunks))
        S = triton.cdiv(max(nch, 1), L)
    elif num_segments is not None:
        S = max(1, int(num_segments))
        L = triton.cdiv(max(nch, 1), S)
    else:
        S, L = plan_warmup(plan, HV, V, BV, k.device)
    use_h0 = initial_state is not None
    store_ht = final_state is not None
    chunk_state_warmup_kernel[(triton.cdiv(V, BV), S * N * HV)](
        k, w, u, gcum, h, vnew,
        initial_state if use_h0 else gcum, final_state if store_ht else gcum,
        plan.cu, plan.chunk_offsets, N, L, float(thresh),
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=max(16, triton.next_power_of_2(K)), BV=BV,
        USE_H0=use_h0, STORE_HT=store_ht, DOT_PREC=dot_prec, num_warps=num_warps, num_stages=num_stages)
    return S, L
