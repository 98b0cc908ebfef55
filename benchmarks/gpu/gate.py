"""The GPU correctness gate of linattn's default paths (H200, sm_90a).

    python benchmarks/gpu/gate.py --out DIR [--only SECTION,SECTION] [--dry-run] [--list]

Sections (each in its own child process under a timeout, so a hang or a crash costs that section only):
  fwd_triton     chunk_gated_delta_rule(backend="triton") at real sizes: T = 1 / 63 / 64 / 65, T = 8192, B8 T4096,
                 T = 65536 with GVA (H16/HV32), fp16 without initial state, varlen at T = 65536 with 1-token
                 sequences, odd head sizes, mixed input dtypes, l2norm in the kernel; then the sync-free checks
                 (torch.cuda sync debug mode "error", CUDA-graph capture of a varlen call replayed on new data).
  fwd_gluon      the same for backend="gluon": its own cases first (T = 1 / 63 / 65 / 1000, 1-token varlen, H2/HV8
                 where V is split finer, B4 T8192 H2/HV8 where the gate-free kernel runs segments), then the
                 K = V = 128 16-bit cases of fwd_triton, then the sync-free checks.
  bwd            forward + backward against autograd through chunk_reference in fp64 on the GPU, full problem:
                 T = 65536, varlen of mixed lengths with 1-token sequences (l2norm), odd head sizes in fp16 with mixed
                 gate dtypes; every gradient, o and the final state; both backends where the gluon backend runs
                 (K = V = 128, bf16); there also h and vnew of the gluon backward's recompute (recompute_h_gluon,
                 the state-only gate-free kernel: its own plan, slow gates, 8 segments) against the Triton state
                 pass's (recompute_case). Then torch.compile(fullgraph=True) of a small model against the fp64
                 reference and a CUDA-graph capture of forward + backward (varlen, cu_seqlens on the device) against eager.
  decode         fused_recurrent_gated_delta_rule against a fp64 reference: state pools (fp32 and bf16) at batch
                 1 / 32 / 256, H = HV = 32 and GVA H16/HV32, padded rows (their outputs 0, unused slots
                 bit-identical), speculative T = 4, varlen, fused gate + beta_sigmoid, out-of-range indices, CUDA
                 graph replay = eager, torch.compile(fullgraph=True) = eager (fp32 pool B8, bf16 pool B32).
  matmul_triton  linattn matmul's Triton path against an fp32 product on ragged shapes, four operand layouts,
  matmul_gluon   the Gluon path on every config of its table and its heuristic (split-K on two shapes).
  eager          speed as users get it (eager_probe.py): forward B1 T8192 / T32768 and decode B1 / B256 eagerly in
                 three fresh processes each (cold caches, warm, after 4 GiB); a shape fails when its slowest process
                 takes more than 5% longer than its fastest.
Every output is NaN-poisoned first (poisoned_allocations or a NaN-filled out=), every error a relative RMS against
linattn.testing.TOL of the dtype.

Budget: on an H200 the correctness sections take about 5.5 minutes (fwd_triton 76 s, fwd_gluon 81 s, bwd 71 s, decode
33 s, matmul_triton 17 s, matmul_gluon 36 s, compiles included) and eager about 2.5 more (12 fresh processes, by the
probe's 16 in 208 s), so one device call (10 minutes) holds the gate; a hang costs its
section's timeout (TIMEOUT_S), so after one, run the rest with --only. Writes DIR/gate.json (the environment line
first, then each section's cases) and exits 1 when any case failed, errored or timed out.
`--dry-run` runs fwd_triton, bwd and decode at tiny sizes on the CPU under TRITON_INTERPRET=1, without the cases
that need a GPU (sync-free, CUDA graphs, torch.compile, out-of-range indices): it checks the script itself.
`--list` prints every section's case names.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))          # linattn from this checkout (children too)
from common import case_runner, env_line, write_json  # noqa: E402

SECTIONS = ("fwd_triton", "fwd_gluon", "bwd", "decode", "matmul_triton", "matmul_gluon", "eager")
DRY_SECTIONS = ("fwd_triton", "bwd", "decode")
TIMEOUT_S = {"fwd_triton": 240, "fwd_gluon": 240, "bwd": 300, "decode": 180, "matmul_triton": 90, "eager": 300,
             "matmul_gluon": 180}
DRY = False
DEV = "cuda"
GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _torch():
    import torch
    return torch


def _sync():
    if DEV == "cuda":
        _torch().cuda.synchronize()


def _free():
    import gc
    gc.collect()
    if DEV == "cuda":
        _torch().cuda.empty_cache()


def _rel(out, ref) -> float:
    """linattn.testing.rel_rms computed on the tensors' device (no multi-GB host copies at T = 65536)."""
    torch = _torch()
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {tuple(out.shape)} vs {tuple(ref.shape)}")
    o, r = out.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    den, num = float(r.norm()), float((o - r).norm())
    return num / den if den else num


