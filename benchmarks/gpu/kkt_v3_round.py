"""GPU round for stage 2a v3, the default since round 17 (triton/intra_split.py kkt_solve_v3_kernel:
kkt_solve_v2_kernel's products with its six tl.gather cross-warp moves replaced by one broadcast per moved tensor and
in-register selects; benchmarks/KKT_SOLVE.md, "v2 after round 16"): `python benchmarks/gpu/kkt_v3_round.py --out DIR
[--budget 110] [--dry-run]`. kkt_v2_round.py's rows and checks, run for v1 (kkt_solve_kernel, "ref"), v2 and v3 on
the same rows and inputs: gcum equal to v1's, each variant's Tinv error vs fp64 within 1.5x v1's (same floors as the
tests), whether v3's Tinv is bit-equal to v2's (tinv_equal_v2_v3_*, recorded, not gated), the three timed (ref_ms_*,
v2_ms_*, v3_ms_*, v2_over_v3_ms_*), registers / spills / shared memory of each; then the Triton forward with
LINATTN_GDN_KKT=v3 (and v1) against the fp64 reference, v3 launched exactly once. Writes DIR/kkt_v3.json."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kkt_v2_round import main  # noqa: E402

if __name__ == "__main__":
    main(variants=("v2", "v3"), script="kkt_v3_round.py", json_name="kkt_v3.json")
