"""`linattn tune --op matmul [--shapes MxNxK ...]`: time each launch config of the matmul kernels on this GPU and
record the fastest per shape bucket in the per-GPU config cache (linattn/runtime/config_cache.py). Configs whose
shared memory exceeds the device's per-block budget are pruned before timing; a config whose result is wrong is
never recorded. Launchers then read the cache; nothing ever tunes on a first call."""
from __future__ import annotations

import argparse
from dataclasses import asdict

DEFAULT_SHAPES = ["8192x8192x8192", "4096x4096x4096", "8192x8192x1024", "2000x3000x1000", "16384x128x16384"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", required=True, choices=["matmul"], help="which op's kernels to tune")
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="problem sizes as MxNxK")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--backends", nargs="+", choices=["triton", "gluon"], default=["triton", "gluon"])
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per config, ms")
    parser.add_argument("--dry-run", action="store_true", help="time and print, but do not write the cache")


def _candidates(backend):
    if backend == "triton":
        from linattn.ops.matmul.triton.matmul import CONFIGS, kernel_source_hash, matmul_triton
        return CONFIGS, kernel_source_hash(), lambda a, b, out, c: matmul_triton(a, b, out=out, config=c)
    from linattn.ops.matmul.gluon.matmul import CONFIGS, kernel_source_hash, matmul_gluon
    return CONFIGS, kernel_source_hash(), lambda a, b, out, c: matmul_gluon(a, b, out=out, config=c)


def run(args) -> int:
    import torch
    import triton
    from linattn.ops.matmul.triton.matmul import shape_key
    from linattn.runtime.config_cache import fits_shared_memory, store
    from linattn.runtime.device import device_facts
    from linattn.testing import TOL, rel_rms

    if not torch.cuda.is_available():
        print("linattn tune: needs a CUDA GPU (timings are per GPU)")
        return 2
    facts = device_facts("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    status = 0
    for backend in args.backends:
        if backend == "gluon":
            from linattn.ops.matmul.api import _gluon_supports
            probe = torch.empty(64, 64, device="cuda", dtype=dtype)
            ok, reason = _gluon_supports(probe, probe)
            if not ok:
                print(f"gluon: skipped ({reason})")
                continue
        configs, src_hash, launch = _candidates(backend)
        for shape in args.shapes:
            M, N, K = (int(x) for x in shape.lower().split("x"))
            a = torch.randn(M, K, device="cuda", dtype=dtype)
            b = torch.randn(K, N, device="cuda", dtype=dtype)
            ref = a.float() @ b.float()
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            results = []
            for name, cfg in configs.items():
                if not fits_shared_memory(cfg.smem_bytes(a.element_size()), facts):
                    print(f"{backend} {shape} {name}: pruned ({cfg.smem_bytes()} B > {facts.smem_per_block} B)")
                    continue
                try:
                    out.fill_(float("nan"))
                    launch(a, b, out, cfg)
                    err = rel_rms(out, ref)
                    if not err <= TOL[dtype]:
                        print(f"{backend} {shape} {name}: WRONG (rel_rms {err:.2e}); not recorded")
                        status = 1
                        continue
                    ms = triton.testing.do_bench(lambda: launch(a, b, out, cfg), rep=args.rep, return_mode="median")
                except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                    print(f"{backend} {shape} {name}: failed: {e!r}"[:300])
                    continue
                tflops = 2.0 * M * N * K / (ms * 1e-3) / 1e12
                print(f"{backend} {shape} {name}: {ms:.3f} ms {tflops:.0f} TFLOP/s")
                results.append((ms, name, cfg))
            if not results:
                print(f"{backend} {shape}: no valid config")
                status = 1
                continue
            ms, name, cfg = min(results, key=lambda r: r[0])
            print(f"{backend} {shape}: best {name} ({ms:.3f} ms)")
            if not args.dry_run:
                path = store(f"matmul_{backend}", src_hash, shape_key(M, N, K, dtype), asdict(cfg), facts.name,
                             extra={"gpu": facts.name, "triton": triton.__version__})
                print(f"    recorded in {path}")
    return status
