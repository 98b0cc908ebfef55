"""FLA's in-kernel gate and beta sigmoid as one elementwise pass before a backend whose kernels read activated values
(the Gluon forward and backward): g_eff = -exp(A_log) softplus(g + dt_bias) and beta_eff = beta_scale sigmoid(beta),
both fp32 [T_tot, HV], and in the backward the raw inputs' gradients with the per-token terms of A_log's and
dt_bias's (summed over tokens here). The Triton path forms the same values inside its own kernels (common.softplus,
common.gate_chain); this pass costs one read and one write of g and beta, [T, HV] values against the chunk kernels'
[T, HV, K] ones.

`activate` is the entry: a direct launch for eager calls without autograd, else the custom op
"linattn::gdn_gate_prologue" with its backward registered (torch.compile traces it through its fake).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import softplus
from linattn.runtime import eager_ops
from linattn.runtime.alloc import empty
from linattn.runtime.host_path import cdiv

BLOCK = 1024


@triton.jit
def gate_prologue_fwd_kernel(g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr, g_out_ptr, beta_out_ptr, n,
                             HV: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                             BETA_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """g, beta [n = T_tot * HV] flat (head fastest) -> g_eff, beta_eff fp32. GATE False / BETA_SCALE 0: copied."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    hv = offs % HV
    x = tl.load(g_ptr + offs, mask=m, other=0.).to(tl.float32)
    if GATE:
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias_ptr + hv, mask=m, other=0.).to(tl.float32)
        x = -tl.exp(tl.load(A_log_ptr + hv, mask=m, other=0.).to(tl.float32)) * softplus(x)
    tl.store(g_out_ptr + offs, x, mask=m)
    b = tl.load(beta_ptr + offs, mask=m, other=0.).to(tl.float32)
    if BETA_SCALE != 0:
        b = tl.sigmoid(b) * BETA_SCALE
    tl.store(beta_out_ptr + offs, b, mask=m)


