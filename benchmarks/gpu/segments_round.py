"""The segment-parallel fused forward (opt-in LINATTN_GDN_GLUON_SEGMENTS=1; with SEG_KIND=gf the gate-free kernel's
segment launch, LINATTN_GDN_GLUON_GF_SEGMENTS=1, its rows and H2/HV8 rows) against the same forward without segments,
in one process on the H200: per row (B, T, decay) the forward with and without segments on the same inputs (CUDA-graph
replay of one api call, backend="gluon"), their o and final-state distance, and how many
(sequence, head) pairs the window kernel sent unsegmented (flagged: slow decay). Decays: "fast" (make_gdn_inputs'
gates), "slow" (g x 0.01 on every head: every head unsegmented), "mixed" (g x 0.01 on the odd value heads).
Correctness against fp64 is the Gluon gate's (gdn_gluon_round.py with the switch on); this round also checks each
row's segmented o and final state against the fp64 chunk reference (slow and mixed decay are not in the gate).

Usage: python3 benchmarks/gpu/segments_round.py --out DIR [--dry | --timeline]  (--dry: CPU, tiny shapes, the fused
kernel's schedule model in place of the Gluon launch, to exercise this script's logic; --timeline: the kernels of one
forward with and without segments, start offsets and durations from the torch profiler, TIMELINE_ROWS)."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_profile, graph_ms, median_ms, round_result, write_json  # noqa: E402

KIND = os.environ.get("SEG_KIND", "wu")       # "wu": the W/U kernel's segments; "gf": the gate-free kernel's
SWITCH = {"wu": "LINATTN_GDN_GLUON_SEGMENTS", "gf": "LINATTN_GDN_GLUON_GF_SEGMENTS"}[KIND]
ROWS = [(1, 8192, "fast"), (1, 16384, "fast"), (1, 32768, "fast"), (1, 65536, "fast"), (2, 32768, "fast"),
        (1, 65536, "slow"), (1, 65536, "mixed"), (1, 16384, "slow")]
if KIND == "gf":   # H2/HV8 B1 (the W/U kernel at BV=16 by default): 16 segments of 64 chunks at T65536
    ROWS += [(1, 8192, "fast", 2, 8), (1, 65536, "fast", 2, 8), (1, 65536, "mixed", 2, 8)]
DRY_ROWS = [(1, 64 * 12, "fast"), (1, 64 * 12, "slow"), (1, 64 * 12, "mixed")]


def inputs(B, T, decay, device, H=16, HV=32):
    import torch

    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, initial_state=True, device=device,
                        generator=torch.Generator().manual_seed(T + B))
    if decay == "slow":
        x["g"] = x["g"] * 0.01
    elif decay == "mixed":
        x["g"][..., 1::2] = x["g"][..., 1::2] * 0.01
    return x


def unsegmented_pairs(x, S, L):
    """(pairs run unsegmented, all pairs): the window kernel's slow[n, hv] (any segment of the pair flagged)."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_windows
    B, T = x["q"].shape[:2]
    HV = x["v"].shape[2]
    plan = make_chunk_plan(B, T, None, 64, x["q"].device)
    slow, _, _ = segment_windows(x["k"], x["beta"], x["g"], plan, S, L)
    return int(slow.sum()), B * HV


