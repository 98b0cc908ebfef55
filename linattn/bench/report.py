"""Terminal table, JSON file, PNG plot, and merging of several result files (the production preset is run
in parts on the H200: one lease call each)."""
from __future__ import annotations

import json
import math
import textwrap
from typing import Dict, List, Optional

from linattn.bench.presets import shape_label

SCHEMA = "linattn-bench/1"
WIDTH = 120                  # the terminal table fits 120 columns


def _f(x, fmt="{:.3f}", none="-"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def _err_text(row: Dict) -> str:
    errs = row.get("errors") or {}
    if not errs:
        return row.get("compared_to") or "-"
    worst = max(errs.values())
    tag = "" if row.get("grads", "verified") == "verified" or row["mode"] == "fwd" else " (grads unverified)"
    return f"{worst:.1e} vs {row.get('compared_to')}{tag}"


def format_table(result: Dict) -> str:
    hdr = ["shape", "mode", "backend", "median ms", "min..max", "TFLOP/s", "GB/s", "% floor", "speedup", "timing",
           "max rel err"]
    parts = result.get("parts") or []
    if len(parts) > 1:
        hdr.append("part")
    lines = []
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append([r["shape_label"], r["mode"], r["backend"], r["status"], "", "", "", "", "", "",
                          (r.get("reason") or "")[:90]] + ([str(r.get("part", ""))] if len(parts) > 1 else []))
            continue
        timing = "graph" if r["timing"].startswith("cuda graph") else r["timing"].split(" (")[0]
        lines.append([r["shape_label"], r["mode"], r["backend"], _f(r["median_ms"]),
                      f"{_f(r['min_ms'])}..{_f(r['max_ms'])}", _f(r["tflops"], "{:.3g}"), _f(r["gbps"], "{:.0f}"),
                      _f(r["pct_of_floor"], "{:.0f}%"), _f(r.get("speedup"), "{:.2f}x"), timing, _err_text(r)]
                     + ([str(r.get("part", ""))] if len(parts) > 1 else []))
    if len(parts) > 1:                       # the part number goes before the last (free-text) column
        hdr = hdr[:-2] + hdr[-1:] + hdr[-2:-1]
        lines = [ln[:-2] + ln[-1:] + ln[-2:-1] for ln in lines]
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *lines)] if lines else [len(h) for h in hdr]
    if sum(widths) + 2 * (len(widths) - 1) <= WIDTH:
        fmt = "  ".join("{:<%d}" % w for w in widths)
        out = [fmt.format(*hdr).rstrip(), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*map(str, ln)).rstrip() for ln in lines]
    else:                                    # the last column (errors, or why a row did not run) under its row
        fmt = "  ".join("{:<%d}" % w for w in widths[:-1])
        out = [fmt.format(*hdr[:-1]) + f"  ({hdr[-1]} / reason below)",
               fmt.format(*("-" * w for w in widths[:-1]))]
        for ln in lines:
            out.append(fmt.format(*map(str, ln[:-1])).rstrip())
            if ln[-1]:
                out += textwrap.wrap(str(ln[-1]), WIDTH, initial_indent="    ", subsequent_indent="    ")
    c = result.get("ceilings", {})
    out.append(f"floor = max(FLOPs / {_f(c.get('matmul_tflops'), '{:.3g}')} TFLOP/s, bytes / "
               f"{_f(c.get('copy_gbps'), '{:.0f}')} GB/s) [{c.get('how', '')}]; speedup vs {result.get('baseline')}")
    if result.get("targets"):
        out.append("targets: " + ", ".join(f"{k} {_f(v, '{:.3g}') if isinstance(v, float) else v}"
                                           for k, v in result["targets"].items()))
    for cold in result.get("cold", []):
        tag = f" [part {cold.get('part')}]" if len(parts) > 1 else ""
        if cold.get("status") == "ok":
            out.append(f"cold start {cold['backend']} {cold['mode']}: first call {cold['first_call_s']:.2f} s, "
                       f"second {cold['second_call_s'] * 1e3:.2f} ms, fresh process {cold['process_s']:.1f} s{tag}")
        else:
            out.append(f"cold start {cold['backend']} {cold['mode']}: {cold.get('status')}: {cold.get('reason')}{tag}")
    if len(parts) > 1:
        for i, p in enumerate(parts):
            c = p.get("ceilings") or {}
            out.append(f"part {i}: {p.get('file')} ({p.get('preset')}{', cut short' if p.get('partial') else ''}; "
                       f"{p.get('rows_taken')} of its {p.get('rows_in_file')} rows taken; ceilings "
                       f"{_f(c.get('matmul_tflops'), '{:.0f}')} TFLOP/s, {_f(c.get('copy_gbps'), '{:.0f}')} GB/s): "
                       f"{p.get('env_line')}")
    else:
        out.append("env: " + result.get("env_line", ""))
    return "\n".join(fit(line) for line in out)


