"""Round 29 (issue 6): where the in-place pool loses against an out-of-place final state, and the discard_l2
variant. `python benchmarks/gpu/decode_inplace_round.py --out DIR` writes DIR/decode_inplace.json.

Round 22 (OPT_LOG 22.2) measured the batch-256 fp32 decode at 281.6 / 282.0 us with the pool updated in place and
275.7 / 276.4 us with the same pool read and a new final state written: the in-place write-back costs ~2%, the
difference between 89.8% of the copy bandwidth and the 90% target. Here, at H = HV = 32, K = V = 128, T = 1, bf16
q/k/v, the bench's layout (two pools of 256 slots each, the live slots in a random order):

1. `equal`: the discard_l2 variant (fused_recurrent.py: each block's L2 lines discarded between its read and its
   in-place write-back) against the default on the same inputs, H32/HV32 and H16/HV32, a pool of 2N + 3 slots with
   every 4th row padded and one index past the pool: o and every slot bit for bit, unused slots untouched, and
   against the fp64 reference. NaN-poisoned outputs.
2. `timing`: CUDA-graph timing (two calls per replay on the two pools, as `linattn bench`), each row alternated
   three times: the default in place, discard_l2, the default at exactly 256 programs (64 tiles each: no last
   round), pool read with a new final state (out of place); and the same bytes moved by torch: a 512 MiB copy into
   another buffer, a 512 MiB in-place scale (x.mul_), and the bench's 1 GiB eager copy (the ceiling).
3. `probe` (round 29's second call): the decode kernel's memory pattern without its math, a stand-alone Triton
   kernel in this file (`stream_probe_kernel`: the same persistent strided walk over (sequence, value head, V-block)
   tiles of [128, 64] fp32, the same pipelined loop, stages and programs, the slot loaded per tile), timed in place
   (random and sorted slots) and out of place, beside the decode and torch's in-place scale. It separates the tile
   walk's memory pattern from the per-tile compute.
4. `--ncu-child`: one call of each decode mode and of the two torch kernels, for `ncu --metrics` (run_round.sh
   step `ncu_decode`): DRAM and L2 bytes, so that the in-place penalty shows as extra bytes or as the same bytes
   moved slower.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from decode_gate import _time_graph  # noqa: E402  (all fns in one CUDA graph, median ms per fn: the bench's method)
from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference  # noqa: E402
from linattn.ops.gated_delta_rule.triton.fused_recurrent import fused_recurrent_gdn_fwd  # noqa: E402
from linattn.runtime.alloc import poisoned_allocations  # noqa: E402
from linattn.testing import TOL, make_gdn_inputs, rel_rms  # noqa: E402

B, H, HV, K, V = 256, 32, 32, 128, 128
DEFAULT = (64, 4, 3, 2, None, "prefetch_qk")
CONFIGS = {"default": DEFAULT, "discard_l2": (64, 4, 3, 2, None, "prefetch_qk+discard_l2"),
           "programs256": (64, 4, 3, 2, 256, "prefetch_qk"), "store_first": (64, 4, 3, 2, None, "prefetch_qk+store_first")}
EQUAL_HEADS = ((32, 32), (16, 32))
# the probe's dependent multiply-adds per element between a tile's arrival and its store (module docstring, 3)
PROBE_DELAYS = tuple(int(d) for d in os.environ.get("PROBE_DELAYS", "16,64").split(",") if d)
AB = ("default", "store_first", "pool_out", "store_first_out")   # the `ab` section's decode modes                  # (H, HV) of the equality cases
# DECODE_AB_DTYPE=bf16: the `ab` section on bf16 pools (round 30), with the Gluon decode (bf16's auto) as mode "gluon"
POOL_DTYPE = {"bf16": torch.bfloat16}.get(os.environ.get("DECODE_AB_DTYPE", ""), torch.float32)
DEV = "cuda"                                      # a CPU dry run of the logic sets "cpu" (and small sizes) from outside
START = time.time()


@triton.jit(do_not_specialize=["n_tiles"])
def stream_probe_kernel(src, dst, idx, n_tiles, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BV: tl.constexpr, NUM_STAGES: tl.constexpr, INPLACE: tl.constexpr, DELAY: tl.constexpr = 0):
    """The persistent decode kernel's walk and tile without the recurrence: block (slot idx[n], head, V-block) read
    as a pipelined [K, BV] load, scaled, written back in place (or to row n of dst). A probe, not an op. DELAY > 0
    puts DELAY dependent multiply-adds per element between the tile's arrival and its store (compute time without
    the decode's barriers; the scale then differs from the plain probe's, so only DELAY = 0 is checked)."""
    NV: tl.constexpr = V // BV
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, BV)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        t = tl.full([], 0, tl.int64) + tile
        i_v = t % NV
        n = (t // NV) // HV
        hv = (t // NV) % HV
        slot = tl.load(idx + n).to(tl.int64)
        cols = tl.max_contiguous(tl.multiple_of(i_v * BV + o_v, BV), BV)
        inner = o_k[:, None] * V + cols[None, :]
        x = tl.load(src + (slot * HV + hv) * K * V + inner)
        x = x * 0.9990234375
        for _ in range(DELAY):
            x = x * 0.9990234375 + 1e-30
        if INPLACE:
            tl.store(src + (slot * HV + hv) * K * V + inner, x)
        else:
            tl.store(dst + (n * HV + hv) * K * V + inner, x)


def _probe(src, dst, idx, stages=3, per_sm=2, inplace=True, BV=64, delay=0):
    n_tiles = idx.shape[0] * HV * (V // BV)
    grid = (min(n_tiles, per_sm * torch.cuda.get_device_properties(0).multi_processor_count),)
    stream_probe_kernel[grid](src, dst, idx, n_tiles, HV=HV, K=K, V=V, BV=BV, NUM_STAGES=stages, INPLACE=inplace,
                              DELAY=delay, num_warps=4, num_stages=1)


def probe() -> dict:
    """The tile walk's memory pattern alone against the decode and torch's in-place scale (module docstring, 3)."""
    sets = _bench_sets()
    for s in sets:
        s["sidx"] = torch.sort(s["idx"]).values
    state_bytes = 2 * B * HV * K * V * 4
    # the probe is checked once: in place it scales every slot by the constant, out of place it writes row n
    s = sets[0]
    before = s["pool"].clone()
    _probe(s["pool"], s["ht"], s["idx"], inplace=False)
    ok_out = bool(torch.equal(s["ht"], before[s["idx"].long()] * 0.9990234375))
    _probe(s["pool"], s["ht"], s["idx"])
    ok_in = bool(torch.equal(s["pool"], before * 0.9990234375))
    fns = {
        "decode_default": [lambda s=s: _call(s["x"], s["pool"], s["idx"], DEFAULT) for s in sets],
        "probe_inplace": [lambda s=s: _probe(s["pool"], s["ht"], s["idx"]) for s in sets],
        "probe_inplace_sorted": [lambda s=s: _probe(s["pool"], s["ht"], s["sidx"]) for s in sets],
        "probe_out": [lambda s=s: _probe(s["pool"], s["ht"], s["idx"], inplace=False) for s in sets],
        "probe_inplace_s2_3sm": [lambda s=s: _probe(s["pool"], s["ht"], s["idx"], stages=2, per_sm=3) for s in sets],
        "probe_inplace_s2_6sm": [lambda s=s: _probe(s["pool"], s["ht"], s["idx"], stages=2, per_sm=6) for s in sets],
        "probe_inplace_bv128_s2_3sm": [lambda s=s: _probe(s["pool"], s["ht"], s["idx"], stages=2, per_sm=3, BV=128)
                                       for s in sets],
        "torch_mul_inplace_512m": [lambda s=s: s["pool"].mul_(0.9990234375) for s in sets],
    }
    for spec in filter(None, os.environ.get("PROBE_EXTRA", "").split(";")):
        name, cfg = spec.split("=")
        bv, st, psm = (int(v) for v in cfg.split(":"))
        fns[name] = [lambda s=s, bv=bv, st=st, psm=psm: _probe(s["pool"], s["ht"], s["idx"], stages=st, per_sm=psm,
                                                               BV=bv) for s in sets]
    for d in PROBE_DELAYS:
        fns[f"probe_inplace_delay{d}"] = [lambda s=s, d=d: _probe(s["pool"], s["ht"], s["idx"], delay=d) for s in sets]
        fns[f"probe_out_delay{d}"] = [lambda s=s, d=d: _probe(s["pool"], s["ht"], s["idx"], inplace=False, delay=d)
                                      for s in sets]
    _warm_clocks()
    rows = _alternate(fns, 3, state_bytes, 200)
    return dict(checks=dict(probe_out_equal=ok_out, probe_inplace_equal=ok_in), rows=rows,
                summary=_summary(rows, fns, state_bytes))


def _extra_configs() -> dict:
    """DECODE_AB_CONFIGS="name=BV:warps:stages:per_sm[:programs[:variant]];...": launch configs the `ab` section
    times in place beside its modes (variant default "prefetch_qk")."""
    out = {}
    for spec in filter(None, os.environ.get("DECODE_AB_CONFIGS", "").split(";")):
        name, cfg = spec.split("=")
        f = cfg.split(":")
        out[name] = (int(f[0]), int(f[1]), int(f[2]), int(f[3]), int(f[4]) if len(f) > 4 and f[4] else None,
                     f[5] if len(f) > 5 else "prefetch_qk")
    return out


def ab() -> dict:
    """store_first against the default, in place and out of place, alternated five times (round 29's third call);
    store_first's o and pool against the default's on the bench's inputs (same math, another rounding of o) and its
    pool against fp64."""
    sets = _bench_sets()
    state_bytes = 2 * B * HV * K * V * sets[0]["pool"].element_size()
    s = sets[0]
    p0 = s["pool"].clone()
    extra = _extra_configs()
    o_a, _ = _call(s["x"], s["pool"], s["idx"], DEFAULT)
    p_a = s["pool"].clone()
    s["pool"].copy_(p0)
    o_b, _ = _call(s["x"], s["pool"], s["idx"], CONFIGS["store_first"])
    f64 = {k: (t.double() if t.is_floating_point() else t) for k, t in s["x"].items()}
    ref_pool = p0.double()
    ro, _ = fused_recurrent_reference(**f64, initial_state=ref_pool, state_indices=s["idx"].long(), inplace=True)
    checks = dict(pool_bit_equal=bool(torch.equal(s["pool"], p_a)), o_rel_rms_vs_default=rel_rms(o_b, o_a),
                  o_rel_rms_vs_fp64=rel_rms(o_b, ro), pool_rel_rms_vs_fp64=rel_rms(s["pool"], ref_pool),
                  default_o_rel_rms_vs_fp64=rel_rms(o_a, ro))
    checks["ok"] = (checks["o_rel_rms_vs_fp64"] <= TOL[torch.bfloat16] and checks["pool_rel_rms_vs_fp64"] <=
                    TOL[torch.float32])
    for name, c in extra.items():              # each extra config's o and pool against the default's (same math)
        s["pool"].copy_(p0)
        o_c, _ = _call(s["x"], s["pool"], s["idx"], c)
        checks[name] = dict(o_rel_rms_vs_default=rel_rms(o_c, o_a), pool_rel_rms_vs_default=rel_rms(s["pool"], p_a))
    modes = {"default": lambda s: _call(s["x"], s["pool"], s["idx"], DEFAULT),
             "store_first": lambda s: _call(s["x"], s["pool"], s["idx"], CONFIGS["store_first"]),
             "pool_out": lambda s: _call(s["x"], s["pool"], s["idx"], DEFAULT, inplace=False, final_out=s["ht"]),
             "store_first_out": lambda s: _call(s["x"], s["pool"], s["idx"], CONFIGS["store_first"], inplace=False,
                                                final_out=s["ht"])}
    for name, c in extra.items():
        modes[name] = lambda s, c=c: _call(s["x"], s["pool"], s["idx"], c)
    if POOL_DTYPE == torch.bfloat16:
        from linattn.ops.gated_delta_rule.gluon.decode import decode_gluon
        modes["gluon"] = lambda s: decode_gluon(s["x"]["q"], s["x"]["k"], s["x"]["v"], s["x"]["g"], s["x"]["beta"],
                                                K ** -0.5, s["pool"], s["idx"])
        s["pool"].copy_(p0)
        o_g = modes["gluon"](s)
        checks["gluon"] = dict(o_rel_rms_vs_default=rel_rms(o_g, o_a), pool_rel_rms_vs_default=rel_rms(s["pool"], p_a))
    out_names = []
    if os.environ.get("DECODE_AB_OUT") == "1":    # each extra config also out of place (pool read, new final state)
        for name, c in extra.items():
            modes[name + "_out"] = lambda s, c=c: _call(s["x"], s["pool"], s["idx"], c, inplace=False,
                                                        final_out=s["ht"])
            out_names.append(name + "_out")
    names = [m for m in os.environ.get("DECODE_AB_MODES", ",".join(AB)).split(",") if m in modes] + list(extra) \
        + out_names
    fns = {m: [lambda s=s, f=modes[m]: f(s) for s in sets] for m in names}
    _warm_clocks()
    rows = _alternate(fns, 5, state_bytes, 220)
    from linattn.bench.timing import measure_ceilings
    c = measure_ceilings("cuda")
    copy_tb_s = c["copy_gbps"] / 1e3
    summ = _summary(rows, fns, state_bytes, copy_tb_s)
    return dict(checks=checks, copy=dict(ms=c["copy_ms"], tb_s=copy_tb_s), rows=rows, summary=summ,
                target_us=state_bytes / (0.9 * copy_tb_s * 1e12) * 1e6)


def paired() -> dict:
    """The ratio's noise (round 29): `linattn bench` measures the copy once at the start of a run; this section
    alternates the bench's copy measurement (measure_ceilings: 1 GiB eager copy, median of 10) with the decode row
    (the default in place, graph, median of 20 replays of two calls) PAIRED_REPS times and records each pair's
    ratio, so the spread of the copy within a run, of the decode, and of their ratio are measured, not assumed."""
    from linattn.bench.timing import measure_ceilings
    sets = _bench_sets()
    state_bytes = 2 * B * HV * K * V * 4
    fns = [lambda s=s: _call(s["x"], s["pool"], s["idx"], DEFAULT) for s in sets]
    _warm_clocks()
    pairs = []
    for rep in range(int(os.environ.get("PAIRED_REPS", "8"))):
        if time.time() - START > 200:
            break
        c = measure_ceilings("cuda")
        us = _time_graph(fns) * 1e3
        copy_tb_s = c["copy_gbps"] / 1e3
        pairs.append(dict(rep=rep, copy_ms=c["copy_ms"], copy_tb_s=copy_tb_s, decode_us=us,
                          of_copy_bw=state_bytes / (us * 1e-6) / 1e12 / copy_tb_s))
    if not pairs:
        return dict(pairs=[], skipped="PAIRED_REPS=0 or no time left")
    r = [p["of_copy_bw"] for p in pairs]
    cp = [p["copy_tb_s"] for p in pairs]
    du = [p["decode_us"] for p in pairs]
    return dict(pairs=pairs, median_of_copy_bw=statistics.median(r), min_of_copy_bw=min(r), max_of_copy_bw=max(r),
                copy_tb_s_median=statistics.median(cp), copy_tb_s_range=[min(cp), max(cp)],
                decode_us_median=statistics.median(du), decode_us_range=[min(du), max(du)])


def _warm_clocks(seconds=1.0):
    """Busy the GPU for about a second before timing: round 29's first call timed its first row at 308.5 us against
    281.2-281.7 for the same row later (the SM clock ramping up from idle)."""
    a = torch.randn(4096, 4096, device="cuda")
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()


def _alternate(fns: dict, reps: int, state_bytes: int, budget_s: float) -> list:
    """Each fns entry timed in turn (graph, _time_graph), the whole round repeated `reps` times so that drift shows;
    rows past `budget_s` since the script's start are recorded as skipped."""
    rows = []
    for rep in range(reps):
        for name, f in fns.items():
            if time.time() - START > budget_s:
                rows.append(dict(mode=name, rep=rep, skipped="time budget"))
                continue
            ms = _time_graph(f)
            rows.append(dict(mode=name, rep=rep, us=ms * 1e3, tb_s=state_bytes / ms / 1e9))
    return rows


def _summary(rows, fns, state_bytes, copy_tb_s=None):
    """Median / min / max us per mode; with the copy bandwidth, the median's share of it."""
    med = {}
    for name in fns:
        us = [r["us"] for r in rows if r["mode"] == name and "us" in r]
        if us:
            med[name] = dict(median_us=statistics.median(us), min_us=min(us), max_us=max(us))
            if copy_tb_s:
                med[name]["of_copy_bw"] = state_bytes / (med[name]["median_us"] * 1e-6) / 1e12 / copy_tb_s
    return med


def _inputs(n, h, hv, seed):
    torch.manual_seed(seed)
    x = make_gdn_inputs(n, 1, h, hv, K, V, dtype=torch.bfloat16, device=DEV, initial_state=False)
    del x["initial_state"]
    return x


def _call(x, pool, idx, cfg, inplace=True, out=None, final_out=None):
    o, ht = fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, None, None,
                                    False, False, not inplace, inplace, config=cfg, out=out, final_out=final_out)
    return o, ht


