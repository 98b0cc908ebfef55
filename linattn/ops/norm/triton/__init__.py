"""Triton kernels of the gated RMS norm."""