# ------------------------------------------------------------------------------------------------ forward

def fwd_cases():
    """(name, B, T, H, HV, K, V, dtype, varlen lengths or None, extra)."""
    torch = _torch()
    BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
    if DRY:
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
    torch = _torch()
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
    torch = _torch()
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, random_cu_seqlens, rel_rms
    extra = dict(extra)
    l2 = extra.pop("l2", False)
    cu = random_cu_seqlens(lens, DEV) if lens else None
    n = len(lens) if lens else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=DEV, num_states=n, **extra)
    with torch.no_grad(), poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                               use_qk_l2norm_in_kernel=l2, backend=backend)
    _sync()
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
    torch = _torch()
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
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            go, _ = call()
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


def section_fwd(backend, save):
    cases = []
    run = case_runner(cases)
    for c in (gluon_fwd_cases() if backend == "gluon" else fwd_cases()):
        run(c[0], fwd_case, *c[1:], backend=backend)
        save(dict(cases=cases, incomplete=True))
        _free()
    if not DRY:
        run("sync_free", sync_free, backend)
    return dict(cases=cases)


# ----------------------------------------------------------------------------------------------- backward

def bwd_sizes():
    if DRY:
        return dict(gate=[dict(name="long", B=1, T=130, H=1, HV=2, K=32, V=32),
                          dict(name="varlen", lengths=[1, 64, 1, 65], H=1, HV=2, K=32, V=48, l2norm=True),
                          dict(name="batch-fp16-mixed", B=2, T=70, H=1, HV=1, K=20, V=36, dtype="float16",
                               gate_dtype="bfloat16", beta_dtype="float32", h0=False)],
                    compile=dict(B=1, T=70, H=1, HV=2, K=32, V=32), graph_lengths=[1, 64, 5])
    return dict(gate=[dict(name="long-T65536", B=1, T=65536, H=16, HV=32, K=128, V=128),
                      dict(name="varlen-mixed", lengths=[1, 4096, 1, 777, 8192, 63, 64, 65, 1, 3000, 2048, 1],
                           H=16, HV=32, K=128, V=128, l2norm=True),
                      dict(name="batch-fp16-mixed-K100-V60", B=4, T=1000, H=4, HV=12, K=100, V=60, dtype="float16",
                           gate_dtype="bfloat16", beta_dtype="float32", h0=False)],
                compile=dict(B=2, T=1024, H=4, HV=8, K=128, V=128), graph_lengths=[1, 1000, 64, 3000, 1, 31])


def _bwd_inputs(case, seed=0):
    torch = _torch()
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
    inp = {n: (None if t is None else t.to(DEV).requires_grad_()) for n, t in inp.items()}
    cu = random_cu_seqlens(lengths, device=DEV) if lengths else None
    return inp, cu


def _reference_grads(inp, cu, l2norm, seed=1):
    """o, final state and every gradient by autograd through chunk_reference in fp64 (on the inputs' device)."""
    torch = _torch()
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    ref = {n: (None if t is None else t.detach().double().requires_grad_()) for n, t in inp.items()}
    o, ht = chunk_reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref["initial_state"], True,
                            cu, l2norm)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, device=o.device, dtype=torch.float64)
    torch.autograd.backward([o, ht], [do, dht])
    out = {"o": o.detach(), "final_state": ht.detach()}
    out.update({n: ref[n].grad for n in GRADS if ref[n] is not None})
    return out, do, dht


