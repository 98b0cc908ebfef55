"""A/B of one environment switch on the public forward, same inputs, same process:
`python benchmarks/gpu/switch_ab_round.py --out DIR [--budget 150] [--dry-run]`.

AB_SIDES names the two sides as "label:VARIABLE=value,label:VARIABLE=value" (common.ab_sides; default round 21's
LINATTN_GDN_GLUON_BV16 off / on); AB_ROWS the rows as space-separated "B:T:H:HV[:decay]" (T "varlen<lengths joined
by +>" for a varlen row; default round 21's H2/HV8 rows; decay "fast", make_gdn_inputs' gates, the default, "slow":
g x 0.01 on every value head, "mixed": g x 0.01 on the odd value heads, as segments_round.py's). Per row: the two
sides' o and final state compared (relative RMS, bit-equality; correctness against fp64 is the gates' job), then
CUDA-graph medians in the order a, b, a, b (backend AB_BACKEND, default "gluon"; bf16, K = V = 128, initial and
final state). AB_MODE=fwdbwd times the forward and the backward together (autograd.grad of o and the final state
against fixed random output gradients, as linattn bench's fwdbwd rows) and compares the gradients of q, k, v, g,
beta and the initial state, concatenated, in place of the final state. Writes DIR/switch_ab.json."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ab_sides, start_round, switch_ab, write_json  # noqa: E402

DEFAULT_SIDES = "bv32:LINATTN_GDN_GLUON_BV16=0,bv16:LINATTN_GDN_GLUON_BV16=1"
DEFAULT_ROWS = "1:8192:2:8 1:32768:2:8 1:65536:2:8 2:32768:2:8"
DRY_ROWS = "1:130:1:2 1:varlen1+63+66:1:2"
DECAYS = ("fast", "slow", "mixed")


def parse_row(spec: str):
    B, T, H, HV, *rest = spec.split(":")
    decay = rest[0] if rest else "fast"
    if len(rest) > 1 or decay not in DECAYS:
        raise ValueError(f"row {spec!r}: B:T:H:HV[:decay], decay one of {DECAYS}")
    lens = [int(x) for x in T[len("varlen"):].split("+")] if T.startswith("varlen") else None
    return int(B), (sum(lens) if lens else int(T)), int(H), int(HV), lens, decay


def run():
    args, dry, dev, path, res = start_round("switch_ab_round.py", "switch_ab.json", budget=150.0)
    import torch

    import linattn
    from linattn.testing import make_gdn_inputs
    sides = ab_sides(os.environ.get("AB_SIDES", DEFAULT_SIDES))
    res["sides"] = {label: f"{var}={val}" for label, (var, val) in sides}
    backend = res["backend"] = os.environ.get("AB_BACKEND", "gluon")
    mode = res["mode"] = os.environ.get("AB_MODE", "fwd")
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"AB_MODE must be fwd or fwdbwd, got {mode!r}")
    start = time.time()
    for spec in (DRY_ROWS if dry else os.environ.get("AB_ROWS", DEFAULT_ROWS)).split():
        B, T, H, HV, lens, decay = parse_row(spec)
        row = dict(row=spec, B=B, T=T, H=H, HV=HV, varlen=lens is not None, decay=decay)
        if time.time() - start > args.budget:
            res["skipped"].append(spec)
            continue
        K = 64 if dry else 128
        cu = None
        if lens:
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=dev)
        x = make_gdn_inputs(1 if lens else B, T, H, HV, K, K, dtype=torch.bfloat16, device=dev,
                            num_states=len(lens) if lens else B, generator=torch.Generator().manual_seed(21 + T))
        if decay == "slow":
            x["g"] = x["g"] * 0.01
        elif decay == "mixed":
            x["g"][..., 1::2] = x["g"][..., 1::2] * 0.01

        be = "triton" if dry else backend

        def fwd():
            with torch.no_grad():
                return linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend=be)

        leaves = ("q", "k", "v", "g", "beta", "initial_state")
        if mode == "fwdbwd":
            for n in leaves:
                x[n].requires_grad_(True)
            gen = torch.Generator(device=dev).manual_seed(22 + T)
            do = torch.randn(x["v"].shape, device=dev, generator=gen).to(x["v"].dtype)
            dht = torch.randn(x["initial_state"].shape, device=dev, generator=gen)

        def fwdbwd():
            o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend=be)
            grads = torch.autograd.grad((o, ht), [x[n] for n in leaves], (do, dht))
            return o.detach(), torch.cat([g.float().flatten() for g in grads])

        try:
            switch_ab(fwdbwd if mode == "fwdbwd" else fwd, sides, row, not dry)
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:600]
        res["rows"].append(row)
        write_json(path, res)
        print(f"  {row}", flush=True)
    res["passed"] = all("error" not in r and r.get("finite") for r in res["rows"])
    write_json(path, res)


if __name__ == "__main__":
    run()
