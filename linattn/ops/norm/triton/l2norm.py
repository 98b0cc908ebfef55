"""Triton kernels and launchers of `l2norm` (the chunk ops' use_qk_l2norm_in_kernel), forward and backward.

x and y are [R, D] rows; a program takes BR rows, each whole in one register tile, the math in fp32:
    rstd = 1 / sqrt(sum(x^2) + eps);  y = x * rstd
    dx = rstd * (dy - y * sum(dy * y))
The forward also stores rstd [R] (fp32) so that the backward reads x, rstd and dy once and writes dx once: one pass
over the rows each way. Both run before and after every chunk op call with use_qk_l2norm_in_kernel (q and k): their
launches go through the compiled kernel's handle once a launch signature has been seen (runtime/host_path.py's
LaunchCache), not the JIT's binding."""
import torch
import triton
import triton.language as tl

from linattn.runtime.alloc import empty
from linattn.runtime.host_path import HostPath, LaunchCache, cdiv, next_power_of_2

host_path = HostPath()
launches = LaunchCache(host_path)
ROW_ELEMS = 4096             # elements of one program's [BR, BD] tile: BR rows of BD (D rounded up to 2^n) columns


@triton.jit
def _tile(x, i_r, R, D, BR: tl.constexpr, BD: tl.constexpr):
    rows = i_r.to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    off = rows[:, None] * D + cols[None, :]
    return rows, off, m, tl.load(x + off, mask=m, other=0.).to(tl.float32)


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, R, D, eps, BR: tl.constexpr, BD: tl.constexpr):
    rows, off, m, bx = _tile(x, tl.program_id(0), R, D, BR, BD)
    s = 1. / tl.sqrt(tl.sum(bx * bx, 1) + eps)
    tl.store(y + off, (bx * s[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, s, mask=rows < R)


@triton.jit
def l2norm_bwd_kernel(x, rstd, dy, dx, R, D, BR: tl.constexpr, BD: tl.constexpr):
    rows, off, m, bx = _tile(x, tl.program_id(0), R, D, BR, BD)
    s = tl.load(rstd + rows, mask=rows < R, other=0.)
    bdy = tl.load(dy + off, mask=m, other=0.).to(tl.float32)
    yn = bx * s[:, None]
    bdx = s[:, None] * (bdy - yn * tl.sum(bdy * yn, 1)[:, None])
    tl.store(dx + off, bdx.to(dx.dtype.element_ty), mask=m)


def _blocks(D: int):
    BD = next_power_of_2(D)
    return max(1, ROW_ELEMS // BD), BD


def l2norm_fwd(x: torch.Tensor, eps: float):
    """(y like x, rstd [R] fp32) of a contiguous x [..., D]."""
    D = x.shape[-1]
    R = x.numel() // D
    y = empty(*x.shape, dtype=x.dtype, device=x.device)
    rstd = empty(R, dtype=torch.float32, device=x.device)
    if R:
        BR, BD = _blocks(D)
        launches(l2norm_fwd_kernel, (cdiv(R, BR),), (x, y, rstd, R, D, eps), dict(BR=BR, BD=BD))
    return y, rstd


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx like x, from x, the forward's rstd and dy (all contiguous)."""
    D = x.shape[-1]
    R = x.numel() // D
    dx = empty(*x.shape, dtype=x.dtype, device=x.device)
    if R:
        BR, BD = _blocks(D)
        launches(l2norm_bwd_kernel, (cdiv(R, BR),), (x, rstd, dy, dx, R, D), dict(BR=BR, BD=BD))
    return dx
