"""`linattn verify`: run the op's correctness gate for a backend; only when every case passes, bench the quick
preset (tiny on the CPU) against the peers. A red gate prints no speed and exits 1; a backend that cannot run
here (no GPU and no Triton interpreter, or its supports() refuses the op's typical call) is named with the reason
before any case runs, and verify exits 2."""
import sys


def add_arguments(p):
    p.add_argument("--op", default="gated_delta_rule")
    p.add_argument("--backend", default="triton", help="the linattn backend to gate and bench")
    p.add_argument("--peers", nargs="*", default=None,
                   help="peers to bench against (default: fla, flashqla, sdpa; missing ones are listed as skipped)")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"],
                   help="what the gate checks and the bench times (fwd: forward only)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--procs", type=int, default=None,
                   help="fresh processes per backend for the bench (default 3 on a GPU, 1 on the CPU)")
    p.add_argument("--json", default=None, help="write the gate's cases and the bench result here")
    p.add_argument("--device", default=None)


def print_cases(cases) -> int:
    from linattn.bench.report import fit
    failed = 0
    for c in cases:
        failed += not c.ok
        worst = max(c.errors.values()) if c.errors else float("nan")
        print(fit(f"  {'PASS' if c.ok else 'FAIL'}  {c.name:<44} max rel err {worst:.2e} (tol {c.tol:.1e}) "
                  f"seed {c.seed}{'  ' + c.detail if c.detail else ''}"))
    return failed


def run(args) -> int:
    import json
    from dataclasses import asdict

    import torch
    from linattn.bench.gates import get_gate
    from linattn.bench.ops import no_kernel_here
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    why = "" if args.backend == "reference" else (no_kernel_here(device) or _refusal(args.op, args.backend, device))
    if why:
        print(f"verify: backend {args.backend!r} cannot run here, nothing was checked: {why}", file=sys.stderr)
        return 2
    if not on_gpu:
        print("verify: no GPU here: the gate runs with tiny shapes (Triton under TRITON_INTERPRET=1) and the bench "
              "runs the tiny preset")
    print(f"verify: gate for {args.op} backend={args.backend} modes={args.modes} on {device}")
    cases = get_gate(args.op)(args.backend, device, tiny=not on_gpu, modes=tuple(args.modes))
    failed = print_cases(cases)
    report = dict(op=args.op, backend=args.backend, device=device, gate=[asdict(c) for c in cases], bench=None)
    if failed:
        refused = sum(not c.ok and c.detail.startswith("BackendError") for c in cases)
        print(f"verify: GATE RED: {failed} of {len(cases)} cases failed"
              + (f" ({refused} refused by the backend, reasons above)" if refused else "")
              + "; no speed is reported for a backend that does not compute the right answer on every case")
        _write(args.json, report, json)
        return 1
    print(f"verify: gate green ({len(cases)} cases)")
    from linattn.bench.report import format_table
    from linattn.bench.runner import run_bench
    peers = args.peers if args.peers is not None else ["fla", "flashqla", "sdpa"]
    result = run_bench(args.op, "quick" if on_gpu else "tiny", [args.backend] + peers, args.modes,
                       repeats=args.repeats or (20 if on_gpu else 2), warmup=3 if on_gpu else 1,
                       procs=args.procs or (3 if on_gpu else 1), device=device, cold=False)
    print(format_table(result))
    report["bench"] = result
    _write(args.json, report, json)
    return 0


def _refusal(op: str, backend: str, device) -> str:
    """The backend's reason for refusing the op's typical call on `device`, or "" (also when the op has none)."""
    from linattn.backends import op_backends
    from linattn.bench.ops import BENCH_OPS
    bench = BENCH_OPS.get(op)
    call = bench.typical_call(device) if bench is not None else None
    if call is None:
        return ""
    __import__(bench.api_module or f"linattn.ops.{bench.name}.api")
    table = op_backends(bench.registry_op)
    if backend not in table.backends:
        return f"{bench.registry_op} has no backend {backend!r} (known: {', '.join(table.names())})"
    ok, reason = table.backends[backend].accepts(**call)
    return "" if ok else reason


def _write(path, report, json):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"verify: wrote {path}", file=sys.stderr)
