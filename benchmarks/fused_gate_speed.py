"""FLA's in-kernel gate and beta sigmoid (use_gate_in_kernel, use_beta_sigmoid_in_kernel) against the same call with g and
beta computed beforehand, forward, on a GPU: backends triton and auto, one process, alternated, eager, median of
3 x 20 calls; H16/HV32, K = V = 128, bf16, initial and final state, B1 T32768 and B8 T4096. Writes
$OUT/gate_speed.json (default: the current folder).

    python3 benchmarks/fused_gate_speed.py       # linattn installed (or PYTHONPATH=$PWD)
"""
import json
import os
import time

import torch
import torch.nn.functional as F
import linattn
from linattn.bench.env import collect_env, env_line

dev = "cuda"
res = {"env": env_line(collect_env(torch.device(dev))), "rows": []}
for (B, T) in [(1, 32768), (8, 4096)]:
    H, HV, K, V = 16, 32, 128, 128
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    graw = torch.randn(B, T, HV, device=dev)
    A_log = torch.rand(HV, device=dev).log(); dt_bias = torch.randn(HV, device=dev) * 0.5
    blog = torch.randn(B, T, HV, device=dev)
    g = -A_log.exp() * F.softplus(graw + dt_bias); beta = torch.sigmoid(blog)
    h0 = torch.randn(B, HV, K, V, device=dev) * 0.1
    calls = {
        "precomputed g, beta (triton)": lambda: linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton"),
        "fused gate + beta sigmoid (triton)": lambda: linattn.chunk_gated_delta_rule(q, k, v, graw, blog, initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend="triton"),
        "precomputed g, beta (auto)": lambda: linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True),
        "fused gate + beta sigmoid (auto)": lambda: linattn.chunk_gated_delta_rule(q, k, v, graw, blog, initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True),
    }
    o1 = calls["precomputed g, beta (triton)"]()[0].float(); o2 = calls["fused gate + beta sigmoid (triton)"]()[0].float()
    diff = ((o1 - o2).pow(2).mean().sqrt() / o1.pow(2).mean().sqrt()).item()
    times = {n: [] for n in calls}
    for f in calls.values():
        for _ in range(3): f()
    torch.cuda.synchronize()
    for rep in range(3):
        for n, f in calls.items():
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(20): f()
            torch.cuda.synchronize(); times[n].append((time.perf_counter() - t) / 20 * 1e3)
    row = {"shape": f"B{B} T{T} H{H}/HV{HV}", "rel_rms_fused_vs_precomputed": diff,
           "ms": {n: sorted(v)[1] for n, v in times.items()}, "all_ms": times}
    res["rows"].append(row); print(json.dumps({k: row[k] for k in ("shape", "rel_rms_fused_vs_precomputed", "ms")}), flush=True)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "gate_speed.json"), "w"), indent=1)
