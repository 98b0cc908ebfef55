"""FLA's in-kernel gate and beta sigmoid as one elementwise pass before a backend whose kernels read activated values
(the Gluon forward and backward): g_eff = -exp(A_log) softplus(g + dt_bias) and beta_eff = beta_scale sigmoid(beta),
both fp32 [T_tot, HV], and in the backward the raw inputs' gradients with A_log's and dt_bias's (per-program sums of
their per-token terms, summed by col_sum_kernel). Both launch through the host path's cached handles (triton/host.py).
The Triton path forms the same values inside its own kernels (common.softplus, common.gate_chain); this pass costs
one read and one write of g and beta, [T, HV] values against the chunk kernels' [T, HV, K] ones.

`activate` is the entry: a direct launch for eager calls without autograd, else the custom op
"linattn::gdn_gate_prologue" with its backward registered (torch.compile traces it through its fake).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from linattn.ops.col_sum import col_sum
from linattn.ops.gated_delta_rule.triton.common import softplus
from linattn.ops.gated_delta_rule.triton.host import launches
from linattn.runtime import eager_ops
from linattn.runtime.alloc import empty
from linattn.runtime.host_path import cdiv, next_power_of_2

BLOCK = 1024      # elements per program (the backward: BLOCK // next_power_of_2(HV) tokens of every head)


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
                             da_part_ptr, dx_part_ptr, n_rows, HV: tl.constexpr, GATE: tl.constexpr,
                             HAS_DT_BIAS: tl.constexpr, BETA_SCALE: tl.constexpr, BR: tl.constexpr,
                             BHV: tl.constexpr):
    """The chain rule of gate_prologue_fwd_kernel on BR tokens (rows of [n_rows, HV]) per program: dg = dg_eff *
    -exp(A_log) sigmoid(x) (x = g + dt_bias) and dbeta = dbeta_eff * beta_scale s (1 - s), s = sigmoid(beta), in
    their inputs' dtypes; the program's sums over its tokens of the parameters' per-token terms, dg_eff * g_eff
    (A_log's: d g_eff / d A_log = g_eff) and dg (dt_bias's), in fp32 at its row of da_part / dx_part [programs, HV]."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BR + tl.arange(0, BR)
    hv = tl.arange(0, BHV)
    m = (rows < n_rows)[:, None] & (hv < HV)[None, :]
    offs = rows[:, None] * HV + hv[None, :]
    dge = tl.load(dg_eff_ptr + offs, mask=m, other=0.).to(tl.float32)
    if GATE:
        x = tl.load(g_ptr + offs, mask=m, other=0.).to(tl.float32)
        if HAS_DT_BIAS:
            x = x + tl.load(dt_bias_ptr + hv, mask=hv < HV, other=0.).to(tl.float32)[None, :]
        neg_a = -tl.exp(tl.load(A_log_ptr + hv, mask=hv < HV, other=0.).to(tl.float32))[None, :]
        tl.store(da_part_ptr + pid * HV + hv, tl.sum(tl.where(m, dge * (neg_a * softplus(x)), 0.), axis=0),
                 mask=hv < HV)
        dge = dge * (neg_a * tl.sigmoid(x))
        if HAS_DT_BIAS:
            tl.store(dx_part_ptr + pid * HV + hv, tl.sum(tl.where(m, dge, 0.), axis=0), mask=hv < HV)
    tl.store(dg_ptr + offs, dge.to(dg_ptr.dtype.element_ty), mask=m)
    db = tl.load(dbeta_eff_ptr + offs, mask=m, other=0.).to(tl.float32)
    if BETA_SCALE != 0:
        s = tl.sigmoid(tl.load(beta_ptr + offs, mask=m, other=0.).to(tl.float32))
        db = db * (BETA_SCALE * s * (1. - s))
    tl.store(dbeta_ptr + offs, db.to(dbeta_ptr.dtype.element_ty), mask=m)


def gate_prologue_fwd(g, beta, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                      beta_scale: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """g, beta [B, T, HV] contiguous; A_log, dt_bias [HV] (A_log None: no gate). Returns fp32 (g_eff, beta_eff)."""
    n = g.numel()
    g_eff = empty(*g.shape, dtype=torch.float32, device=g.device)
    beta_eff = empty(*beta.shape, dtype=torch.float32, device=g.device)
    gate = A_log is not None
    launches(gate_prologue_fwd_kernel, (max(cdiv(n, BLOCK), 1),),
             (g, beta, A_log if gate else g, dt_bias if dt_bias is not None else g, g_eff, beta_eff, n),
             dict(HV=g.shape[-1], GATE=gate, HAS_DT_BIAS=dt_bias is not None, BETA_SCALE=beta_scale, BLOCK=BLOCK))
    return g_eff, beta_eff


def gate_prologue_bwd(g, beta, A_log, dt_bias, beta_scale: int, dg_eff, dbeta_eff):
    """(dg, dbeta, dA_log or None, ddt_bias or None) of gate_prologue_fwd, the parameters' in their dtypes (summed
    over the programs' partials by col_sum_kernel)."""
    HV = g.shape[-1]
    n_rows = g.numel() // HV
    BHV = next_power_of_2(HV)
    BR = max(1, BLOCK // BHV)
    programs = max(cdiv(n_rows, BR), 1)
    gate = A_log is not None
    dg = empty(*g.shape, dtype=g.dtype, device=g.device)
    dbeta = empty(*beta.shape, dtype=beta.dtype, device=g.device)
    da_part = empty(programs, HV, dtype=torch.float32, device=g.device) if gate else dg
    dx_part = empty(programs, HV, dtype=torch.float32, device=g.device) if dt_bias is not None else dg
    launches(gate_prologue_bwd_kernel, (programs,),
             (g, beta, A_log if gate else g, dt_bias if dt_bias is not None else g, dg_eff.contiguous(),
              dbeta_eff.contiguous(), dg, dbeta, da_part, dx_part, n_rows),
             dict(HV=HV, GATE=gate, HAS_DT_BIAS=dt_bias is not None, BETA_SCALE=beta_scale, BR=BR, BHV=BHV))
    dA_log = col_sum(da_part, A_log.shape, A_log.dtype, launches) if gate else None
    ddt_bias = col_sum(dx_part, dt_bias.shape, dt_bias.dtype, launches) if dt_bias is not None else None
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