def equal() -> dict:
    cases = []
    for h, hv in EQUAL_HEADS:
        n = B
        x = _inputs(n, h, hv, seed=h)
        slots = 2 * n + 3
        pool0 = torch.randn(slots, hv, K, V, device=DEV) * 0.5
        idx = torch.randperm(slots, device=DEV)[:n].to(torch.int32)
        idx[3::4] = -1
        idx[5] = slots                                 # past the pool: a padded row (no read, no write)
        res = {}
        for name in ("default", "discard_l2"):
            pool = pool0.clone()
            with poisoned_allocations():
                o, _ = _call(x, pool, idx, CONFIGS[name])
            if DEV == "cuda":
                torch.cuda.synchronize()
            res[name] = (o, pool)
        live = idx[(idx >= 0) & (idx < slots)].long()
        unused = torch.ones(slots, dtype=torch.bool, device=DEV)
        unused[live] = False
        f64 = {k: (t.double() if t.is_floating_point() else t) for k, t in x.items()}
        ref_pool = pool0.double()
        # the reference with the out-of-range row padded, as the kernel treats it
        ridx = idx.long().clone()
        ridx[ridx >= slots] = -1
        ro, _ = fused_recurrent_reference(**f64, initial_state=ref_pool, state_indices=ridx, inplace=True)
        o_d, p_d = res["discard_l2"]
        o_0, p_0 = res["default"]
        pad = (ridx < 0).nonzero().flatten()
        case = dict(H=h, HV=hv, N=n, slots=slots,
                    o_bit_equal=bool(torch.equal(o_d, o_0)), pool_bit_equal=bool(torch.equal(p_d, p_0)),
                    unused_untouched=bool(torch.equal(p_d[unused], pool0[unused])),
                    pad_rows_zero=bool((o_d[pad] == 0).all()),
                    rel_rms_o=rel_rms(o_d[ridx >= 0], ro[ridx >= 0]), rel_rms_state=rel_rms(p_d[live], ref_pool[live]))
        case["status"] = "pass" if (case["o_bit_equal"] and case["pool_bit_equal"] and case["unused_untouched"]
                                    and case["pad_rows_zero"] and case["rel_rms_o"] <= TOL[torch.bfloat16]
                                    and case["rel_rms_state"] <= TOL[torch.float32]) else "FAIL"
        cases.append(case)
    return dict(cases=cases, all_pass=all(c["status"] == "pass" for c in cases))


