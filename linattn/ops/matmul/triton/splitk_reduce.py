"""Split-K epilogue: C[m, n] = sum over s of W[s * M_pad + m, n], W the fp32 partial products of the split-K
GEMM (one [M_pad, N] slice per K slice; M_pad = M rounded up to the GEMM's BM so a ragged row tile never
writes into the next slice). Summed in fp32 and rounded once to C's dtype, like the unsplit kernel.

Portable Triton (it also runs under TRITON_INTERPRET=1), used by the Gluon split-K configs.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def matmul_splitk_reduce(ws_ptr, c_ptr, M, N, M_pad, stride_cm,
                         SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    slice_elems = M_pad.to(tl.int64) * N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * slice_elems + offs, mask=mask, other=0.0)
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


class ReducePlan:
    """The reduction's launch for one call signature (grid and constants fixed)."""
    BM, BN, NUM_WARPS = 32, 128, 4

    def __init__(self, M: int, N: int, M_pad: int, split_k: int, stride_cm: int):
        self.M, self.N, self.M_pad, self.split_k, self.stride_cm = M, N, M_pad, split_k, stride_cm
        self.grid = (triton.cdiv(M, self.BM), triton.cdiv(N, self.BN), 1)

    def run(self, ws, out, handles: dict) -> None:
        from linattn.ops.matmul.launch import launch
        args = (ws, out, self.M, self.N, self.M_pad, self.stride_cm, self.split_k, self.BM, self.BN)
        launch(matmul_splitk_reduce, handles, "splitk_reduce", self.grid, args, {"num_warps": self.NUM_WARPS})


def reduce_plan(M: int, N: int, M_pad: int, split_k: int, stride_cm: int = None) -> ReducePlan:
    return ReducePlan(M, N, M_pad, split_k, N if stride_cm is None else stride_cm)


def splitk_reduce(ws, out, split_k: int) -> None:
    """Sum the split_k [M_pad, N] fp32 slices stacked in `ws` into `out` [M, N] (row-major, any row stride)."""
    M, N = out.shape
    ReducePlan(M, N, ws.shape[0] // split_k, split_k, out.stride(0)).run(ws, out, {})
