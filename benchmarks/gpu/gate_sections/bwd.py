"""Gate section bwd: chunk_gated_delta_rule's forward + backward against autograd through chunk_reference in fp64
on the GPU (every gradient, o and the final state), both backends where gluon runs; each output alone in the loss
(the other's gradient None in the op's backward, as in a layer's training step); then torch.compile(fullgraph=True)
and a CUDA-graph capture of forward + backward."""
from __future__ import annotations

import time

import torch
from common import case_runner

from gate_sections import base


def bwd_sizes():
    if base.DRY:
        return dict(gate=[dict(name="long", B=1, T=130, H=1, HV=2, K=32, V=32),
                          dict(name="varlen", lengths=[1, 64, 1, 65], H=1, HV=2, K=32, V=48, l2norm=True),
                          dict(name="batch-fp16-mixed", B=2, T=70, H=1, HV=1, K=20, V=36, dtype="float16",
                               gate_dtype="bfloat16", beta_dtype="float32", h0=False),
                          dict(name="strong-decay", B=1, T=70, H=1, HV=2, K=32, V=32, l2norm=True,
                               strong_decay=True)],
                    one_output=dict(name="one-output", B=1, T=90, H=1, HV=2, K=32, V=32, l2norm=True),
                    compile=dict(B=1, T=70, H=1, HV=2, K=32, V=32), graph_lengths=[1, 64, 5])
    return dict(gate=[dict(name="long-T65536", B=1, T=65536, H=16, HV=32, K=128, V=128),
                      dict(name="varlen-mixed", lengths=[1, 4096, 1, 777, 8192, 63, 64, 65, 1, 3000, 2048, 1],
                           H=16, HV=32, K=128, V=128, l2norm=True),
                      dict(name="batch-fp16-mixed-K100-V60", B=4, T=1000, H=4, HV=12, K=100, V=60, dtype="float16",
                           gate_dtype="bfloat16", beta_dtype="float32", h0=False),
                      # the Gluon local/WY kernel's group loop at HV = 4H and HV = H, T not a multiple of 64
                      dict(name="gva4-B2-T1000", B=2, T=1000, H=2, HV=8, K=128, V=128),
                      dict(name="mha-B3-T777", B=3, T=777, H=4, HV=4, K=128, V=128, l2norm=True),
                      # a trained layer's gates (g down to -60): dg far below the pairs its cumsum cancels, and
                      # A_log's gradient (sum_t dg_t g_t per head) checked as one more output
                      dict(name="strong-decay-B2-T1000", B=2, T=1000, H=4, HV=8, K=128, V=128, l2norm=True,
                           strong_decay=True)],
                # T = 200: the final state alone reaches h0 through ~e^-23 of decay (about 1e-10; at T = 1000 about
                # 1e-51, below fp32's range, so any fp32 backward gives 0 there)
                one_output=dict(name="one-output-B2-T200", B=2, T=200, H=4, HV=8, K=128, V=128, l2norm=True),
                compile=dict(B=2, T=1024, H=4, HV=8, K=128, V=128), graph_lengths=[1, 1000, 64, 3000, 1, 31])


def _bwd_inputs(case, seed=0):
    from linattn.testing import make_gdn_inputs, random_cu_seqlens
    dt = lambda s, d: getattr(torch, s) if s else d  # noqa: E731
    lengths = case.get("lengths")
    B, T = (1, sum(lengths)) if lengths else (case["B"], case["T"])
    gen = torch.Generator().manual_seed(seed)
    inp = make_gdn_inputs(B, T, case["H"], case["HV"], case["K"], case["V"],
                          dtype=dt(case.get("dtype"), torch.bfloat16),
                          gate_dtype=dt(case.get("gate_dtype"), torch.float32),
                          beta_dtype=dt(case.get("beta_dtype"), None),
                          num_states=len(lengths) if lengths else None, initial_state=case.get("h0", True),
                          normalize_k=not case.get("l2norm", False), generator=gen)
    if case.get("strong_decay"):
        inp["g"] = -torch.empty(inp["g"].shape).uniform_(0.3, 60, generator=gen).to(inp["g"].dtype)
    if case.get("slow_heads"):          # every odd head decays ~1000x slower: its segment windows are flagged
        inp["g"][..., 1::2] *= 1e-3
    inp = {n: (None if t is None else t.to(base.DEV).requires_grad_()) for n, t in inp.items()}
    cu = random_cu_seqlens(lengths, device=base.DEV) if lengths else None
    return inp, cu


