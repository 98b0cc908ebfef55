"""Stage 4 of the forward (gdn-math.md): the output, parallel over chunks,

    O = diag(exp(gam)) (scale Q) S + ((scale Q K^T) * Gam * lower_incl) Vnew

with S the chunk-start state h[chunk] from the state pass. One program per (V block, chunk slot, value head).

chunk_output_loop_kernel, OutputConfig and chunk_output(): the K-loop variant and its launcher (benchmarks/OUTPUT_STAGE.md).
Since round 13 forward.py launches OUTPUT_V2 through chunk_output(); LINATTN_GDN_OUTPUT=v1 launches
chunk_output_kernel as before.
"""
from dataclasses import dataclass

import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import chunk_span, slot_chunk


# The three parts of O, one jit helper each, shared with the fused state+output kernel (chunk_fused_fwd.py) so that
# both round at the same points (each kernel orders the calls for its own register pressure).

@triton.jit
def chunk_output_inter(b_q, b_h, gam, DOT_PREC: tl.constexpr):
    """diag(exp(gam)) Q S, fp32 [BT, BV]: q [BT, BK] and the chunk-start state b_h [BK, BV] in the operand dtype."""
    return tl.dot(b_q, b_h, input_precision=DOT_PREC) * tl.exp(gam)[:, None]


@triton.jit
def chunk_attention(b_q, b_k, gam, BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """(Q K^T) * Gam * lower_incl in the operand dtype (the left operand of att Vnew); q, k [BT, BK] with rows past
    the sequence end zero, gam [BT] fp32 (0 past the end). Unscaled: the scale multiplies O."""
    qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    return chunk_attention_from_qk(qk, gam, BT, b_q.dtype)


@triton.jit
def chunk_attention_from_qk(qk, gam, BT: tl.constexpr, OP_DTYPE: tl.constexpr):
    """chunk_attention's mask and decay on a given fp32 q k^T [BT, BT] (the K-loop kernel accumulates it over K
    blocks); the result in OP_DTYPE."""
    rows = tl.arange(0, BT)
    lower = rows[:, None] >= rows[None, :]
    # mask before exp (see intra_chunk.py)
    gmat = tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.))
    return tl.where(lower, qk * gmat, 0.).to(OP_DTYPE)


@triton.jit
def chunk_output_combine(o_inter, att, b_vn, scale, DOT_PREC: tl.constexpr):
    """O = (o_inter + att Vnew) * scale, fp32; b_vn [BT, BV] in the operand dtype."""
    return (o_inter + tl.dot(att, b_vn, input_precision=DOT_PREC)) * scale


