"""Chunk bookkeeping for fixed-length and varlen batches, computed on the device without a host sync.

Every batch is treated as packed sequences: sequence n spans tokens cu[n]:cu[n+1] of the flattened [B*T] axis
(for a fixed-length batch cu = arange(B+1) * T). Chunk-parallel kernels get one program per chunk slot p; the
number of slots must be known on the host to size the grid, and sum(ceil(len_n / C)) is not known without
reading cu_seqlens. We use the bound sum(ceil(len_n / C)) <= T_total // C + N and let surplus programs exit.
"""
from dataclasses import dataclass

import torch


@dataclass
class ChunkPlan:
    cu: torch.Tensor             # [N+1] int64, clamped into [0, T_total]
    chunk_offsets: torch.Tensor  # [N+1] int64: first chunk slot of each sequence; [N] = chunks in use
    chunk_indices: torch.Tensor  # [num_slots, 2] int32: (sequence, chunk within the sequence); sequence N = unused
    num_slots: int               # host-side upper bound on the number of chunks (grid size)
    N: int
    T_total: int


def make_chunk_plan(B: int, T: int, cu_seqlens, chunk_size: int, device) -> ChunkPlan:
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
    return ChunkPlan(cu.contiguous(), chunk_offsets, chunk_indices, max(num_slots, 1), N, T_total)