def _with_pdl(on: bool, f):
    """f with LINATTN_GDN_DECODE_PDL set first (read by the launcher at each call, so also at graph capture)."""
    def g():
        os.environ["LINATTN_GDN_DECODE_PDL"] = "1" if on else "0"
        return f()
    return g


def pdl() -> dict:
    """Round 30: the decode kernels launched with programmatic dependent launch (the default where it exists) against
    the same launches without it (LINATTN_GDN_DECODE_PDL=0), in place at batch 256 (the bench's layout, default
    config), alternated five times: graphs of two calls per replay (the bench's method) and of eight (four per set),
    whose difference separates the per-replay cost from the per-call one. o and pool with PDL bit-equal to those
    without (same kernel code but the wait), and against fp64."""
    from linattn.bench.timing import measure_ceilings
    sets = _bench_sets()
    state_bytes = 2 * B * HV * K * V * 4
    s = sets[0]
    p0 = s["pool"].clone()
    saved = os.environ.get("LINATTN_GDN_DECODE_PDL")
    try:
        res = {}
        for on in (False, True):
            s["pool"].copy_(p0)
            o, _ = _with_pdl(on, lambda: _call(s["x"], s["pool"], s["idx"], None))()
            torch.cuda.synchronize()
            res[on] = (o.clone(), s["pool"].clone())
        from linattn.ops.gated_delta_rule.triton.fused_recurrent import decode_pdl
        f64 = {k: (t.double() if t.is_floating_point() else t) for k, t in s["x"].items()}
        ref_pool = p0.double()
        ro, _ = fused_recurrent_reference(**f64, initial_state=ref_pool, state_indices=s["idx"].long(), inplace=True)
        checks = dict(pdl_used=bool(decode_pdl(s["x"]["q"])),
                      o_bit_equal=bool(torch.equal(res[True][0], res[False][0])),
                      pool_bit_equal=bool(torch.equal(res[True][1], res[False][1])),
                      o_rel_rms_vs_fp64=rel_rms(res[True][0], ro), pool_rel_rms_vs_fp64=rel_rms(res[True][1], ref_pool))
        checks["ok"] = (checks["pdl_used"] and checks["o_bit_equal"] and checks["pool_bit_equal"]
                        and checks["o_rel_rms_vs_fp64"] <= TOL[torch.bfloat16]
                        and checks["pool_rel_rms_vs_fp64"] <= TOL[torch.float32])
        fns = {}
        for on in (True, False):
            tag = "pdl" if on else "nopdl"
            one = [_with_pdl(on, lambda s=s: _call(s["x"], s["pool"], s["idx"], None)) for s in sets]
            fns[f"{tag}_2calls"] = one
            fns[f"{tag}_8calls"] = one * 4
        # PDL_BATCHES: smaller batches (the one-tile kernel at batch 1 and 32), two calls per replay as the bench
        small = {}
        for nb in (int(b) for b in os.environ.get("PDL_BATCHES", "").split(",") if b.strip()):
            sb = _bench_sets(batch=nb)
            for on in (True, False):
                small[f"{'pdl' if on else 'nopdl'}_b{nb}"] = (
                    [_with_pdl(on, lambda s=s: _call(s["x"], s["pool"], s["idx"], None)) for s in sb],
                    2 * nb * HV * K * V * 4)
        _warm_clocks()
        rows = _alternate(fns, 5, state_bytes, 200)
        for rep in range(5):
            for name, (f, nbytes) in small.items():
                ms = _time_graph(f)
                rows.append(dict(mode=name, rep=rep, us=ms * 1e3, tb_s=nbytes / ms / 1e9))
    finally:
        if saved is None:
            os.environ.pop("LINATTN_GDN_DECODE_PDL", None)
        else:
            os.environ["LINATTN_GDN_DECODE_PDL"] = saved
    c = measure_ceilings("cuda")
    copy_tb_s = c["copy_gbps"] / 1e3
    summ = _summary(rows, fns, state_bytes, copy_tb_s)
    summ.update(_summary(rows, small, state_bytes))
    return dict(checks=checks, copy=dict(ms=c["copy_ms"], tb_s=copy_tb_s), rows=rows, summary=summ,
                target_us=state_bytes / (0.9 * copy_tb_s * 1e12) * 1e6)