def _errors(got, ref, qkv_dtype):
    torch = _torch()
    from linattn.testing import TOL
    errs, ok = {}, True
    for n, r in ref.items():
        g = got.get(n)
        if g is None:
            errs[n], ok = "missing", False
            continue
        tol = TOL[qkv_dtype]
        if g.dtype in (torch.bfloat16, torch.float16):
            tol = max(tol, TOL[g.dtype])             # the gradient is rounded to its input's 16-bit dtype
        errs[n] = _rel(g, r)
        ok = ok and errs[n] <= tol
    return errs, ok


def bwd_case(case, ref, do, dht, inp, cu, backend):
    """Forward + backward of `backend` on NaN-poisoned buffers against the fp64 gradients `ref`."""
    torch = _torch()
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
    got.update({n: inp[n].grad for n in GRADS if inp[n] is not None})
    errs, ok = _errors(got, ref, inp["q"].dtype)
    return dict(shape=case, backend=backend, errors=errs, passed=ok, first_call_s=round(time.time() - t0, 2))


def compile_case(sz):
    """torch.compile(fullgraph=True) forward + backward of a small model against autograd through the fp64
    reference of the same model (the gate's tolerance rule)."""
    torch = _torch()
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    inp, _ = _bwd_inputs(sz["compile"])
    leaves = list(inp.values())
    w = torch.randn(sz["compile"]["V"], sz["compile"]["V"], device=DEV) * 0.1

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
    got = {"loss": loss_c.detach().reshape(1), **dict(zip(GRADS, grads_c))}
    want = {"loss": loss_r.detach().reshape(1), **dict(zip(GRADS, grads_r))}
    errs, ok = _errors(got, want, leaves[0].dtype)
    return dict(compile_s=round(compile_s, 1), errors=errs, passed=ok)


def graph_bwd_case(sz):
    """A CUDA graph of forward + backward (varlen, cu_seqlens on the device: no host sync allowed), replayed on
    fresh values copied into the captured buffers, equals eager."""
    torch = _torch()
    import linattn
    from linattn.testing import rel_rms
    case = dict(sz["compile"], lengths=sz["graph_lengths"])
    inp, cu = _bwd_inputs(case)
    leaves = list(inp.values())
    do = torch.randn(1, sum(case["lengths"]), case["HV"], case["V"], device=DEV, dtype=torch.bfloat16)
    dht = torch.randn_like(inp["initial_state"])

    def step():
        o, ht = linattn.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                               cu_seqlens=cu, backend="triton")
        return (o,) + torch.autograd.grad([o, ht], leaves, [do, dht])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):                         # warm-up: every kernel compiled outside the capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    fresh, _ = _bwd_inputs(case, seed=7)
    with torch.no_grad():
        for t, f in zip(leaves, fresh.values()):
            t.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    errs = {n: rel_rms(a, b) for n, a, b in zip(("o",) + GRADS, static, eager)}
    return dict(graph_vs_eager=errs, passed=all(v <= 1e-6 for v in errs.values()))


def recompute_case(inp, cu, tol, segments=None, slow=False):
    """h and vnew of the gluon backward's recompute (gluon/recompute.py: the gate-free kernel's state-only mode)
    against the Triton recompute's (its state pass), relative RMS within tol, on NaN-poisoned buffers (every used
    slot written); gcum, fp32 Tinv and W bit-identical (the same Triton kernels). The call's own plan (segments where
    the forward's planner cuts the sequences), `segments` = (S, L) forced, or slow=True: gates x 0.01, so that the
    window kernel flags the pairs and the selected unsegmented launch runs them. The gradients through the hook are
    the gluon cases'."""
    torch = _torch()
    from linattn.ops.gated_delta_rule.gluon.recompute import recompute_h_applies, recompute_h_gluon, \
        recompute_segments
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import rel_rms
    x = {n: (None if t is None else t.detach()) for n, t in inp.items()}
    g = (x["g"] * 0.01).contiguous() if slow else x["g"]
    segs = segments or recompute_segments(x["k"], x["v"], cu)
    with poisoned_allocations():
        rc = recompute_h_gluon(x["k"], x["v"], g, x["beta"], x["initial_state"], cu, segments=segs)
        ref = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], g, x["beta"], 1.0, x["initial_state"], False, cu,
                                         store_tinv=True, plan=rc.plan, compute_output=False)
    _sync()
    used = int(rc.plan.chunk_offsets[-1])
    errs = dict(h=rel_rms(rc.h[:used], ref.h[:used]), vnew=rel_rms(rc.vnew, ref.vnew))
    same = dict(gcum=bool(torch.equal(rc.gcum, ref.gcum)), tinv=bool(torch.equal(rc.tinv, ref.tinv)),
                w=bool(torch.equal(rc.w, ref.w)))
    ok = all(e <= tol for e in errs.values()) and all(same.values())
    return dict(segments=list(segs), slow=slow, hook_applies=recompute_h_applies(x["k"], x["v"], cu), errors=errs,
                identical=same, passed=ok)


