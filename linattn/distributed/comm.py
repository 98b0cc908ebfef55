"""The two collectives context parallelism uses, behind one small interface so that the one-GPU model can stand in
for the peers: `all_gather(t) -> [W, *t.shape]` and `all_reduce_(t)` (sum, in place).

TorchComm runs torch.distributed (NCCL on GPUs, gloo on CPUs) on flat contiguous buffers, the form both backends
accept (gloo's all-gather into one tensor takes a [W * n] output, not [W, n]). The collectives are issued on the
current stream; nothing is read back on the host. SimulatedComm (no communication) returns W copies of this rank's
tensor: the shapes and the work of every other step stay those of a real run, the values do not.
"""
from __future__ import annotations

import torch


class TorchComm:
    def __init__(self, group=None):
        import torch.distributed as dist
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        # torch >= 2.13 names the flat all-gather all_gather_single (all_gather_into_tensor warns there)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.contiguous().reshape(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=t.dtype, device=t.device)
        self._gather(out, flat, group=self.group)
        return out.view(self.world_size, *t.shape)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)
        return t


class SimulatedComm:
    """World of `world_size` ranks seen from rank `rank`, with no peers: all_gather returns this rank's tensor W times
    (a copy, as a real gather writes a new buffer), all_reduce_ leaves the tensor as it is. For timing models only."""

    def __init__(self, rank: int, world_size: int):
        self.group = None
        self.rank = rank
        self.world_size = world_size

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0).repeat(self.world_size, *([1] * t.dim()))

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t


def comm_of(ctx) -> object:
    """The context's collectives: its own `comm`, else torch.distributed over its group."""
    if ctx.comm is None:
        ctx.comm = TorchComm(ctx.group)
    return ctx.comm
