"""Gate section kda: Kimi Delta Attention at GPU sizes against the fp64 token-by-token reference
(linattn/ops/kda/reference.py) on the GPU.

chunk_kda: forward + backward on NaN-poisoned buffers; o, the final state and every gradient (q, k, v, g, beta,
initial_state) against autograd through naive_recurrent_kda in fp64, random upstream gradients on o and the final
state; with the gate in the kernel, A_log / dt_bias against the fp64 chain rule of the kernel's own dg (their error
against fp64 end to end is recorded: see gate_param_chain). fused_recurrent_kda: serving calls on state pools (fp32 and
bf16, padded rows, speculative decoding, the gate in the kernel, state_v_first) against fused_recurrent_reference
in fp64. Then, on the GPU only, the sync-free checks: no synchronising call in a varlen forward + backward and a
decode step (sync debug mode "error"), and a CUDA graph of chunk_kda's forward + backward replayed on new data
equal to eager. Inputs are fresh random draws; each case records its seed.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from common import case_runner

from gate_sections import base
from gate_sections.decode import serving_case

KDA_GRADS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
BACKENDS = ("triton", "gluon")          # the sync-free and CUDA-graph cases run once per backend


def _dims():
    """(H, HV, K, V, B, T) of the dense chunk cases and the decode batches."""
    if base.DRY:
        return dict(H=1, HV=2, K=16, V=16, B=1, T=70, batches=(1, 3))
    return dict(H=4, HV=8, K=128, V=128, B=2, T=1000, batches=(1, 32, 256))


def chunk_cases():
    """(name, options): B, T (or lengths), dtype, gate ("" / "softplus" / "lower_bound"), l2, h0, v_first."""
    d = _dims()
    B, T = d["B"], d["T"]
    BF, F32 = torch.bfloat16, torch.float32
    if base.DRY:
        lens = [1, 40, 1, 30]
        return [(f"B{B} T{T} bf16", dict(B=B, T=T, dtype=BF)),
                ("varlen 1-token l2norm v_first fp32", dict(lengths=lens, dtype=F32, l2=True, v_first=True)),
                ("gate softplus + beta sigmoid neg eigval fp32", dict(B=B, T=T, dtype=F32, gate="softplus"))]
    lens = [1, 700, 1, 63, 65, 170, 1]
    return [(f"B{B} T{T} bf16", dict(B=B, T=T, dtype=BF)),
            ("B2 T1 bf16", dict(B=2, T=1, dtype=BF)),
            (f"varlen {len(lens)} seqs 1-token l2norm bf16", dict(lengths=lens, dtype=BF, l2=True)),
            (f"B{B} T{T} gate softplus + beta sigmoid neg eigval bf16", dict(B=B, T=T, dtype=BF, gate="softplus")),
            ("B1 T333 gate lower_bound (safe_gate) no h0 fp32", dict(B=1, T=333, dtype=F32, gate="lower_bound",
                                                                     h0=False)),
            ("varlen state_v_first fp32", dict(lengths=[1, 129, 64, 1, 300], dtype=F32, v_first=True))]


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def chunk_inputs(B=1, T=None, lengths=None, dtype=torch.bfloat16, gate="", l2=False, h0=True, v_first=False,
                 seed=0, g_scale=1.0, heads=None):
    """The op's leaves (on the device, requiring grad) and call options. g: with the gate in the kernel, its raw input
    and FLA's parameters (A_log [HV], dt_bias [HV * K]), beta a logit; else a log decay per channel, half of a head's
    channels weak (e^-0.04 per step) and half strong (down to e^-8), times g_scale, beta in (0, 1). heads: (H, HV)
    instead of _dims()'s."""
    d = _dims()
    H, HV, K, V = d["H"], d["HV"], d["K"], d["V"]
    if heads is not None:
        H, HV = heads
    if lengths:
        B, T = 1, sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    k = rnd(B, T, H, K)
    x = dict(q=rnd(B, T, H, K), k=k if l2 else F.normalize(k, dim=-1), v=rnd(B, T, HV, V))
    if gate:
        x.update(g=rnd(B, T, HV, K) * 2, beta=rnd(B, T, HV) * 2, A_log=rnd(HV) * 0.5, dt_bias=rnd(HV * K))
    else:
        weak = F.logsigmoid(rnd(B, T, HV, K) + 4.0) * 2.0
        strong = -torch.rand(B, T, HV, K, generator=gen) * 8.0
        x.update(g=torch.where(torch.rand(1, 1, 1, K, generator=gen) < 0.5, weak, strong) * g_scale,
                 beta=torch.sigmoid(rnd(B, T, HV)))
    N = len(lengths) if lengths else B
    if h0:
        x["initial_state"] = rnd(N, HV, V, K) * 0.5 if v_first else rnd(N, HV, K, V) * 0.5
    for n in ("q", "k", "v"):
        x[n] = x[n].to(dtype)
    leaves = {n: t.to(base.DEV).requires_grad_() for n, t in x.items()}
    opts = dict(use_qk_l2norm_in_kernel=l2, state_v_first=v_first)
    if lengths:
        from linattn.testing import random_cu_seqlens
        opts["cu_seqlens"] = random_cu_seqlens(lengths, device=base.DEV)
    if gate:
        opts.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=gate == "softplus")
        if gate == "lower_bound":
            opts.update(lower_bound=-5.0, safe_gate=True)
    return leaves, opts


