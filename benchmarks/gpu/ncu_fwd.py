"""Hardware counters of the GDN forward's kernels (issue 7, step 2: which stage holds the time, and why).

Two roles:

    ncu --clock-control none --profile-from-start off --csv --page details \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        python3 benchmarks/gpu/ncu_fwd.py run --backend gluon --B 1 --T 65536 > $OUT/ncu_gluon_B1_T65536.csv
        (--op kda: chunk_kda, e.g. --HV 32 --H 32 --T 32768; -k "regex:kda_intra" narrows ncu to one kernel)
    python3 benchmarks/gpu/ncu_fwd.py summarize --out $OUT $OUT/ncu_*.csv      # CSVs -> ncu_summary.json

`run` makes the inputs (bf16, H16/HV32, K=V=128, initial and final state), calls the forward once outside the
profiled range (compiles, tunes), then once between cudaProfilerStart/Stop, so ncu (with --profile-from-start
off) measures exactly one forward's kernels. `--backend fla` profiles FLA's Triton forward (FLA_FLASH_QLA=0).
ncu lives in /usr/local/cuda*/bin or /opt/nvidia/nsight-compute/*/ on the device. ncu replays each kernel once per counter pass and restores
memory between passes, so the in-place state writes do not accumulate.

`summarize` turns ncu's `--csv --page details` output (one row per kernel, section and metric) into one record
per kernel: duration, DRAM and SM throughput (% of peak), achieved and theoretical occupancy, registers per
thread, shared memory per block, block and grid size, and the warp-stall breakdown when the WarpStateStats
section is there. `--dry-run` checks the summarizer on a small CSV in ncu's layout (CPU).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys

# what the summary keeps of each kernel: our key -> the ncu metric names that may carry it, in order of preference
# (an earlier name wins over a later one wherever the rows come): ncu lists the Speed-of-Light "Memory Throughput"
# (the busiest memory unit: L1, L2 or DRAM) before "DRAM Throughput", and each must land in its own key.
METRICS = {
    "duration_us": ("Duration",),
    "dram_throughput_pct": ("DRAM Throughput",),
    "memory_throughput_pct": ("Memory Throughput",),
    "dram_bytes_per_s": ("Memory Throughput",),
    "sm_throughput_pct": ("Compute (SM) Throughput", "SM Busy"),
    "achieved_occupancy_pct": ("Achieved Occupancy",),
    "theoretical_occupancy_pct": ("Theoretical Occupancy",),
    "registers_per_thread": ("Registers Per Thread",),
    "smem_per_block_kb": ("Dynamic Shared Memory Per Block", "Shared Memory Configuration Size"),
    "block_size": ("Block Size",),
    "grid_size": ("Grid Size",),
    "warp_cycles_per_issued_instruction": ("Warp Cycles Per Issued Instruction",),
    "issue_slots_busy_pct": ("Issue Slots Busy",),
    "l2_hit_rate_pct": ("L2 Hit Rate",),
    "waves_per_sm": ("Waves Per SM",),
}
# keys whose metric name is shared by rows of different units: the unit a row must carry for this key
METRIC_UNITS = {"memory_throughput_pct": "%", "dram_bytes_per_s": "byte/s"}
# the H200's ncu writes "ns"/"us"/"ms"/"s" for durations, older versions "nsecond" etc.
UNIT_SCALE = {("duration_us", "msecond"): 1e3, ("duration_us", "nsecond"): 1e-3, ("duration_us", "usecond"): 1.0,
              ("duration_us", "second"): 1e6, ("duration_us", "ms"): 1e3, ("duration_us", "ns"): 1e-3,
              ("duration_us", "us"): 1.0, ("duration_us", "s"): 1e6, ("smem_per_block_kb", "byte"): 1 / 1024,
              ("smem_per_block_kb", "Kbyte"): 1.0, ("smem_per_block_kb", "Mbyte"): 1024.0,
              # the H200's ncu writes the launch statistics' shared memory per block as "byte/block" (
              # until then smem_per_block_kb held bytes, e.g. 16384.0 for 16 KB)
              ("smem_per_block_kb", "byte/block"): 1 / 1024, ("smem_per_block_kb", "Kbyte/block"): 1.0,
              ("smem_per_block_kb", "Mbyte/block"): 1024.0}


def _num(text: str):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def summarize_csv(text: str) -> list:
    """ncu --csv --page details text -> [{kernel, id, metrics..., stalls{}}] in launch order."""
    start = text.find('"ID"')
    if start < 0:
        return []
    kernels: dict = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        kid = row.get("ID")
        if kid is None:
            continue
        k = kernels.setdefault(kid, dict(id=int(kid), kernel=row.get("Kernel Name", "")[:120], stalls={}, _rank={}))
        name, unit, value = row.get("Metric Name", ""), row.get("Metric Unit", ""), row.get("Metric Value", "")
        for key, names in METRICS.items():
            if name not in names or (key in METRIC_UNITS and unit != METRIC_UNITS[key]):
                continue
            rank = names.index(name)
            if rank < k["_rank"].get(key, len(names)):
                v = _num(value)
                if v is not None:
                    k[key] = v * UNIT_SCALE.get((key, unit), 1.0)
                    k["_rank"][key] = rank
        # WarpStateStats lists stall reasons as "Stall <Reason>" style metrics in some versions and as
        # smsp__average_warp_latency_issue_stalled_* / smsp__pcsamp_warps_issue_stalled_* raw names in others; the
        # H200's ncu prints none of them on the details page ("stalls" stays empty), so the ncu steps
        # also request smsp__average_warps_issue_stalled_*_per_issue_active.ratio by name, which ncu lists under
        # its own section ("Command line profiler metrics"): those rows are taken from any section
        low = name.lower()
        if ((row.get("Section Name", "").startswith("Warp State") and ("stall" in low or "stalled" in low))
                or "issue_stalled" in low):
            v = _num(value)
            if v is not None:
                k["stalls"][name] = v
    out = sorted(kernels.values(), key=lambda k: k["id"])
    for k in out:
        del k["_rank"]
        top = sorted(k["stalls"].items(), key=lambda kv: -kv[1])[:6]
        k["stalls"] = dict(top)
    return out


def summarize(paths, out_dir):
    res = {}
    for p in paths:
        with open(p, errors="replace") as f:
            res[os.path.basename(p)] = summarize_csv(f.read())
    total = {name: round(sum(k.get("duration_us", 0) for k in ks), 1) for name, ks in res.items()}
    for name, ks in res.items():
        print(f"{name}: {len(ks)} kernels, {total[name]} us")
        for k in sorted(ks, key=lambda k: -k.get("duration_us", 0))[:6]:
            print(f"  {k.get('duration_us', 0):9.1f} us  dram {k.get('dram_throughput_pct', 0):5.1f}%  "
                  f"mem {k.get('memory_throughput_pct', 0):5.1f}%  sm {k.get('sm_throughput_pct', 0):5.1f}%  occ {k.get('achieved_occupancy_pct', 0):5.1f}%  "
                  f"regs {k.get('registers_per_thread', 0):4.0f}  {k['kernel'][:60]}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ncu_summary.json"), "w") as f:
        json.dump(dict(files=res, total_us=total), f, indent=1)
    return res


def run(backend: str, B: int, T: int, H: int, HV: int, op: str = "gdn"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch

    import linattn
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, device="cuda")
    if op == "kda":                                  # the decay per key channel, [B, T, HV, K]
        x["g"] = -(0.01 + 0.1 * torch.rand(B, T, HV, 128, device="cuda"))
    if backend == "fla":
        os.environ["FLA_FLASH_QLA"] = "0"
        if op == "kda":
            from fla.ops.kda import chunk_kda as fla_fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

        def fn():
            return fla_fn(**x, output_final_state=True)
    else:
        lin_fn = linattn.chunk_kda if op == "kda" else linattn.chunk_gated_delta_rule

        def fn():
            return lin_fn(**x, output_final_state=True, backend=backend)
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_fwd: profiled one {op} {backend} forward at B={B} T={T} H={H} HV={HV}")


_SAMPLE = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","intra_chunk_wy_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","msecond","1.97"
"0","1","python3","h","intra_chunk_wy_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","23.5"
"0","1","python3","h","intra_chunk_wy_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","Occupancy","Achieved Occupancy","%","31.2"
"0","1","python3","h","intra_chunk_wy_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","168"
"0","1","python3","h","intra_chunk_wy_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","Warp State Statistics","Stall Long Scoreboard","cycle","12.5"
"0","1","python3","h","intra_chunk_wy_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","Warp State Statistics","Stall Barrier","cycle","3.1"
"1","1","python3","h","chunk_state_fwd_kernel","1","7","(128, 1, 1)","(2, 32, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","usecond","2,010.4"
"1","1","python3","h","chunk_state_fwd_kernel","1","7","(128, 1, 1)","(2, 32, 1)","0","9.0","Launch Statistics","Dynamic Shared Memory Per Block","byte","32768"
'''


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--op", choices=["gdn", "kda"], default="gdn", help="chunk_gated_delta_rule or chunk_kda")
    r.add_argument("--backend", default="triton")
    r.add_argument("--B", type=int, default=1)
    r.add_argument("--T", type=int, default=65536)
    r.add_argument("--H", type=int, default=16)
    r.add_argument("--HV", type=int, default=32)
    s = sub.add_parser("summarize")
    s.add_argument("--out", required=True)
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("csv", nargs="*")
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.backend, a.B, a.T, a.H, a.HV, a.op)
        return
    if a.dry_run:
        os.makedirs(a.out, exist_ok=True)
        p = os.path.join(a.out, "sample.csv")
        with open(p, "w") as f:
            f.write(_SAMPLE)
        ks = summarize([p], a.out)["sample.csv"]
        assert [k["kernel"] for k in ks] == ["intra_chunk_wy_kernel", "chunk_state_fwd_kernel"], ks
        assert abs(ks[0]["duration_us"] - 1970.0) < 1e-6 and abs(ks[1]["duration_us"] - 2010.4) < 1e-6, ks
        assert ks[0]["registers_per_thread"] == 168 and ks[1]["smem_per_block_kb"] == 32.0, ks
        assert list(ks[0]["stalls"]) == ["Stall Long Scoreboard", "Stall Barrier"], ks
        print("ncu_fwd summarize dry run: ok")
        return
    summarize(a.csv, a.out)


if __name__ == "__main__":
    main()
