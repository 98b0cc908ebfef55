"""Helpers shared by the chunked kernels: where a program's chunk or sequence lies in the packed batch, a state
tile's offsets, bounds-masked 2-D tiles of row-major tensors (tile, load_tile, store_tile), compact vector loads,
and FLA's gate function (softplus) with its chain rule (gate_chain).

Every batch is packed sequences (chunk_indices.py): sequence n spans tokens cu[n]:cu[n+1]; chunk-parallel
kernels get one program per chunk slot, and slots past the real chunk count carry sequence N (surplus slots of
the host-side bound) and must exit before touching cu[N + 1].
"""
import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """input_precision of the products whose operands are fp32 (the block inverse, the gate-scaled tiles, fp32
    states): IEEE for fp32 inputs; TF32x3 (three TF32 products, ~fp32 accuracy) for fp16, whose 11-bit mantissa
    outresolves one TF32 product and whose Tinv of nearly dependent keys (no decay, positive keys) amplifies its
    error past FLA's fp16 tolerances; TF32 for bf16, whose own 8-bit rounding dominates."""
    if dtype == torch.float32:
        return "ieee"
    return "tf32x3" if dtype == torch.float16 else "tf32"


@triton.jit
def slot_chunk(chunk_idx_ptr, p):
    """(sequence, chunk within the sequence) of chunk slot p; sequence N marks a surplus slot."""
    return tl.load(chunk_idx_ptr + 2 * p), tl.load(chunk_idx_ptr + 2 * p + 1)


@triton.jit
def chunk_span(cu_ptr, n, c, BT: tl.constexpr):
    """(bos, eos, t0): the sequence's token range and the chunk's first token, in int64 (token offsets times
    head strides can pass 2^31)."""
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    return bos, eos, bos + c.to(tl.int64) * BT


@triton.jit
def sequence_span(cu_ptr, chunk_off_ptr, n, BT: tl.constexpr):
    """(bos, eos, first chunk slot, number of chunks) of sequence n, for the sequential state passes."""
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    return bos, eos, tl.load(chunk_off_ptr + n), tl.cdiv(tl.maximum(eos - bos, 0), BT)