def reference_grads(leaves, opts, seed):
    """o, the final state and every gradient by autograd through naive_recurrent_kda in fp64 (FLA's KDA gate and the
    beta sigmoid as plain functions first), and the random upstream gradients do, dht."""
    from linattn.ops.kda.reference import kda_gate, naive_recurrent_kda
    ref = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    g, beta = ref["g"], ref["beta"]
    if opts.get("use_gate_in_kernel"):
        g = kda_gate(g, ref.get("A_log"), ref.get("dt_bias"), opts.get("lower_bound"))
        beta = torch.sigmoid(beta) * (2 if opts.get("allow_neg_eigval") else 1)
    h0 = ref.get("initial_state")
    if h0 is not None and opts["state_v_first"]:
        h0 = h0.transpose(-1, -2)
    o, ht = naive_recurrent_kda(ref["q"], ref["k"], ref["v"], g, beta, None, h0, True, opts.get("cu_seqlens"),
                                opts["use_qk_l2norm_in_kernel"])
    if opts["state_v_first"]:
        ht = ht.transpose(-1, -2)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, device=o.device, dtype=torch.float64)
    torch.autograd.backward([o, ht], [do, dht])
    out = {"o": o.detach(), "final_state": ht.detach()}
    out.update({n: ref[n].grad for n in KDA_GRADS if n in ref})
    return out, do, dht


