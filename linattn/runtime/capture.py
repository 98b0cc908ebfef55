"""Whether a call is being captured into a CUDA graph, as a host-side flag (no synchronisation)."""
from __future__ import annotations

import torch


def capturing(t: torch.Tensor) -> bool:
    """Whether work on t's device is being captured into a CUDA graph. A CPU build of torch raises on the query,
    hence the device test first. Under torch.compile the choice is made at trace time, where no capture is under way
    (a later cudagraph of the compiled graph is not known): the eager rule holds."""
    from linattn.runtime.device import under_torch_compile
    return not under_torch_compile() and stream_capturing(t)


def stream_capturing(t: torch.Tensor) -> bool:
    """capturing(t) for a caller that has already ruled out torch.compile tracing (runtime/device.py's
    eager_without_autograd): the capture query alone, CUDA tensors only."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
