"""Speed as a user gets it: each shape timed eagerly in several fresh processes, with what explains a difference
between them.

    python3 benchmarks/gpu/eager_probe.py --out DIR [--shapes fwd_b1_t8192,decode_b1] [--procs 4] [--json NAME]

Shapes: the GDN forward at B1 T8192 / T32768 and the decode at B1 / B256 (the default, the gate's); by name, for a
survey of every public op's host cost (--procs 1): the GDN forward at B1 T256, chunk_kda at B1 T2048 / T8192 and its
decode, causal_conv1d, causal_conv1d_update and rms_norm_gated at a layer's sizes (SHAPES).

A process per (shape, pass), in the order cold caches (first pass: Triton's cache emptied into a private folder),
warm, after 4 GiB (a 4 GiB tensor allocated and freed first, so the caching allocator holds it), warm. In each:
- eager_ms: median over 3 loops of 100 back-to-back calls (one synchronisation per loop), as a user's loop runs;
- graph_ms: the same call replayed from a CUDA graph (the kernels alone), where capture works;
- host_us: host-clock time for one call to return with the GPU idle (synchronised before each), median of 20;
- allocator: cudaMalloc / cudaFree calls, allocation retries and sync-all-streams during the eager loops
  (torch.cuda.memory_stats deltas);
- runtime_api: CUDA runtime / driver calls of 10 eager calls by torch.profiler (count and host us per call), and the
  GPU kernel time per call;
- sm_clock: the SM clock (nvidia-smi) sampled during the eager loops;
- python_us: a cProfile of 20 calls, the functions with the most own time (us per call): where the host time goes;
- python_speed_us: a plain-Python control timed before and after the loops (_python_speed_us): the host's own speed;
  the summary's slow_host says which processes ran it SLOW_HOST times slower than the shape's fastest;
- host_us_layers (decode): host us per call through each layer of the eager path (public function, custom op,
  launcher, a trivial custom op);
- eager_ms_late (and host_us_public_late for decode): the eager loops (the public call's host us) again after the
  profiles, late_after_first_call_s after the first call: whether a process's early slowness fades.
The summary gives, per shape, each process's eager ms and the spread (slowest / fastest - 1); --max-spread makes the
exit status 1 when a shape's spread exceeds it (the gate's regression check).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)                  # linattn from this checkout

SHAPES = {  # name: (kind, B, T, H, HV)
    "fwd_b1_t8192": ("fwd", 1, 8192, 16, 32),
    "fwd_b1_t32768": ("fwd", 1, 32768, 16, 32),
    "decode_b1": ("decode", 1, 1, 32, 32),
    "decode_b256": ("decode", 256, 1, 32, 32),
    # by name (the host-cost survey of every public op: --procs 1): a short forward, KDA, the layers' pieces
    "fwd_b1_t256": ("fwd", 1, 256, 16, 32),
    "kda_b1_t2048": ("kda", 1, 2048, 16, 32),
    "kda_b1_t8192": ("kda", 1, 8192, 16, 32),
    "kda_decode_b1": ("kda_decode", 1, 1, 16, 32),
    "conv_b1_t2048": ("conv", 1, 2048, 16, 32),            # causal_conv1d, D = HV * 128, W = 4, silu
    "conv_update_b1": ("conv_update", 1, 1, 16, 32),       # causal_conv1d_update, one token, D = HV * 128
    "norm_t2048": ("norm", 1, 2048, 16, 32),               # rms_norm_gated on [B * T, HV, 128], a group per head
}
DEFAULT_SHAPES = ("fwd_b1_t8192", "fwd_b1_t32768", "decode_b1", "decode_b256")   # the gate's
PASSES = ("cold", "warm", "after4g", "warm")
GATE_SPREAD = 0.05           # the gate's bound on slowest / fastest - 1 between fresh processes


def _inputs(kind, B, T, H, HV, torch):
    K = V = 128
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev) + 4.0) * 4.0
    beta = torch.rand(B, T, HV, device=dev) * 0.9 + 0.05
    h0 = torch.randn(B, HV, K, V, device=dev) * 0.1
    if kind.startswith("kda"):             # a log decay per key channel
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device=dev) + 4.0) * 4.0
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


def _call(kind, B, T, H, HV, torch):
    """(one eager call of the shape's public op on fresh inputs (inference, backend "auto"), its chunk / decode inputs
    or None)."""
    import linattn
    if kind in ("conv", "conv_update", "norm"):
        D, W, dev, bf = HV * 128, 4, "cuda", torch.bfloat16
        w = torch.randn(D, W, device=dev)
        if kind == "conv":
            x = torch.randn(B, T, D, device=dev, dtype=bf)
            return (lambda: linattn.causal_conv1d(x, w, activation="silu")), None
        if kind == "conv_update":
            x = torch.randn(B, D, device=dev, dtype=bf)
            state = torch.randn(B, D, W, device=dev, dtype=bf)
            return (lambda: linattn.causal_conv1d_update(x, state, w, activation="silu")), None
        x, gate = (torch.randn(B * T, HV, 128, device=dev, dtype=bf) for _ in range(2))
        weight = torch.ones(128, device=dev)
        return (lambda: linattn.rms_norm_gated(x, gate, weight)), None
    x = _inputs(kind, B, T, H, HV, torch)
    fn = dict(fwd=linattn.chunk_gated_delta_rule, decode=linattn.fused_recurrent_gated_delta_rule,
              kda=linattn.chunk_kda, kda_decode=linattn.fused_recurrent_kda)[kind]
    return lambda: fn(**x, output_final_state=True), x


def _clock_sampler(samples, stop):
    """The SM clock every 50 ms through NVML in this process (no subprocess: forking would disturb the timing);
    nothing where pynvml is missing (the snapshot after the loops still says the clock)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001
        return
    while not stop.is_set():
        samples.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
        stop.wait(0.05)


