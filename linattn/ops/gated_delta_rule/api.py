"""Public entry of the chunked Gated DeltaNet op: argument checks, backend choice, dtype plumbing.

Backends registered here: "triton" (portable; every device Triton runs on, and the CPU under TRITON_INTERPRET=1)
and "reference" (plain PyTorch, by name only). A Gluon backend registers itself from gluon/ with a higher priority.
"""
from typing import Optional, Tuple

import torch

from linattn.backends import op_backends
from linattn.ops.gated_delta_rule import reference as _ref
from linattn.ops.gated_delta_rule.validation import check_gdn_inputs
from linattn.runtime.settings import settings

OP = "chunk_gated_delta_rule"
_backends = op_backends(OP)


def _triton_supports(q=None, **_) -> Tuple[bool, str]:
    if q is None:
        return True, ""
    if q.device.type == "cpu" and not settings.interpret:
        return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton path"
    if q.device.type not in ("cpu", "cuda"):
        return False, f"device {q.device.type} is not supported by the Triton path"
    return True, ""


def _triton_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    res = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return res.o, res.final_state


def _reference_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    return _ref.chunk_reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


_backends.register("triton", _triton_impl, _triton_supports, priority=10)
_backends.register("reference", _reference_impl, lambda **_: (True, ""), priority=100, auto=False)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                           use_qk_l2norm_in_kernel: bool = False, backend: str = "auto"
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet, chunked (shared/gdn-math.md).

    Args:
        q, k: [B, T, H, K] (bf16, fp16 or fp32; one dtype with v).
        v: [B, T, HV, V], HV a multiple of H (GVA: value head j reads q/k head j // (HV // H)).
        g: [B, T, HV] log decay (<= 0), any float dtype.  beta: [B, T, HV] any float dtype.
        scale: query scale, default K ** -0.5.
        initial_state: [N, HV, K, V], any float dtype (the math is fp32); N = B, or the number of sequences.
        output_final_state: also return the fp32 state after the last token, [N, HV, K, V].
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (B must be 1); starts at 0, sorted, ends at T.
            Checked on the host when it lives on the CPU; on a GPU it is not read back (no sync) and malformed
            offsets are clamped so that they can never cause out-of-bounds accesses.
        use_qk_l2norm_in_kernel: L2-normalise q and k along K first (eps 1e-6).
        backend: "auto", "triton", "reference" (or "gluon" where registered).
    Returns:
        o [B, T, HV, V] in v's dtype, and the final state (fp32) or None.
    """
    dims = check_gdn_inputs(q, k, v, g, beta, initial_state, cu_seqlens, op=OP)
    if scale is None:
        scale = dims["K"] ** -0.5
    b = _backends.select(backend, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, output_final_state=output_final_state)
    if b.name != "reference" and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)):
        raise NotImplementedError(
            f"{OP}: the {b.name} backend has no backward yet; call it under torch.no_grad() or use backend='reference'")
    if use_qk_l2norm_in_kernel:
        q = _ref.l2norm(q.float()).to(q.dtype)
        k = _ref.l2norm(k.float()).to(k.dtype)
    if b.name == "reference":
        return b.impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    return b.impl(q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens)
