"""GPU gate and benchmark for linattn matmul (H200): `python benchmarks/gpu/matmul_gate.py --out DIR`.

1. gate: the Triton and Gluon paths against an fp32 product (relative RMS error, tolerance per dtype from
   linattn.testing.TOL) on ragged shapes, all four operand layouts, outputs poisoned with NaN first.
2. bench, same run: cuBLAS (torch.matmul), our Triton, our Gluon (only if its gate passed) on the preset shapes;
   median ms from triton.testing.do_bench over rotated inputs (so small problems do not run from L2),
   TFLOP/s and the ratio to cuBLAS. Alternative Gluon tile configs are timed too, to guide the heuristic.

Every section runs in a child process with a timeout, so a hung or crashing kernel (a wrong mbarrier phase
hangs; an LLVM error aborts the process) is recorded as that section's error and the rest still runs.
Writes DIR/matmul.json (with an environment line) and prints a short table. Budget: about 3 minutes.
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
                (2000, 3000, 1000), (16384, 128, 16384)]                        # irregular
LARGE, IRREGULAR = BENCH_SHAPES[:3], BENCH_SHAPES[3:]
TOTAL_BUDGET_S = 180
SECTION_TIMEOUT_S = {"gate_triton": 70, "gate_gluon": 80, "bench_cublas": 40, "bench_triton": 50, "bench_gluon": 70}


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
    the heuristic picks 128x128 on the gate's small shapes and 128x256 on the large benchmark shapes. Triton:
    its heuristic (the benchmark post-checks each timed config at full size)."""
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import CONFIGS
        return list(CONFIGS.items())
    return [("heuristic", None)]


def _launcher(backend):
    if backend == "triton":
        from linattn.ops.matmul.triton.matmul import matmul_triton
        return lambda a, b, out, cfg=None: matmul_triton(a, b, out=out, config=cfg)
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import matmul_gluon
        return lambda a, b, out, cfg=None: matmul_gluon(a, b, out=out, config=cfg)
    raise ValueError(backend)


def gate(backend: str) -> dict:
    import torch
    from linattn.ops.matmul import matmul
    from linattn.backends import op_backends
    from linattn.testing import TOL, rel_rms
    from linattn.ops.matmul.api import check_inputs
    launch = _launcher(backend)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    # Ragged: no dimension a multiple of the 128/256/64 tiles. Gluon needs K and N (and M for a transposed A)
    # to be multiples of 8 (16-byte TMA strides); Triton also gets odd sizes.
    shapes = [(2000, 3000, 1000), (520, 776, 136), (8, 8, 8), (1, 256, 4096), (4096, 264, 72)]
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
                cublas_err = rel_rms(torch.matmul(a, b), ref)
                base = dict(M=M, N=N, K=K, dtype=str(dtype).replace("torch.", ""), layout=f"{la}/{lb}")
                check_inputs(a, b)
                ok, reason = op_backends("matmul").backends[backend].supports(a=a, b=b)
                if not ok:
                    cases.append(dict(base, status="unsupported", reason=reason))
                    continue
                for name, cfg in _variants(backend):
                    case = dict(base, config=name)
                    try:
                        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)   # NaN poison
                        launch(a, b, out, cfg)
                        torch.cuda.synchronize()
                        err = rel_rms(out, ref)
                        case.update(rel_rms=err, cublas_rel_rms=cublas_err, tol=TOL[dtype],
                                    status="pass" if err <= TOL[dtype] else "FAIL")
                    except Exception as e:  # noqa: BLE001
                        case.update(status="ERROR", error=f"{e!r}"[:600])
                    cases.append(case)
    # The public function with backend="auto" must dispatch to Gluon on an sm_90 GPU for aligned inputs.
    try:
        a = _operand(512, 512, "row", torch.bfloat16, gen)
        auto = op_backends("matmul").select("auto", a=a, b=a).name
        api_err = rel_rms(matmul(a, a, backend=backend), a.float() @ a.float())
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