def chunk_case(backend="triton", **case):
    """chunk_kda forward + backward (the backend's forward, Triton's backward) on NaN-poisoned buffers against
    reference_grads."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    seed = _seed()
    leaves, opts = chunk_inputs(**case, seed=seed)
    ref, do, dht = reference_grads(leaves, opts, seed + 1)
    with poisoned_allocations():
        o, ht = linattn.chunk_kda(**leaves, output_final_state=True, backend=backend, **opts)
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    base.sync()
    got = {"o": o.detach(), "final_state": ht.detach()}
    got.update({n: leaves[n].grad for n in KDA_GRADS if n in leaves})
    info = {}
    if "A_log" in leaves:
        chain, info = gate_param_chain(leaves, opts, ref)
        got_p = {n: got.pop(n) for n in chain}
        for n in chain:
            ref.pop(n)
    errs, ok = base.errors(got, ref, leaves["q"].dtype)
    if info:
        # the chain is fp32 arithmetic on the kernel's own dg: checked at fp32's tolerance
        errs_p, ok_p = base.errors({f"{n} (chain of dg)": t for n, t in got_p.items()},
                                   {f"{n} (chain of dg)": t for n, t in chain.items()}, torch.float32)
        errs.update(errs_p)
        ok = ok and ok_p
        info["end_to_end"] = {n: base.rel(got_p[n], info.pop(f"ref_{n}")) for n in chain}
    return dict(seed=seed, errors=errs, passed=ok, **({"gate_params": info} if info else {}))


def gluon_fwd_cases():
    """(name, options) of gluon_fwd_case: the Gluon stage 2a takes bf16 inputs (K = 128 here), followed by the fused
    Gluon stages 2b-4 but with state_v_first. The default decays flag most chunks pairwise (channels down to e^-8
    per step); g x 0.01 flags none."""
    d = _dims()
    B, T, BF = d["B"], d["T"], torch.bfloat16
    return [(f"B{B} T{T} bf16 (chunks flagged pairwise)", dict(B=B, T=T, dtype=BF)),
            (f"B{B} T{T} bf16 slow decays (no chunk flagged)", dict(B=B, T=T, dtype=BF, g_scale=0.01)),
            ("varlen 7 seqs 1-token l2norm bf16", dict(lengths=[1, 700, 1, 63, 65, 170, 1], dtype=BF, l2=True)),
            (f"B{B} T{T} gate softplus + beta sigmoid neg eigval bf16", dict(B=B, T=T, dtype=BF, gate="softplus")),
            ("B1 T333 gate lower_bound (safe_gate) no h0 bf16", dict(B=1, T=333, dtype=BF, gate="lower_bound",
                                                                     h0=False)),
            # state_v_first: the Gluon stage 2a then the Triton stages 2b-4 (the fused stages take K-first states)
            ("varlen state_v_first bf16 (stage 2a only)", dict(lengths=[1, 129, 64, 1, 300], dtype=BF,
                                                                v_first=True))]


def gluon_fwd_case(**case):
    """chunk_kda(backend="gluon") forward without autograd (its Gluon stage 2a) on NaN-poisoned buffers: o and the
    final state against the fp64 reference, and against backend="triton" on the same inputs (recorded)."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import rel_rms
    seed = _seed()
    leaves, opts = chunk_inputs(**case, seed=seed)
    ref, _, _ = reference_grads(leaves, opts, seed + 1)
    x = {n: t.detach() for n, t in leaves.items()}
    with torch.no_grad(), poisoned_allocations():
        o, ht = linattn.chunk_kda(**x, output_final_state=True, backend="gluon", **opts)
        o_t, ht_t = linattn.chunk_kda(**x, output_final_state=True, backend="triton", **opts)
    base.sync()
    errs, ok = base.errors({"o": o, "final_state": ht}, {"o": ref["o"], "final_state": ref["final_state"]},
                           leaves["q"].dtype)
    errs_t, _ = base.errors({"o": o_t, "final_state": ht_t}, {"o": ref["o"], "final_state": ref["final_state"]},
                            leaves["q"].dtype)
    return dict(seed=seed, errors=errs, passed=ok, triton_errors=errs_t,
                gluon_vs_triton={"o": rel_rms(o, o_t), "final_state": rel_rms(ht, ht_t)})


def eager_repeat(backend="gluon", **case):
    """Five plain eager calls of chunk_kda(backend=backend) without autograd, one signature, fresh inputs each (the
    first compiles, the second records the signature's launch list, the later ones replay it, kda/eager.py; without
    FLA's options the public call's direct path replays it), NaN-poisoned buffers, each call's o and final state
    against the fp64 reference; the last call on a side stream (the replay declines another stream and the host path
    runs it)."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    errs, ok = [], True
    for i in range(5):
        seed = _seed()
        leaves, opts = chunk_inputs(**case, seed=seed)
        ref, _, _ = reference_grads(leaves, opts, seed + 1)
        x = {n: t.detach() for n, t in leaves.items()}
        side = torch.cuda.Stream() if i == 4 else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), poisoned_allocations(), torch.cuda.stream(side):     # stream(None): no switch
            o, ht = linattn.chunk_kda(**x, output_final_state=True, backend=backend, **opts)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        base.sync()
        e, passed = base.errors({"o": o, "final_state": ht}, {"o": ref["o"], "final_state": ref["final_state"]},
                                leaves["q"].dtype)
        errs.append(e)
        ok = ok and passed
    return dict(errors=errs, passed=ok)


def train_repeat(backend="gluon", **case):
    """Five eager training steps (chunk_kda forward with autograd and torch.autograd.grad of o and the final state) of
    one signature, fresh inputs each: the backward's calls record the signature's
    launch list and the later ones replay it (kda/eager.py bwd_eager); NaN-poisoned buffers; each step's o, final
    state and every gradient against the fp64 reference; the last step on a side stream (the replay declines it)."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    errs, ok = [], True
    for i in range(5):
        seed = _seed()
        leaves, opts = chunk_inputs(**case, seed=seed)
        ref, do, dht = reference_grads(leaves, opts, seed + 1)
        side = torch.cuda.Stream() if i == 4 else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with poisoned_allocations(), torch.cuda.stream(side):                       # stream(None): no switch
            o, ht = linattn.chunk_kda(**leaves, output_final_state=True, backend=backend, **opts)
            names = [n for n in KDA_GRADS if n in leaves]
            grads = torch.autograd.grad([o, ht], [leaves[n] for n in names], [do.to(o.dtype), dht.to(ht.dtype)])
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        base.sync()
        got = {"o": o.detach(), "final_state": ht.detach(), **dict(zip(names, grads))}
        chain_errs = {}
        if "A_log" in leaves:
            # the gate's parameters: the chain rule from the kernel's own dg at fp32's tolerance (gate_param_chain)
            leaves["g"].grad = got["g"]
            chain, _ = gate_param_chain(leaves, opts, ref)
            chain_errs, ok_p = base.errors({f"{n} (chain of dg)": got.pop(n) for n in chain},
                                           {f"{n} (chain of dg)": t for n, t in chain.items()}, torch.float32)
            ok = ok and ok_p
        e, passed = base.errors(got, {n: ref[n] for n in got}, leaves["q"].dtype)
        errs.append({**e, **chain_errs})
        ok = ok and passed
    return dict(errors=errs, passed=ok)


