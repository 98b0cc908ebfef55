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
    def _load_partition(a_desc, b_desc, a_s, b_s, ready, empty, M, N, K,
                        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                        A_T: gl.constexpr, B_T: gl.constexpr, GROUP_M: gl.constexpr):
        STAGES: gl.constexpr = a_s.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        it = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            for kk in range(num_k):
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
    def _mma_partition(a_s, b_s, c_s, ready, empty, c_desc, M, N, K,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       A_T: gl.constexpr, B_T: gl.constexpr, GROUP_M: gl.constexpr):
        STAGES: gl.constexpr = a_s.shape[0]
        acc_layout: gl.constexpr = wgmma_acc_layout(BM, BN, gl.num_warps())
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        num_k = gl.cdiv(K, BK)
        it = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            for kk in range(num_k):
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
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            # The previous tile's TMA store may still be reading c_s: wait for it (only the issuing thread
            # tracks the bulk group), then barrier so no warp overwrites c_s early.
            tma_store_wait(0)
            gl.thread_barrier()
            c_s.store(acc.to(c_desc.dtype))
            fence_async_shared()                            # generic-proxy smem writes -> async-proxy TMA read
            tma_store(c_desc, [pid_m * BM, pid_n * BN], c_s)
        tma_store_wait(0)

    @gluon.jit
    def matmul_ws_persistent(a_desc, b_desc, c_desc, M, N, K,
                             A_T: gl.constexpr, B_T: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        if A_T:
            BK: gl.constexpr = a_desc.block_type.shape[0]
        else:
            BK: gl.constexpr = a_desc.block_type.shape[1]
        a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_s = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()                                # barrier inits visible to the async proxy
        gl.warp_specialize(
            [(_mma_partition, (a_s, b_s, c_s, ready, empty, c_desc, M, N, K, BM, BN, BK, A_T, B_T, GROUP_M)),
             (_load_partition, (a_desc, b_desc, a_s, b_s, ready, empty, M, N, K, BM, BN, BK, A_T, B_T, GROUP_M))],
            worker_num_warps=[1], worker_num_regs=[24])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


# ---------------------------------------------------------------- launcher

from dataclasses import dataclass  # noqa: E402

import functools  # noqa: E402

import torch  # noqa: E402

SMEM_BUDGET_SM90 = 232448          # opt-in dynamic shared memory per block on H100/H200


@dataclass(frozen=True)
class GluonMatmulConfig:
    BM: int
    BN: int
    BK: int
    stages: int
    num_warps: int                 # 4: one consumer warpgroup; 8: two, splitting BM
    group_m: int = 8

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        ring = self.stages * (self.BM * self.BK + self.BK * self.BN) * elem_bytes
        return ring + self.BM * self.BN * elem_bytes + 2 * self.stages * 8


# 128x256 is the fastest tile per CTA (gluon-3.6.md section 8 table); 128x128 with two consumer warpgroups
# wastes less of the last wave on small or skinny problems. Stages fill the 227 KB budget with C's buffer.
CONFIGS = {
    "128x256x64_s3_w8": GluonMatmulConfig(128, 256, 64, 3, 8),
    "128x128x64_s5_w8": GluonMatmulConfig(128, 128, 64, 5, 8),
    "128x128x64_s4_w4": GluonMatmulConfig(128, 128, 64, 4, 4),
}
# Relative throughput of one CTA per tile shape, from the same table (128x128 ran at about 0.88 of 128x256).
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.88}


def pick_config(M: int, N: int, K: int, num_sms: int) -> GluonMatmulConfig:
    """The tile that minimises (waves x tile work / tile efficiency): a persistent grid still runs in waves of
    num_sms tiles, so a 1.45-wave problem with big tiles loses to a 2.9-wave one with half-size tiles."""
    best, best_cost = None, None
    for cfg in (CONFIGS["128x256x64_s3_w8"], CONFIGS["128x128x64_s5_w8"]):
        tiles = -(-M // cfg.BM) * -(-N // cfg.BN)
        waves = -(-tiles // num_sms)
        cost = waves * cfg.BM * cfg.BN / _TILE_EFFICIENCY[(cfg.BM, cfg.BN)]
        if best_cost is None or cost < best_cost:
            best, best_cost = cfg, cost
    return best


def tma_layout(t: torch.Tensor):
    """('row', t) if t can be read by TMA as stored, ('col', t.T) if its transpose can, else (None, reason).
    TMA needs a 16-byte aligned base, 16-byte aligned non-last strides and a last stride of 1."""
    es = t.element_size()
    if t.data_ptr() % 16:
        return None, f"base address {t.data_ptr():#x} is not 16-byte aligned"
    if t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0:
        return "row", t
    if t.stride(0) == 1 and (t.stride(1) * es) % 16 == 0:
        return "col", t.T
    return None, (f"strides {tuple(t.stride())} of a {tuple(t.shape)} {t.dtype} tensor: TMA needs one stride 1 "
                  f"and the other a multiple of {16 // es} elements")


def matmul_gluon(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor = None,
                 config: GluonMatmulConfig = None) -> torch.Tensor:
    """C = A @ B on sm_90a. a [M,K], b [K,N] (each row-major or a transposed view), bf16/fp16; returns [M,N]."""
    from linattn.runtime.device import device_facts
    from linattn.runtime.gluon_compat import TensorDescriptor
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    facts = device_facts(a.device)
    cfg = config or _cached_config(M, N, K, a.dtype, facts) or pick_config(M, N, K, facts.num_sms)
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_kind, a_t = tma_layout(a)
    b_kind, b_t = tma_layout(b)
    c_kind, _ = tma_layout(out)
    if a_kind is None or b_kind is None or c_kind != "row":
        raise ValueError("matmul_gluon: operands are not TMA-compatible; call supports() first")
    A_T, B_T = a_kind == "col", b_kind == "col"

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))

    a_desc = desc(a_t, [cfg.BK, cfg.BM] if A_T else [cfg.BM, cfg.BK])
    b_desc = desc(b_t, [cfg.BN, cfg.BK] if B_T else [cfg.BK, cfg.BN])
    c_desc = desc(out, [cfg.BM, cfg.BN])
    tiles = -(-M // cfg.BM) * -(-N // cfg.BN)
    grid = (min(facts.num_sms, tiles),)
    matmul_ws_persistent[grid](a_desc, b_desc, c_desc, M, N, K, A_T=A_T, B_T=B_T, STAGES=cfg.stages,
                               GROUP_M=cfg.group_m, num_warps=cfg.num_warps)
    return out


@functools.lru_cache(maxsize=None)   # inspect.getsource costs about a millisecond: once per process
def kernel_source_hash() -> str:
    """Hash of the kernel and its partitions' source: a cached tuning result is void once any of them changes."""
    import hashlib
    import inspect
    src = "".join(inspect.getsource(f.fn) for f in (matmul_ws_persistent, _mma_partition, _load_partition, _tile_coords))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _cached_config(M, N, K, dtype, facts):
    from linattn.ops.matmul.triton.matmul import shape_key
    from linattn.runtime.config_cache import lookup
    entry = lookup("matmul_gluon", kernel_source_hash(), shape_key(M, N, K, dtype), facts)
    return GluonMatmulConfig(**entry) if entry else None
