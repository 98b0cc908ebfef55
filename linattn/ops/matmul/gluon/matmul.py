"""Hopper (sm_90a) GEMM in Gluon: C[M,N] = A[M,K] @ B[K,N], fp32 accumulation, C in the operands' dtype.

Structure (one CTA per SM, persistent):
  * worker partition, 1 warp: walks the CTA's tiles in grouped order and issues TMA loads of A and B k-slices
    into a STAGES-deep shared-memory ring, gated by `empty` mbarriers, completing `ready` mbarriers.
  * default partition, num_warps warps (4 = one consumer warpgroup, 8 = two warpgroups splitting BM): waits on
    `ready`, issues async WGMMA with one group in flight, releases the slot of the retired group on `empty`,
    and at the end of a tile writes C through shared memory with a TMA store that it does NOT wait for: the
    wait happens before the next tile's epilogue reuses the buffer, so the store overlaps the next mainloop
    (whose loads the producer has already issued).
Both partitions count k-steps with the same running counter `it` across tiles, so ring slot `it % STAGES`
and mbarrier parity `(it // STAGES) & 1` agree without any extra handshake (gluon-3.6.md section 5, Phases).

Operand layouts are constexpr flags: A_T means A is stored as A^T (a [K,M] row-major tensor; the smem tile is
[BK,BM] and is fed to wgmma as a permuted, MN-major view), B_T means B is stored as B^T ([N,K] row-major, an
nn.Linear weight; the [BN,BK] tile permuted is K-major). TMA zero-fills out-of-bounds loads and clips
out-of-bounds stores, so ragged M, N and K need no masks.

Split-K (SPLIT_K > 1, for problems whose tiles leave SMs idle and whose K is long): a work unit is a tile times
one of SPLIT_K contiguous K slices; each unit stores its fp32 partial tile into a [SPLIT_K * M_pad, N] workspace
and triton/splitk_reduce.py sums the slices into C.
"""
from __future__ import annotations

from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, warpgroup_mma,
                                          warpgroup_mma_wait, tma_load, tma_store, tma_store_wait)

