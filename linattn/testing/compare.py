"""Relative RMS error against an fp64 reference, and NaN poisoning.

Tolerances per operand dtype, justified once: the same chunked computation done by torch with operands rounded
to the dtype and fp32 accumulation lands from the fp64 reference at about 2-4e-3 (bf16), 3-5e-4 (fp16) and
1e-6 (fp32, or 3e-4 with TF32 matrix units) on the gate's inputs. The bounds leave a factor of about 3 for
shape-dependent growth, and no more.
"""
import math

import torch

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-3}


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN or inf anywhere in `out` gives inf."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape mismatch: {tuple(out64.shape)} vs {tuple(ref64.shape)}")
    if not torch.isfinite(out64).all():
        return math.inf
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if den == 0.0:
        return num
    return num / den


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    err = rel_rms(out, ref)
    if not err <= tol:
        raise AssertionError(f"{name}: relative RMS error {err:.3e} exceeds {tol:.1e}")
    return err


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a floating buffer with NaN, so an element the kernel never writes fails the check."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t