def _clock_now():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return repr(e)


def _idle_us(fn, torch, n=50):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def _eager_loops(call, torch, loops=3, calls=100):
    """ms per call of `loops` loops of `calls` back-to-back eager calls, one synchronisation per loop."""
    out = []
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3 / calls)
    return out


def _decode_layers(x, torch) -> dict:
    """Host us per decode call (GPU idle) through each layer of the eager path: the public function (checks, backend
    choice, custom op), the torch custom op alone, the launcher alone (fused_recurrent_gdn_fwd), and a trivial
    custom op (the dispatcher's own cost on this host)."""
    import linattn
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gdn_fwd
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    scale = q.shape[-1] ** -0.5

    @torch.library.custom_op("eager_probe::trivial", mutates_args=())
    def trivial(a: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(a)
    calls = {
        "public": lambda: linattn.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0,
                                                                   output_final_state=True),
        "custom_op": lambda: torch.ops.linattn.fused_recurrent_gdn(q, k, v, g, beta, scale, h0, None, None, None,
                                                                   None, False, False, True),
        "launcher": lambda: fused_recurrent_gdn_fwd(q, k, v, g, beta, scale, h0, None, None, None, None, False,
                                                    False, True, inplace=False),
        "trivial_custom_op": lambda: trivial(q),
        "empty_like": lambda: torch.empty_like(q),
    }
    out = {}
    for name, fn in calls.items():
        fn()
        out[name] = round(_idle_us(fn, torch), 1)
    return out


def _python_speed_us() -> float:
    """The host's plain-Python speed: the best of 5 timings of a fixed dict loop (us), with no torch or GPU in it.
    The device host is a KVM guest whose vCPU speed varies ~2x over seconds, in one process and between processes;
    a host-bound eager row varies with it, and this control says by how much the host itself did."""
    def work():
        d = {}
        for i in range(20000):
            d[i & 255] = d.get(i & 255, 0) + i
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(5):
            work()
        best = min(best, (time.perf_counter() - t) * 1e6 / 5)
    return round(best, 1)


def child(shape: str, cond: str) -> dict:
    import torch

    import linattn  # noqa: F401 -- imported before anything else, as a user's script does
    kind, B, T, H, HV = SHAPES[shape]
    if cond == "after4g":
        torch.empty(4 << 30, dtype=torch.uint8, device="cuda").zero_()     # freed at once, kept by the allocator
    call, x = _call(kind, B, T, H, HV, torch)
    res = dict(shape=shape, cond=cond, pid=os.getpid(), python_speed_us=[_python_speed_us()])
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    res["first_call_s"] = round(time.perf_counter() - t0, 3)
    t_first = time.perf_counter()
    for _ in range(3):
        call()
    torch.cuda.synchronize()

    stats0 = torch.cuda.memory_stats()
    samples, stop = [], threading.Event()
    th = threading.Thread(target=_clock_sampler, args=(samples, stop), daemon=True)
    th.start()
    loops = _eager_loops(call, torch)
    stop.set()
    th.join()
    stats1 = torch.cuda.memory_stats()
    res["python_speed_us"].append(_python_speed_us())
    res["eager_ms_loops"] = loops
    res["eager_ms"] = statistics.median(loops)
    res["sm_clock_mhz"] = samples
    res["clocks_after_loops"] = _clock_now()
    res["allocator"] = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in
                        ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}

    host = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        host.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    res["host_us"] = statistics.median(host)
    if kind == "decode":
        res["host_us_layers"] = _decode_layers(x, torch)

    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        call()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = sorted(((f"{os.path.basename(f)}:{ln}:{fn}", tt * 1e6 / 20, nc) for (f, ln, fn), (_, nc, tt, _, _)
                   in st.stats.items()), key=lambda r: -r[1])[:30]
    res["python_us"] = dict(total=round(st.total_tt * 1e6 / 20, 1),
                            top=[dict(fn=f, us=round(us, 2), ncalls=nc) for f, us, nc in rows])

    # the eager loops again, later in the process's life: a slowdown that fades after the first call shows as
    # eager_ms above eager_ms_late
    res["late_after_first_call_s"] = round(time.perf_counter() - t_first, 3)
    late = _eager_loops(call, torch)
    res["eager_ms_late_loops"] = late
    res["eager_ms_late"] = statistics.median(late)
    if kind == "decode":
        res["host_us_public_late"] = _idle_us(call, torch)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    api, kernels_us = {}, 0.0
    for ev in prof.key_averages():
        if ev.key.startswith(("cuda", "cu")) and not ev.key.startswith("cudaDeviceSynchronize_") and ev.count:
            api[ev.key] = dict(count_per_call=ev.count / 10, host_us_per_call=round(ev.cpu_time_total / 10, 1))
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "cuda_time_total", 0)
        if getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            kernels_us += dev_us
    res["runtime_api"] = api
    res["kernel_us_per_call"] = round(kernels_us / 10, 1)

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                call()
        graph.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 10)
        res["graph_ms"] = statistics.median(ts)
    except Exception as e:  # noqa: BLE001
        res["graph_ms"] = None
        res["graph_error"] = repr(e)[:300]
    return res


