"""`linattn doctor`: what this machine is, what Triton and Gluon provide, whether the peers import, and which
backend `auto` picks for each registered op on a typical call, with every other backend's rejection reason."""


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


# ops without a bench entry: (label, call) pairs that show where `auto` sends their usual calls; for ops with one,
# further calls shown after its typical call
EXTRA_TYPICAL_CALLS = {"fused_recurrent_gated_delta_rule": _decode_calls, "chunk_gated_delta_rule": _chunk_calls}


def run(args) -> int:
    import torch
    import triton

    import linattn  # noqa: F401  (ops register their backends on import)
    from linattn.backends import all_ops
    from linattn.bench.env import nvidia_smi, package_version
    from linattn.bench.ops import BENCH_OPS, bench_op_for_registry
    from linattn.runtime import device_facts, settings

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    f = device_facts(device)
    if f.kind != "cuda":
        print("GPU: none: no CUDA GPU is visible here (CPU only); Triton kernels run only under "
              f"TRITON_INTERPRET=1 (now {'set' if settings.interpret else 'not set'})")
    else:
        smi = nvidia_smi()
        print(f"GPU: {f.name}, {f.arch}, {f.num_sms} SMs, shared memory per block {f.smem_per_block // 1024} KiB "
              f"(opt-in), memory {f.total_memory / 2 ** 30:.0f} GiB, driver {smi.get('driver', smi.get('nvidia_smi'))}, "
              f"SM clock {smi.get('sm_clock', '?')}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), triton {triton.__version__}")
    print(f"Gluon pieces linattn uses: {_gluon_line()}")
    for mod in ("fla", "flash_qla"):
        print(f"{mod}: {package_version(mod)}")
    for bench in {id(b): b for b in BENCH_OPS.values()}.values():
        try:                                    # the op's API module registers its backends
            __import__(bench.api_module or f"linattn.ops.{bench.name}.api")
        except ImportError as e:
            print(f"op {bench.registry_op}: API not importable ({e})")
    ops = all_ops()
    if not ops:
        print("ops: none registered")
    for name, table in sorted(ops.items()):
        bench = bench_op_for_registry(name)
        if bench is not None:
            typical = bench.typical_call(device)
            calls = (([("typical call", typical)] if typical is not None else [])
                     + EXTRA_TYPICAL_CALLS.get(name, lambda d: [])(device))
        elif name in EXTRA_TYPICAL_CALLS:
            calls = EXTRA_TYPICAL_CALLS[name](device)
        else:
            print(f"op {name}: backends {table.names()} (no typical call known)")
            continue
        for label, call in calls:
            shape = f"q {tuple(call['q'].shape)} v {tuple(call['v'].shape)} {str(call['q'].dtype).replace('torch.', '')}"
            rows = table.explain(**call)
            chosen = next((n for n, ok, _ in rows if ok), None)
            print(f"op {name}: {label} {shape} on {device}: auto picks {chosen or 'NOTHING'}")
            for n, ok, reason in rows:
                mark = "picked" if n == chosen else ("accepts" if ok else "rejects")
                print(f"  {n:<10} {mark:<8} {reason}")
    return 0
