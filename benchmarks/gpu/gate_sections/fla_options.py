"""Gate section fla_options: FLA's in-kernel options of the GDN ops at GPU sizes against the fp64 reference on the GPU.

chunk_gated_delta_rule with use_gate_in_kernel (A_log, dt_bias), use_beta_sigmoid_in_kernel (and allow_neg_eigval)
and state_v_first, alone and combined: forward + backward on NaN-poisoned buffers, o, the final state and every
gradient (the raw gate input, the beta logits, A_log, dt_bias, initial_state in its layout) against autograd through
reference.chunk_gated_delta_rule in fp64, for backend "auto" and "triton" (auto runs Gluon with the gate
prologue where it takes the call, Triton with state_v_first).
fused_recurrent_gated_delta_rule (backend auto) with state_v_first pools and vLLM's speculative decoding (2-D
state_indices, num_accepted_tokens, pad_slot_id=0), the fused gate and beta sigmoid, against
fused_recurrent_reference in fp64. Inputs are fresh random draws; each case records its seed.
"""
from __future__ import annotations

import os

import torch
from common import case_runner

from gate_sections import base
from gate_sections.decode import serving_case

LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def chunk_cases():
    """(name, options): B, T (or lengths), H, HV, K, V, dtype, gate, beta (0: post-sigmoid beta; 1: sigmoid in the
    kernel; 2: with allow_neg_eigval), v_first, h0."""
    BF, F32 = torch.bfloat16, torch.float32
    if base.DRY:
        small = dict(H=1, HV=2, K=32, V=32)
        return [("gate varlen 1-token fp32", dict(small, lengths=[1, 40, 1, 30], dtype=F32, gate=True)),
                ("beta neg eigval + state_v_first T70 bf16", dict(small, B=1, T=70, dtype=BF, beta=2, v_first=True))]
    big, mid = dict(H=16, HV=32, K=128, V=128), dict(H=4, HV=8, K=128, V=128)
    lens = [1, 4096, 1, 63, 65, 1000, 1]
    return [(f"gate A_log dt_bias varlen {len(lens)} seqs H16/HV32 bf16", dict(big, lengths=lens, dtype=BF, gate=True)),
            ("beta sigmoid B2 T1000 H4/HV8 bf16", dict(mid, B=2, T=1000, dtype=BF, beta=1)),
            ("beta sigmoid neg eigval B2 T1000 H4/HV8 fp32", dict(mid, B=2, T=1000, dtype=F32, beta=2)),
            ("state_v_first B2 T1000 H4/HV8 bf16", dict(mid, B=2, T=1000, dtype=BF, v_first=True)),
            ("all options varlen 1-token H4/HV8 fp32", dict(mid, lengths=[1, 700, 65, 1], dtype=F32, gate=True,
                                                             beta=2, v_first=True)),
            ("all options no h0 B1 T8192 H16/HV32 bf16", dict(big, B=1, T=8192, dtype=BF, gate=True, beta=1,
                                                               v_first=True, h0=False)),
            # auto takes the Gluon forward here, with the gate and beta sigmoid as gate_prologue's pass
            ("gate + beta sigmoid B1 T8192 H16/HV32 bf16", dict(big, B=1, T=8192, dtype=BF, gate=True, beta=1))]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def chunk_inputs(H, HV, K, V, B=1, T=None, lengths=None, dtype=torch.bfloat16, gate=False, beta=0, v_first=False,
                 h0=True, seed=0):
    """The op's leaves (on the device, requiring grad) and FLA options. With the gate: g the raw gate input, A_log
    and dt_bias Qwen3-Next-like (decays of about -0.05 to -0.5 per token); with the beta sigmoid, beta logits."""
    from linattn.testing import make_gdn_inputs, random_cu_seqlens
    if lengths:
        B, T = 1, sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, initial_state=h0,
                        num_states=len(lengths) if lengths else None, generator=gen)
    if gate:
        x.update(g=torch.randn(B, T, HV, generator=gen), A_log=torch.randn(HV, generator=gen) * 0.5,
                 dt_bias=torch.randn(HV, generator=gen) * 0.5 - 1.5)
    if beta:
        x["beta"] = torch.randn(B, T, HV, generator=gen) * 2.0
    if v_first and h0:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    leaves = {n: t.to(base.DEV).requires_grad_() for n, t in x.items() if t is not None}
    opts = dict(use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=beta > 0, allow_neg_eigval=beta == 2,
                state_v_first=v_first,
                cu_seqlens=random_cu_seqlens(lengths, device=base.DEV) if lengths else None)
    return leaves, opts


