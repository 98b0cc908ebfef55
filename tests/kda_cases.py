"""KDA test inputs shared by the chunk and decode tests: fresh random inputs each call (k L2-normalised; weak,
strong or mixed per-channel decays), and their fp64 copies."""
import torch
import torch.nn.functional as F


def kda_inputs(B, T, H, HV, K, V, *, dtype=torch.float32, decay="mixed", num_states=None, h0=True):
    """q, k (k L2-normalised), v, g [B, T, HV, K] log decays, beta, initial_state. decay: "weak" (per-step decay
    near 1), "strong" (down to e^-8 per step on some channels) or "mixed" (both within one head)."""
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, HV, V)
    weak = F.logsigmoid(torch.randn(B, T, HV, K) + 4.0) * 2.0
    strong = -torch.rand(B, T, HV, K) * 8.0
    g = {"weak": weak, "strong": strong,
         "mixed": torch.where(torch.rand(1, 1, 1, K) < 0.5, weak, strong)}[decay]
    beta = torch.sigmoid(torch.randn(B, T, HV))
    n = B if num_states is None else num_states
    state = torch.randn(n, HV, K, V) * 0.5 if h0 else None
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, initial_state=state)


def f64(x):
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}
