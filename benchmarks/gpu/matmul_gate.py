"""GPU gate and benchmark for linattn matmul (H200): `python benchmarks/gpu/matmul_gate.py --out DIR`.

1. gate: the Triton and Gluon paths against an fp32 product (relative RMS error, tolerance per dtype from
   linattn.testing.TOL) on ragged shapes, all four operand layouts, outputs poisoned with NaN first.
   Every case also runs through the compiled-handle launch (linattn/ops/matmul/launch.py, `handle`).
   Gluon's gate covers every config in its table, in two sections: gate_gluon the round-6 configs (decides
   whether Gluon is benchmarked), gate_gluonx the split-K and subtiled-epilogue configs and the heuristic
   (which picks split-K on two gate shapes); an experimental config is timed only if its own cases passed.
2. bench, same run: cuBLAS (torch.matmul), our Triton, our Gluon (only if its gate passed) on the preset shapes;
   median ms from triton.testing.do_bench over rotated inputs (so small problems do not run from L2),
   TFLOP/s and the ratio to cuBLAS. Alternative Gluon tile configs are timed too, to guide the heuristic
   (split-K configs only on the skinny shapes), and "+handle" rows use the compiled-handle launch. On the
   small shapes each row also has ms_graph: the same calls replayed from a CUDA graph (kernel time, no host).
3. host (benchmarks/MATMUL.md, direction 1; run right after the Gluon base gate, before the experimental one):
   on 2000x3000x1000 (and the skinny shape), per implementation and
   host-path mode (jit: no plan cache, the pre-round-8 path; plan: the default; plan+handle):
   graph_us (CUDA-graph replay per call), eager_us (events over back-to-back calls), host_us (perf_counter
   over 1000 calls, no sync) and a cProfile top-15 by cumulative time; plus the floor: an empty Triton
   kernel's launch through the JIT and through its handle, and torch.empty.

Every section runs in a child process with a timeout, so a hung or crashing kernel (a wrong mbarrier phase
hangs; an LLVM error aborts the process) is recorded as that section's error and the rest still runs.
Writes DIR/matmul.json (with an environment line; result["directions"] gathers what benchmarks/MATMUL.md's
predictions are checked against) and one part_<section>.json per section (8 files in all), and prints a
short table. Budget: under 200 s (TOTAL_BUDGET_S; each section has its own timeout).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

BENCH_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 1024),     # large
                (2000, 3000, 1000), (16384, 128, 16384),                        # irregular
                (4096, 128, 16384)]                 # split-K probe: 32 tiles; not part of any target
LARGE, IRREGULAR, SKINNY = BENCH_SHAPES[:3], BENCH_SHAPES[3:5], [BENCH_SHAPES[4], BENCH_SHAPES[5]]
SMALL = BENCH_SHAPES[3:]                  # rows get ms_graph too (the host cost can exceed the kernel's)
TOTAL_BUDGET_S = 200
SECTION_TIMEOUT_S = {"gate_triton": 45, "gate_gluon": 60, "gate_gluonx": 70, "bench_cublas": 30,
                     "bench_triton": 40, "bench_gluon": 80, "host": 45}


def environment() -> dict:
    """linattn.bench.env's record, the one implementation every script shares."""
    import torch

    from linattn.bench.env import collect_env, env_line
    env = collect_env("cuda" if torch.cuda.is_available() else "cpu")
    env["line"] = env_line(env)
    return env


# ------------------------------------------------------------------------------------------------ gate

def _operand(rows, cols, layout, dtype, gen):
    """A [rows, cols] operand, row-major ('row') or a transposed view of a [cols, rows] tensor ('col')."""
    import torch
    if layout == "row":
        return torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    return torch.randn(cols, rows, generator=gen, device="cuda", dtype=torch.float32).to(dtype).T


