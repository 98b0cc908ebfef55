"""Whether a call is being captured into a CUDA graph, as a host-side flag (no synchronisation)."""
from __future__ import annotations

import torch


def capturing(t: torch.Tensor) -> bool:
    """Whether work on t's device is being captured into a CUDA graph. A CPU build of torch raises on the query,
    hence the device test first. Under torch.compile the choice is made at trace time, where no capture is under way
    (a later cudagraph of the compiled graph is not known): the eager rule holds."""
    from linattn.runtime.device import under_torch_compile
    if t.device.type != "cuda" or under_torch_compile():
        return False
    return torch.cuda.is_current_stream_capturing()
