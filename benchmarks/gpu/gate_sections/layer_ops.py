"""Gate section layer_ops: the ops around the attention in a GDN / KDA layer, against their fp64 references on the GPU:
causal_conv1d forward + backward (fixed length and varlen with cu_seqlens on the device, states, bias, residual,
every gradient; y or the final state alone in the loss), its decode step causal_conv1d_update on a state pool with
padded rows, rms_norm_gated forward + backward (per-head groups, both gate orders); repeat calls of one signature on
fresh inputs of each op (the signature memo's path and the launch lists' replays, the last on a side stream);
sync-free calls; a CUDA graph of the three replayed on new data."""
from __future__ import annotations

import torch
from common import run_listed

from gate_sections import base


def _dims():
    """(B, T, D, varlen lengths, norm rows, heads, head size)."""
    if base.DRY:
        return 2, 70, 37, [5, 1, 0, 20, 3], 9, 2, 16
    return 2, 4096, 4096, [1, 63, 64, 65, 0, 3000, 777], 4096, 32, 128


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=base.DEV).to(dtype)


def _grad_pass(fn, leaves: dict, seed: int):
    """(outputs, {name: gradient}) of fn(**leaves) under fixed upstream gradients (the same for every backend)."""
    outs = [o for o in fn(**leaves) if o is not None]
    gen = torch.Generator(device=base.DEV)
    gen.manual_seed(seed)
    ups = [torch.randn(o.shape, device=base.DEV, generator=gen).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, list(leaves.values()), ups)
    return outs, dict(zip(leaves, grads))


def _leaves(x: dict, cast=None) -> dict:
    return {n: (t.detach().to(cast) if cast else t.detach()).requires_grad_(True) for n, t in x.items()
            if t is not None}


