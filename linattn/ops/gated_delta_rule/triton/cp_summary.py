"""The forward boundary summary of context parallelism (linattn/distributed/chunk.py, docs/context-parallel.md).

Over one sequence's tokens on a rank, the state map is affine per value head: S_out = M S_in + C, with
M = prod_t exp(g_t) (I - beta_t k_t k_t^T) ([K, K]) and C the state the tokens produce from the state they start
with here (the sequence's initial state where it starts on this rank, else zero). Every column of S follows the
same linear map, so M is the state pass run from S_in = I with U = 0 (v := 0), and C the state pass run with the
real U: one launch computes both, as one [K, V + K] state [C | M] split into column blocks:

    block vb < cdiv(V, BV):  columns of C, started from h0 (USE_H0) or zero, U loaded
    block vb >= cdiv(V, BV): columns of M, started from the identity's columns, U = 0 (its tile starts past
                             column V, so the bounds mask zero-fills it)

With per-key-channel decays (KDA, DECAY "channel") the map is the same with exp(g_t) a diagonal matrix, and the
same launch computes it. Per chunk the arithmetic is stage 3's (chunk_state.py: the same loads and update, the
state rounded to the operand
dtype for W S exactly as there); nothing but the final [C | M] is written (no h, no Vnew).
"""
import torch
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.chunk_state import state_chunk_inputs, state_update
from linattn.ops.gated_delta_rule.triton.common import contracts, dot_precision
from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2


THRESH = 20.0      # a window's summed log decay reaches -20: what lies beyond it is damped by e^-20 = 2.1e-9
MAX_WINDOW = 16    # chunks: a window that needs more is not taken (the whole range runs)


@triton.jit
def _chunk_decays(gcum_ptr, bos, eos, c, valid, hv, HV: tl.constexpr, BT: tl.constexpr):
    """The summed log decay of chunks c (a vector; gcum is the within-chunk cumulative log decay: its last row's)."""
    last = tl.minimum(bos + (c.to(tl.int64) + 1) * BT, eos) - 1
    return tl.load(gcum_ptr + last * HV + hv, mask=valid, other=0.)


@triton.jit
def tail_window(gcum_ptr, k_ptr, beta_ptr, bos, eos, nchunks, hv, hk, thresh, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, MAXW: tl.constexpr, BETA_SCALE: tl.constexpr):
    """The first chunk of the shortest tail [cw, nchunks) of at most MAXW chunks whose summed log decay is <= -thresh
    and whose every token's transition is a contraction: the state the tail starts with then reaches its end damped
    by e^-thresh or more, so the tail run from zero gives the range's final state (and its transition, ~0) to that
    bound. 0 (the whole range) where no such tail exists."""
    j = tl.arange(0, MAXW)                     # chunk nchunks - 1 - j
    inside = j < nchunks
    dec = _chunk_decays(gcum_ptr, bos, eos, nchunks - 1 - j, inside, hv, HV, BT)
    hit = inside & (tl.cumsum(dec, 0) <= -thresh)
    first = tl.min(tl.where(hit, j, MAXW), 0)
    cw = tl.where(first < MAXW, nchunks - 1 - first, 0)
    if cw > 0:
        cw = tl.where(contracts(k_ptr, beta_ptr, bos, eos, cw, nchunks, hv, hk, H, HV, K, BT, BK, BETA_SCALE), cw, 0)
    return cw


@triton.jit
def head_window_kernel(
    gcum_ptr, k_ptr, beta_ptr, cu_ptr,         # gcum [T_tot, HV], k [T_tot, H, K], beta [T_tot, HV], cu [2] int64
    out_ptr, thresh,                           # out [1] int32 (zeroed): the max over heads of the window's end
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, MAXW: tl.constexpr,
    BETA_SCALE: tl.constexpr,
):
    """Program hv: the end ce (in chunks) of the shortest head [0, ce) of at most MAXW chunks of the sequence
    cu[0]:cu[1] whose summed log decay is <= -thresh and whose every token's transition is a contraction (the
    gradient of the state entering the sequence then gets what lies past ce damped by e^-thresh or more), the
    sequence's chunk count where none; the max over heads goes to out[0]."""
    hv = tl.program_id(0)
    hk = hv // (HV // H)
    bos = tl.load(cu_ptr)
    eos = tl.load(cu_ptr + 1)
    nchunks = tl.cdiv(tl.maximum(eos - bos, 0), BT)
    j = tl.arange(0, MAXW)
    inside = j < nchunks
    dec = _chunk_decays(gcum_ptr, bos, eos, j, inside, hv, HV, BT)
    hit = inside & (tl.cumsum(dec, 0) <= -thresh)
    first = tl.min(tl.where(hit, j, MAXW), 0)
    ce = tl.where(first < MAXW, first + 1, nchunks)
    if ce < nchunks:
        ce = tl.where(contracts(k_ptr, beta_ptr, bos, eos, 0, ce, hv, hk, H, HV, K, BT, BK, BETA_SCALE), ce, nchunks)
    tl.atomic_max(out_ptr, ce.to(tl.int32))


