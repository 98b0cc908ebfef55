"""Where the host time of one eager forward goes: per row (B, T, H, HV), host-clock us per call (common.host_us) and
a cProfile of `calls` back-to-back calls (no synchronisation inside), its top functions by own time and by
cumulative time, in us per call. Answers which Python step (descriptor builds, JIT launch binding, stream and event
calls, allocations) a launch path adds where the eager forward is host-bound (at B1 T8192 the gluon forward's
segment launch takes about 0.57 ms eager against 0.21 ms in a CUDA graph).

Usage: python3 benchmarks/gpu/host_profile.py --out DIR [--backend gluon] [--dry]   (rows: HOST_ROWS="B:T:H:HV;...")"""
import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_us, run_result, write_json  # noqa: E402

DEFAULT_ROWS = "1:8192:16:32;8:4096:16:32"


def parse_rows(spec: str):
    return [tuple(int(x) for x in item.split(":")) for item in filter(None, (s.strip() for s in spec.split(";")))]


def top(stats: pstats.Stats, key: str, calls: int, n: int = 25):
    """The n functions with the largest `key` ("tottime" or "cumtime") as (name, us per forward call, ncalls)."""
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append((f"{os.path.basename(file)}:{line}:{fn}", (tt if key == "tottime" else ct) * 1e6 / calls, nc))
    return [dict(fn=f, us=round(us, 1), ncalls=nc) for f, us, nc in sorted(rows, key=lambda r: -r[1])[:n]]


def row(B, T, H, HV, backend, device, calls):
    import torch

    from linattn import chunk_gated_delta_rule
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, initial_state=True, device=device)

    def fwd():
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                      output_final_state=True, backend=backend)
    out = dict(B=B, T=T, H=H, HV=HV, backend=backend, host_us=host_us(fwd, calls))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fwd()
    prof.disable()
    if device == "cuda":
        torch.cuda.synchronize()
    st = pstats.Stats(prof)
    out["profiled_us"] = st.total_tt * 1e6 / calls
    out["by_own_time"] = top(st, "tottime", calls)
    out["by_cumulative"] = top(st, "cumtime", calls)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="gluon", choices=("gluon", "triton"))
    ap.add_argument("--dry", action="store_true", help="CPU: one tiny row through the Triton backend (logic only)")
    a = ap.parse_args()
    import torch
    dry = a.dry or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    backend = "triton" if dry else a.backend
    rows = [(1, 64, 1, 2)] if dry else parse_rows(os.environ.get("HOST_ROWS", DEFAULT_ROWS))
    res = run_result("host_profile.py", device, dry_run=dry, rows=[])
    path = os.path.join(a.out, "host_profile.json")
    for B, T, H, HV in rows:
        try:
            r = row(B, T, H, HV, backend, device, 2 if dry else 20)
        except Exception as e:  # noqa: BLE001
            r = dict(B=B, T=T, H=H, HV=HV, backend=backend, error=repr(e)[:600])
        print({k: v for k, v in r.items() if k not in ("by_own_time", "by_cumulative")}, flush=True)
        for key in ("by_cumulative", "by_own_time"):
            for item in r.get(key, [])[:18]:
                print(f"   {key[:6]} {item['us']:9.1f} us  x{item['ncalls']:<5} {item['fn']}", flush=True)
        res["rows"].append(r)
        write_json(path, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
