"""GPU round for stage 2a v4 (opt-in LINATTN_GDN_KKT=v4; triton/intra_split.py kkt_solve_v4_kernel: v3 with bf16
operands for the inverse's products where Tinv is stored in bf16; benchmarks/KKT_SOLVE.md, "v4"):
`python benchmarks/gpu/kkt_v4_round.py --out DIR [--budget 110] [--dry-run]`.
1. kkt_v2_round.py's rows and checks for v1 ("ref"), v3, v4o (the diagonal 16x16 inverses kept at TF32) and v4 on the
   same rows and inputs: gcum equal to v1's, each variant's Tinv error vs fp64 (v4 / v4o bound: 2.0x v1's worst +
   floor, kkt_v2_round.BOUND), v3's fp32 Tinv bit-equal to v4's (tinv_equal_v3_v4_fp32: v4 keeps v3's products
   there), all timed; the Triton forward with LINATTN_GDN_KKT=v4 against fp64.
2. Forward A/B (`forward_ab`): the public forward (backend "gluon", bf16, H16/HV32 K=V=128, initial and final state)
   at the production rows with LINATTN_GDN_KKT=v3 and =v4 on the same inputs, CUDA-graph medians in the order
   v3, v4, v3, v4; o and the final state of v4 against v3's (relative RMS); plus B1 T65536 with the opt-in segments
   and the Triton backend at B8 T4096. Correctness against fp64 of the whole forward with v4 is the gates' (run_round.sh
   fwd / gluon with LINATTN_GDN_KKT=v4).
KKT_VARIANTS (comma-separated kkt_v2_round.VARIANTS names, the last one the forward check's) changes the variants of
part 1, e.g. KKT_VARIANTS=v4,v4h (v4 with HEADS_FAST) with KKT_V4_AB_BUDGET=0 (no part 2). KKT_AB changes part 2's
two sides (ab_sides), e.g. KKT_AB="v4:LINATTN_GDN_KKT_EARLY_K=0,v4e:LINATTN_GDN_KKT_EARLY_K=1" (round 21); each row
also records whether the two sides' o and final state are bit-equal.
Writes DIR/kkt_v4.json."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ab_sides as parse_sides, switch_ab, write_json  # noqa: E402
from kkt_v2_round import START, main  # noqa: E402

AB_ROWS = [(1, 8192, "gluon", ""), (1, 65536, "gluon", ""), (8, 4096, "gluon", ""), (4, 16384, "gluon", ""),
           (1, "varlen", "gluon", ""), (1, 65536, "gluon", "segments"), (8, 4096, "triton", "")]
DRY_AB_ROWS = [(1, 130, "triton", ""), (1, "varlen", "triton", "")]


def ab_row(B, T, backend, mode, dev, dry, budget_left):
    import torch

    import linattn
    from linattn.bench.presets import PRODUCTION_VARLEN
    from linattn.testing import make_gdn_inputs
    H, HV, K = (1, 2, 64) if dry else (16, 32, 128)
    cu, N = None, B
    if T == "varlen":
        lens = [1, 63, 1, 65, 70] if dry else PRODUCTION_VARLEN["lengths"]
        T, N = sum(lens), len(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=dev)
    x = make_gdn_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16, device=dev, num_states=N,
                        generator=torch.Generator().manual_seed(2000 + B + T))
    out = dict(B=B, T=T, backend=backend, mode=mode or "default", varlen=cu is not None)
    os.environ["LINATTN_GDN_GLUON_SEGMENTS"] = "1" if mode == "segments" else "0"

    try:
        with torch.no_grad():
            switch_ab(lambda: linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                                             backend=backend),
                      ab_sides(), out, not dry and budget_left() > 0)
    finally:
        os.environ.pop("LINATTN_GDN_GLUON_SEGMENTS", None)
    return out


def ab_sides():
    """The forward A/B's two sides from KKT_AB ("label:VARIABLE=value,label:VARIABLE=value"; default v3 against v4
    through LINATTN_GDN_KKT): common.ab_sides' ((label_a, (variable, value)), (label_b, (variable, value)))."""
    return parse_sides(os.environ.get("KKT_AB", "v3:LINATTN_GDN_KKT=v3,v4:LINATTN_GDN_KKT=v4"))


def run():
    variants = tuple(os.environ.get("KKT_VARIANTS", "v3,v4o,v4").split(","))
    res, path, dry, dev = main(variants=variants, script="kkt_v4_round.py", json_name="kkt_v4.json")
    budget = float(os.environ.get("KKT_V4_AB_BUDGET", 200))
    res["forward_ab"] = []
    for B, T, backend, mode in (DRY_AB_ROWS if dry else AB_ROWS):
        if time.time() - START > budget:
            res["forward_ab"].append(dict(B=B, T=T, backend=backend, mode=mode, skipped="budget"))
            continue
        try:
            r = ab_row(B, T, backend, mode, dev, dry, lambda: budget - (time.time() - START))
        except Exception as e:  # noqa: BLE001
            r = dict(B=B, T=T, backend=backend, mode=mode, error=repr(e)[:600])
        res["forward_ab"].append(r)
        write_json(path, res)
        print(f"  A/B {r}", flush=True)
    write_json(path, res)


if __name__ == "__main__":
    run()