@triton.jit
def gate_prologue_bwd_kernel(g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr, dg_eff_ptr, dbeta_eff_ptr, dg_ptr, dbeta_ptr,
                             da_terms_ptr, dx_terms_ptr, n, HV: tl.constexpr, GATE: tl.constexpr,
                             HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """The chain rule of gate_prologue_fwd_kernel: dg = dg_eff * -exp(A_log) sigmoid(x) (x = g + dt_bias), with the
    per-token terms dg_eff * g_eff (A_log's: d g_eff / d A_log = g_eff) and dg (dt_bias's) in fp32;
    dbeta = dbeta_eff * beta_scale s (1 - s), s = sigmoid(beta). dg and dbeta in their inputs' dtypes."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    hv = offs % HV
    dge = tl.load(dg_eff_ptr + offs, mask=m, other=0.).to(tl.float32)
    if GATE:
        x = tl.load(g_ptr + offs, mask=m, other=0.).to(tl.float32)
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias_ptr + hv, mask=m, other=0.).to(tl.float32)
        neg_a = -tl.exp(tl.load(A_log_ptr + hv, mask=m, other=0.).to(tl.float32))
        tl.store(da_terms_ptr + offs, dge * (neg_a * softplus(x)), mask=m)
        dge = dge * (neg_a * tl.sigmoid(x))
        if HAS_DT_BIAS:
            tl.store(dx_terms_ptr + offs, dge, mask=m)
    tl.store(dg_ptr + offs, dge.to(dg_ptr.dtype.element_ty), mask=m)
    db = tl.load(dbeta_eff_ptr + offs, mask=m, other=0.).to(tl.float32)
    if BETA_SCALE != 0:
        s = tl.sigmoid(tl.load(beta_ptr + offs, mask=m, other=0.).to(tl.float32))
        db = db * (BETA_SCALE * s * (1. - s))
    tl.store(dbeta_ptr + offs, db.to(dbeta_ptr.dtype.element_ty), mask=m)


def _grid(n: int):
    return (max(cdiv(n, BLOCK), 1),)


def gate_prologue_fwd(g, beta, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                      beta_scale: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """g, beta [B, T, HV] contiguous; A_log, dt_bias [HV] (A_log None: no gate). Returns fp32 (g_eff, beta_eff)."""
    n = g.numel()
    g_eff = empty(*g.shape, dtype=torch.float32, device=g.device)
    beta_eff = empty(*beta.shape, dtype=torch.float32, device=g.device)
    gate = A_log is not None
    gate_prologue_fwd_kernel[_grid(n)](
        g, beta, A_log if gate else g, dt_bias if dt_bias is not None else g, g_eff, beta_eff, n,
        HV=g.shape[-1], GATE=gate, HAS_DT_BIAS=dt_bias is not None, BETA_SCALE=beta_scale, BLOCK=BLOCK)
    return g_eff, beta_eff


def gate_prologue_bwd(g, beta, A_log, dt_bias, beta_scale: int, dg_eff, dbeta_eff):
    """(dg, dbeta, dA_log or None, ddt_bias or None) of gate_prologue_fwd, the parameters' in their dtypes."""
    n, HV = g.numel(), g.shape[-1]
    gate = A_log is not None
    dg = empty(*g.shape, dtype=g.dtype, device=g.device)
    dbeta = empty(*beta.shape, dtype=beta.dtype, device=g.device)
    da_terms = empty(n // HV, HV, dtype=torch.float32, device=g.device) if gate else dg
    dx_terms = empty(n // HV, HV, dtype=torch.float32, device=g.device) if dt_bias is not None else dg
    gate_prologue_bwd_kernel[_grid(n)](
        g, beta, A_log if gate else g, dt_bias if dt_bias is not None else g, dg_eff.contiguous(),
        dbeta_eff.contiguous(), dg, dbeta, da_terms, dx_terms, n, HV=HV, GATE=gate, HAS_DT_BIAS=dt_bias is not None,
        BETA_SCALE=beta_scale, BLOCK=BLOCK)
    dA_log = da_terms.sum(0).to(A_log.dtype) if gate else None
    ddt_bias = dx_terms.sum(0).to(dt_bias.dtype) if dt_bias is not None else None
    return dg, dbeta, dA_log, ddt_bias


@eager_ops.custom_op("linattn::gdn_gate_prologue")
def _prologue(g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
              beta_scale: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return gate_prologue_fwd(g, beta, A_log, dt_bias, beta_scale)


@_prologue.register_fake
def _(g, beta, A_log, dt_bias, beta_scale):
    return g.new_empty(g.shape, dtype=torch.float32), beta.new_empty(beta.shape, dtype=torch.float32)


@eager_ops.custom_op("linattn::gdn_gate_prologue_bwd")
def _prologue_bwd(g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor],
                  dt_bias: Optional[torch.Tensor], beta_scale: int, dg_eff: torch.Tensor,
                  dbeta_eff: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dg, dbeta, dA_log, ddt_bias = gate_prologue_bwd(g, beta, A_log, dt_bias, beta_scale, dg_eff, dbeta_eff)
    # an absent parameter's gradient comes back as an empty [0] tensor (optional outputs are not allowed)
    return (dg, dbeta, dA_log if dA_log is not None else g.new_empty(0, dtype=torch.float32),
            ddt_bias if ddt_bias is not None else g.new_empty(0, dtype=torch.float32))


@_prologue_bwd.register_fake
def _(g, beta, A_log, dt_bias, beta_scale, dg_eff, dbeta_eff):
    return (torch.empty_like(g), torch.empty_like(beta),
            torch.empty_like(A_log) if A_log is not None else g.new_empty(0, dtype=torch.float32),
            torch.empty_like(dt_bias) if dt_bias is not None else g.new_empty(0, dtype=torch.float32))


def _setup(ctx, inputs, output):
    g, beta, A_log, dt_bias, beta_scale = inputs
    ctx.save_for_backward(g, beta, A_log, dt_bias)
    ctx.beta_scale = beta_scale


def _backward(ctx, dg_eff, dbeta_eff):
    g, beta, A_log, dt_bias = ctx.saved_tensors
    dg, dbeta, dA_log, ddt_bias = _prologue_bwd(
        g, beta, A_log, dt_bias, ctx.beta_scale,
        dg_eff if dg_eff is not None else torch.zeros_like(g, dtype=torch.float32),
        dbeta_eff if dbeta_eff is not None else torch.zeros_like(beta, dtype=torch.float32))
    return dg, dbeta, (dA_log if A_log is not None else None), (ddt_bias if dt_bias is not None else None), None


_prologue.register_autograd(_backward, setup_context=_setup)


def activate(g, beta, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
             beta_scale: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(g_eff, beta_eff) fp32 from FLA's raw gate input (A_log given; dt_bias optional) and beta logit (beta_scale 1,
    or 2 with allow_neg_eigval; 0: beta as given), differentiable in all four tensors."""
    from linattn.runtime.device import eager_without_autograd
    g, beta = g.contiguous(), beta.contiguous()
    if eager_without_autograd(g, beta, A_log, dt_bias):
        return gate_prologue_fwd(g, beta, A_log, dt_bias, beta_scale)
    return _prologue(g, beta, A_log, dt_bias, beta_scale)