@triton.jit
def chunk_state_summary_kernel(
    k_ptr, w_ptr, u_ptr, gcum_ptr,             # k [T_tot, H, K], w [T_tot, HV, K], u [T_tot, HV, V], gcum [T_tot, HV]
    h0_ptr, hm_ptr,                            # h0 [HV, K, V] fp32 (USE_H0), hm [HV, K, V + K] fp32 out: [C | M]
    cu_ptr,                                    # [2] int64: the sequence's token range
    beta_ptr, thresh,                          # beta [T_tot, HV] (the input) and the window's bound (WINDOW)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, DOT_PREC: tl.constexpr, DECAY: tl.constexpr = "scalar",
    WINDOW: tl.constexpr = False, MAXW: tl.constexpr = 16, BETA_SCALE: tl.constexpr = 0,
):
    vb = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // (HV // H)
    bos = tl.load(cu_ptr)
    eos = tl.load(cu_ptr + 1)
    nchunks = tl.cdiv(tl.maximum(eos - bos, 0), BT)
    c_start = 0
    if WINDOW:                                 # scalar decay only: the chain from the tail window, from zero
        c_start = tail_window(gcum_ptr, k_ptr, beta_ptr, bos, eos, nchunks, hv, hk, thresh, H, HV, K, BT, BK, MAXW,
                              BETA_SCALE)

    NVB: tl.constexpr = (V + BV - 1) // BV
    is_m = vb >= NVB
    rk = tl.arange(0, BK)
    cols = tl.arange(0, BV)
    col_c = vb * BV + cols                     # column of C (blocks below NVB)
    col_m = (vb - NVB) * BV + cols             # column of M (blocks from NVB on)
    mask_c = (rk[:, None] < K) & (col_c[None, :] < V)
    mask_m = (rk[:, None] < K) & (col_m[None, :] < K)
    if is_m:
        s = tl.where(mask_m & (rk[:, None] == col_m[None, :]), 1.0, 0.0).to(tl.float32)
    else:
        if USE_H0:
            s = tl.load(h0_ptr + hv.to(tl.int64) * K * V + rk[:, None] * V + col_c[None, :],
                        mask=mask_c & (c_start == 0), other=0.).to(tl.float32)
        else:
            s = tl.zeros([BK, BV], dtype=tl.float32)

    for c in range(c_start, nchunks):
        t0 = bos + c * BT
        b_w, b_u, b_k, gam, gam_last = state_chunk_inputs(k_ptr, w_ptr, u_ptr, gcum_ptr, t0, eos, hv, hk, vb,
                                                          H, HV, K, V, BT, BK, BV, DECAY)
        vnew = b_u - tl.dot(b_w, s.to(b_w.dtype), input_precision=DOT_PREC)
        s = state_update(s, b_k, vnew, gam, gam_last, DOT_PREC, DECAY)

    out_col = tl.where(is_m, V + col_m, col_c)
    tl.store(hm_ptr + hv.to(tl.int64) * K * (V + K) + rk[:, None] * (V + K) + out_col[None, :], s,
             mask=tl.where(is_m, mask_m, mask_c))


def summary_config(K: int, V: int, HV: int, device):
    """(BK, BV, warps, stages): stage 3's config for one sequence (forward._configs with N = 1)."""
    cfg = _configs(K, V, 1, HV, device)
    return _pow2(K), cfg.BV_state, cfg.warps_state, cfg.stages


def launch_state_summary(k, w, u, gcum, h0, hm, cu2, with_transition: bool, decay: str = "scalar", beta=None,
                         beta_scale: int = 0, thresh: float = THRESH):
    """[C | M] of the sequence spanning tokens cu2[0]:cu2[1] (cu2: an int64 device view of two offsets) into hm
    [HV, K, V + K] fp32. h0: [HV, K, V] fp32 or None (zero). with_transition=False computes only C (hm's M columns
    are left unwritten): the M of a sequence that starts on this rank is never read. decay "channel" (KDA): k the
    decayed keys and gcum per key channel, as the state pass takes them. beta (the call's beta [T, HV], a logit
    with beta_scale 1 or 2), scalar decay only: each head runs only the tail window where one exists (tail_window;
    a head whose decay is slower runs the whole range), to e^-thresh of the whole range's [C | M]."""
    H, K = k.shape[-2], k.shape[-1]
    HV, V = u.shape[1], u.shape[2]
    BK, BV, warps, stages = summary_config(K, V, HV, k.device)
    blocks = triton.cdiv(V, BV) + (triton.cdiv(K, BV) if with_transition else 0)
    window = beta is not None and decay == "scalar"
    chunk_state_summary_kernel[(blocks, HV)](
        k, w, u, gcum, h0 if h0 is not None else gcum, hm, cu2, beta if window else gcum, float(thresh),
        H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=BK, BV=BV, USE_H0=h0 is not None,
        DOT_PREC=dot_precision(w.dtype), DECAY=decay, WINDOW=window, MAXW=MAX_WINDOW, BETA_SCALE=beta_scale,
        num_warps=warps, num_stages=stages)


def head_window_range(gcum, k, beta, cu2, beta_scale: int = 0, thresh: float = THRESH) -> torch.Tensor:
    """cu2 (an int64 device view of a sequence's two offsets) cut to the head window of head_window_kernel, the
    widest over heads (device ops only): the range the context-parallel backward's dh0-only pass needs, to e^-thresh,
    where no gradient enters the sequence's final state."""
    H, K = k.shape[-2], k.shape[-1]
    HV = gcum.shape[-1]
    ce = torch.zeros(1, dtype=torch.int32, device=gcum.device)
    head_window_kernel[(HV,)](gcum, k, beta, cu2, ce, float(thresh), H=H, HV=HV, K=K, BT=CHUNK, BK=_pow2(K),
                              MAXW=MAX_WINDOW, BETA_SCALE=beta_scale, num_warps=4)
    return torch.cat([cu2[:1], torch.minimum(cu2[:1] + ce.to(torch.int64) * CHUNK, cu2[1:2])])
