"""FLA 0.6's in-kernel options of chunk_gated_delta_rule on the Triton path (CPU under TRITON_INTERPRET=1, or the GPU
when present): use_gate_in_kernel (g the raw gate input, the decay -exp(A_log) * softplus(g + dt_bias)),
use_beta_sigmoid_in_kernel (beta a logit, sigmoid(beta), 2 * sigmoid(beta) with allow_neg_eigval) and state_v_first
(initial and final states [N, HV, V, K]), alone and combined.

Every case compares o, the final state and every gradient (q, k, v, the raw g, the beta logits, A_log, dt_bias,
initial_state) with autograd through the fp64 reference that applies the same functions in PyTorch
(reference.chunk_gated_delta_rule: fla_gates, then the chunk form), by relative RMS error at linattn.testing.TOL.
Fresh random inputs, every kernel buffer NaN-poisoned (runtime.alloc.poisoned_allocations), varlen with uneven
lengths and a 1-token sequence, GVA, T not a multiple of 64, bf16 and fp32.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.gated_delta_rule.reference import chunk_gated_delta_rule as reference
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.settings import settings
from linattn.testing import TOL, make_gdn_inputs, random_cu_seqlens, rel_rms

needs_interpreter = pytest.mark.skipif(not settings.interpret and not torch.cuda.is_available(),
                                       reason="the Triton path on the CPU needs TRITON_INTERPRET=1")


def _inputs(B, T, H, HV, K, V, *, dtype, lengths, gate, dt_bias, beta_scale, v_first, h0, gate_dtype, gen):
    """The op's keyword arguments (leaves requiring grad) and the reference's fp64 copies of them."""
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, gate_dtype=gate_dtype, initial_state=h0,
                        num_states=None if lengths is None else len(lengths), generator=gen)
    if gate:
        # raw gate input and Qwen3-Next-like parameters: decays of about -0.05 to -0.5 per token
        x["g"] = torch.randn(B, T, HV, generator=gen).to(gate_dtype)
        x["A_log"] = torch.randn(HV, generator=gen) * 0.5
        if dt_bias:
            x["dt_bias"] = torch.randn(HV, generator=gen) * 0.5 - 1.5
    if beta_scale:
        x["beta"] = (torch.randn(B, T, HV, generator=gen) * 2.0).to(gate_dtype)      # logits
    if v_first and h0:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    x = {n: t for n, t in x.items() if t is not None}
    for t in x.values():
        t.requires_grad_(True)
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    return x, ref


def _check(B, T, H, HV, K, V, *, dtype, lengths=None, gate=False, dt_bias=True, beta_scale=0, v_first=False,
           h0=True, gate_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + torch.randint(0, 2 ** 30, ()).item())
    cu = random_cu_seqlens(lengths) if lengths is not None else None
    x, ref = _inputs(B, T, H, HV, K, V, dtype=dtype, lengths=lengths, gate=gate, dt_bias=dt_bias,
                     beta_scale=beta_scale, v_first=v_first, h0=h0, gate_dtype=gate_dtype, gen=gen)
    o_ref, ht_ref = reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref.get("initial_state"),
                              True, cu, A_log=ref.get("A_log"), dt_bias=ref.get("dt_bias"), beta_scale=beta_scale,
                              state_v_first=v_first)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()

    fla = dict(use_gate_in_kernel=gate, A_log=x.get("A_log"), dt_bias=x.get("dt_bias"),
               use_beta_sigmoid_in_kernel=beta_scale > 0, allow_neg_eigval=beta_scale == 2, state_v_first=v_first)
    with poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                               initial_state=x.get("initial_state"), output_final_state=True,
                                               cu_seqlens=cu, backend="triton", **fla)
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])

    N = B if lengths is None else len(lengths)
    assert ht.shape == ((N, HV, V, K) if v_first else (N, HV, K, V)) and ht.dtype == torch.float32
    errs = {"o": rel_rms(o, o_ref), "final_state": rel_rms(ht, ht_ref)}
    for name, t in x.items():
        assert t.grad is not None, f"d{name} missing"
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype, (name, t.grad.shape, t.grad.dtype)
        assert ref[name].grad.norm() > 0, f"d{name}: the reference gradient is zero, the case checks nothing"
        errs["d" + name] = rel_rms(t.grad, ref[name].grad)
    if gate:
        # dA_log and dt_bias are sums over every token of per-token terms of both signs: the relative error of such a
        # sum grows with its cancellation, not with the kernel's error (terms of relative error e add to an error of
        # about e * ||terms||). Their errors are taken relative to max(||reference||, ||terms||); the terms are
        # d(loss)/dx per token for dt_bias (x = g + dt_bias: the raw gate's gradient) and that times
        # softplus(x) / sigmoid(x) for A_log (dg/dA_log = g = -exp(A_log) softplus(x)).
        xg = ref["g"].detach() + (ref["dt_bias"].detach() if "dt_bias" in ref else 0.0)
        terms = {"A_log": ref["g"].grad * F.softplus(xg) / torch.sigmoid(xg), "dt_bias": ref["g"].grad}
        for name, tt in terms.items():
            if name in x:
                diff = (x[name].grad.double() - ref[name].grad).norm().item()
                errs["d" + name] = diff / max(ref[name].grad.norm().item(), tt.norm().item())
    for name, err in errs.items():
        t = x.get(name[1:])
        tol = TOL[dtype]
        if t is not None and t.dtype in (torch.bfloat16, torch.float16):
            tol = max(tol, TOL[t.dtype])             # a gradient rounded to its input's 16-bit dtype
        assert math.isfinite(err) and err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e} (all: {errs})"
    return errs


CASES = [
    # B, T, H, HV, K, V, options
    pytest.param(1, 150, 1, 2, 16, 16, dict(dtype=torch.float32, gate=True, lengths=[70, 1, 79]),
                 id="gate-dtbias-varlen-gva-fp32"),
    pytest.param(2, 100, 2, 2, 32, 16, dict(dtype=torch.bfloat16, gate=True, dt_bias=False, gate_dtype=torch.bfloat16),
                 id="gate-nobias-T100-bf16-bf16gates"),
    pytest.param(1, 130, 1, 2, 16, 32, dict(dtype=torch.bfloat16, beta_scale=1, lengths=[1, 64, 65]),
                 id="beta-sigmoid-varlen-gva-bf16"),
    pytest.param(2, 65, 1, 1, 32, 32, dict(dtype=torch.float32, beta_scale=2), id="beta-neg-eigval-T65-fp32"),
    pytest.param(1, 120, 1, 2, 16, 32, dict(dtype=torch.float32, v_first=True, lengths=[50, 1, 69]),
                 id="state-v-first-varlen-gva-fp32"),
    pytest.param(2, 70, 1, 1, 32, 16, dict(dtype=torch.bfloat16, v_first=True), id="state-v-first-T70-bf16"),
    pytest.param(1, 140, 1, 2, 32, 16, dict(dtype=torch.float32, gate=True, beta_scale=2, v_first=True,
                                            lengths=[1, 73, 66]), id="all-varlen-gva-fp32"),
    pytest.param(1, 131, 2, 4, 16, 16, dict(dtype=torch.bfloat16, gate=True, beta_scale=1, v_first=True,
                                            lengths=[64, 1, 66]), id="all-varlen-gva-bf16"),
    pytest.param(1, 90, 1, 2, 16, 16, dict(dtype=torch.float32, gate=True, beta_scale=1, v_first=True, h0=False),
                 id="all-no-initial-state-fp32"),
]


@needs_interpreter
@pytest.mark.parametrize("B,T,H,HV,K,V,opts", CASES)
def test_fla_options_match_fp64_reference(B, T, H, HV, K, V, opts):
    _check(B, T, H, HV, K, V, **opts)


@needs_interpreter
def test_gate_and_beta_options_are_the_explicit_functions():
    """The in-kernel gate and sigmoid give what the default path gives on the activated inputs (the same kernels on
    g_eff and sigmoid(beta) computed outside), and state_v_first is the transposed layout of the same states."""
    x = make_gdn_inputs(1, 100, 1, 2, 16, 16, dtype=torch.float32, num_states=2)
    cu = torch.tensor([0, 37, 100])
    raw_g, logits = torch.randn(1, 100, 2), torch.randn(1, 100, 2) * 2
    A_log, dt_bias = torch.randn(2) * 0.5, torch.randn(2) - 1.5
    o, ht = linattn.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], raw_g, logits, initial_state=x["initial_state"].transpose(-1, -2),
        output_final_state=True, cu_seqlens=cu, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True, state_v_first=True, backend="triton")
    g_eff = -torch.exp(A_log) * torch.nn.functional.softplus(raw_g + dt_bias)
    o0, ht0 = linattn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g_eff, torch.sigmoid(logits),
                                             initial_state=x["initial_state"], output_final_state=True,
                                             cu_seqlens=cu, backend="triton")
    assert rel_rms(o, o0) <= 1e-5 and rel_rms(ht, ht0.transpose(-1, -2)) <= 1e-5


def test_fake_shapes_follow_state_v_first():
    """The custom op's fake implementation (torch.compile's view of it): the final state [N, HV, V, K]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(1, 10, 1, 16)
        v = torch.empty(1, 10, 2, 32)
        g = torch.empty(1, 10, 2)
        o, ht = torch.ops.linattn.chunk_gdn_fwd(q, q, v, g, g, 0.25, torch.empty(2, 2, 32, 16), True,
                                                torch.empty(3, dtype=torch.int64), torch.empty(2), None, 1, True)
        assert tuple(o.shape) == (1, 10, 2, 32) and tuple(ht.shape) == (2, 2, 32, 16)


