"""Shared by the GPU scripts: the environment record (one implementation, linattn.bench.env) and JSON writing."""
import json
import os


def env_line() -> dict:
    """The environment dict of linattn.bench.env with its one-line summary under "line"."""
    import torch

    from linattn.bench.env import collect_env, env_line as line
    env = collect_env("cuda" if torch.cuda.is_available() else "cpu")
    env["line"] = line(env)
    return env


def round_result(script: str, device: str, **flags) -> dict:
    """A round script's result dict as it starts: {"script", "device", **flags, "env": env_line()'s one line (or the
    error that kept it from being read)}."""
    res = dict(script=script, device=device, **flags)
    try:
        res["env"] = env_line()["line"]
    except Exception as e:  # noqa: BLE001
        res["env"] = repr(e)[:200]
    return res


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def median_ms(fn, warmup: int = 5, repeats: int = 20) -> float:
    """Median ms of `repeats` eager calls of fn after `warmup` (CUDA events around each call on a GPU; one host-
    clock call on the CPU, where only a script's logic is being exercised). Eager: includes the host path when it
    is longer than the kernels (graph_ms separates the two)."""
    import time

    import torch
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from linattn.bench.timing import event_times_ms
    times = sorted(event_times_ms(fn, repeats))
    return times[len(times) // 2]


def host_us(fn, calls: int = 20) -> float:
    """Host-clock us per call of fn over `calls` back-to-back calls with no synchronisation inside (after a
    synchronised warm-up): the Python and launch cost alone while the GPU's launch queue absorbs the kernels
    (calls x launches per call must stay well under the queue's ~1000 entries)."""
    import time

    import torch
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) * 1e6 / calls
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def graph_ms(fn, repeats: int = 20) -> float:
    """Median ms of CUDA-graph replays of one call of fn: no host launch cost. Warm-up on a side stream first, as
    torch's graph docs require."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    ms = median_ms(graph.replay, warmup=2, repeats=repeats)
    del graph
    return ms


def cuda_profile(fn, iters: int = 10):
    """The torch profiler (CUDA activity) over `iters` calls of fn queued back to back, after 3 warm-up calls."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof


def run_sections(res: dict, sections, path: str) -> dict:
    """Run (name, fn) sections in order into res[name], each in try/except (an error is recorded with its trace
    and the next section still runs), timing each under res["section_s"], and rewrite the JSON at `path` after
    every section so a run cut short by a time limit keeps what it measured."""
    import time
    import traceback
    for name, fn in sections:
        t0 = time.time()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=f"{e!r}"[:600], trace=traceback.format_exc()[-2000:])
        res.setdefault("section_s", {})[name] = round(time.time() - t0, 1)
        write_json(path, res)
    return res


def case_runner(cases: list):
    """run(name, fn, **kw): one gate case, fn's dict merged into {"case": name}, an exception recorded as status
    ERROR with its trace (the next case still runs), the seconds under "s"; appended to `cases`."""
    import time
    import traceback

    def run(name, fn, **kw):
        case = dict(case=name)
        t0 = time.time()
        try:
            case.update(fn(**kw))
        except Exception as e:  # noqa: BLE001
            case.update(status="ERROR", error=f"{e!r}"[:600], trace=traceback.format_exc()[-1500:])
        case["s"] = round(time.time() - t0, 2)
        cases.append(case)
    return run


def run_rows(res: dict, path: str, rows, run_row, line, budget: float, start: float) -> None:
    """Timing rows (B, T) in order into res["rows"]: run_row(B, T) -> dict, an exception recorded as the row's
    error with its trace (the next row still runs), the row's seconds added, the JSON at `path` rewritten and
    line(row) printed after each; rows not started within `budget` seconds of `start` go to res["skipped"]."""
    import time
    import traceback
    for B, T in rows:
        if time.time() - start > budget:
            res["skipped"].append(f"B{B} T{T}")
            continue
        t0 = time.time()
        try:
            row = run_row(B, T)
        except Exception as e:  # noqa: BLE001 - record, the next row still runs
            row = dict(B=B, T=T, varlen=T == "varlen", error=f"{e!r}"[:600], trace=traceback.format_exc()[-2000:])
        row["seconds"] = round(time.time() - t0, 2)
        res["rows"].append(row)
        write_json(path, res)
        print(line(row), flush=True)


def start_round(script: str, json_name: str, budget: float = 110.0):
    """The usual start of a timing round script: --out DIR, --budget seconds, --dry-run (TRITON_INTERPRET=1 on the
    CPU; without it a GPU is required), linattn imported (it installs the interpreter fixes when interpreting), the
    result dict with the environment line, rows and skipped, and its JSON written once. Returns
    (args, dry, dev, path, res)."""
    import argparse
    import sys
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=budget)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch
        if not torch.cuda.is_available():
            sys.exit(f"{script} needs a GPU (or --dry-run)")
    dev = "cpu" if dry else "cuda"
    import linattn  # noqa: F401
    path = os.path.join(args.out, json_name)
    res = round_result(script, dev, dry_run=dry, rows=[], skipped=[])
    res["commit"] = os.environ.get("LINATTN_COMMIT", "")
    write_json(path, res)
    return args, dry, dev, path, res


def ab_sides(spec: str):
    """Two sides of a switch A/B from "label:VARIABLE=value,label:VARIABLE=value":
    ((label_a, (variable, value)), (label_b, (variable, value)))."""
    sides = []
    for part in spec.split(","):
        label, setting = part.split(":", 1)
        var, val = setting.split("=", 1)
        sides.append((label.strip(), (var.strip(), val.strip())))
    if len(sides) != 2 or sides[0][0] == sides[1][0]:
        raise ValueError(f"an A/B needs two differently labelled sides, got {spec!r}")
    return tuple(sides)


def switch_ab(call, sides, out: dict, timed: bool) -> None:
    """call() (returning (o, final state)) under each side's environment setting (ab_sides): the two results
    compared into out (o_b_vs_a, final_b_vs_a relative RMS, bit_equal, finite), then, when timed, CUDA-graph
    medians in the order a, b, a, b (a_ms_0, b_ms_0, a_ms_1, b_ms_1; a_ms / b_ms the better of each; speedup
    a_ms / b_ms). The variable is unset again after every call."""
    import torch

    from linattn.testing import rel_rms
    (la, (var_a, val_a)), (lb, (var_b, val_b)) = sides

    def run(side):
        var, val = (var_a, val_a) if side == la else (var_b, val_b)
        os.environ[var] = val
        try:
            return call()
        finally:
            os.environ.pop(var, None)
    oa, ha = run(la)
    ob, hb = run(lb)
    out.update({f"o_{lb}_vs_{la}": rel_rms(ob, oa), f"final_{lb}_vs_{la}": rel_rms(hb, ha),
                "bit_equal": bool(torch.equal(ob, oa) and torch.equal(hb, ha)),
                "finite": bool(torch.isfinite(ob).all() and torch.isfinite(hb).all())})
    if timed:
        for i, side in enumerate((la, lb, la, lb)):
            out[f"{side}_ms_{i // 2}"] = graph_ms(lambda: run(side))
        for side in (la, lb):
            out[f"{side}_ms"] = min(out[f"{side}_ms_0"], out[f"{side}_ms_1"])
        out["speedup"] = out[f"{la}_ms"] / out[f"{lb}_ms"]