def _reference_grads(inp, cu, l2norm, seed=1):
    """o, final state and every gradient by autograd through chunk_reference in fp64 (on the inputs' device)."""
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    ref = {n: (None if t is None else t.detach().double().requires_grad_()) for n, t in inp.items()}
    o, ht = chunk_reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref["initial_state"], True,
                            cu, l2norm)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, device=o.device, dtype=torch.float64)
    torch.autograd.backward([o, ht], [do, dht])
    out = {"o": o.detach(), "final_state": ht.detach()}
    out.update({n: ref[n].grad for n in base.GRADS if ref[n] is not None})
    return out, do, dht


def gate_sum(dg, g):
    """FLA's A_log gradient for g = -exp(A_log) softplus(.): sum over tokens of dg * g, per head, in fp64."""
    return (dg.double() * g.detach().double()).sum((0, 1))


def bwd_case(case, ref, do, dht, inp, cu, backend):
    """Forward + backward of `backend` on NaN-poisoned buffers against the fp64 gradients `ref`."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    for t in inp.values():
        if t is not None:
            t.grad = None
    l2 = case.get("l2norm", False)
    t0 = time.time()
    with poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                               initial_state=inp["initial_state"], output_final_state=True,
                                               cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, backend=backend)
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    got = {"o": o.detach(), "final_state": ht.detach()}
    got.update({n: inp[n].grad for n in base.GRADS if inp[n] is not None})
    if case.get("strong_decay"):
        ref = dict(ref, dA_log=gate_sum(ref["g"], inp["g"]))
        got["dA_log"] = gate_sum(got["g"], inp["g"])
    errs, ok = base.errors(got, ref, inp["q"].dtype)
    return dict(shape=case, backend=backend, errors=errs, passed=ok, first_call_s=round(time.time() - t0, 2))


def one_output_case(case, which, backend):
    """Forward + backward with only `which` ("o" or "final_state") in the loss, as a layer's training step leaves the
    final state out: the other output's gradient reaches the op's backward as None (no zero fill), NaN-poisoned
    buffers; every gradient against autograd through chunk_reference in fp64 with the same single output. A gradient
    the reference leaves unconnected (q's, with the final state alone) must be exactly zero."""
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    inp, cu = _bwd_inputs(case, seed=30)
    l2 = case.get("l2norm", False)
    k = 0 if which == "o" else 1
    ref_in = {n: (None if t is None else t.detach().double().requires_grad_()) for n, t in inp.items()}
    outs = chunk_reference(ref_in["q"], ref_in["k"], ref_in["v"], ref_in["g"], ref_in["beta"], None,
                           ref_in["initial_state"], True, cu, l2)
    gen = torch.Generator(device=outs[k].device).manual_seed(31)
    up = torch.randn(outs[k].shape, generator=gen, device=outs[k].device, dtype=torch.float64)
    leaves = [n for n in base.GRADS if ref_in[n] is not None]
    ref_grads = torch.autograd.grad(outs[k], [ref_in[n] for n in leaves], up, allow_unused=True)
    with poisoned_allocations():
        got_outs = linattn.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                                  initial_state=inp["initial_state"], output_final_state=True,
                                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, backend=backend)
        got_grads = torch.autograd.grad(got_outs[k], [inp[n] for n in leaves], up.to(got_outs[k].dtype))
    got, ref, unconnected = {which: got_outs[k].detach()}, {which: outs[k].detach()}, {}
    for n, g, r in zip(leaves, got_grads, ref_grads):
        if r is None:
            unconnected[n] = float(g.abs().max())
        else:
            got[n], ref[n] = g, r
    errs, ok = base.errors(got, ref, inp["q"].dtype)
    ok = ok and all(v == 0.0 for v in unconnected.values())
    return dict(shape=case, backend=backend, which=which, errors=errs, unconnected_max_abs=unconnected, passed=ok)


