"""The fresh process that times one backend: `python -m linattn.bench.child '<job json>'`, started by
linattn.bench.runner once per (round, backend). It prints one JSON object on stdout (everything else it or the
libraries print goes to stderr) with every row's eager and CUDA-graph timing, the ceilings measured in this
process, its environment and clocks.

Each row: inputs made once from fixed seeds (so every process and backend gets the same numbers), the first call
(compilation and autotuning happen here; its outputs are the ones checked), then eager timing, then the graph.

Checks, in the job's check round only: the first backend that runs a (shape, mode) and computes the op (not SDPA)
is that row's anchor: it saves its outputs (o, final state, in fwdbwd mode the gradients) to the job's
`compare_dir` and is itself checked against the reference backend (fp32 chunk form, same inputs) when the problem
is small (B*T*HV <= REFERENCE_LIMIT; `linattn verify` checks against fp64 on its case matrix). Every later
backend's process loads the anchor's outputs and compares its own with them.
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback
from typing import Dict

import torch

from linattn.bench.env import collect_env, env_line, nvidia_smi
from linattn.bench.ops import Unavailable, get_bench_op
from linattn.bench.presets import shape_label
from linattn.bench.timing import measure_ceilings, num_input_sets, step, time_eager, time_graph
from linattn.testing import TOL

REFERENCE_LIMIT = 8192 * 32          # B*T*HV: the reference's chunk loop stays near a second on a GPU


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, like linattn.testing.rel_rms but on the device in fp32: production outputs are
    gigabytes, and an fp64 copy on the host would cost more than the whole row. NaN or inf gives inf."""
    o, r = out.detach().float(), ref.detach().float()
    if o.shape != r.shape:
        raise AssertionError(f"shape mismatch: {tuple(o.shape)} vs {tuple(r.shape)}")
    if not bool(torch.isfinite(o).all()):
        return math.inf
    den = float(r.norm())
    num = float((o - r).norm())
    return num / den if den else num


def _lead(inputs: Dict) -> torch.Tensor:
    """The input that names the row's device and dtype: q (the ops), x (the layer), else the first tensor."""
    for name in ("q", "x"):
        if name in inputs:
            return inputs[name]
    return next(v for v in inputs.values() if isinstance(v, torch.Tensor))


def _collect(runner, outs, grads, mode) -> Dict[str, torch.Tensor]:
    named = {n: t.detach().clone() for n, t in zip(runner.out_names, outs) if t is not None}
    if mode == "fwdbwd":
        named.update({n: t.detach().clone() for n, t in zip(runner.grad_names, grads) if t is not None})
    return named


def _compare(out: Dict, ref: Dict) -> Dict[str, float]:
    return {n: rel_err(out[n], ref[n]) for n in ref if n in out}


def _reference_check(op, backend, shape, inputs, mode, out) -> Dict:
    if op.reference == backend:
        return dict(status="is the reference")
    if not op.reference:
        return dict(status="no reference for this op: compared between backends only")
    if shape["B"] * shape["T"] * shape["HV"] > REFERENCE_LIMIT:
        return dict(status=f"skipped: B*T*HV above {REFERENCE_LIMIT} (slow reference); `linattn verify` checks "
                           "this backend against fp64 on its case matrix")
    try:
        runner = op.prepare(op.reference, shape, inputs, mode)
        ref = _collect(runner, *step(runner.fn, *runner.args(inputs, mode)), mode)
    except Exception as e:
        return dict(status=f"error: {type(e).__name__}: {e}")
    errors = _compare(out, ref)
    tol = TOL.get(_lead(inputs).dtype, 1e-3)
    return dict(status="pass" if all(e <= tol for e in errors.values()) else "FAIL", errors=errors, tol=tol)


