"""Stage 3 of the forward split into segments of chunks that run in parallel and are joined exactly.

The plain state pass (chunk_state.py) walks every chunk of a sequence in order, one program per (V block, head):
at B=1 that is few programs with long sequential chains. Per chunk (gdn-math.md, chunk form), with
kdec = diag(exp(gam_C - gam)) K:

    S' = exp(gam_C) S + kdec^T (U - W S) = A_c S + B_c,   A_c = exp(gam_C) I - kdec^T W  [K, K],  B_c = kdec^T U [K, V]

so a segment of chunks c = a..b maps its start state affinely: S_end = M S_start + R with M = A_b ... A_a and
R = the segment's end state from S_start = 0. Three phases:

  1. parallel over (column block, segment, head): R by the ordinary recurrence from zero (the first segment of a
     sequence starts from the initial state instead, so its M is never needed), and M by the same recurrence on
     the columns of M:  M <- exp(gam_C) M + kdec^T (0 - W M)  from M = I, in fp32 operands (the product of many
     near-identity matrices; TF32 dots for 16-bit inputs, IEEE for fp32, as DOT_PREC elsewhere).
     The last segment of a sequence needs neither.
  2. sequential over segments, parallel over (V block, sequence * head):
        S_start[first] = h0 (or 0),  S_start[first + 1] = R[first],  S_start[s + 1] = M_s S_start[s] + R_s.
  3. parallel over (V block, segment, head): the ordinary pass from S_start over the segment's chunks, writing h
     and vnew exactly as the plain kernel does (same operand roundings), and the final state from the last segment.

Segment plan (device-side, no host sync, CUDA-graph safe): the host picks a segment length L in chunks from shapes
only; each sequence n with nch_n chunks gets ns_n = max(1, cdiv(nch_n, L)) segments of cdiv(nch_n, ns_n) chunks
(balanced; a short sequence is one segment, an empty one a single empty segment so that its final state = h0).
The grid is sized by the bound sum_n ns_n <= num_slots // L + N; surplus rows carry sequence N and exit.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.chunk_indices import ChunkPlan
from linattn.ops.gated_delta_rule.triton.common import sequence_span
from linattn.runtime.alloc import empty
from linattn.runtime.device import device_facts
from linattn.runtime.settings import settings

CHUNK = 64
MIN_SEG_CHUNKS = 16        # automatic plans: segments of at least 16 chunks (1024 tokens)
PLANNING_SMS = 132         # off-GPU (interpreter) plans as for an H200

MODE_R, MODE_M, MODE_OUT, MODE_P1 = 0, 1, 2, 3   # phase 1 (R), phase 1 (M), phase 3, phase 1 (R and M)
_R = tl.constexpr(MODE_R)
_P1 = tl.constexpr(MODE_P1)
_M = tl.constexpr(MODE_M)
_OUT = tl.constexpr(MODE_OUT)


@triton.jit
def _segment_run(k_ptr, w_ptr, u_ptr, gcum_ptr, h_ptr, vnew_ptr, s0_ptr, end_ptr,
                 n, p, hv, hk, vb, c0, nc, bos, eos, slot0, first, last,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 MODE: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One program's walk over its segment's chunks for one column block vb of R (MODE _R), M (_M) or S (_OUT)."""
    COLS: tl.constexpr = K if MODE == _M else V   # columns of the state this program carries a block of
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mkv = (rk[:, None] < K) & (rv[None, :] < COLS)
    tile = rk[:, None] * COLS + rv[None, :]
    p64 = p.to(tl.int64)
    if MODE == _M:
        s = tl.where((rk[:, None] == rv[None, :]) & mkv, 1., 0.)
    elif MODE == _R:
        if USE_H0:
            s = tl.load(s0_ptr + (n.to(tl.int64) * HV + hv) * K * V + tile, mask=mkv & first, other=0.).to(tl.float32)
        else:
            s = tl.zeros([BK, BV], dtype=tl.float32)
    else:
        s = tl.load(s0_ptr + (p64 * HV + hv) * K * V + tile, mask=mkv, other=0.)

    rows = tl.arange(0, BT)
    for c in range(c0, c0 + nc):
        t0 = bos + c * BT
        if MODE == _OUT:
            slot = (slot0 + c).to(tl.int64)
            tl.store(h_ptr + (slot * HV + hv) * K * V + tile, s.to(h_ptr.dtype.element_ty), mask=mkv)
        p_w = tl.make_block_ptr(w_ptr + t0 * HV * K + hv * K, (eos - t0, K), (HV * K, 1), (0, 0), (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
        b_w = tl.load(p_w, boundary_check=(0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        valid = (t0 + rows) < eos
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
        last_row = tl.minimum(eos - t0, BT) - 1
        gam_last = tl.load(gcum_ptr + (t0 + last_row) * HV + hv)
        if MODE == _M:
            # fp32 operands throughout: M must not be rounded to the 16-bit operand type
            wm = tl.dot(b_w.to(tl.float32), s, input_precision=DOT_PREC)
            kdec = b_k.to(tl.float32) * tl.exp(gam_last - gam)[:, None]
            s = s * tl.exp(gam_last) - tl.dot(tl.trans(kdec), wm, input_precision=DOT_PREC)
        else:
            # the plain pass's arithmetic and roundings, so phase 3 reproduces its h and vnew
            p_u = tl.make_block_ptr(u_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV),
                                    (1, 0))
            b_u = tl.load(p_u, boundary_check=(0, 1)).to(tl.float32)
            vnew = b_u - tl.dot(b_w, s.to(b_w.dtype), input_precision=DOT_PREC)
            vnew_op = vnew.to(vnew_ptr.dtype.element_ty)
            if MODE == _OUT:
                p_vn = tl.make_block_ptr(vnew_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV),
                                         (BT, BV), (1, 0))
                tl.store(p_vn, vnew_op, boundary_check=(0, 1))
            kdec = (b_k.to(tl.float32) * tl.exp(gam_last - gam)[:, None]).to(b_k.dtype)
            s = s * tl.exp(gam_last) + tl.dot(tl.trans(kdec), vnew_op, input_precision=DOT_PREC)

    if MODE == _OUT:
        if STORE_HT:
            if last:
                tl.store(end_ptr + (n.to(tl.int64) * HV + hv) * K * V + tile, s, mask=mkv)
    else:
        tl.store(end_ptr + (p64 * HV + hv) * K * COLS + tile, s, mask=mkv)




@triton.jit
def _segment_pass_kernel(
    k_ptr, w_ptr, u_ptr, gcum_ptr,             # k [T_tot, H, K], w [T_tot, HV, K], u [T_tot, HV, V], gcum [T_tot, HV]
    h_ptr, vnew_ptr,                           # MODE_OUT: h [slots, HV, K, V], vnew [T_tot, HV, V]
    s0_ptr,                                    # MODE_R/_P1: h0 [N, HV, K, V]; MODE_OUT: S_start [NSEG, HV, K, V] fp32
    end_ptr,                                   # MODE_R/_P1: R [NSEG, HV, K, V]; MODE_M: M [NSEG, HV, K, K]; OUT: ht
    m_ptr,                                     # MODE_P1: M [NSEG, HV, K, K] (else unused)
    cu_ptr, chunk_off_ptr, seg_ptr,            # seg [NSEG, 3] int32: (sequence, first chunk, number of chunks)
    N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    MODE: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (column blocks, segment rows, HV). MODE_P1 runs phase 1's R (column blocks 0 .. cdiv(V, BV) - 1) and
    M (the next cdiv(K, BV)) in one launch, so that the programs of one segment and head read w and k from HBM once."""
    vb = tl.program_id(0)
    p = tl.program_id(1)
    hv = tl.program_id(2)
    hk = hv // (HV // H)
    n = tl.load(seg_ptr + 3 * p)
    if n >= N:                                  # surplus row of the host-side bound
        return
    c0 = tl.load(seg_ptr + 3 * p + 1)
    nc = tl.load(seg_ptr + 3 * p + 2)
    bos, eos, slot0, nchunks = sequence_span(cu_ptr, chunk_off_ptr, n, BT)
    first = c0 == 0
    last = c0 + nc >= nchunks
    if MODE == _P1:
        NVB_R: tl.constexpr = (V + BV - 1) // BV
        if vb < NVB_R:
            if c0 + nc < nchunks:               # the last segment's map is never used
                _segment_run(k_ptr, w_ptr, u_ptr, gcum_ptr, h_ptr, vnew_ptr, s0_ptr, end_ptr,
                             n, p, hv, hk, vb, c0, nc, bos, eos, slot0, first, last,
                             H, HV, K, V, BT, BK, BV, _R, USE_H0, False, DOT_PREC)
        else:
            if (c0 > 0) & (c0 + nc < nchunks):  # nor the first segment's M (it starts from the known h0)
                _segment_run(k_ptr, w_ptr, u_ptr, gcum_ptr, h_ptr, vnew_ptr, s0_ptr, m_ptr,
                             n, p, hv, hk, vb - NVB_R, c0, nc, bos, eos, slot0, first, last,
                             H, HV, K, V, BT, BK, BV, _M, USE_H0, False, DOT_PREC)
    else:
        if MODE != _OUT:
            if last:                            # the last segment's map is never used
                return
        if MODE == _M:
            if first:                           # the first segment starts from the known initial state
                return
        _segment_run(k_ptr, w_ptr, u_ptr, gcum_ptr, h_ptr, vnew_ptr, s0_ptr, end_ptr,
                     n, p, hv, hk, vb, c0, nc, bos, eos, slot0, first, last,
                     H, HV, K, V, BT, BK, BV, MODE, USE_H0, STORE_HT, DOT_PREC)


@triton.jit
def _segment_join_kernel(
    m_ptr, r_ptr,                              # M [NSEG, HV, K, K], R [NSEG, HV, K, V] fp32 (phase 1)
    h0_ptr, sstart_ptr,                        # h0 [N, HV, K, V]; S_start [NSEG, HV, K, V] fp32 (out)
    seg_off_ptr,                               # [N + 1] int64: first segment row of each sequence
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKB: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """S_start[s + 1] = M_s S_start[s] + R_s in [BKB, BKB] x [BKB, BV] blocks (M never whole in registers: at K=256
    it would be 256 KB); the state of the previous step is read back from S_start, after a CTA barrier."""
    vb = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    seg0 = tl.load(seg_off_ptr + n)
    nseg = tl.load(seg_off_ptr + n + 1) - seg0
    NKB: tl.constexpr = (K + BKB - 1) // BKB
    rb = tl.arange(0, BKB)
    rv = vb * BV + tl.arange(0, BV)
    # the first segment starts from the initial state (or zero)
    p0 = seg0.to(tl.int64)
    for i in tl.static_range(NKB):
        rows = i * BKB + rb
        mk = (rows[:, None] < K) & (rv[None, :] < V)
        off = rows[:, None] * V + rv[None, :]
        if USE_H0:
            s0 = tl.load(h0_ptr + (n.to(tl.int64) * HV + hv) * K * V + off, mask=mk, other=0.).to(tl.float32)
        else:
            s0 = tl.zeros([BKB, BV], dtype=tl.float32)
        tl.store(sstart_ptr + (p0 * HV + hv) * K * V + off, s0, mask=mk)
    for j in range(0, nseg - 1):
        p = (seg0 + j).to(tl.int64)
        tl.debug_barrier()                      # S_start[p] was stored by other threads of this program
        base = (p * HV + hv) * K * V
        for i in tl.static_range(NKB):
            rows = i * BKB + rb
            mk = (rows[:, None] < K) & (rv[None, :] < V)
            off = rows[:, None] * V + rv[None, :]
            acc = tl.load(r_ptr + base + off, mask=mk, other=0.)
            if j > 0:                           # R of the first segment already started from h0: no M there
                for c in tl.static_range(NKB):
                    cols = c * BKB + rb
                    m = tl.load(m_ptr + (p * HV + hv) * K * K + rows[:, None] * K + cols[None, :],
                                mask=(rows[:, None] < K) & (cols[None, :] < K), other=0.)
                    sv = tl.load(sstart_ptr + base + cols[:, None] * V + rv[None, :],
                                 mask=(cols[:, None] < K) & (rv[None, :] < V), other=0.)
                    acc += tl.dot(m, sv, input_precision=DOT_PREC)
            tl.store(sstart_ptr + base + HV * K * V + off, acc, mask=mk)


@dataclass
class SegmentPlan:
    seg: torch.Tensor          # [num_rows, 3] int32: (sequence, first chunk, number of chunks); sequence N = unused
    seg_offsets: torch.Tensor  # [N + 1] int64: first row of each sequence's segments
    num_rows: int              # host-side bound on the number of segments (grid size)
    seg_chunks: int            # the host's target segment length L in chunks


def auto_seg_chunks(plan: ChunkPlan, HV: int, K: int, V: int, cfg: "SplitConfig", device) -> int:
    """Segment length in chunks from shapes only (LINATTN_GDN_SPLIT_CHUNKS overrides it).

    Wave model: a phase with P programs of L dependent chunk steps each, cfg.per_sm of them resident per SM, takes
    about cdiv(P, SMs * per_sm) * L step times. Over the segment counts ns >= 2 that keep segments at least
    MIN_SEG_CHUNKS long, minimise the sum over phase 1 (R: (ns - 1) segments, M: (ns - 2), per sequence) and phase 3
    (ns) plus phase 2's chain (~1 step per segment), fewest segments on a tie (less work: M and R are skipped only
    at the ends). Sequences are taken at the
    average length num_slots / N (exact for fixed-length batches). Too short to split: one segment per sequence."""
    forced = settings.gdn_split_chunks
    if forced > 0:
        return forced
    facts = device_facts(device)
    sms = facts.num_sms if facts.kind == "cuda" else PLANNING_SMS
    slots = sms * max(1, cfg.per_sm)
    N = plan.N
    nch = max(1, triton.cdiv(plan.num_slots, N))
    vb, mb = triton.cdiv(V, cfg.BV), triton.cdiv(K, cfg.BV_M)

    def waves(progs):
        return triton.cdiv(progs, slots) if progs > 0 else 0
    best = None
    for ns in range(2, nch // MIN_SEG_CHUNKS + 1):
        L = triton.cdiv(nch, ns)
        ns = triton.cdiv(nch, L)
        r, m, o = N * (ns - 1) * HV * vb, N * max(ns - 2, 0) * HV * mb, N * ns * HV * vb
        w = waves(r + m) if cfg.fused_phase1 else waves(r) + waves(m)
        key = ((w + waves(o)) * L + ns, ns)          # + ns: phase 2's chain, about one step per segment
        if best is None or key < best[0]:
            best = (key, L)
    return best[1] if best is not None else nch


def split_state_wanted(plan: ChunkPlan, HV: int, V: int, device) -> bool:
    """Whether the forward should take the split pass when LINATTN_GDN_SPLIT_STATE=1: always off the GPU (so the
    interpreter tests exercise it) or with a forced segment length; on a GPU only when the plain pass leaves SMs
    idle even at its narrowest V split (N * HV * V/32 < SMs: B = 1 at HV=32, V=128) and the sequences are long
    enough for two segments on average. (At B=2 the plain pass has 256 programs, two per SM, and the wave model
    of auto_seg_chunks finds no split faster.) A guess until the GPU round."""
    facts = device_facts(device)
    if facts.kind != "cuda" or settings.gdn_split_chunks > 0:
        return True
    return (plan.N * HV * triton.cdiv(V, 32) < facts.num_sms
            and plan.num_slots >= 2 * MIN_SEG_CHUNKS * plan.N)


def make_segment_plan(plan: ChunkPlan, seg_chunks: int) -> SegmentPlan:
    """Device-side segment table (torch ops only: no host sync)."""
    L = max(1, int(seg_chunks))
    N, dev = plan.N, plan.cu.device
    nch = plan.chunk_offsets[1:] - plan.chunk_offsets[:-1]                     # [N] chunks per sequence
    ns = torch.clamp_min((nch + L - 1) // L, 1)
    per = (nch + ns - 1) // ns                                                 # balanced segment length
    ns = torch.where(nch > 0, (nch + per.clamp_min(1) - 1) // per.clamp_min(1), torch.ones_like(ns))
    seg_offsets = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    torch.cumsum(ns, 0, out=seg_offsets[1:])
    rows = max(plan.num_slots // L + N, 1)
    r = torch.arange(rows, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(seg_offsets[1:].contiguous(), r, right=True)    # in [0, N]; N: unused row
    sc = seq.clamp_max(N - 1)
    within = r - seg_offsets[sc]
    c0 = within * per[sc]
    ncs = torch.minimum(per[sc], nch[sc] - c0).clamp_min(0)
    seg = torch.stack([seq, c0, ncs], 1).to(torch.int32).contiguous()
    return SegmentPlan(seg, seg_offsets, rows, L)


@dataclass(frozen=True)
class SplitConfig:
    BK: int
    BV: int            # phase 1 (R) and phase 3: V block
    BV_M: int          # phase 1 (M): block of M's columns
    BV_JOIN: int       # phase 2: V block
    BKB_JOIN: int      # phase 2: square block of M
    warps: int
    stages: int
    warps_m: int
    stages_m: int
    warps_join: int
    fused_phase1: bool = False   # R and M in one launch (needs BV_M == BV, warps_m == warps, stages_m == stages)
    per_sm: int = 2              # programs resident per SM (registers, smem: the AOT table), for the segment plan


def split_configs(K: int, V: int) -> SplitConfig:
    """Launch configs (ptxas of triton 3.6.0, sm_90a, K=V=128 bf16; benchmarks/SPLIT_STATE.md has the table).

    Unlike the plain pass, the split pass has programs to spare, and what it needs is several programs resident
    per SM so that their per-chunk latencies overlap: 4 warps and no software pipelining (the loads of the other
    resident programs hide the latency instead). R and phase 3 at BV=64: 251/243 registers, 0 spills, 2 programs
    per SM; M at BV=64: 248 registers, 2 per SM; join (blocks of M [64, 64] x S [64, 64]) 4 warps, 164 registers.
    Not yet timed on a GPU: the GPU round (benchmarks/gpu/split_state_round.py --sweep) compares BV=32, 8 warps
    with pipelining (1 per SM) and the fused phase 1 (254 registers)."""
    BK = max(16, triton.next_power_of_2(K))
    if BK <= 128:
        BV = min(max(16, triton.next_power_of_2(V)), 64)
        return SplitConfig(BK=BK, BV=BV, BV_M=min(BK, 64), BV_JOIN=min(BV, 64), BKB_JOIN=min(BK, 64), warps=4,
                           stages=1, warps_m=4, stages_m=1, warps_join=4)
    return SplitConfig(BK=BK, BV=min(max(16, triton.next_power_of_2(V)), 32), BV_M=16, BV_JOIN=32, BKB_JOIN=64,
                       warps=8, stages=1, warps_m=8, stages_m=1, warps_join=4, per_sm=1)


def chunk_state_split(k, w, u, gcum, h, vnew, initial_state: Optional[torch.Tensor],
                      final_state: Optional[torch.Tensor], plan: ChunkPlan, *,
                      H: int, HV: int, K: int, V: int, dot_prec: str,
                      seg_chunks: Optional[int] = None, cfg: Optional[SplitConfig] = None,
                      seg_plan: Optional[SegmentPlan] = None) -> SegmentPlan:
    """The forward's stage 3, segment-parallel: same inputs and outputs as chunk_state_fwd_kernel's launch (writes
    h [slots, HV, K, V], vnew [T_tot, HV, V] and, when given, final_state [N, HV, K, V] fp32 in place).
    Returns the segment plan it used (pass it back as seg_plan to skip rebuilding it)."""
    dev = k.device
    cfg = cfg or split_configs(K, V)
    if seg_plan is None:
        seg_plan = make_segment_plan(plan, seg_chunks if seg_chunks else auto_seg_chunks(plan, HV, K, V, cfg, dev))
    rows, N = seg_plan.num_rows, plan.N
    m_buf = empty(rows, HV, K, K, dtype=torch.float32, device=dev)
    r_buf = empty(rows, HV, K, V, dtype=torch.float32, device=dev)
    s_start = empty(rows, HV, K, V, dtype=torch.float32, device=dev)
    use_h0 = initial_state is not None
    common = dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=cfg.BK, USE_H0=use_h0, DOT_PREC=dot_prec)
    args = (k, w, u, gcum)
    # phase 1: R (from zero, or from h0 for a sequence's first segment) and M, for every segment but the last
    if cfg.fused_phase1:
        assert cfg.BV_M == cfg.BV and cfg.warps_m == cfg.warps and cfg.stages_m == cfg.stages, cfg
        _segment_pass_kernel[(triton.cdiv(V, cfg.BV) + triton.cdiv(K, cfg.BV), rows, HV)](
            *args, h, vnew, initial_state if use_h0 else gcum, r_buf, m_buf, plan.cu, plan.chunk_offsets,
            seg_plan.seg, N, BV=cfg.BV, MODE=MODE_P1, STORE_HT=False, num_warps=cfg.warps, num_stages=cfg.stages,
            **common)
    else:
        _segment_pass_kernel[(triton.cdiv(V, cfg.BV), rows, HV)](
            *args, h, vnew, initial_state if use_h0 else gcum, r_buf, gcum, plan.cu, plan.chunk_offsets,
            seg_plan.seg, N, BV=cfg.BV, MODE=MODE_R, STORE_HT=False, num_warps=cfg.warps, num_stages=cfg.stages,
            **common)
        _segment_pass_kernel[(triton.cdiv(K, cfg.BV_M), rows, HV)](
            *args, h, vnew, gcum, m_buf, gcum, plan.cu, plan.chunk_offsets, seg_plan.seg, N,
            BV=cfg.BV_M, MODE=MODE_M, STORE_HT=False, num_warps=cfg.warps_m, num_stages=cfg.stages_m, **common)
    # phase 2: the segment start states, sequentially per sequence
    _segment_join_kernel[(triton.cdiv(V, cfg.BV_JOIN), N * HV)](
        m_buf, r_buf, initial_state if use_h0 else gcum, s_start, seg_plan.seg_offsets,
        HV=HV, K=K, V=V, BKB=cfg.BKB_JOIN, BV=cfg.BV_JOIN, USE_H0=use_h0, DOT_PREC=dot_prec,
        num_warps=cfg.warps_join)
    # phase 3: the ordinary pass from each segment's true start state
    store_ht = final_state is not None
    _segment_pass_kernel[(triton.cdiv(V, cfg.BV), rows, HV)](
        *args, h, vnew, s_start, final_state if store_ht else gcum, gcum, plan.cu, plan.chunk_offsets, seg_plan.seg,
        N,
        BV=cfg.BV, MODE=MODE_OUT, STORE_HT=store_ht, num_warps=cfg.warps, num_stages=cfg.stages, **common)
    return seg_plan
