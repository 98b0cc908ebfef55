"""`linattn demo`: the main job. On a GPU, the Triton forward at B=1, T=8192, H=16, HV=32, K=V=128 (bf16),
checked against the fp64 reference and timed; on a CPU, a small problem run by the Triton interpreter and
checked against the fp64 step-by-step recurrence. Then, where transformers is installed, the model-level line: a tiny
random Qwen3-Next generating with linattn (linattn.integrations.transformers.enable) against transformers' own
computation (same greedy tokens, step logits within the fp32 tolerance)."""
import importlib.util
import os
import subprocess
import sys
import time


def add_arguments(p):
    p.add_argument("--cpu", action="store_true", help="use the CPU interpreter path even when a GPU is present")
    p.add_argument("--T", type=int, default=None, help="sequence length (default 8192 on a GPU, 200 on a CPU)")


def run(args) -> int:
    import torch
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton decides at decoration time whether a @triton.jit function is interpreted, and its own library
        # functions (tl.cumsum, ...) were decorated when `linattn` imported triton: so the interpreter must be
        # on before triton is imported at all. Run the demo again in a fresh interpreter with it set.
        env = dict(os.environ, TRITON_INTERPRET="1")
        argv = [sys.executable, "-m", "linattn.cli", "demo", "--cpu"] + ([f"--T={args.T}"] if args.T else [])
        return subprocess.call(argv, env=env)
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference, naive_recurrent
    from linattn.testing import TOL, make_gdn_inputs, rel_rms

    dev = "cuda" if on_gpu else "cpu"
    if on_gpu:
        B, T, H, HV, K, V, dtype = 1, args.T or 8192, 16, 32, 128, 128, torch.bfloat16
    else:
        B, T, H, HV, K, V, dtype = 1, args.T or 200, 2, 4, 64, 64, torch.bfloat16
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=dev)
    where = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)"
    print(f"linattn demo: chunk_gated_delta_rule forward, backend=triton, on {where}")
    print(f"  B={B} T={T} H={H} HV={HV} K={K} V={V} q/k/v {str(dtype).replace('torch.', '')}, "
          f"fp32 g/beta/states, initial and final state")

    def call():
        with torch.no_grad():
            return linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")

    t0 = time.perf_counter()
    o, ht = call()
    if on_gpu:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if on_gpu:
        import triton
        ms = triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
    else:
        t0 = time.perf_counter()
        call()
        ms = (time.perf_counter() - t0) * 1e3

    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    if on_gpu:
        # the whole problem through the differentiable chunk form in fp64 on the GPU
        ref_o, ref_ht = chunk_reference(**x64, output_final_state=True)
        check = "fp64 chunk-form reference, whole problem"
    else:
        ref_o, ref_ht = naive_recurrent(**x64, output_final_state=True)
        check = "fp64 step-by-step recurrence"
    e_o, e_h = rel_rms(o, ref_o), rel_rms(ht, ref_ht)
    tol = TOL[dtype]
    ok = e_o <= tol and e_h <= tol
    print(f"  check against the {check}: relative RMS error o {e_o:.2e}, final state {e_h:.2e} "
          f"(tolerance {tol:.1e}) -> {'PASS' if ok else 'FAIL'}")
    print(f"  time: first call {first:.2f} s (compile included), then {ms:.3f} ms per call"
          + (" (median, triton.testing.do_bench)" if on_gpu else " (interpreter)"))
    return 0 if ok and model_check(dev) else 1


def model_check(dev) -> bool:
    """The model line: False only when the check ran and failed."""
    print("linattn demo: a tiny random Qwen3-Next (transformers) generating with "
          "linattn.integrations.transformers.enable()")
    if importlib.util.find_spec("transformers") is None:
        print("  skipped: transformers is not installed (pip install transformers==4.57.3)")
        return True
    from linattn.integrations.transformers_check import check_tiny_model, format_check
    t0 = time.perf_counter()
    r = check_tiny_model(dev, new_tokens=6, batch=1, prompt_len=12, fp64=False)
    print(f"  6 greedy tokens (prefill + decode through the cache), fp32, against transformers' own computation: "
          f"{format_check(r)} ({time.perf_counter() - t0:.1f} s)")
    return r["passed"]
