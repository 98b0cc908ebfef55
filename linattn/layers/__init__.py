from linattn.layers.norm import FusedRMSNormGated  # noqa: F401
