"""`linattn bench`: an op's backends against peers and the roofline floor, each backend timed in its own fresh
processes, alternated (linattn.bench.runner): eager calls, and CUDA-graph replays where the backend can be
captured."""
import os
import sys

from linattn.bench.presets import CPU_PRESETS, PRESETS


def add_arguments(p):
    p.add_argument("--op", default=None, help="bench op (linattn.bench.ops.BENCH_OPS; default gated_delta_rule, "
                   "or gated_delta_rule_decode with --modes decode; kda: chunk_kda against FLA's; layer_gdn / "
                   "layer_kda: the GatedDeltaNet / KimiDeltaAttention layer against FLA's; conv_gdn: the layer's three "
                   "short convolutions against FLA's causal_conv1d)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="linattn backends (triton, gluon, reference; auto for decode) and peers (fla, flashqla, sdpa); "
                   "default triton fla sdpa, and auto triton gluon fla with --modes decode")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd", "decode", "step"],
                   help="decode: the decode step (fused_recurrent_gated_delta_rule, T = 1), alone; step: a layer's "
                   "decode step after a prefill (--op layer_gdn or layer_kda), alone")
    p.add_argument("--preset", default=None, help=f"one of {sorted(PRESETS)} (default: quick on a GPU, tiny on the "
                   "CPU; decode and decode_tiny with --modes decode; kda_production and kda_tiny with --op kda; "
                   "layer and layer_tiny with --op layer_gdn or conv_gdn, layer_kda and layer_kda_tiny with --op "
                   "layer_kda; "
                   "layer_step / layer_kda_step and their _tiny forms with --modes step)")
    p.add_argument("--procs", type=int, default=None,
                   help="rounds of fresh processes: each backend runs once per round, alternated (default 3 on a "
                   "GPU, 2 on the CPU)")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="eager timing only (no CUDA-graph column)")
    p.add_argument("--json", default=None, help="write the full result here (every process's numbers included)")
    p.add_argument("--markdown", default=None, help="write markdown tables here (for RESULTS.md and README)")
    p.add_argument("--plot", default=None, help="write a PNG: ms vs T per backend, log-log (needs matplotlib)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per row and process (default 20 on a GPU, 3 on the CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls before timing (default 3 on a GPU, 1 on the CPU)")
    p.add_argument("--cold", dest="cold", action="store_true", default=None,
                   help="measure each backend's first call in a fresh process (first row only; default on a GPU)")
    p.add_argument("--no-cold", dest="cold", action="store_false")
    p.add_argument("--cold-only", action="store_true",
                   help="only the cold-start measurements (one call of a split run; merge the JSONs with --from-json)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="F",
                   help="do not run: merge these result files and print / write / plot them")


def emit(result, args) -> int:
    from linattn.bench.report import format_table, markdown, plot, write_json
    print(format_table(result))
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown(result))
        print(f"[bench] wrote {args.markdown}")
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        write_json(result, args.json)
        print(f"[bench] wrote {args.json}")
    if args.plot:
        why = plot(result, args.plot)
        print(f"[bench] {why}" if why else f"[bench] wrote {args.plot}")
    return 0


def run(args) -> int:
    import torch
    from linattn.bench.report import load_results
    if args.from_json:
        return emit(load_results(args.from_json), args)
    for name, least in (("procs", 1), ("repeats", 1), ("warmup", 0)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            print(f"linattn bench: --{name} must be at least {least}, got {getattr(args, name)}", file=sys.stderr)
            return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    decode = "decode" in args.modes
    if decode and args.modes != ["decode"]:
        print("linattn bench: --modes decode times another op (the decode step): run it alone", file=sys.stderr)
        return 2
    from linattn.bench.ops import BENCH_OPS
    op_name = args.op or ("gated_delta_rule_decode" if decode else "gated_delta_rule")
    if op_name not in BENCH_OPS:
        print(f"linattn bench: unknown op {op_name!r}; known: {sorted(BENCH_OPS)}", file=sys.stderr)
        return 2
    bad = [m for m in args.modes if m not in BENCH_OPS[op_name].modes]
    if bad:
        print(f"linattn bench: op {op_name} has no mode {bad[0]!r} (its modes: {', '.join(BENCH_OPS[op_name].modes)})",
              file=sys.stderr)
        return 2
    backends = args.backends or (["auto", "triton", "gluon", "fla"] if decode else
                                 ["auto", "fla"] if op_name.startswith("layer_") else ["triton", "fla", "sdpa"])
    if "step" in args.modes and args.modes != ["step"]:
        print("linattn bench: --modes step times a layer's decode step on its own shapes (T = 1): run it alone",
              file=sys.stderr)
        return 2
    if decode:
        preset = args.preset or ("decode" if on_gpu else "decode_tiny")
    elif args.modes == ["step"]:
        preset = args.preset or BENCH_OPS[op_name].step_presets[0 if on_gpu else 1]
    else:
        preset = args.preset or BENCH_OPS[op_name].default_presets[0 if on_gpu else 1]
    if preset in PRESETS and any(("state" in s) != decode for s in PRESETS[preset]):
        known = "decode presets: decode, decode_tiny, kda_decode, kda_decode_tiny"
        print(f"linattn bench: preset {preset!r} is {'not ' if decode else ''}a decode preset "
              f"({'use --modes decode' if not decode else known})", file=sys.stderr)
        return 2
    if not on_gpu and preset not in CPU_PRESETS:
        cpu = ["decode_tiny"] if decode else [BENCH_OPS[op_name].step_presets[1]] if args.modes == ["step"] else \
            [BENCH_OPS[op_name].default_presets[1]]
        print(f"linattn bench: no GPU here; only the {', '.join(cpu)} preset runs on the CPU "
              f"(asked for {preset!r})", file=sys.stderr)
        return 2
    if preset not in PRESETS:
        print(f"linattn bench: unknown preset {preset!r}; known: {sorted(PRESETS)}", file=sys.stderr)
        return 2
    from linattn.bench.ops import no_kernel_here
    why = no_kernel_here(device)
    if why and "reference" not in backends:
        print(f"linattn bench: nothing to time: {why}; or time the PyTorch reference with --backends reference",
              file=sys.stderr)
        return 2
    from linattn.bench.runner import run_bench
    on_progress = None
    if args.json:
        from linattn.bench.report import write_json

        def on_progress(partial):             # a run cut short by a time limit still leaves its measurements
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            write_json(dict(partial, partial=True), args.json + ".partial")
    # cold start is measured by default for the chunked op on a GPU, not for decode (its kernels compile in seconds)
    cold_default = on_gpu and not decode
    result = run_bench(op_name, preset, backends, args.modes,
                       repeats=args.repeats or (20 if on_gpu else 3),
                       warmup=args.warmup if args.warmup is not None else (3 if on_gpu else 1),
                       procs=args.procs or (3 if on_gpu else 2), device=device, graph=args.graph,
                       cold=args.cold_only or (cold_default if args.cold is None else args.cold),
                       cold_only=args.cold_only, on_progress=on_progress)
    if decode:
        from linattn.bench.decode import decode_targets
        result["targets"] = {col: decode_targets(result["rows"], col) for col in ("graph", "eager")}
    if on_progress and os.path.exists(args.json + ".partial"):
        os.remove(args.json + ".partial")
    status = emit(result, args)
    mine = [r for r in result["rows"] if r["backend"] not in BENCH_OPS[op_name].peers]
    if not args.cold_only and not any(r["status"] == "ok" for r in mine):
        print("linattn bench: no linattn backend ran (every row of theirs was skipped or failed: reasons in the "
              "table)", file=sys.stderr)
        return 1
    return status
