"""Kernel breakdown of a chunked op's forward and backward on a GPU (torch.profiler: CUDA time per kernel name, mean
of 3 calls), H16/HV32 (GDN) or H = HV = 32 (KDA), K = V = 128, bf16, initial and final state. The backward is
torch.autograd.grad of (o, final state) on a kept graph; "infer" is the forward without autograd (what a prefill
runs: the autograd forward saves the backward's intermediates, KDA's gluon backend takes its Gluon stages only
there). --op layer_gdn / layer_kda: the same for the training step
of linattn's GatedDeltaNet / KimiDeltaAttention layer or FLA's (`--backend fla`; fla.layers from the
flash-linear-attention wheel) at the sizes of linattn.integrations.transformers_check (hidden 2048, 16 q/k heads,
32 v heads, head dim 128), gradients of the input and every parameter, then one decode step after a 16-token
prefill into the cache at batch 1 and 64 (the kernels a CUDA graph of the step replays, each timed eagerly); a
linattn backend name reaches the layer's ops through LINATTN_BACKEND. Kernels a backend launches on side streams are counted too,
but the columns then sum more than the wall time. Writes $OUT/breakdown_<op>_<backend>.json (default: this folder).

    python3 benchmarks/kernel_breakdown.py --op gdn --backend gluon      # linattn installed (or PYTHONPATH=$PWD)
    python3 benchmarks/kernel_breakdown.py --op kda --backend triton fla  # fla: FLA's own op (FLA_FLASH_QLA=0)
    python3 benchmarks/kernel_breakdown.py --op layer_gdn --backend auto fla
"""
import argparse
import collections
import json
import os

import torch
from torch.profiler import profile, ProfilerActivity

import linattn
from linattn.bench.env import collect_env, env_line

SHAPES = {"gdn": [(1, 65536, 16, 32), (8, 4096, 16, 32), (1, 8192, 16, 32)],
          "kda": [(1, 32768, 32, 32), (8, 4096, 32, 32)],
          "layer_gdn": [(1, 8192), (8, 4096)], "layer_kda": [(1, 8192), (8, 4096)]}


def make_call(op, backend, B, T, H, HV, dev="cuda", g_scale=1.0):
    """The op's call on fresh inputs; g_scale multiplies the log decays (-(0.01 + 0.1 U) per token by default)."""
    K = V = 128
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    gshape = (B, T, HV, K) if op == "kda" else (B, T, HV)
    g = -(0.01 + 0.1 * torch.rand(*gshape, device=dev)) * g_scale
    beta = torch.rand(B, T, HV, device=dev).to(torch.bfloat16)
    h0 = torch.randn(B, HV, K, V, device=dev) * 0.1
    ins = [q, k, v, g, beta, h0]
    for t in ins:
        t.requires_grad_(True)
    if backend == "fla":
        os.environ.setdefault("FLA_FLASH_QLA", "0")
        if op == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        kw = {}
    else:
        fn = linattn.chunk_kda if op == "kda" else linattn.chunk_gated_delta_rule
        kw = dict(backend=backend)
    return (lambda: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)), ins


def make_layer(op, backend, dev="cuda"):
    """linattn's GatedDeltaNet / KimiDeltaAttention layer, or FLA's (backend "fla"), bf16."""
    from linattn.integrations.transformers_check import LAYER
    name = "KimiDeltaAttention" if op == "layer_kda" else "GatedDeltaNet"
    if backend == "fla":
        os.environ.setdefault("FLA_FLASH_QLA", "0")
        import fla.layers as layers
    else:
        os.environ["LINATTN_BACKEND"] = backend
        import linattn.layers as layers
    return getattr(layers, name)(**LAYER, layer_idx=0).to(device=dev, dtype=torch.bfloat16)


