"""KDA's reverse state pass (backward stage 1) on Hopper: GDN's Gluon kernel (gated_delta_rule/gluon/
chunk_state_bwd.py: a TMA ring of the chunk tiles, every product on warpgroup_mma) with the per-channel decay. Its q
and k tiles are the recompute's decayed queries and keys per value head (Q exp(gam), K exp(gam_C - gam)), so no
exp is formed per element; dS decays per key row by exp(gam_C), gcum's last row. Stage 1a (chunk_dv_local_kernel)
stays Triton's. The gluon backend's backward takes it where the call fits the kernel; elsewhere the Triton pass
runs (triton/backward.py launch_kda_state_bwd)."""
from __future__ import annotations

from typing import Tuple

import torch


def kda_state_bwd_gluon_supported(qdec: torch.Tensor, dvnew: torch.Tensor) -> Tuple[bool, str]:
    """(ok, reason): the Gluon reverse pass takes K = V = 128 in one 16-bit dtype on a CUDA device with Gluon."""
    from linattn.runtime.gluon_compat import GLUON_OK
    if not GLUON_OK:
        return False, "this Triton has no Gluon"
    if not qdec.is_cuda:
        return False, f"the tensors are on {qdec.device}; the Gluon pass runs on a CUDA (sm_90) device"
    if qdec.shape[-1] != 128 or dvnew.shape[-1] != 128:
        return False, f"K={qdec.shape[-1]}, V={dvnew.shape[-1]}; the Gluon pass takes K = V = 128"
    if qdec.dtype not in (torch.bfloat16, torch.float16):
        return False, f"{qdec.dtype}; the Gluon pass takes bf16 or fp16"
    return True, ""


def kda_state_bwd_gluon(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, scale: float) -> None:
    """chunk_kda_bwd's state_bwd hook (its arguments; K-first states [N, HV, K, V]): the Gluon pass where
    kda_state_bwd_gluon_supported, else the Triton one."""
    ok, _ = kda_state_bwd_gluon_supported(qdec, dvnew)
    if not ok:
        from linattn.ops.kda.triton.backward import launch_kda_state_bwd
        launch_kda_state_bwd(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, scale)
        return
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import chunk_state_bwd_gluon
    chunk_state_bwd_gluon(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, decay="channel")