if GLUON_OK:

    @gluon.constexpr_function
    def wgmma_acc_layout(BM, BN, num_warps):
        # Warpgroup atom [4,1]; extra warpgroups split M while each still gets >= 64 rows, else N.
        w = [4, 1]
        while w[0] * w[1] < num_warps:
            if BM > 16 * w[0]:
                w[0] *= 2
            else:
                w[1] *= 2
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=w, instr_shape=[16, min(256, BN // w[1]), 16])

    @gluon.jit
    def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
        # Grouped order: GROUP_M row-tiles sweep the N tiles together, so the B panel stays in L2 while
        # GROUP_M A panels are reused across it.
        per_group = GROUP_M * num_pid_n
        first_m = (tile // per_group) * GROUP_M
        group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        return pid_m, pid_n

    @gluon.jit
    def _unit_coords(unit, num_pid_m, num_pid_n, num_k, GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr):
        # A work unit is one C tile times one K slice. Units of the same slice are consecutive, so CTAs that run
        # together read the same B k-panel. With SPLIT_K == 1 this is the plain grouped tile walk over all of K.
        num_tiles = num_pid_m * num_pid_n
        split = unit // num_tiles
        pid_m, pid_n = _tile_coords(unit % num_tiles, num_pid_m, num_pid_n, GROUP_M)
        k_per = gl.cdiv(num_k, SPLIT_K)
        k_lo = split * k_per
        k_hi = gl.minimum(num_k, k_lo + k_per)
        return pid_m, pid_n, split, k_lo, k_hi

    @gluon.jit
    def _load_partition(a_desc, b_desc, a_s, b_s, ready, empty, M, N, K,
                        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                        A_T: gl.constexpr, B_T: gl.constexpr, GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr):
        STAGES: gl.constexpr = a_s.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        it = 0
        for unit in range(gl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, gl.num_programs(0)):
            pid_m, pid_n, split, k_lo, k_hi = _unit_coords(unit, num_pid_m, num_pid_n, num_k, GROUP_M, SPLIT_K)
            off_m = pid_m * BM
            off_n = pid_n * BN
            for kk in range(k_lo, k_hi):
                s = it % STAGES
                # A fresh barrier reads as if phase 1 had completed: the first lap passes at once.
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)    # TMA counts the full box, zero-filled part included
                if A_T:
                    tma_load(a_desc, [kk * BK, off_m], ready.index(s), a_s.index(s))
                else:
                    tma_load(a_desc, [off_m, kk * BK], ready.index(s), a_s.index(s))
                if B_T:
                    tma_load(b_desc, [off_n, kk * BK], ready.index(s), b_s.index(s))
                else:
                    tma_load(b_desc, [kk * BK, off_n], ready.index(s), b_s.index(s))
                it += 1

    @gluon.jit
    def _store_tile(c_desc, c_s, vals, off_m, off_n):
        # The previous TMA store may still be reading c_s: wait for it (only the issuing thread tracks the bulk
        # group), then barrier so no warp overwrites c_s early. The store itself is not waited for here.
        tma_store_wait(0)
        gl.thread_barrier()
        c_s.store(vals.to(c_desc.dtype))
        fence_async_shared()                                # generic-proxy smem writes -> async-proxy TMA read
        tma_store(c_desc, [off_m, off_n], c_s)

    @gluon.jit
    def _mma_partition(a_s, b_s, c_s, ready, empty, c_desc, M, N, K,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       A_T: gl.constexpr, B_T: gl.constexpr, GROUP_M: gl.constexpr,
                       SPLIT_K: gl.constexpr):
        STAGES: gl.constexpr = a_s.shape[0]
        acc_layout: gl.constexpr = wgmma_acc_layout(BM, BN, gl.num_warps())
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        it = 0
        for unit in range(gl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, gl.num_programs(0)):
            pid_m, pid_n, split, k_lo, k_hi = _unit_coords(unit, num_pid_m, num_pid_n, num_k, GROUP_M, SPLIT_K)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            for kk in range(k_lo, k_hi):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if A_T:
                    a = a_s.index(s).permute((1, 0))
                else:
                    a = a_s.index(s)
                if B_T:
                    b = b_s.index(s).permute((1, 0))
                else:
                    b = b_s.index(s)
                acc = warpgroup_mma(a, b, acc, is_async=True)
                # At most one wgmma in flight: the one of step it-1 has retired, so its slot can be refilled.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > k_lo)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            # Release the last step's slot (a unit with an empty K slice issued none: nothing to release).
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k_hi > k_lo)
            # Split-K: slice `split` of C goes to rows [split * M_pad, ...) of the fp32 workspace, M_pad a whole
            # number of tiles, so a ragged last row-tile clips into padding rows, never into the next slice.
            off_m = split * (num_pid_m * BM) + pid_m * BM
            off_n = pid_n * BN
            _store_tile(c_desc, c_s, acc, off_m, off_n)
        tma_store_wait(0)

    @gluon.jit
    def matmul_ws_persistent(a_desc, b_desc, c_desc, M, N, K,
                             A_T: gl.constexpr, B_T: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                             SPLIT_K: gl.constexpr):
        # c_desc's block is [BM, BN]; with SPLIT_K > 1 it describes the fp32 partial-sum workspace
        # [SPLIT_K * M_pad, N] that matmul_splitk_reduce sums into C.
        BM: gl.constexpr = c_desc.block_type.shape[0]
        if A_T:
            BK: gl.constexpr = a_desc.block_type.shape[0]
        else:
            BK: gl.constexpr = a_desc.block_type.shape[1]
        if B_T:
            BN: gl.constexpr = b_desc.block_type.shape[0]
        else:
            BN: gl.constexpr = b_desc.block_type.shape[1]
        a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_s = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()                                # barrier inits visible to the async proxy
        gl.warp_specialize(
            [(_mma_partition, (a_s, b_s, c_s, ready, empty, c_desc, M, N, K, BM, BN, BK, A_T, B_T, GROUP_M,
                               SPLIT_K)),
             (_load_partition, (a_desc, b_desc, a_s, b_s, ready, empty, M, N, K, BM, BN, BK, A_T, B_T, GROUP_M,
                                SPLIT_K))],
            worker_num_warps=[1], worker_num_regs=[24])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


# ---------------------------------------------------------------- launcher

from dataclasses import dataclass  # noqa: E402

import functools  # noqa: E402

import torch  # noqa: E402

from linattn.ops.matmul.launch import DescriptorFactory, PlanCache, launch  # noqa: E402

SMEM_BUDGET_SM90 = 232448          # opt-in dynamic shared memory per block on H100/H200


@dataclass(frozen=True)
class GluonMatmulConfig:
    BM: int
    BN: int
    BK: int
    stages: int
    num_warps: int                 # 4: one consumer warpgroup; 8: two, splitting BM
    group_m: int = 8
    split_k: int = 1               # > 1: K split over that many work units per tile, fp32 partials + a reduction

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        ring = self.stages * (self.BM * self.BK + self.BK * self.BN) * elem_bytes
        c_bytes = 4 if self.split_k > 1 else elem_bytes
        return ring + self.BM * self.BN * c_bytes + 2 * self.stages * 8


# 128x256 is the fastest tile per CTA (gluon-3.6.md section 8 table); 128x128 with two consumer warpgroups
# wastes less of the last wave on small or skinny problems. Stages fill the 227 KB budget with C's buffer.
# _k2/_k4: split-K over 2/4 slices (fp32 partials); picked when the tiles leave SMs idle and K is long.
CONFIGS = {
    "128x256x64_s3_w8": GluonMatmulConfig(128, 256, 64, 3, 8),
    "128x128x64_s5_w8": GluonMatmulConfig(128, 128, 64, 5, 8),
    "128x128x64_s5_w8_k2": GluonMatmulConfig(128, 128, 64, 5, 8, split_k=2),
    "128x128x64_s5_w8_k4": GluonMatmulConfig(128, 128, 64, 5, 8, split_k=4),
}
# Relative throughput of one CTA per tile shape, from the same table (128x128 ran at about 0.88 of 128x256).
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.88}
# Split-K: only when K is long (the partials' write + read and the reduction launch are then a few % of the
# GEMM), charged as this fraction of the unsplit time.
SPLITK_MIN_K = 4096
_SPLITK_OVERHEAD = 0.05