def bench(backend: str, save) -> dict:
    """Time every implementation of `backend` on BENCH_SHAPES; `save(partial)` is called after every row so a
    crash in a later config keeps the earlier timings. Each timed config is then checked at full size."""
    import torch
    import triton
    from linattn.testing import TOL
    fns = {}
    if backend == "cublas":
        fns["cublas"] = lambda a, b, out: torch.matmul(a, b, out=out)
    elif backend == "triton":
        fns["triton"] = _launcher("triton")
    else:
        from linattn.ops.matmul.gluon.matmul import CONFIGS
        launch = _launcher("gluon")
        fns["gluon"] = launch
        for name, cfg in CONFIGS.items():
            fns[f"gluon[{name}]"] = (lambda c: (lambda a, b, out: launch(a, b, out, c)))(cfg)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (M, N, K) in BENCH_SHAPES:
        # Rotate through enough input sets that together they exceed the 50 MB L2 several times over.
        per_set = (M * K + K * N + M * N) * 2
        n_sets = max(2, min(16, math.ceil(256e6 / per_set)))
        sets = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
                 torch.randn(K, N, device="cuda", dtype=torch.bfloat16),
                 torch.empty(M, N, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
        ref0 = sets[0][0].float() @ sets[0][1].float()
        for name, fn in fns.items():
            row = dict(shape=[M, N, K], impl=name)
            if name == "gluon":
                from linattn.ops.matmul.gluon.matmul import pick_config
                row["config"] = repr(pick_config(M, N, K, sms))
            elif name == "triton":
                from linattn.ops.matmul.triton.matmul import pick_config as tpick
                row["config"] = repr(tpick(M, N, K, sms))
            try:
                state = {"i": 0}

                def call():
                    a, b, out = sets[state["i"] % n_sets]
                    state["i"] += 1
                    fn(a, b, out)
                call()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                row.update(ms=ms, tflops=2.0 * M * N * K / (ms * 1e-3) / 1e12)
                a0, b0, out0 = sets[0]
                out0.fill_(float("nan"))
                fn(a0, b0, out0)
                err = _gpu_rel_err(out0, ref0)
                row.update(post_check_rel_err=err, valid=err <= TOL[torch.bfloat16])
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{e!r}"[:600]
            rows.append(row)
            save(dict(backend=backend, rows=rows, incomplete=True))
        del sets, ref0
        torch.cuda.empty_cache()
    return dict(backend=backend, rows=rows)


# ------------------------------------------------------------------------------------- orchestration

def run_section(section: str, out_dir: str, deadline: float) -> dict:
    """Run one section in a child process (timeout = its budget or what is left of the total)."""
    path = os.path.join(out_dir, f"part_{section}.json")
    if os.path.exists(path):
        os.remove(path)
    timeout = max(5.0, min(SECTION_TIMEOUT_S[section], deadline - time.time()))
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--section", section, "--out", out_dir],
                              capture_output=True, text=True, timeout=timeout)
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


def child(section: str, out_dir: str) -> None:
    kind, backend = section.split("_", 1)
    path = os.path.join(out_dir, f"part_{section}.json")

    def save(res):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.replace(tmp, path)
    try:
        res = gate(backend) if kind == "gate" else bench(backend, save)
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
    for b in ("triton", "gluon"):
        g = result["gate"][b]
        if "error" in g:
            lines.append(f"gate {b}: ERROR {g['error'][-400:]}")
        else:
            errs = [c["rel_rms"] for c in g["cases"] if "rel_rms" in c]
            lines.append(f"gate {b}: {'PASS' if g['passed'] else 'FAIL'} ({g['n_ran']}/{g['n_cases']} cases ran, "
                         f"max rel_rms {max(errs) if errs else float('nan'):.2e}, auto -> {g['auto_backend']})")
            for c in g["failures"][:6]:
                lines.append(f"   {c}")
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
    lines.append(f"{'M x N x K':>20} " + " ".join(f"{i[:26]:>26}" for i in impls))
    for shape in BENCH_SHAPES:
        base = times.get((shape, "cublas"), {}).get("ms")
        cells = []
        for i in impls:
            r = times.get((shape, i), {})
            if "ms" in r:
                ratio = f" {base / r['ms']:.0%}" if base else ""
                cells.append(f"{r['ms']:.3f}ms {r['tflops']:.0f}TF{ratio}")
            else:
                cells.append("error" if "error" in r else "-")
        lines.append(f"{'x'.join(map(str, shape)):>20} " + " ".join(f"{c:>26}" for c in cells))
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
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for matmul.json")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.section:
        child(args.section, args.out)
        return 0
    deadline = time.time() + TOTAL_BUDGET_S
    result = dict(environment=environment(), gate={}, bench={})
    out_json = os.path.join(args.out, "matmul.json")

    def checkpoint(kind, name, res):
        # Progress line and a partial JSON after every section, in case the whole run is cut short.
        state = "error" if "error" in res else ("passed" if res.get("passed") else "done" if kind == "bench"
                                                else "FAILED")
        print(f"[{time.strftime('%H:%M:%S')}] {kind} {name}: {state} ({res.get('wall_s')} s)", flush=True)
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1, default=str)

    for b in ("triton", "gluon"):
        result["gate"][b] = run_section(f"gate_{b}", args.out, deadline)
        checkpoint("gate", b, result["gate"][b])
    for b in ("cublas", "triton", "gluon"):
        if b != "cublas" and not result["gate"][b].get("passed"):
            # A kernel that failed (or could not run) its gate is not timed as if it were valid.
            result["bench"][b] = dict(error=f"not benchmarked: {b} gate did not pass")
            continue
        result["bench"][b] = run_section(f"bench_{b}", args.out, deadline)
        checkpoint("bench", b, result["bench"][b])
    try:
        lines = summarise(result)
    except Exception:  # noqa: BLE001
        lines = ["summary failed:", traceback.format_exc()]
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print("\n".join(lines))
    print(f"wrote {out_json}")
    gates_ok = all(result["gate"][b].get("passed") for b in ("triton", "gluon"))
    return 0 if gates_ok else 1


if __name__ == "__main__":
    sys.exit(main())
