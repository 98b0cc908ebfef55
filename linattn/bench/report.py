"""Terminal table, markdown tables (RESULTS.md, README's speed table), JSON file, PNG plot, and merging of several
result files (the production preset is run in parts on the H200: one lease call each)."""
from __future__ import annotations

import json
import math
import textwrap
from typing import Dict, List, Optional

from linattn.bench.aggregate import COLUMNS

SCHEMA = "linattn-bench/2"
WIDTH = 120                  # the terminal table fits 120 columns


def _f(x, fmt="{:.3f}", none="-"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def _ms(col: Dict) -> str:
    return f"{col['median_ms']:.4g}" if col and col.get("status") == "ok" else "n/a"


def _spread(col: Dict) -> str:
    return f"{100 * col['spread']:.1f}%" if col and col.get("status") == "ok" else ""


def _err_text(row: Dict) -> str:
    errs = row.get("errors") or {}
    if not errs:
        return row.get("compared_to") or "-"
    worst = max(errs.values())
    tag = "" if row.get("grads", "verified") == "verified" or row["mode"] == "fwd" else " (grads unverified)"
    return f"{worst:.1e} vs {row.get('compared_to')}{tag}"


def _peers(result: Dict) -> List[str]:
    ran = {r["backend"] for r in result["rows"] if r["status"] == "ok"}
    return [p for p in result.get("peers", []) if p in ran]


def _pair(row: Dict, get) -> str:
    """"eager/graph" of one quantity, "-" where a column did not run or has no value."""
    vals = [get(row.get(c) or {}) if (row.get(c) or {}).get("status") == "ok" else None for c in COLUMNS]
    return "/".join("-" if v is None else v for v in vals)


def format_table(result: Dict) -> str:
    peers = _peers(result)
    hdr = ["shape", "mode", "backend", "eager ms", "spread", "graph ms", "spread", "% floor e/g"]
    hdr += [f"vs {p} e/g" for p in peers] + ["max rel err"]
    parts = result.get("parts") or []
    lines, graph_na = [], {}
    for r in result["rows"]:
        part = [str(r.get("part", ""))] if len(parts) > 1 else []
        if r["status"] != "ok":
            lines.append([r["shape_label"], r["mode"], r["backend"], r["status"]] + [""] * (len(hdr) - 5) + part
                         + [(r.get("reason") or "")[:200]])
            continue
        if r["graph"]["status"] != "ok":
            graph_na.setdefault((r["backend"], r["graph"]["reason"]), 0)
            graph_na[(r["backend"], r["graph"]["reason"])] += 1
        ratios = [_pair(r, lambda c, p=p: _f(c.get("ratios", {}).get(p), "{:.2f}x", None)) for p in peers]
        floor = _pair(r, lambda c: _f(c.get("pct_of_floor"), "{:.0f}", None))
        failed = "; failed in " + ", ".join(r["failed_in"]) if r.get("failed_in") else ""
        lines.append([r["shape_label"], r["mode"], r["backend"], _ms(r["eager"]), _spread(r["eager"]),
                      _ms(r["graph"]), _spread(r["graph"]), floor] + ratios + part + [_err_text(r) + failed])
    if len(parts) > 1:                       # the part number goes before the last (free-text) column
        hdr = hdr[:-1] + ["part"] + hdr[-1:]
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
    out.append(f"ms: median over {result.get('procs')} fresh processes per backend (each its median of "
               f"{result.get('repeats')} repeats); spread = (max - min) / min between processes; e/g = eager / CUDA "
               "graph; vs P = P's ms / this row's ms (> 1: this row faster)")
    for (b, why), n in graph_na.items():
        out.append(f"graph n/a for {b} ({n} rows): {why}")
    c = result.get("ceilings", {})
    out.append(f"floor = max(FLOPs / {_f(c.get('matmul_tflops'), '{:.3g}')} TFLOP/s, bytes / "
               f"{_f(c.get('copy_gbps'), '{:.0f}')} GB/s) [{c.get('how', '')}; medians over the processes]")
    for col, t in (result.get("targets") or {}).items():
        if t:
            out.append(f"targets ({col}): " + ", ".join(f"{k} {_f(v, '{:.3g}') if isinstance(v, float) else v}"
                                                       for k, v in t.items()))
    for cold in result.get("cold", []):
        tag = f" [part {cold.get('part')}]" if len(parts) > 1 else ""
        if cold.get("status") == "ok":
            out.append(f"cold start {cold['backend']} {cold['mode']}: first call {cold['first_call_s']:.2f} s, "
                       f"second {cold['second_call_s'] * 1e3:.2f} ms, fresh process {cold['process_s']:.1f} s{tag}")
        else:
            out.append(f"cold start {cold['backend']} {cold['mode']}: {cold.get('status')}: {cold.get('reason')}{tag}")
    for p in result.get("processes", []):
        if p.get("status") != "ok":
            out.append(f"process round {p['round']} {p['backend']}: {p.get('reason')}: "
                       + " | ".join(p.get("stderr_tail", [])[-3:]))
    if len(parts) > 1:
        for i, p in enumerate(parts):
            out.append(f"part {i}: {p.get('file')} ({p.get('preset')}{', cut short' if p.get('partial') else ''}; "
                       f"{p.get('rows_taken')} of its {p.get('rows_in_file')} rows taken): {p.get('env_line')}")
    else:
        out.append("env: " + result.get("env_line", ""))
    return "\n".join(fit(line) for line in out)


def markdown(result: Dict) -> str:
    """Markdown tables for benchmarks/RESULTS.md and README's speed table: per mode and timing column, one line
    per shape with each backend's ms (spread between processes) and each linattn backend's ratio against each
    peer. Rows that did not run are listed with their reasons under the table."""
    peers = _peers(result)
    mine = [b for b in result["backends"] if b not in result.get("peers", [])]
    ran = [b for b in result["backends"] if any(r["backend"] == b and r["status"] == "ok" for r in result["rows"])]
    out = [f"`linattn bench --op {result['op']} --preset {result['preset']}`: median over {result.get('procs')} fresh "
           "processes per backend, alternated; in parentheses the spread between processes, (max - min) / min; "
           "ratio = peer ms / linattn ms (> 1: linattn faster).", "", f"Environment: {result.get('env_line', '')}"]
    for mode in result.get("modes", []):
        for col in COLUMNS:
            rows = [r for r in result["rows"] if r["mode"] == mode]
            if not any(r.get(col, {}).get("status") == "ok" for r in rows):
                continue
            shapes = list(dict.fromkeys(r["shape_label"] for r in rows))
            at = {(r["shape_label"], r["backend"]): r for r in rows}
            pairs = [(m, p) for m in mine if m in ran for p in peers]
            out += ["", f"{mode}, {'eager' if col == 'eager' else 'CUDA graph'}:", "",
                    "| shape | " + " | ".join(f"{b} ms" for b in ran) + "".join(f" | {m} vs {p}" for m, p in pairs)
                    + " |", "|---" * (1 + len(ran) + len(pairs)) + "|"]
            notes = {}
            for s in shapes:
                cells = []
                for b in ran:
                    r = at.get((s, b))
                    c = (r or {}).get(col) or {}
                    if c.get("status") == "ok":
                        cells.append(f"{c['median_ms']:.4g} ({100 * c['spread']:.1f}%)")
                        continue
                    cells.append("n/a" if r and r["status"] == "ok" else (r["status"] if r else "-"))
                    if r:
                        notes.setdefault(f"{b}: {c.get('reason') or r.get('reason')}", []).append(s)
                for m, p in pairs:
                    c = ((at.get((s, m)) or {}).get(col)) or {}
                    cells.append(_f(c.get("ratios", {}).get(p), "{:.2f}x"))
                out.append(f"| {s} | " + " | ".join(cells) + " |")
            if notes:
                out.append("")
                out += [f"- {why} ({', '.join(ss)})" for why, ss in notes.items()]
    return "\n".join(out) + "\n"


def fit(line: str) -> str:
    return line if len(line) <= WIDTH else "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent="    "))


def write_json(result: Dict, path: str):
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str, allow_nan=True)


