"""Inputs and checks shared by the tests that plug a kernel's formulas into a hook of chunk_gated_delta_rule_bwd
(tests/ is on sys.path)."""
import torch

from linattn.testing import make_gdn_inputs, rel_rms

# (B, T, H, HV, varlen lengths): GVA with a partial last chunk, varlen with 1-token and chunk-edge sequences, HV = H
HOOK_CASES = [(2, 150, 2, 4, None), (1, 300, 1, 2, [1, 63, 65, 171]), (1, 129, 2, 2, None)]


def fp32_bwd_args(B, T, H, HV, lens, K=32):
    """chunk_gated_delta_rule_bwd's positional arguments (q, k, v, g, beta, scale, initial_state, cu_seqlens, do,
    dht) on fresh random fp32 CPU inputs with K = V: no rounding anywhere, so hook and Triton stages agree to fp32."""
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    N = B if cu is None else len(lens)
    x = make_gdn_inputs(B, T, H, HV, K, K, dtype=torch.float32, device="cpu", num_states=N)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"], cu,
            torch.randn(B, T, HV, K), torch.randn(N, HV, K, K))


def assert_same_grads(got, want, tol=1e-4):
    """dq, dk, dv, dg, dbeta and d initial_state finite and within tol relative RMS of the reference's."""
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got[:6], want[:6]):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < tol, (name, rel_rms(a, b))