def train_repeat_cases():
    """(name, options) of train_repeat: the gluon backend (stage 2a's outputs saved, the Gluon state passes and WY
    stage) and the triton backend (stage 2a's outputs saved), H = HV = _dims()'s HV; and the gluon backend with GVA
    (_dims()'s H and HV: dq and dk summed over the value heads inside the list), plain and with FLA's gate and beta
    options (the gate's parameter gradients summed over the chunk slots inside the list)."""
    d = _dims()
    H, HV, T, BF = d["H"], d["HV"], d["T"], torch.bfloat16
    return [(f"{b} train repeat B1 T{T} H=HV={HV} bf16", dict(backend=b, B=1, T=T, dtype=BF, heads=(HV, HV)))
            for b in ("gluon", "triton")] + [
        (f"gluon train repeat B1 T{T} H{H}/HV{HV} bf16", dict(backend="gluon", B=1, T=T, dtype=BF, heads=(H, HV))),
        (f"gluon train repeat B1 T{T} H{H}/HV{HV} gate softplus + beta sigmoid bf16",
         dict(backend="gluon", B=1, T=T, dtype=BF, heads=(H, HV), gate="softplus"))]


def repeat_cases():
    """(name, options) of eager_repeat: on the fused Gluon stages plain (the direct path) and with FLA's gate and beta
    options (inputs of the list); on the Triton stages plain and with state_v_first."""
    d = _dims()
    B, T, BF = d["B"], d["T"], torch.bfloat16
    return [(f"gluon eager repeat B{B} T{T} bf16", dict(backend="gluon", B=B, T=T, dtype=BF)),
            (f"gluon eager repeat B1 T{T} gate softplus + beta sigmoid bf16",
             dict(backend="gluon", B=1, T=T, dtype=BF, gate="softplus")),
            (f"triton eager repeat B{B} T{T} bf16", dict(backend="triton", B=B, T=T, dtype=BF)),
            (f"triton eager repeat B1 T{T} state_v_first bf16",
             dict(backend="triton", B=1, T=T, dtype=BF, v_first=True))]


def gate_param_chain(leaves, opts, ref):
    """dA_log and ddt_bias as the chain rule through FLA's KDA gate applied in fp64 to the kernel's own dg (the
    gradient of the gate's raw input), and what the fp64 reference says.

    Both parameters are sums of one term per token and key channel (dA_log: B*T*K terms per head, 256 000 in the
    gate's case) whose signs differ, so their relative error is dg's error times the cancellation: measured on three
    seeds of the softplus case, sum|terms| / |sum| is 160-220 (RMS over heads; single heads up to 1900) for A_log
    and ~15 for dt_bias, and the same trees give dA_log 0.009-0.016 against fp64 while dg is at 0.0035. That end to
    end error is recorded (`end_to_end`, with `cancellation`), not gated: dg is gated against fp64 like every other
    gradient, and the chain from dg to the parameters is gated here at fp32's tolerance.
    With x = g + dt_bias: softplus gate (-e^A softplus(x)) dA = sum dg softplus(x) / sigmoid(x); lower-bound gate
    (lb sigmoid(e^A x)) dA = sum dg x; d dt_bias = sum over tokens of dg for both."""
    g = leaves["g"].detach().double()
    HV, K = g.shape[-2], g.shape[-1]
    dg = leaves["g"].grad.double()
    x = g + leaves["dt_bias"].detach().double().view(HV, K)
    ratio = x if opts.get("lower_bound") is not None else F.softplus(x) / torch.sigmoid(x)
    terms = dg * ratio
    red = tuple(range(terms.dim() - 2))
    chain = {"A_log": terms.sum(red + (3,)), "dt_bias": dg.sum(red).reshape(-1)}
    ref_terms = ref["g"].double() * ratio
    cancel = {"A_log": float(ref_terms.abs().sum(red + (3,)).norm() / ref_terms.sum(red + (3,)).norm()),
              "dt_bias": float(ref["g"].double().abs().sum(red).norm() / ref["g"].double().sum(red).norm())}
    info = {"cancellation": cancel, "ref_A_log": ref["A_log"], "ref_dt_bias": ref["dt_bias"]}
    return chain, info


