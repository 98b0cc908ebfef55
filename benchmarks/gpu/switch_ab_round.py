"""A/B of one environment switch on the public forward, same inputs, same process:
`python benchmarks/gpu/switch_ab_round.py --out DIR [--budget 150] [--dry-run]`.

AB_SIDES names the two sides as "label:VARIABLE=value,label:VARIABLE=value" (common.ab_sides; default
round 21's LINATTN_GDN_GLUON_BV16 off / on); AB_ROWS the rows as space-separated "B:T:H:HV" (T "varlen<lengths
joined by +>" for a varlen row; default round 21's H2/HV8 rows). Per row: the two sides' o and final state compared
(relative RMS, bit-equality; correctness against fp64 is the gates' job), then CUDA-graph medians in the order a, b,
a, b (backend AB_BACKEND, default "gluon"; bf16, K = V = 128, initial and final state). Writes DIR/switch_ab.json."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ab_sides, start_round, switch_ab, write_json  # noqa: E402

DEFAULT_SIDES = "bv32:LINATTN_GDN_GLUON_BV16=0,bv16:LINATTN_GDN_GLUON_BV16=1"
DEFAULT_ROWS = "1:8192:2:8 1:32768:2:8 1:65536:2:8 2:32768:2:8"
DRY_ROWS = "1:130:1:2 1:varlen1+63+66:1:2"


def parse_row(spec: str):
    B, T, H, HV = spec.split(":")
    lens = [int(x) for x in T[len("varlen"):].split("+")] if T.startswith("varlen") else None
    return int(B), (sum(lens) if lens else int(T)), int(H), int(HV), lens


def run():
    args, dry, dev, path, res = start_round("switch_ab_round.py", "switch_ab.json", budget=150.0)
    import torch

    import linattn
    from linattn.testing import make_gdn_inputs
    sides = ab_sides(os.environ.get("AB_SIDES", DEFAULT_SIDES))
    res["sides"] = {label: f"{var}={val}" for label, (var, val) in sides}
    backend = res["backend"] = os.environ.get("AB_BACKEND", "gluon")
    start = time.time()
    for spec in (DRY_ROWS if dry else os.environ.get("AB_ROWS", DEFAULT_ROWS)).split():
        B, T, H, HV, lens = parse_row(spec)
        row = dict(row=spec, B=B, T=T, H=H, HV=HV, varlen=lens is not None)
        if time.time() - start > args.budget:
            res["skipped"].append(spec)
            continue
        K = 64 if dry else 128
        cu = None
        if lens:
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=dev)
        x = make_gdn_inputs(1 if lens else B, T, H, HV, K, K, dtype=torch.bfloat16, device=dev,
                            num_states=len(lens) if lens else B, generator=torch.Generator().manual_seed(21 + T))

        try:
            with torch.no_grad():
                switch_ab(lambda: linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu,
                                                                 backend="triton" if dry else backend),
                          sides, row, not dry)
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:600]
        res["rows"].append(row)
        write_json(path, res)
        print(f"  {row}", flush=True)
    res["passed"] = all("error" not in r and r.get("finite") for r in res["rows"])
    write_json(path, res)


if __name__ == "__main__":
    run()