def load_results(paths: List[str]) -> Dict:
    """Merge result files of one op: each part's env and ceilings kept (parts may come from different machines or
    runs: the merged file says so rather than pretending one run), every row, process and cold entry tagged with
    its part.

    A (shape, mode) measured in several parts (a part cut short by its time limit and the rest taken from an
    earlier run, or a part re-run) is taken whole from one part: the one with the most rows that ran, the earlier
    file on a tie (list files in order of preference). So every ratio compares backends timed in one run (the
    rows keep the ratios computed in their part). Cold entries are deduplicated per (backend, mode) the same
    way: first file wins."""
    parts = []
    for p in paths:
        with open(p) as f:
            parts.append(json.load(f))
    if not parts:
        raise ValueError("no result files")
    old = [p for p, d in zip(paths, parts) if d.get("schema") != SCHEMA]
    if old:
        raise ValueError(f"not {SCHEMA} results (measured by an earlier bench, not comparable): {old}")
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
    merged["processes"] = [dict(x, part=i) for i, p in enumerate(parts) for x in p.get("processes", [])]
    merged["peers"] = list(dict.fromkeys(b for p in parts for b in p.get("peers", [])))
    merged["backends"] = list(dict.fromkeys(b for p in parts for b in p.get("backends", [])))
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
    return merged


def plot(result: Dict, path: str) -> Optional[str]:
    """ms vs T per backend (one line per batch size and timing column: eager solid, CUDA graph dotted), log-log,
    one panel per (mode, heads). Returns None, or why no plot was made."""
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
        for col in COLUMNS:
            if r[col]["status"] == "ok":
                line = groups.setdefault(key, {}).setdefault((r["backend"], s["B"], col), [])
                line.append((s["T"], r[col]["median_ms"]))
    if not groups:
        return "no dense rows to plot"
    # one colour per backend, one marker per batch size: a panel stays readable with 5 backends x 3 batches
    backends = sorted({b for g in groups.values() for b, _, _ in g})
    batches = sorted({B for g in groups.values() for _, B, _ in g})
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
        for (backend, B, col), pts in sorted(groups[key].items()):
            pts.sort()
            style = ("-" if col == "eager" else ":") if len(pts) > 1 else "none"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker[B], color=colour[backend],
                    label=f"{backend} B={B} {col}", linestyle=style, fillstyle="full" if col == "eager" else "none")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{key[0]} {key[1]}", fontsize=9)
        ax.set_xlabel("T (tokens per sequence)")
        ax.set_ylabel("ms (median over processes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    presets = list(dict.fromkeys(str(result.get("preset", "")).split("+")))
    fig.suptitle(f"{result['op']} ({'+'.join(presets)}): {result.get('env_line', '')[:110]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
