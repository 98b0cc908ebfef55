from linattn.ops.matmul.triton.matmul import matmul_triton, matmul_grouped, pick_config, TritonMatmulConfig

__all__ = ["matmul_triton", "matmul_grouped", "pick_config", "TritonMatmulConfig"]