def bwd_repeat_case(case, backend, calls=5):
    """Forward + backward of one signature `calls` times on fresh inputs (the first compiles, the second records the
    backward's launch list, the later ones replay it: triton/backward.py bwd_eager, both backends), NaN-poisoned
    buffers, every call against its own fp64 gradients; the last call on a side stream (a replay declines another
    stream)."""
    errs, ok = [], True
    for i in range(calls):
        inp, cu = _bwd_inputs(case, seed=10 + i)
        ref, do, dht = _reference_grads(inp, cu, case.get("l2norm", False), seed=20 + i)
        side = torch.cuda.Stream() if i == calls - 1 else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                    # stream(None): no switch
            r = bwd_case(case, ref, do, dht, inp, cu, backend)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        base.sync()
        errs.append(r["errors"])
        ok = ok and r["passed"]
    return dict(shape=case, backend=backend, errors=errs, passed=ok)


# bwd_repeat_case's signatures (under triton/backward.py BWD_LIST_MAX_TOKEN_HEADS): with states, and without; B1
# T8192 H16/HV32 with slow odd heads: the gluon backward's segment launches (its recompute and its reverse pass, the
# slow heads unsegmented on the side stream) recorded and replayed by the launch list
REPEAT_CASES = (dict(name="repeat-B2-T1000", B=2, T=1000, H=16, HV=32, K=128, V=128),
                dict(name="repeat-B1-T2048-no-states", B=1, T=2048, H=4, HV=8, K=128, V=128, h0=False, l2norm=True),
                dict(name="repeat-B1-T8192-segments-slow-heads", B=1, T=8192, H=16, HV=32, K=128, V=128,
                     slow_heads=True))


def compile_case(sz):
    """torch.compile(fullgraph=True) forward + backward of a small model against autograd through the fp64
    reference of the same model (the gate's tolerance rule)."""
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    inp, _ = _bwd_inputs(sz["compile"])
    leaves = list(inp.values())
    w = torch.randn(sz["compile"]["V"], sz["compile"]["V"], device=base.DEV) * 0.1

    def model(q, k, v, g, beta, h0):
        o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, backend="triton")
        return (o.float() @ w).square().sum() + ht.square().sum()

    t0 = time.time()
    loss_c = torch.compile(model, fullgraph=True)(*leaves)
    grads_c = torch.autograd.grad(loss_c, leaves)
    compile_s = time.time() - t0
    ref = [t.detach().double().requires_grad_() for t in leaves]
    o, ht = chunk_reference(*ref[:5], None, ref[5], True, None, True)
    loss_r = (o @ w.double()).square().sum() + ht.square().sum()
    grads_r = torch.autograd.grad(loss_r, ref)
    got = {"loss": loss_c.detach().reshape(1), **dict(zip(base.GRADS, grads_c))}
    want = {"loss": loss_r.detach().reshape(1), **dict(zip(base.GRADS, grads_r))}
    errs, ok = base.errors(got, want, leaves[0].dtype)
    return dict(compile_s=round(compile_s, 1), errors=errs, passed=ok)


def graph_bwd_case(sz):
    """A CUDA graph of forward + backward (varlen, cu_seqlens on the device: no host sync allowed), replayed on
    fresh values copied into the captured buffers, equals eager."""
    import linattn
    from linattn.testing import rel_rms
    case = dict(sz["compile"], lengths=sz["graph_lengths"])
    inp, cu = _bwd_inputs(case)
    leaves = list(inp.values())
    do = torch.randn(1, sum(case["lengths"]), case["HV"], case["V"], device=base.DEV, dtype=torch.bfloat16)
    dht = torch.randn_like(inp["initial_state"])

    def step():
        o, ht = linattn.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                               cu_seqlens=cu, backend="triton")
        return (o,) + torch.autograd.grad([o, ht], leaves, [do, dht])

    graph, static = base.captured(step)             # warm-up: every kernel compiled outside the capture
    fresh, _ = _bwd_inputs(case, seed=7)
    with torch.no_grad():
        for t, f in zip(leaves, fresh.values()):
            t.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    errs = {n: rel_rms(a, b) for n, a, b in zip(("o",) + base.GRADS, static, eager)}
    return dict(graph_vs_eager=errs, passed=all(v <= 1e-6 for v in errs.values()))


