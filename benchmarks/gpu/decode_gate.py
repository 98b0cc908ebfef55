"""GPU gate and benchmark for GDN decode (`fused_recurrent_gated_delta_rule`) on an H200:
`python benchmarks/gpu/decode_gate.py --out DIR [--fla]`.

1. gate: the Triton decode against a fp64 torch reference (`fused_recurrent_reference` on fp64 copies) at real
   sizes: K = V = 128, H = HV = 32 and GVA H = 16, HV = 32, batch 1 / 32 / 256, a state pool with padded rows
   (unused slots must stay bit-identical), fp32 and bf16 pools, speculative T = 4, varlen, fused gate +
   beta_sigmoid, out-of-range indices (no write outside the pool), CUDA-graph replay = eager, and
   torch.compile(fullgraph=True). Relative RMS errors recorded; outputs NaN-poisoned (poisoned_allocations).
2. bench: H = HV = 32, K = V = 128, T = 1, bf16 q/k/v, pool inplace, batch 1 / 32 / 256: median time per call
   inside a CUDA graph (each replay runs several calls on disjoint pool slots spanning >= 3x the L2, so the
   state comes from HBM as in serving), FLA 0.6.0's fused_recurrent_gated_delta_rule on the same inputs
   (initial_state -> new final state) with --fla, state bandwidth against a device-to-device copy measured in
   the same run, bf16-state speedup at batch 256. Targets are checked and recorded.
3. drift: 1,000 decode steps, one call per token, fp32 and bf16 pools against a fp64 recurrence.
4. sweep: launch configs around the heuristic (data for decode_launch_config). 3 and 4 give way to the budget.
5. modes (only with DECODE_SECTIONS=modes): batch 256 fp32 in four state modes (pool in place / out of place /
   sorted slots, no pool), alternated: where the pool mode's time goes.

`--drift-cpu` runs only the drift section on the CPU (under TRITON_INTERPRET=1) at a small size: the numbers
in benchmarks/DECODE.md. Writes DIR/decode.json (environment line first) and prints a short table.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from linattn.ops.gated_delta_rule.fused_recurrent import (  # noqa: E402
    fused_recurrent_gated_delta_rule as decode, fused_recurrent_reference)
from linattn.ops.gated_delta_rule.reference import naive_recurrent  # noqa: E402
from linattn.runtime.alloc import poisoned_allocations  # noqa: E402
from linattn.testing import TOL, make_gdn_inputs, rel_rms, random_cu_seqlens  # noqa: E402

K = V = 128
F32_TOL = TOL[torch.float32]
BF16_STATE_TOL = 4e-3        # one bf16 rounding of the state: < 2^-9 relative (tests/test_fused_recurrent.py)
START = time.time()
SWEEP_B = 256                # the sweep's large batch (a CPU dry run of the logic lowers it)
DEV = "cuda"                 # a CPU dry run of the gate's logic sets "cpu" (and small K, V) from outside


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def environment(fla: bool) -> dict:
    """linattn.bench.env's record, the one implementation every script shares."""
    from linattn.bench.env import collect_env, env_line
    env = collect_env(DEV if torch.cuda.is_available() else "cpu")
    env.update(fla_requested=fla, line=env_line(env))
    return env


def _f64(x: dict) -> dict:
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}


def _inputs(B, T, H, HV, device=None):
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=device or DEV, initial_state=False)
    del x["initial_state"]
    return x


