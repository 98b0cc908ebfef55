"""Input makers for Gated DeltaNet: fresh random data every call, never zeros, with realistic statistics
(L2-normalised keys, decays g in roughly [-0.2, 0), beta in (0, 1))."""
from typing import Optional

import torch
import torch.nn.functional as F


def random_cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_gdn_inputs(B: int, T: int, H: int, HV: int, K: int, V: int, *, dtype=torch.bfloat16,
                    gate_dtype=torch.float32, beta_dtype=None, state_dtype=torch.float32, device="cpu",
                    num_states: Optional[int] = None, initial_state: bool = True, normalize_k: bool = True,
                    requires_grad: bool = False, generator: Optional[torch.Generator] = None) -> dict:
    """q, k [B,T,H,K]; v [B,T,HV,V]; g, beta [B,T,HV]; initial_state [N,HV,K,V] (N = num_states or B)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device)

    q = rnd(B, T, H, K)
    k = rnd(B, T, H, K)
    if normalize_k:
        k = F.normalize(k, dim=-1)
    v = rnd(B, T, HV, V)
    g = F.logsigmoid(rnd(B, T, HV) + 4.0) * 4.0           # log decay in about [-0.3, 0): alpha near 0.9-1
    beta = torch.sigmoid(rnd(B, T, HV))
    n = num_states if num_states is not None else B
    h0 = rnd(n, HV, K, V) * 0.5 if initial_state else None
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(gate_dtype),
               beta=beta.to(beta_dtype or gate_dtype), initial_state=None if h0 is None else h0.to(state_dtype))
    if requires_grad:
        for name, t in out.items():
            if t is not None:
                t.requires_grad_(True)
    return out
