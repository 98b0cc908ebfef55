"""Where the warps of one kernel wait, instruction by instruction (ncu's source page, SASS view).

The per-kernel stall breakdown mixes the partitions of a warp-specialised kernel (chunk_fused_wu_ws_kernel runs a
state, an output, a W/U and a producer partition): each waits at its own mbarrier. ncu's SourceCounters section
samples warp stalls per SASS instruction, which separates them. Profile one forward with that section for the
kernels matching a name:

    ncu --clock-control none --profile-from-start off -k "regex:fused" --section SourceCounters \\
        --section WarpStateStats --section SpeedOfLight --section LaunchStats -o REPORT -f \\
        python3 benchmarks/gpu/ncu_fwd.py run --backend gluon --B 1 --T 65536

then export

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
        # the H200's ncu starts each kernel with '"Kernel Name","<name>",'; others with a one-field line
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
                regions=regions, partitions=partition_breakdown(rows),
                top=[dict(index=i, address=rows[i]["address"], sass=rows[i]["sass"][:120],
                          share=round(rows[i]["samples"] / total, 4),
                          not_issued_share=round(rows[i]["not_issued"] / total, 4),
                          reasons=dict(sorted(rows[i]["reasons"].items(), key=lambda kv: -kv[1])[:4]))
                     for i in hot])


def _address(text: str):
    try:
        return int(str(text), 16)
    except ValueError:
        return None


def partition_breakdown(rows: list, min_share: float = 0.01) -> list:
    """Where each warp-specialised partition's samples go. The SASS of a gl.warp_specialize kernel gives every
    partition its own code, entered through a setmaxnreg (USETMAXREG.TRY_ALLOC / DEALLOC, its register count in the
    operand), so the code between two USETMAXREG is one partition's (or a prologue, or the idle warps of a padded
    warpgroup). For each such segment with at least min_share of the kernel's samples: its register count, its
    share, and its samples split into
      mbar_wait   mbarrier waits: SYNCS.PHASECHK TRYWAIT and the branch on its result that jumps to the out-of-line
                  retry loop (placed after the kernel's EXIT; the warp's wait is sampled on that branch),
      wgmma_wait  WARPGROUP.DEPBAR (waiting for an asynchronous wgmma),
      bar_sync    BAR.SYNC (named barriers: thread_barrier, layout conversions through shared memory),
      fence       MEMBAR / FENCE (fence_async_shared: MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S: a stall of its own, long
                  scoreboard, with or without global loads in flight),
      idle        NOP (the padding warps of the producer's warpgroup),
      work        everything else, with its leading stall reasons.
    A partition whose samples are nearly all work and wgmma_wait is busy the whole kernel; one with a large mbar_wait
    waits for another (e.g. an output warpgroup 97% busy with the state partition waiting 32% of its samples)."""
    total = sum(r["samples"] for r in rows) or 1.0
    exits = [_address(r["address"]) for r in rows if _opcode(r["sass"]) == "EXIT"]
    exit_at = min(a for a in exits if a is not None) if any(a is not None for a in exits) else None
    segments, cur = [], None
    for idx, r in enumerate(rows):
        op = _opcode(r["sass"])
        if op == "USETMAXREG" or cur is None:
            m = re.search(r"(0x[0-9a-fA-F]+)\s*$", r["sass"].strip()) if op == "USETMAXREG" else None
            cur = dict(first=idx, first_address=r["address"], setmaxnreg=int(m.group(1), 16) if m else None,
                       samples=0.0, cats=dict(mbar_wait=0.0, wgmma_wait=0.0, bar_sync=0.0, fence=0.0, idle=0.0,
                                              work=0.0),
                       reasons={})
            segments.append(cur)
        cur["last"] = idx
        text = r["sass"]
        target = re.search(r"BRA\s+(0x[0-9a-fA-F]+)", text)
        if "TRYWAIT" in text or (target and exit_at is not None and int(target.group(1), 16) > exit_at):
            cat = "mbar_wait"
        elif op == "WARPGROUP" and "DEPBAR" in text:
            cat = "wgmma_wait"
        elif op == "BAR":
            cat = "bar_sync"
        elif op in ("MEMBAR", "FENCE"):
            cat = "fence"
        elif op == "NOP":
            cat = "idle"
        else:
            cat = "work"
            for k, v in r["reasons"].items():
                if "not issued" not in k.lower():
                    cur["reasons"][k] = cur["reasons"].get(k, 0.0) + v
        cur["samples"] += r["samples"]
        cur["cats"][cat] += r["samples"]
    out = []
    for seg in segments:
        if seg["samples"] < min_share * total:
            continue
        n = seg["samples"]
        rs = sum(seg["reasons"].values()) or 1.0
        out.append(dict(first=seg["first"], last=seg["last"], first_address=seg["first_address"],
                        setmaxnreg=seg["setmaxnreg"], share=round(n / total, 4),
                        categories={k: round(v / n, 4) for k, v in seg["cats"].items()},
                        work_reasons={k: round(v / rs, 4) for k, v in
                                      sorted(seg["reasons"].items(), key=lambda kv: -kv[1])[:5]}))
    return out


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
            for part in s["partitions"]:
                print(f"  partition at {part['first']} (setmaxnreg {part['setmaxnreg']}): {100 * part['share']:.1f}% "
                      "of samples: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in part["categories"].items() if v))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ncu_source_summary.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


# A CSV in the layout the H200's ncu writes for `--page source --csv --print-source sass` (a kernel line,
# a header, one row per instruction, then the next kernel; columns cut to a few); values made up.
_SAMPLE = '''"Kernel Name","kkt_solve_kernel",
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


# A warp-specialised kernel in that layout: a prologue, two partitions entered through setmaxnreg, the kernel's EXIT
# and an out-of-line mbarrier retry loop after it; values made up.
_SAMPLE_WS = '''"Kernel Name","chunk_fused_wu_ws_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_short_sb","stall_long_sb"
"0x7f0000000000","MOV R1, c[0x0][0x28]","0","0","0","0"
"0x7f0000000010","USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa0","0","0","0","0"
"0x7f0000000020","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x31100], R3","10","10","0","0"
"0x7f0000000030","@!P0  BRA 0x7f0000000100","190","190","0","190"
"0x7f0000000040","HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24","100","50","0","0"
"0x7f0000000050","WARPGROUP.DEPBAR.LE gsb0, 0x0","200","200","0","0"
"0x7f0000000060","FMUL R4, R4, R5","400","300","300","0"
"0x7f0000000064","MEMBAR.ALL.CTA","0","0","0","0"
"0x7f0000000068","FENCE.VIEW.ASYNC.S","100","100","0","100"
"0x7f0000000070","USETMAXREG.DEALLOC.CTAPOOL 0x18","0","0","0","0"
"0x7f0000000080","NOP","900","900","0","0"
"0x7f0000000090","@!P1  BRA 0x7f0000000080","100","0","0","0"
"0x7f00000000a0","EXIT","0","0","0","0"
"0x7f0000000100","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x31100], R3","0","0","0","0"
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
        assert list(res) == ["kkt_solve_kernel", "chunk_fused_wu_ws_kernel"], list(res)
        assert res["kkt_solve_kernel"]["samples"] == 7.0, res["kkt_solve_kernel"]
        s = res["chunk_fused_wu_ws_kernel"]
        assert s["instructions"] == 6 and s["samples"] == 2000.0, s
        assert list(s["by_opcode"])[:3] == ["SYNCS", "WARPGROUP", "HGMMA"], s["by_opcode"]
        assert s["top"][0]["share"] == 0.45 and s["top"][0]["not_issued_share"] == 0.445, s["top"][0]
        assert s["top"][2]["sass"].startswith("HGMMA") and s["top"][3]["reasons"] == {"stall_long_sb": 120.0}, s["top"]
        assert len(s["regions"]) == 1 and s["regions"][0]["share"] == 0.9995, s["regions"]     # MOV: under 0.1%
        p = os.path.join(a.out, "sample_ws_sass.csv")
        with open(p, "w") as f:
            f.write(_SAMPLE_WS)
        # (its summary in a folder of its own: ncu_source_summary.json of the first sample stays as written)
        parts = summarize([p], os.path.join(a.out, "ws"))["sample_ws_sass.csv"]["chunk_fused_wu_ws_kernel"]["partitions"]
        # the prologue (MOV, no samples) is dropped; the branch into the retry loop past EXIT is an mbarrier wait,
        # the idle warps' own loop branch is work
        assert [(q["first"], q["setmaxnreg"], q["share"]) for q in parts] == [(1, 160, 0.5), (9, 24, 0.5)], parts
        assert parts[0]["categories"] == dict(mbar_wait=0.2, wgmma_wait=0.2, bar_sync=0.0, fence=0.1, idle=0.0,
                                              work=0.5), parts
        assert parts[0]["work_reasons"] == {"stall_short_sb": 1.0}, parts[0]
        assert parts[1]["categories"]["idle"] == 0.9 and parts[1]["categories"]["work"] == 0.1, parts[1]
        print("ncu_source dry run: ok")
        return
    summarize(a.csv, a.out)


if __name__ == "__main__":
    main()
