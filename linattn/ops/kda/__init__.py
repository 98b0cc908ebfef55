"""Kimi Delta Attention (KDA): Gated DeltaNet with a per-key-channel decay."""