def _bench_sets(n_sets=2, batch=B):
    """The bench's layout: per set, inputs of `batch` sequences and a pool of `batch` slots in a random order."""
    sets = []
    for i in range(n_sets):
        x = _inputs(batch, H, HV, seed=100 + i)
        pool = (torch.randn(batch, HV, K, V, device="cuda") * 0.5).to(POOL_DTYPE)
        idx = torch.randperm(batch, device="cuda").to(torch.int32)
        sets.append(dict(x=x, pool=pool, idx=idx, ht=torch.empty(batch, HV, K, V, device="cuda")))
    return sets


def timing() -> dict:
    from linattn.bench.timing import measure_ceilings
    sets = _bench_sets()
    state_bytes = 2 * B * HV * K * V * 4
    fns = {name: [lambda s=s, c=cfg: _call(s["x"], s["pool"], s["idx"], c) for s in sets]
           for name, cfg in CONFIGS.items()}
    fns["pool_out"] = [lambda s=s: _call(s["x"], s["pool"], s["idx"], DEFAULT, inplace=False, final_out=s["ht"])
                       for s in sets]
    half = B * HV * K * V                              # 512 MiB of fp32: the state bytes read (and written) per call
    src = [torch.randn(half, device="cuda") for _ in range(2)]
    dst = [torch.empty_like(t) for t in src]
    fns["torch_copy_512m"] = [lambda a=a, b=b: b.copy_(a) for a, b in zip(src, dst)]
    fns["torch_mul_inplace_512m"] = [lambda a=a: a.mul_(0.9990234375) for a in src]
    _warm_clocks()
    rows = _alternate(fns, 3, state_bytes, 150)
    c = measure_ceilings("cuda")
    copy_tb_s = c["copy_gbps"] / 1e3
    for r in rows:
        if "us" in r:
            r["of_copy_bw"] = r["tb_s"] / copy_tb_s
    med = _summary(rows, fns, state_bytes, copy_tb_s)
    return dict(copy=dict(ms=c["copy_ms"], tb_s=copy_tb_s, how=c["how"]), calls_per_replay=2, rows=rows,
                summary=med, target_us=state_bytes / (0.9 * copy_tb_s * 1e12) * 1e6)