def pick_config(M: int, N: int, K: int, num_sms: int) -> GluonMatmulConfig:
    """The tile that minimises (waves x tile work / tile efficiency): a persistent grid still runs in waves of
    num_sms tiles, so a 1.45-wave problem with big tiles loses to a 2.9-wave one with half-size tiles.
    Split-K is a candidate only when the 128x128 tiles number fewer than the SMs and K >= SPLITK_MIN_K; its
    units are tiles x slices, each 1/slices of the work, plus the overhead charge. With 128 tiles on 132 SMs
    a split gains nothing (2 slices: 2 waves of half-length units); with 32 tiles 4 slices fill 128 SMs."""
    best, best_cost = None, None
    for cfg in (CONFIGS["128x256x64_s3_w8"], CONFIGS["128x128x64_s5_w8"]):
        tiles = -(-M // cfg.BM) * -(-N // cfg.BN)
        waves = -(-tiles // num_sms)
        cost = waves * cfg.BM * cfg.BN / _TILE_EFFICIENCY[(cfg.BM, cfg.BN)]
        if best_cost is None or cost < best_cost:
            best, best_cost = cfg, cost
    tiles128 = -(-M // 128) * -(-N // 128)
    if tiles128 < num_sms and K >= SPLITK_MIN_K:
        for name in ("128x128x64_s5_w8_k2", "128x128x64_s5_w8_k4"):
            cfg = CONFIGS[name]
            waves = -(-(tiles128 * cfg.split_k) // num_sms)
            cost = waves * cfg.BM * cfg.BN / _TILE_EFFICIENCY[(cfg.BM, cfg.BN)] / cfg.split_k * (1 + _SPLITK_OVERHEAD)
            if cost < best_cost:
                best, best_cost = cfg, cost
    return best


def tma_layout(t: torch.Tensor):
    """('row', t) if t can be read by TMA as stored, ('col', t.T) if its transpose can, else (None, reason).
    TMA needs a 16-byte aligned base, 16-byte aligned non-last strides and a last stride of 1."""
    if t.data_ptr() % 16:
        return None, f"base address {t.data_ptr():#x} is not 16-byte aligned"
    kind, why = tma_stride_kind(tuple(t.shape), tuple(t.stride()), t.element_size(), str(t.dtype))
    if kind is None:
        return None, why
    return kind, (t if kind == "row" else t.T)


@functools.lru_cache(maxsize=4096)
def tma_stride_kind(shape, strides, es, dtype_name):
    """The stride half of tma_layout (pure, cached): ('row' | 'col', '') or (None, reason)."""
    if strides[1] == 1 and (strides[0] * es) % 16 == 0:
        return "row", ""
    if strides[0] == 1 and (strides[1] * es) % 16 == 0:
        return "col", ""
    return None, (f"strides {strides} of a {shape} {dtype_name} tensor: TMA needs one stride 1 "
                  f"and the other a multiple of {16 // es} elements")


class _Plan:
    """Everything a launch needs that depends only on the call signature (see linattn/ops/matmul/launch.py)."""
    __slots__ = ("cfg", "A_T", "B_T", "grid", "num_warps", "a_desc", "b_desc", "c_desc", "ws_rows",
                 "reduce", "handles")


def _make_plan(M, N, K, a_shape, a_strides, b_strides, c_strides, dtype, device, config):
    from linattn.runtime.device import device_facts
    from linattn.runtime.gluon_compat import TensorDescriptor
    es = 2
    a_kind, why_a = tma_stride_kind(a_shape, a_strides, es, str(dtype))
    b_kind, why_b = tma_stride_kind((K, N), b_strides, es, str(dtype))
    if a_kind is None or b_kind is None or c_strides[1] != 1 or (c_strides[0] * es) % 16:
        raise ValueError(f"matmul_gluon: operands are not TMA-compatible ({why_a or why_b or 'output'}); "
                         "call supports() first")
    facts = device_facts(device)
    cfg = config or _cached_config(M, N, K, dtype, facts) or pick_config(M, N, K, facts.num_sms)
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    p = _Plan()
    p.cfg, p.A_T, p.B_T = cfg, a_kind == "col", b_kind == "col"

    def desc_spec(shape, strides, block, elem):
        # Only the base pointer of a descriptor changes per call.
        return DescriptorFactory(TensorDescriptor, list(shape), list(strides), block,
                                 gl.NVMMASharedLayout.get_default_for(block, elem))
    # A^T / B^T views: shape and strides of the transposed tensor, which TMA reads row by row.
    p.a_desc = (desc_spec((K, M), (a_strides[1], 1), [cfg.BK, cfg.BM], gdt) if p.A_T
                else desc_spec((M, K), (a_strides[0], 1), [cfg.BM, cfg.BK], gdt))
    p.b_desc = (desc_spec((N, K), (b_strides[1], 1), [cfg.BN, cfg.BK], gdt) if p.B_T
                else desc_spec((K, N), (b_strides[0], 1), [cfg.BK, cfg.BN], gdt))
    c_block = [cfg.BM, cfg.BN]
    num_pid_m = -(-M // cfg.BM)
    if cfg.split_k > 1:
        p.ws_rows = cfg.split_k * num_pid_m * cfg.BM
        p.c_desc = desc_spec((p.ws_rows, N), (N, 1), c_block, gl.float32)
        from linattn.ops.matmul.triton.splitk_reduce import reduce_plan
        p.reduce = reduce_plan(M, N, num_pid_m * cfg.BM, cfg.split_k, c_strides[0])
    else:
        p.ws_rows, p.reduce = 0, None
        p.c_desc = desc_spec((M, N), c_strides, c_block, gdt)
    units = num_pid_m * -(-N // cfg.BN) * cfg.split_k
    p.grid = (min(facts.num_sms, units), 1, 1)
    p.num_warps = cfg.num_warps
    p.handles = {}
    return p


_PLANS = PlanCache()


def matmul_gluon(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor = None,
                 config: GluonMatmulConfig = None) -> torch.Tensor:
    """C = A @ B on sm_90a. a [M,K], b [K,N] (each row-major or a transposed view), bf16/fp16; returns [M,N]."""
    M, K = a.shape
    N = b.shape[1]
    a_strides, b_strides = a.stride(), b.stride()
    c_strides = out.stride() if out is not None else (N, 1)
    plan = _PLANS.get((M, N, K, a_strides, b_strides, c_strides, a.dtype, a.device, config),
                      lambda: _make_plan(M, N, K, (M, K), a_strides, b_strides, c_strides, a.dtype, a.device,
                                         config))
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    if (a.data_ptr() | b.data_ptr() | out.data_ptr()) % 16:
        raise ValueError("matmul_gluon: a base address is not 16-byte aligned (TMA); call supports() first")
    cfg = plan.cfg
    c_base = out if cfg.split_k == 1 else torch.empty(plan.ws_rows, N, device=a.device, dtype=torch.float32)
    args = (plan.a_desc(a), plan.b_desc(b), plan.c_desc(c_base), M, N, K,
            plan.A_T, plan.B_T, cfg.stages, cfg.group_m, cfg.split_k)
    launch(matmul_ws_persistent, plan.handles, "gemm", plan.grid, args, {"num_warps": plan.num_warps})
    if plan.reduce is not None:
        plan.reduce.run(c_base, out, plan.handles)
    return out


def clear_plans() -> None:
    """Forget every launch plan (e.g. after `linattn tune` wrote a config this process should now use)."""
    _PLANS.clear()


@functools.lru_cache(maxsize=None)   # inspect.getsource costs about a millisecond: once per process
def kernel_source_hash() -> str:
    """Hash of the kernel and its partitions' source: a cached tuning result is void once any of them changes."""
    import hashlib
    import inspect
    fns = (matmul_ws_persistent, _mma_partition, _load_partition, _tile_coords, _unit_coords, _store_tile)
    src = "".join(inspect.getsource(f.fn) for f in fns)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _cached_config(M, N, K, dtype, facts):
    from linattn.ops.matmul.triton.matmul import shape_key
    from linattn.runtime.config_cache import lookup
    entry = lookup("matmul_gluon", kernel_source_hash(), shape_key(M, N, K, dtype), facts)
    return GluonMatmulConfig(**entry) if entry else None
