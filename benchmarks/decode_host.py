"""Host time of one eager decode call on a CPU, launches faked: `fused_recurrent_gated_delta_rule` at eager_probe.py's
decode_b1 shape (batch 1, H = HV = 32, K = V = 128, bf16 q/k/v, fp32 g/beta, an fp32 initial state in and a new fp32
final state out: FLA's mode), with every Triton launch recorded by the stand-in sm_90 driver of
linattn/runtime/hostsim.py instead of made. Run without TRITON_INTERPRET (the kernel is compiled for sm_90a once).

    python3 benchmarks/decode_host.py [--batch 1] [--pool] [--calls 200] [--rounds 30] [--profile] [--json]
                                      [--c-launcher]

Prints host us per call (thread CPU time, time.thread_time_ns, over loops of --calls calls; best and median of --rounds loops: the
machine is shared) of: the public call; the public call with the per-signature direct launch switched off (the
signature memo, the launcher, the host path's launch); the launcher alone (fused_recurrent_gdn_fwd); the two output
allocations alone. The signature memo applies as for CUDA tensors (here switched on for CPU ones), and the CPU-only
value checks are left out. --pool: a pool of 2 * batch + 1 slots updated in place (vLLM's mode) instead.
Not included: the C launcher (cuLaunchKernelEx, ~6 us on the H200's host) and the CUDA caching allocator (CPU
allocations of the 2 MB state go to mmap unless glibc keeps them: MALLOC_MMAP_THRESHOLD_=268435456).
Runs against whichever linattn is on the path (an older tree: its modes that exist).
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch


def _loops(fn, calls, rounds, drv):
    fn()
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(calls):
            fn()
        out.append((time.thread_time_ns() - t0) / calls / 1e3)
        del drv.launches[:]
    return round(min(out), 2), round(statistics.median(out), 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pool", action="store_true", help="a state pool updated in place (state_indices)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top 25 of the public call")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--c-launcher", action="store_true", help="the stand-in launcher with Triton's CudaLauncher "
                    "structure (its __call__ included, as on a GPU; the direct launch then calls the C launch under "
                    "it where the tree can)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("run without TRITON_INTERPRET=1 (the stand-in driver compiles and records real launches)")
    torch.set_num_threads(1)

    import linattn
    from linattn.runtime import call_memo
    from linattn.ops.gated_delta_rule import fused_recurrent as F
    from linattn.ops.gated_delta_rule import validation
    from linattn.ops.gated_delta_rule.triton import fused_recurrent as L
    from linattn.ops.gated_delta_rule.triton.hostsim import _LaunchNames, _patched
    from linattn.runtime.device import DeviceFacts
    from linattn.runtime.hostsim import H200_SMS, count_jit_runs, fake_hopper

    facts = DeviceFacts("cuda", "NVIDIA H200 (simulated)", (9, 0), H200_SMS, 232448, 0)
    patches = [(F._backends.backends["triton"], "supports", lambda **_: (True, "")),
               (L, "device_facts", lambda device=None: facts),
               (validation, "check_gate_values", lambda *_, **__: None),
               (F, "_check_index_values", lambda *_, **__: None),
               (call_memo, "memo_applies", lambda q: True)]
    B, H, K = a.batch, 32, 128
    torch.manual_seed(0)
    x = dict(q=torch.randn(B, 1, H, K, dtype=torch.bfloat16), k=torch.randn(B, 1, H, K, dtype=torch.bfloat16),
             v=torch.randn(B, 1, H, K, dtype=torch.bfloat16), g=-torch.rand(B, 1, H), beta=torch.rand(B, 1, H))
    if a.pool:
        opts = dict(initial_state=torch.randn(2 * B + 1, H, K, K), state_indices=torch.randperm(2 * B + 1)[:B],
                    inplace=True)
    else:
        opts = dict(initial_state=torch.randn(B, H, K, K), output_final_state=True)

    def public():
        return linattn.fused_recurrent_gated_delta_rule(**x, **opts)

    h0, inplace = opts["initial_state"], a.pool

    def launcher():
        return L.fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, h0, None,
                                         opts.get("state_indices"), None, None, False, False, not inplace, inplace)

    def allocations():
        return torch.empty_like(x["v"]), (None if inplace else torch.empty_like(h0))

    calls = {"public": public, "launcher": launcher, "allocations": allocations}
    res = dict(shape=f"decode B{B} H{H} K=V={K} " + ("pool in place" if a.pool else "fp32 state in, new state out"),
               python=sys.version.split()[0], torch=torch.__version__, linattn=os.path.dirname(linattn.__file__))
    with torch.no_grad(), fake_hopper(**({"c_launcher": True} if a.c_launcher else {})) as drv, _patched(patches):
        drv.launches = _LaunchNames()           # names only: kept arguments would keep every output alive
        for name, fn in calls.items():
            fn()
            del drv.launches[:]
            with count_jit_runs() as runs:
                fn()
            launches = len(drv.launches)
            best, median = _loops(fn, a.calls, a.rounds, drv)
            res[name] = dict(best_us=best, median_us=median, launches=launches, jit_runs=runs[0])
        if hasattr(F, "_DIRECT"):                   # the direct launch off: the path before it
            with _patched([(F, "direct_decode", lambda *_, **__: None), (F, "_DIRECT", {})]):
                best, median = _loops(public, a.calls, a.rounds, drv)
            res["public_without_direct"] = dict(best_us=best, median_us=median)
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls * 10):
                public()
            prof.disable()
            del drv.launches[:]
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            res["profile"] = s.getvalue()
    if a.json:
        print(json.dumps(res))
        return 0
    print(res["shape"], "| linattn from", res["linattn"])
    for name in ("public", "public_without_direct", "launcher", "allocations"):
        if name in res:
            r = res[name]
            extra = f", launches {r['launches']}, JIT runs {r['jit_runs']}" if "launches" in r else ""
            print(f"  {name:22s} best {r['best_us']:7.2f} us, median {r['median_us']:7.2f} us{extra}")
    if "profile" in res:
        print(res["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
