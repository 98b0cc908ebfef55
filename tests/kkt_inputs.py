"""Shared by the stage-2a tests (test_kkt_solve_gva.py, test_kkt_solve_v2.py): chunk inputs, NaN-filled output
buffers, and kkt_solve_kernel launched as the forward launches it (the reference the opt-in variants are held to)."""
import torch

from linattn.ops.gated_delta_rule.triton import intra_split as sm
from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
from linattn.testing import make_gdn_inputs


def kkt_inputs(B, T, H, HV, K, dtype, lens=None, seed=0, g_scale=1.0, device="cpu"):
    """(k, g * g_scale, beta, plan, B, T, cu): fresh random inputs (seeded), T = sum(lens) with cu_seqlens when lens
    is given."""
    cu = None
    if lens is not None:
        T = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=device)
    x = make_gdn_inputs(B, T, H, HV, K, K, dtype=dtype, device=device, initial_state=False,
                        generator=torch.Generator().manual_seed(seed))
    return x["k"], x["g"] * g_scale, x["beta"], make_chunk_plan(B, T, cu, 64, device), B, T, cu


def nan_bufs(plan, HV, tinv_dtype, device="cpu"):
    """gcum [T_tot, HV] fp32 and Tinv [T_tot, HV, 64] filled with NaN: a row a kernel does not write stays NaN."""
    return (torch.full((plan.T_total, HV), float("nan"), dtype=torch.float32, device=device),
            torch.full((plan.T_total, HV, 64), float("nan"), dtype=tinv_dtype, device=device))


def launch_kkt_solve(k, g, beta, plan, HV, tinv_dtype):
    """kkt_solve_kernel as the forward launches it (split_intra_config's BK_kkt / warps_kkt): (gcum, Tinv)."""
    H, K = k.shape[-2], k.shape[-1]
    cfg = sm.split_intra_config(K, K)
    gcum, tinv = nan_bufs(plan, HV, tinv_dtype, k.device)
    sm.kkt_solve_kernel[(plan.num_slots, HV)](
        k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N, H=H, HV=HV, K=K, BT=sm.CHUNK,
        BK=cfg.BK_kkt, DOT_PREC="ieee" if k.dtype == torch.float32 else "tf32", num_warps=cfg.warps_kkt)
    return gcum, tinv