def _variants(backend):
    """(name, config) pairs the gate must cover. Gluon: every config in its table, each run explicitly, because
    the heuristic picks 128x128 on the gate's small shapes and 128x256 on the large benchmark shapes, plus the
    heuristic itself. Triton: its heuristic (the benchmark post-checks each timed config at full size)."""
    if backend.startswith("gluon"):
        from linattn.ops.matmul.gluon.matmul import CONFIGS
        base = [(n, c) for n, c in CONFIGS.items() if c.split_k == 1 and c.epi_split == 1]
        if backend == "gluon":
            return base
        # gluonx: the round-8 variants, and the heuristic (which picks split-K on two of the gate's shapes),
        # gated in their own child so that a hang there cannot cost the base configs their benchmark.
        return [(n, c) for n, c in CONFIGS.items() if (n, c) not in base] + [("heuristic", None)]
    return [("heuristic", None)]


def _passed_configs(gate_result: dict) -> set:
    """Config names with at least one case and no failing one (a timed-out section counts what it saved)."""
    seen, bad = set(), set()
    for c in gate_result.get("cases", []):
        if "config" in c:
            seen.add(c["config"])
            if c["status"] != "pass":
                bad.add(c["config"])
    return seen - bad


def _launcher(backend):
    if backend == "triton":
        from linattn.ops.matmul.triton.matmul import matmul_triton
        return lambda a, b, out, cfg=None: matmul_triton(a, b, out=out, config=cfg)
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import matmul_gluon
        return lambda a, b, out, cfg=None: matmul_gluon(a, b, out=out, config=cfg)
    raise ValueError(backend)


def _rel_rms_gpu(out, ref) -> float:
    """linattn.testing.rel_rms (fp64, inf on any NaN/inf) computed on the device: no 100 MB host copies."""
    import torch
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    den = r.norm().item()
    num = (o - r).norm().item()
    return num / den if den else num


def gate(backend: str, save=None) -> dict:
    import torch
    from linattn.ops.matmul import matmul
    from linattn.backends import op_backends
    from linattn.testing import TOL
    from linattn.ops.matmul.api import check_inputs
    from linattn.ops.matmul.launch import host_path_options
    variants = _variants(backend)
    backend = "gluon" if backend.startswith("gluon") else backend
    launch = _launcher(backend)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    # Ragged: no dimension a multiple of the 128/256/64 tiles. Gluon needs K and N (and M for a transposed A)
    # to be multiples of 8 (16-byte TMA strides); Triton also gets odd sizes.
    # (264, 136, 8200): 6 tiles, long K -> the heuristic picks split-K; K=72 and 8 leave split-K slices empty.
    shapes = [(2000, 3000, 1000), (520, 776, 136), (8, 8, 8), (1, 256, 4096), (4096, 264, 72), (264, 136, 8200)]
    if backend == "triton":
        shapes += [(67, 45, 33), (1, 1, 1), (257, 131, 1029)]
    layouts = [("row", "row"), ("col", "col"), ("row", "col"), ("col", "row")]
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for (M, N, K) in shapes:
            for la, lb in (layouts if dtype == torch.bfloat16 else layouts[:2]):
                a = _operand(M, K, la, dtype, gen)
                b = _operand(K, N, lb, dtype, gen)
                ref = a.float() @ b.float()
                cublas_err = _rel_rms_gpu(torch.matmul(a, b), ref)
                base = dict(M=M, N=N, K=K, dtype=str(dtype).replace("torch.", ""), layout=f"{la}/{lb}")
                check_inputs(a, b)
                ok, reason = op_backends("matmul").backends[backend].supports(a=a, b=b)
                if not ok:
                    cases.append(dict(base, status="unsupported", reason=reason))
                    continue
                for name, cfg in variants:
                    for mode in ("default", "handle"):
                        case = dict(base, config=name, launch=mode)
                        try:
                            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)   # NaN poison
                            with host_path_options(handle=(mode == "handle")):
                                launch(a, b, out, cfg)
                                if mode == "handle":       # the first call went through the JIT: again
                                    out.fill_(float("nan"))
                                    launch(a, b, out, cfg)
                            err = _rel_rms_gpu(out, ref)
                            case.update(rel_rms=err, cublas_rel_rms=cublas_err, tol=TOL[dtype],
                                        status="pass" if err <= TOL[dtype] else "FAIL")
                        except Exception as e:  # noqa: BLE001
                            case.update(status="ERROR", error=f"{e!r}"[:600])
                        cases.append(case)
                if save is not None:                # a hang later still leaves these cases on record
                    save(dict(backend=backend, cases=cases, incomplete=True))
    # The public function with backend="auto" must dispatch to Gluon on an sm_90 GPU for aligned inputs.
    try:
        a = _operand(512, 512, "row", torch.bfloat16, gen)
        auto = op_backends("matmul").select("auto", a=a, b=a).name
        api_err = _rel_rms_gpu(matmul(a, a, backend=backend), a.float() @ a.float())
        if not api_err <= TOL[torch.bfloat16]:
            cases.append(dict(M=512, N=512, K=512, via="matmul(backend=...)", rel_rms=api_err, status="FAIL"))
    except Exception as e:  # noqa: BLE001
        auto, api_err = f"error: {e!r}"[:300], None
        cases.append(dict(M=512, N=512, K=512, via="matmul(backend=...)", status="ERROR", error=auto))
    ran = [c for c in cases if c["status"] != "unsupported"]
    passed = bool(ran) and all(c["status"] == "pass" for c in ran)
    return dict(backend=backend, passed=passed, auto_backend=auto, api_rel_rms=api_err,
                n_cases=len(cases), n_ran=len(ran), failures=[c for c in ran if c["status"] != "pass"],
                cases=cases)


