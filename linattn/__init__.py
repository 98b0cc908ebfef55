"""linattn: chunked linear-attention operators for PyTorch (Gated DeltaNet first).

Portable Triton kernels for every op (also on a CPU under TRITON_INTERPRET=1) and Gluon fast paths for NVIDIA
Hopper behind a backend registry. The API follows FLA's conventions ([B, T, H, K] layouts, GVA, cu_seqlens,
fp32 states), so switching is a change of import.
"""
from linattn.runtime.settings import settings as _settings

if _settings.interpret:
    from linattn.runtime import interpreter_fixes as _fixes
    _fixes.install()

__version__ = "0.1.0"

from linattn.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from linattn.ops.kda.chunk import chunk_kda  # noqa: E402
from linattn.ops.kda.fused_recurrent import fused_recurrent_kda  # noqa: E402
from linattn.ops.matmul import matmul  # noqa: E402
from linattn.ops.conv1d import causal_conv1d, causal_conv1d_update  # noqa: E402
from linattn.ops.norm import rms_norm_gated  # noqa: E402
from linattn.distributed import build_cp_context  # noqa: E402

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda", "matmul",
           "causal_conv1d", "causal_conv1d_update", "rms_norm_gated", "build_cp_context"]
