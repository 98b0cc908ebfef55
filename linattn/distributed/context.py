"""The context of a context-parallel call (FLA 0.6's `build_cp_context` / `FLACPContext`, contiguous layout).

One packed stream of T tokens (global cu_seqlens, N sequences) is split over W ranks: rank r holds tokens
[r * T / W, (r + 1) * T / W). Sequences may cross rank boundaries. The context holds what the op needs on rank r,
all computed once on the host from the global offsets:

- FLA's fields: `group`, `cu_seqlens` (the local offsets, on cu_seqlens' device) and `cu_seqlens_cpu`,
  `is_first_rank` (the rank's first sequence starts here), `pre_num_ranks` (how many ranks before this one it
  started), `is_last_rank` / `post_num_ranks` (the same for the end of the rank's last sequence),
  `conv1d_kernel_size`, `pre_num_conv_tokens` (tokens of the first sequence on earlier ranks, FLA's
  convention).
- linattn's: `rank`, `world_size`, `part_len` (T / W), `total_tokens`, `num_seqs_global` (N), `seq_offset` (the
  global index of local sequence 0: local sequence i is global sequence seq_offset + i), `any_crossing` (some
  sequence crosses some boundary: without one the forward needs no exchange), and `comm` (None: torch.distributed
  over `group`; linattn/distributed/comm.py's SimulatedComm stands in for the peers in the one-GPU model).

Local sequences: every global sequence with a token on this rank, plus the empty sequences (cu[n] == cu[n + 1])
whose offset lies in [start, end) (the last rank also takes those at T), so that each global sequence belongs to
exactly one rank as its ending rank and local index i maps to global index seq_offset + i. FLA drops empty sequences
(it keeps no per-sequence states); linattn keeps them, since initial and final states are indexed by sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(eq=False)
class CPContext:
    group: object = None
    cu_seqlens: Optional[torch.Tensor] = None
    cu_seqlens_cpu: Optional[torch.Tensor] = None
    is_last_rank: bool = True
    pre_num_ranks: int = 0
    is_first_rank: bool = True
    post_num_ranks: int = 0
    conv1d_kernel_size: Optional[int] = None
    pre_num_conv_tokens: int = 0
    rank: int = 0
    world_size: int = 1
    part_len: int = 0
    total_tokens: int = 0
    num_seqs_global: int = 0
    seq_offset: int = 0
    any_crossing: bool = False
    comm: object = None
    layout: str = "contiguous"

    @property
    def num_seqs(self) -> int:
        """Number of sequences on this rank (FLA's name)."""
        return 0 if self.cu_seqlens_cpu is None else self.cu_seqlens_cpu.numel() - 1

    @property
    def is_cp_enabled(self) -> bool:
        return self.group is not None or self.comm is not None or self.world_size > 1

    def copy_for_backward(self) -> "CPContext":
        """FLA's: the context is read-only here, so the copy shares it."""
        return self


FLACPContext = CPContext


def _fail(msg: str):
    raise ValueError(f"build_cp_context: {msg}")


def build_cp_context(cu_seqlens: torch.Tensor, group=None, conv1d_kernel_size: Optional[int] = None,
                     cu_seqlens_cpu: Optional[torch.Tensor] = None, use_tf32x3_affine_chain: bool = True,
                     layout: str = "contiguous", *, rank: Optional[int] = None, world_size: Optional[int] = None,
                     comm=None) -> CPContext:
    """The context of rank `rank` of `world_size` (default: torch.distributed's rank and size in `group`, the
    default group when None) for one packed stream with global offsets `cu_seqlens` ([N + 1], int, from 0 to T;
    T a multiple of the world size).

    Reads the offsets on the host (pass `cu_seqlens_cpu`, a host copy, to avoid a device-to-host copy): build it once
    per batch, outside the step that is timed or captured. `use_tf32x3_affine_chain` is FLA's legacy switch (True
    only, as in FLA; linattn composes the summaries in fp32). `layout="zigzag"` is not supported
    (NotImplementedError). `comm`: an object with all_gather / all_reduce_ (comm.py) that replaces torch.distributed.
    """
    if use_tf32x3_affine_chain is not True:
        raise ValueError("build_cp_context: use_tf32x3_affine_chain=False is not supported (as in FLA)")
    if layout != "contiguous":
        if layout == "zigzag":
            raise NotImplementedError("build_cp_context: layout='zigzag' is not supported yet (only 'contiguous')")
        _fail(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        _fail(f"cu_seqlens must be a 1-D int32/int64 tensor [N + 1] with N >= 1, got {cu_seqlens.dtype} "
              f"{tuple(cu_seqlens.shape)}")
    if rank is None or world_size is None:
        if comm is not None:
            rank, world_size = comm.rank, comm.world_size
        else:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized()):
                _fail("torch.distributed is not initialised: initialise the process group first, or pass rank "
                      "and world_size")
            rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        _fail(f"rank must be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")

    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.detach().cpu()
    if tuple(host.shape) != tuple(cu_seqlens.shape):
        _fail(f"cu_seqlens_cpu has shape {tuple(host.shape)}, cu_seqlens {tuple(cu_seqlens.shape)}")
    cu = [int(x) for x in host.to(torch.int64).tolist()]
    total = cu[-1]
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        _fail(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:16]}")
    if total < world_size or total % world_size:
        _fail(f"the total length T={total} must be a positive multiple of the world size {world_size}: every rank "
              f"holds T / W tokens")
    N = len(cu) - 1
    part = total // world_size

    def owned(r: int):
        """(first, last) global sequence index of rank r's local sequences (see the module docstring)."""
        start, end = r * part, (r + 1) * part
        last_rank = r == world_size - 1
        first = next(n for n in range(N) if cu[n + 1] > start or cu[n] >= start)
        last = max(n for n in range(N) if cu[n] < end or (last_rank and cu[n] <= end))
        return first, last

    def rank_of(token: int) -> int:
        return min(token // part, world_size - 1)

    start, end = rank * part, (rank + 1) * part
    lo, hi = owned(rank)
    local = [min(max(c, start), end) - start for c in cu[lo:hi + 2]]     # from 0 to part (see owned)
    continues_in = cu[lo] < start
    continues_out = cu[hi + 1] > end
    pre = rank - rank_of(cu[lo]) if continues_in else 0
    post = rank_of(cu[hi + 1] - 1) - rank if continues_out else 0
    offsets = set(cu)
    crossing = any(r * part not in offsets for r in range(1, world_size))   # a boundary strictly inside a sequence
    local_cpu = torch.tensor(local, dtype=torch.int32)
    return CPContext(
        group=group, cu_seqlens=local_cpu.to(cu_seqlens.device, non_blocking=True), cu_seqlens_cpu=local_cpu,
        is_last_rank=not continues_out, pre_num_ranks=pre, is_first_rank=not continues_in, post_num_ranks=post,
        conv1d_kernel_size=conv1d_kernel_size, pre_num_conv_tokens=max(0, start - cu[lo]), rank=rank,
        world_size=world_size, part_len=part, total_tokens=total, num_seqs_global=N, seq_offset=lo,
        any_crossing=crossing, comm=comm)


def check_cp_call(op: str, q, cu_seqlens, cp, backend: str, triton_supports) -> None:
    """The checks of an op's cp_context call against the context (chunk_gated_delta_rule's and chunk_kda's):
    cp_context built by build_cp_context, cu_seqlens omitted or the context's local offsets, the Triton backend
    (triton_supports(q=q) -> (ok, why)), and this rank's T / W tokens."""
    if not isinstance(cp, CPContext):
        raise TypeError(f"{op}: cp_context must be built by linattn.distributed.build_cp_context, got "
                        f"{type(cp).__name__}")
    if cu_seqlens is not None and cu_seqlens is not cp.cu_seqlens and not (
            cu_seqlens.device.type == "cpu" and torch.equal(cu_seqlens.to(torch.int64),
                                                            cp.cu_seqlens_cpu.to(torch.int64))):
        raise ValueError(f"{op}: with cp_context, cu_seqlens must be omitted or be cp_context.cu_seqlens (this "
                         f"rank's local offsets); the global offsets go to build_cp_context")
    if backend not in ("auto", "triton"):
        raise NotImplementedError(f"{op}: cp_context runs the Triton kernels; backend={backend!r} is not supported")
    ok, why = triton_supports(q=q)
    if not ok:
        raise NotImplementedError(f"{op}: cp_context runs the Triton kernels: {why}")
    if q.dim() == 4 and q.shape[1] != cp.part_len:
        raise ValueError(f"{op}: with cp_context, q must hold this rank's T / W = {cp.part_len} tokens, got "
                         f"T={q.shape[1]}")