# ----------------------------------------------------------------------------------------------- bench

def _gpu_rel_err(out, ref) -> float:
    """Relative Frobenius error computed on the GPU (the large outputs are too big to move to the host)."""
    import torch
    o = out.float()
    if not torch.isfinite(o).all():
        return math.inf
    return ((o - ref).norm() / ref.norm()).item()


def _graph_ms(fn, sets, reps: int = 10) -> float:
    """Milliseconds per call replaying one CUDA graph that makes one call per input set: kernel time without
    any host cost (what the eager timing would be if the host path were free)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                  # warm up on the capture stream (allocator, plans)
        for a, b, out in sets:
            fn(a, b, out)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for a, b, out in sets:
            fn(a, b, out)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * len(sets))


def _bench_impls(backend: str) -> dict:
    """name -> (fn(a, b, out), shapes it runs on)."""
    import torch
    from linattn.ops.matmul.launch import host_path
    if backend == "cublas":
        return {"cublas": (lambda a, b, out: torch.matmul(a, b, out=out), BENCH_SHAPES)}
    launch = _launcher(backend)

    def with_handle(f):
        def call(a, b, out):                     # a plain flag flip: a context manager would cost microseconds
            saved, host_path.handle = host_path.handle, True
            try:
                f(a, b, out)
            finally:
                host_path.handle = saved
        return call
    fns = {backend: (launch, BENCH_SHAPES), f"{backend}+handle": (with_handle(launch), SMALL)}
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import CONFIGS
        for name, cfg in CONFIGS.items():
            f = (lambda c: (lambda a, b, out: launch(a, b, out, c)))(cfg)
            fns[f"gluon[{name}]"] = (f, SKINNY if cfg.split_k > 1 else BENCH_SHAPES)
    return fns


def bench(backend: str, save, skip=()) -> dict:
    """Time every implementation of `backend` on BENCH_SHAPES; `save(partial)` is called after every row so a
    crash in a later config keeps the earlier timings. Each timed config is then checked at full size.
    `skip`: Gluon config names whose gate did not pass (not timed)."""
    import torch
    import triton
    from linattn.testing import TOL
    fns = {n: f for n, f in _bench_impls(backend).items() if not any(n == f"gluon[{c}]" for c in skip)}
    rows, paired = [], {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (M, N, K) in BENCH_SHAPES:
        # Rotate through enough input sets that together they exceed the 50 MB L2 several times over.
        per_set = (M * K + K * N + M * N) * 2
        n_sets = max(2, min(16, math.ceil(256e6 / per_set)))
        sets = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
                 torch.randn(K, N, device="cuda", dtype=torch.bfloat16),
                 torch.empty(M, N, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
        ref0 = sets[0][0].float() @ sets[0][1].float()
        for name, (fn, shapes) in fns.items():
            if (M, N, K) not in shapes:
                continue
            row = dict(shape=[M, N, K], impl=name)
            if name.split("+")[0] == "gluon":
                from linattn.ops.matmul.gluon.matmul import pick_config
                row["config"] = repr(pick_config(M, N, K, sms))
            elif name.split("+")[0] == "triton":
                from linattn.ops.matmul.triton.matmul import pick_config as tpick
                row["config"] = repr(tpick(M, N, K, sms))
            try:
                call = _rotating(fn, sets)
                call()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                row.update(ms=ms, tflops=2.0 * M * N * K / (ms * 1e-3) / 1e12)
                if (M, N, K) in SMALL:
                    try:
                        row["ms_graph"] = _graph_ms(fn, sets)
                    except Exception as e:  # noqa: BLE001 - a capture failure must not void the eager timing
                        row["ms_graph_error"] = f"{e!r}"[:300]
                        torch.cuda.synchronize()
                a0, b0, out0 = sets[0]
                out0.fill_(float("nan"))
                fn(a0, b0, out0)
                err = _gpu_rel_err(out0, ref0)
                row.update(post_check_rel_err=err, valid=err <= TOL[torch.bfloat16])
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{e!r}"[:600]
            rows.append(row)
            save(dict(backend=backend, rows=rows, paired=paired, incomplete=True))
        valid = {r["impl"] for r in rows if r["shape"] == [M, N, K] and r.get("valid")}
        if backend == "gluon" and (M, N, K) in LARGE and all(f"gluon[{n}]" in valid for n in PAIRED_CONFIGS):
            # Direction 3: the two 128x256 configs timed alternately, 5 rounds each, so that clock or thermal
            # drift during the section (round 6 saw 5% between two rows of the same config) hits both alike.
            pair = {name: [] for name in PAIRED_CONFIGS}
            try:
                for _ in range(5):
                    for name in PAIRED_CONFIGS:
                        call = _rotating(fns[f"gluon[{name}]"][0], sets)
                        pair[name].append(triton.testing.do_bench(call, warmup=5, rep=40, return_mode="median"))
                paired["x".join(map(str, (M, N, K)))] = dict(ms=pair,
                                                             median_ms={n: sorted(v)[2] for n, v in pair.items()})
            except Exception as e:  # noqa: BLE001
                paired["x".join(map(str, (M, N, K)))] = dict(ms=pair, error=f"{e!r}"[:600])
        del sets, ref0
        torch.cuda.empty_cache()
    return dict(backend=backend, rows=rows, paired=paired, skipped_configs=list(skip))


def _rotating(fn, sets):
    """A no-argument call that runs fn on the next input set each time."""
    state = {"i": 0}

    def call():
        a, b, out = sets[state["i"] % len(sets)]
        state["i"] += 1
        fn(a, b, out)
    return call


# ------------------------------------------------------------------------------------------------ host

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _store_zeros(x_ptr, n, BLOCK: tl.constexpr):
    """The smallest real kernel: its launch cost is the floor under any Triton/Gluon launch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, 0.0, mask=offs < n)


