"""GPU gate and benchmark of the GDN backward (H200): `python benchmarks/gpu/gdn_bwd_gate.py --out DIR [--fla]`.

Sections (each in a child process with a timeout, so a hang or a crash is that section's error):
1. gate: our Triton forward+backward at real sizes against autograd through `chunk_reference` in fp64 ON THE GPU,
   on the full problem (not a slice, not fp32): T=65536 (B=1, H=16, HV=32, K=V=128), varlen of mixed lengths with
   1-token sequences (GVA, l2norm), a fixed batch with odd head sizes (fp16, mixed gate dtypes). Every gradient
   (dq, dk, dv, dg, dbeta, d initial_state) plus o and the final state, relative RMS error against
   linattn.testing.TOL, buffers NaN-poisoned first.
2. fla (with --fla; ours alone without): the case that breaks FLA 0.6.0 on Triton 3.4-3.7.0 on Hopper (gated
   backward, chunk 64, K=128; B=1, T=8192, H=16, HV=32): FLA run with its guard bypassed (chunk_o's
   TRITON_ABOVE_3_7_1 forced True) and both errors recorded against the same fp64 reference; then timing, in this
   same process: fwd+bwd and fwd median ms (triton.testing.do_bench) at B=1 T=8192 and B=8 T=4096, H=16, HV=32,
   K=V=128, bf16, initial and final state, ours and FLA's (FLA's gradients flagged unverified).
3. compile: torch.compile(fullgraph=True) forward+backward of a small model on the GPU, against eager; and a CUDA
   graph capture of our forward+backward (varlen, cu_seqlens on the device) replayed and compared with eager.

Writes DIR/gdn_bwd.json (environment line first) and prints a table. Budget: about 4 minutes.
`--dry-run`: tiny sizes on the CPU under TRITON_INTERPRET=1 (checks the script itself; no FLA, no timing claims).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

SECTIONS = ("gate", "fla", "compile")
TIMEOUT_S = {"gate": 80, "fla": 130, "compile": 35}
TOTAL_BUDGET_S = 235
GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _sizes(dry: bool) -> dict:
    if dry:
        return dict(
            gate=[dict(name="long", B=1, T=130, H=1, HV=2, K=32, V=32),
                  dict(name="varlen", lengths=[1, 64, 1, 65], H=1, HV=2, K=32, V=48, l2norm=True),
                  dict(name="batch-fp16-mixed", B=2, T=70, H=1, HV=1, K=20, V=36, dtype="float16",
                       gate_dtype="bfloat16", beta_dtype="float32", h0=False)],
            fla_case=dict(B=1, T=70, H=1, HV=2, K=32, V=32),
            bench=[dict(B=1, T=64, H=1, HV=2, K=32, V=32)],
            compile=dict(B=1, T=70, H=1, HV=2, K=32, V=32), graph_lengths=[1, 64, 5])
    return dict(
        gate=[dict(name="long-T65536", B=1, T=65536, H=16, HV=32, K=128, V=128),
              dict(name="varlen-mixed", lengths=[1, 4096, 1, 777, 8192, 63, 64, 65, 1, 3000, 2048, 1],
                   H=16, HV=32, K=128, V=128, l2norm=True),
              dict(name="batch-fp16-mixed-K100-V60", B=4, T=1000, H=4, HV=12, K=100, V=60, dtype="float16",
                   gate_dtype="bfloat16", beta_dtype="float32", h0=False)],
        fla_case=dict(B=1, T=8192, H=16, HV=32, K=128, V=128),
        bench=[dict(B=1, T=8192, H=16, HV=32, K=128, V=128), dict(B=8, T=4096, H=16, HV=32, K=128, V=128)],
        compile=dict(B=2, T=1024, H=4, HV=8, K=128, V=128), graph_lengths=[1, 1000, 64, 3000, 1, 31])


def _device(dry):
    return "cpu" if dry else "cuda"


def _make(case, device, requires_grad=True, seed=0):
    import torch
    from linattn.testing import make_gdn_inputs, random_cu_seqlens
    dt = lambda s, d: getattr(torch, s) if s else d  # noqa: E731
    lengths = case.get("lengths")
    B, T = (1, sum(lengths)) if lengths else (case["B"], case["T"])
    gen = torch.Generator().manual_seed(seed)
    inp = make_gdn_inputs(B, T, case["H"], case["HV"], case["K"], case["V"], dtype=dt(case.get("dtype"), torch.bfloat16),
                          gate_dtype=dt(case.get("gate_dtype"), torch.float32), beta_dtype=dt(case.get("beta_dtype"), None),
                          num_states=len(lengths) if lengths else None, initial_state=case.get("h0", True),
                          normalize_k=not case.get("l2norm", False), generator=gen)
    inp = {n: (None if t is None else t.to(device).requires_grad_(requires_grad)) for n, t in inp.items()}
    cu = random_cu_seqlens(lengths, device=device) if lengths else None
    return inp, cu


def _reference_grads(inp, cu, l2norm, seed=1):
    """o, final state and every gradient by autograd through chunk_reference in fp64 (on the inputs' device)."""
    import torch
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


def _run_op(fn, inp, cu, l2norm, do, dht):
    import torch
    for t in inp.values():
        if t is not None:
            t.grad = None
    o, ht = fn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=inp["initial_state"],
               output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.to(ht.dtype)])
    out = {"o": o.detach(), "final_state": ht.detach()}
    out.update({n: inp[n].grad for n in GRADS if inp[n] is not None})
    return out


