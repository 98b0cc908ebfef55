"""Column sums of per-program partials in one launch, in the result's dtype: the parameter gradients that backwards
accumulate per chunk slot or program (the in-kernel gate's dA_log / d dt_bias of GDN and KDA, rms_norm_gated's dweight
/ dbias). A Triton kernel rather than torch's sum and cast, so that an eager backward's launch list
(runtime/launch_list.py) can replay it and the launch goes through the caller's host path; in a fixed order
(deterministic)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linattn.runtime.alloc import empty
from linattn.runtime.host_path import cdiv

# rows (partials) per step and columns per program: KDA's d dt_bias has HV * K columns (128 programs at HV = 32,
# K = 128), GDN's HV (one program), each stepping 64 partials at a time
COL_SUM_ROWS = 64
COL_SUM_COLS = 32


@triton.jit
def col_sum_kernel(x_ptr, y_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """y[c] = sum over r < R of x[r, c] (x [R, C] fp32; y [C] in its own dtype), in fp32, rounded once."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    mc = cols < C
    acc = tl.zeros([BR, BC], dtype=tl.float32)
    for r0 in range(0, R, BR):
        rows = r0 + tl.arange(0, BR)
        acc += tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=(rows < R)[:, None] & mc[None, :],
                       other=0.)
    tl.store(y_ptr + cols, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=mc)


def col_sum(x: torch.Tensor, shape, dtype: torch.dtype, launch) -> torch.Tensor:
    """A new tensor of `shape` and `dtype` from x [R, ...] fp32 contiguous (R partials of prod(shape) values each):
    their sum over R. launch: the caller's host-path launcher (a runtime.host_path.LaunchCache)."""
    R = x.shape[0]
    y = empty(*shape, dtype=dtype, device=x.device)
    C = y.numel()
    if C:
        launch(col_sum_kernel, (cdiv(C, COL_SUM_COLS),), (x, y, R, C), dict(BR=COL_SUM_ROWS, BC=COL_SUM_COLS,
                                                                            num_warps=4))
    return y