def seg_plan(B, T, HV, device, dry):
    """(S, L) with the switch of SEG_KIND on."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    os.environ[SWITCH] = "1"
    if dry:
        return 4, 3
    if KIND == "gf":
        return chunk_fused_gf.gf_segments_wanted(B, T, HV, None, device)
    return fw.segments_wanted(B, T, HV, 128, None, device)


def launches_apart(x, S, L):
    """The segment-parallel forward's two fused launches on prepared inputs (kkt_solve and the window kernel done
    once): the unsegmented heads' launch alone, the segment launch alone, both as the forward runs them (side stream
    at the highest priority, joined) and both one after the other on one stream, each a CUDA-graph median. Answers
    whether the two launches get in each other's way (both > max of the two alone) at mixed decay."""
    import torch

    from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan, segment_windows
    seg_pass = chunk_fused_gf.chunk_fused_gf_gluon if KIND == "gf" else fw.chunk_fused_wu_ws_gluon
    q, k, v, beta, h0 = x["q"], x["k"], x["v"], x["beta"], x["initial_state"]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    plan = make_chunk_plan(B, T, None, 64, q.device)
    gcum, tinv = fw.kkt_solve(k, x["g"], beta, plan, HV)
    splan = segment_plan(B, T, S, L, q.device)
    o = torch.empty_like(v)
    scale = K ** -0.5
    slow, _, segw = segment_windows(k, beta, x["g"], plan, S, L)
    final = torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)

    def slow_run():
        fw.chunk_fused_wu_ws_gluon(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, select=slow)

    def seg_run():
        seg_pass(q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), v.reshape(1, B * T, HV, V),
                 beta.reshape(1, B * T, HV), gcum, tinv, o.view(1, B * T, HV, V), h0, final, splan, scale,
                 select=slow, seg=segw)

    def both():
        # as the forward issues them: the unsegmented launch on the high-priority side stream, the segment launch
        # on this one
        side = fw._side_stream(q.device)
        cur = torch.cuda.current_stream(q.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            slow_run()
        seg_run()
        cur.wait_stream(side)

    def serial():
        slow_run()
        seg_run()
    return {name + "_ms": graph_ms(fn) for name, fn in (("slow_alone", slow_run), ("segments_alone", seg_run),
                                                          ("both", both), ("serial", serial))}


def row(B, T, decay, device, dry, H=16, HV=32):
    import torch

    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    from linattn.testing import TOL, rel_rms
    x = inputs(B, T, decay, device, *((1, 2) if dry else (H, HV)))
    HV = x["v"].shape[2]
    out = dict(B=B, T=T, H=x["q"].shape[2], HV=HV, decay=decay, kind=KIND)
    S, L = seg_plan(B, T, HV, device, dry)
    out.update(S=S, L=L)
    if S <= 1:
        out["note"] = "no segments at this shape (plan_segments)"
    else:
        out["unsegmented_pairs"], out["pairs"] = unsegmented_pairs(x, S, L)

    def fwd(segments):
        if dry:
            def fused(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, select=None, seg=None):
                fw.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=64, stages=2,
                                       areg=True, select=select, seg=seg)

            def gf_seg(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, select=None, seg=None):
                fw.emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, h0, final, plan, scale, BV=128, stages=2,
                                       npub=1, out_pipe=True, gate_free=True, select=select, seg=seg)
            r = fw.chunk_gated_delta_rule_fwd_fused_wu(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5,
                                                       x["initial_state"], True, None, fused_pass=fused,
                                                       segments=(S, L) if segments else (1, 0),
                                                       segment_pass=gf_seg if KIND == "gf" else None)
            return r.o, r.final_state
        from linattn import chunk_gated_delta_rule
        os.environ[SWITCH] = "1" if segments else "0"
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                      output_final_state=True, backend="gluon")

    o_b, f_b = fwd(False)
    o_s, f_s = fwd(True)
    out.update(o_vs_unsegmented=rel_rms(o_s, o_b), final_vs_unsegmented=rel_rms(f_s, f_b),
               finite=bool(torch.isfinite(o_s).all() and torch.isfinite(f_s).all()))
    if os.environ.get("SEG_FP64", "1") == "1":
        from linattn.ops.gated_delta_rule.reference import chunk_reference
        x64 = {k: (t.double() if t is not None else None) for k, t in x.items()}
        with torch.no_grad():
            ro, rh = chunk_reference(**x64, output_final_state=True)
        del x64
        tol = TOL[x["q"].dtype]
        out.update(err_o_vs_fp64=rel_rms(o_s, ro), err_state_vs_fp64=rel_rms(f_s, rh),
                   err_o_unsegmented_vs_fp64=rel_rms(o_b, ro), err_state_unsegmented_vs_fp64=rel_rms(f_b, rh), tol=tol)
        out["passed"] = bool(out["finite"] and out["err_o_vs_fp64"] <= tol and out["err_state_vs_fp64"] <= tol)
        del ro, rh
    if not dry:
        out["unsegmented_ms"] = graph_ms(lambda: fwd(False))
        out["segments_ms"] = graph_ms(lambda: fwd(True))
        out["speedup"] = out["unsegmented_ms"] / out["segments_ms"]
        # eager (host path included; stream priorities apply, which a graph replay may not keep)
        out["unsegmented_eager_ms"] = median_ms(lambda: fwd(False))
        out["segments_eager_ms"] = median_ms(lambda: fwd(True))
        if S > 1 and decay in ("mixed", "fast") and T == 65536:
            try:
                out["launches_apart"] = launches_apart(x, S, L)
            except Exception as e:  # noqa: BLE001
                out["launches_apart"] = dict(error=repr(e)[:400])
    return out