def conv_case(dtype, varlen: bool):
    """causal_conv1d forward + backward (silu, bias, residual, initial and final states, W = 4; varlen: W = 3 and
    zero-length / 1-token sequences) against autograd through the fp64 reference: y, the final state, every
    gradient."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    B, T, D, lengths, _, _, _ = _dims()
    W = 3 if varlen else 4
    cu = None
    if varlen:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=base.DEV, dtype=torch.int32)
        B, T = 1, sum(lengths)
    N = len(lengths) if varlen else B
    x = dict(x=_randn(B, T, D, dtype=dtype), weight=_randn(D, W, dtype=dtype) * 0.5, bias=_randn(D, dtype=dtype),
             residual=_randn(B, T, D, dtype=dtype), initial_state=_randn(N, D, W, dtype=dtype))

    def run(backend, cast=None):
        def fn(**t):
            return linattn.causal_conv1d(t["x"], t["weight"], t["bias"], t["residual"], t["initial_state"], True,
                                         "silu", backend, cu)
        return _grad_pass(fn, _leaves(x, cast), seed=1)

    with poisoned_allocations():
        (y, final), grads = run("auto")
    (y_ref, final_ref), grads_ref = run("reference", torch.float64)
    got = dict(y=y, final_state=final, **{f"d{n}": g for n, g in grads.items()})
    ref = dict(y=y_ref, final_state=final_ref, **{f"d{n}": g for n, g in grads_ref.items()})
    errs, ok = base.errors(got, ref, dtype)
    return dict(errors=errs, passed=ok)


def conv_one_output_case(which: str):
    """causal_conv1d forward + backward with only `which` ("y" or "final_state") in the loss (the other output's
    gradient reaches the backward as None), bf16, initial state and bias, on NaN-poisoned buffers, against autograd
    through the fp64 reference with the same single output. A gradient the reference leaves unconnected (dweight and
    dbias with the final state alone: it holds the last inputs) must be exactly zero."""
    import linattn
    from linattn.ops.conv1d.reference import causal_conv1d_reference
    from linattn.runtime.alloc import poisoned_allocations
    B, T, D, _, _, _, _ = _dims()
    W, k = 4, 0 if which == "y" else 1
    x = dict(x=_randn(B, T, D, dtype=torch.bfloat16), weight=_randn(D, W, dtype=torch.bfloat16) * 0.5,
             bias=_randn(D, dtype=torch.bfloat16), initial_state=_randn(B, D, W, dtype=torch.bfloat16))
    gen = torch.Generator(device=base.DEV)
    gen.manual_seed(3)
    up = torch.randn((B, T, D) if which == "y" else (B, D, W), device=base.DEV, generator=gen, dtype=torch.float64)

    def run(fn, cast=None):
        leaves = _leaves(x, cast)
        out = fn(leaves["x"], leaves["weight"], leaves["bias"], initial_state=leaves["initial_state"],
                 output_final_state=True, activation="silu")[k]
        grads = torch.autograd.grad(out, list(leaves.values()), up.to(out.dtype), allow_unused=True)
        return out.detach(), dict(zip(leaves, grads))

    with poisoned_allocations():
        out, grads = run(lambda *a, **kw: linattn.causal_conv1d(*a, **kw, backend="auto"))
    out_ref, grads_ref = run(causal_conv1d_reference, torch.float64)
    got, ref, unconnected = {which: out}, {which: out_ref}, {}
    for n, r in grads_ref.items():
        if r is None:
            unconnected[f"d{n}"] = float(grads[n].abs().max()) if grads[n] is not None else None
        else:
            got[f"d{n}"], ref[f"d{n}"] = grads[n], r
    errs, ok = base.errors(got, ref, torch.bfloat16)
    ok = ok and all(v == 0.0 for v in unconnected.values())
    return dict(errors=errs, unconnected_max_abs=unconnected, passed=ok)


def conv_repeat_case():
    """Five no-grad calls of one causal_conv1d signature on fresh inputs, outputs NaN-poisoned, the last on a side
    stream: each against the fp64 reference (the repeat calls skip the checks and the backend choice)."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    B, T, D, _, _, _, _ = _dims()
    errs, ok = [], True
    side = torch.cuda.Stream() if base.DEV == "cuda" else None
    for i in range(5):
        x, w, h0 = _randn(B, T, D, dtype=torch.bfloat16), _randn(D, 4) * 0.5, _randn(B, D, 4, dtype=torch.bfloat16)
        with torch.no_grad(), poisoned_allocations():
            if side is not None and i == 4:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    y, f = linattn.causal_conv1d(x, w, initial_state=h0, output_final_state=True, activation="silu")
                torch.cuda.current_stream().wait_stream(side)
            else:
                y, f = linattn.causal_conv1d(x, w, initial_state=h0, output_final_state=True, activation="silu")
        y_ref, f_ref = linattn.causal_conv1d(x.double(), w.double(), initial_state=h0.double(),
                                             output_final_state=True, activation="silu", backend="reference")
        e, good = base.errors(dict(y=y, final_state=f), dict(y=y_ref, final_state=f_ref), torch.bfloat16)
        errs.append(e)
        ok = ok and good
    return dict(errors=errs, passed=ok)


def _small_op_call(op: str):
    """(fresh inputs, the call on a backend) of one signature of a decode-step op for small_op_repeat_case: update /
    update3 (one token per row into a pool through state_indices with a padded row), norm (no grad)."""
    import linattn
    from linattn.ops.conv1d.update import causal_conv1d_update3
    _, _, D, _, rows, heads, hd = _dims()
    B, W = (6 if base.DRY else 8), 4

    def c(a, cast):
        return a if cast is None else a.to(cast)

    def pool_in():
        idx = torch.randperm(2 * B, device=base.DEV)[:B]
        idx[1] = -1
        return dict(x=_randn(B, D, dtype=torch.bfloat16), w=_randn(D, W) * 0.5, b=_randn(D),
                    pool=_randn(2 * B, D, W), idx=idx)
    if op == "update":
        def call(t, backend, cast):
            return (linattn.causal_conv1d_update(c(t["x"], cast), t["pool"], c(t["w"], cast), c(t["b"], cast), "silu",
                                                 state_indices=t["idx"], backend=backend),)
        return pool_in, call
    if op == "update3":
        def make3():
            ts = [pool_in() for _ in range(3)]
            for t in ts[1:]:
                t["idx"] = ts[0]["idx"]
            return ts

        def call3(ts, backend, cast):
            if backend == "reference":
                return tuple(linattn.causal_conv1d_update(c(t["x"], cast), t["pool"], c(t["w"], cast),
                                                          c(t["b"], cast), "silu", state_indices=t["idx"],
                                                          backend=backend) for t in ts)
            return tuple(causal_conv1d_update3([t["x"] for t in ts], [t["pool"] for t in ts], [t["w"] for t in ts],
                                               [t["b"] for t in ts], "silu", state_indices=ts[0]["idx"]))
        return make3, call3

    def norm_in():
        return dict(x=_randn(rows, heads * hd, dtype=torch.bfloat16), g=_randn(rows, heads * hd, dtype=torch.bfloat16),
                    w=_randn(heads * hd), b=_randn(heads * hd))

    def call_norm(t, backend, cast):
        return (linattn.rms_norm_gated(c(t["x"], cast), c(t["g"], cast), c(t["w"], cast), c(t["b"], cast),
                                       group_size=hd, backend=backend),)
    return norm_in, call_norm