@triton.jit
def state_program(HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """(sequence, value head, V block) of a state-pass program. One grid axis (x: up to 2^31 - 1 programs; y and z
    stop at 65535), V blocks fastest: the programs of one sequence-head, which read the same k and w tiles, are
    dispatched next to each other."""
    NV: tl.constexpr = (V + BV - 1) // BV
    nh = tl.program_id(0) // NV
    return nh // HV, nh % HV, tl.program_id(0) % NV


@triton.jit
def state_tile(n, hv, vb, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               V_FIRST: tl.constexpr = False):
    """Rows, columns, mask and int64 offsets of the [BK, BV] block vb of state [n, hv] in an [N, HV, K, V] tensor, or
    with V_FIRST (FLA's state_v_first) in an [N, HV, V, K] one: the same [BK, BV] block read through transposed
    strides."""
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mkv = (rk[:, None] < K) & (rv[None, :] < V)
    if V_FIRST:
        return rk, rv, mkv, (n.to(tl.int64) * HV + hv) * K * V + rk[:, None] + rv[None, :] * K
    return rk, rv, mkv, (n.to(tl.int64) * HV + hv) * K * V + rk[:, None] * V + rv[None, :]


@triton.jit
def tile(base, r0, c0, n_rows, n_cols, row_stride, BR: tl.constexpr, BC: tl.constexpr,
         CHECK_COLS: tl.constexpr = True):
    """Pointers and bounds mask of the [BR, BC] tile whose corner is (r0, c0) in a row-major [n_rows, n_cols] matrix
    at base, with unit column stride (the offsets stay contiguous, so loads and stores vectorise) and row stride
    row_stride. The mask keeps rows < n_rows and, with CHECK_COLS, columns < n_cols. Row offsets are int64, as is
    the offset base carries (tokens times head strides can pass 2^31); ptxas also allocates the chunked stages'
    registers best this way (int32 rows spilled 8 B in backward_local.py)."""
    r = (r0 + tl.arange(0, BR)).to(tl.int64)
    c = c0 + tl.arange(0, BC)
    ptrs = base + r[:, None] * row_stride + c[None, :]
    if CHECK_COLS:
        mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    else:
        mask = r[:, None] < n_rows
    return ptrs, mask


@triton.jit
def load_tile(base, r0, c0, n_rows, n_cols, row_stride, BR: tl.constexpr, BC: tl.constexpr,
              CHECK_COLS: tl.constexpr = True):
    """The [BR, BC] tile of `tile`, zero outside the mask."""
    ptrs, mask = tile(base, r0, c0, n_rows, n_cols, row_stride, BR, BC, CHECK_COLS)
    return tl.load(ptrs, mask=mask, other=0.)


@triton.jit
def store_tile(base, x, r0, c0, n_rows, n_cols, row_stride, CHECK_COLS: tl.constexpr = True):
    """Stores the [BR, BC] tile x at `tile`'s pointers, only where its mask holds."""
    ptrs, mask = tile(base, r0, c0, n_rows, n_cols, row_stride, x.shape[0], x.shape[1], CHECK_COLS)
    tl.store(ptrs, x, mask=mask)


@triton.jit
def load_vec_compact(ptrs, mask, BT: tl.constexpr):
    """A [BT] vector (gate or beta of one value head) loaded as a [BT, 2] tile whose two columns read the same
    address, then split. A load of >= 32 * num_warps elements counts as expensive to Triton's layout pass, so it is
    not rematerialised in the [64, 64] WGMMA tile's column slice (16 elements and 16 64-bit pointers per thread, kept
    live across phases: most of a 380 B spill in backward_wy.py); it stays one element per thread and is
    converted (through shared memory) where it is used."""
    two = tl.arange(0, 2)
    x = tl.load(ptrs[:, None] + two[None, :] * 0, mask=mask[:, None], other=0.)
    a, b = tl.split(x)
    return a


@triton.jit
def softplus(x):
    """log(1 + exp(x)) as max(x, 0) + log(1 + exp(-|x|)), which cannot overflow. FLA (its gate of use_gate_in_kernel)
    and torch.nn.functional.softplus return x itself above 20, where the two differ by log(1 + e^-20) < 2.1e-9."""
    return tl.maximum(x, 0.) + tl.log(1. + tl.exp(-tl.abs(x)))


@triton.jit
def kda_gate_act(x, A_log, hv, GATE: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """FLA's KDA gate on x, the raw input with dt_bias added, of value head hv: "softplus" -exp(A_log) softplus(x),
    "lower_bound" LOWER_BOUND sigmoid(exp(A_log) x), "lower_bound_no_a" LOWER_BOUND sigmoid(x). Elementwise on any
    shape, and callable from Gluon kernels (KDA's Gluon stage 2a)."""
    if GATE == "lower_bound_no_a":
        return LOWER_BOUND * tl.sigmoid(x)
    else:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
        if GATE == "softplus":
            return -a * softplus(x)
        else:
            tl.static_assert(GATE == "lower_bound", "GATE: softplus, lower_bound, lower_bound_no_a")
            return LOWER_BOUND * tl.sigmoid(a * x)


@triton.jit
def gate_chain(dg, g_raw_ptr, A_log_ptr, dt_bias_ptr, dgate_ptr, r, valid, hv, slot, n_slots, HV: tl.constexpr,
               BT: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """FLA's use_gate_in_kernel: dg is the gradient of the decay g_eff = -exp(A_log) softplus(x), x = g + dt_bias, at
    rows r (one chunk). Returns the gradient of the raw g, dg * -exp(A_log) sigmoid(x), and stores this chunk's sums of
    the parameters' per-token terms at its slot (the launcher sums the slots, col_sum.py): dg * g_eff for A_log
    (d g_eff / d A_log = g_eff) to dgate[0, slot, hv], the raw g's gradient for dt_bias to dgate[1, slot, hv] (fp32,
    dgate [2, n_slots, HV])."""
    x = load_vec_compact(g_raw_ptr + r * HV + hv, valid, BT).to(tl.float32)
    if HAS_DT_BIAS:
        x = x + tl.load(dt_bias_ptr + hv).to(tl.float32)
    neg_a = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32))
    tl.store(dgate_ptr + slot * HV + hv, tl.sum(tl.where(valid, dg * (neg_a * softplus(x)), 0.), axis=0))
    dx = dg * (neg_a * tl.sigmoid(x))
    if HAS_DT_BIAS:
        tl.store(dgate_ptr + (n_slots + slot) * HV + hv, tl.sum(tl.where(valid, dx, 0.), axis=0))
    return dx


LOG2E = tl.constexpr(1.4426950408889634)          # exp(x) = 2^(x log2 e)


@triton.jit
def exp2_fast(x, FTZ: tl.constexpr):
    """2^x. FTZ (compiled for NVIDIA): one MUFU.EX2 by ex2.approx.ftz.f32, whose results below 2^-126 flush to 0
    (a decay factor that small is 0 to every sum it enters); tl.exp2 adds a range fix-up for such results (FSETP and
    two FMUL per element). Otherwise (the interpreter, other targets) tl.exp2."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def exp_fast(x, FTZ: tl.constexpr):
    """e^x as exp2_fast(x log2 e)."""
    return exp2_fast(x * LOG2E, FTZ)


def ftz_exp2(t) -> bool:
    """exp2_fast's FTZ for kernels on t's device: compiled for an NVIDIA GPU (inline PTX), not the interpreter."""
    from linattn.runtime.settings import settings
    return t.device.type == "cuda" and torch.version.hip is None and not settings.interpret


@triton.jit
def contracts(k_ptr, beta_ptr, bos, eos, c_lo, c_hi, hv, hk, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, BETA_SCALE: tl.constexpr):
    """Whether every token of chunks [c_lo, c_hi) of the sequence at tokens [bos, eos) has 0 <= beta ||k||^2 <= 2 for
    head hv (its transition I - beta k k^T is a contraction): the condition of the gate-truncated windows
    (segment_start.py's segments, cp_summary.py's boundary summaries). beta: the input, a logit activated as
    BETA_SCALE * sigmoid(beta) where BETA_SCALE > 0."""
    i = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    bad = 0
    for c in range(c_lo, c_hi):
        r = bos + c * BT + i
        m = r < eos
        kf = tl.load(k_ptr + (r.to(tl.int64) * H + hk)[:, None] * K + rk[None, :], mask=m[:, None] & (rk[None, :] < K),
                     other=0.).to(tl.float32)
        b = tl.load(beta_ptr + r.to(tl.int64) * HV + hv, mask=m, other=0.).to(tl.float32)
        if BETA_SCALE > 0:
            b = BETA_SCALE * tl.sigmoid(b)
        bkk = tl.where(m, b * tl.sum(kf * kf, axis=1), 0.)
        bad = tl.maximum(bad, tl.max(((bkk < 0.) | (bkk > 2.)).to(tl.int32), axis=0))
    return bad == 0
