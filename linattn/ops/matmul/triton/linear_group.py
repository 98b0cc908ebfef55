"""Triton kernel of LinearGroup (linattn/ops/matmul/linear_group.py): y_g = x @ W_g^T for a few weights W_g
[N_g, K] that share their input x [M, K], M small (a decode step's rows), in one launch.

Each program takes BN output columns of one group (fewer in a group's last block) and all M rows: it streams its BN
weight rows once (the bytes that bound a decode step's projections) through a pipelined K loop of BM x BK by BK x BN
products. The weights stay separate tensors: a table holds per column block the address of its first weight row, its
group's first column, the group's width and the block's first column inside the group. Group g's output is the
contiguous [M, N_g] block at out + M * start_g."""
import triton
import triton.language as tl


@triton.jit
def linear_group_kernel(x, table, out, M, K, stride_xm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        DOT_PREC: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    # the row address as a pointer, 16-byte aligned (torch allocations are; a block starts BN rows of K further,
    # K a multiple of 8 where the launcher uses the kernel), so that the weight rows load as 16-byte vectors
    w = tl.multiple_of(tl.load(table + 4 * pid_n).to(tl.pointer_type(x.dtype.element_ty)), 16)
    start = tl.load(table + 4 * pid_n + 1)
    n_g = tl.load(table + 4 * pid_n + 2)
    c0 = tl.load(table + 4 * pid_n + 3)
    rm = pid_m * BM + tl.arange(0, BM)
    m_m = rm < M
    rn = tl.arange(0, BN)
    col = c0 + rn                                                        # columns inside the group
    m_n = col < n_g                                                      # a group's last block may be partial
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = k0 + rk < K
        xb = tl.load(x + rm.to(tl.int64)[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_m[:, None] & m_k[None, :],
                     other=0.)
        wb = tl.load(w + rn.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], mask=m_n[:, None] & m_k[None, :],
                     other=0.)
        acc = tl.dot(xb, tl.trans(wb), acc, input_precision=DOT_PREC)
    y = out + start * M + rm.to(tl.int64)[:, None] * n_g + col[None, :]          # start: int64
    tl.store(y, acc.to(out.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])