def section_bwd(save):
    """Each gate case's fp64 reference is computed once (a case of its own, so that a failure there is on record)
    and checked against both backends where the gluon backend runs (K = V = 128, bf16 inputs)."""
    cases = []
    run = case_runner(cases)
    sz = bwd_sizes()
    for case in sz["gate"]:
        backends = ["triton"]
        if not DRY and case["K"] == case["V"] == 128 and case.get("dtype") in (None, "bfloat16"):
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
        if "gluon" in backends and "inp" in prepared:
            from linattn.testing import TOL
            tol = TOL[prepared["inp"]["q"].dtype]
            for slow in (False, True):
                run(f"{case['name']} recompute_h gluon{' slow gates' if slow else ''}", recompute_case,
                    prepared["inp"], prepared["cu"], tol, slow=slow)
            if prepared["cu"] is None:
                run(f"{case['name']} recompute_h gluon segments (8, 128)", recompute_case, prepared["inp"], None, tol,
                    segments=(8, 128))
            save(dict(cases=cases, incomplete=True))
        prepared.clear()
        _free()
    if not DRY:
        run("torch.compile fullgraph fwd+bwd", compile_case, sz)
        run("CUDA graph fwd+bwd varlen", graph_bwd_case, sz)
    return dict(cases=cases, reference="autograd through chunk_reference in fp64 on the same device, full problem")


# ------------------------------------------------------------------------------------------------- decode

def _decode_dims():
    """(K, V, H of the plain pools, the GVA pair, batches): real sizes on the GPU, tiny ones in a dry run."""
    return (32, 32, (4, (2, 4)), (1, 3)) if DRY else (128, 128, (32, (16, 32)), (1, 32, 256))


def _decode_inputs(B, T, H, HV):
    torch = _torch()
    from linattn.testing import make_gdn_inputs
    K, V = _decode_dims()[:2]
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=DEV, initial_state=False)
    del x["initial_state"]
    return x


def _f64(x):
    torch = _torch()
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}


def decode_pool_case(B, H, HV, state_dtype, T=1, extra=None, varlen=None):
    """A pool of 2N + 3 slots, every 4th sequence padded (-1), live slots a random permutation: o and the updated
    slots against the fp64 reference, padded outputs 0, unused slots bit-identical, the pool returned in place."""
    torch = _torch()
    from linattn.ops.gated_delta_rule.fused_recurrent import (fused_recurrent_gated_delta_rule as decode,
                                                              fused_recurrent_reference)
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, random_cu_seqlens, rel_rms
    K, V = _decode_dims()[:2]
    if varlen is not None:
        x = _decode_inputs(1, sum(varlen), H, HV)
        x["cu_seqlens"] = random_cu_seqlens(varlen, device=DEV)
        N = len(varlen)
    else:
        x = _decode_inputs(B, T, H, HV)
        N = B
    x.update(extra() if extra else {})
    slots = 2 * N + 3
    pool = (torch.randn(slots, HV, K, V, device=DEV) * 0.5).to(state_dtype)
    idx = torch.randperm(slots, device=DEV)[:N]
    idx[3::4] = -1
    before = pool.clone()
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True)
    with poisoned_allocations():
        o, ret = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    _sync()
    live = idx[idx >= 0]
    unused = torch.ones(slots, dtype=torch.bool, device=DEV)
    unused[live] = False
    pad = (idx < 0).nonzero().flatten()
    if varlen is None:
        pad_rows_zero = bool((o[pad] == 0).all())
    else:
        cu = x["cu_seqlens"].tolist()
        pad_rows_zero = all(bool((o[0, cu[n]:cu[n + 1]] == 0).all()) for n in pad.tolist())
    err_o, err_s = rel_rms(o, ro), rel_rms(pool[live], ref_pool[live])
    tol_o = TOL[torch.bfloat16]                        # o is written in v's dtype (bf16)
    tol_s = TOL[torch.float32] if state_dtype == torch.float32 else BF16_STATE_TOL
    untouched = bool(torch.equal(pool[unused], before[unused]))
    return dict(rel_rms_o=err_o, rel_rms_state=err_s, tol_o=tol_o, tol_state=tol_s, pad_rows_zero=pad_rows_zero,
                unused_slots_untouched=untouched,
                passed=bool(err_o <= tol_o and err_s <= tol_s and ret is pool and pad_rows_zero and untouched))