# ------------------------------------------------------------------------------------------------------ decode

def _decode_reference(g=None, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, lower_bound=None,
                      A_log=None, **kw):
    """fused_recurrent_kda's call in plain PyTorch: GDN's decode reference with the per-channel decay gk."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
    from linattn.ops.kda.fused_recurrent import gate_mode
    return fused_recurrent_reference(g=None, gk=g, gk_mode=gate_mode(use_gate_in_kernel, A_log, lower_bound),
                                     A_log=A_log, lower_bound=0.0 if lower_bound is None else lower_bound,
                                     beta_sigmoid=use_beta_sigmoid_in_kernel, **kw)


def decode_case(B, T=1, state_dtype=torch.float32, v_first=False, spec=False, gate=""):
    """One serving call of fused_recurrent_kda (serving_case): bf16 q, k (L2-normalised), v; a per-channel log decay
    (or the gate's raw input with FLA's KDA gate in the kernel, beta a logit then)."""
    from linattn.ops.kda.fused_recurrent import fused_recurrent_kda
    d = _dims()
    H, HV, K, V = d["H"], d["HV"], d["K"], d["V"]
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=rnd(B, T, H, K), k=F.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, HV, V))
    x = {n: t.to(torch.bfloat16) for n, t in x.items()}
    opts = {}
    if gate:
        x.update(g=rnd(B, T, HV, K) * 2, beta=rnd(B, T, HV) * 2)
        opts = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=rnd(HV) * 0.5,
                    dt_bias=rnd(HV * K), lower_bound=-5.0 if gate == "lower_bound" else None)
    else:
        x.update(g=F.logsigmoid(rnd(B, T, HV, K) + 3.0), beta=torch.sigmoid(rnd(B, T, HV)))
    x = {n: t.to(base.DEV) for n, t in x.items()}
    opts = {n: (t.to(base.DEV) if isinstance(t, torch.Tensor) else t) for n, t in opts.items()}
    res = serving_case(fused_recurrent_kda, _decode_reference, x, HV, K, V, state_dtype, state_v_first=v_first,
                       spec=spec, **opts)
    return dict(res, seed=seed)


def decode_cases():
    """(name, kwargs) of decode_case."""
    d = _dims()
    out = []
    for B in d["batches"]:
        for sd in (torch.float32, torch.bfloat16):
            out.append((f"decode pool B={B} state={str(sd)[6:]}", dict(B=B, state_dtype=sd)))
    Bs = d["batches"][-1 if base.DRY else 1]
    out.append((f"decode spec T=4 state_v_first bf16 pool B={Bs}", dict(B=Bs, T=4, state_dtype=torch.bfloat16,
                                                                         v_first=True, spec=True)))
    out.append((f"decode gate softplus + beta sigmoid B={Bs}", dict(B=Bs, gate="softplus")))
    out.append((f"decode gate lower_bound + beta sigmoid state_v_first B={Bs}", dict(B=Bs, gate="lower_bound",
                                                                                     v_first=True)))
    return out


# ------------------------------------------------------------------------------------------------- GPU only

def sync_free_case(backend):
    """No synchronising call in a varlen chunk_kda forward + backward (the backend's forward) nor in a pool decode
    step (after a first call that compiles), sync debug mode "error"."""
    import linattn
    from linattn.ops.kda.fused_recurrent import fused_recurrent_kda
    leaves, opts = chunk_inputs(lengths=[1, 500, 63, 1], l2=True, seed=_seed())
    d = _dims()
    B, H, HV, K, V = 32, d["H"], d["HV"], d["K"], d["V"]
    dx = dict(q=torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16),
              k=F.normalize(torch.randn(B, 1, H, K, device="cuda"), dim=-1).to(torch.bfloat16),
              v=torch.randn(B, 1, HV, V, device="cuda", dtype=torch.bfloat16),
              g=F.logsigmoid(torch.randn(B, 1, HV, K, device="cuda") + 3.0),
              beta=torch.rand(B, 1, HV, device="cuda"))
    pool = torch.randn(2 * B, HV, K, V, device="cuda")
    idx = torch.randperm(2 * B, device="cuda")[:B]

    def step():
        o, ht = linattn.chunk_kda(**leaves, output_final_state=True, backend=backend, **opts)
        torch.autograd.grad([o, ht], list(leaves.values()), [torch.ones_like(o), torch.ones_like(ht)])
        fused_recurrent_kda(**dx, initial_state=pool, state_indices=idx, inplace=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return dict(sync_debug_mode_error="no synchronising call", passed=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def graph_case(backend):
    """A CUDA graph of chunk_kda's forward + backward (the backend's forward; varlen, cu_seqlens on the device, the
    gate in the kernel), replayed on fresh values copied into the captured buffers, equals eager."""
    import linattn
    from linattn.testing import rel_rms
    case = dict(lengths=[1, 1000, 64, 300, 1], gate="softplus", dtype=torch.bfloat16)
    leaves, opts = chunk_inputs(**case, seed=_seed())
    names = list(leaves)
    do = torch.randn(1, sum(case["lengths"]), _dims()["HV"], _dims()["V"], device="cuda", dtype=torch.bfloat16)
    dht = torch.randn_like(leaves["initial_state"])

    def step():
        o, ht = linattn.chunk_kda(**leaves, output_final_state=True, backend=backend, **opts)
        return (o, ht) + torch.autograd.grad([o, ht], [leaves[n] for n in names], [do, dht])

    graph, static = base.captured(step)        # warm-up: every kernel compiled outside the capture
    fresh, _ = chunk_inputs(**case, seed=_seed())
    with torch.no_grad():
        for n in names:
            leaves[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    errs = {n: rel_rms(a, b) for n, a, b in zip(["o", "final_state"] + names, static, eager)}
    return dict(graph_vs_eager=errs, passed=all(v <= 1e-6 for v in errs.values()))


def case_names():
    names = [f"chunk {n}" for n, _ in chunk_cases()] + [n for n, _ in decode_cases()]
    if base.DRY:
        return names
    return (names + [f"{b} {c}" for b in BACKENDS for c in ("sync-free chunk fwd+bwd and decode",
                                                             "CUDA graph chunk fwd+bwd varlen")]
            + [f"gluon fwd {n}" for n, _ in gluon_fwd_cases()]
            + [f"gluon fwd+bwd {n}" for n, _ in gluon_fwd_cases()]
            + [n for n, _ in repeat_cases()] + [n for n, _ in train_repeat_cases()])


def section(save):
    cases = []
    run = case_runner(cases)
    for name, kw in chunk_cases():
        run(f"chunk {name}", chunk_case, **kw)
        save(dict(cases=cases, incomplete=True))
        base.free()
    for name, kw in decode_cases():
        run(name, decode_case, **kw)
        save(dict(cases=cases, incomplete=True))
    if not base.DRY:
        for b in BACKENDS:
            run(f"{b} sync-free chunk fwd+bwd and decode", sync_free_case, b)
            run(f"{b} CUDA graph chunk fwd+bwd varlen", graph_case, b)
        for name, kw in gluon_fwd_cases():
            run(f"gluon fwd {name}", gluon_fwd_case, **kw)
            save(dict(cases=cases, incomplete=True))
            base.free()
        # the autograd forward on the Gluon stages (stage 2a's outputs saved, Tinv in bf16), Triton's backward
        for name, kw in gluon_fwd_cases():
            run(f"gluon fwd+bwd {name}", chunk_case, backend="gluon", **kw)
            save(dict(cases=cases, incomplete=True))
            base.free()
        for name, kw in repeat_cases():
            run(name, eager_repeat, **kw)
            save(dict(cases=cases, incomplete=True))
            base.free()
        for name, kw in train_repeat_cases():
            run(name, train_repeat, **kw)
            save(dict(cases=cases, incomplete=True))
            base.free()
    return dict(cases=cases, reference="autograd through naive_recurrent_kda in fp64 on the same device; decode: "
                                       "fused_recurrent_reference in fp64")
