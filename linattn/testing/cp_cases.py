"""Cases and checks of context-parallel chunk_gated_delta_rule / chunk_kda, shared by the CPU test
(tests/test_context_parallel.py: gloo under the Triton interpreter) and the multi-GPU gate
(linattn/distributed/multi_gpu.py: NCCL).

A case is one packed stream's inputs (on the CPU; each rank moves its slice to its device), the options of the
call and the cotangents of the loss. `rank_call` runs rank r's part of it; `one_process` the whole stream in one
call, or the fp64 reference; `compare` lines the ranks' results up against either and returns every error.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

import linattn
from linattn.distributed import build_cp_context
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.kda.reference import kda_gate, naive_recurrent_kda
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing.compare import rel_rms
from linattn.testing.inputs import make_gdn_inputs, random_cu_seqlens

NAMES = ("q", "k", "v", "g", "beta")


def _op(case):
    return linattn.chunk_kda if case["op"] == "kda" else linattn.chunk_gated_delta_rule


def make_case(lengths, world: int, dtype, with_h0: bool, final: bool, op: str = "gdn", fla_options: bool = False,
              dims: Tuple[int, int, int, int] = (1, 2, 16, 16)) -> dict:
    """One packed stream of sequences of `lengths` tokens; dims (H, HV, K, V). op "kda": g a log decay per key
    channel [1, T, HV, K], half of each head's channels near 1 and half down to e^-4 per token. fla_options: FLA's
    in-kernel gate (g its raw input, A_log and dt_bias parameters) and beta sigmoid with allow_neg_eigval (beta a
    logit), and states [N, HV, V, K] (state_v_first): how FLA's KDA layer calls chunk_kda."""
    H, HV, K, V = dims
    cu = random_cu_seqlens(lengths)
    T, N = int(cu[-1]), len(lengths)
    x = make_gdn_inputs(1, T, H, HV, K, V, dtype=dtype, num_states=N, initial_state=with_h0)
    if op == "kda":
        weak = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, K) + 4.0) * 2.0
        x["g"] = torch.where(torch.rand(1, 1, 1, K) < 0.5, weak, -4.0 * torch.rand(1, T, HV, K))
    opts, params, state = {}, {}, (N, HV, K, V)
    if fla_options:
        x["g"] = torch.randn_like(x["g"]) * 2
        x["beta"] = torch.randn_like(x["beta"]) * 2
        opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                    state_v_first=True)
        params = dict(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV * K if op == "kda" else HV))
        state = (N, HV, V, K)
        if with_h0:
            x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    return dict(**{n: x[n] for n in NAMES}, h0=x["initial_state"], cu=cu, final=final, op=op, opts=opts,
                params=params, do=torch.randn(1, T, HV, V), dfin=torch.randn(world, *state), K=K)


def rank_call(rank: int, case: dict, device="cpu", group=None) -> dict:
    """Rank r's part of the case on `device` (torch.distributed already initialised): o, the final states and every
    gradient of its slice, on the CPU. Outputs are NaN-poisoned before the kernels write them."""
    dev = torch.device(device)
    cu = case["cu"].to(dev)
    cp = build_cp_context(cu, group=group)
    P = cp.part_len
    sl = slice(rank * P, (rank + 1) * P)
    x = {n: case[n][:, sl].to(dev).clone().requires_grad_(True) for n in NAMES}
    h0 = case["h0"]
    if h0 is not None:
        h0 = h0.to(dev).clone().requires_grad_(True)
    params = {n: t.to(dev).clone().requires_grad_(True) for n, t in case["params"].items()}
    with poisoned_allocations():
        o, fin = _op(case)(**x, initial_state=h0, output_final_state=case["final"], cp_context=cp,
                           **case["opts"], **params)
        loss = (o.float() * case["do"][:, sl].to(dev)).sum()
        if case["final"]:
            loss = loss + (fin * case["dfin"][rank].to(dev)).sum()      # each rank's own gradient of the states
        loss.backward()

    def cpu(t):
        return None if t is None else t.detach().cpu()
    return dict(o=cpu(o), fin=cpu(fin), dh0=None if h0 is None else cpu(h0.grad),
                **{"d" + n: cpu(x[n].grad) for n in NAMES}, **{"d" + n: cpu(t.grad) for n, t in params.items()})