def _rel(out, ref) -> float:
    """linattn.testing.rel_rms computed on the tensors' device (no multi-GB copies to the host at T=65536)."""
    import torch
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {tuple(out.shape)} vs {tuple(ref.shape)}")
    o, r = out.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    den = float(r.norm())
    num = float((o - r).norm())
    return num / den if den else num


def _errors(got, ref, qkv_dtype):
    import torch
    from linattn.testing import TOL
    errs, ok = {}, True
    for n, r in ref.items():
        g = got.get(n)
        if g is None:
            errs[n], ok = "missing", False
            continue
        tol = TOL[qkv_dtype]
        if g.dtype in (torch.bfloat16, torch.float16):
            tol = max(tol, TOL[g.dtype])        # the gradient is rounded to its input's 16-bit dtype
        e = _rel(g, r)
        errs[n] = e
        ok = ok and e <= tol
    return errs, ok


def _ours():
    import linattn
    return lambda *a, **kw: linattn.chunk_gated_delta_rule(*a, backend="triton", **kw)


def _fla():
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    import fla.ops.common.chunk_o as fla_chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    # bypass FLA's guard against its own gated backward on Triton 3.4-3.7.0 on Hopper: speed and errors only
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True
    return fla_gdn


def section_gate(dry, save):
    from linattn.runtime.alloc import poisoned_allocations
    res = {"reference": "autograd through chunk_reference in fp64 on the same device, full problem", "cases": {}}
    for case in _sizes(dry)["gate"]:
        name = case["name"]
        try:
            inp, cu = _make(case, _device(dry))
            ref, do, dht = _reference_grads(inp, cu, case.get("l2norm", False))
            t0 = time.time()
            with poisoned_allocations():
                got = _run_op(_ours(), inp, cu, case.get("l2norm", False), do, dht)
            errs, ok = _errors(got, ref, inp["q"].dtype)
            res["cases"][name] = {"shape": case, "errors": errs, "pass": ok, "first_call_s": time.time() - t0}
            del ref, got
        except Exception as e:  # noqa: BLE001
            res["cases"][name] = {"shape": case, "error": repr(e), "trace": traceback.format_exc()[-2000:]}
        save(res)
        _free()
    return res


