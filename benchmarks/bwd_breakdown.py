"""Kernel breakdown of the gluon backend's forward and backward on a GPU (torch.profiler: CUDA time per kernel name, mean
of 3 calls), B1 T65536, B8 T4096 and B1 T8192, H16/HV32, K = V = 128, bf16, initial and final state, g = -(0.01 + 0.1 U).
The backward is torch.autograd.grad of (o, final state) on a kept graph. The forward's columns miss kernels the segment
path launches on its side streams (B1 T65536). Writes $OUT/bwd_breakdown.json (default: the current folder).

    python3 benchmarks/bwd_breakdown.py          # linattn installed (or PYTHONPATH=$PWD)
"""
import collections
import json
import os

import torch
import linattn
from linattn.bench.env import collect_env, env_line
from torch.profiler import profile, ProfilerActivity

out = {}
try:
    out["env"] = env_line(collect_env(torch.device("cuda")))
except Exception as e:
    out["env"] = repr(e)
dev = "cuda"
for (B, T) in [(1, 65536), (8, 4096), (1, 8192)]:
    H, HV, K, V = 16, 32, 128, 128
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    g = -(0.01 + 0.1 * torch.rand(B, T, HV, device=dev))
    beta = torch.rand(B, T, HV, device=dev).to(torch.bfloat16)
    h0 = torch.randn(B, HV, K, V, device=dev) * 0.1
    ins = [q, k, v, g, beta, h0]
    for t in ins:
        t.requires_grad_(True)
    def fwd():
        return linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              backend="gluon")
    o, hT = fwd()
    do = torch.randn_like(o); dhT = torch.randn_like(hT)
    for _ in range(3):
        o, hT = fwd()
        torch.autograd.grad((o, hT), ins, (do, dhT))
    torch.cuda.synchronize()
    res = {}
    for phase in ("fwd", "bwd"):
        o, hT = fwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                if phase == "fwd":
                    o, hT = fwd()
                else:
                    torch.autograd.grad((o, hT), ins, (do, dhT), retain_graph=True)
            torch.cuda.synchronize()
        agg = collections.defaultdict(float)
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t and ev.key and not ev.key.startswith("aten::") and "Memcpy" not in ev.key:
                agg[ev.key] += t / 3 / 1000.0
        res[phase] = dict(sorted(agg.items(), key=lambda kv: -kv[1]))
        res[phase + "_total_ms"] = sum(agg.values())
    out[f"B{B} T{T}"] = res
    print(B, T, json.dumps({p: round(res[p + "_total_ms"], 3) for p in ("fwd", "bwd")}), flush=True)
    for p in ("fwd", "bwd"):
        for kname, ms in list(res[p].items())[:8]:
            print(f"   {p} {ms:8.3f} ms  {kname[:90]}")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "bwd_breakdown.json"), "w"), indent=1)
