"""Where the warps of one kernel wait, instruction by instruction (ncu's source page, SASS view).

The per-kernel stall breakdown mixes the partitions of a warp-specialised kernel (chunk_fused_wu_ws_kernel runs a
state, an output, a W/U and a producer partition): each waits at its own mbarrier. ncu's SourceCounters section
samples warp stalls per SASS instruction, which separates them. `run_round.sh ncu_src` profiles one forward with
that section for the kernels matching NCU_KERNEL (default: the fused kernel), then exports

    ncu -i REPORT --page source --csv --print-source sass   ->  ncusrc_<case>_sass.csv
    ncu -i REPORT --page raw --csv                           ->  ncusrc_<case>_raw.csv

and this script reads the SASS CSV:

    python benchmarks/gpu/ncu_source.py --out DIR CSV...     ->  DIR/ncu_source_summary.json
    python benchmarks/gpu/ncu_source.py --dry-run --out DIR  (CPU: checks the reader on a CSV in ncu's layout)

The column names are found by substring (ncu versions differ): the address ("Address"), the SASS text ("Source"),
the sampled stalls ("Warp Stall Sampling (All Samples)" and its "Not-issued" twin) and, where the page has them,
per-reason sample columns ("stall_*"/"... Stall ..."). The summary keeps the top instructions by samples, the samples
per opcode (the mnemonic before the first '.' or space: SYNCS for mbarrier waits, WARPGROUP for wgmma waits, BAR,
HGMMA, LDS/STS, ...), and the share of samples in each contiguous run of "hot" code, so a reader can tell which
partition's wait dominates (the partitions are separate regions of the SASS).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re


def _num(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def _find(header, *needles, exclude=()):
    for i, h in enumerate(header):
        low = h.lower()
        if all(n in low for n in needles) and not any(x in low for x in exclude):
            return i
    return None


def _opcode(sass: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())           # predicate guard
    return re.split(r"[ .]", text, maxsplit=1)[0] if text else ""


def read_sass_csv(text: str) -> dict:
    """ncu --page source --csv --print-source sass text -> {kernel: [ {address, sass, samples, not_issued,
    reasons{}} ]}. A file may hold several kernels: ncu starts each with a line naming it (kept as the key) before
    its own header row."""
    kernels, name, header, rows = {}, "kernel", None, []
    for rec in csv.reader(io.StringIO(text)):
        if not rec:
            continue
        # the H200's ncu (round 16) starts each kernel with '"Kernel Name","<name>",'; others with a one-field line
        is_label = rec[0].strip() == "Kernel Name" or len(rec) == 1
        if is_label or (header is None and not any("address" in c.lower() for c in rec)):
            if header is not None and rows:
                kernels[name] = rows
            label = (rec[1] if rec[0].strip() == "Kernel Name" and len(rec) > 1 else " ".join(c for c in rec if c))
            if label.strip() and not label.startswith("=="):
                name = label.strip()[:160]
            header, rows = None, []
            continue
        if header is None:
            header = rec
            continue
        if len(rec) < len(header):
            continue
        i_addr, i_src = _find(header, "address"), _find(header, "source")
        i_all = _find(header, "stall sampling", "all")
        i_ni = _find(header, "stall sampling", "not")
        if i_all is None:
            i_all = _find(header, "sampl", exclude=("not",))
        reasons = {}
        for i, h in enumerate(header):
            low = h.lower()
            if i in (i_all, i_ni) or "sampl" in low and "stall" not in low:
                continue
            if low.startswith("stall_") or "stall " in low or low.startswith("warp stall ("):
                v = _num(rec[i])
                if v:
                    reasons[h] = v
        rows.append(dict(address=rec[i_addr] if i_addr is not None else str(len(rows)),
                         sass=rec[i_src] if i_src is not None else "",
                         samples=(_num(rec[i_all]) or 0.0) if i_all is not None else 0.0,
                         not_issued=(_num(rec[i_ni]) or 0.0) if i_ni is not None else 0.0,
                         reasons=reasons))
    if header is not None and rows:
        kernels[name] = rows
    return kernels


def summarize_kernel(rows: list, top: int = 40) -> dict:
    total = sum(r["samples"] for r in rows) or 1.0
    by_op: dict = {}
    for r in rows:
        op = _opcode(r["sass"])
        by_op[op] = by_op.get(op, 0.0) + r["samples"]
    # contiguous regions: runs of instructions, split where 64 consecutive instructions carry < 0.1% of the samples
    regions, cur, quiet = [], None, 0
    for idx, r in enumerate(rows):
        hot = r["samples"] >= 0.001 * total
        if hot:
            if cur is None:
                cur = dict(first=idx, last=idx, first_address=r["address"], samples=0.0)
            cur["last"], cur["last_address"], quiet = idx, r["address"], 0
        elif cur is not None:
            quiet += 1
            if quiet >= 64:
                regions.append(cur)
                cur, quiet = None, 0
        if cur is not None:
            cur["samples"] += r["samples"]
    if cur is not None:
        regions.append(cur)
    for reg in regions:
        reg["share"] = round(reg["samples"] / total, 4)
        seg = rows[reg["first"]:reg["last"] + 1]
        reg["top"] = [dict(address=r["address"], sass=r["sass"][:90], share=round(r["samples"] / total, 4))
                      for r in sorted(seg, key=lambda r: -r["samples"])[:5]]
    hot = sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])[:top]
    return dict(instructions=len(rows), samples=total,
                by_opcode={k: round(v / total, 4) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:20]},
                regions=regions,
                top=[dict(index=i, address=rows[i]["address"], sass=rows[i]["sass"][:120],
                          share=round(rows[i]["samples"] / total, 4),
                          not_issued_share=round(rows[i]["not_issued"] / total, 4),
                          reasons=dict(sorted(rows[i]["reasons"].items(), key=lambda kv: -kv[1])[:4]))
                     for i in hot])


def summarize(paths, out_dir) -> dict:
    res = {}
    for p in paths:
        with open(p, errors="replace") as f:
            kernels = read_sass_csv(f.read())
        res[os.path.basename(p)] = {k: summarize_kernel(rows) for k, rows in kernels.items()}
        for k, s in res[os.path.basename(p)].items():
            print(f"{os.path.basename(p)} :: {k[:80]}: {s['instructions']} instructions, {s['samples']:.0f} samples")
            print("  by opcode: " + ", ".join(f"{op} {100 * v:.1f}%" for op, v in list(s["by_opcode"].items())[:10]))
            for reg in s["regions"]:
                if reg["share"] >= 0.02:
                    print(f"  region {reg['first_address']}..{reg.get('last_address', '')}: {100 * reg['share']:.1f}%  "
                          + "; ".join(f"{t['sass'][:40]} {100 * t['share']:.1f}%" for t in reg["top"][:3]))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ncu_source_summary.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


# A CSV in the layout the H200's ncu wrote in round 16 for `--page source --csv --print-source sass` (a kernel line,
# a header, one row per instruction, then the next kernel; columns cut to a few); values made up.
_SAMPLE = '''"Kernel Name","kkt_solve_v2_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier"
"0x7f0000001000","MOV R1, c[0x0][0x28]","7","0","0","0"
"Kernel Name","chunk_fused_wu_ws_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier"
"0x7f0000000000","MOV R1, c[0x0][0x28]","1","0","0","0"
"0x7f0000000010","@P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R3","900","890","0","0"
"0x7f0000000020","HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24","300","250","0","0"
"0x7f0000000030","WARPGROUP.DEPBAR.LE gsb0, 0x0","500","495","0","0"
"0x7f0000000040","LDS.128 R4, [R2]","200","150","120","0"
"0x7f0000000050","BAR.SYNC.DEFER_BLOCKING 0x1, 0x80","99","99","0","99"
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("csv", nargs="*")
    a = ap.parse_args()
    if a.dry_run:
        os.makedirs(a.out, exist_ok=True)
        p = os.path.join(a.out, "sample_sass.csv")
        with open(p, "w") as f:
            f.write(_SAMPLE)
        res = summarize([p], a.out)["sample_sass.csv"]
        assert list(res) == ["kkt_solve_v2_kernel", "chunk_fused_wu_ws_kernel"], list(res)
        assert res["kkt_solve_v2_kernel"]["samples"] == 7.0, res["kkt_solve_v2_kernel"]
        s = res["chunk_fused_wu_ws_kernel"]
        assert s["instructions"] == 6 and s["samples"] == 2000.0, s
        assert list(s["by_opcode"])[:3] == ["SYNCS", "WARPGROUP", "HGMMA"], s["by_opcode"]
        assert s["top"][0]["share"] == 0.45 and s["top"][0]["not_issued_share"] == 0.445, s["top"][0]
        assert s["top"][2]["sass"].startswith("HGMMA") and s["top"][3]["reasons"] == {"stall_long_sb": 120.0}, s["top"]
        assert len(s["regions"]) == 1 and s["regions"][0]["share"] == 0.9995, s["regions"]     # MOV: under 0.1%
        print("ncu_source dry run: ok")
        return
    summarize(a.csv, a.out)


if __name__ == "__main__":
    main()
