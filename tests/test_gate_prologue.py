"""linattn/ops/gated_delta_rule/triton/gate_prologue.py: FLA's gate and beta sigmoid as one pass before the Gluon
kernels. Its values and every gradient against fp64 autograd of the formulas, on NaN-poisoned outputs; and the
chunked op fed by it against the same op with the options in its Triton kernels (what the gluon backend composes,
checked here on the Triton backend, which runs on a CPU)."""
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import assert_close, make_gdn_inputs

from markers import needs_triton   # tests/ is on sys.path

F32 = 2e-5


def _formula(g, beta, A_log, dt_bias, beta_scale):
    if A_log is not None:
        g = -torch.exp(A_log) * F.softplus(g + (dt_bias if dt_bias is not None else 0.))
    if beta_scale:
        beta = torch.sigmoid(beta) * beta_scale
    return g, beta


@needs_triton
@pytest.mark.parametrize("gate,dt_bias,beta_scale,B,T,HV", [
    (True, True, 2, 2, 37, 3), (True, False, 0, 2, 37, 3), (False, False, 1, 2, 37, 3), (True, True, 1, 2, 37, 3),
    (True, True, 1, 1, 600, 5)])       # the backward's parameter sums over 5 programs of 128 tokens, the last partial
def test_values_and_gradients_against_fp64(gate, dt_bias, beta_scale, B, T, HV):
    from linattn.ops.gated_delta_rule.triton.gate_prologue import activate
    x = dict(g=torch.randn(B, T, HV) * 4, beta=torch.randn(B, T, HV) * 2,
             A_log=torch.randn(HV) * 0.5 if gate else None, dt_bias=torch.randn(HV) if dt_bias else None)
    x["g"][0, 0, 0] = 40.0                       # softplus's linear range, where exp(x) alone would overflow in fp16
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
    with poisoned_allocations():
        g_eff, beta_eff = activate(**{n: leaves.get(n) for n in x}, beta_scale=beta_scale)
    ref = {n: t.detach().double().requires_grad_(True) for n, t in leaves.items()}
    g_ref, b_ref = _formula(ref["g"], ref["beta"], ref.get("A_log"), ref.get("dt_bias"), beta_scale)
    assert g_eff.dtype == beta_eff.dtype == torch.float32
    assert_close("g_eff", g_eff, g_ref, F32)
    assert_close("beta_eff", beta_eff, b_ref, F32)
    dg, db = torch.randn_like(g_eff), torch.randn_like(beta_eff)
    with poisoned_allocations():
        torch.autograd.backward([g_eff, beta_eff], [dg, db])
    torch.autograd.backward([g_ref, b_ref], [dg.double(), db.double()])
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype, n
        assert_close(f"d{n}", t.grad, ref[n].grad, F32)


@needs_triton
def test_chunk_fed_by_the_prologue_matches_the_in_kernel_options():
    """chunk_gated_delta_rule on activate()'s g and beta gives the in-kernel options' o, final state and gradients
    (raw g, beta logits, A_log, dt_bias included): the composition the gluon backend runs."""
    from linattn.ops.gated_delta_rule.triton.gate_prologue import activate
    x = make_gdn_inputs(1, 90, 1, 2, 16, 16, dtype=torch.float32)
    x["g"], x["beta"] = torch.randn(1, 90, 2) * 2, torch.randn(1, 90, 2)
    params = dict(A_log=torch.randn(2) * 0.5, dt_bias=torch.randn(2))
    cu = torch.tensor([0, 1, 60, 90])
    x["initial_state"] = torch.randn(3, 2, 16, 16) * 0.1

    def run(composed):
        leaves = {n: t.clone().requires_grad_(True) for n, t in {**x, **params}.items()}
        if composed:
            g, beta = activate(leaves["g"], leaves["beta"], leaves["A_log"], leaves["dt_bias"], 2)
            o, s = linattn.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], g, beta,
                                                  initial_state=leaves["initial_state"], output_final_state=True,
                                                  cu_seqlens=cu, backend="triton")
        else:
            o, s = linattn.chunk_gated_delta_rule(**{n: leaves[n] for n in x}, output_final_state=True,
                                                  cu_seqlens=cu, use_gate_in_kernel=True, A_log=leaves["A_log"],
                                                  dt_bias=leaves["dt_bias"], use_beta_sigmoid_in_kernel=True,
                                                  allow_neg_eigval=True, backend="triton")
        torch.manual_seed(5)
        ((o * torch.randn_like(o)).sum() + (s * torch.randn_like(s)).sum()).backward()
        return dict(o=o, final_state=s, **{f"d{n}": t.grad for n, t in leaves.items()})
    fused, composed = run(False), run(True)
    for n in fused:
        assert_close(n, composed[n], fused[n], F32)


@needs_triton
def test_traces_under_torch_compile_fullgraph():
    """The pass as a compiled model calls it (the gluon backend under torch.compile): fullgraph=True traces its custom
    op and fake (a graph break raises), and the compiled values and gradients equal the eager ones."""
    from linattn.ops.gated_delta_rule.triton.gate_prologue import activate
    x = dict(g=torch.randn(1, 20, 2) * 3, beta=torch.randn(1, 20, 2), A_log=torch.randn(2), dt_bias=torch.randn(2))

    def model(g, beta, A_log, dt_bias):
        g_eff, beta_eff = activate(g, beta, A_log, dt_bias, 1)
        return (g_eff * beta_eff).sum()

    grads = []
    for fn in (model, torch.compile(model, fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in x.values()]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(x, *grads):
        assert torch.equal(a, b), name