def make_layer_call(op, backend, B, T, dev="cuda"):
    """A training step of the layer: outputs (y,), inputs x and the parameters."""
    layer = make_layer(op, backend, dev).train()
    x = torch.randn(B, T, layer.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    return (lambda: (layer(x)[0],)), [x] + [p for p in layer.parameters() if p.requires_grad]


def decode_breakdown(op, backend, N, dev="cuda"):
    """CUDA time per kernel of one decode step (mean of 3) after a 16-token prefill into a RecurrentCache."""
    from linattn.layers import RecurrentCache
    layer = make_layer(op, backend, dev).eval()
    H = layer.hidden_size
    prompt = torch.randn(N, 16, H, device=dev, dtype=torch.bfloat16)
    x1 = torch.randn(N, 1, H, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        cache = RecurrentCache()
        layer(prompt, past_key_values=cache, use_cache=True)
        for _ in range(3):
            layer(x1, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                layer(x1, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    agg = _per_kernel(prof)
    return dict(decode=dict(sorted(agg.items(), key=lambda kv: -kv[1])), decode_total_ms=sum(agg.values()))


def _per_kernel(prof):
    """ms per call of each kernel name (3 calls profiled)."""
    agg = collections.defaultdict(float)
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.key and not ev.key.startswith("aten::") and "Memcpy" not in ev.key:
            agg[ev.key] += t / 3 / 1000.0
    return agg


def breakdown(fwd, ins):
    outs = fwd()
    cot = tuple(torch.randn_like(t) for t in outs)
    for _ in range(3):
        outs = fwd()
        torch.autograd.grad(outs, ins, cot)
    torch.cuda.synchronize()
    res = {}
    for phase in ("fwd", "bwd", "infer"):
        outs = fwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                if phase == "fwd":
                    outs = fwd()
                elif phase == "bwd":
                    torch.autograd.grad(outs, ins, cot, retain_graph=True)
                else:                               # a forward without autograd (prefill, inference)
                    with torch.no_grad():
                        fwd()
            torch.cuda.synchronize()
        agg = _per_kernel(prof)
        res[phase] = dict(sorted(agg.items(), key=lambda kv: -kv[1]))
        res[phase + "_total_ms"] = sum(agg.values())
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=sorted(SHAPES), default="gdn")
    ap.add_argument("--backend", nargs="+", default=["gluon"], help="linattn backends and/or fla")
    ap.add_argument("--g-scale", type=float, default=1.0,
                    help="multiply the log decays (default -(0.01 + 0.1 U) per token) by this: steep decays")
    args = ap.parse_args()
    for backend in args.backend:
        try:
            out = dict(env=env_line(collect_env(torch.device("cuda"))), op=args.op, backend=backend)
        except Exception as e:  # the environment line is informative, not required
            out = dict(env=repr(e), op=args.op, backend=backend)
        if args.g_scale != 1.0:
            out["g_scale"] = args.g_scale
        for shape in SHAPES[args.op]:
            torch.manual_seed(0)
            if args.op.startswith("layer"):
                B, T = shape
                res = out[f"B{B} T{T}"] = breakdown(*make_layer_call(args.op, backend, B, T))
            else:
                B, T, H, HV = shape
                res = out[f"B{B} T{T} H{H}/HV{HV}"] = breakdown(*make_call(args.op, backend, B, T, H, HV,
                                                                           g_scale=args.g_scale))
            print(args.op, backend, B, T, json.dumps({p: round(res[p + "_total_ms"], 3)
                                                      for p in ("fwd", "bwd", "infer")}), flush=True)
            for p in ("fwd", "bwd", "infer"):
                for kname, ms in list(res[p].items())[:12 if args.op.startswith("layer") else 8]:
                    print(f"   {p} {ms:8.3f} ms  {kname[:90]}")
        if args.op.startswith("layer"):
            for N in (1, 64):
                torch.manual_seed(0)
                res = out[f"decode batch {N}"] = decode_breakdown(args.op, backend, N)
                print(args.op, backend, "decode batch", N, round(res["decode_total_ms"], 4), "ms", flush=True)
                for kname, ms in list(res["decode"].items())[:16]:
                    print(f"   decode {ms * 1e3:8.1f} us  {kname[:90]}")
        os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
        tag = "" if args.g_scale == 1.0 else f"_g{args.g_scale:g}"
        path = os.path.join(os.environ.get("OUT", "."), f"breakdown_{args.op}_{backend}{tag}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
