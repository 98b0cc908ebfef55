"""Precision of the fused backward's decomposition on a CPU: the torch model of the fused per-chunk backward
(linattn/testing/fused_bwd_model.py) with its 16-bit rounding points, A saved in fp32 or bf16, against the Triton
backward under the interpreter, each gradient's relative RMS error from fp64 autograd through the chunk reference,
on the same bf16 inputs, for production, slow and fast decays.

    TRITON_INTERPRET=1 python3 benchmarks/fused_bwd_precision.py [--T 512] [--K 128] [--json out.json]
"""
import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import linattn  # noqa: E402
from linattn.bench.env import collect_env  # noqa: E402
from linattn.ops.gated_delta_rule.reference import chunk_reference  # noqa: E402
from linattn.testing.compare import rel_rms  # noqa: E402
from linattn.testing.fused_bwd_model import fused_bwd_model  # noqa: E402
from linattn.testing.inputs import make_gdn_inputs  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
DECAYS = {"production": 1.0, "slow (g x 0.01)": 0.01, "fast (g x 20)": 20.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    bf = torch.bfloat16
    rows = {}
    for label, g_scale in DECAYS.items():
        x = make_gdn_inputs(1, a.T, 2, 4, a.K, a.K, dtype=bf)
        x["g"] = x["g"] * g_scale
        do = torch.randn(1, a.T, 4, a.K).to(bf)
        dht = torch.randn_like(x["initial_state"])
        ins = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
        leaves = [t.double().requires_grad_(True) for t in ins]
        o, ht = chunk_reference(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        ref = torch.autograd.grad([o, ht], leaves, [do.double(), dht.double()])
        row = {}
        for tag, a_dtype in (("model, A fp32", None), ("model, A bf16", bf)):
            m = fused_bwd_model(*ins[:5], do, dht=dht, initial_state=ins[5], rnd=bf, a_dtype=a_dtype,
                                compute_dtype=torch.float32)
            row[tag] = {n: rel_rms(m[n], r) for n, r in zip(NAMES, ref)}
        leaves = [t.clone().requires_grad_(True) for t in ins]
        o, ht = linattn.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                               backend="triton")
        got = torch.autograd.grad([o, ht], leaves, [do, dht])
        row["triton backward"] = {n: rel_rms(t, r) for n, t, r in zip(NAMES, got, ref)}
        rows[label] = row
        for tag, errs in row.items():
            print(f"{label:18s} {tag:16s} " + "  ".join(f"{n} {e:.2e}" for n, e in errs.items()), flush=True)
    if a.json:
        env = collect_env("cpu")
        json.dump(dict(env=env, shape=dict(B=1, T=a.T, H=2, HV=4, K=a.K, V=a.K, dtype="bfloat16"), rows=rows),
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