def fit(line: str) -> str:
    return line if len(line) <= WIDTH else "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent="    "))


def write_json(result: Dict, path: str):
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str, allow_nan=True)


def apply_baseline(rows: List[Dict], baseline: Optional[str]) -> str:
    """Default baseline: fla when it ran here, else triton. speedup = baseline ms / row ms, same shape and mode."""
    if baseline is None:
        baseline = "fla" if any(r["backend"] == "fla" and r["status"] == "ok" for r in rows) else "triton"
    ref = {(r["shape_label"], r["mode"]): r["median_ms"] for r in rows if r["backend"] == baseline and r["status"] == "ok"}
    for r in rows:
        base = ref.get((r["shape_label"], r["mode"]))
        r["speedup"] = base / r["median_ms"] if (r["status"] == "ok" and base) else None
    return baseline


def load_results(paths: List[str], baseline: Optional[str] = None) -> Dict:
    """Merge result files of one op: each part's env and ceilings kept (parts may come from different machines or
    runs: the merged file says so rather than pretending one run), every row and cold entry tagged with its part.

    A (shape, mode) measured in several parts (a part cut short by its time limit and the rest taken from an
    earlier run, or a part re-run) is taken whole from one part: the one with the most rows that ran, the earlier
    file on a tie (list files in order of preference). So every speedup compares backends timed in one run; the
    speedups are recomputed here (a partial file has none). Cold entries are deduplicated per (backend, mode) the
    same way: first file wins."""
    parts = []
    for p in paths:
        with open(p) as f:
            parts.append(json.load(f))
    if not parts:
        raise ValueError("no result files")
    ops = {p["op"] for p in parts}
    if len(ops) != 1:
        raise ValueError(f"result files are of different ops: {sorted(ops)}")
    count: Dict[tuple, Dict[int, int]] = {}
    for i, p in enumerate(parts):
        for r in p["rows"]:
            r["part"] = i
            per = count.setdefault((r["shape_label"], r["mode"]), {})
            per[i] = per.get(i, 0) + (r["status"] == "ok")
    chosen = {key: max(per, key=lambda i: (per[i], -i)) for key, per in count.items()}
    merged = dict(parts[0])
    merged["rows"] = [r for p in parts for r in p["rows"] if chosen[(r["shape_label"], r["mode"])] == r["part"]]
    cold, seen = [], set()
    for i, p in enumerate(parts):
        for c in p.get("cold", []):
            if (c["backend"], c["mode"]) not in seen:
                seen.add((c["backend"], c["mode"]))
                cold.append(dict(c, part=i))
    merged["cold"] = cold
    merged["parts"] = [dict(file=path, preset=p.get("preset"), env_line=p.get("env_line"), ceilings=p.get("ceilings"),
                            partial=bool(p.get("partial")), rows_taken=sum(1 for r in merged["rows"] if r["part"] == i),
                            rows_in_file=len(p["rows"]))
                       for i, (path, p) in enumerate(zip(paths, parts))]
    merged["preset"] = "+".join(str(p.get("preset")) for p in parts)
    merged.pop("partial", None)
    merged["baseline"] = apply_baseline(merged["rows"], baseline or parts[0].get("baseline"))
    return merged


def plot(result: Dict, path: str) -> Optional[str]:
    """ms vs T per backend (one line per batch size), log-log, one panel per (mode, heads). Returns None, or why no plot was made."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    groups: Dict[tuple, Dict[tuple, List]] = {}
    for r in result["rows"]:
        if r["status"] != "ok" or r["shape"].get("lengths"):
            continue
        s = r["shape"]
        key = (r["mode"], f"H{s['H']}/HV{s['HV']} K{s['K']}")
        groups.setdefault(key, {}).setdefault((r["backend"], s["B"]), []).append((s["T"], r["median_ms"]))
    if not groups:
        return "no dense rows to plot"
    # one colour per backend, one marker per batch size: a panel stays readable with 5 backends x 3 batches
    backends = sorted({b for g in groups.values() for b, _ in g})
    batches = sorted({B for g in groups.values() for _, B in g})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {b: palette[i % len(palette)] for i, b in enumerate(backends)}
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    marker = {B: markers[i % len(markers)] for i, B in enumerate(batches)}
    keys = sorted(groups)
    cols = min(3, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        for (backend, B), pts in sorted(groups[key].items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker[B], color=colour[backend],
                    label=f"{backend} B={B}", linestyle="-" if len(pts) > 1 else "none")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{key[0]} {key[1]}", fontsize=9)
        ax.set_xlabel("T (tokens per sequence)")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    presets = list(dict.fromkeys(str(result.get("preset", "")).split("+")))
    fig.suptitle(f"{result['op']} ({'+'.join(presets)}): {result.get('env_line', '')[:110]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def label(shape: Dict) -> str:
    return shape_label(shape)
