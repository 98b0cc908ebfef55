"""Context parallelism for chunk_gated_delta_rule (FLA 0.6's form): build a context per rank with
`build_cp_context(cu_seqlens_global, group)` and pass it as the op's `cp_context=`. docs/context-parallel.md has the
algorithm, the communication per pass and the memory cost."""
from linattn.distributed.context import CPContext, FLACPContext, build_cp_context

__all__ = ["CPContext", "FLACPContext", "build_cp_context"]