def ncu_child():
    """One call of each mode (after a warm-up outside the profiled range), for ncu --profile-from-start off."""
    sets = _bench_sets(1)
    s = sets[0]
    half = B * HV * K * V
    a = torch.randn(half, device="cuda")
    b = torch.empty_like(a)
    work = [("default", lambda: _call(s["x"], s["pool"], s["idx"], DEFAULT)),
            ("discard_l2", lambda: _call(s["x"], s["pool"], s["idx"], CONFIGS["discard_l2"])),
            ("pool_out", lambda: _call(s["x"], s["pool"], s["idx"], DEFAULT, inplace=False, final_out=s["ht"])),
            ("torch_copy_512m", lambda: b.copy_(a)), ("torch_mul_inplace_512m", lambda: a.mul_(0.9990234375))]
    for _, f in work:
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, f in work:
        torch.cuda.nvtx.range_push(name)
        f()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("order:", [n for n, _ in work])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--ncu-child", action="store_true")
    args = ap.parse_args()
    if args.ncu_child:
        ncu_child()
        return
    from common import round_result, run_sections
    res = round_result("decode_inplace_round.py", "cuda")
    sections = [("equal", equal), ("timing", timing), ("probe", probe), ("ab", ab), ("paired", paired), ("pdl", pdl)]
    only = [n.strip() for n in os.environ.get("DECODE_INPLACE_SECTIONS", "").split(",") if n.strip()]
    if only:
        sections = [(n, f) for n, f in sections if n in only]
    run_sections(res, sections, os.path.join(args.out, "decode_inplace.json"))
    eq = res.get("equal", {})
    print("equal:", eq.get("all_pass"), [(c.get("H"), c.get("status"), c.get("rel_rms_o"), c.get("rel_rms_state"))
                                         for c in eq.get("cases", [])])
    t = res.get("timing", {})
    print("copy:", t.get("copy"), "target us:", t.get("target_us"))
    for name, m in t.get("summary", {}).items():
        print(f"{name:24s} {m['median_us']:8.1f} us  [{m['min_us']:.1f}, {m['max_us']:.1f}]  {100 * m['of_copy_bw']:.2f}% of copy")
    a = res.get("ab", {})
    print("ab checks:", a.get("checks"), a.get("error", ""), "target us:", a.get("target_us"))
    for name, m in a.get("summary", {}).items():
        print(f"{name:28s} {m['median_us']:8.1f} us  [{m['min_us']:.1f}, {m['max_us']:.1f}]  {100 * m['of_copy_bw']:.2f}% of copy")
    pa = res.get("paired", {})
    if pa:
        print("paired:", {k: v for k, v in pa.items() if k != "pairs"})
        for p in pa.get("pairs", []):
            print(f"  copy {p['copy_tb_s']:.4f} TB/s  decode {p['decode_us']:.1f} us  {100 * p['of_copy_bw']:.2f}% of copy")
    pd = res.get("pdl", {})
    if pd:
        print("pdl checks:", pd.get("checks"), pd.get("error", ""), "target us:", pd.get("target_us"))
        for name, m in pd.get("summary", {}).items():
            print(f"{name:28s} {m['median_us']:8.2f} us  [{m['min_us']:.2f}, {m['max_us']:.2f}]  "
                  f"{100 * m.get('of_copy_bw', 0):.2f}% of copy")
    pr = res.get("probe", {})
    print("probe checks:", pr.get("checks"), pr.get("error", ""))
    for name, m in pr.get("summary", {}).items():
        print(f"{name:28s} {m['median_us']:8.1f} us  [{m['min_us']:.1f}, {m['max_us']:.1f}]")


if __name__ == "__main__":
    main()
