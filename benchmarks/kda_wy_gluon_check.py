"""GPU check of KDA's Gluon WY kernel (linattn/ops/kda/gluon/wy_bwd.py) against the Triton one on the inputs
chunk_kda's backward gives them (the Triton WY launch spied on): each output's relative RMS difference from the
Triton kernel's and its NaNs (the Gluon outputs poisoned with NaN first), and both kernels' times (CUDA events,
median of 20), the Gluon one at BK = 32 and 16. Writes $OUT/wy_check.json.

    OUT=/tmp/out PYTHONPATH=$PWD python3 benchmarks/kda_wy_gluon_check.py
"""
import json, os, sys, time
import torch
import linattn
from linattn.ops.kda.triton import backward as bw
from linattn.ops.kda.gluon.wy_bwd import kda_wy_bwd_gluon_kernel
from linattn.testing.compare import poison_, rel_rms

OUT = os.environ.get("OUT", "/tmp")
real = bw.kda_wy_bwd_kernel
rows = []
NAMES = ["dq", "dk", "dv", "dgam", "dbeta", "dakk", "daqk"]


def timed(fn, reps=20):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


class Spy:
    def __getitem__(self, grid):
        def launch(*args, **kw):
            real[grid](*args, **kw)
            ref = [args[i].clone() for i in range(11, 18)]
            g_args = list(args)
            for i in range(11, 18):
                g_args[i] = poison_(torch.empty_like(args[i]))
            gk = dict(H=kw["H"], HV=kw["HV"], K=kw["K"], V=kw["V"], BT=kw["BT"], BK=32, num_warps=8)
            kda_wy_bwd_gluon_kernel[grid](*g_args, **gk)
            torch.cuda.synchronize()
            row = dict(grid=list(grid), tinv=str(args[5].dtype))
            for name, r, i in zip(NAMES, ref, range(11, 18)):
                row[name] = dict(nan=int(torch.isnan(g_args[i]).sum()), rel_rms=rel_rms(g_args[i], r))
            row["triton_ms"] = timed(lambda: real[grid](*args, **kw))
            row["gluon_ms"] = timed(lambda: kda_wy_bwd_gluon_kernel[grid](*g_args, **gk))
            row["gluon_bk16_ms"] = timed(lambda: kda_wy_bwd_gluon_kernel[grid](*g_args, **dict(gk, BK=16)))
            rows.append(row)
            print(json.dumps(row), flush=True)
        return launch


bw.kda_wy_bwd_kernel = Spy()          # launch_kda_wy_bwd looks it up at each call
# the backward's wy_bwd hook falls back to the (spied) Triton stage, which runs both kernels and compares
import linattn.ops.kda.gluon.wy_bwd as wy
wy.kda_wy_bwd_gluon_supported = lambda *a: (False, "compared by kda_wy_gluon_check.py")
torch.manual_seed(0)
LENS = [1000, 1, 2047, 152]
for B, T, HV, lens, backend in ((1, 32768, 32, None, "gluon"), (8, 4096, 32, None, "gluon"),
                                (1, 3200, 4, LENS, "gluon"), (1, 3200, 4, LENS, "triton")):
    H, K, V = HV, 128, 128
    bf = torch.bfloat16
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev).to(bf)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf)
    v = torch.randn(B, T, HV, V, device=dev).to(bf)
    g = -(0.01 + 0.1 * torch.rand(B, T, HV, K, device=dev))
    beta = torch.rand(B, T, HV, device=dev)
    N = B if lens is None else len(lens)
    h0 = torch.randn(N, HV, K, V, device=dev) * 0.5
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    n0 = len(rows)
    try:
        o, ht = linattn.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                                  backend=backend)
        ((o.float() * torch.randn_like(o, dtype=torch.float32)).sum() + (ht * torch.randn_like(ht)).sum()).backward()
    except Exception as e:
        import traceback; traceback.print_exc()
        rows.append(dict(error=repr(e)[:2000]))
    if len(rows) > n0:
        rows[-1]["shape"] = dict(B=B, T=T, HV=HV, lens=lens, backend=backend)
    with open(os.path.join(OUT, "wy_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
