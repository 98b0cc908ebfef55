"""Device helpers shared by the causal convolution kernels: the sequence of a token, a token's input (from x or
from its sequence's initial state), the pre-activation and the activation's derivative."""
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
def load_src(x_row, h0, s, bos, n, o_d, m_tok, D, stride_t, stride_d, W: tl.constexpr, HAS_H0: tl.constexpr):
    """[BT, BD] fp32: the input at position s (per token) of the sequence that starts at bos: x[s] where
    s >= bos, else column W + s - bos of the sequence's initial state h0[n] (zeros without one, or further back)."""
    m_d = o_d < D
    in_x = m_tok & (s >= bos) & (s >= 0)
    v = tl.load(x_row + s[:, None] * stride_t + o_d[None, :] * stride_d, mask=in_x[:, None] & m_d[None, :],
                other=0.).to(tl.float32)
    if HAS_H0:
        k = W + s - bos
        in_h = m_tok & (s < bos) & (k >= 0)
        v += tl.load(h0 + (n * D * W + k)[:, None] + o_d[None, :] * W, mask=in_h[:, None] & m_d[None, :],
                     other=0.).to(tl.float32)
    return v


@triton.jit
def preact(x_row, h0, weight, bias, t, bos, n, o_d, m_tok, D, stride_t, stride_d, W: tl.constexpr,
           HAS_H0: tl.constexpr, HAS_BIAS: tl.constexpr):
    """[BT, BD] fp32: sum_j weight[:, j] * input(t - (W - 1) + j) + bias."""
    m_d = o_d < D
    a = tl.zeros((t.shape[0], o_d.shape[0]), dtype=tl.float32)
    for j in tl.static_range(W):
        w = tl.load(weight + o_d * W + j, mask=m_d, other=0.).to(tl.float32)
        a += w[None, :] * load_src(x_row, h0, t - (W - 1) + j, bos, n, o_d, m_tok, D, stride_t, stride_d, W, HAS_H0)
    if HAS_BIAS:
        a += tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    return a


@triton.jit
def silu_grad(a):
    """d silu(a) / da = s (1 + a (1 - s)), s = sigmoid(a)."""
    s = tl.sigmoid(a)
    return s * (1 + a * (1 - s))
