"""Gate sections fwd_triton and fwd_gluon: chunk_gated_delta_rule's forward at real sizes against the fp64
chunk-form reference on the GPU, then the sync-free checks (sync debug mode "error", a CUDA graph of a varlen call
replayed on new data)."""
from __future__ import annotations

import torch
from common import case_runner

from gate_sections import base


def fwd_cases():
    """(name, B, T, H, HV, K, V, dtype, varlen lengths or None, extra)."""
    BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
    if base.DRY:
        yield "T65_gva", 2, 65, 2, 4, 32, 32, BF, None, {}
        yield "varlen_small", 1, 131, 1, 2, 32, 32, FP32, [1, 1, 63, 66], {}
        return
    yield "T1", 1, 1, 16, 32, 128, 128, BF, None, {}
    yield "T63", 2, 63, 16, 32, 128, 128, BF, None, {}
    yield "T64", 2, 64, 16, 32, 128, 128, BF, None, {}
    yield "T65", 2, 65, 16, 32, 128, 128, BF, None, {}
    yield "T8192", 1, 8192, 16, 32, 128, 128, BF, None, {}
    yield "B8_T4096", 8, 4096, 16, 32, 128, 128, BF, None, {}
    yield "T65536_gva", 1, 65536, 16, 32, 128, 128, BF, None, {}
    yield "T65536_fp16_no_h0", 1, 65536, 16, 32, 128, 128, FP16, None, dict(initial_state=False)
    g = torch.Generator().manual_seed(1)
    lens = [1, 4096, 1, 63, 65, 1000] + torch.randint(256, 4096, (18,), generator=g).tolist()
    lens += [65536 - sum(lens)]                       # a long sequence fills the rest: varlen at T = 65536
    yield "varlen_T65536_gva", 1, 65536, 16, 32, 128, 128, BF, lens, {}
    yield "varlen_small", 1, 300, 4, 8, 64, 64, FP32, [1, 1, 63, 64, 65, 106], {}
    yield "fp32_T1000", 1, 1000, 4, 4, 128, 128, FP32, None, {}
    for K, V in ((64, 64), (60, 100), (100, 60), (256, 256), (16, 32)):
        yield f"K{K}_V{V}", 2, 333, 4, 8, K, V, BF, None, {}
    yield "mixed_fp16_beta32_g16_h0_16", 2, 777, 8, 16, 128, 128, FP16, None, dict(
        gate_dtype=BF, beta_dtype=FP32, state_dtype=FP16)
    yield "l2norm_scale", 1, 2048, 16, 32, 128, 128, BF, None, dict(l2=True, normalize_k=False)


def gluon_fwd_cases():
    """The gluon backend's own cases, then fwd_cases' K = V = 128 16-bit ones, small first (a timeout still leaves
    most cases measured). The own cases reuse fwd_cases' head counts and dtypes (H16/HV32 bf16, H8/HV16 fp16), so
    they add no kernel specialisations to compile, except H2/HV8: there few sequence-heads leave SMs idle, the
    launcher splits V finer (BV = 16 at B1-B2) and B4 T8192 runs the gate-free kernel's segment launch (4 segments
    of 32 chunks per sequence)."""
    BF, FP16 = torch.bfloat16, torch.float16
    own = [(f"gluon_T{T}_gva_h0", 2, T, 16, 32, 128, 128, BF, None, {}) for T in (1, 63, 65, 1000)]
    own.append(("gluon_T1000_fp16_no_h0", 2, 1000, 8, 16, 128, 128, FP16, None, dict(initial_state=False)))
    lens = [1, 1, 63, 1, 65, 1000, 1, 64, 128, 1]
    own.append(("gluon_varlen_1tok", 1, sum(lens), 16, 32, 128, 128, BF, lens, {}))
    own.append(("gluon_varlen_1tok_no_h0", 1, 265, 16, 32, 128, 128, BF, [1, 200, 1, 63], dict(initial_state=False)))
    own.append(("gluon_hv8_T1000", 1, 1000, 2, 8, 128, 128, BF, None, {}))
    own.append(("gluon_hv8_B2_T130_no_h0", 2, 130, 2, 8, 128, 128, BF, None, dict(initial_state=False)))
    own.append(("gluon_hv8_varlen_1tok", 1, 333, 2, 8, 128, 128, BF, [1, 200, 1, 65, 66], {}))
    own.append(("gluon_hv8_B4_T8192_segments", 4, 8192, 2, 8, 128, 128, BF, None, {}))
    theirs = [c for c in fwd_cases() if c[5] == 128 and c[6] == 128 and c[7] in (BF, FP16)]
    return own + sorted(theirs, key=lambda c: c[1] * c[2])