def _pool_case(B, H, HV, state_dtype, T=1, extra=None, varlen=None):
    """Pool of 2B + 3 slots, every 4th sequence padded (-1), live slots a random permutation. Checks o, the
    updated slots, and that padded outputs are 0 and unused slots bit-identical."""
    if varlen is not None:
        x = _inputs(1, sum(varlen), H, HV)
        x["cu_seqlens"] = random_cu_seqlens(varlen, device=DEV)
        N = len(varlen)
    else:
        x = _inputs(B, T, H, HV)
        N = B
    x.update(extra or {})
    slots = 2 * N + 3
    pool = (torch.randn(slots, HV, K, V, device=DEV) * 0.5).to(state_dtype)
    idx = torch.randperm(slots, device=DEV)[:N]
    idx[3::4] = -1
    before = pool.clone()
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True)
    with poisoned_allocations():
        o, ret = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    _sync()
    live = idx[idx >= 0]
    unused = torch.ones(slots, dtype=torch.bool, device=DEV)
    unused[live] = False
    pad = (idx < 0).nonzero().flatten()
    if varlen is None:
        pad_rows_zero = bool((o[pad] == 0).all())
    else:
        cu = x["cu_seqlens"].tolist()
        pad_rows_zero = all(bool((o[0, cu[n]:cu[n + 1]] == 0).all()) for n in pad.tolist())
    err_o = rel_rms(o, ro)
    err_s = rel_rms(pool[live], ref_pool[live])
    tol_o = TOL[torch.bfloat16]                    # o is written in v's dtype (bf16)
    tol_s = F32_TOL if state_dtype == torch.float32 else BF16_STATE_TOL
    ok = (err_o <= tol_o and err_s <= tol_s and ret is pool and pad_rows_zero
          and torch.equal(pool[unused], before[unused]))
    return dict(rel_rms_o=err_o, rel_rms_state=err_s, tol_o=tol_o, tol_state=tol_s, pad_rows_zero=pad_rows_zero,
                unused_slots_untouched=bool(torch.equal(pool[unused], before[unused])),
                status="pass" if ok else "FAIL")


def _out_of_range_case():
    """Indices >= num_slots on the GPU (not checked on the host): treated as padded; guard rows untouched."""
    H = HV = 32
    x = _inputs(8, 1, H, HV)
    buf = torch.randn(12, HV, K, V, device=DEV)
    pool = buf[:8]
    before = buf.clone()
    idx = torch.tensor([8, 1, 11, 2, 1000, -1, 3, 9], device=DEV)
    with poisoned_allocations():
        o, _ = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    _sync()
    keep = [0, 4, 5, 6, 7, 8, 9, 10, 11]
    ok_guard = bool(torch.equal(buf[keep], before[keep]))
    bad = torch.tensor([0, 2, 4, 5, 7], device=DEV)
    ok_zero = bool((o[bad] == 0).all())
    return dict(guard_rows_untouched=ok_guard, padded_outputs_zero=ok_zero,
                status="pass" if ok_guard and ok_zero else "FAIL")


def _graph_case():
    """One CUDA-graph replay gives the eager result (pool state and outputs), with new inputs copied in."""
    B, H, HV = 32, 16, 32
    x = _inputs(B, 1, H, HV)
    pool = torch.randn(2 * B, HV, K, V, device=DEV)
    idx = torch.randperm(2 * B, device=DEV)[:B].to(torch.int32)
    p_eager, p_graph = pool.clone(), pool.clone()
    decode(**x, initial_state=p_graph, state_indices=idx, inplace=True)      # compile outside the capture
    p_graph.copy_(pool)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        o_graph, _ = decode(**x, initial_state=p_graph, state_indices=idx, inplace=True)
    torch.cuda.current_stream().wait_stream(s)
    p_graph.copy_(pool)
    fresh = _inputs(B, 1, H, HV)
    for n in x:
        x[n].copy_(fresh[n])
    graph.replay()
    o_eager, _ = decode(**x, initial_state=p_eager, state_indices=idx, inplace=True)
    _sync()
    ok = torch.equal(o_graph, o_eager) and torch.equal(p_graph, p_eager)
    return dict(graph_equals_eager=bool(ok), status="pass" if ok else "FAIL")


def _compile_case(B=8, state_dtype=torch.float32):
    """torch.compile(fullgraph=True) of one in-place step equals eager, bit for bit. B=8 fp32 pool: the Triton
    kernel; B=32 bf16 pool: what `auto` gives the Gluon decode on sm_90 (fused_recurrent._gluon_auto_filter)."""
    H, HV = 16, 32
    x = _inputs(B, 1, H, HV)
    pool = torch.randn(2 * B, HV, K, V, device=DEV).to(state_dtype)
    idx = torch.randperm(2 * B, device=DEV)[:B]
    idx[1::6] = -1
    want = pool.clone()
    wo, _ = decode(**x, initial_state=want, state_indices=idx, inplace=True)

    def step(q, k, v, g, beta, pool, idx):
        return decode(q, k, v, g, beta, initial_state=pool, state_indices=idx, inplace=True)[0]

    t0 = time.time()
    o = torch.compile(step, fullgraph=True)(**x, pool=pool, idx=idx)
    _sync()
    ok = torch.equal(o, wo) and torch.equal(pool, want)
    return dict(compile_s=round(time.time() - t0, 1), matches_eager=bool(ok), status="pass" if ok else "FAIL")


