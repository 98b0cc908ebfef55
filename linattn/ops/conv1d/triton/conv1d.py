"""Triton kernels and launchers of `causal_conv1d`, forward and backward.

Both passes stream over tokens: a program holds BD channels of a segment of tokens and walks it U tokens a step, a
window of the last W inputs (and, backward, of the last W da) in registers, so each input row is loaded once (plus
the W - 1 rows either side of a segment). Grid (D blocks, segments, batch rows). Under cu_seqlens a segment finds
its first token's sequence by a binary search of the offsets on the device (common.seq_of) and the walk moves to the
next sequence where one ends, so no chunk table is built and nothing is read back on the host. The backward
recomputes the pre-activation (x, weight and the initial state are all it keeps); da = dy silu'(a), dx(t) = sum_i
weight[:, W - 1 - i] da(t + i) over the tokens t + i of t's sequence plus the final state's gradient for a sequence's
last W tokens; dweight and dbias are summed per program over a strided set of segments into fp32 partials
(deterministic, reduced by col_sum_kernel, linattn/ops/col_sum.py, in the parameters' dtypes). d initial_state comes
from one small program per (D block, sequence), as does the final state."""
import torch
import triton
import triton.language as tl

from linattn.ops.col_sum import col_sum
from linattn.ops.conv1d.triton.common import seq_of, silu_grad, window
from linattn.runtime.alloc import empty
from linattn.runtime.device import device_facts
from linattn.runtime.host_path import HostPath, LaunchCache, cdiv, next_power_of_2
from linattn.runtime.op_lists import OpLists

# Both passes stream over tokens in one-warp programs that hold 8 consecutive channels a thread (BD_STREAM = 256),
# so that a token's row is one 16-byte load a thread; U tokens are loaded a step. The forward's
# programs take one segment of L_FWD tokens each, the backward's a strided set of L_BWD-token segments (their
# dweight / dbias partials summed over the set).
BD_STREAM = 256
U = 8
L_FWD = 128
L_BWD = 128
# The forward and backward run once per layer and step with the same shapes: their launches go through the compiled
# kernels' handles once a launch signature has been seen (runtime/host_path.LaunchCache), skipping the JIT's binding;
# a repeat plain eager forward without autograd replays its signature's launch list (LISTS, keyed by api.py's
# _CHECKED key; runtime/op_lists.py).
host_path = HostPath()
launches = LaunchCache(host_path)
LISTS = OpLists(host_path)


def _block_d(D: int) -> int:
    """Channels per program: 256 (8 a thread of one warp), fewer for a narrower D."""
    return min(BD_STREAM, max(32, next_power_of_2(D)))


def _log_n(N: int) -> int:
    return max(N - 1, 0).bit_length()


def _fwd_segment(T: int) -> int:
    """Tokens per forward program: L_FWD, doubled until the segments fit the grid's second dimension (65535)."""
    L = L_FWD
    while cdiv(T, L) > 65535:
        L *= 2
    return L


@triton.jit
def _push(win, v, W: tl.constexpr):
    """The window (a tuple of W [BD] rows) moved one token on: slot j takes slot j + 1, slot W - 1 takes v."""
    out = ()
    for j in tl.static_range(1, W):
        out += (win[j],)
    out += (v,)
    return out


@triton.jit
def _weights(weight, o_d, m_d, W: tl.constexpr):
    """weight[:, j] for j < W as a tuple of [BD] fp32 rows."""
    wt = ()
    for j in tl.static_range(W):
        wt += (tl.load(weight + o_d * W + j, mask=m_d, other=0.).to(tl.float32),)
    return wt


@triton.jit
def _preact(wt, xwin, b, W: tl.constexpr):
    a = b
    for j in tl.static_range(W):
        a += wt[j] * xwin[j]
    return a


@triton.jit
def _rows(ptr, t0, hi, stride, o_d, m_d, U: tl.constexpr):
    """The rows t0 .. t0 + U - 1 below hi of a [T, BD] view, one load each, all issued before any is used."""
    out = ()
    for i in tl.static_range(U):
        out += (tl.load(ptr + (t0 + i) * stride + o_d, mask=m_d & (t0 + i < hi), other=0.),)
    return out


