"""GPU round for the restructured WY stage of the Triton GDN backward (triton/backward_wy_v2.py, LINATTN_GDN_BWD_WY=v2):
`python benchmarks/gpu/bwd_wy_round.py --out DIR` (< 150 s on an H200). What it does: bwd_switch_round.py; the
gate compares dk, dv, dg, dbeta switch on vs off, the timing's difference is the WY stage's. DIR/bwd_wy.json.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_switch_round import Stage, main  # noqa: E402

STAGE = Stage(name="wy", label="WY stage", env="LINATTN_GDN_BWD_WY", module_attr="wy_v2",
              kernel="chunk_wy_bwd_v2_kernel", vs_grads=("k", "v", "g", "beta"))

if __name__ == "__main__":
    main(STAGE, "bwd_wy_round.py")