def graph_bwd_segments_case():
    """A CUDA graph of the gluon forward + backward at B1 T4096 H16/HV32 with the odd heads slow: fixed length, so
    under capture the forward and both backward passes run in segments (the flagged heads unsegmented), which an
    eager call of this size does not; replayed on fresh values copied into the captured buffers (inputs and upstream
    gradients), against the fp64 gradients of those values."""
    import linattn
    case = dict(name="graph-B1-T4096-slow-heads", B=1, T=4096, H=16, HV=32, K=128, V=128, slow_heads=True)
    inp, _ = _bwd_inputs(case)
    leaves = list(inp.values())
    do = torch.randn(1, case["T"], case["HV"], case["V"], device=base.DEV, dtype=torch.bfloat16)
    dht = torch.randn_like(inp["initial_state"])

    def step():
        o, ht = linattn.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                               backend="gluon")
        return (o, ht) + torch.autograd.grad([o, ht], leaves, [do, dht])

    graph, static = base.captured(step)     # the warm-up runs unsegmented: the segment launches compile under capture
    fresh, _ = _bwd_inputs(case, seed=7)
    ref, do64, dht64 = _reference_grads(fresh, None, False, seed=8)
    with torch.no_grad():
        for t, f in zip(leaves, fresh.values()):
            t.copy_(f)
        do.copy_(do64)
        dht.copy_(dht64)
    graph.replay()
    torch.cuda.synchronize()
    got = dict(zip(("o", "final_state") + base.GRADS, static))
    errs, ok = base.errors(got, ref, torch.bfloat16)
    return dict(shape=case, errors=errs, passed=ok)


def section(save):
    """Each gate case's fp64 reference is computed once (a case of its own, so that a failure there is on record)
    and checked against both backends where the gluon backend runs (K = V = 128, bf16 inputs)."""
    cases = []
    run = case_runner(cases)
    sz = bwd_sizes()
    for case in sz["gate"]:
        backends = ["triton"]
        if not base.DRY and case["K"] == case["V"] == 128 and case.get("dtype") in (None, "bfloat16"):
            backends.append("gluon")
        prepared = {}

        def reference(case=case):
            prepared["inp"], prepared["cu"] = _bwd_inputs(case)
            prepared["ref"], prepared["do"], prepared["dht"] = _reference_grads(prepared["inp"], prepared["cu"],
                                                                                 case.get("l2norm", False))
            return dict(passed=True)
        run(f"{case['name']} fp64 reference", reference)
        for b in backends:
            if "ref" in prepared:
                p = prepared
                run(f"{case['name']} {b}", bwd_case, case, p["ref"], p["do"], p["dht"], p["inp"], p["cu"], b)
            save(dict(cases=cases, incomplete=True))
        prepared.clear()
        base.free()
    for which, b in _one_output_runs():
        run(f"{sz['one_output']['name']} {which} {b}", one_output_case, sz["one_output"], which, b)
        save(dict(cases=cases, incomplete=True))
    if not base.DRY:
        for case in REPEAT_CASES:
            for b in ("triton", "gluon"):
                run(f"{case['name']} {b}", bwd_repeat_case, case, b)
                save(dict(cases=cases, incomplete=True))
        run("torch.compile fullgraph fwd+bwd", compile_case, sz)
        run("CUDA graph fwd+bwd varlen", graph_bwd_case, sz)
        run("CUDA graph fwd+bwd gluon B1 T4096 segments", graph_bwd_segments_case)
    return dict(cases=cases, reference="autograd through chunk_reference in fp64 on the same device, full problem")


def _one_output_runs():
    """(which output is in the loss, backend) of one_output_case: both outputs on each backend that runs."""
    return [(w, b) for b in (("triton",) if base.DRY else ("triton", "gluon")) for w in ("o", "final_state")]


def case_names():
    names = []
    for c in bwd_sizes()["gate"]:
        names += [f"{c['name']} fp64 reference", f"{c['name']} triton"]
        if not base.DRY and c["K"] == c["V"] == 128 and c.get("dtype") in (None, "bfloat16"):
            names.append(f"{c['name']} gluon")
    names += [f"{bwd_sizes()['one_output']['name']} {w} {b}" for w, b in _one_output_runs()]
    return names + ([] if base.DRY else [f"{c['name']} {b}" for c in REPEAT_CASES for b in ("triton", "gluon")]
                    + ["torch.compile fullgraph fwd+bwd", "CUDA graph fwd+bwd varlen",
                       "CUDA graph fwd+bwd gluon B1 T4096 segments"])
