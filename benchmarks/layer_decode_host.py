"""The host path of one eager GatedDeltaNet (or, with --layer kda, KimiDeltaAttention) decode step on a CPU: the
linattn.layers layer after a 16-token prefill into a RecurrentCache, then one token per row, with every Triton launch
recorded by the stand-in sm_90 driver of linattn/runtime/hostsim.py instead of made (so the JIT's binding, the launch
caches and the launchers' Python all run). Run without TRITON_INTERPRET (a child-free process: the kernels are compiled
for sm_90a once).

    python3 benchmarks/layer_decode_host.py [--layer gdn|kda] [--hidden 256 --head-dim 16] [--batch 1] [--mask]
                                            [--dtype float32] [--cpu-checks] [--profile] [--train T]

--train T: a training step instead (the layer's forward on [batch, T, hidden] with autograd, then the backward of its
output; no cache): what an eager training loop's host runs per layer.

Prints per step: Triton launches (and how many went through the JIT's run), torch ops (aten; device = those that
launch a GPU kernel), custom-op dispatches, host syncs (linattn/ops/gated_delta_rule/triton/hostsim.py's counter),
Python function calls (cProfile) and host us per step (thread CPU time, best and median of 40 batches: the CPU is
shared). The heads keep the timed H200 layer's structure (16 q/k heads, 32 v heads, GVA 2) at a small head dim, so
that the CPU's matmuls stay small: they still count in the host time (a GPU enqueues them). By default the checks that
only CPU tensors get (value reads of g, beta and slot indices) are left out and the decode op's signature memo is on,
as for CUDA tensors; --cpu-checks keeps the CPU's behaviour.
"""
import argparse
import cProfile
import collections
import io
import os
import pstats
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", default="gdn", choices=["gdn", "kda"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mask", action="store_true", help="pass a padding mask (row 0 left-padded when batch > 1)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--cpu-checks", action="store_true", help="keep the CPU-only value checks")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top 30 by cumulative time")
    ap.add_argument("--train", type=int, default=0, metavar="T", help="time a training step on T tokens instead")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("run without TRITON_INTERPRET=1 (the stand-in driver compiles and records real launches)")
    torch.set_num_threads(1)            # the CPU's matmul threads would spin against the other users of the machine

    from linattn.backends import op_backends
    from linattn.layers import GatedDeltaNet, KimiDeltaAttention, RecurrentCache
    from linattn.ops.conv1d import validation as conv_validation
    from linattn.ops.gated_delta_rule import fused_recurrent, validation
    from linattn.runtime import call_memo
    from linattn.ops.gated_delta_rule.triton import fused_recurrent as launcher
    from linattn.ops.gated_delta_rule.triton.hostsim import _patched, count_torch_ops
    from linattn.runtime.device import DeviceFacts
    from linattn.runtime.hostsim import H200_SMS, count_jit_runs, fake_hopper

    facts = DeviceFacts("cuda", "NVIDIA H200 (simulated)", (9, 0), H200_SMS, 232448, 0)
    patches = [(op_backends(op).backends["triton"], "supports", lambda **_: (True, "")) for op in
               ("causal_conv1d_update", "causal_conv1d", "rms_norm_gated", "fused_recurrent_gated_delta_rule",
                "fused_recurrent_kda", "chunk_gated_delta_rule", "chunk_kda")]
    patches.append((launcher, "device_facts", lambda device=None: facts))
    from linattn.ops.norm import l2norm
    patches.append((l2norm, "_triton_ok", lambda x: True))      # q / k's l2norm on its Triton passes, as on a GPU
    if not a.cpu_checks:
        patches += [(validation, "check_gate_values", lambda *_, **__: None),
                    (validation, "check_channel_decay_values", lambda *_, **__: None),
                    (call_memo, "memo_applies", lambda q: True),
                    (fused_recurrent, "_check_index_values", lambda *_, **__: None),
                    (conv_validation, "check_index_values", lambda *_, **__: None)]
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    kind = GatedDeltaNet if a.layer == "gdn" else KimiDeltaAttention
    layer = kind(hidden_size=a.hidden, head_dim=a.head_dim, num_heads=16, num_v_heads=32, expand_v=1,
                 layer_idx=0).to(dtype)
    layer.train(a.train > 0)
    B = a.batch
    prompt, token = torch.randn(B, 16, a.hidden, dtype=dtype), torch.randn(B, 1, a.hidden, dtype=dtype)
    mask = None
    if a.mask:
        mask = torch.ones(B, 17, dtype=torch.long)
        if B > 1:
            mask[0, :3] = 0
    cache = RecurrentCache()
    grad_mode = torch.enable_grad() if a.train else torch.no_grad()
    with grad_mode, fake_hopper() as drv, _patched(patches):
        if a.train:
            xs = [torch.randn(B, a.train, a.hidden, dtype=dtype, requires_grad=True) for _ in range(2)]
            dy = torch.randn(B, a.train, a.hidden, dtype=dtype)
            turn = [0]

            def step():
                x = xs[turn[0] % 2]
                turn[0] += 1
                y = layer(x)[0]
                y.backward(dy)
                x.grad = None
                for p in layer.parameters():
                    p.grad = None
        else:
            layer(prompt, attention_mask=None if mask is None else mask[:, :16], past_key_values=cache,
                  use_cache=True)

            def step():
                return layer(token, attention_mask=mask, past_key_values=cache, use_cache=True)
        step()
        step()
        del drv.launches[:]
        with count_jit_runs() as runs:
            ops = count_torch_ops(step)
        launches = [name for name, _, _ in drv.launches]
        times = []
        for _ in range(40):
            n = max(1, a.calls // 10)
            t0 = time.thread_time()
            for _ in range(n):
                step()
            times.append((time.thread_time() - t0) / n * 1e6)
            del drv.launches[:]
        times.sort()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            step()
        prof.disable()
        del drv.launches[:]
    stats = pstats.Stats(prof)
    what = f"training step T{a.train}" if a.train else "decode step"
    print(f"{kind.__name__} {what}, batch {B}, hidden {a.hidden}, H16/HV32 head dim {a.head_dim}, {a.dtype}"
          f"{', mask' if mask is not None else ''}{', CPU checks' if a.cpu_checks else ''}")
    print(f"  Triton launches {len(launches)} ({runs[0]} through the JIT's run): {', '.join(launches)}")
    print(f"  torch ops {ops['aten']} (device {ops['device']}: "
          f"{dict(collections.Counter(ops['device_ops']))}), custom-op dispatches {len(ops['custom'])}")
    print(f"  host syncs {len(ops['syncs'])}{': ' + ', '.join(ops['syncs']) if ops['syncs'] else ''}")
    print(f"  Python function calls {stats.total_calls // a.calls}")
    print(f"  host us/step: best {times[0]:.1f}, median {times[len(times) // 2]:.1f}")
    if a.profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
