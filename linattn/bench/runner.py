"""One bench run: every (shape, mode, backend) row timed in this process, every output compared in this run.

Comparison: linattn's first backend that runs (in --backends order) is the anchor of each (shape, mode); it is
itself checked against the reference backend (fp32 chunk form, same inputs) when the problem is small enough
for the reference to be quick (B*T*HV <= REFERENCE_LIMIT; `linattn verify` checks against fp64 on its case
matrix). Every peer's outputs (o, final state, and in fwdbwd mode the gradients) are compared with the anchor.
"""
from __future__ import annotations

import gc
import math
import time
import traceback
from typing import Dict, List, Optional

import torch

from linattn.bench.env import collect_env, env_line
from linattn.bench.ops import Unavailable, get_bench_op
from linattn.bench.presets import get_preset, shape_label
from linattn.bench.report import SCHEMA, apply_baseline, fit
from linattn.testing import TOL
from linattn.bench.timing import cold_start, floor_ms, measure_ceilings, num_input_sets, step, time_calls

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


def _collect(runner, outs, grads, mode) -> Dict[str, torch.Tensor]:
    named = {n: t.detach().clone() for n, t in zip(runner.out_names, outs) if t is not None}
    if mode == "fwdbwd":
        named.update({n: t.detach().clone() for n, t in zip(runner.grad_names, grads) if t is not None})
    return named


def _compare(out: Dict, ref: Dict) -> Dict[str, float]:
    return {n: rel_err(out[n], ref[n]) for n in ref if n in out}


def _reference_check(op, shape, inputs, mode, anchor_out) -> Dict:
    if op.reference == anchor_out.get("_backend"):
        return dict(status="is the reference")
    if shape["B"] * shape["T"] * shape["HV"] > REFERENCE_LIMIT:
        return dict(status=f"skipped: B*T*HV above {REFERENCE_LIMIT} (slow reference); `linattn verify` checks "
                           "this backend against fp64 on its case matrix")
    try:
        runner = op.prepare(op.reference, shape, inputs, mode)
        kw, leaves, gouts = runner.args(inputs, mode)
        ref = _collect(runner, *step(runner.fn, kw, leaves, gouts), mode)
    except Exception as e:
        return dict(status=f"error: {type(e).__name__}: {e}")
    errors = _compare(anchor_out, ref)
    tol = TOL.get(inputs["q"].dtype, 1e-3)
    ok = all(e <= tol for e in errors.values())
    return dict(status="pass" if ok else "FAIL", errors=errors, tol=tol)


def _row_base(shape, mode, backend) -> Dict:
    return dict(shape=shape, shape_label=shape_label(shape), mode=mode, backend=backend)


def _run_one(op, backend, shape, mode, sets, ceilings, repeats, warmup, anchor: Optional[Dict]) -> Dict:
    t_row = time.perf_counter()
    row = _row_base(shape, mode, backend)
    try:
        runner = op.prepare(backend, shape, sets[0], mode)
    except Unavailable as e:
        return dict(row, status="skipped", reason=str(e))
    row.update(family=runner.family, notes=runner.notes)
    try:
        arg_sets = [runner.args(s, mode) for s in sets]
        # the check call: also the first warm-up call (compilation and autotuning happen here)
        out = _collect(runner, *step(runner.fn, *arg_sets[0]), mode)
        timing = time_calls(runner.fn, arg_sets, repeats, warmup, sets[0]["q"].device)
    except Exception as e:
        return dict(row, status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                    traceback=traceback.format_exc(limit=6))
    flops, nbytes = op.flops(shape, mode, backend), op.bytes(shape, mode, backend)
    fl = floor_ms(flops, nbytes, ceilings)
    ms = timing["median_ms"]
    row.update(status="ok", **timing, wall_s=time.perf_counter() - t_row, flops=flops, bytes=nbytes, tflops=flops / (ms * 1e-3) / 1e12,
               gbps=nbytes / (ms * 1e-3) / 1e9, pct_of_floor=100.0 * fl["floor_ms"] / ms, floor=fl)
    if mode == "fwdbwd":
        row["grads"] = "verified" if runner.grads_verified else "unverified"
    if not runner.compare:
        row["compared_to"] = "not compared: another function"
        row["_out"] = None
    elif anchor is None:
        row["_out"] = dict(out, _backend=backend)
    else:
        row.update(compared_to=anchor["_backend"], errors=_compare(out, anchor))
    return row


