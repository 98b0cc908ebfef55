"""Device helpers shared by the causal convolution kernels: the sequence of a token, the window of inputs before a
token (from x or from its sequence's initial state) and the activation's derivative."""
import triton
import triton.language as tl


@triton.jit
def seq_of(cu_seqlens, t, N, LOG_N: tl.constexpr):
    """The sequence holding each token t: the largest n < N with cu_seqlens[n] <= t (binary lifting over
    2^(LOG_N - 1) .. 1; LOG_N = (N - 1).bit_length()), so zero-length sequences are skipped."""
    n = tl.zeros_like(t)
    for i in tl.static_range(LOG_N):
        cand = n + (1 << (LOG_N - 1 - i))
        ok = cand < N
        start = tl.load(cu_seqlens + cand, mask=ok, other=0).to(tl.int64)
        n = tl.where(ok & (start <= t), cand, n)
    return n


@triton.jit
def window(x_row, h0, t, bos, n, o_d, D, stride_t, stride_d, W: tl.constexpr, HAS_H0: tl.constexpr):
    """The window of inputs as it stands before token t, W [BD] fp32 rows: slot j = input(t - W + j) of the sequence
    that starts at bos (x where t - W + j >= bos, else its initial state's column W + t - W + j - bos, or 0)."""
    m_d = o_d < D
    win = ()
    for j in tl.static_range(W):
        s = t - W + j
        v = tl.load(x_row + s * stride_t + o_d * stride_d, mask=m_d & (s >= bos) & (s >= 0), other=0.).to(tl.float32)
        if HAS_H0:
            k = W + s - bos
            v += tl.load(h0 + n * D * W + o_d * W + k, mask=m_d & (s < bos) & (k >= 0), other=0.).to(tl.float32)
        win += (v,)
    return win


@triton.jit
def silu_grad(a):
    """d silu(a) / da = s (1 + a (1 - s)), s = sigmoid(a)."""
    s = tl.sigmoid(a)
    return s * (1 + a * (1 - s))
