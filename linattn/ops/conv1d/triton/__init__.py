"""Triton kernels of the causal convolution."""