def gate() -> dict:
    from common import case_runner
    cases = []
    run = case_runner(cases)

    for H, HV in ((32, 32), (16, 32)):
        for B in (1, 32, 256):
            for sd in (torch.float32, torch.bfloat16):
                run(f"pool H={H} HV={HV} B={B} state={str(sd)[6:]}", _pool_case, B=B, H=H, HV=HV, state_dtype=sd)
    run("spec decode T=4 H=16 HV=32 B=32", _pool_case, B=32, H=16, HV=32, state_dtype=torch.float32, T=4)
    run("varlen 1..4 tokens H=16 HV=32 N=24", _pool_case, B=None, H=16, HV=32, state_dtype=torch.float32,
        varlen=[1 + (n * 7) % 4 for n in range(24)])
    gen = torch.Generator(device=DEV)
    gen.manual_seed(1)
    fused = dict(g=torch.randn(32, 1, 32, device=DEV, generator=gen) * 3,
                 beta=torch.randn(32, 1, 32, device=DEV, generator=gen) * 2,
                 A_log=torch.rand(32, device=DEV, generator=gen) * 2 - 1,
                 dt_bias=torch.randn(32, device=DEV, generator=gen), beta_sigmoid=True)
    run("fused gate + beta_sigmoid H=16 HV=32 B=32", _pool_case, B=32, H=16, HV=32, state_dtype=torch.float32,
        extra=fused)
    run("out-of-range indices", _out_of_range_case)
    run("CUDA graph", _graph_case)
    for name, kw in (("torch.compile fullgraph", {}),
                     ("torch.compile fullgraph bf16 pool B=32", dict(B=32, state_dtype=torch.bfloat16))):
        if time.time() - START < 70:
            run(name, _compile_case, **kw)
        else:
            cases.append(dict(case=name, status="skipped", reason="time budget"))
    ran = [c for c in cases if c["status"] != "skipped"]
    return dict(passed=all(c["status"] == "pass" for c in ran), cases=cases)


# ------------------------------------------------------------------------------------------------- drift
def drift(device: str, B: int, H: int, HV: int, Kd: int, Vd: int, steps: int, g_scale: float = 1.0) -> dict:
    """`steps` decode calls of one token, fp32 and bf16 pools, against the fp64 recurrence (naive_recurrent)
    run token by token from the same start. g_scale scales the log decays (0.05: alpha ~ 0.99, long memory).
    q/k/v are fp32 so that only the state's precision differs between the two runs."""
    x = make_gdn_inputs(B, steps, H, HV, Kd, Vd, dtype=torch.float32, device=device)
    x["g"] = x["g"] * g_scale
    h0 = x.pop("initial_state")
    S64 = h0.double()
    pools = {"fp32": h0.clone(), "bf16": h0.to(torch.bfloat16)}
    S64_from_bf16 = pools["bf16"].double()     # the bf16 run starts from a rounded state: give the ref the same
    outs = {n: [] for n in pools}
    refs = {"fp32": [], "bf16": []}
    idx = torch.arange(B, device=device)
    for t in range(steps):
        step = {n: x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        for name, pool in pools.items():
            o, _ = decode(**step, initial_state=pool, state_indices=idx, inplace=True)
            outs[name].append(o)
        s64 = _f64(step)
        o64, S64 = naive_recurrent(**s64, initial_state=S64, output_final_state=True)
        ob, S64_from_bf16 = naive_recurrent(**s64, initial_state=S64_from_bf16, output_final_state=True)
        refs["fp32"].append(o64)
        refs["bf16"].append(ob)
    res = dict(B=B, H=H, HV=HV, K=Kd, V=Vd, steps=steps, g_scale=g_scale,
               mean_alpha=float(torch.exp(x["g"]).mean()))
    for name in pools:
        o = torch.cat(outs[name], 1)
        r = torch.cat(refs[name], 1)
        S_ref = S64 if name == "fp32" else S64_from_bf16
        res[name] = dict(rel_rms_o_all=rel_rms(o, r), rel_rms_o_first10=rel_rms(o[:, :10], r[:, :10]),
                         rel_rms_o_last100=rel_rms(o[:, -100:], r[:, -100:]),
                         rel_rms_state_final=rel_rms(pools[name], S_ref))
    return res


# ------------------------------------------------------------------------------------------------- bench
def _time_graph(fns, replays=20) -> float:
    """Capture all fns (one call each) in one CUDA graph; median ms per call over `replays` replays."""
    for fn in fns:                                     # warm up / compile outside the capture
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        graph.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in ev:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) / len(fns)