PAIRED_CONFIGS = ("128x256x64_s3_w8", "128x256x64_s4_w8_e2")
HOST_MODES = {"jit": dict(plan_cache=False, handle=False),          # no plans: the path of rounds 2-6
              "plan": dict(plan_cache=True, handle=False),          # the default
              "plan+handle": dict(plan_cache=True, handle=True)}    # plus the compiled-handle launch
HOST_CASES = [((2000, 3000, 1000), ("cublas", "triton", "gluon", "auto")), ((16384, 128, 16384), ("cublas", "auto"))]
N_HOST_CALLS = 1000


def _per_call_us(fn, sync=None):
    """(graph_us, eager_us, host_us) per call of fn(): a CUDA graph of 20 calls replayed 5 times; events over
    200 back-to-back eager calls; the host clock over N_HOST_CALLS calls with no synchronisation inside."""
    import torch
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                fn()
        g.replay()
        torch.cuda.synchronize()
        e0.record()
        for _ in range(5):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        graph_us = e0.elapsed_time(e1) * 1e3 / 100
        del g
    except Exception as e:  # noqa: BLE001 - keep the eager and host timings of a path that cannot be captured
        graph_us = f"capture failed: {e!r}"[:300]
        torch.cuda.synchronize()
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    e0.record()
    for _ in range(200):
        fn()
    e1.record()
    torch.cuda.synchronize()
    eager_us = e0.elapsed_time(e1) * 1e3 / 200
    t0 = time.perf_counter()
    for _ in range(N_HOST_CALLS):
        fn()
    host_us = (time.perf_counter() - t0) * 1e6 / N_HOST_CALLS
    torch.cuda.synchronize()
    return graph_us, eager_us, host_us


