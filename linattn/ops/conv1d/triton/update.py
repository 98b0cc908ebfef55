"""Triton kernel and launcher of `causal_conv1d_update`: T new tokens per row against a pool of states.

One program per (D block, row). A row's window is its slot's W state columns followed by its T tokens; token t
reads window positions t + 1 .. t + W and the new state is the window's last W positions. Every read of the slot
happens before the barrier that precedes the in-place write. A padded row (negative slot, or one >= slots) writes
zeros to y and leaves the pool alone.

conv1d_update3_kernel runs a layer's three updates (q, k, v: same rows and slots) in one launch, one kernel
latency instead of three in a decode step. Decode calls it once per layer and token with the same shapes: launches
go through runtime/host_path.LaunchCache
(the compiled kernel's handle once a call signature has been seen, skipping the JIT's argument binding), and a repeat
plain eager call of the public op through its signature's launch list (LISTS)."""
import triton
import triton.language as tl

from linattn.runtime.alloc import empty
from linattn.runtime.host_path import HostPath, LaunchCache, cdiv, next_power_of_2
from linattn.runtime.op_lists import OpLists

host_path = HostPath()
launches = LaunchCache(host_path)
# Per checked call signature of the public ops (update.py's _CHECKED and _CHECKED3 keys), the launch list of a plain
# eager call: a repeat decode step replays its one launch instead of building it (runtime/op_lists.py)
LISTS = OpLists(host_path)
LISTS3 = OpLists(host_path)


@triton.jit
def _window(state, x_row, pos, o_d, m, D, stride_t, stride_d, W: tl.constexpr):
    """[BD, BW] fp32: window positions pos (per column) of a row: state columns below W, tokens from W on."""
    in_s = m & (pos < W)
    in_x = m & (pos >= W)
    v = tl.load(state + o_d[:, None] * W + pos[None, :], mask=in_s, other=0.).to(tl.float32)
    v += tl.load(x_row + (pos - W)[None, :] * stride_t + o_d[:, None] * stride_d, mask=in_x, other=0.).to(tl.float32)
    return v


@triton.jit
def _update_rows(x, conv_state, weight, bias, state_indices, y, i_d, i_n, T, D, num_slots, stride_n, stride_t,
                 stride_d, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_INDICES: tl.constexpr):
    """The T tokens of row i_n in channels [i_d * BD, (i_d + 1) * BD), and the row's state written back."""
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, BW)
    m_w = o_w < W
    m = m_d[:, None] & m_w[None, :]
    if HAS_INDICES:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    else:
        slot = i_n
    live = (slot >= 0) & (slot < num_slots)
    slot = tl.where(live, slot, 0)
    state = conv_state + slot * D * W
    x_row = x + i_n * stride_n
    y_row = y + i_n * T * D
    w = tl.load(weight + o_d[:, None] * W + o_w[None, :], mask=m, other=0.).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.).to(tl.float32)
    for t in range(T):
        a = tl.sum(w * _window(state, x_row, t + 1 + o_w, o_d, m & live, D, stride_t, stride_d, W), 1)
        if HAS_BIAS:
            a += b
        if SILU:
            a = a * tl.sigmoid(a)
        a = tl.where(live, a, 0.)
        tl.store(y_row + t * D + o_d, a.to(y.dtype.element_ty), mask=m_d)
    new = _window(state, x_row, T + o_w, o_d, m & live, D, stride_t, stride_d, W)
    tl.debug_barrier()
    tl.store(state + o_d[:, None] * W + o_w[None, :], new.to(conv_state.dtype.element_ty), mask=m & live)


@triton.jit
def conv1d_update_kernel(x, conv_state, weight, bias, state_indices, y, T, D, num_slots, stride_n, stride_t,
                         stride_d, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_INDICES: tl.constexpr):
    _update_rows(x, conv_state, weight, bias, state_indices, y, tl.program_id(0), tl.program_id(1).to(tl.int64), T,
                 D, num_slots, stride_n, stride_t, stride_d, W, BW, BD, SILU, HAS_BIAS, HAS_INDICES)


@triton.jit
def conv1d_update3_kernel(x0, s0, w0, b0, y0, D0, sn0, st0, sd0, x1, s1, w1, b1, y1, D1, sn1, st1, sd1,
                          x2, s2, w2, b2, y2, D2, sn2, st2, sd2, state_indices, T, num_slots, W: tl.constexpr,
                          BW: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_INDICES: tl.constexpr):
    """Three updates in one launch (a layer's q, k and v convolutions, same rows and slots): program_id(2) picks
    the tensors; programs past a narrower tensor's channels return."""
    i_d, i_n, i_g = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    if i_g == 0:
        x, s, w, b, y, D, sn, st, sd = x0, s0, w0, b0, y0, D0, sn0, st0, sd0
    elif i_g == 1:
        x, s, w, b, y, D, sn, st, sd = x1, s1, w1, b1, y1, D1, sn1, st1, sd1
    else:
        x, s, w, b, y, D, sn, st, sd = x2, s2, w2, b2, y2, D2, sn2, st2, sd2
    if i_d * BD < D:
        _update_rows(x, s, w, b, state_indices, y, i_d, i_n, T, D, num_slots, sn, st, sd, W, BW, BD, SILU, HAS_BIAS,
                     HAS_INDICES)


def conv1d_update(x, conv_state, weight, bias, silu, state_indices):
    x3 = x[:, None] if x.dim() == 2 else x
    N, T, D = x3.shape
    W = weight.shape[1]
    y = empty(N, T, D, dtype=x.dtype, device=x.device)
    BD = min(128, next_power_of_2(D))
    if N > 0 and T > 0 and D > 0:
        launches(conv1d_update_kernel, (cdiv(D, BD), N, 1),
                 (x3, conv_state, weight.contiguous(), bias, state_indices, y, T, D, conv_state.shape[0],
                  *x3.stride()),
                 dict(W=W, BW=next_power_of_2(W), BD=BD, SILU=silu, HAS_BIAS=bias is not None,
                      HAS_INDICES=state_indices is not None))
    return y.view(x.shape)


def conv1d_update3(xs, conv_states, weights, biases, silu, state_indices):
    """The three updates of conv1d_update in one launch: xs, conv_states, weights, biases are triples with the same
    rows, tokens, dtypes and W (biases all None or all tensors); returns the three outputs."""
    x3s = [x[:, None] if x.dim() == 2 else x for x in xs]
    N, T = x3s[0].shape[:2]
    W = weights[0].shape[1]
    ys = [empty(*x3.shape, dtype=x3.dtype, device=x3.device) for x3 in x3s]
    Dmax = max(x3.shape[2] for x3 in x3s)
    BD = min(128, next_power_of_2(Dmax))
    if N > 0 and T > 0 and Dmax > 0:
        args = []
        for x3, cs, w, b, y in zip(x3s, conv_states, weights, biases, ys):
            args += [x3, cs, w.contiguous(), b, y, x3.shape[2], *x3.stride()]
        launches(conv1d_update3_kernel, (cdiv(Dmax, BD), N, 3), (*args, state_indices, T, conv_states[0].shape[0]),
                 dict(W=W, BW=next_power_of_2(W), BD=BD, SILU=silu, HAS_BIAS=biases[0] is not None,
                      HAS_INDICES=state_indices is not None))
    return [y.view(x.shape) for x, y in zip(xs, ys)]
