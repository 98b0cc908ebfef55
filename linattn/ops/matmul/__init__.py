"""GEMM: C = A @ B (bf16/fp16, fp32 accumulation). Backends: gluon (sm_90a), triton, reference."""
from linattn.ops.matmul.api import matmul, check_inputs
from linattn.ops.matmul.reference import matmul_reference

__all__ = ["matmul", "matmul_reference", "check_inputs"]
