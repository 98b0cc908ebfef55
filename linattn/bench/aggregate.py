"""From the fresh processes' numbers to the result's rows: per (shape, mode, backend) and timing column (eager,
graph), the median over processes of each process's median, the spread between processes, and the ratio against
each peer. Plain Python on the processes' JSON, no torch.

- median: statistics.median of the per-process medians (the processes where the row ran).
- spread: (max - min) / min of the per-process medians: how far apart fresh processes of the same code landed.
- ratio against peer P: P's median / this row's median, same shape, mode and column (> 1: this backend faster).
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

COLUMNS = ("eager", "graph")


def spread(values: Sequence[float]) -> float:
    return (max(values) - min(values)) / min(values)


def median_ceilings(processes: List[Dict]) -> Dict:
    """Each ceiling's median over the processes that measured it (every process measures its own)."""
    found = [p["ceilings"] for p in processes if p.get("ceilings")]
    if not found:
        return {}
    out = {k: statistics.median(c[k] for c in found) for k in ("matmul_tflops", "copy_gbps", "matmul_ms", "copy_ms")}
    out["how"] = found[0].get("how", "")
    out["per_process"] = [{k: c[k] for k in ("matmul_tflops", "copy_gbps")} for c in found]
    return out


def _column(name: str, rows: List[Dict]) -> Dict:
    """One timing column of one aggregated row from the per-process rows that ran."""
    ok = [r[name] for r in rows if r.get(name, {}).get("status") == "ok"]
    if not ok:
        why = next((r[name]["reason"] for r in rows if r.get(name)), "did not run")
        return dict(status="n/a", reason=why)
    per = [c["median_ms"] for c in ok]
    return dict(status="ok", median_ms=statistics.median(per), spread=spread(per), per_process_ms=per,
                processes=len(per), timing=ok[0]["timing"], repeats=ok[0]["repeats"], input_sets=ok[0]["input_sets"])


def _merge(backend: str, per: List[Dict]) -> Dict:
    """The per-process rows of one (shape, mode, backend), in round order, into one row."""
    ran = [r for r in per if r["status"] == "ok"]
    first = ran[0] if ran else per[0]
    row = dict(key=first["key"], shape_label=first["shape_label"], mode=first["mode"], backend=backend,
               status=first["status"], rounds=[r["round"] for r in per])
    for k in ("reason", "traceback", "family", "notes", "grads"):
        if k in first:
            row[k] = first[k]
    if not ran:
        return row
    for name in COLUMNS:
        row[name] = _column(name, ran)
    row["first_call_s"] = [r["first_call_s"] for r in ran]
    failed = [f"round {r['round']}: {r['status']}: {r.get('reason')}" for r in per if r["status"] != "ok"]
    if failed:
        row["failed_in"] = failed
    checked = next((r for r in per if "compared_to" in r), None)
    if checked:
        for k in ("compared_to", "errors", "reference_check"):
            if k in checked:
                row[k] = checked[k]
    return row


def add_ratios(rows: List[Dict], peers: Sequence[str]):
    """row[column]["ratios"] = {peer: peer median / row median} for every peer that ran the same shape and mode."""
    by_key = {}
    for r in rows:
        by_key.setdefault((r["key"], r["mode"]), {})[r["backend"]] = r
    for r in rows:
        for name in COLUMNS:
            col = r.get(name)
            if not col or col["status"] != "ok":
                continue
            col["ratios"] = {}
            for p in peers:
                if p == r["backend"]:
                    continue
                other = by_key[(r["key"], r["mode"])].get(p, {}).get(name)
                if other and other["status"] == "ok":
                    col["ratios"][p] = other["median_ms"] / col["median_ms"]


def aggregate(processes: List[Dict], order: List[str], peers: Sequence[str]) -> List[Dict]:
    """Rows in the processes' row order, backends in `order` within each (shape, mode); a process that failed
    as a whole (no rows) adds nothing."""
    keys: List[tuple] = []
    per: Dict[tuple, Dict[str, List[Dict]]] = {}
    for p in sorted(processes, key=lambda p: p["round"]):
        for r in p.get("rows", []):
            k = (r["key"], r["mode"])
            if k not in per:
                keys.append(k)
                per[k] = {}
            per[k].setdefault(p["backend"], []).append(dict(r, round=p["round"]))
    rows = [_merge(b, per[k][b]) for k in keys for b in order if b in per[k]]
    add_ratios(rows, peers)
    return rows
