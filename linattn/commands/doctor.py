"""`linattn doctor`: what this machine is, what Triton and Gluon provide, whether the peers import, which
environment variables linattn sees, and which backend `auto` picks for each registered op on a typical call, with
every other backend's rejection reason.

Exit status: 0 when linattn's kernels can run here; 1 when none can (no GPU and no Triton interpreter: calls then
run the PyTorch reference); 2 when the environment holds a value linattn rejects (an unknown LINATTN_* variable,
an unknown LINATTN_BACKEND, a flag that is not 0/1)."""
import os
import textwrap

WIDTH = 120
# the environment variables linattn reads; everything else named LINATTN_* is unknown (and ignored)
SWITCHES = {
    "LINATTN_BACKEND": "replaces backend='auto' by this backend for every call",
    "LINATTN_LOG": "1: print each op's backend choice and rejection reasons once (stderr)",
    "LINATTN_CHECK_INPUTS": "1: check g and beta values of GPU tensors too (one host sync per call)",
    "TRITON_INTERPRET": "Triton's own: 1 before importing linattn runs the Triton kernels on the CPU",
}
METADATA = {"LINATTN_COMMIT": "the commit a bench result records (set by the GPU runner)"}
FLAGS = ("LINATTN_LOG", "LINATTN_CHECK_INPUTS", "TRITON_INTERPRET")
FLAG_VALUES = ("", "0", "1", "true", "false", "yes", "no", "on", "off")


def add_arguments(p):
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")


def _gluon_line() -> str:
    try:
        from linattn.runtime.gluon_compat import gluon_status
    except ImportError:
        return "gluon_compat not available"
    try:
        ok, reason, details = gluon_status()
    except Exception as e:                      # a probe that crashes is itself the answer
        return f"gluon_status() raised {type(e).__name__}: {e}"
    extra = ", ".join(f"{k}={v}" for k, v in sorted(details.items())) if details else ""
    return f"{'yes' if ok else 'no'}: {reason}" + (f" ({extra})" if extra else "")


def _decode_calls(device):
    from linattn.ops.gated_delta_rule.fused_recurrent import typical_calls
    return typical_calls(device)


def _chunk_calls(device):
    """On a GPU, the production rows beside the bench's typical call: one long sequence (where `auto` takes the
    Gluon state pass on Hopper) and a batch (where it keeps Triton). Uninitialised tensors: supports() and the
    auto filters read shapes, dtypes and devices only. None on a CPU (the typical call covers it)."""
    import torch
    if torch.device(device).type != "cuda":
        return []
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, device=device, dtype=dt)  # noqa: E731
    out = []
    for B, T in ((1, 65536), (8, 4096)):
        out.append((f"B{B} T{T} H16/HV32", dict(q=e(B, T, 16, 128), k=e(B, T, 16, 128), v=e(B, T, 32, 128),
                                               g=e(B, T, 32, dt=torch.float32), beta=e(B, T, 32, dt=torch.float32),
                                               initial_state=e(B, 32, 128, 128, dt=torch.float32),
                                               cu_seqlens=None)))
    return out


def _matmul_calls(device):
    import torch
    e = lambda *s: torch.empty(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    return [("4096x4096x4096 bf16", dict(a=e(4096, 4096), b=e(4096, 4096)))]


# ops without a bench entry: (label, call) pairs that show where `auto` sends their usual calls; for ops with one,
# further calls shown after its typical call
EXTRA_TYPICAL_CALLS = {"fused_recurrent_gated_delta_rule": _decode_calls, "chunk_gated_delta_rule": _chunk_calls,
                       "matmul": _matmul_calls}


def environment_lines(environ, backend_names):
    """(lines, problems) about the environment: every LINATTN_* and TRITON_INTERPRET variable that is set, and a
    problem for each value linattn rejects. backend_names: every backend registered for some op."""
    lines, problems = [], []
    names = sorted(k for k in environ if k.startswith("LINATTN_") or k == "TRITON_INTERPRET")
    for k in names:
        v = environ[k]
        what = SWITCHES.get(k) or METADATA.get(k)
        if what is None:
            problems.append(f"{k}={v!r} is not a linattn variable and is ignored; the known ones: "
                            f"{', '.join(s for s in SWITCHES if s.startswith('LINATTN_'))}")
        elif k in FLAGS and v.strip().lower() not in FLAG_VALUES:
            problems.append(f"{k}={v!r}: expected 0 or 1")
        elif k == "LINATTN_BACKEND" and v not in ("auto",) + tuple(backend_names):
            problems.append(f"LINATTN_BACKEND={v!r} names no backend; known: auto, {', '.join(backend_names)}")
        lines.append(f"  {k}={v!r}" + (f": {what}" if what else ""))
    if not names:
        lines.append("  none set (LINATTN_BACKEND, LINATTN_LOG, LINATTN_CHECK_INPUTS; TRITON_INTERPRET)")
    return lines, problems


def _wrapped(text: str, indent: str = "", hang: str = "      ") -> str:
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + hang))