BF16_STATE_TOL = 4e-3        # one bf16 rounding of the state: < 2^-9 relative (tests/test_fused_recurrent.py)


def decode_out_of_range_case():
    """Indices >= num_slots (not checked on the host) are treated as padded; the guard rows stay untouched."""
    torch = _torch()
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    from linattn.runtime.alloc import poisoned_allocations
    K, V, (H, _), _ = _decode_dims()
    x = _decode_inputs(8, 1, H, H)
    buf = torch.randn(12, H, K, V, device=DEV)
    pool = buf[:8]
    before = buf.clone()
    idx = torch.tensor([8, 1, 11, 2, 1000, -1, 3, 9], device=DEV)
    with poisoned_allocations():
        o, _ = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    _sync()
    keep = [0, 4, 5, 6, 7, 8, 9, 10, 11]
    ok_guard = bool(torch.equal(buf[keep], before[keep]))
    ok_zero = bool((o[torch.tensor([0, 2, 4, 5, 7], device=DEV)] == 0).all())
    return dict(guard_rows_untouched=ok_guard, padded_outputs_zero=ok_zero, passed=ok_guard and ok_zero)


def decode_graph_case():
    """One CUDA-graph replay gives the eager result (pool state and outputs), with new inputs copied in."""
    torch = _torch()
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    B, H, HV, K, V = 32, 16, 32, 128, 128
    x = _decode_inputs(B, 1, H, HV)
    pool = torch.randn(2 * B, HV, K, V, device=DEV)
    idx = torch.randperm(2 * B, device=DEV)[:B].to(torch.int32)
    p_eager, p_graph = pool.clone(), pool.clone()
    decode(**x, initial_state=p_graph, state_indices=idx, inplace=True)        # compile outside the capture
    p_graph.copy_(pool)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        o_graph, _ = decode(**x, initial_state=p_graph, state_indices=idx, inplace=True)
    torch.cuda.current_stream().wait_stream(s)
    p_graph.copy_(pool)
    fresh = _decode_inputs(B, 1, H, HV)
    for n in x:
        x[n].copy_(fresh[n])
    graph.replay()
    o_eager, _ = decode(**x, initial_state=p_eager, state_indices=idx, inplace=True)
    _sync()
    ok = bool(torch.equal(o_graph, o_eager) and torch.equal(p_graph, p_eager))
    return dict(graph_equals_eager=ok, passed=ok)


def decode_compile_case(B, state_dtype):
    """torch.compile(fullgraph=True) of one in-place step equals eager, bit for bit. B8 fp32 pool: the Triton
    kernel; B32 bf16 pool: what `auto` gives the Gluon decode on sm_90 (fused_recurrent._gluon_auto_filter)."""
    torch = _torch()
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    H, HV, K, V = 16, 32, 128, 128
    x = _decode_inputs(B, 1, H, HV)
    pool = torch.randn(2 * B, HV, K, V, device=DEV).to(state_dtype)
    idx = torch.randperm(2 * B, device=DEV)[:B]
    idx[1::6] = -1
    want = pool.clone()
    wo, _ = decode(**x, initial_state=want, state_indices=idx, inplace=True)

    def step(q, k, v, g, beta, pool, idx):
        return decode(q, k, v, g, beta=beta, initial_state=pool, state_indices=idx, inplace=True)[0]

    t0 = time.time()
    o = torch.compile(step, fullgraph=True)(**x, pool=pool, idx=idx)
    _sync()
    ok = bool(torch.equal(o, wo) and torch.equal(pool, want))
    return dict(compile_s=round(time.time() - t0, 1), matches_eager=ok, passed=ok)


