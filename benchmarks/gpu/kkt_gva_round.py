"""GPU round for the opt-in GVA form of stage 2a (triton/intra_split.py kkt_solve_gva_kernel: one program per (chunk
slot, key head), k loaded and K K^T formed once per key head, then a static loop over its HV // H value heads) against
kkt_solve_kernel (one program per (chunk slot, value head), the default):
`python benchmarks/gpu/kkt_gva_round.py --out DIR [--budget 110] [--dry-run]` (well under 60 s on an H200).

Per row (H16 HV32 K=V=128 bf16 on the GPU: B1 T8192, B1 T65536, B8 T4096, and the 24-sequence varlen row of
linattn.bench.presets.PRODUCTION_VARLEN):
1. bit-equality: both kernels launched into NaN-filled gcum and Tinv buffers, with Tinv in bf16 (the forward) and in
   fp32 (the backward's store_tinv); torch.equal of gcum and Tinv (and, when they differ, the count of differing
   elements and the largest absolute difference), every value finite.
2. timing (median of CUDA-event repeats, eager launches, bf16 and fp32 Tinv): kkt_solve_kernel vs kkt_solve_gva_kernel
   and their ratio; the registers, spills and shared memory of both compiled kernels as the driver reports them.
A row that raises is recorded with its error; the next row still runs. No new row starts after --budget seconds.
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (H1 HV2, 2-3 chunks; host-clock
times, no claims). Writes DIR/kkt_gva.json after every row and prints a table.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)                                       # common
sys.path.insert(1, ROOT)                                       # linattn from this checkout
import torch  # noqa: E402
from common import median_ms, run_rows, start_round, write_json  # noqa: E402

# the rows, shapes, launches, kernel facts and row inputs of kkt_v2_round (the same stage-2a rows)
from kkt_v2_round import (DRY_ROWS, ROWS, _launch, kernel_facts, launch_ref, row_inputs,  # noqa: E402
                          shapes)

START = time.time()


def launch_gva(*a):
    """kkt_solve_gva_kernel as intra_split.kkt_solve_gva launches it (returns the compiled kernel, for its registers)."""
    from linattn.ops.gated_delta_rule.triton.intra_split import kkt_solve_gva_kernel
    return _launch(kkt_solve_gva_kernel, *a, per_key_head=True)


def compare(a, b):
    """torch.equal plus, where they differ, how much (NaN-safe: a NaN left in either fails)."""
    out = dict(equal=bool(torch.equal(a, b)), finite=bool(torch.isfinite(a).all() and torch.isfinite(b).all()))
    if not out["equal"]:
        diff = a.float() != b.float()
        out["n_diff"] = int(diff.sum())
        d = (a.float() - b.float()).abs()
        out["max_abs_diff"] = float(torch.nan_to_num(d, nan=float("inf")).max())
    return out


def run_row(B, T, dev, dry):
    H, HV, K = shapes(dry)
    k, g, beta, cu, T, plan, row = row_inputs(B, T, dev, dry)
    Tt = plan.T_total
    ok = True
    for tname, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        bufs = {}
        for which, launch in (("ref", launch_ref), ("gva", launch_gva)):
            gcum = torch.full((Tt, HV), float("nan"), dtype=torch.float32, device=dev)
            tinv = torch.full((Tt, HV, 64), float("nan"), dtype=tdt, device=dev)
            compiled = launch(k, g, beta, gcum, tinv, plan, H, HV, K, "tf32")
            bufs[which] = (gcum, tinv)
            facts = kernel_facts(compiled)
            if facts is not None:
                row[f"{which}_kernel_{tname}"] = facts
        if dev == "cuda":
            torch.cuda.synchronize()
        cg, ct = compare(bufs["gva"][0], bufs["ref"][0]), compare(bufs["gva"][1], bufs["ref"][1])
        row[f"gcum_{tname}"], row[f"tinv_{tname}"] = cg, ct
        ok = ok and cg["equal"] and ct["equal"] and cg["finite"] and ct["finite"]
        del bufs
    row["bit_equal"] = ok

    # timing: the same buffers for every call of one kernel (no NaN fills inside the timed calls)
    warm, reps = (1, 1) if dry else (5, 20)
    for tname, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        gcum = torch.empty(Tt, HV, dtype=torch.float32, device=dev)
        tinv = torch.empty(Tt, HV, 64, dtype=tdt, device=dev)
        row[f"ref_ms_{tname}"] = median_ms(lambda: launch_ref(k, g, beta, gcum, tinv, plan, H, HV, K, "tf32"),
                                           warmup=warm, repeats=reps)
        row[f"gva_ms_{tname}"] = median_ms(lambda: launch_gva(k, g, beta, gcum, tinv, plan, H, HV, K, "tf32"),
                                           warmup=warm, repeats=reps)
        row[f"speedup_{tname}"] = row[f"ref_ms_{tname}"] / row[f"gva_ms_{tname}"]
        del gcum, tinv
    return row


def line(r):
    if "error" in r:
        return f"  B{r['B']} T{r['T']}: ERROR {r['error'][:200]}"
    return (f"  B{r['B']} T{r['T']}{' varlen' if r['varlen'] else ''}: bit-equal {r['bit_equal']} | bf16 Tinv: "
            f"kkt_solve {r['ref_ms_bf16']:.4f} ms, gva {r['gva_ms_bf16']:.4f} ms (x{r['speedup_bf16']:.2f}) | fp32 "
            f"Tinv: {r['ref_ms_fp32']:.4f} -> {r['gva_ms_fp32']:.4f} ms (x{r['speedup_fp32']:.2f})"
            + (f" | regs {r['ref_kernel_bf16']['regs']} -> {r['gva_kernel_bf16']['regs']}, spills "
               f"{r['gva_kernel_bf16']['spills']}, smem {r['ref_kernel_bf16']['smem']} -> "
               f"{r['gva_kernel_bf16']['smem']}" if "gva_kernel_bf16" in r else ""))


def main():
    args, dry, dev, path, res = start_round("kkt_gva_round.py", "kkt_gva.json")
    run_rows(res, path, DRY_ROWS if dry else ROWS, lambda B, T: run_row(B, T, dev, dry), line, args.budget, START)
    rows = res["rows"]
    res["all_bit_equal"] = bool(rows) and all(r.get("bit_equal") is True for r in rows)
    res["passed"] = res["all_bit_equal"] and not res["skipped"]
    write_json(path, res)
    print(f"kkt_gva: all bit-equal {res['all_bit_equal']}, skipped {res['skipped']}, {time.time() - START:.0f} s")


if __name__ == "__main__":
    main()
