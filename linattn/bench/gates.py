"""Correctness gates: per op, a case matrix run for one backend against an fp64 reference. `linattn verify`
runs the gate first and reports no speed unless every case passes.

Each case draws fresh random inputs (seed recorded), calls the backend once, poisons those outputs with NaN
and frees them, then calls again: the second call's outputs land in recycled, poisoned memory, so an
element the op never writes shows up as NaN (rel_rms gives inf) instead of a stale right answer.
"""
from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch

from linattn.testing import TOL, make_gdn_inputs, poison_, random_cu_seqlens, rel_rms


@dataclass
class CaseResult:
    name: str
    ok: bool
    errors: Dict[str, float] = field(default_factory=dict)
    tol: float = 0.0
    seed: int = 0
    detail: str = ""


def _gdn_cases(tiny: bool) -> List[Dict]:
    """T in {1, C-1, C, C+1, several chunks, long}, varlen with 1-token sequences, GVA and plain heads, with
    and without states, each dtype, in-kernel L2 norm, two head sizes. `tiny`: interpreter sizes."""
    K = 32 if tiny else 128
    H, HV = (1, 2) if tiny else (4, 8)
    Ts = (1, 63, 64, 65, 130) if tiny else (1, 63, 64, 65, 200, 4096)
    bf, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = [dict(T=T, H=H, HV=HV, K=K, V=K, dtype=bf) for T in Ts]
    cases += [dict(T=65, H=H, HV=HV, K=K, V=K, dtype=dt) for dt in (fp16, fp32)]
    cases.append(dict(T=65, H=H, HV=HV, K=K, V=K, dtype=bf, states=False))
    cases.append(dict(T=64, H=HV, HV=HV, K=K, V=K, dtype=bf))                        # no GVA
    cases.append(dict(T=65, H=H, HV=HV, K=K, V=K, dtype=bf, l2norm=True))
    cases.append(dict(lengths=[1, 40, 1, 70] if tiny else [1, 63, 1, 200, 64, 1, 130], H=H, HV=HV, K=K, V=K, dtype=bf))
    if not tiny:
        cases.append(dict(T=200, H=H, HV=HV, K=64, V=64, dtype=bf))
        cases.append(dict(lengths=[1, 63, 1, 200, 64, 1, 130], H=H, HV=HV, K=K, V=K, dtype=fp16))
    return cases


def _case_name(c: Dict) -> str:
    shape = f"varlen{c['lengths']}" if c.get("lengths") else f"T={c['T']}"
    extra = ("" if c.get("states", True) else " no-states") + (" l2norm" if c.get("l2norm") else "")
    return f"{shape} H={c['H']} HV={c['HV']} K={c['K']} {str(c['dtype']).replace('torch.', '')}{extra}"


def _gdn_case(fn: Callable, c: Dict, device, modes, seed: int) -> CaseResult:
    from linattn.ops.gated_delta_rule.reference import chunk_reference, naive_recurrent
    name, tol = _case_name(c), TOL[c["dtype"]]
    lengths = c.get("lengths")
    T = sum(lengths) if lengths else c["T"]
    states = c.get("states", True)
    gen = torch.Generator().manual_seed(seed)
    inp = make_gdn_inputs(1, T, c["H"], c["HV"], c["K"], c["V"], dtype=c["dtype"], device=device, generator=gen,
                          num_states=len(lengths) if lengths else None, initial_state=states,
                          normalize_k=not c.get("l2norm"))
    cu = random_cu_seqlens(lengths, device=device) if lengths else None
    kw = dict(scale=None, output_final_state=states, cu_seqlens=cu, use_qk_l2norm_in_kernel=bool(c.get("l2norm")))
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp[n] is not None]
    x64 = {n: inp[n].detach().to(torch.float64).requires_grad_("fwdbwd" in modes) for n in names}
    ref_fn = naive_recurrent if T <= 256 else chunk_reference
    with torch.no_grad():
        o_ref, s_ref = ref_fn(**{n: x64[n].detach() for n in names}, **kw)
    errors: Dict[str, float] = {}
    try:
        def call(**extra):
            args = {n: inp[n] if not extra.get("grad") else inp[n].detach().requires_grad_(True) for n in names}
            o, s = fn(**args, **kw)
            return args, o, s
        _, o, s = call()                     # first call: outputs poisoned and freed, see the module doc
        for t in (o, s):
            if t is not None:
                poison_(t.detach())
        del o, s
        _, o, s = call()
        errors["o"] = rel_rms(o, o_ref)
        if states:
            errors["final_state"] = rel_rms(s, s_ref) if s is not None else float("inf")
        if "fwdbwd" in modes:
            gen_b = torch.Generator().manual_seed(seed + 1)
            do = torch.randn(o.shape, generator=gen_b).to(device, o.dtype)
            ds = torch.randn(s_ref.shape, generator=gen_b).to(device) if states else None
            args, o2, s2 = call(grad=True)
            outs, gouts = [o2], [do]
            if states:
                outs.append(s2)
                gouts.append(ds)
            grads = torch.autograd.grad(outs, [args[n] for n in names], gouts, allow_unused=True)
            o64, s64 = chunk_reference(**x64, **kw)
            r_outs, r_gouts = [o64], [do.to(torch.float64)]
            if states:
                r_outs.append(s64)
                r_gouts.append(ds.to(torch.float64))
            rgrads = torch.autograd.grad(r_outs, [x64[n] for n in names], r_gouts)
            for n, g, rg in zip(names, grads, rgrads):
                errors["d" + ("h0" if n == "initial_state" else n)] = rel_rms(g, rg) if g is not None else float("inf")
    except Exception as e:
        tb = traceback.format_exc(limit=3).strip().splitlines()[-1]
        return CaseResult(name, False, errors, tol, seed, f"{type(e).__name__}: {str(e)[:200]} ({tb[:160]})")
    ok = all(err <= tol for err in errors.values())
    bad = {k: v for k, v in errors.items() if not v <= tol}
    return CaseResult(name, ok, errors, tol, seed, "" if ok else f"over tolerance: {bad}")


def gated_delta_rule_gate(backend: str, device, tiny: bool = False, modes=("fwd", "fwdbwd")) -> List[CaseResult]:
    """The GDN gate: every case of `_gdn_cases` for `backend` against the fp64 reference (forward: the
    step-by-step recurrence up to T=256, the chunk form beyond; gradients: autograd through the fp64 chunk
    form). Tolerances: linattn.testing.TOL for the operand dtype, for outputs and gradients alike."""
    from linattn.bench.ops import Unavailable, linattn_gdn_callable
    try:
        fn, _ = linattn_gdn_callable(backend)
    except Unavailable as e:
        return [CaseResult("backend available", False, detail=str(e))]
    rng = random.Random()                    # fresh inputs every run; each case's seed is in its result
    return [_gdn_case(fn, c, device, modes, rng.randrange(1 << 30)) for c in _gdn_cases(tiny)]


GATES: Dict[str, Callable[..., List[CaseResult]]] = {"gated_delta_rule": gated_delta_rule_gate}
GATES["chunk_gated_delta_rule"] = gated_delta_rule_gate


def get_gate(op: str) -> Callable[..., List[CaseResult]]:
    if op not in GATES:
        raise KeyError(f"no gate for op {op!r}; known: {sorted(GATES)}")
    return GATES[op]