def _order(op, backends: List[str]) -> List[str]:
    """linattn's backends first (the first that runs is the anchor), then peers, each in the order given."""
    mine = [b for b in backends if b not in op.peers]
    return mine + [b for b in backends if b in op.peers]


def run_bench(op_name: str, preset: str, backends: List[str], modes: List[str], repeats: int, warmup: int = 3,
              device: Optional[str] = None, baseline: Optional[str] = None, cold: bool = False,
              cold_only: bool = False, log=None, on_progress=None) -> Dict:
    """on_progress(result): called after every cold start and every row (the CLI writes a partial JSON there,
    so a run cut short by a time limit still leaves its measurements)."""
    log = log or (lambda line: print(fit(line)))
    op = get_bench_op(op_name)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = get_preset(preset)
    env = collect_env(dev)
    ceilings = measure_ceilings(dev)
    log(f"[bench] {op.name} preset={preset} on {dev}: {env_line(env)}")
    log(f"[bench] ceilings: {ceilings['matmul_tflops']:.2f} TFLOP/s, {ceilings['copy_gbps']:.0f} GB/s ({ceilings['how']})")
    order = _order(op, backends)
    result = dict(schema=SCHEMA, op=op.name, preset=preset, device=str(dev), env=env, env_line=env_line(env),
                  ceilings=ceilings, backends=order, modes=modes, repeats=repeats, warmup=warmup,
                  bytes_model=op.bytes_model, flops_model=op.flops.__doc__.strip(), rows=[], cold=[],
                  comparison=__doc__.strip().split("\n\n")[1].replace("\n", " "))
    if cold:
        for mode in modes:
            for b in order:
                log(f"[bench] cold start {b} {mode} (fresh process) ...")
                result["cold"].append(cold_start(op.name, b, mode, shapes[0], str(dev)))
                _log_cold(log, result["cold"][-1])
                if on_progress:
                    on_progress(result)
    for i, shape in enumerate([] if cold_only else shapes):
        for mode in modes:
            set_bytes = op.bytes(shape, mode, "")
            n_sets = num_input_sets(set_bytes, dev, op.max_sets)
            sets = [op.make_inputs(shape, dev, 1000 * i + j, mode) for j in range(n_sets)]
            anchor = None
            for b in order:
                row = _run_one(op, b, shape, mode, sets, ceilings, repeats, warmup, anchor)
                out = row.pop("_out", None)
                if out is not None and anchor is None:
                    anchor = out
                    row["compared_to"] = "reference"
                    row["reference_check"] = _reference_check(op, shape, sets[0], mode, out)
                    row["errors"] = row["reference_check"].get("errors", {})
                result["rows"].append(row)
                _log_row(log, row)
                if on_progress:
                    on_progress(result)
            del sets, anchor
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    result["baseline"] = apply_baseline(result["rows"], baseline)
    return result


def _log_cold(log, c):
    if c.get("status") == "ok":
        log(f"[bench] cold start {c['backend']} {c['mode']}: first call {c['first_call_s']:.2f} s, "
            f"fresh process {c['process_s']:.1f} s")
    else:
        log(f"[bench] cold start {c['backend']} {c['mode']}: {c.get('status')}: {c.get('reason')}")


def _log_row(log, r):
    if r["status"] == "ok":
        errs = r.get("errors") or {}
        worst = f"{max(errs.values()):.1e}" if errs else "-"
        log(f"[bench] {r['shape_label']:<34} {r['mode']:<6} {r['backend']:<9} {r['median_ms']:.3f} ms "
            f"({r['timing'].split(';')[0]}) max rel err {worst} vs {r.get('compared_to')}; row took {r['wall_s']:.1f} s "
            "(compile, tuning, checks and timing)")
    else:
        log(f"[bench] {r['shape_label']:<34} {r['mode']:<6} {r['backend']:<9} {r['status']}: {r.get('reason')}")
