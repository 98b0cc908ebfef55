"""Portable GEMM in Triton: C[M,N] = A[M,K] @ B[K,N], fp32 accumulation, C in the operands' dtype.

The textbook kernel: one program per C tile, programs ordered in groups of GROUP_M row-tiles (L2 reuse of the B
panel), operands read through their strides (so transposed views need no copy), ragged edges masked. The launch
config is a small frozen table picked by a shape heuristic; `linattn tune --op matmul` may override it per GPU
through the config cache. No run-time autotuning.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from linattn.ops.matmul.launch import PlanCache, launch
from linattn.runtime.host_path import cdiv, next_power_of_2


@triton.jit
def matmul_grouped(a_ptr, b_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # Grouped order: consecutive programs share a B column panel across GROUP_M row tiles.
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    # Wrap (not mask) the M/N indices for loads: out-of-range rows/cols re-read valid ones whose results are
    # never stored, so loads stay unmasked in M/N (only the store is masked). No max_contiguous hint: the last
    # tile's indices really do wrap, and a vector load along a unit M/N stride would then read past the end.
    rm_ld = rm % M
    rn_ld = rn % N
    a_ptrs = a_ptr + rm_ld[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn_ld[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BK
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class TritonMatmulConfig:
    BM: int
    BN: int
    BK: int
    num_stages: int
    num_warps: int
    group_m: int = 8

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        # Triton's pipeliner keeps num_stages copies of both operand tiles in shared memory.
        return self.num_stages * (self.BM * self.BK + self.BK * self.BN) * elem_bytes


# The frozen table. The big tiles are what the plain-Triton column of gluon-3.6.md section 8 measured on an H200;
# the small ones keep skinny/small problems from running a handful of programs on 132 SMs.
CONFIGS = {
    "128x256x64_s3_w8": TritonMatmulConfig(128, 256, 64, 3, 8),
    "128x128x64_s4_w4": TritonMatmulConfig(128, 128, 64, 4, 4),
    "128x128x64_s4_w8": TritonMatmulConfig(128, 128, 64, 4, 8),
    "64x128x64_s4_w4": TritonMatmulConfig(64, 128, 64, 4, 4),
    "64x64x64_s4_w4": TritonMatmulConfig(64, 64, 64, 4, 4),
    "128x64x64_s4_w4": TritonMatmulConfig(128, 64, 64, 4, 4),
}


@functools.lru_cache(maxsize=None)   # inspect.getsource costs about a millisecond: once per process
def kernel_source_hash() -> str:
    """Hash of the kernel's source: a cached tuning result is void once the kernel changes."""
    return hashlib.sha256(inspect.getsource(matmul_grouped.fn).encode()).hexdigest()[:16]


def _pow2_at_least_16(n: int, cap: int) -> int:
    return max(16, min(cap, next_power_of_2(max(1, n))))


def pick_config(M: int, N: int, K: int, num_sms: int, interpret: bool = False) -> TritonMatmulConfig:
    """Frozen heuristic. Under the interpreter the cost is per program, so tiles just cover the problem."""
    if interpret:
        return TritonMatmulConfig(_pow2_at_least_16(M, 64), _pow2_at_least_16(N, 64), _pow2_at_least_16(K, 32), 1, 4)
    tiles = lambda c: -(-M // c.BM) * -(-N // c.BN)  # noqa: E731
    for name in ("128x256x64_s3_w8", "128x128x64_s4_w8", "64x128x64_s4_w4"):
        cfg = CONFIGS[name]
        if tiles(cfg) >= 2 * num_sms:         # at least two waves: the larger tile's reuse wins
            return cfg
    return CONFIGS["64x64x64_s4_w4"]


class _Plan:
    """Config, grid and constexprs for one call signature (see linattn/ops/matmul/launch.py)."""
    __slots__ = ("config", "grid", "even_k", "handles")


def _make_plan(M, N, K, dtype, device, config):
    from linattn.runtime.device import device_facts
    from linattn.runtime.settings import settings
    if config is None:
        interpret = settings.interpret or device.type == "cpu"
        facts = device_facts(device)
        config = None if interpret else _cached_config(M, N, K, dtype, facts)
        config = config or pick_config(M, N, K, facts.num_sms, interpret=interpret)
    p = _Plan()
    p.config = config
    p.grid = (cdiv(M, config.BM) * cdiv(N, config.BN), 1, 1)
    p.even_k = K % config.BK == 0
    p.handles = {}
    return p


_PLANS = PlanCache()


def matmul_triton(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor = None,
                  config: TritonMatmulConfig = None) -> torch.Tensor:
    """C = A @ B. a [M,K], b [K,N], any strides, bf16/fp16; returns a new row-major [M,N] (or fills `out`)."""
    from linattn.runtime.settings import settings
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    # The key fixes everything the JIT specialises on: sizes and strides by value, pointers by 16-byte alignment.
    # The interpreter flag is in it because the config choice depends on it.
    aligned = ((a.data_ptr() % 16 == 0) << 2) | ((b.data_ptr() % 16 == 0) << 1) | (out.data_ptr() % 16 == 0)
    plan = _PLANS.get((M, N, K, a.stride(), b.stride(), out.stride(), aligned, a.dtype, a.device, config,
                       settings.interpret),
                      lambda: _make_plan(M, N, K, a.dtype, a.device, config))
    cfg = plan.config
    args = (a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            cfg.BM, cfg.BN, cfg.BK, cfg.group_m, plan.even_k)
    launch(matmul_grouped, plan.handles, "gemm", plan.grid, args,
           {"num_stages": cfg.num_stages, "num_warps": cfg.num_warps})
    return out


def clear_plans() -> None:
    """Forget every launch plan (e.g. after `linattn tune` wrote a config this process should now use)."""
    _PLANS.clear()


def _cached_config(M, N, K, dtype, facts):
    """A tuned config for this GPU/Triton/kernel source and shape bucket, if `linattn tune` wrote one."""
    from linattn.runtime.config_cache import lookup
    entry = lookup("matmul_triton", kernel_source_hash(), shape_key(M, N, K, dtype), facts)
    if entry is None:
        return None
    return TritonMatmulConfig(**entry)


def shape_key(M: int, N: int, K: int, dtype) -> str:
    """Bucket by powers of two so one tuned entry serves neighbouring shapes."""
    b = lambda x: next_power_of_2(max(1, x))  # noqa: E731
    return f"{b(M)}x{b(N)}x{b(K)}:{str(dtype).replace('torch.', '')}"
