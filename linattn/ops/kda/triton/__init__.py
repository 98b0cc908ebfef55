"""Triton launchers of the KDA ops (the kernels are shared with Gated DeltaNet where the math allows)."""