def _free():
    import gc
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_ms(fn, dry):
    if dry:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def section_fla(dry, save, with_fla):
    import torch
    res = {"fla_case": {}, "bench": {}}
    impls = {"ours": _ours()}
    if with_fla:
        try:
            impls["fla"] = _fla()
            import fla
            res["fla_version"] = getattr(fla, "__version__", "unknown")
        except Exception as e:  # noqa: BLE001
            res["fla_import_error"] = repr(e)
    # 1. the case that breaks FLA's gated backward on this Triton: both against one fp64 reference
    case = _sizes(dry)["fla_case"]
    try:
        inp, cu = _make(case, _device(dry))
        ref, do, dht = _reference_grads(inp, cu, False)
        for name, fn in impls.items():
            try:
                got = _run_op(fn, inp, cu, False, do, dht)
                errs, ok = _errors(got, ref, inp["q"].dtype)
                res["fla_case"][name] = {"errors": errs, "pass": ok}
            except Exception as e:  # noqa: BLE001
                res["fla_case"][name] = {"error": repr(e), "trace": traceback.format_exc()[-2000:]}
            save(res)
        res["fla_case"]["shape"] = case
        del ref
    except Exception as e:  # noqa: BLE001
        res["fla_case"]["error"] = repr(e)
    _free()
    save(res)
    # 2. timing, same process: fwd and fwd+bwd
    for case in _sizes(dry)["bench"]:
        key = "B{B}_T{T}_H{H}_HV{HV}_K{K}_V{V}".format(**case)
        row = res["bench"].setdefault(key, {})
        try:
            inp, cu = _make(case, _device(dry))
            leaves = [t for t in inp.values() if t is not None]
            do = torch.randn(case["B"], case["T"], case["HV"], case["V"], device=_device(dry), dtype=torch.bfloat16)
            dht = torch.randn_like(inp["initial_state"], dtype=torch.float32)
            for name, fn in impls.items():
                try:
                    def fwd():
                        with torch.no_grad():
                            fn(*(inp[n] for n in ("q", "k", "v", "g", "beta")), initial_state=inp["initial_state"],
                               output_final_state=True)

                    def fwd_bwd():
                        o, ht = fn(*(inp[n] for n in ("q", "k", "v", "g", "beta")),
                                   initial_state=inp["initial_state"], output_final_state=True)
                        torch.autograd.grad([o, ht], leaves, [do, dht])

                    t0 = time.time()
                    fwd_bwd()
                    if not dry:
                        torch.cuda.synchronize()
                    first = time.time() - t0
                    row[name] = {"first_call_s": first, "fwd_ms": _time_ms(fwd, dry), "fwd_bwd_ms": _time_ms(fwd_bwd, dry)}
                    if name == "fla":
                        row[name]["gradients"] = "unverified (FLA guard bypassed; see fla_case for its errors)"
                except Exception as e:  # noqa: BLE001
                    row[name] = {"error": repr(e), "trace": traceback.format_exc()[-2000:]}
                save(res)
            if "ours" in row and "fla" in row and "fwd_bwd_ms" in row["ours"] and "fwd_bwd_ms" in row["fla"]:
                row["fwd_bwd_ratio_fla_over_ours"] = row["fla"]["fwd_bwd_ms"] / row["ours"]["fwd_bwd_ms"]
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)
        _free()
        save(res)
    return res


def section_compile(dry, save):
    import torch
    import linattn
    from linattn.testing import rel_rms
    res = {}
    sz = _sizes(dry)
    dev = _device(dry)
    # torch.compile(fullgraph=True), forward + backward, against eager
    try:
        inp, _ = _make(sz["compile"], dev)
        leaves = list(inp.values())
        w = torch.randn(sz["compile"]["V"], sz["compile"]["V"], device=dev) * 0.1

        def model(q, k, v, g, beta, h0):
            o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, backend="triton")
            return (o.float() @ w).square().sum() + ht.square().sum()

        t0 = time.time()
        loss_c = torch.compile(model, fullgraph=True)(*leaves)
        grads_c = torch.autograd.grad(loss_c, leaves)
        res["compile_s"] = time.time() - t0
        # against autograd through the fp64 reference of the same model (same tolerance rule as the gate)
        from linattn.ops.gated_delta_rule.reference import chunk_reference
        ref = [t.detach().double().requires_grad_() for t in leaves]
        o, ht = chunk_reference(*ref[:5], None, ref[5], True, None, True)
        loss_r = (o @ w.double()).square().sum() + ht.square().sum()
        grads_r = torch.autograd.grad(loss_r, ref)
        got = {"loss": loss_c.detach().reshape(1), **dict(zip(GRADS, grads_c))}
        want = {"loss": loss_r.detach().reshape(1), **dict(zip(GRADS, grads_r))}
        res["compile_vs_fp64"], res["compile_ok"] = _errors(got, want, leaves[0].dtype)
    except Exception as e:  # noqa: BLE001
        res["compile_error"] = repr(e)
        res["compile_trace"] = traceback.format_exc()[-3000:]
    save(res)
    # CUDA graph capture of forward + backward, varlen with cu_seqlens on the device (no host sync allowed)
    if dry:
        res["cuda_graph"] = "skipped on the CPU"
        return res
    try:
        case = dict(sz["compile"], lengths=sz["graph_lengths"])
        inp, cu = _make(case, dev)
        leaves = list(inp.values())
        do = torch.randn(1, sum(case["lengths"]), case["HV"], case["V"], device=dev, dtype=torch.bfloat16)
        dht = torch.randn_like(inp["initial_state"])

        def step():
            o, ht = linattn.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                   cu_seqlens=cu, backend="triton")
            return (o,) + torch.autograd.grad([o, ht], leaves, [do, dht])

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):                 # warm-up: compiles every kernel outside the capture
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
        # fresh values through the captured buffers: the replay must recompute, not return stale results
        fresh, _ = _make(case, dev, seed=7)
        with torch.no_grad():
            for t, f in zip(leaves, fresh.values()):
                t.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        res["cuda_graph_vs_eager"] = {n: rel_rms(a, b) for n, a, b in zip(("o",) + GRADS, static, eager)}
        res["cuda_graph_ok"] = all(v <= 1e-6 for v in res["cuda_graph_vs_eager"].values())
    except Exception as e:  # noqa: BLE001
        res["cuda_graph_error"] = repr(e)
        res["cuda_graph_trace"] = traceback.format_exc()[-3000:]
    return res


