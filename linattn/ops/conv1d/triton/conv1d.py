"""Triton kernels and launchers of `causal_conv1d`, forward and backward.

Grid (D blocks, token blocks, batch rows). Under cu_seqlens every token finds its sequence by a binary search of
the offsets on the device (common.seq_of), so no chunk table is built and nothing is read back on the host. The
backward (one kernel) recomputes the pre-activation (x, weight and the initial state are all it keeps): per token
block, da = dy silu'(a) for the block and its next W - 1 tokens goes through a per-program scratch in L2 and is read
back at the W shifts of dx[t] = sum_i weight[:, W - 1 - i] * da[t + i] over the tokens t + i of t's sequence, plus
the final state's gradient for a sequence's last W tokens; dweight and dbias are summed per program over a strided set
of token blocks into fp32 partials (deterministic, reduced by col_sum_kernel, linattn/ops/col_sum.py, in the
parameters' dtypes). d initial_state comes from one small program per (D block, sequence), as does the final state."""
import torch
import triton
import triton.language as tl

from linattn.ops.col_sum import col_sum
from linattn.ops.conv1d.triton.common import load_src, preact, seq_of, silu_grad
from linattn.runtime.alloc import empty
from linattn.runtime.device import device_facts
from linattn.runtime.host_path import HostPath, LaunchCache, cdiv, next_power_of_2
from linattn.runtime.op_lists import OpLists

# tokens per block: the forward's (32 ran 6% faster than 64 on an H200 at the layer's shapes) and the backward's
BT = 32
BT_BWD = 64
# The forward and backward run once per layer and step with the same shapes: their launches go through the compiled
# kernels' handles once a launch signature has been seen (runtime/host_path.LaunchCache), skipping the JIT's binding;
# a repeat plain eager forward without autograd replays its signature's launch list (LISTS, keyed by api.py's
# _CHECKED key; runtime/op_lists.py).
host_path = HostPath()
launches = LaunchCache(host_path)
LISTS = OpLists(host_path)


def _block_d(D: int, bwd: bool = False) -> int:
    """Channels per block: 64, or 32 in the backward, whose first pass holds the pre-activation's input tiles and
    the dweight products (168 registers at 64 x 64: three programs per SM; 32 channels ran 8% faster on an H200)."""
    return min(32 if bwd else 64, next_power_of_2(D))


def _log_n(N: int) -> int:
    return max(N - 1, 0).bit_length()


