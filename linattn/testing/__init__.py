"""Test helpers shared by the CPU tests, the GPU gates, `verify` and `bench`."""
from linattn.testing.compare import rel_rms, assert_close, poison_, TOL
from linattn.testing.inputs import make_gdn_inputs, random_cu_seqlens

__all__ = ["rel_rms", "assert_close", "poison_", "TOL", "make_gdn_inputs", "random_cu_seqlens"]