def fwd_case(B, T, H, HV, K, V, dtype, lens, extra, backend):
    """One forward, NaN-poisoned buffers, o and final state against the fp64 chunk-form reference on the GPU."""
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, random_cu_seqlens, rel_rms
    extra = dict(extra)
    l2 = extra.pop("l2", False)
    cu = random_cu_seqlens(lens, base.DEV) if lens else None
    n = len(lens) if lens else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=base.DEV, num_states=n, **extra)
    with torch.no_grad(), poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                               use_qk_l2norm_in_kernel=l2, backend=backend)
    base.sync()
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        ro, rh = chunk_reference(**x64, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
    eo, eh = rel_rms(o, ro), rel_rms(ht, rh)
    tol = TOL[dtype]
    return dict(B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=str(dtype), varlen=bool(lens), n_seqs=n or B,
                err_o=eo, err_state=eh, tol=tol, passed=bool(eo <= tol and eh <= tol))


def sync_free(backend):
    """No synchronising call in a varlen forward (sync debug mode "error"), and a CUDA graph of it replayed on new
    data equals eager."""
    import linattn
    from linattn.testing import make_gdn_inputs, random_cu_seqlens, rel_rms
    out = {}
    lens = [1, 500, 63, 1, 1000]
    cu = random_cu_seqlens(lens, "cuda")
    shape = (1, sum(lens), 16, 32, 128, 128)
    x = make_gdn_inputs(*shape, dtype=torch.bfloat16, device="cuda", num_states=len(lens))
    call = lambda: linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,  # noqa: E731
                                                  backend=backend)
    with torch.no_grad():
        call()                                     # compile first: the compile itself may synchronise
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            out["sync_debug_mode_error"], ok1 = "passed: no synchronising call in the forward", True
        except Exception as e:  # noqa: BLE001
            out["sync_debug_mode_error"], ok1 = f"FAILED: {e!r}", False
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph, (go, _) = base.captured(call, warmups=1)
        fresh = make_gdn_inputs(*shape, dtype=torch.bfloat16, device="cuda", num_states=len(lens))
        for k in x:
            x[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        err = rel_rms(go, call()[0])
        ok2 = err == 0.0
        out["cuda_graph_varlen"] = f"{'passed' if ok2 else 'FAILED'}: replay on new data vs eager, rel err {err:.1e}"
    out["passed"] = ok1 and ok2
    return out


def eager_repeat(B, T, H, HV, backend, initial_state=True, output_final_state=True, slow_heads=False):
    """Four plain eager calls of one signature on fresh inputs each (the first compiles, the second records the
    signature's launch list, the later ones replay it: gluon/launcher.py fwd_eager), NaN-poisoned buffers, every
    call's o and final state against the fp64 reference; then one call on a side stream (the replay declines another
    stream and the host path runs it). slow_heads: every odd head decays ~1000x slower (its segment windows are flagged:
    the unsegmented launch on the side stream does work)."""
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, rel_rms
    errs = []
    for i in range(5):
        x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, device=base.DEV, initial_state=initial_state)
        if slow_heads:
            x["g"][..., 1::2] *= 1e-3
        side = torch.cuda.Stream() if i == 4 else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), poisoned_allocations(), torch.cuda.stream(side):     # stream(None): no switch
            o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=output_final_state, backend=backend)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        base.sync()
        x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
        with torch.no_grad():
            ro, rh = chunk_reference(**x64, output_final_state=True)
        if output_final_state:
            errs.append((rel_rms(o, ro), rel_rms(ht, rh)))
        else:
            errs.append((rel_rms(o, ro), 0.0 if ht is None else float("inf")))
    tol = TOL[torch.bfloat16]
    return dict(B=B, T=T, H=H, HV=HV, initial_state=initial_state, output_final_state=output_final_state,
                errors=errs, tol=tol, passed=all(a <= tol and b <= tol for a, b in errs))


# eager_repeat's signatures: B1 T16384 segmented eagerly (side stream, events; also with flagged heads, whose
# unsegmented launch runs on the side stream), B1 T8192, B4 T8192 at H2/HV8 (the segment launch), B2 T1000 without
# states (the W/U kernel)
REPEAT_CASES = (("repeat_B1_T16384", 1, 16384, 16, 32, {}),
                ("repeat_B1_T16384_slow_heads", 1, 16384, 16, 32, dict(slow_heads=True)),
                ("repeat_B1_T8192", 1, 8192, 16, 32, {}),
                ("repeat_hv8_B4_T8192", 4, 8192, 2, 8, {}),
                ("repeat_B2_T1000_no_states", 2, 1000, 16, 32, dict(initial_state=False, output_final_state=False)))


def section(backend, save):
    cases = []
    run = case_runner(cases)
    for c in (gluon_fwd_cases() if backend == "gluon" else fwd_cases()):
        run(c[0], fwd_case, *c[1:], backend=backend)
        save(dict(cases=cases, incomplete=True))
        base.free()
    if not base.DRY:
        for name, B, T, H, HV, kw in REPEAT_CASES:
            run(name, eager_repeat, B, T, H, HV, backend, **kw)
            save(dict(cases=cases, incomplete=True))
        run("sync_free", sync_free, backend)
    return dict(cases=cases)


def case_names(backend):
    repeat = [c[0] for c in REPEAT_CASES]
    if backend == "gluon":
        return [c[0] for c in gluon_fwd_cases()] + repeat + ["sync_free"]
    return [c[0] for c in fwd_cases()] + ([] if base.DRY else repeat + ["sync_free"])