@triton.jit
def _tokens(cu_seqlens, i_b, t0, T, N, BT: tl.constexpr, LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Token positions t0 .. t0 + BT - 1 (int64), their mask, and per token its sequence, start and end."""
    t = (t0 + tl.arange(0, BT)).to(tl.int64)              # t0 + BT < T + 2 BT < 2^31
    m_tok = t < T
    if IS_VARLEN:
        n = seq_of(cu_seqlens, t, N, LOG_N)
        bos = tl.load(cu_seqlens + n, mask=m_tok, other=0).to(tl.int64)
        eos = tl.minimum(tl.load(cu_seqlens + n + 1, mask=m_tok, other=0).to(tl.int64), T)
    else:
        n = tl.zeros_like(t) + i_b
        bos = tl.zeros_like(t)
        eos = tl.zeros_like(t) + T
    return t, m_tok, n, bos, eos


@triton.jit
def conv1d_fwd_kernel(x, weight, bias, residual, h0, cu_seqlens, y, T, N, D, stride_b, stride_t, stride_d,
                      W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, LOG_N: tl.constexpr,
                      SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_H0: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    t, m_tok, n, bos, eos = _tokens(cu_seqlens, i_b, i_t * BT, T, N, BT, LOG_N, IS_VARLEN)
    x_row = x + i_b.to(tl.int64) * stride_b
    a = preact(x_row, h0, weight, bias, t, bos, n, o_d, m_tok, D, stride_t, stride_d, W, HAS_H0, HAS_BIAS)
    if SILU:
        a = a * tl.sigmoid(a)
    off = (i_b.to(tl.int64) * T + t)[:, None] * D + o_d[None, :]
    m = m_tok[:, None] & m_d[None, :]
    if HAS_RES:
        a += tl.load(residual + off, mask=m, other=0.).to(tl.float32)
    tl.store(y + off, a.to(y.dtype.element_ty), mask=m)


@triton.jit
def conv1d_final_kernel(x, h0, cu_seqlens, final, T, D, stride_b, stride_t, stride_d, W: tl.constexpr,
                        BW: tl.constexpr, BD: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr):
    """final[n, :, k] = input(eos - W + k) of sequence n, k < W."""
    i_d, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    k = tl.arange(0, BW).to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.maximum(tl.minimum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), T), bos)
        x_row = x
    else:
        bos = 0
        eos = T
        x_row = x + i_n * stride_b
    m_k = k < W
    v = load_src(x_row, h0, eos - W + k, bos + tl.zeros_like(k), i_n + tl.zeros_like(k), o_d, m_k, D, stride_t,
                 stride_d, W, HAS_H0)
    tl.store(final + i_n * D * W + o_d[None, :] * W + k[:, None], v.to(final.dtype.element_ty),
             mask=m_k[:, None] & (o_d < D)[None, :])


@triton.jit
def conv1d_bwd_kernel(x, weight, bias, h0, cu_seqlens, dy, dht, dx, scratch, dw_part, db_part, T, N, D, NTB, stride_b,
                      stride_t, stride_d, W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                      LOG_N: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
                      HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Backward over token blocks i_t = program_id(1) + k * num_programs(1): per block, da = dy silu'(a) (a the
    pre-activation, recomputed) for its BT tokens and for the next W - 1 tokens (the halo, recomputed again by the
    next block's program), written to this program's own [BT + BW, BD] fp32 scratch (L2-resident) and read back at
    the W shifts of dx(t) = sum_i weight[:, W - 1 - i] da(t + i) over the tokens t + i of t's sequence, plus the
    final state's gradient for a sequence's last W tokens; and this program's dweight / dbias partial sums
    dweight[:, j] += sum_t da(t) input(t - (W - 1) + j), from the inputs the pre-activation loaded. Without SiLU da
    is dy, read at the shifts directly."""
    i_d, i_p, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G = tl.num_programs(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, BW)
    r = tl.arange(0, BT)
    c = tl.arange(0, BD)
    x_row = x + i_b.to(tl.int64) * stride_b
    row = i_b.to(tl.int64) * T
    sc = scratch + ((i_b * G + i_p).to(tl.int64) * tl.num_programs(0) + i_d) * (BT + BW) * BD
    dw_acc = tl.zeros((BD, BW), dtype=tl.float32)
    db_acc = tl.zeros((BD,), dtype=tl.float32)
    for i_t in range(i_p, NTB, G):
        t, m_tok, n, bos, eos = _tokens(cu_seqlens, i_b, i_t * BT, T, N, BT, LOG_N, IS_VARLEN)
        off = (row + t)[:, None] * D + o_d[None, :]
        m = m_tok[:, None] & m_d[None, :]
        b_da = tl.load(dy + off, mask=m, other=0.).to(tl.float32)
        if SILU:
            a = preact(x_row, h0, weight, bias, t, bos, n, o_d, m_tok, D, stride_t, stride_d, W, HAS_H0, HAS_BIAS)
            b_da = b_da * silu_grad(a)
            th, m_th, nh, bh, eh = _tokens(cu_seqlens, i_b, (i_t + 1) * BT, T, N, BW, LOG_N, IS_VARLEN)
            ah = preact(x_row, h0, weight, bias, th, bh, nh, o_d, m_th, D, stride_t, stride_d, W, HAS_H0, HAS_BIAS)
            dah = tl.load(dy + (row + th)[:, None] * D + o_d[None, :], mask=m_th[:, None] & m_d[None, :],
                          other=0.).to(tl.float32) * silu_grad(ah)
            tl.debug_barrier()                  # the previous block's reads of the scratch are done
            tl.store(sc + r[:, None] * BD + c[None, :], b_da)
            tl.store(sc + (BT + o_w)[:, None] * BD + c[None, :], dah)
            tl.debug_barrier()                  # visible to every thread of the program
        for j in tl.static_range(W):
            src = load_src(x_row, h0, t - (W - 1) + j, bos, n, o_d, m_tok, D, stride_t, stride_d, W, HAS_H0)
            dw_acc += tl.where(o_w[None, :] == j, tl.sum(b_da * src, 0)[:, None], 0.)
        db_acc += tl.sum(b_da, 0)
        b_dx = tl.zeros((BT, BD), dtype=tl.float32)
        for i in tl.static_range(W):
            m_i = m_tok & (t + i < eos)
            w = tl.load(weight + o_d * W + (W - 1 - i), mask=m_d, other=0.).to(tl.float32)
            if SILU:
                sh = tl.load(sc + (r + i)[:, None] * BD + c[None, :], mask=m_i[:, None], other=0.)
            else:
                sh = tl.load(dy + (row + t + i)[:, None] * D + o_d[None, :], mask=m_i[:, None] & m_d[None, :],
                             other=0.).to(tl.float32)
            b_dx += w[None, :] * sh
        if HAS_DHT:
            k = t - eos + W
            m_k = m_tok & (k >= 0) & (t >= bos)
            b_dx += tl.load(dht + (n * D * W + k)[:, None] + o_d[None, :] * W, mask=m_k[:, None] & m_d[None, :],
                            other=0.).to(tl.float32)
        tl.store(dx + off, b_dx.to(dx.dtype.element_ty), mask=m)
    p = (i_b * G + i_p).to(tl.int64)
    tl.store(dw_part + p * D * W + o_d[:, None] * W + o_w[None, :], dw_acc, mask=m_d[:, None] & (o_w < W)[None, :])
    if HAS_BIAS:
        tl.store(db_part + p * D + o_d, db_acc, mask=m_d)


@triton.jit
def conv1d_dh0_kernel(x, weight, bias, h0, cu_seqlens, dy, dht, dh0, T, D, stride_b, stride_t, stride_d,
                      W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dh0[n, :, k] = sum_{q < k} weight[:, k - 1 - q] * da[bos + q] (+ dht[n, :, k - L] where k >= L, L the
    sequence's length: a short sequence's final state keeps those initial columns)."""
    i_d, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    q = tl.arange(0, BW).to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.maximum(tl.minimum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), T), bos)
        x_row = x
        row = 0
    else:
        bos = 0
        eos = T
        x_row = x + i_n * stride_b
        row = i_n * T
    L = eos - bos
    m_q = (q < L) & (q < W - 1)
    t = bos + q
    da = tl.load(dy + (row + t)[:, None] * D + o_d[None, :], mask=m_q[:, None] & m_d[None, :], other=0.).to(tl.float32)
    if SILU:
        a = preact(x_row, h0, weight, bias, t, bos + tl.zeros_like(q), i_n + tl.zeros_like(q), o_d, m_q, D,
                   stride_t, stride_d, W, True, HAS_BIAS)
        da = da * silu_grad(a)
    for k in tl.static_range(W):
        m_w = m_q & (q < k)
        w = tl.load(weight + o_d[None, :] * W + (k - 1 - q)[:, None], mask=m_w[:, None] & m_d[None, :],
                    other=0.).to(tl.float32)
        acc = tl.sum(w * da, 0)
        if HAS_DHT:
            kk = k - L
            acc += tl.load(dht + i_n * D * W + o_d * W + kk, mask=m_d & (kk >= 0) & (kk < W), other=0.).to(tl.float32)
        tl.store(dh0 + i_n * D * W + o_d * W + k, acc.to(dh0.dtype.element_ty), mask=m_d)


def _common(x, weight, cu_seqlens):
    B, T, D = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return B, T, D, W, N


def conv1d_fwd(x, weight, bias, residual, initial_state, output_final_state, silu, cu_seqlens):
    B, T, D, W, N = _common(x, weight, cu_seqlens)
    weight = weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    BD = _block_d(D)
    y = empty(B, T, D, dtype=x.dtype, device=x.device)
    if T > 0:
        launches(conv1d_fwd_kernel, (cdiv(D, BD), cdiv(T, BT), B),
                 (x, weight, bias, residual, h0, cu_seqlens, y, T, N, D, *x.stride()),
                 dict(W=W, BT=BT, BD=BD, LOG_N=_log_n(N), SILU=silu, HAS_BIAS=bias is not None,
                      HAS_RES=residual is not None, HAS_H0=h0 is not None, IS_VARLEN=cu_seqlens is not None))
    final = None
    if output_final_state:
        final = empty(N, D, W, dtype=x.dtype, device=x.device)
        launches(conv1d_final_kernel, (cdiv(D, BD), N, 1),
                 (x, h0, cu_seqlens, final, T, D, *x.stride()),
                 dict(W=W, BW=next_power_of_2(W), BD=BD, HAS_H0=h0 is not None, IS_VARLEN=cu_seqlens is not None))
    return y, final


def conv1d_bwd(x, weight, bias, initial_state, silu, cu_seqlens, dy, dfinal):
    B, T, D, W, N = _common(x, weight, cu_seqlens)
    w = weight.contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    dy = dy.contiguous()
    dht = dfinal.contiguous() if dfinal is not None else None
    BD = _block_d(D, bwd=True)
    BW = next_power_of_2(W)
    nd, ntb = cdiv(D, BD), cdiv(T, BT_BWD)
    # the first pass's programs along the token blocks: about 8 per SM, each summing its blocks' dweight / dbias terms
    G = max(1, min(ntb, cdiv(8 * device_facts(x.device).num_sms, nd * B)))
    dx = empty(B, T, D, dtype=x.dtype, device=x.device)
    dw_part = empty(B * G, D, W, dtype=torch.float32, device=x.device)
    db_part = empty(B * G, D, dtype=torch.float32, device=x.device) if bias is not None else None
    if T > 0:
        # the program's own [BT + BW, BD] fp32 scratch for da (with SiLU): written and read back per block, in L2
        scratch = empty(nd * G * B * (BT_BWD + BW) * BD, dtype=torch.float32, device=x.device) if silu else dy
        launches(conv1d_bwd_kernel, (nd, G, B),
                 (x, w, bias, h0, cu_seqlens, dy, dht, dx, scratch, dw_part, db_part, T, N, D, ntb, *x.stride()),
                 dict(W=W, BW=BW, BT=BT_BWD, BD=BD, LOG_N=_log_n(N), SILU=silu, HAS_BIAS=bias is not None,
                      HAS_H0=h0 is not None, HAS_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None))
        dw = col_sum(dw_part, (D, W), weight.dtype, launches)
        db = col_sum(db_part, (D,), bias.dtype, launches) if bias is not None else None
    else:
        dw = torch.zeros(D, W, dtype=weight.dtype, device=x.device)
        db = torch.zeros(D, dtype=bias.dtype, device=x.device) if bias is not None else None
    dh0 = None
    if h0 is not None:
        dh0 = empty(N, D, W, dtype=initial_state.dtype, device=x.device)
        launches(conv1d_dh0_kernel, (nd, N, 1), (x, w, bias, h0, cu_seqlens, dy, dht, dh0, T, D, *x.stride()),
                 dict(W=W, BW=BW, BD=BD, SILU=silu, HAS_BIAS=bias is not None, HAS_DHT=dht is not None,
                      IS_VARLEN=cu_seqlens is not None))
    return dx, dw, db, dh0