TIMELINE_ROWS = [(1, 65536, "fast"), (1, 65536, "mixed"), (1, 65536, "slow"), (1, 16384, "slow")]


def kernel_timeline(fn, iters: int = 8, first: str = "kkt") -> dict:
    """GPU kernels of `fn` (one forward) on the torch profiler's CUDA trace, `iters` calls queued back to back (the
    host runs ahead of the GPU after the first, so the gaps are the GPU's own): per kernel of one call (in start
    order; iterations split at each kernel whose name contains `first`), its stream, median start offset from the
    call's first kernel and median duration in us, and the median span of a call (first start to last end)."""
    import json
    import tempfile
    prof = cuda_profile(fn, iters)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return calls_timeline(events, first)


def calls_timeline(events, first: str = "kkt") -> dict:
    """kernel_timeline's summary of chrome-trace events (kernels and memsets; dicts with name, ts, dur, tid)."""
    import statistics
    ks = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset")), key=lambda e: e["ts"])
    calls, cur = [], []
    for e in ks:
        if first in e["name"] and cur:
            calls.append(cur)
            cur = []
        cur.append(e)
    if cur:
        calls.append(cur)
    calls = [c for c in calls if first in c[0]["name"]]
    n = statistics.mode(len(c) for c in calls) if calls else 0
    calls = [c for c in calls if len(c) == n]
    if not calls:
        return dict(error="no complete call found", kernels_seen=len(ks))
    kernels = [dict(name=calls[0][i]["name"][:90], stream=calls[0][i].get("tid"),
                    start_us=statistics.median(c[i]["ts"] - c[0]["ts"] for c in calls),
                    dur_us=statistics.median(c[i]["dur"] for c in calls)) for i in range(n)]
    span = statistics.median(max(e["ts"] + e["dur"] for e in c) - c[0]["ts"] for c in calls)
    return dict(calls=len(calls), span_us=span, kernels=kernels)


def timeline_row(B, T, decay, device) -> dict:
    """The forward with and without segments (api, backend="gluon") as kernel timelines (kernel_timeline)."""
    from linattn import chunk_gated_delta_rule
    x = inputs(B, T, decay, device)
    out = dict(B=B, T=T, decay=decay)
    for name, seg in (("unsegmented", "0"), ("segments", "1")):
        os.environ[SWITCH] = seg
        out[name] = kernel_timeline(lambda: chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
            backend="gluon"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="kernel timelines of TIMELINE_ROWS instead (GPU only)")
    a = ap.parse_args()
    import torch
    dry = a.dry or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    timeline = a.timeline and not dry
    res = round_result("segments_round.py", device, dry_run=dry, timeline=timeline, rows=[])
    tag = "_gf" if KIND == "gf" else ""
    path = os.path.join(a.out, f"segments{tag}_timeline.json" if timeline else f"segments{tag}_round.json")
    t0 = time.time()
    for B, T, decay, *heads in (DRY_ROWS if dry else TIMELINE_ROWS if timeline else ROWS):
        try:
            r = timeline_row(B, T, decay, device) if timeline else row(B, T, decay, device, dry, *heads)
        except Exception as e:  # noqa: BLE001
            r = dict(B=B, T=T, decay=decay, error=repr(e)[:600])
        print(r, flush=True)
        res["rows"].append(r)
        write_json(path, res)
    res["seconds"] = time.time() - t0
    write_json(path, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