def _copy_bandwidth() -> dict:
    """The copy ceiling of `linattn bench` (linattn.bench.timing.measure_ceilings: a 1 GiB device-to-device copy
    timed with events, bytes read + written). This script's first probe timed the copy inside a CUDA graph and
    read 2.77 TB/s on the H200 where the eager copy reads 4.26 TB/s (anchors.md: 4.25), which made the "90% of
    copy bandwidth" target look met when it was not (round 3 and 7 JSON)."""
    from linattn.bench.timing import measure_ceilings
    c = measure_ceilings(DEV)
    return dict(ms=c["copy_ms"], tb_s=c["copy_gbps"] / 1e3, how=c["how"])


def _n_calls(state_bytes_per_call: int) -> int:
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20))
    return int(min(64, max(2, math.ceil(3 * l2 / state_bytes_per_call))))


def bench(fla: bool) -> dict:
    H = HV = 32
    out = dict(shape=dict(H=H, HV=HV, K=K, V=V, T=1, qkv="bf16", mode="pool, inplace"), rows=[])
    copy = _copy_bandwidth()
    out["copy"] = copy
    fla_fn = None
    if fla:
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn
        except Exception as e:  # noqa: BLE001
            out["fla_error"] = f"{e!r}"[:400]
    for B, sd in ((1, torch.float32), (32, torch.float32), (256, torch.float32), (256, torch.bfloat16)):
        row = dict(B=B, state=str(sd)[6:])
        try:
            x = _inputs(B, 1, H, HV)
            esize = torch.empty((), dtype=sd).element_size()
            state_bytes = 2 * B * HV * K * V * esize            # read + write
            n = _n_calls(state_bytes)
            pool = (torch.randn(n * B, HV, K, V, device=DEV) * 0.5).to(sd)
            perm = torch.randperm(n * B, device=DEV)
            idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(n)]
            ours = [lambda i=i: decode(**x, initial_state=pool, state_indices=idx[i], inplace=True) for i in range(n)]
            ms = _time_graph(ours)
            row.update(calls_per_replay=n, ours_us=ms * 1e3, state_tb_s=state_bytes / ms / 1e9,
                       of_copy_bw=state_bytes / ms / 1e9 / copy["tb_s"])
            if fla_fn is not None and sd == torch.float32:
                try:
                    h0 = [pool[i].contiguous() for i in idx]
                    f = [lambda i=i: fla_fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=h0[i],
                                            output_final_state=True) for i in range(n)]
                    fms = _time_graph(f)
                    # ours in FLA's mode too (no pool, no index load, new final state): the same work as FLA
                    mine = [lambda i=i: decode(**x, initial_state=h0[i], output_final_state=True) for i in range(n)]
                    row["ours_fla_mode_us"] = _time_graph(mine) * 1e3
                    row.update(fla_us=fms * 1e3, fla_of_copy_bw=state_bytes / fms / 1e9 / copy["tb_s"],
                               ours_speedup=fms / ms)
                    # same inputs, same answer (FLA reads h0 copies of our pool's slots at this point)
                    fo, fh = fla_fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=h0[0],
                                    output_final_state=True)
                    oo, oh = decode(**x, initial_state=h0[0], output_final_state=True)
                    row.update(vs_fla_rel_rms_o=rel_rms(oo, fo), vs_fla_rel_rms_state=rel_rms(oh, fh))
                except Exception as e:  # noqa: BLE001
                    row["fla_error"] = f"{e!r}"[:400]
            del pool
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{e!r}"[:600], trace=traceback.format_exc()[-1500:])
        out["rows"].append(row)
        torch.cuda.empty_cache()
    rows = {(r["B"], r["state"]): r for r in out["rows"]}
    t = {}
    r256, r256b = rows.get((256, "float32"), {}), rows.get((256, "bfloat16"), {})
    if "of_copy_bw" in r256:
        t["batch256_ge_90pct_copy_bw"] = r256["of_copy_bw"] >= 0.90
    if "ours_us" in r256 and "ours_us" in r256b:
        out["bf16_speedup_b256"] = r256["ours_us"] / r256b["ours_us"]
        t["bf16_ge_1.7x_fp32_b256"] = out["bf16_speedup_b256"] >= 1.7
    for B in (1, 32):
        r = rows.get((B, "float32"), {})
        if "fla_us" in r:
            t[f"batch{B}_not_slower_than_fla"] = r["ours_us"] <= r["fla_us"]
    if "ours_us" in rows.get((1, "float32"), {}):
        t["batch1_le_8us"] = rows[(1, "float32")]["ours_us"] <= 8.0
    out["targets"] = t
    return out


