"""Portable Triton kernels for Gated DeltaNet, one file per stage (shared/gdn-math.md, "The chunk form")."""
