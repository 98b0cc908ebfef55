"""KDA's backward state passes on Hopper: GDN's Gluon kernels with the per-channel decay, as the hooks of the
backward (triton/backward.py chunk_kda_bwd's state_bwd) and of its recompute (triton/forward.py kda_recompute's
state_pass). The gluon backend's backward takes them where the call fits the kernels; elsewhere the Triton passes run.

- the recompute's state pass (stage 3): gated_delta_rule/gluon/chunk_state_tma.py (a TMA ring of the W, K and U
  tiles, both products on warpgroup_mma) with DECAY "channel": its k tiles are the recompute's decayed keys per value
  head (K exp(gam_C - gam)), S decays per key row by exp(gam_C), gcum's last row of the chunk; h and Vnew as the
  Triton pass stores them.
- the reverse state pass (backward stage 1): gated_delta_rule/gluon/chunk_state_bwd.py with DECAY "channel": its q
  and k tiles are the decayed queries and keys (Q exp(gam), K exp(gam_C - gam)), so no exp is formed per element; dS
  decays per key row by exp(gam_C). Stage 1a (chunk_dv_local_kernel) stays Triton's.
"""
from __future__ import annotations

from typing import Tuple

import torch


def kda_state_gluon_supported(x: torch.Tensor, v_like: torch.Tensor) -> Tuple[bool, str]:
    """(ok, reason): the Gluon passes take K = V = 128 in one 16-bit dtype on a CUDA device with Gluon (x: the decayed
    queries or keys [T_tot, HV, K], v_like: a [..., V] tensor of the pass)."""
    from linattn.runtime.gluon_compat import GLUON_OK
    if not GLUON_OK:
        return False, "this Triton has no Gluon"
    if not x.is_cuda:
        return False, f"the tensors are on {x.device}; the Gluon passes run on a CUDA (sm_90) device"
    if x.shape[-1] != 128 or v_like.shape[-1] != 128:
        return False, f"K={x.shape[-1]}, V={v_like.shape[-1]}; the Gluon passes take K = V = 128"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False, f"{x.dtype}; the Gluon passes take bf16 or fp16"
    return True, ""


def kda_state_fwd_gluon_wanted(N: int, HV: int, V: int, num_sms: int) -> bool:
    """Whether the recompute's Gluon state pass is the faster one: where its config (launcher.state_config) is 32 value
    columns, fewer programs than SMs at 64 (one CTA per SM, a 3-stage ring). At 64 columns Triton's pass was faster
    (H100, H = HV = 32, K = V = 128: Gluon 0.661 against Triton 1.05 ms at B1 T32768, 0.686 against 0.58 at B8 T4096;
    benchmarks/OPT_LOG.md)."""
    from linattn.ops.gated_delta_rule.gluon.launcher import state_config
    return state_config(N, HV, V, num_sms).BV < 64


def kda_state_fwd_gluon(kdec, w, u, gcum, h, vnew, initial_state, final, plan) -> None:
    """kda_recompute's state_pass hook (its arguments; K-first states [N, HV, K, V]): the Gluon pass where
    kda_state_gluon_supported and kda_state_fwd_gluon_wanted, else the Triton one."""
    from linattn.runtime.device import device_facts
    if not (kda_state_gluon_supported(kdec, u)[0]
            and kda_state_fwd_gluon_wanted(plan.N, u.shape[1], u.shape[2], device_facts(u.device).num_sms)):
        from linattn.ops.gated_delta_rule.triton.forward import launch_state_pass
        launch_state_pass(kdec, w, u, gcum, h, vnew, initial_state, final, plan, False, decay="channel")
        return
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_state_gluon
    chunk_state_gluon(kdec, w, u, gcum, h, vnew, initial_state, final, plan, decay="channel")


def kda_state_bwd_gluon(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, scale: float) -> None:
    """chunk_kda_bwd's state_bwd hook (its arguments; K-first states [N, HV, K, V]): the Gluon pass where
    kda_state_gluon_supported, else the Triton one."""
    if not kda_state_gluon_supported(qdec, dvnew)[0]:
        from linattn.ops.kda.triton.backward import launch_kda_state_bwd
        launch_kda_state_bwd(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, scale)
        return
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import chunk_state_bwd_gluon
    chunk_state_bwd_gluon(qdec, kdec, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, decay="channel")