def one_process(case: dict, reference: bool, device="cpu"):
    """(o, final, grads) of the whole stream in one process on `device`: the fp64 reference or linattn's own call."""
    dev = torch.device(device)
    cast = (lambda t: t.detach().to(dev, torch.float64)) if reference else (lambda t: t.detach().to(dev).clone())
    x = {n: cast(case[n]).requires_grad_(True) for n in NAMES}
    h0 = None if case["h0"] is None else cast(case["h0"]).requires_grad_(True)
    params = {n: cast(t).requires_grad_(True) for n, t in case["params"].items()}
    cu = case["cu"].to(dev)
    if reference:
        ref = naive_recurrent_kda if case["op"] == "kda" else naive_recurrent
        g, beta, h0_kv = x["g"], x["beta"], h0
        if params:                      # FLA's options written out: the gate, 2 sigmoid(beta), [N, HV, V, K] states
            if case["op"] == "kda":
                g = kda_gate(g, params["A_log"], params["dt_bias"])
            else:
                g = -params["A_log"].exp() * torch.nn.functional.softplus(g + params["dt_bias"])
            beta = 2 * torch.sigmoid(beta)
            h0_kv = None if h0 is None else h0.transpose(-1, -2)
        o, fin = ref(x["q"], x["k"], x["v"], g, beta, case["K"] ** -0.5, h0_kv, True, cu)
        if params:
            fin = fin.transpose(-1, -2)
    else:
        o, fin = _op(case)(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu, **case["opts"], **params)
    loss = (o.double() * case["do"].to(dev).double()).sum()
    if case["final"]:
        loss = loss + (fin.double() * case["dfin"].to(dev).double().sum(0)).sum()
    loss.backward()
    grads = {"d" + n: x[n].grad for n in NAMES}
    grads["dh0"] = None if h0 is None else h0.grad
    grads.update({"d" + n: t.grad for n, t in params.items()})
    return o, fin, grads


def compare(case: dict, ranks: List[dict], expected, world: int, params_too: bool) -> Dict[str, float]:
    """Relative RMS errors of the ranks' results against expected = one_process(...): each rank's o (and the final
    states, returned on every rank), the gradients of q, k, v, g, beta concatenated over ranks, the initial state's
    and (params_too) A_log's / dt_bias's summed over ranks. A rank that returned final states the case did not ask
    for, or a gradient of another dtype than its input, is an error (inf)."""
    o, fin, grads = expected
    P = int(case["cu"][-1]) // world
    errs = {}
    for r in range(world):
        errs[f"rank {r} o"] = rel_rms(ranks[r]["o"], o[:, r * P:(r + 1) * P])
        if case["final"]:
            errs[f"rank {r} final states"] = rel_rms(ranks[r]["fin"], fin)
        elif ranks[r]["fin"] is not None:
            errs[f"rank {r} final states (not asked for)"] = float("inf")
    for n in NAMES:
        got = torch.cat([ranks[r]["d" + n] for r in range(world)], dim=1)
        errs["d" + n] = rel_rms(got, grads["d" + n]) if got.dtype == case[n].dtype else float("inf")
    if case["h0"] is not None:
        errs["d initial_state (summed over ranks)"] = rel_rms(sum(rk["dh0"] for rk in ranks), grads["dh0"])
    if params_too:
        for n in case["params"]:
            errs[f"d{n} (summed over ranks)"] = rel_rms(sum(rk["d" + n] for rk in ranks), grads["d" + n])
    return errs


def failures(errs: Dict[str, float], tol: float, against: str) -> List[str]:
    """The errors above tol, as messages."""
    return [f"{name} vs {against}: relative RMS error {e:.3e} exceeds {tol:.1e}" for name, e in errs.items()
            if not e <= tol]


def expected(case: dict, same_call: bool, device="cpu") -> dict:
    """{against: one_process(...)}: the fp64 reference, and with same_call the one-process call too. Computed before
    the ranks run where they are forked from this process: the kernels are then compiled (or, under the interpreter,
    started up) once, not once per rank."""
    out = {"reference": one_process(case, reference=True, device=device)}
    if same_call:
        out["one-process call"] = one_process(case, reference=False, device=device)
    return out


def check(case: dict, ranks: List[dict], world: int, same_call_tol: Optional[float], device="cpu",
          exp: Optional[dict] = None) -> dict:
    """Every error of the ranks against the fp64 reference (the dtype's tolerance) and, where same_call_tol is
    given, against the one-process call (exp: expected(...) if computed already). A parameter's gradient (each
    rank's from its tokens, summed over ranks) is checked against fp64 only: it sums every token's terms, of both
    signs, and the one-process call adds the same terms in another order, so their difference is the sum's
    cancellation (measured up to 4e-5 of its norm over 11 draws, and unbounded where a head's sum is near zero), not
    a bound same_call_tol can hold. Returns dict(errors={against: {name: err}}, failures=[messages])."""
    from linattn.testing.compare import TOL
    exp = exp if exp is not None else expected(case, same_call_tol is not None, device)
    out = dict(errors={}, failures=[])
    for against, result in exp.items():
        ref = against == "reference"
        tol = TOL[case["q"].dtype] if ref else same_call_tol
        errs = compare(case, ranks, result, world, params_too=ref)
        out["errors"][against] = errs
        out["failures"] += failures(errs, tol, against)
    return out
