"""The multi-GPU runner of context parallelism (linattn/distributed/multi_gpu.py) in its CPU form: two gloo ranks
forked under the Triton interpreter run its gate case (GDN fp32, initial and final states, a sequence crossing the
boundary) and a tiny scaling run; the JSON must say every case passed
with finite errors against both the fp64 reference and the one-process call, and hold the scaling row's times."""
import json
import math

import pytest

from linattn.distributed import multi_gpu
from linattn.runtime.settings import settings

pytestmark = pytest.mark.skipif(not settings.interpret, reason="runs the CPU path under TRITON_INTERPRET=1")


def test_dry_run_two_ranks(tmp_path):
    out = tmp_path / "cp.json"
    assert multi_gpu.main(["--world", "2", "--dry-run", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["backend"] == "gloo" and res["world"] == 2 and res["passed"] is True
    assert len(res["gate"]) == 1
    for row in res["gate"]:
        assert row["passed"] and not row["failures"], row["failures"]
        assert set(row["errors"]) == {"reference", "one-process call"}
        errs = [e for d in row["errors"].values() for e in d.values()]
        assert len(errs) >= 2 * (2 + 2 + 5 + 1) and all(math.isfinite(e) and e < 1e-2 for e in errs)
    (row,) = res["scaling"]
    assert row["T"] == 256 and row["world"] == 2
    for key in ("cp_fwd_s", "cp_fwd_bwd_s", "one_gpu_triton_fwd_bwd_s", "one_gpu_auto_fwd_bwd_s"):
        assert len(row[key]) == 1 and row[key][0] > 0
    assert row["efficiency_fwd_bwd_vs_triton"] > 0
