"""The GPU correctness gate of linattn's default paths (H200, sm_90a).

    python benchmarks/gpu/gate.py --out DIR [--only SECTION,SECTION] [--dry-run] [--list]

Sections (each in its own child process under a timeout, so a hang or a crash costs that section only):
  fwd_triton     chunk_gated_delta_rule(backend="triton") at real sizes: T = 1 / 63 / 64 / 65, T = 8192, B8 T4096,
                 T = 65536 with GVA (H16/HV32), fp16 without initial state, varlen at T = 65536 with 1-token
                 sequences, odd head sizes, mixed input dtypes, l2norm in the kernel; then the sync-free checks
                 (torch.cuda sync debug mode "error", CUDA-graph capture of a varlen call replayed on new data).
  fwd_gluon      the same for backend="gluon": its own cases first (T = 1 / 63 / 65 / 1000, 1-token varlen, H2/HV8
                 where V is split finer, B4 T8192 H2/HV8 where the gate-free kernel runs segments), then the
                 K = V = 128 16-bit cases of fwd_triton, then the sync-free checks.
  bwd            forward + backward against autograd through chunk_reference in fp64 on the GPU, full problem:
                 T = 65536, varlen of mixed lengths with 1-token sequences (l2norm), odd head sizes in fp16 with mixed
                 gate dtypes; every gradient, o and the final state; both backends where the gluon backend runs
                 (K = V = 128, bf16). Then torch.compile(fullgraph=True) of a small model against the fp64 reference
                 and a CUDA-graph capture of forward + backward (varlen, cu_seqlens on the device) against eager.
  decode         fused_recurrent_gated_delta_rule against a fp64 reference: state pools (fp32 and bf16) at batch
                 1 / 32 / 256, H = HV = 32 and GVA H16/HV32, padded rows (their outputs 0, unused slots
                 bit-identical), speculative T = 4, varlen, fused gate + beta_sigmoid, out-of-range indices, CUDA
                 graph replay = eager, torch.compile(fullgraph=True) = eager (fp32 pool B8, bf16 pool B32).
  matmul_triton  linattn matmul's Triton path against an fp32 product on ragged shapes, four operand layouts,
  matmul_gluon   the Gluon path on every config of its table and its heuristic (split-K on two shapes).
  kda            chunk_kda forward + backward (B2 T1000 H4/HV8 K = V = 128, T = 1, varlen with 1-token sequences and
                 l2norm, the KDA gate in the kernel with beta sigmoid: every gradient (A_log / dt_bias through the chain of dg),
                 state_v_first) against autograd through naive_recurrent_kda in fp64; fused_recurrent_kda serving
                 calls (pools fp32 / bf16 at batch 1 / 32 / 256, padded rows, speculative T = 4, the gate forms,
                 state_v_first) against the fp64 reference; sync-free calls; a CUDA graph of forward + backward
                 (both per backend); the gluon backend's forward alone and with Triton's backward (its cases).
  layer_ops      causal_conv1d forward + backward (fixed length, varlen with 0- and 1-token sequences, states, bias,
                 residual; every gradient), causal_conv1d_update on a pool with padded rows, rms_norm_gated forward +
                 backward (per-head groups, both gate orders) against fp64 references; repeat calls of one signature
                 on fresh inputs (the last on a side stream); a sync-free step; a CUDA graph of the step = eager.
  fla_options    chunk_gated_delta_rule with use_gate_in_kernel (A_log, dt_bias), the beta sigmoid (allow_neg_eigval)
                 and state_v_first, alone and combined, forward + backward against fp64, backends auto and triton;
                 fused_recurrent_gated_delta_rule with state_v_first pools and vLLM's speculative decoding.
  eager          speed as users get it (eager_probe.py): forward B1 T8192 / T32768 and decode B1 / B256 eagerly in
                 three fresh processes each (cold caches, warm, after 4 GiB); a shape fails when its slowest process
                 takes more than 5% longer than its fastest.
Every output is NaN-poisoned first (poisoned_allocations or a NaN-filled out=), every error a relative RMS against
linattn.testing.TOL of the dtype.

Budget: on an H200 the correctness sections take about 5.5 minutes (fwd_triton 76 s, fwd_gluon 81 s, bwd 71 s, decode
33 s, matmul_triton 17 s, matmul_gluon 36 s, compiles included) and eager about 2.5 more (12 fresh processes, by the
probe's 16 in 208 s), so one device call (10 minutes) held the gate before kda and fla_options (not yet timed on a
GPU): run kda alone in a call (its first case took 167 s on the H200 before the section was cut at 280 s) and
fla_options in another. A hang costs its section's timeout (TIMEOUT_S),
so after one, run the rest with --only. Writes DIR/gate.json (the environment line
first, then each section's cases) and exits 1 when any case failed, errored or timed out.
`--dry-run` runs fwd_triton, bwd, decode, kda, layer_ops and fla_options at tiny sizes on the CPU under TRITON_INTERPRET=1, without the cases
that need a GPU (sync-free, CUDA graphs, torch.compile, out-of-range indices; fla_options' auto backend): it checks the script itself.
`--list` prints every section's case names.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))          # linattn from this checkout (children too)
from common import env_line, write_json  # noqa: E402
from gate_sections import base  # noqa: E402

SECTIONS = ("fwd_triton", "fwd_gluon", "bwd", "decode", "matmul_triton", "matmul_gluon", "kda", "layer_ops",
            "fla_options", "eager")
DRY_SECTIONS = ("fwd_triton", "bwd", "decode", "kda", "layer_ops", "fla_options")
TIMEOUT_S = {"fwd_triton": 240, "fwd_gluon": 240, "bwd": 300, "decode": 180, "matmul_triton": 90, "eager": 300,
             "matmul_gluon": 180, "kda": 540, "layer_ops": 180, "fla_options": 240}


def _sections():
    """section -> (run(save) -> its result dict, () -> its case names), eager (eager_probe.py) aside. The modules are
    imported on first use, after main has set the run mode (base.configure)."""
    from gate_sections import bwd, decode, fla_options, fwd, kda, layer_ops, matmul
    return {"fwd_triton": (lambda save: fwd.section("triton", save), lambda: fwd.case_names("triton")),
            "fwd_gluon": (lambda save: fwd.section("gluon", save), lambda: fwd.case_names("gluon")),
            "bwd": (bwd.section, bwd.case_names),
            "decode": (decode.section, decode.case_names),
            "matmul_triton": (lambda save: matmul.section("triton", save), lambda: matmul.case_names("triton")),
            "matmul_gluon": (lambda save: matmul.section("gluon", save), lambda: matmul.case_names("gluon")),
            "kda": (kda.section, kda.case_names),
            "layer_ops": (layer_ops.section, layer_ops.case_names),
            "fla_options": (fla_options.section, fla_options.case_names)}


def child(section, out_dir):
    path = os.path.join(out_dir, f"part_{section}.json")

    def save(res):
        write_json(path + ".tmp", res)
        os.replace(path + ".tmp", path)

    import linattn  # noqa: F401  (installs the interpreter fixes before any kernel runs)
    save(_sections()[section][0](save))


def run_section(section, out_dir, dry):
    """The section in a child process under its timeout; what it saved survives a timeout or a crash."""
    path = os.path.join(out_dir, f"part_{section}.json")
    if os.path.exists(path):
        os.remove(path)
    timeout = TIMEOUT_S[section] * (4 if dry else 1)
    cmd = [sys.executable, os.path.abspath(__file__), "--section", section, "--out", out_dir]
    cmd += ["--dry-run"] if dry else []
    if section == "eager":
        cmd = [sys.executable, os.path.join(HERE, "eager_probe.py"), "--out", out_dir, "--procs", "3",
               "--json", f"part_{section}.json", "--gate"]
    t0 = time.time()
    extra = {}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            extra["error"] = f"child exited with {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        extra["error"] = f"timed out after {timeout:.0f} s (partial results kept; a hang: check mbarrier phases)"
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = dict(cases=[])
    res.update(extra)
    if res.pop("incomplete", False) and "error" not in res:
        res["error"] = "the section did not finish"
    res["passed"] = bool(res.get("cases")) and "error" not in res and all(c.get("passed") for c in res["cases"])
    res["section_s"] = round(time.time() - t0, 1)
    return res


def case_names(section):
    if section == "eager":
        from eager_probe import SHAPES
        return [f"{shape} process spread <= 5%" for shape in SHAPES]
    return _sections()[section][1]()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for gate.json (default $OUT)")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all; " + ", ".join(SECTIONS) + ")")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1 "
                                                           "(sections " + ", ".join(DRY_SECTIONS) + ")")
    ap.add_argument("--list", action="store_true", help="print every section's case names and exit")
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    allowed = DRY_SECTIONS if args.dry_run else SECTIONS
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or list(allowed)
    bad = [s for s in sections if s not in allowed]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {list(allowed)}")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        base.configure(dry=True)
    if args.list:
        for s in sections:
            print(s + ": " + "; ".join(case_names(s)))
        return 0
    out = args.out or os.environ.get("OUT")
    if not out:
        ap.error("--out DIR (or $OUT) is required")
    os.makedirs(out, exist_ok=True)
    if args.section:
        child(args.section, out)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("the gate needs a GPU (or --dry-run)")
    env = env_line()
    env["dry_run"] = args.dry_run
    result = dict(environment=env, sections={})
    path = os.path.join(out, "gate.json")
    print(env["line"], flush=True)
    for s in sections:
        res = result["sections"][s] = run_section(s, out, args.dry_run)
        write_json(path, result)
        print(f"{s}: {'PASS' if res['passed'] else 'FAIL'} ({len(res.get('cases', []))} cases, "
              f"{res['section_s']} s){'  ' + res['error'][-300:] if 'error' in res else ''}", flush=True)
        for c in res.get("cases", []):
            if not c.get("passed"):
                print(f"   FAIL {c['case']}: " + json.dumps({k: v for k, v in c.items() if k != "trace"},
                                                          default=str)[:600], flush=True)
    result["passed"] = all(r["passed"] for r in result["sections"].values())
    write_json(path, result)
    print(("ALL PASSED" if result["passed"] else "GATE RED") + f"; wrote {path}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