def sweep() -> dict:
    """Launch configs around the heuristic's choice, timed like the bench (fp32 and bf16 pools, inplace, T = 1,
    H = HV = 32): data for decode_launch_config / decode_persistent_config, not a gate. A config is
    (BV, num_warps, NUM_STAGES, programs per SM); NUM_STAGES = 0 is the one-tile kernel, >= 1 the persistent
    one; a 5th element sets the persistent program count, a 6th names opt-in kernel variants ("+"-joined keys of
    PERSISTENT_VARIANTS). Each config's result on one call is checked against the one-tile kernel's (same math,
    same inputs), so a fast but wrong variant shows as wrong."""
    from linattn.ops.gated_delta_rule.triton.fused_recurrent import (decode_launch_config, decode_persistent_config,
                                                                     fused_recurrent_gdn_fwd)
    H = HV = 32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    # round 9: fp32 best (64, 4, 2, 3) 289.6 us; the rest are next candidates (sm_90a AOT, no spills: fp32 BV=64
    # 8 warps 128 regs -> 2/SM; BV=128 8 warps 209 regs -> 1/SM; bf16 BV=64 8 warps 127 regs -> 2/SM)
    # round 11: tail experiment. At batch 256 (16384 tiles of BV=64) 3 programs per SM give 396 programs walking
    # 41 or 42 tiles each (the slowest 1.5% above the mean); a 5th element sets the program count exactly: 256 or
    # 512 programs walk 64 or 32 tiles each (4 SMs then hold one program fewer)
    # round 13 (round 12: 289.3 us = 87.7% of copy; 90% is <= 282 us): the persistent kernel's opt-in variants
    # (streaming state stores; next tile's q, k prefetched; contiguous tile runs per program), BV = 128 at 4
    # warps (255 registers, no spills: 2 programs per SM, 64 KiB contiguous tiles; 256 programs = 32 tiles each),
    # and the heuristic's config again last, to read the run-to-run noise against
    # round 12 result: prefetch_qk 284.1 / 282.7 us (now the default); next: prefetch_qk with 3 stages at 2
    # programs per SM (two tiles in flight per program instead of two programs), and with 384 programs
    # round 13 result: 3 stages at 2/SM 281.3 us, default 283.1: launch parameters exhausted. Round 14: the kwarp
    # variant (K rows inside one warp, warps along V: 3 CTA barriers per tile instead of 16; benchmarks/
    # DECODE_KWARP.md) at the default's config, at 3 stages / 2 per SM, with streaming stores, and on a bf16 pool
    # round 14 result: kwarp 310 us, default 283.2-284.6 (89%). Round 15: split_tail (benchmarks/DECODE_TAIL.md):
    # 16384 tiles over 396 programs leave R = 148 for a 42nd round; split_tail walks the 41 even rounds as now and
    # gives the 148 tiles as 296 half tiles (BV/2 columns) to programs 0-295, prefetched like any other tile.
    # First in the list, each next to its own launch config's default (2 stages 3/SM, 3 stages 2/SM: R = 148
    # over 396, R = 16 over 264 programs), and again last to read the noise against
    # round 15 result: split_tail no gain (285.0 / 284.8 us; benchmarks/DECODE_TAIL.md). Round 21: 4 stages at 2 per
    # SM (sm_90a: 252 registers, 0 spill, 99,756 B shared = three 32 KB state buffers, so while a program computes
    # tile i the copies of tiles i+1 and i+2 are in flight, 128 KB per SM against 64 KB at 3 stages), alternated
    # with the default (3 stages) three times on the same inputs; the rows of rounds 9-15 are in their JSONs
    # round 21 result: 4 stages flat (280.4-282.6 us against 281.4-282.5). Round 22 (the modes section: in place
    # 281.6 / 282.0 us, the same kernel writing a new final state instead 275.7 / 276.4, in place on the same slots
    # sorted 279.5 / 279.8: the in-place write's addresses cost ~2%): whole-head tiles, BV = 128, so that every tile
    # reads and writes one contiguous 64 KB state (sm_90a: 8 warps 211 registers at 2 stages, 254 at 3; 16 warps 128
    # at 3 stages; one program per SM), and the streaming store on the default, each next to the default
    for B, sd, configs in ((SWEEP_B, torch.float32, [(64, 4, 3, 2, None, "prefetch_qk"),
                                                     (128, 8, 2, 1, None, "prefetch_qk"),
                                                     (128, 8, 3, 1, None, "prefetch_qk"),
                                                     (128, 16, 3, 1, None, "prefetch_qk"),
                                                     (64, 4, 3, 2, None, "prefetch_qk+store_cs"),
                                                     (64, 4, 3, 2, None, "prefetch_qk"),
                                                     (128, 8, 2, 1, None, "prefetch_qk"),
                                                     (128, 16, 3, 1, None, "prefetch_qk")]),
                           (SWEEP_B, torch.bfloat16, [(64, 4, 0, 0), (64, 8, 0, 0), (64, 8, 2, 2), (128, 8, 2, 1),
                                                      (64, 4, 2, 3), (128, 8, 0, 0), (64, 4, 2, 3, None, "kwarp")]),
                           (SWEEP_B // 8, torch.float32, [(32, 4, 0, 0), (64, 4, 2, 3), (32, 4, 2, 4)]),
                           # batch 1 (issue 6: no slower than FLA; round 9 3.50 vs 3.45 us): around the heuristic's
                           # 16 fp32 columns, 2 warps (256 programs)
                           (1, torch.float32, [(16, 2, 0, 0), (16, 1, 0, 0), (8, 1, 0, 0), (32, 2, 0, 0),
                                               (32, 4, 0, 0)])):
        if time.time() - START > 170:
            rows.append(dict(B=B, state=str(sd)[6:], skipped="time budget"))
            continue
        x = _inputs(B, 1, H, HV)
        esize = torch.empty((), dtype=sd).element_size()
        state_bytes = 2 * B * HV * K * V * esize
        n = _n_calls(state_bytes)
        pool = (torch.randn(n * B, HV, K, V, device=DEV) * 0.5).to(sd)
        perm = torch.randperm(n * B, device=DEV)
        idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(n)]
        _, bv, w = decode_launch_config(B, HV, K, V, sd, sms)
        pers = decode_persistent_config(B, HV, K, V, 1, False, sd, sms)
        chosen = tuple(pers) if pers else (bv, w, 0, 0)

        def one_call(cfg, p):
            return fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, p, None, idx[0],
                                           None, None, False, False, False, True, config=cfg)[0]
        pool0 = pool[idx[0]].clone()             # the timed calls below update the pool in place: keep the start
        want_pool = pool.clone()
        want_o = one_call((bv, w, 0, 0), want_pool)
        for cfg in configs:
            row = dict(B=B, state=str(sd)[6:], BV=cfg[0], num_warps=cfg[1], stages=cfg[2], per_sm=cfg[3],
                       programs=cfg[4] if len(cfg) > 4 else None, variant=cfg[5] if len(cfg) > 5 else "",
                       heuristic=tuple(cfg) == chosen)
            try:
                got_pool = pool.clone()
                got_pool[idx[0]] = pool0
                got_o = one_call(cfg, got_pool)
                got_pool, want_rows = got_pool[idx[0]], want_pool[idx[0]]
                row.update(vs_one_tile_rel_o=rel_rms(got_o, want_o), vs_one_tile_rel_pool=rel_rms(got_pool, want_rows))
                fns = [lambda i=i: fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5,
                                                           pool, None, idx[i], None, None, False, False, False,
                                                           True, config=cfg) for i in range(n)]
                ms = _time_graph(fns, replays=10)
                row.update(us=ms * 1e3, state_tb_s=state_bytes / ms / 1e9)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{e!r}"[:300]
            rows.append(row)
        del pool, want_pool
        torch.cuda.empty_cache()
    return dict(rows=rows)