def small_op_repeat_case(op: str):
    """Five no-grad calls of one signature of causal_conv1d_update, causal_conv1d_update3 or rms_norm_gated on fresh
    inputs, outputs NaN-poisoned, the last on a side stream (the repeat calls replay the signature's launch list;
    the side stream's declines it): each against the fp64 reference, the pools' updated state too."""
    from linattn.runtime.alloc import poisoned_allocations
    make, call = _small_op_call(op)
    errs, ok = [], True
    side = torch.cuda.Stream() if base.DEV == "cuda" else None
    for i in range(5):
        t = make()
        ts = t if isinstance(t, list) else [t]
        ref_ts = [dict(s, pool=s["pool"].double()) if "pool" in s else s for s in ts]
        with torch.no_grad():
            ref = call(ref_ts if isinstance(t, list) else ref_ts[0], "reference", torch.float64)
            with poisoned_allocations():
                if side is not None and i == 4:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        got = call(t, "auto", None)
                    torch.cuda.current_stream().wait_stream(side)
                else:
                    got = call(t, "auto", None)
        got_d = {f"y{j}": y for j, y in enumerate(got)}
        ref_d = {f"y{j}": y for j, y in enumerate(ref)}
        for j, (s, r) in enumerate(zip(ts, ref_ts)):
            if "pool" in s:
                got_d[f"pool{j}"], ref_d[f"pool{j}"] = s["pool"], r["pool"]
        e, good = base.errors(got_d, ref_d, torch.bfloat16)
        errs.append(e)
        ok = ok and good
    return dict(errors=errs, passed=ok)


def conv_update_case(state_dtype):
    """causal_conv1d_update: one token per row into a pool of 2B slots through state_indices with padded rows (-1),
    against the fp64 reference on a copy of the pool: outputs of live rows, the updated slots, untouched slots."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    _, _, D, _, _, _, _ = _dims()
    B, W = (6 if base.DRY else 64), 4
    x, w, b = _randn(B, D, dtype=torch.bfloat16), _randn(D, W) * 0.5, _randn(D)
    pool = _randn(2 * B, D, W, dtype=state_dtype)
    idx = torch.randperm(2 * B, device=base.DEV)[:B]
    idx[1::5] = -1
    ref_pool = pool.double()
    with poisoned_allocations():
        y = linattn.causal_conv1d_update(x, pool, w, b, "silu", state_indices=idx)
    y_ref = linattn.causal_conv1d_update(x.double(), ref_pool, w.double(), b.double(), "silu", state_indices=idx,
                                         backend="reference")
    live = idx >= 0
    errs, ok = base.errors(dict(y=y[live], state=pool), dict(y=y_ref[live], state=ref_pool), torch.bfloat16)
    pad_zero = bool((y[~live] == 0).all()) if bool((~live).any()) else True
    return dict(errors=errs, padded_rows_zero=pad_zero, passed=ok and pad_zero)


def norm_case(norm_before_gate: bool):
    """rms_norm_gated forward + backward on [rows, heads * head size] bf16 with one group per head, weight and bias,
    against autograd through the fp64 reference: y and the gradients of x, g, weight and bias."""
    import linattn
    from linattn.runtime.alloc import poisoned_allocations
    _, _, _, _, rows, heads, hd = _dims()
    D = heads * hd
    x = dict(x=_randn(rows, D, dtype=torch.bfloat16), g=_randn(rows, D, dtype=torch.bfloat16), weight=_randn(D),
             bias=_randn(D))

    def run(backend, cast=None):
        def fn(**t):
            return (linattn.rms_norm_gated(t["x"], t["g"], t["weight"], t["bias"], group_size=hd,
                                           norm_before_gate=norm_before_gate, backend=backend),)
        return _grad_pass(fn, _leaves(x, cast), seed=2)

    with poisoned_allocations():
        (y,), grads = run("auto")
    (y_ref,), grads_ref = run("reference", torch.float64)
    errs, ok = base.errors(dict(y=y, **{f"d{n}": g for n, g in grads.items()}),
                           dict(y=y_ref, **{f"d{n}": g for n, g in grads_ref.items()}), torch.bfloat16)
    return dict(errors=errs, passed=ok)


def _step_inputs():
    B, T, D, lengths, _, heads, hd = _dims()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=base.DEV, dtype=torch.int32)
    Tv = sum(lengths)
    return dict(x=_randn(1, Tv, D, dtype=torch.bfloat16), w=_randn(D, 4) * 0.5, cu=cu,
                xu=_randn(8, D, dtype=torch.bfloat16), pool=_randn(16, D, 4), idx=torch.arange(8, device=base.DEV),
                g=_randn(1, Tv, D, dtype=torch.bfloat16), nw=_randn(D)), hd


def _step(t, hd):
    """A layer's ops on one batch: the varlen convolution, a decode step into the pool, the gated norm."""
    import linattn
    y, _ = linattn.causal_conv1d(t["x"], t["w"], activation="silu", cu_seqlens=t["cu"])
    yu = linattn.causal_conv1d_update(t["xu"], t["pool"], t["w"], None, "silu", state_indices=t["idx"])
    o = linattn.rms_norm_gated(y, t["g"], t["nw"], group_size=hd)
    return o, yu


