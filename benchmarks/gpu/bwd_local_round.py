"""GPU round for the restructured local stage of the Triton GDN backward (triton/backward_local_v2.py,
LINATTN_GDN_BWD_LOCAL=v2): `python benchmarks/gpu/bwd_local_round.py --out DIR` (< 150 s on an H200). What it does:
bwd_switch_round.py; the gate compares every gradient switch on vs off, the timing's difference is the local
stage's, and a third column times both opt-in stages together (LINATTN_GDN_BWD_LOCAL=v2 and
LINATTN_GDN_BWD_WY=v2). DIR/bwd_local.json.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_switch_round import Stage, main  # noqa: E402

STAGE = Stage(name="local", label="local stage", env="LINATTN_GDN_BWD_LOCAL", module_attr="local_v2",
              kernel="chunk_local_bwd_v2_kernel", vs_grads=("q", "k", "v", "g", "beta"), with_wy=True)

if __name__ == "__main__":
    main(STAGE, "bwd_local_round.py")