def child(section, out_dir, dry, with_fla):
    path = os.path.join(out_dir, f"part_{section}.json")

    def save(res):
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    try:
        if section == "gate":
            res = section_gate(dry, save)
        elif section == "fla":
            res = section_fla(dry, save, with_fla)
        else:
            res = section_compile(dry, save)
    except Exception as e:  # noqa: BLE001
        res = {"error": repr(e), "trace": traceback.format_exc()[-3000:]}
    save(res)


def run_section(section, out_dir, deadline, dry, with_fla):
    path = os.path.join(out_dir, f"part_{section}.json")
    if os.path.exists(path):
        os.remove(path)
    timeout = max(5.0, min(TIMEOUT_S[section] * (6 if dry else 1), deadline - time.time()))
    cmd = [sys.executable, os.path.abspath(__file__), "--section", section, "--out", out_dir]
    cmd += ["--dry-run"] if dry else []
    cmd += ["--fla"] if with_fla else []
    extra = {}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            extra["child_error"] = f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        extra["child_error"] = f"timed out after {timeout:.0f} s (partial results kept)"
    res = {}
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    res.update(extra)
    res["section_s"] = time.time() - t0
    return res


def environment(dry):
    """linattn.bench.env's record (the one implementation every script shares), plus this run's mode."""
    from linattn.bench.env import collect_env, env_line
    env = collect_env("cpu" if dry else "cuda")
    env.update(dry_run=dry, line=env_line(env))
    return env


def table(result):
    lines = []
    gate = result.get("gate", {})
    for name, c in gate.get("cases", {}).items():
        errs = c.get("errors") or {}
        worst = max((v for v in errs.values() if isinstance(v, float)), default=float("nan"))
        lines.append(f"gate {name:32s} {'PASS' if c.get('pass') else 'FAIL'} worst rel err {worst:.2e}"
                     + (f"  error {c['error']}" if "error" in c else ""))
    fla = result.get("fla", {})
    for impl, c in fla.get("fla_case", {}).items():
        if impl == "shape":
            continue
        errs = c.get("errors", {}) if isinstance(c, dict) else {}
        lines.append(f"fla-breaker {impl:8s} " + " ".join(f"{n}={v:.1e}" for n, v in errs.items()
                                                           if isinstance(v, float)) + (f" {c.get('error', '')}"))
    for key, row in fla.get("bench", {}).items():
        for impl in ("ours", "fla"):
            r = row.get(impl, {})
            if "fwd_bwd_ms" in r:
                lines.append(f"bench {key} {impl:5s} fwd {r['fwd_ms']:.3f} ms  fwd+bwd {r['fwd_bwd_ms']:.3f} ms")
            elif r:
                lines.append(f"bench {key} {impl:5s} error {r.get('error')}")
        if "fwd_bwd_ratio_fla_over_ours" in row:
            lines.append(f"bench {key} FLA / ours fwd+bwd time: {row['fwd_bwd_ratio_fla_over_ours']:.2f}x (>1: ours faster)")
    comp = result.get("compile", {})
    lines.append(f"compile ok={comp.get('compile_ok')} cuda_graph ok={comp.get('cuda_graph_ok')} "
                 + str(comp.get("compile_error", "")) + str(comp.get("cuda_graph_error", "")))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fla", action="store_true", help="also run FLA 0.6.0 (guard bypassed) for errors and timing")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import linattn  # noqa: F401  (installs the interpreter fixes before any kernel runs)
    if args.section:
        child(args.section, args.out, args.dry_run, args.fla)
        return 0
    deadline = time.time() + TOTAL_BUDGET_S * (6 if args.dry_run else 1)
    result = {"environment": environment(args.dry_run)}
    out_json = os.path.join(args.out, "gdn_bwd.json")
    for section in SECTIONS:
        result[section] = run_section(section, args.out, deadline, args.dry_run, args.fla)
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(result["environment"].get("line", result["environment"]))
    for line in table(result):
        print(line)
    print(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