SLOW_HOST = 1.5


def summarise(runs, max_spread=None):
    """(summary, failed) of one shape's processes: each process's eager ms, graph ms and host us, and the spread
    slowest / fastest - 1 of the eager times; failed when a process gave no time, or the spread exceeds max_spread."""
    eager = [r["eager_ms"] for r in runs if "eager_ms" in r]
    complete = bool(runs) and len(eager) == len(runs)
    spread = max(eager) / min(eager) - 1 if complete else None
    failed = not complete or (max_spread is not None and spread > max_spread)
    speeds = [r.get("python_speed_us") or [] for r in runs]
    fastest = min((v for sp in speeds for v in sp), default=None)
    # a process whose plain-Python control ran SLOW_HOST times slower than the fastest control of the shape's
    # processes, before or after its loops: it met a slow host phase (the reading of a spread, not a verdict)
    slow_host = [None if not sp or not fastest else max(sp) > SLOW_HOST * fastest for sp in speeds]
    return dict(eager_ms=eager, spread=spread, graph_ms=[r.get("graph_ms") for r in runs],
                host_us=[r.get("host_us") for r in runs], eager_ms_late=[r.get("eager_ms_late") for r in runs],
                python_speed_us=[r.get("python_speed_us") for r in runs], slow_host=slow_host), failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default="eager_probe.json")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--procs", type=int, default=len(PASSES), help="processes per shape (passes in PASSES order)")
    ap.add_argument("--max-spread", type=float, default=None, help="exit 1 when a shape's spread exceeds this")
    ap.add_argument("--gate", action="store_true", help="gate.py's section: --max-spread 0.05, and the JSON "
                                                        "holds one case per shape")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(*a.child)), flush=True)
        return 0
    from common import env_line, write_json
    if a.gate:
        a.max_spread = GATE_SPREAD
    res = dict(env=env_line()["line"], shapes={}, summary={}, cases=[])
    path = os.path.join(a.out, a.json)
    failed = False
    unknown = [n for n in a.shapes.split(",") if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    for shape in a.shapes.split(","):
        runs = []
        for i in range(a.procs):
            cond = PASSES[i % len(PASSES)]
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            tmp = None
            if cond == "cold":
                tmp = tempfile.mkdtemp(prefix="probe_cache_")
                env["TRITON_CACHE_DIR"] = tmp
            try:
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", a.out, "--child", shape, cond],
                                   env=env, capture_output=True, text=True, timeout=240)
                line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                r = json.loads(line[-1][7:]) if line else dict(cond=cond, error=(p.stderr or p.stdout)[-1500:])
            except subprocess.TimeoutExpired:
                r = dict(cond=cond, error="timeout")
            finally:
                if tmp:
                    shutil.rmtree(tmp, ignore_errors=True)
            runs.append(r)
            print(shape, {k: r.get(k) for k in ("cond", "eager_ms", "graph_ms", "host_us", "allocator",
                                                 "kernel_us_per_call", "error")}, flush=True)
            res["shapes"][shape] = runs
            write_json(path, res)
        res["summary"][shape], bad = summarise(runs, a.max_spread)
        failed |= bad
        # The case is judged against the gate's threshold whether or not --max-spread sets the exit status.
        res["cases"].append(dict(case=f"{shape} process spread <= {GATE_SPREAD:.0%}",
                                 passed=not summarise(runs, GATE_SPREAD)[1], **res["summary"][shape]))
        write_json(path, res)
    for shape, s in res["summary"].items():
        spread = "-" if s["spread"] is None else f"{s['spread'] * 100:.1f}%"
        print(f"{shape:16s} eager ms {[round(e, 4) for e in s['eager_ms']]} spread {spread} slow host phase "
              f"{s['slow_host']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
