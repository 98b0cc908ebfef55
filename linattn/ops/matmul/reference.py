"""The definition of matmul in plain PyTorch, same signature as the op: the ground truth in tests."""
import torch


def matmul_reference(a: torch.Tensor, b: torch.Tensor, backend: str = "reference") -> torch.Tensor:
    """C = A @ B computed in fp32 (fp64 when asked for by the tests through the operands' dtype), cast back to
    the operands' dtype, like the kernels: fp32 accumulation, output in the input dtype."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    return (a.to(acc) @ b.to(acc)).to(a.dtype)