def _describe(call) -> str:
    import torch
    ts = [(k, v) for k, v in call.items() if isinstance(v, torch.Tensor)][:3]
    dt = str(ts[0][1].dtype).replace("torch.", "") if ts else ""
    return " ".join(f"{k} {tuple(v.shape)}" for k, v in ts[:2]) + f" {dt}"


def run(args) -> int:
    import torch
    import triton

    import linattn  # noqa: F401  (ops register their backends on import)
    from linattn.backends import all_ops
    from linattn.bench.env import nvidia_smi, package_version
    from linattn.bench.ops import BENCH_OPS, bench_op_for_registry
    from linattn.runtime import device_facts, settings
    from linattn.runtime.device import interpreter_mismatch, triton_interprets

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    f = device_facts(device)
    interprets = triton_interprets()
    if f.kind != "cuda":
        print("GPU: none: no CUDA GPU is visible here (CPU only)")
    else:
        smi = nvidia_smi()
        print(f"GPU: {f.name}, {f.arch}, {f.num_sms} SMs, shared memory per block {f.smem_per_block // 1024} KiB, "
              f"memory {f.total_memory / 2 ** 30:.0f} GiB, driver {smi.get('driver', smi.get('nvidia_smi'))}, "
              f"SM clock {smi.get('sm_clock', '?')}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), triton {triton.__version__}, Triton "
          f"{'interprets' if interprets else 'compiles'} in this process")
    print(_wrapped(f"Gluon pieces linattn uses: {_gluon_line()}"))
    for mod in ("fla", "flash_qla"):
        print(_wrapped(f"{mod}: {package_version(mod)}"))
    for bench in {id(b): b for b in BENCH_OPS.values()}.values():
        try:                                    # the op's API module registers its backends
            __import__(bench.api_module or f"linattn.ops.{bench.name}.api")
        except ImportError as e:
            print(f"op {bench.registry_op}: API not importable ({e})")
    ops = all_ops()
    backend_names = sorted({n for table in ops.values() for n in table.backends})
    env_lines, problems = environment_lines(os.environ, backend_names)
    print("environment:")
    print("\n".join(env_lines))
    if interpreter_mismatch():
        problems.append(interpreter_mismatch())
    forced = settings.default_backend
    if not ops:
        print("ops: none registered")
    for name, table in sorted(ops.items()):
        bench = bench_op_for_registry(name)
        calls = []
        if bench is not None and bench.typical_call(device) is not None:
            calls.append(("typical call", bench.typical_call(device)))
        calls += EXTRA_TYPICAL_CALLS.get(name, lambda d: [])(device)
        if not calls:
            print(f"op {name}: backends {table.names()} (no typical call known)")
            continue
        for label, call in calls:
            rows = table.explain(**call)
            chosen = next((n for n, ok, _ in rows if ok), None)
            if forced != "auto":
                b = table.backends.get(forced)
                ok, reason = b.accepts(**call) if b else (False, f"this op has no backend {forced!r}")
                pick = f"LINATTN_BACKEND={forced}: runs {forced}" if ok else f"LINATTN_BACKEND={forced}: raises ({reason})"
            else:
                pick = f"auto picks {chosen or 'NOTHING (raises BackendError)'}"
            print(_wrapped(f"op {name}: {label}, {_describe(call)} on {device}: {pick}"))
            for n, ok, reason in rows:
                mark = "picked" if n == chosen else ("accepts" if ok else "rejects")
                print(_wrapped(f"{n:<10} {mark:<8} {reason}", indent="  ", hang=" " * 20))
    for p in problems:
        print(_wrapped(f"PROBLEM: {p}"))
    if problems:
        return 2
    if f.kind != "cuda" and not interprets:
        print(_wrapped("No kernel can run here: there is no CUDA GPU and Triton does not interpret in this process, "
                       "so every op runs the plain-PyTorch reference (slow). To run the Triton kernels on the CPU, "
                       "set TRITON_INTERPRET=1 before Python starts (TRITON_INTERPRET=1 linattn doctor)."))
        return 1
    return 0
