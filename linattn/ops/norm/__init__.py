"""The gated RMS norm (FLA's FusedRMSNormGated)."""
from linattn.ops.norm.api import rms_norm_gated

__all__ = ["rms_norm_gated"]
