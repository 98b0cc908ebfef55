"""The Triton kernels of chunk_gated_delta_rule number sequence x value head and the chunk slots on grid axis 0
(CUDA: up to 2^31 - 1 programs); axes 1 and 2 (CUDA: up to 65535) carry only head counts. A packed batch of more
than 65535 / HV sequences therefore launches, forward and backward. Running it under the interpreter takes far
too long (tens of ms per program), so the launches of such a call through the public function are recorded instead
of run, and their grids checked; the kernels' program numbering itself is exercised by every other kernel test."""
import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.triton import backward, chunk_output, forward, intra_split
from linattn.runtime.settings import settings

needs_interpreter = pytest.mark.skipif(not settings.interpret,
                                       reason="records the launches of CPU tensors: needs TRITON_INTERPRET=1")
KERNELS = [(forward, "chunk_state_fwd_kernel"), (chunk_output, "chunk_output_kernel"),
           (intra_split, "kkt_solve_kernel"), (intra_split, "wu_kernel"), (backward, "chunk_dv_local_kernel"),
           (backward, "chunk_state_bwd_kernel"), (backward, "chunk_local_bwd_kernel"),
           (backward, "chunk_wy_bwd_kernel")]


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records (name, grid, kwargs) and runs nothing."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, tuple(grid), kwargs))


@needs_interpreter
def test_more_sequence_heads_than_grid_y_launch_on_axis_0(monkeypatch):
    log = []
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, _Recorder(name, log))
    N, H, HV, K, V = 2100, 2, 32, 16, 16                   # N * HV = 67200 > 65535
    lens = torch.randint(1, 4, (N,))
    cu = torch.zeros(N + 1, dtype=torch.int64)
    cu[1:] = lens.cumsum(0)
    T = int(cu[-1])
    leaf = lambda *s: torch.randn(*s).requires_grad_()    # noqa: E731
    q, k, v = leaf(1, T, H, K), leaf(1, T, H, K), leaf(1, T, HV, V)
    g = (-torch.rand(1, T, HV)).requires_grad_()
    beta = torch.rand(1, T, HV).requires_grad_()
    h0 = leaf(N, HV, K, V)
    o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           cu_seqlens=cu, backend="triton")
    (o.sum() + ht.sum()).backward()

    launched = {name for name, _, _ in log}
    assert launched == {name for _, name in KERNELS}, launched
    slots = T // 64 + N                                    # the chunk plan's host-side bound
    for name, grid, kw in log:
        assert len(grid) <= 3 and all(1 <= n for n in grid), (name, grid)
        assert grid[0] < 2 ** 31 and all(n <= 65535 for n in grid[1:]), (name, grid)
        programs = 1
        for n in grid:
            programs *= n
        nv = -(-V // kw["BV"]) if "BV" in kw else 1
        if name in ("chunk_state_fwd_kernel", "chunk_state_bwd_kernel"):
            assert grid == (nv * N * HV,), (name, grid)     # every (V block, sequence, value head) once
        elif name == "chunk_output_kernel":
            assert grid == (slots * nv * (HV // H), H), (name, grid)
        elif name == "chunk_local_bwd_kernel":
            assert grid == (-(-K // kw["BK"]) * slots, H), (name, grid)
        else:                                              # chunk slot on axis 0, a head count on axis 1
            assert grid[0] == slots and grid[1] in (H, HV), (name, grid)
        assert programs >= slots, (name, grid)
