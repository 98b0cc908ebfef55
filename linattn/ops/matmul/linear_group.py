"""LinearGroup: the outputs of a few bias-free nn.Linear modules that share their input, in one kernel launch for
a call of at most 64 rows without autograd (a decode step's projections), each module's own call otherwise.

At a decode step's few rows the projections are bound by reading their weights, and one small matmul per module
(cuBLAS) reaches a fraction of the memory rate at these widths; one launch over all of them streams every weight
once at near the rate. The weights stay the modules' own tensors (no copy, no extra memory): the kernel reads them
through a table of row addresses, built on the first call and rebuilt when a weight's address, shape or dtype
changes. Outputs are contiguous tensors (views of one buffer)."""
from typing import List, Sequence

import torch

from linattn.runtime.alloc import empty
from linattn.runtime.host_path import HostPath, LaunchCache
from linattn.runtime.settings import settings

# a decode step's launch, once per layer and token: through the compiled kernel's handle once its signature has
# been seen (runtime/host_path.LaunchCache)
launches = LaunchCache(HostPath())

BN, BK = 32, 128
MAX_ROWS = 64


class LinearGroup:
    def __init__(self):
        self._key = None
        self._table = None

    @staticmethod
    def _call_ok(x: torch.Tensor) -> bool:
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or type(x) is not torch.Tensor:
            return False
        if not (x.is_cuda or (x.device.type == "cpu" and settings.interpret)):
            return False
        return x.dim() >= 2 and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and x.dtype != torch.float64

    @staticmethod
    def _module_ok(x: torch.Tensor, m: torch.nn.Module) -> bool:
        w = getattr(m, "weight", None)
        return (type(m) is torch.nn.Linear and m.bias is None and w.dtype == x.dtype and w.device == x.device
                and w.shape[1] == x.shape[-1] and w.shape[0] > 0 and w.is_contiguous()
                # 16-byte aligned rows: the kernel loads them as vectors through addresses from its table
                and w.data_ptr() % 16 == 0 and w.shape[1] * w.element_size() % 16 == 0)

    def _table_for(self, x: torch.Tensor, weights) -> torch.Tensor:
        key = tuple((w.data_ptr(), tuple(w.shape), w.dtype) for w in weights) + (x.device,)
        if key != self._key:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return None                          # no host-to-device copy inside a capture
            rows, start = [], 0
            for w in weights:
                N, K = w.shape
                rows += [(w.data_ptr() + j * BN * K * w.element_size(), start, N, j * BN) for j in range(-(-N // BN))]
                start += N
            self._table = torch.tensor(rows, dtype=torch.int64).to(x.device)
            self._key = key
        return self._table

    def __call__(self, x: torch.Tensor, mods: Sequence[torch.nn.Module]) -> List[torch.Tensor]:
        """[m(x) for m in mods]: the modules the kernel takes (bias-free nn.Linear in x's dtype) in one launch, any
        other by its own call."""
        grouped = [self._module_ok(x, m) for m in mods] if self._call_ok(x) else [False] * len(mods)
        if sum(grouped) < 2:
            return [m(x) for m in mods]
        outs = iter(self._launch(x, [m.weight for m, g in zip(mods, grouped) if g]))
        return [next(outs) if g else m(x) for m, g in zip(mods, grouped)]

    def _launch(self, x: torch.Tensor, weights) -> List[torch.Tensor]:
        table = self._table_for(x, weights)
        if table is None:
            return [torch.nn.functional.linear(x, w) for w in weights]
        from linattn.ops.matmul.triton.linear_group import linear_group_kernel
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        widths = [w.shape[0] for w in weights]
        buf = empty(M * sum(widths), dtype=x.dtype, device=x.device)
        if M > 0:
            BM = max(16, min(MAX_ROWS, 1 << (M - 1).bit_length()))
            launches(linear_group_kernel, (table.shape[0], 1, 1), (x2, table, buf, M, K, x2.stride(0)),
                     dict(BM=BM, BN=BN, BK=BK, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
                          num_stages=4))
        outs, off = [], 0
        for N in widths:
            outs.append(buf[off:off + M * N].view(*lead, N))
            off += M * N
        return outs