def decode_cases():
    """(name, fn, kwargs)."""
    torch = _torch()
    F32, BF = torch.float32, torch.bfloat16
    _, _, (H, (Hg, HVg)), batches = _decode_dims()
    out = []
    for h, hv in ((H, H), (Hg, HVg)):
        for B in batches:
            for sd in (F32, BF):
                out.append((f"pool H={h} HV={hv} B={B} state={str(sd)[6:]}", decode_pool_case,
                            dict(B=B, H=h, HV=hv, state_dtype=sd)))
    Bs = batches[1]
    out.append((f"spec decode T=4 H={Hg} HV={HVg} B={Bs}", decode_pool_case,
                dict(B=Bs, H=Hg, HV=HVg, state_dtype=F32, T=4)))
    N = 6 if DRY else 24
    out.append((f"varlen 1..4 tokens H={Hg} HV={HVg} N={N}", decode_pool_case,
                dict(B=None, H=Hg, HV=HVg, state_dtype=F32, varlen=[1 + (n * 7) % 4 for n in range(N)])))

    def fused():                                       # g is the raw gate, beta a logit: the kernel maps both
        gen = torch.Generator(device=DEV)
        gen.manual_seed(1)
        return dict(g=torch.randn(Bs, 1, HVg, device=DEV, generator=gen) * 3,
                    beta=torch.randn(Bs, 1, HVg, device=DEV, generator=gen) * 2,
                    A_log=torch.rand(HVg, device=DEV, generator=gen) * 2 - 1,
                    dt_bias=torch.randn(HVg, device=DEV, generator=gen), beta_sigmoid=True)
    out.append((f"fused gate + beta_sigmoid H={Hg} HV={HVg} B={Bs}", decode_pool_case,
                dict(B=Bs, H=Hg, HV=HVg, state_dtype=F32, extra=fused)))
    if not DRY:                                        # on the CPU, indices are checked on the host instead
        out.append(("out-of-range indices", decode_out_of_range_case, {}))
        out.append(("CUDA graph", decode_graph_case, {}))
        out.append(("torch.compile fullgraph", decode_compile_case, dict(B=8, state_dtype=F32)))
        out.append(("torch.compile fullgraph bf16 pool B=32", decode_compile_case, dict(B=32, state_dtype=BF)))
    return out


def decode_case_names():
    return [name for name, _, _ in decode_cases()]


def section_decode(save):
    cases = []
    run = case_runner(cases)
    for name, fn, kw in decode_cases():
        run(name, fn, **kw)
        save(dict(cases=cases, incomplete=True))
    return dict(cases=cases)


# ------------------------------------------------------------------------------------------------- matmul

MATMUL_LAYOUTS = [("row", "row"), ("col", "col"), ("row", "col"), ("col", "row")]


def matmul_shapes(backend):
    """Ragged: no dimension a multiple of the 128/256/64 tiles. Gluon needs K and N (and M for a transposed A) to be
    multiples of 8 (16-byte TMA strides); Triton also gets odd sizes. (264, 136, 8200): 6 tiles and a long K, where
    the heuristic picks split-K; K = 72 and 8 leave split-K slices empty."""
    shapes = [(2000, 3000, 1000), (520, 776, 136), (8, 8, 8), (1, 256, 4096), (4096, 264, 72), (264, 136, 8200)]
    if backend == "triton":
        shapes += [(67, 45, 33), (1, 1, 1), (257, 131, 1029)]
    return shapes