def modes() -> dict:
    """Where the pool costs (round 22): batch 256, fp32 state, H = HV = 32, the default launch config, the same
    inputs timed in four state modes, alternated twice so that call-to-call drift shows: "pool_inplace" (the bench's
    row, the issue's target), "pool_out" (index load and gather, a new final state: no in-place write),
    "pool_sorted" (in place with the same slots in ascending order: DRAM locality of the slots), "plain_out"
    (FLA's mode: no pool, no index load, a new final state). Each mode's first call is checked against
    pool_inplace's (same math, same inputs: o and the updated states bit-equal expected)."""
    B, H, HV = SWEEP_B, 32, 32
    x = _inputs(B, 1, H, HV)
    state_bytes = 2 * B * HV * K * V * 4
    n = _n_calls(state_bytes)
    pool = torch.randn(n * B, HV, K, V, device=DEV) * 0.5
    perm = torch.randperm(n * B, device=DEV)
    idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(n)]
    sidx = [torch.sort(i).values for i in idx]
    # sorted slots: the sequences' inputs permuted with them, so every mode does the same work per sequence
    order = [torch.sort(i).indices for i in idx]
    xs = [{kk: (t[o] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == B else t)
           for kk, t in x.items()} for o in order]
    h0 = [pool[i].contiguous() for i in idx]
    fns = {
        "pool_inplace": [lambda i=i: decode(**x, initial_state=pool, state_indices=idx[i], inplace=True)
                         for i in range(n)],
        "pool_out": [lambda i=i: decode(**x, initial_state=pool, state_indices=idx[i], output_final_state=True)
                     for i in range(n)],
        "pool_sorted": [lambda i=i: decode(**xs[i], initial_state=pool, state_indices=sidx[i], inplace=True)
                        for i in range(n)],
        "plain_out": [lambda i=i: decode(**x, initial_state=h0[i], output_final_state=True) for i in range(n)],
    }
    # correctness of each mode's first call against pool_inplace's, from the same start states
    start = pool[idx[0]].clone()
    o_ref = decode(**x, initial_state=pool, state_indices=idx[0], inplace=True)[0]
    s_ref = pool[idx[0]].clone()
    checks = {}
    pool[idx[0]] = start
    o, st = decode(**x, initial_state=pool, state_indices=idx[0], output_final_state=True)[:2]
    checks["pool_out"] = dict(o_equal=bool(torch.equal(o, o_ref)), state_equal=bool(torch.equal(st, s_ref)))
    o = decode(**xs[0], initial_state=pool, state_indices=sidx[0], inplace=True)[0]
    checks["pool_sorted"] = dict(o_equal=bool(torch.equal(o, o_ref[order[0]])),
                                 state_equal=bool(torch.equal(pool[idx[0]], s_ref)))
    pool[idx[0]] = start
    o, st = decode(**x, initial_state=start.contiguous(), output_final_state=True)[:2]
    checks["plain_out"] = dict(o_equal=bool(torch.equal(o, o_ref)), state_equal=bool(torch.equal(st, s_ref)))
    rows = []
    for rep in range(2):
        for name, f in fns.items():
            if time.time() - START > 200:
                rows.append(dict(mode=name, rep=rep, skipped="time budget"))
                continue
            ms = _time_graph(f)
            rows.append(dict(mode=name, rep=rep, us=ms * 1e3, state_tb_s=state_bytes / ms / 1e9))
    copy = _copy_bandwidth()
    for r in rows:
        if "us" in r:
            r["of_copy_bw"] = r["state_tb_s"] / copy["tb_s"]
    return dict(B=B, calls_per_replay=n, copy=copy, checks=checks, rows=rows)