def _check(op, backend, shape, key, sets, mode, runner, out, compare_dir) -> Dict:
    """The row's check fields: anchor (saved, checked against the reference) or compared with the anchor."""
    if not runner.compare:
        return dict(compared_to="not compared: another function")
    path = os.path.join(compare_dir, key + ".pt")
    if os.path.exists(path):
        anchor = torch.load(path, map_location=_lead(sets[0]).device, weights_only=True)
        name = anchor.pop("_backend")
        return dict(compared_to=name, errors=_compare(out, anchor))
    torch.save(dict({n: t.cpu() for n, t in out.items()}, _backend=backend), path)
    ref = _reference_check(op, backend, shape, sets[0], mode, out)
    return dict(compared_to="reference" if op.reference else "anchor",
                reference_check=ref, errors=ref.get("errors", {}))


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run_row(op, backend: str, shape: Dict, key: str, sets, mode: str, job: Dict) -> Dict:
    t_row = time.perf_counter()
    row = dict(key=key, shape_label=shape_label(shape), mode=mode)
    try:
        runner = op.prepare(backend, shape, sets[0], mode)
    except Unavailable as e:
        return dict(row, status="skipped", reason=str(e))
    row.update(family=runner.family, notes=runner.notes)
    try:
        arg_sets = [runner.args(s, mode) for s in sets]
        t0 = time.perf_counter()
        first = step(runner.fn, *arg_sets[0])
        if _lead(sets[0]).device.type == "cuda":
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        out = _collect(runner, *first, mode) if job.get("compare_dir") else None
        del first
        dev = _lead(sets[0]).device
        row["eager"] = time_eager(runner.fn, arg_sets, job["repeats"], job["warmup"], dev)
    except Exception as e:
        return dict(row, status="error", reason=_first_line(e), traceback=traceback.format_exc(limit=6))
    try:                                            # a graph that fails after capture keeps the eager numbers
        row["graph"] = time_graph(runner.fn, arg_sets, job["repeats"], dev) if job.get("graph", True) else \
            dict(status="n/a", reason="not asked for (--no-graph)")
    except Exception as e:
        row["graph"] = dict(status="n/a", reason=f"replay failed: {_first_line(e)}")
    row["status"] = "ok"
    if mode == "fwdbwd":
        row["grads"] = "verified" if runner.grads_verified else "unverified"
    if out is not None:
        try:
            row.update(_check(op, backend, shape, key, sets, mode, runner, out, job["compare_dir"]))
        except Exception as e:
            row["compared_to"] = f"check failed: {_first_line(e)}"
    row["wall_s"] = time.perf_counter() - t_row
    return row


def _log(line: str):
    print(line, file=sys.stderr, flush=True)


def _log_row(backend: str, rnd: int, r: Dict):
    head = f"[bench] round {rnd} {backend:<9} {r['shape_label']:<34} {r['mode']:<6}"
    if r["status"] != "ok":
        return _log(f"{head} {r['status']}: {r.get('reason')}")
    g = r["graph"]
    graph = f"{g['median_ms']:.3f} ms" if g["status"] == "ok" else f"n/a ({g['reason'][:60]})"
    errs = r.get("errors") or {}
    check = f"; max rel err {max(errs.values()):.1e} vs {r.get('compared_to')}" if errs else ""
    _log(f"{head} eager {r['eager']['median_ms']:.3f} ms, graph {graph}{check}; first call {r['first_call_s']:.2f} s")


def run_job(job: Dict) -> Dict:
    """Time job["backend"] on every (shape, mode) of the job, in this process. Job keys: op, backend, shapes,
    modes, device, repeats, warmup, round, graph (default True), compare_dir (None: no checks)."""
    t_start = time.perf_counter()
    op = get_bench_op(job["op"])
    dev = torch.device(job["device"])
    backend, rnd = job["backend"], job.get("round", 0)
    import linattn
    result = dict(backend=backend, round=rnd, pid=os.getpid(), rows=[],
                  linattn=os.path.dirname(os.path.abspath(linattn.__file__)),
                  clocks_at_start=nvidia_smi() if dev.type == "cuda" else {})
    result["ceilings"] = measure_ceilings(dev)
    for i, shape in enumerate(job["shapes"]):
        for mode in job["modes"]:
            n_sets = num_input_sets(op.bytes(shape, mode, ""), dev, op.max_sets)
            sets = [op.make_inputs(shape, dev, 1000 * i + j, mode) for j in range(n_sets)]
            row = run_row(op, backend, shape, f"{i}-{mode}", sets, mode, job)
            result["rows"].append(row)
            _log_row(backend, rnd, row)
            del sets
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    # the environment last: it imports fla and flash_qla for their versions, which must not happen before a
    # peer's runner has set the variables it imports them under
    result["env"] = collect_env(dev)
    result["env_line"] = env_line(result["env"])
    result["wall_s"] = time.perf_counter() - t_start
    return result


def main(argv) -> int:
    if len(argv) != 1:
        print("usage: python -m linattn.bench.child '<job json>'", file=sys.stderr)
        return 2
    job = json.loads(argv[0])
    # stdout carries the result alone: whatever Python or a library prints on file descriptor 1 goes to stderr
    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    result = run_job(job)
    out.write(json.dumps(result, default=str, allow_nan=True) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