def _profile_top(fn, calls=200, top=15) -> list:
    import cProfile
    import io
    import pstats
    import torch
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return lines[-(top + 1):]                     # the header row and the top entries


def host(save) -> dict:
    """Direction 1 of benchmarks/MATMUL.md: where a small GEMM's time goes on the host."""
    import torch
    from linattn.ops.matmul import matmul
    from linattn.ops.matmul.launch import host_path_options
    res = dict(rows=[], floor={}, n_host_calls=N_HOST_CALLS)
    for (M, N, K), impls in HOST_CASES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        calls = {"cublas": lambda: torch.matmul(a, b), "triton": lambda: matmul(a, b, backend="triton"),
                 "gluon": lambda: matmul(a, b, backend="gluon"), "auto": lambda: matmul(a, b)}
        for impl in impls:
            for mode in (("-",) if impl == "cublas" else tuple(HOST_MODES)):
                row = dict(shape=[M, N, K], impl=impl, mode=mode)
                try:
                    with host_path_options(**HOST_MODES.get(mode, {})):
                        graph_us, eager_us, host_us = _per_call_us(calls[impl])
                        excess = eager_us - graph_us if isinstance(graph_us, float) else None
                        row.update(graph_us=graph_us, eager_us=eager_us, host_us=host_us, host_excess_us=excess,
                                   profile_top15=_profile_top(calls[impl]))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{e!r}"[:600]
                res["rows"].append(row)
                save(dict(res, incomplete=True))
        calls = None

    # The floor: what launching any Triton kernel costs on this host, and the output allocation.
    x = torch.empty(16, device="cuda")
    k = _store_zeros[(1,)](x, 16, BLOCK=16)
    for name, fn in {"triton_jit_launch": lambda: _store_zeros[(1,)](x, 16, BLOCK=16),
                     "triton_handle_launch": lambda: k[(1, 1, 1)](x, 16, 16),
                     "torch_empty_2000x3000": lambda: torch.empty(2000, 3000, device="cuda", dtype=torch.bfloat16)
                     }.items():
        try:
            graph_us, eager_us, host_us = _per_call_us(fn)
            res["floor"][name] = dict(graph_us=graph_us, eager_us=eager_us, host_us=host_us)
        except Exception as e:  # noqa: BLE001
            res["floor"][name] = dict(error=f"{e!r}"[:600])
        save(dict(res, incomplete=True))
    return res


# ------------------------------------------------------------------------------------- orchestration