def gpu_drift():
    if time.time() - START > 60:
        return dict(skipped="time budget")
    return [drift("cuda", 4, 16, 32, K, V, 1000, s) for s in (1.0, 0.05)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--drift-cpu", action="store_true", help="only the drift section, on the CPU (interpreter)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = dict(environment=environment(args.fla))
    sections = ([("drift_cpu", lambda: [drift("cpu", 1, 2, 2, 32, 32, 1000, s) for s in (1.0, 0.05)])]
                if args.drift_cpu else
                [("gate", gate), ("bench", lambda: bench(args.fla)), ("drift", gpu_drift), ("sweep", sweep),
                 ("modes", modes)])
    only = [n.strip() for n in os.environ.get("DECODE_SECTIONS", "").split(",") if n.strip()]
    if only:                                   # e.g. DECODE_SECTIONS=sweep: a launch-config A/B alone
        sections = [(n, f) for n, f in sections if n in only]
    else:                                      # modes is a diagnosis, run only when named
        sections = [(n, f) for n, f in sections if n != "modes"]
    from common import run_sections
    run_sections(res, sections, os.path.join(args.out, "decode.json"))
    _print(res)


def _print(res):
    env = res["environment"]
    print(f"# {env.get('line', env)}")
    g = res.get("gate")
    if g:
        print(f"gate: {'PASS' if g.get('passed') else 'FAIL'}" + (f" ({g['error']})" if "error" in g else ""))
        for c in g.get("cases", []):
            errs = " ".join(f"{k}={c[k]:.2e}" for k in ("rel_rms_o", "rel_rms_state") if k in c)
            print(f"  {c['status']:7s} {c['case']:45s} {errs} {c.get('error', '')}")
    for key in ("drift", "drift_cpu"):
        for d in res.get(key, []) if isinstance(res.get(key), list) else []:
            print(f"drift {d['steps']} steps, mean alpha {d['mean_alpha']:.3f}: " + "  ".join(
                f"{n}: o {d[n]['rel_rms_o_all']:.2e} (last100 {d[n]['rel_rms_o_last100']:.2e}) "
                f"state {d[n]['rel_rms_state_final']:.2e}" for n in ("fp32", "bf16")))
    b = res.get("bench")
    if b and "rows" in b:
        print(f"copy bandwidth {b['copy']['tb_s']:.2f} TB/s")
        print(f"{'B':>4} {'state':>8} {'ours us':>8} {'TB/s':>6} {'%copy':>6} {'FLA us':>8} {'FLA %copy':>9}")
        for r in b["rows"]:
            if "ours_us" not in r:
                print(f"{r['B']:>4} {r['state']:>8} error: {r.get('error')}")
                continue
            fl = (f"{r['fla_us']:8.1f} {100 * r['fla_of_copy_bw']:8.0f}%   (ours in FLA's mode "
                  f"{r.get('ours_fla_mode_us', float('nan')):.1f} us)" if "fla_us" in r
                  else r.get("fla_error", "")[:60])
            print(f"{r['B']:>4} {r['state']:>8} {r['ours_us']:8.1f} {r['state_tb_s']:6.2f} "
                  f"{100 * r['of_copy_bw']:5.0f}% {fl}")
        print(f"bf16 speedup at batch 256: {b.get('bf16_speedup_b256', float('nan')):.2f}x; targets: {b.get('targets')}")
    elif b:
        print(f"bench error: {b.get('error')}")
    m = res.get("modes") or {}
    for r in m.get("rows", []):
        print(f"mode {r['mode']:13s} rep {r['rep']}: " + (f"{r['us']:.1f} us {100 * r['of_copy_bw']:.1f}% of copy"
                                                          if "us" in r else str(r.get("skipped"))))
    if m.get("checks"):
        print(f"modes checks: {m['checks']}")
    for r in (res.get("sweep") or {}).get("rows", []):
        print(f"sweep B={r['B']} {r['state']} BV={r.get('BV')} warps={r.get('num_warps')} stages={r.get('stages')} "
              f"per_sm={r.get('per_sm')}" + (f" programs={r['programs']}" if r.get("programs") else "")
              + (f" variant={r['variant']}" if r.get("variant") else "")
              + f"{' (heuristic)' if r.get('heuristic') else ''}: "
              + (f"{r['us']:.1f} us {r['state_tb_s']:.2f} TB/s err {r.get('vs_one_tile_rel_pool', -1):.1e}"
                 if "us" in r else str(r.get("error", r.get("skipped")))))


if __name__ == "__main__":
    main()