def matmul_configs(backend):
    """(name, config) pairs every case runs: Triton its heuristic; Gluon every config of its table explicitly (the
    heuristic picks 128x128 on these small shapes and 128x256 on large ones), then the heuristic itself."""
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import CONFIGS
        return list(CONFIGS.items()) + [("heuristic", None)]
    return [("heuristic", None)]


def matmul_case_names(backend):
    n = sum(len(MATMUL_LAYOUTS) if dt == "bfloat16" else 2 for dt in ("bfloat16", "float16")) * len(
        matmul_shapes(backend))
    return [f"{n} (shape, dtype, layout) cases x {len(matmul_configs(backend))} configs", "matmul(backend=...)"]


def _operand(rows, cols, layout, dtype, gen):
    """A [rows, cols] operand, row-major ('row') or a transposed view of a [cols, rows] tensor ('col')."""
    torch = _torch()
    if layout == "row":
        return torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    return torch.randn(cols, rows, generator=gen, device="cuda", dtype=torch.float32).to(dtype).T


def section_matmul(backend, save):
    """Each case into a NaN-filled out= twice: the plan's first call (through the JIT) and a second one (through the
    compiled handle the first kept), both against the fp32 product."""
    torch = _torch()
    from linattn.backends import op_backends
    from linattn.ops.matmul import matmul
    from linattn.ops.matmul.api import check_inputs
    from linattn.testing import TOL
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import matmul_gluon as launch
    else:
        from linattn.ops.matmul.triton.matmul import matmul_triton as launch
    configs = matmul_configs(backend)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for (M, N, K) in matmul_shapes(backend):
            for la, lb in (MATMUL_LAYOUTS if dtype == torch.bfloat16 else MATMUL_LAYOUTS[:2]):
                a, b = _operand(M, K, la, dtype, gen), _operand(K, N, lb, dtype, gen)
                ref = a.float() @ b.float()
                base = dict(M=M, N=N, K=K, dtype=str(dtype)[6:], layout=f"{la}/{lb}")
                check_inputs(a, b)
                ok, reason = op_backends("matmul").backends[backend].supports(a=a, b=b)
                if not ok:
                    cases.append(dict(base, case=f"{M}x{N}x{K} {base['dtype']} {la}/{lb}", passed=True,
                                      unsupported=reason))
                    continue
                for name, cfg in configs:
                    case = dict(base, case=f"{M}x{N}x{K} {base['dtype']} {la}/{lb} {name}", config=name)
                    try:
                        errs = []
                        for _ in range(2):
                            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
                            launch(a, b, out=out, config=cfg)
                            errs.append(_rel(out, ref))
                        case.update(rel_rms=errs, cublas_rel_rms=_rel(torch.matmul(a, b), ref), tol=TOL[dtype],
                                    passed=all(e <= TOL[dtype] for e in errs))
                    except Exception as e:  # noqa: BLE001
                        case.update(passed=False, error=f"{e!r}"[:600])
                    cases.append(case)
                save(dict(backend=backend, cases=cases, incomplete=True))
    run = case_runner(cases)

    def public():
        """matmul(backend=...) on an aligned problem, and the backend `auto` picks (Gluon on an sm_90 GPU)."""
        a = _operand(512, 512, "row", torch.bfloat16, gen)
        err = _rel(matmul(a, a, backend=backend), a.float() @ a.float())
        return dict(rel_rms=err, auto_backend=op_backends("matmul").select("auto", a=a, b=a).name,
                    passed=err <= TOL[torch.bfloat16])
    run("matmul(backend=...)", public)
    return dict(backend=backend, cases=cases)


# ------------------------------------------------------------------------------------------- orchestration

def child(section, out_dir):
    path = os.path.join(out_dir, f"part_{section}.json")

    def save(res):
        write_json(path + ".tmp", res)
        os.replace(path + ".tmp", path)

    import linattn  # noqa: F401  (installs the interpreter fixes before any kernel runs)
    if section.startswith("fwd_"):
        res = section_fwd(section[4:], save)
    elif section == "bwd":
        res = section_bwd(save)
    elif section == "decode":
        res = section_decode(save)
    else:
        res = section_matmul(section[7:], save)
    save(res)