@triton.jit
def _seq_at(cu_seqlens, s0, i_b, T, N, LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The sequence holding token s0 (int64 scalar), its start and its end."""
    if IS_VARLEN:
        n = tl.sum(seq_of(cu_seqlens, tl.full((1,), 0, tl.int64) + s0, N, LOG_N))
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.minimum(tl.load(cu_seqlens + n + 1).to(tl.int64), T)
    else:
        n = s0 * 0 + i_b
        bos = s0 * 0
        eos = s0 * 0 + T
    return n, bos, eos


@triton.jit
def _next_seq(cu_seqlens, n, t, T, N):
    """At t, the end of sequence n: the next sequence that holds t (empty ones skipped) and its end."""
    n += 1
    while (n + 1 < N) & (tl.load(cu_seqlens + n + 1).to(tl.int64) <= t):
        n += 1
    return n, tl.minimum(tl.load(cu_seqlens + n + 1).to(tl.int64), T)


@triton.jit
def conv1d_fwd_kernel(x, weight, bias, residual, h0, cu_seqlens, y, T, N, D, stride_b, stride_t, stride_d,
                      W: tl.constexpr, L: tl.constexpr, U: tl.constexpr, BD: tl.constexpr, LOG_N: tl.constexpr,
                      SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_H0: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    """The forward as a stream over the L tokens of segment program_id(1), U tokens a step: each input row loaded
    once into the window of the last W inputs (xwin[j] = input(t - (W - 1) + j)), refilled from the initial state
    where a sequence starts; y(t) = act(sum_j weight[:, j] xwin[j] + bias) (+ residual)."""
    i_d, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x_row = x + i_b.to(tl.int64) * stride_b
    row = i_b.to(tl.int64) * T
    wt = _weights(weight, o_d, m_d, W)
    b = tl.zeros((BD,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)
    s0 = row * 0 + i_s * L
    s1 = tl.minimum(s0 + L, T)
    n, bos, eos = _seq_at(cu_seqlens, s0, i_b, T, N, LOG_N, IS_VARLEN)
    xwin = window(x_row, h0, s0, bos, n, o_d, D, stride_t, stride_d, W, HAS_H0)
    for t0 in range(s0, s1, U):
        x_t = _rows(x_row, t0, s1, stride_t, o_d * stride_d, m_d, U)
        if HAS_RES:
            res_t = _rows(residual + row * D, t0, s1, D, o_d, m_d, U)
        for i in tl.static_range(U):
            t = t0 + i
            if IS_VARLEN:
                if (t == eos) & (t < T):
                    n, eos = _next_seq(cu_seqlens, n, t, T, N)
                    xwin = window(x_row, h0, t, t, n, o_d, D, stride_t, stride_d, W, HAS_H0)
            xwin = _push(xwin, x_t[i].to(tl.float32), W)
            a = _preact(wt, xwin, b, W)
            if SILU:
                a = a * tl.sigmoid(a)
            if HAS_RES:
                a += res_t[i].to(tl.float32)
            tl.store(y + (row + t) * D + o_d, a.to(y.dtype.element_ty), mask=m_d & (t < s1))


@triton.jit
def conv1d_final_kernel(x, h0, cu_seqlens, final, T, D, stride_b, stride_t, stride_d, W: tl.constexpr,
                        BD: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr):
    """final[n, :, k] = input(eos - W + k) of sequence n, k < W: the window of inputs before its end."""
    i_d, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.maximum(tl.minimum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), T), bos)
        x_row = x
    else:
        bos = i_n * 0
        eos = bos + T
        x_row = x + i_n * stride_b
    win = window(x_row, h0, eos, bos, i_n, o_d, D, stride_t, stride_d, W, HAS_H0)
    for k in tl.static_range(W):
        tl.store(final + i_n * D * W + o_d * W + k, win[k].to(final.dtype.element_ty), mask=o_d < D)


@triton.jit
def _emit(dx, dht, wt, dwin, u, lo, hi, row, n, eos, o_d, m_d, D, W: tl.constexpr, HAS_DHT: tl.constexpr):
    """dx(u) = sum_i weight[:, W - 1 - i] da(u + i) (wt[j] = weight[:, j], dwin[i] = da(u + i)), stored where
    lo <= u < hi; plus the final state's gradient where u is one of its sequence's last W tokens."""
    acc = wt[W - 1] * dwin[0]
    for i in tl.static_range(1, W):
        acc += wt[W - 1 - i] * dwin[i]
    ok = (u >= lo) & (u < hi)
    if HAS_DHT:
        k = u - eos + W
        acc += tl.load(dht + n * D * W + o_d * W + k, mask=m_d & ok & (k >= 0), other=0.).to(tl.float32)
    tl.store(dx + (row + u) * D + o_d, acc.to(dx.dtype.element_ty), mask=m_d & ok)


@triton.jit
def conv1d_bwd_kernel(x, weight, bias, h0, cu_seqlens, dy, dht, dx, dw_part, db_part, T, N, D, NSEG, stride_b,
                      stride_t, stride_d, W: tl.constexpr, L: tl.constexpr, U: tl.constexpr, BD: tl.constexpr,
                      LOG_N: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
                      HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The backward as a stream over tokens: segments i_s = program_id(1) + k * num_programs(1) of L tokens, each
    walked forward U tokens a step (one load of each x and dy row, but the W - 1 rows either side of a segment).
    Per token t: the pre-activation a(t) from the window of its W inputs (xwin[j] = input(t - (W - 1) + j)),
    da(t) = dy(t) silu'(a(t)), the dweight / dbias partial sums, and dx(t - (W - 1)) from the window of the last W
    da (dwin). A sequence's end flushes the window (da of later tokens are another sequence's: zero) and its start
    refills xwin from its initial state. The W - 1 tokens after a segment are walked for their da only (dx of the
    segment's last tokens)."""
    i_d, i_p, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G = tl.num_programs(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    x_row = x + i_b.to(tl.int64) * stride_b
    row = i_b.to(tl.int64) * T
    wt = _weights(weight, o_d, m_d, W)
    b = tl.zeros((BD,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)
    dw_acc = ()
    for j in tl.static_range(W):
        dw_acc += (tl.zeros((BD,), dtype=tl.float32),)
    db_acc = tl.zeros((BD,), dtype=tl.float32)
    for i_s in range(i_p, NSEG, G):
        s0 = row * 0 + i_s * L
        s1 = tl.minimum(s0 + L, T)
        n, bos, eos = _seq_at(cu_seqlens, s0, i_b, T, N, LOG_N, IS_VARLEN)
        xwin = window(x_row, h0, s0, bos, n, o_d, D, stride_t, stride_d, W, HAS_H0)
        dwin = ()
        for j in tl.static_range(W):
            dwin += (tl.zeros((BD,), dtype=tl.float32),)
        for t0 in range(s0, s1 + W - 1, U):
            x_t = _rows(x_row, t0, T, stride_t, o_d * stride_d, m_d, U)
            dy_t = _rows(dy + row * D, t0, T, D, o_d, m_d, U)
            for i in tl.static_range(U):
                t = t0 + i
                if IS_VARLEN:
                    if (t == eos) & (t < T):
                        # flush the sequence's last W - 1 tokens, then start the next non-empty sequence
                        for k in tl.static_range(W - 1):
                            dwin = _push(dwin, tl.zeros((BD,), dtype=tl.float32), W)
                            _emit(dx, dht, wt, dwin, t - (W - 1) + k, tl.maximum(s0, bos), s1, row, n, eos, o_d,
                                  m_d, D, W, HAS_DHT)
                        n, eos = _next_seq(cu_seqlens, n, t, T, N)
                        bos = t
                        xwin = window(x_row, h0, t, bos, n, o_d, D, stride_t, stride_d, W, HAS_H0)
                        dwin = _push(dwin, tl.zeros((BD,), dtype=tl.float32), W)   # its last da out too
                xwin = _push(xwin, x_t[i].to(tl.float32), W)
                da = dy_t[i].to(tl.float32)
                if SILU:
                    da = da * silu_grad(_preact(wt, xwin, b, W))
                da_own = tl.where((t >= s0) & (t < s1), da, 0.)
                acc = ()
                for j in tl.static_range(W):
                    acc += (dw_acc[j] + da_own * xwin[j],)
                dw_acc = acc
                db_acc += da_own
                dwin = _push(dwin, da, W)
                _emit(dx, dht, wt, dwin, t - (W - 1), tl.maximum(s0, bos), s1, row, n, eos, o_d, m_d, D, W,
                      HAS_DHT)
    p = (i_b * G + i_p).to(tl.int64)
    for j in tl.static_range(W):
        tl.store(dw_part + p * D * W + o_d * W + j, dw_acc[j], mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + p * D + o_d, db_acc, mask=m_d)


@triton.jit
def conv1d_dh0_kernel(x, weight, bias, h0, cu_seqlens, dy, dht, dh0, T, D, stride_b, stride_t, stride_d,
                      W: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dh0[n, :, k] = sum_{q < k} weight[:, k - 1 - q] * da[bos + q] (+ dht[n, :, k - L] where k >= L, L the
    sequence's length: a short sequence's final state keeps those initial columns)."""
    i_d, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.maximum(tl.minimum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), T), bos)
        x_row = x
        row = i_n * 0
    else:
        bos = i_n * 0
        eos = bos + T
        x_row = x + i_n * stride_b
        row = i_n * T
    L = eos - bos
    wt = _weights(weight, o_d, m_d, W)
    b = tl.zeros((BD,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)
    da = ()                                       # da of the sequence's first W - 1 tokens (0 past its end)
    for q in tl.static_range(W - 1):
        d = tl.zeros((BD,), dtype=tl.float32)
        if q < L:
            t = bos + q
            d = tl.load(dy + (row + t) * D + o_d, mask=m_d, other=0.).to(tl.float32)
            if SILU:
                d = d * silu_grad(_preact(wt, window(x_row, h0, t + 1, bos, i_n, o_d, D, stride_t, stride_d, W,
                                                     True), b, W))
        da += (d,)
    for k in tl.static_range(W):
        acc = tl.zeros((BD,), dtype=tl.float32)
        for q in tl.static_range(k):
            acc += wt[k - 1 - q] * da[q]
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
        L = _fwd_segment(T)
        launches(conv1d_fwd_kernel, (cdiv(D, BD), cdiv(T, L), B),
                 (x, weight, bias, residual, h0, cu_seqlens, y, T, N, D, *x.stride()),
                 dict(W=W, L=L, U=U, BD=BD, LOG_N=_log_n(N), SILU=silu,
                      HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_H0=h0 is not None,
                      IS_VARLEN=cu_seqlens is not None, num_warps=1))
    final = None
    if output_final_state:
        final = empty(N, D, W, dtype=x.dtype, device=x.device)
        launches(conv1d_final_kernel, (cdiv(D, BD), N, 1),
                 (x, h0, cu_seqlens, final, T, D, *x.stride()),
                 dict(W=W, BD=BD, HAS_H0=h0 is not None, IS_VARLEN=cu_seqlens is not None))
    return y, final


def conv1d_bwd(x, weight, bias, initial_state, silu, cu_seqlens, dy, dfinal):
    B, T, D, W, N = _common(x, weight, cu_seqlens)
    w = weight.contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    dy = dy.contiguous()
    dht = dfinal.contiguous() if dfinal is not None else None
    BD = _block_d(D)
    nd, nseg = cdiv(D, BD), cdiv(T, L_BWD)
    # programs along the segments: about 32 one-warp programs per SM, each summing its segments' dweight / dbias
    G = max(1, min(nseg, cdiv(32 * device_facts(x.device).num_sms, nd * B)))
    dx = empty(B, T, D, dtype=x.dtype, device=x.device)
    dw_part = empty(B * G, D, W, dtype=torch.float32, device=x.device)
    db_part = empty(B * G, D, dtype=torch.float32, device=x.device) if bias is not None else None
    if T > 0:
        launches(conv1d_bwd_kernel, (nd, G, B),
                 (x, w, bias, h0, cu_seqlens, dy, dht, dx, dw_part, db_part, T, N, D, nseg, *x.stride()),
                 dict(W=W, L=L_BWD, U=U, BD=BD, LOG_N=_log_n(N), SILU=silu, HAS_BIAS=bias is not None,
                      HAS_H0=h0 is not None, HAS_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
                      num_warps=1))
        dw = col_sum(dw_part, (D, W), weight.dtype, launches)
        db = col_sum(db_part, (D,), bias.dtype, launches) if bias is not None else None
    else:
        dw = torch.zeros(D, W, dtype=weight.dtype, device=x.device)
        db = torch.zeros(D, dtype=bias.dtype, device=x.device) if bias is not None else None
    dh0 = None
    if h0 is not None:
        dh0 = empty(N, D, W, dtype=initial_state.dtype, device=x.device)
        launches(conv1d_dh0_kernel, (nd, N, 1), (x, w, bias, h0, cu_seqlens, dy, dht, dh0, T, D, *x.stride()),
                 dict(W=W, BD=BD, SILU=silu, HAS_BIAS=bias is not None, HAS_DHT=dht is not None,
                      IS_VARLEN=cu_seqlens is not None))
    return dx, dw, db, dh0