def sync_free_case():
    """The step (and the convolution's backward) with torch's sync debug mode set to "error": no host
    synchronisation."""
    t, hd = _step_inputs()
    _step(t, hd)                                        # compile and remember the signatures first
    torch.cuda.synchronize()
    x = t["x"].detach().requires_grad_(True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(t, hd)
        import linattn
        y, _ = linattn.causal_conv1d(x, t["w"], activation="silu", cu_seqlens=t["cu"])
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(x.grad).all())
    return dict(sync_free=True, grad_finite=ok, passed=ok)


def graph_case():
    """A CUDA graph of the step replayed on new inputs (copied in) equals the eager step on them, bit for bit."""
    t, hd = _step_inputs()
    pool0 = t["pool"].clone()
    graph, static = base.captured(lambda: _step(t, hd))
    fresh, _ = _step_inputs()
    for n in ("x", "xu", "g", "w", "nw"):
        t[n].copy_(fresh[n])
    t["pool"].copy_(pool0)
    graph.replay()
    got = [s.clone() for s in static] + [t["pool"].clone()]
    t["pool"].copy_(pool0)
    want = list(_step(t, hd)) + [t["pool"]]
    torch.cuda.synchronize()
    ok = all(bool(torch.equal(a, b)) for a, b in zip(got, want))
    return dict(graph_equals_eager=ok, passed=ok)


def layer_ops_cases():
    """(name, fn, kwargs)."""
    out = []
    for dt in (torch.bfloat16, torch.float32):
        out.append((f"causal_conv1d fwd+bwd {str(dt)[6:]}", conv_case, dict(dtype=dt, varlen=False)))
    out.append(("causal_conv1d fwd+bwd varlen bf16", conv_case, dict(dtype=torch.bfloat16, varlen=True)))
    for which in ("y", "final_state"):
        out.append((f"causal_conv1d fwd+bwd {which} alone in the loss", conv_one_output_case, dict(which=which)))
    out.append(("causal_conv1d repeat calls", conv_repeat_case, {}))
    for sd in (torch.float32, torch.bfloat16):
        out.append((f"causal_conv1d_update pool {str(sd)[6:]}", conv_update_case, dict(state_dtype=sd)))
    for nbg in (True, False):
        out.append((f"rms_norm_gated fwd+bwd norm_before_gate={nbg}", norm_case, dict(norm_before_gate=nbg)))
    for op in ("update", "update3", "norm"):
        out.append((f"{op} repeat calls", small_op_repeat_case, dict(op=op)))
    if not base.DRY:
        out.append(("sync-free step", sync_free_case, {}))
        out.append(("CUDA graph step", graph_case, {}))
    return out


def case_names():
    return [name for name, _, _ in layer_ops_cases()]


def section(save):
    return run_listed(layer_ops_cases(), save)