def run_section(section, out_dir, dry):
    """The section in a child process under its timeout; what it saved survives a timeout or a crash."""
    path = os.path.join(out_dir, f"part_{section}.json")
    if os.path.exists(path):
        os.remove(path)
    timeout = TIMEOUT_S[section] * (4 if dry else 1)
    cmd = [sys.executable, os.path.abspath(__file__), "--section", section, "--out", out_dir]
    cmd += ["--dry-run"] if dry else []
    if section == "eager":
        cmd = [sys.executable, os.path.join(HERE, "eager_probe.py"), "--out", out_dir, "--procs", "3",
               "--json", f"part_{section}.json", "--gate"]
    t0 = time.time()
    extra = {}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            extra["error"] = f"child exited with {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        extra["error"] = f"timed out after {timeout:.0f} s (partial results kept; a hang: check mbarrier phases)"
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = dict(cases=[])
    res.update(extra)
    if res.pop("incomplete", False) and "error" not in res:
        res["error"] = "the section did not finish"
    res["passed"] = bool(res.get("cases")) and "error" not in res and all(c.get("passed") for c in res["cases"])
    res["section_s"] = round(time.time() - t0, 1)
    return res


def case_names(section):
    if section == "fwd_triton":
        return [c[0] for c in fwd_cases()] + ([] if DRY else ["sync_free"])
    if section == "fwd_gluon":
        return [c[0] for c in gluon_fwd_cases()] + ["sync_free"]
    if section == "bwd":
        names = []
        for c in bwd_sizes()["gate"]:
            names += [f"{c['name']} fp64 reference", f"{c['name']} triton"]
            if not DRY and c["K"] == c["V"] == 128 and c.get("dtype") in (None, "bfloat16"):
                names.append(f"{c['name']} gluon")
                names += [f"{c['name']} recompute_h gluon", f"{c['name']} recompute_h gluon slow gates"]
                if "lengths" not in c:
                    names.append(f"{c['name']} recompute_h gluon segments (8, 128)")
        return names + ([] if DRY else ["torch.compile fullgraph fwd+bwd", "CUDA graph fwd+bwd varlen"])
    if section == "decode":
        return decode_case_names()
    if section == "eager":
        from eager_probe import SHAPES
        return [f"{shape} process spread <= 5%" for shape in SHAPES]
    return matmul_case_names(section[7:])


def main(argv=None) -> int:
    global DRY, DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for gate.json (default $OUT)")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all; " + ", ".join(SECTIONS) + ")")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1 "
                                                           "(sections " + ", ".join(DRY_SECTIONS) + ")")
    ap.add_argument("--list", action="store_true", help="print every section's case names and exit")
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    allowed = DRY_SECTIONS if args.dry_run else SECTIONS
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or list(allowed)
    bad = [s for s in sections if s not in allowed]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {list(allowed)}")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DRY, DEV = True, "cpu"
    if args.list:
        for s in sections:
            print(s + ": " + "; ".join(case_names(s)))
        return 0
    out = args.out or os.environ.get("OUT")
    if not out:
        ap.error("--out DIR (or $OUT) is required")
    os.makedirs(out, exist_ok=True)
    if args.section:
        child(args.section, out)
        return 0
    if not args.dry_run and not _torch().cuda.is_available():
        ap.error("the gate needs a GPU (or --dry-run)")
    env = env_line()
    env["dry_run"] = args.dry_run
    result = dict(environment=env, sections={})
    path = os.path.join(out, "gate.json")
    print(env["line"], flush=True)
    for s in sections:
        res = result["sections"][s] = run_section(s, out, args.dry_run)
        write_json(path, result)
        print(f"{s}: {'PASS' if res['passed'] else 'FAIL'} ({len(res.get('cases', []))} cases, "
              f"{res['section_s']} s){'  ' + res['error'][-300:] if 'error' in res else ''}", flush=True)
        for c in res.get("cases", []):
            if not c.get("passed"):
                print(f"   FAIL {c['case']}: " + json.dumps({k: v for k, v in c.items() if k != "trace"},
                                                          default=str)[:600], flush=True)
    result["passed"] = all(r["passed"] for r in result["sections"].values())
    write_json(path, result)
    print(("ALL PASSED" if result["passed"] else "GATE RED") + f"; wrote {path}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