def run_section(section: str, out_dir: str, deadline: float, skip=()) -> dict:
    """Run one section in a child process (timeout = its budget or what is left of the total)."""
    path = os.path.join(out_dir, f"part_{section}.json")
    if os.path.exists(path):
        os.remove(path)
    timeout = max(5.0, min(SECTION_TIMEOUT_S[section], deadline - time.time()))
    t0 = time.time()
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--section", section, "--out", out_dir]
        if skip:
            cmd += ["--skip", ",".join(skip)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr)[-3000:]
        res = _read_part(path)
        if res is None:
            res = dict(error=f"child exited with {proc.returncode} and wrote nothing", log_tail=tail)
        elif proc.returncode != 0 or res.get("incomplete"):
            res["error"] = f"child exited with {proc.returncode} before finishing"
            res["log_tail"] = tail
    except subprocess.TimeoutExpired:
        res = _read_part(path) or {}
        res["error"] = f"timed out after {timeout:.0f} s (a hang: check mbarrier phases / expect bytes)"
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def _read_part(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def child(section: str, out_dir: str, skip=()) -> None:
    kind, _, backend = section.partition("_")
    path = os.path.join(out_dir, f"part_{section}.json")

    def save(res):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.replace(tmp, path)
    try:
        res = (gate(backend, save) if kind == "gate" else bench(backend, save, skip) if kind == "bench"
               else host(save))
    except Exception:  # noqa: BLE001
        res = dict(_read_part(path) or {}, error=traceback.format_exc()[-3000:])
    res.pop("incomplete", None)
    save(res)


def _geomean(xs):
    """None when any shape lacks a timing: a missing shape must not make a target look met."""
    if not xs or any(x is None or x <= 0 for x in xs):
        return None
    return math.exp(sum(map(math.log, xs)) / len(xs))


def summarise(result: dict) -> list:
    lines = []
    env = result["environment"]
    lines.append(f"env: {env.get('line', env)}")
    for b in ("triton", "gluon", "gluonx"):
        g = result["gate"].get(b, {})
        if "error" in g:
            lines.append(f"gate {b}: ERROR {g['error'][-400:]}")
            bad = [c for c in g.get("cases", []) if c.get("status") not in ("pass", "unsupported")]
            lines.append(f"   configs with only passing cases before the error: {sorted(_passed_configs(g))}; "
                         f"first failures: {bad[:3]}")
        else:
            errs = [c["rel_rms"] for c in g["cases"] if "rel_rms" in c]
            lines.append(f"gate {b}: {'PASS' if g['passed'] else 'FAIL'} ({g['n_ran']}/{g['n_cases']} cases ran, "
                         f"max rel_rms {max(errs) if errs else float('nan'):.2e}, auto -> {g['auto_backend']})")
            for c in g["failures"][:6]:
                lines.append(f"   {c}")
            if b != "triton":
                lines.append(f"   configs passed: {sorted(_passed_configs(g))}")
    times = {}
    for part in result["bench"].values():
        if "error" in part:
            lines.append(f"bench error: {part['error'][-400:]}")
        for r in part.get("rows", []):
            if "ms" in r and not r.get("valid", False):
                # Wrong at full size: keep the row in the JSON, but never count it as a timing.
                lines.append(f"INVALID result, timing discarded: {r['impl']} {r['shape']} "
                             f"rel err {r.get('post_check_rel_err')}")
                r = dict(r, error="post-check failed")
                r.pop("ms")
            times[(tuple(r["shape"]), r["impl"])] = r
    impls = sorted({k[1] for k in times}, key=lambda s: (s != "cublas", s != "triton", s != "gluon", s))
    lines.append(f"{'M x N x K':>17} {'implementation':<30} {'ms':>8} {'TFLOP/s':>8} {'/cuBLAS':>8} {'ms_graph':>9}")
    for shape in BENCH_SHAPES:
        base = times.get((shape, "cublas"), {}).get("ms")
        for i in impls:
            r = times.get((shape, i))
            if r is None:
                continue
            if "ms" in r:
                ratio = f"{base / r['ms']:.0%}" if base else "-"
                graph = f"{r['ms_graph']:.4f}" if "ms_graph" in r else "-"
                lines.append(f"{'x'.join(map(str, shape)):>17} {i[:30]:<30} {r['ms']:8.4f} {r['tflops']:8.0f} "
                             f"{ratio:>8} {graph:>9}")
            else:
                lines.append(f"{'x'.join(map(str, shape)):>17} {i[:30]:<30} error: {str(r.get('error'))[:60]}")
    ratio = lambda s, num, den: (times[(s, den)]["ms"] / times[(s, num)]["ms"]  # noqa: E731
                                 if "ms" in times.get((s, num), {}) and "ms" in times.get((s, den), {}) else None)
    targets = {
        "gluon/cublas geomean, large (>= 0.98)": (_geomean([ratio(s, "gluon", "cublas") for s in LARGE]), 0.98),
        "gluon/cublas geomean, irregular (>= 0.90)": (_geomean([ratio(s, "gluon", "cublas") for s in IRREGULAR]), 0.90),
        "gluon/triton geomean, large (>= 1.08)": (_geomean([ratio(s, "gluon", "triton") for s in LARGE]), 1.08),
    }
    result["targets"] = {}
    for name, (val, goal) in targets.items():
        met = val is not None and val >= goal
        result["targets"][name] = dict(value=val, goal=goal, met=met)
        lines.append(f"target {name}: {'n/a' if val is None else f'{val:.3f}'} -> {'met' if met else 'NOT met'}")
    lines += summarise_directions(result, times, ratio)
    return lines


# The 1 GiB copy bandwidth `linattn bench` measured on this H200 in round 5 (benchmarks/RESULTS.md): the skinny
# shape must stream A (M x K bf16) from HBM at least once, so its time is bounded below by bytes / this.
HBM_COPY_TBPS = 4.26


def summarise_directions(result: dict, times: dict, ratio) -> list:
    """result["directions"]: the numbers benchmarks/MATMUL.md's three predictions are checked against."""
    ms = lambda shape, impl: times.get((shape, impl), {}).get("ms")  # noqa: E731
    d = {}
    # 1. host path: per implementation and mode on the small shape, eager vs graph-replayed per-call time.
    host = result.get("host", {})
    d["1_host"] = {f"{r['impl']}|{r['mode']}|{'x'.join(map(str, r['shape']))}":
                   {k: r.get(k) for k in ("graph_us", "eager_us", "host_us", "host_excess_us", "error") if k in r}
                   for r in host.get("rows", [])}
    d["1_host"]["floor"] = host.get("floor")
    small = IRREGULAR[0]
    d["1_small_shape_bench_ms"] = {i: ms(small, i) for i in ("cublas", "triton", "triton+handle", "gluon",
                                                             "gluon+handle")}
    d["1_irregular_geomean_gluon+handle/cublas"] = _geomean([ratio(s, "gluon+handle", "cublas") for s in IRREGULAR])
    # 2. skinny: every variant vs cuBLAS and vs the HBM bound of streaming A once.
    d["2_skinny"] = {}
    for shape in SKINNY:
        M, N, K = shape
        d["2_skinny"]["x".join(map(str, shape))] = dict(
            bound_ms=M * K * 2 / (HBM_COPY_TBPS * 1e12) * 1e3,
            ms={i: ms(shape, i) for (sh, i) in times if sh == shape and ms(shape, i) is not None},
            ms_graph={i: times[(shape, i)].get("ms_graph") for (sh, i) in times if sh == shape})
    # 3. large: the subtiled-epilogue 4-stage config against the 3-stage one it replaces, and against cuBLAS.
    d["3_large"] = {}
    for shape in LARGE:
        s3, e2 = ms(shape, "gluon[128x256x64_s3_w8]"), ms(shape, "gluon[128x256x64_s4_w8_e2]")
        d["3_large"]["x".join(map(str, shape))] = dict(
            s3_ms=s3, e2_ms=e2, e2_speedup=(s3 / e2 if s3 and e2 else None),
            e2_vs_cublas=ratio(shape, "gluon[128x256x64_s4_w8_e2]", "cublas"),
            auto_vs_cublas=ratio(shape, "gluon", "cublas"))
    paired = result.get("bench", {}).get("gluon", {}).get("paired", {})
    for shape, p in paired.items():
        med = p.get("median_ms", {})
        if shape in d["3_large"] and len(med) == 2:
            d["3_large"][shape]["paired_median_ms"] = med
            d["3_large"][shape]["paired_e2_speedup"] = med[PAIRED_CONFIGS[0]] / med[PAIRED_CONFIGS[1]]
    d["3_large_geomean_e2/cublas"] = _geomean([ratio(s, "gluon[128x256x64_s4_w8_e2]", "cublas") for s in LARGE])
    d["3_large_geomean_e2/triton"] = _geomean([ratio(s, "gluon[128x256x64_s4_w8_e2]", "triton") for s in LARGE])
    result["directions"] = d
    out = ["host path, 2000x3000x1000 and 16384x128x16384 (us per call: graph replay / eager / host clock):"]
    if "error" in host:
        out.append(f"   host section error: {(str(host['error']).strip().splitlines() or [''])[-1][:300]}")
    f = lambda v: f"{v:8.1f}" if isinstance(v, (int, float)) else f"{str(v)[:8]:>8}"  # noqa: E731
    for key, r in d["1_host"].items():
        if key != "floor":
            out.append(f"   {key:<42} " + (f"{f(r['graph_us'])} {f(r['eager_us'])} {f(r['host_us'])}"
                                            if "eager_us" in r else str(r.get("error"))[:80]))
    for key, r in (d["1_host"]["floor"] or {}).items():
        out.append(f"   floor {key:<36} " + (f"{f(r['graph_us'])} {f(r['eager_us'])} {f(r['host_us'])}"
                                              if "eager_us" in r else str(r.get("error"))[:80]))
    for shape, r in d["2_skinny"].items():
        out.append(f"skinny {shape}: HBM bound {r['bound_ms']:.4f} ms; " +
                   ", ".join(f"{i} {v:.4f}" for i, v in sorted(r["ms"].items(), key=lambda kv: kv[1])))
    for shape, r in d["3_large"].items():
        out.append(f"large {shape}: 128x256 s3 {r['s3_ms']} ms, s4+split epilogue {r['e2_ms']} ms "
                   f"(speedup {r['e2_speedup']}; paired, 5 alternating rounds: {r.get('paired_e2_speedup')})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for matmul.json")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.section:
        child(args.section, args.out, [c for c in args.skip.split(",") if c])
        return 0
    deadline = time.time() + TOTAL_BUDGET_S
    result = dict(environment=environment(), gate={}, bench={}, host={})
    out_json = os.path.join(args.out, "matmul.json")

    def checkpoint(kind, name, res):
        # Progress line and a partial JSON after every section, in case the whole run is cut short. Only a gate
        # has a verdict; bench and host sections are "done" unless they recorded an error (round 9 printed
        # "host small: FAILED" for a host section that had finished with every row timed).
        state = ("error" if "error" in res else "done" if kind != "gate"
                 else "passed" if res.get("passed") else "FAILED")
        print(f"[{time.strftime('%H:%M:%S')}] {kind} {name}: {state} ({res.get('wall_s')} s)", flush=True)
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1, default=str)

    for b in ("triton", "gluon", "gluonx"):
        result["gate"][b] = run_section(f"gate_{b}", args.out, deadline)
        checkpoint("gate", b, result["gate"][b])
        if b == "gluon":
            # Before the experimental gate: a hang there must not eat the host section's share of the budget.
            # (The host section uses only round-6 configs: 128x128 s5 on both of its shapes.)
            result["host"] = run_section("host", args.out, deadline)
            checkpoint("host", "small", result["host"])
    # Experimental Gluon configs are timed only if their own gate passed (the base configs' gate decides
    # whether Gluon is benchmarked at all).
    try:
        gx_names = [n for n, c in _variants("gluonx") if c is not None]
    except Exception:  # noqa: BLE001 - no Gluon here: its gates have already said why
        gx_names = []
    gx_ok = _passed_configs(result["gate"]["gluonx"])
    skip = [n for n in gx_names if n not in gx_ok]
    for b in ("cublas", "triton", "gluon"):
        if b != "cublas" and not result["gate"][b].get("passed"):
            # A kernel that failed (or could not run) its gate is not timed as if it were valid.
            result["bench"][b] = dict(error=f"not benchmarked: {b} gate did not pass")
            continue
        result["bench"][b] = run_section(f"bench_{b}", args.out, deadline, skip if b == "gluon" else ())
        checkpoint("bench", b, result["bench"][b])
    try:
        lines = summarise(result)
    except Exception:  # noqa: BLE001
        lines = ["summary failed:", traceback.format_exc()]
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print("\n".join(lines))
    print(f"wrote {out_json}")
    gates_ok = all(result["gate"][b].get("passed") for b in ("triton", "gluon", "gluonx"))
    return 0 if gates_ok else 1


if __name__ == "__main__":
    sys.exit(main())
