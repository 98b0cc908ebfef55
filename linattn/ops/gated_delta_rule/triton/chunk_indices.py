"""Chunk bookkeeping for fixed-length and varlen batches, computed on the device without a host sync.

Every batch is treated as packed sequences: sequence n spans tokens cu[n]:cu[n+1] of the flattened [B*T] axis
(for a fixed-length batch cu = arange(B+1) * T). Chunk-parallel kernels get one program per chunk slot p; the
number of slots must be known on the host to size the grid, and sum(ceil(len_n / C)) is not known without
reading cu_seqlens. We use the bound sum(ceil(len_n / C)) <= T_total // C + N and let surplus programs exit.

Plans of fixed-length batches are cached (make_chunk_plan): building one is ~16 small device ops (arange, cumsum,
searchsorted, stack, casts...), which on a GPU cost more host time than the forward's own kernel launches
(benchmarks/OPT_LOG.md, "Host path of the Triton forward"). Varlen plans are built per call: their offsets live
on the device and are never read back, so no host key can say two of them are equal.
"""
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkPlan:
    """Read-only: a fixed-length plan is shared by every call of its (B, T, chunk size, device, stream); kernels
    only read these tensors, and nothing may write them."""
    cu: torch.Tensor             # [N+1] int64, clamped into [0, T_total]
    chunk_offsets: torch.Tensor  # [N+1] int64: first chunk slot of each sequence; [N] = chunks in use
    chunk_indices: torch.Tensor  # [num_slots, 2] int32: (sequence, chunk within the sequence); sequence N = unused
    num_slots: int               # host-side upper bound on the number of chunks (grid size)
    N: int
    T_total: int
    seq_len: int = 0             # every sequence's length for a fixed-length batch (cu = arange * T); 0 for varlen


MAX_CACHED_PLANS = 64
_PLANS: "OrderedDict[tuple, ChunkPlan]" = OrderedDict()     # least recently used first
_LOCK = threading.Lock()


def _fixed_plan_key(B: int, T: int, chunk_size: int, device):
    """The cache key of a fixed-length plan, or None where it must not be cached. On a GPU the key holds the
    current stream: a plan is reused only on the stream that built it, so its tensors are complete before any
    reader runs and freeing one on eviction is ordered after its last reader (the caching allocator's per-stream
    reuse). Never during CUDA-graph capture: the plan's ops would then be recorded, not run, and the graph holds
    no reference to tensors it reads, so capture builds its own plan as before (in the graph's pool)."""
    device = torch.device(device)
    if device.type != "cuda":
        return (B, T, chunk_size, device.type, device.index)
    if torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (B, T, chunk_size, "cuda", index, torch.cuda.current_stream(index).cuda_stream)


def make_chunk_plan(B: int, T: int, cu_seqlens, chunk_size: int, device) -> ChunkPlan:
    """The chunk plan of a batch: cached for fixed-length batches (cu_seqlens None; see _fixed_plan_key), built
    afresh for varlen ones (build_chunk_plan). The returned plan is shared: never write its tensors."""
    if cu_seqlens is not None:
        return build_chunk_plan(B, T, cu_seqlens, chunk_size, device)
    key = _fixed_plan_key(B, T, chunk_size, device)
    if key is None:
        return build_chunk_plan(B, T, None, chunk_size, device)
    with _LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = build_chunk_plan(B, T, None, chunk_size, device)
    with _LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > MAX_CACHED_PLANS:
            _PLANS.popitem(last=False)
    return plan


def clear_chunk_plans() -> None:
    """Forget every cached fixed-length plan."""
    with _LOCK:
        _PLANS.clear()


def build_chunk_plan(B: int, T: int, cu_seqlens, chunk_size: int, device) -> ChunkPlan:
    """A fresh plan (device ops only, no host sync)."""
    if cu_seqlens is None:
        N, T_total = B, B * T
        cu = torch.arange(B + 1, device=device, dtype=torch.int64) * T
        per_seq = -(-T // chunk_size)
        num_slots = B * per_seq
    else:
        N, T_total = cu_seqlens.numel() - 1, T
        # clamp: malformed device-side cu_seqlens can then only produce empty or short sequences, never
        # out-of-bounds accesses (the values are checked on the host when cu_seqlens lives there)
        cu = cu_seqlens.to(torch.int64).clamp(0, T_total)
        num_slots = T_total // chunk_size + N
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    nch = (lens + chunk_size - 1) // chunk_size
    chunk_offsets = torch.zeros(N + 1, dtype=torch.int64, device=device)
    torch.cumsum(nch, 0, out=chunk_offsets[1:])
    slots = torch.arange(max(num_slots, 1), device=device, dtype=torch.int64)
    seq = torch.searchsorted(chunk_offsets[1:].contiguous(), slots, right=True)       # in [0, N]; N: unused slot
    within = slots - chunk_offsets[seq.clamp_max(N - 1)]
    chunk_indices = torch.stack([seq, within], 1).to(torch.int32).contiguous()
    return ChunkPlan(cu.contiguous(), chunk_offsets, chunk_indices, max(num_slots, 1), N, T_total,
                     T if cu_seqlens is None else 0)
