"""Per-kernel time of the GDN forward (torch profiler), for OPT_LOG.md.

    python benchmarks/gpu/profile_fwd.py --out DIR [--backend triton] [--fla]

PROFILE_SHAPES: space-separated "B:T:H:HV" (K = V = 128; default "1:65536:16:32 8:4096:16:32").
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

import linattn  # noqa: E402
from common import cuda_profile, env_line, write_json  # noqa: E402
from linattn.testing import make_gdn_inputs  # noqa: E402


def profile(fn, iters=10):
    prof = cuda_profile(fn, iters)
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows[e.key[:80]] = t / iters / 1e3   # ms per call
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--fla", action="store_true")
    a = ap.parse_args()
    res = dict(env=env_line(), shapes={})
    shapes = [tuple(int(v) for v in spec.split(":")) for spec in
              os.environ.get("PROFILE_SHAPES", "1:65536:16:32 8:4096:16:32").split()]
    for B, T, H, HV in shapes:
        x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, device="cuda")
        entry = {}
        with torch.no_grad():
            entry["linattn"] = profile(lambda: linattn.chunk_gated_delta_rule(**x, output_final_state=True,
                                                                              backend=a.backend))
            if a.fla:
                try:
                    os.environ["FLA_FLASH_QLA"] = "0"
                    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
                    entry["fla"] = profile(lambda: fla_fn(**x, output_final_state=True))
                except Exception as e:
                    entry["fla_error"] = repr(e)
        res["shapes"][f"B{B}_T{T}" + (f"_H{H}_HV{HV}" if (H, HV) != (16, 32) else "")] = entry
        for who, rows in entry.items():
            if isinstance(rows, dict):
                print(f"B={B} T={T} {who}: total {sum(rows.values()):.3f} ms")
                for kname, ms in list(rows.items())[:8]:
                    print(f"    {ms:8.3f} ms  {kname}")
    write_json(os.path.join(a.out, "gdn_fwd_profile.json"), res)


if __name__ == "__main__":
    main()