@pytest.mark.parametrize("kw,match", [
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), "A_log must have HV=2 elements"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2, 2)), "dt_bias must have HV=2"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2, dtype=torch.int32)), "A_log must be a float tensor"),
    (dict(state_v_first=True, initial_state=torch.zeros(1, 2, 16, 32)), r"initial_state must be \[N, HV, V, K\]"),
])
def test_option_argument_errors(kw, match):
    x = make_gdn_inputs(1, 10, 1, 2, 16, 32, dtype=torch.float32)
    x.update({n: kw.pop(n) for n in ("initial_state",) if n in kw})
    with pytest.raises(ValueError, match=match):
        linattn.chunk_gated_delta_rule(**x, **kw)


def test_gluon_declines_state_v_first_with_a_reason_and_takes_the_gate():
    """The Gluon kernels store [N, HV, K, V] states, so state_v_first is declined by name; the gate and beta sigmoid
    run as gate_prologue's pass before them, so those are not a reason (here the CPU is)."""
    from linattn.ops.gated_delta_rule.gluon.backend import supports
    q, v = torch.empty(1, 64, 1, 128), torch.empty(1, 64, 2, 128)
    ok, reason = supports(q=q, v=v, state_v_first=True)
    assert not ok and "state_v_first" in reason and "Triton path only" in reason, reason
    for name in ("use_gate_in_kernel", "beta_sigmoid"):
        ok, reason = supports(q=q, v=v, **{name: True})
        assert name not in reason and "Triton path only" not in reason, (name, reason)


@needs_interpreter
def test_torch_compile_fullgraph_with_every_option():
    """A model calling the op with every option, compiled with fullgraph=True (a graph break raises), forward and
    backward against the fp64 reference."""
    x, ref = _inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32, lengths=None, gate=True, dt_bias=True, beta_scale=2,
                     v_first=True, h0=True, gate_dtype=torch.float32, gen=torch.Generator().manual_seed(3))

    def model(q, k, v, g, beta, initial_state, A_log, dt_bias):
        o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                               use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                               use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                               state_v_first=True, backend="triton")
        return o.square().sum() + ht.square().sum()

    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    loss = torch.compile(model, fullgraph=True)(*(x[n] for n in names))
    loss.backward()
    o, ht = reference(*(ref[n] for n in names[:5]), None, ref["initial_state"], True, None, A_log=ref["A_log"],
                      dt_bias=ref["dt_bias"], beta_scale=2, state_v_first=True)
    ref_loss = o.square().sum() + ht.square().sum()
    ref_loss.backward()
    assert rel_rms(loss, ref_loss) <= TOL[torch.float32]
    for n in names:
        err = rel_rms(x[n].grad, ref[n].grad)
        assert err <= TOL[torch.float32], f"d{n}: {err:.3e}"