def reference_grads(leaves, opts, seed):
    """o, the final state and every gradient by autograd through the fp64 reference (FLA's gate and beta sigmoid as
    plain functions, then the chunk form), and the random upstream gradients do, dht."""
    from linattn.ops.gated_delta_rule.reference import chunk_gated_delta_rule as reference
    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    beta_scale = (2 if opts["allow_neg_eigval"] else 1) if opts["use_beta_sigmoid_in_kernel"] else 0
    o, ht = reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref.get("initial_state"), True,
                      opts["cu_seqlens"], A_log=ref.get("A_log"), dt_bias=ref.get("dt_bias"), beta_scale=beta_scale,
                      state_v_first=opts["state_v_first"])
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, device=o.device, dtype=torch.float64)
    torch.autograd.backward([o, ht], [do, dht])
    out = {"o": o.detach(), "final_state": ht.detach()}
    out.update({n: ref[n].grad for n in LEAVES if n in ref})
    return out, do, dht


def chunk_case(leaves, opts, ref, do, dht, backend):
    """chunk_gated_delta_rule(backend=...) forward + backward on NaN-poisoned buffers against the fp64 gradients."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    for t in leaves.values():
        t.grad = None
    kw = {n: leaves[n] for n in ("A_log", "dt_bias") if n in leaves}
    with poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                               initial_state=leaves.get("initial_state"), output_final_state=True,
                                               backend=backend, **opts, **kw)
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    base.sync()
    got = {"o": o.detach(), "final_state": ht.detach()}
    got.update({n: leaves[n].grad for n in LEAVES if n in leaves})
    errs, ok = base.errors(got, ref, leaves["q"].dtype)
    return dict(backend=backend, errors=errs, passed=ok)


# ------------------------------------------------------------------------------------------------------ decode

def _decode_reference(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, **kw):
    """fused_recurrent_gated_delta_rule's call in plain PyTorch (the fused gate follows from A_log)."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
    return fused_recurrent_reference(beta_sigmoid=use_beta_sigmoid_in_kernel, **kw)


def decode_case(B, H, HV, K, V, T=1, state_dtype=torch.float32, v_first=False, spec=False, gate=False):
    """One serving call of fused_recurrent_gated_delta_rule (serving_case), backend auto."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
    from linattn.testing import make_gdn_inputs
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, initial_state=False, generator=gen)
    del x["initial_state"]
    opts = {}
    if gate:
        x.update(g=torch.randn(B, T, HV, generator=gen) * 3, beta=torch.randn(B, T, HV, generator=gen) * 2)
        opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                    A_log=(torch.rand(HV, generator=gen) * 2 - 1).to(base.DEV),
                    dt_bias=torch.randn(HV, generator=gen).to(base.DEV))
    x = {n: t.to(base.DEV) for n, t in x.items()}
    res = serving_case(fused_recurrent_gated_delta_rule, _decode_reference, x, HV, K, V, state_dtype,
                       state_v_first=v_first, spec=spec, **opts)
    return dict(res, seed=seed)


def decode_cases():
    """(name, kwargs) of decode_case."""
    dims = dict(H=1, HV=2, K=32, V=32) if base.DRY else dict(H=16, HV=32, K=128, V=128)
    B = 3 if base.DRY else 32
    F32, BF = torch.float32, torch.bfloat16
    return [(f"decode state_v_first pool fp32 B={B}", dict(dims, B=B, state_dtype=F32, v_first=True)),
            (f"decode state_v_first pool bf16 B={B}", dict(dims, B=B, state_dtype=BF, v_first=True)),
            (f"decode spec T=4 fp32 pool B={B}", dict(dims, B=B, T=4, state_dtype=F32, spec=True)),
            (f"decode spec T=4 state_v_first bf16 pool gate + beta sigmoid B={B}",
             dict(dims, B=B, T=4, state_dtype=BF, v_first=True, spec=True, gate=True))]


def _backends():
    return ("triton",) if base.DRY else ("auto", "triton")


def case_names():
    names = []
    for name, _ in chunk_cases():
        names += [f"chunk {name} fp64 reference"] + [f"chunk {name} {b}" for b in _backends()]
    return names + [n for n, _ in decode_cases()]


def section(save):
    """Each chunk case's fp64 reference once (a case of its own, so that a failure there is on record), checked
    against each backend; then the decode cases."""
    cases = []
    run = case_runner(cases)
    for name, kw in chunk_cases():
        prepared = {}

        def reference(kw=kw):
            seed = _seed()
            prepared["leaves"], prepared["opts"] = chunk_inputs(**kw, seed=seed)
            prepared["ref"], prepared["do"], prepared["dht"] = reference_grads(prepared["leaves"], prepared["opts"],
                                                                               seed + 1)
            return dict(seed=seed, passed=True)
        run(f"chunk {name} fp64 reference", reference)
        for b in _backends():
            if "ref" in prepared:
                p = prepared
                run(f"chunk {name} {b}", chunk_case, p["leaves"], p["opts"], p["ref"], p["do"], p["dht"], b)
            save(dict(cases=cases, incomplete=True))
        prepared.clear()
        base.free()
    for name, kw in decode_cases():
        run(name, decode_case, **kw)
        save(dict(cases=cases, incomplete=True))
    return dict(cases=cases, reference="autograd through reference.chunk_gated_delta_rule in fp64 on the same device; "
                                       "decode: fused_recurrent_reference in fp64")
