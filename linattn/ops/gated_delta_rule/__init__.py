"""Gated DeltaNet ops."""
from linattn.ops.gated_delta_rule.api import chunk_gated_delta_rule
from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