@triton.jit
def chunk_output_kernel(
    q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr, o_ptr,
    cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    vb = tl.program_id(0)
    p = tl.program_id(1)
    hv = tl.program_id(2)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    slot = (tl.load(chunk_off_ptr + n) + c).to(tl.int64)
    hk = hv // (HV // H)
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos

    p_q = tl.make_block_ptr(q_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
    p_h = tl.make_block_ptr(h_ptr + (slot * HV + hv) * K * V, (K, V), (V, 1), (0, vb * BV), (BK, BV), (1, 0))
    p_vn = tl.make_block_ptr(vnew_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    b_h = tl.load(p_h, boundary_check=(0, 1))
    b_vn = tl.load(p_vn, boundary_check=(0, 1))
    gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)

    o_inter = chunk_output_inter(b_q, b_h, gam, DOT_PREC)
    att = chunk_attention(b_q, b_k, gam, BT, DOT_PREC)
    o = chunk_output_combine(o_inter, att, b_vn, scale, DOT_PREC)
    p_o = tl.make_block_ptr(o_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
    tl.store(p_o, o.to(o_ptr.dtype.element_ty), boundary_check=(0, 1))


# ---- Opt-in variant for the GPU round of benchmarks/OUTPUT_STAGE.md (not used by forward.py): the same O with the
# two K-sized products (q S and q k^T) accumulated over K blocks of BK inside a loop, so that Triton's pipeliner
# copies q, k and h straight to shared memory with cp.async (num_stages deep) instead of staging all of them in
# registers first; and, with GROUP_HEADS, the programs that read the same q and k tile (the V blocks of the
# HV // H value heads of one key head) launched next to each other so that all but the first find it in L2.
# Same rounding points as chunk_output_kernel (fp32 accumulators, att and vnew in the operand dtype); with BK = K the
# products are the same, otherwise only their accumulation order over K differs.

@triton.jit
def chunk_output_loop_kernel(
    q_ptr, k_ptr, vnew_ptr, h_ptr, gcum_ptr, o_ptr,
    cu_ptr, chunk_idx_ptr, chunk_off_ptr, N, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
    GROUP_HEADS: tl.constexpr, VN_FIRST: tl.constexpr,
):
    """Grid (cdiv(V, BV), slots, HV), or with GROUP_HEADS (cdiv(V, BV) * (HV // H), slots, H): program_id(0) then
    walks the V blocks of each value head of key head program_id(2). VN_FIRST: load vnew and gam before the K loop
    (their latency under the loop) instead of after it."""
    NVB: tl.constexpr = (V + BV - 1) // BV
    if GROUP_HEADS:
        hk = tl.program_id(2)
        vb = tl.program_id(0) % NVB
        hv = hk * (HV // H) + tl.program_id(0) // NVB
    else:
        vb = tl.program_id(0)
        hv = tl.program_id(2)
        hk = hv // (HV // H)
    p = tl.program_id(1)
    n, c = slot_chunk(chunk_idx_ptr, p)
    if n >= N:                                 # surplus slot of the varlen bound
        return
    bos, eos, t0 = chunk_span(cu_ptr, n, c, BT)
    slot = (tl.load(chunk_off_ptr + n) + c).to(tl.int64)
    rows = tl.arange(0, BT)
    valid = (t0 + rows) < eos

    p_vn = tl.make_block_ptr(vnew_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
    if VN_FIRST:
        b_vn = tl.load(p_vn, boundary_check=(0, 1))
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)
    p_q = tl.make_block_ptr(q_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k_ptr + t0 * H * K + hk * K, (eos - t0, K), (H * K, 1), (0, 0), (BT, BK), (1, 0))
    p_h = tl.make_block_ptr(h_ptr + (slot * HV + hv) * K * V, (K, V), (V, 1), (0, vb * BV), (BK, BV), (1, 0))
    acc_o = tl.zeros([BT, BV], dtype=tl.float32)
    acc_a = tl.zeros([BT, BT], dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BK)):
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_h = tl.load(p_h, boundary_check=(0, 1))
        acc_o = tl.dot(b_q, b_h, acc_o, input_precision=DOT_PREC)
        acc_a = tl.dot(b_q, tl.trans(b_k), acc_a, input_precision=DOT_PREC)
        p_q = tl.advance(p_q, (0, BK))
        p_k = tl.advance(p_k, (0, BK))
        p_h = tl.advance(p_h, (BK, 0))
    if not VN_FIRST:
        b_vn = tl.load(p_vn, boundary_check=(0, 1))
        gam = tl.load(gcum_ptr + (t0 + rows) * HV + hv, mask=valid, other=0.)

    o_inter = acc_o * tl.exp(gam)[:, None]
    att = chunk_attention_from_qk(acc_a, gam, BT, q_ptr.dtype.element_ty)
    o = chunk_output_combine(o_inter, att, b_vn, scale, DOT_PREC)
    p_o = tl.make_block_ptr(o_ptr + t0 * HV * V + hv * V, (eos - t0, V), (HV * V, 1), (0, vb * BV), (BT, BV), (1, 0))
    tl.store(p_o, o.to(o_ptr.dtype.element_ty), boundary_check=(0, 1))


@dataclass(frozen=True)
class OutputConfig:
    """A launch of stage 4. kernel "one": chunk_output_kernel (BK must be the padded K; group_heads and vn_first
    unused); "loop": chunk_output_loop_kernel. forward.py launches OUTPUT_V2 (DEFAULT_OUTPUT with
    LINATTN_GDN_OUTPUT=v1, as before round 13)."""
    kernel: str = "one"
    BK: int = 0            # 0: the padded K (one K block)
    BV: int = 64
    warps: int = 4
    stages: int = 2
    group_heads: bool = False
    vn_first: bool = False

    @property
    def name(self) -> str:
        s = f"{self.kernel}_bk{self.BK or 'K'}_bv{self.BV}_w{self.warps}_s{self.stages}"
        return s + ("_gh" if self.group_heads else "") + ("_vnf" if self.vn_first else "")


DEFAULT_OUTPUT = OutputConfig()            # LINATTN_GDN_OUTPUT=v1: forward.py's launch before round 13
# forward.py's launch since round 13 (H200, B1 T65536 H16/HV32: 0.929 ms vs 1.222 for DEFAULT_OUTPUT, o identical;
# B8 T4096: 0.469 vs 0.612; results/2026-11-29_r13_output_stage.json)
OUTPUT_V2 = OutputConfig("loop", 64, 128, 8, 2, True)


def chunk_output(q, k, vnew, h, gcum, o, plan, scale, *, H, HV, K, V, dot_prec, cfg: OutputConfig = DEFAULT_OUTPUT,
                 BT: int = 64):
    """Launch stage 4 with `cfg` into o (forward.py's launch when cfg is DEFAULT_OUTPUT and V >= 64). Returns what the
    Triton launch returns (the compiled kernel on a GPU: n_regs, n_spills, metadata.shared)."""
    BKp = max(16, triton.next_power_of_2(K))
    BK = min(cfg.BK or BKp, BKp)
    BV = min(cfg.BV, max(16, triton.next_power_of_2(V)))
    nvb = triton.cdiv(V, BV)
    args = (q, k, vnew, h, gcum, o, plan.cu, plan.chunk_indices, plan.chunk_offsets, plan.N, scale)
    meta = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, DOT_PREC=dot_prec, num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.kernel == "one":
        if BK != BKp:
            raise ValueError("chunk_output_kernel takes the whole K in one block (BK = 0 or the padded K)")
        return chunk_output_kernel[(nvb, plan.num_slots, HV)](*args, BK=BK, **meta)
    if cfg.kernel == "loop":
        grid = (nvb * (HV // H), plan.num_slots, H) if cfg.group_heads else (nvb, plan.num_slots, HV)
        return chunk_output_loop_kernel[grid](*args, BK=BK, GROUP_HEADS=cfg.group_heads, VN_FIRST=cfg.vn_first,
                                              **meta)
    raise ValueError(f"unknown stage-4 kernel {cfg.kernel!r}")


# The GPU round's candidates (benchmarks/gpu/output_stage_round.py, benchmarks/OUTPUT_STAGE.md), the default first.
# Registers / CTAs per SM on sm_90a at K=V=128 bf16 (aot_output.py) in the comments.
OUTPUT_CANDIDATES = (
    DEFAULT_OUTPUT,                                               # 165 regs, 3 x 4 warps, no cp.async
    OutputConfig("one", 0, 32, 4, 2),                             # 128, 4 x 4: config only, q/k read 4x (L2)
    OutputConfig("loop", 128, 64, 4, 2, True, True),              # 165, 3 x 4: the default + grouped heads only
    OutputConfig("loop", 64, 64, 4, 2),                           # 154, 3 x 4: FLA-like K loop, cp.async
    OutputConfig("loop", 64, 64, 4, 3),                           # 154, 3 x 4 (72 KB smem)
    OutputConfig("loop", 64, 64, 8, 2, False, True),              # 80, 3 x 8
    OutputConfig("loop", 64, 64, 8, 2, True, True),               # 80, 3 x 8, grouped heads
    OutputConfig("loop", 64, 32, 8, 2, False, True),              # 74, 3 x 8
    OutputConfig("loop", 32, 64, 8, 2, False, True),              # 80, 3 x 8, 4 K steps
    OutputConfig("loop", 64, 32, 4, 2),                           # 128, 4 x 4
    OutputConfig("loop", 64, 128, 8, 2),                          # 116, 2 x 8: q k^T once per chunk and head
    OutputConfig("loop", 64, 128, 8, 2, True),                    # 119, 2 x 8, grouped heads
)
