"""GPU round for the Gluon decode step (issue 6; gluon/decode.py, backend "gluon" of
`fused_recurrent_gated_delta_rule`): `python benchmarks/gpu/decode_gluon_round.py --out DIR` (< 120 s on an H200).

1. gate: backend="gluon" against `fused_recurrent_reference` in fp64 at K = V = 128: H = HV = 32 at batch 1, 32,
   256 with fp32 and bf16 pools; GVA H = 16, HV = 32 (batch 32, both dtypes); fused gate + beta_sigmoid; a pool
   of 2N + 3 slots with every 4th row padded (-1); unused slots must stay bit-identical; outputs NaN-poisoned
   (poisoned_allocations); indices >= num_slots on a pool that is a view of a larger buffer (the rows past it stay
   bit-identical); one CUDA-graph replay equals eager. Tolerances as decode_gate.py: o 1.5e-2 (bf16), fp32 state
   1e-3, bf16 state 4e-3.
2. bench: the gluon and triton backends on identical inputs (H = HV = 32, T = 1, bf16 q/k/v, pool in place),
   batch 32 and 256, fp32 and bf16 pools, timed exactly like decode_gate.py's bench (its helpers: CUDA-graph
   replays of several calls on disjoint slots spanning >= 3x the L2; median per call), bandwidth against the
   1 GiB copy measured in the same run.
3. sweep: a few gluon configs (BV, warps, stages, CTAs per SM) at batch 256, each checked against the triton
   backend's result on the same call first.

`--dry-run` runs the script's logic on the CPU under TRITON_INTERPRET=1 with small shapes, the Triton backend
standing in for the kernel (which needs sm_90a), and builds every sweep config's launch arguments (TMA
descriptors build without a GPU). Writes DIR/decode_gluon.json (environment line first) and prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import torch  # noqa: E402

import decode_gate as dg  # noqa: E402  (its bench helpers: _time_graph, _copy_bandwidth, _n_calls, _inputs)
from linattn.ops.gated_delta_rule.fused_recurrent import (  # noqa: E402
    fused_recurrent_gated_delta_rule as decode, fused_recurrent_reference)
from linattn.runtime.alloc import poisoned_allocations  # noqa: E402
from linattn.testing import TOL, rel_rms  # noqa: E402

K = V = 128
START = time.time()
CFG = dict(dev="cuda", backend="gluon", batches=(1, 32, 256), bench_batches=(1, 32, 256), H=32, HV=32, sweep_B=256)
SWEEP = {torch.float32: [(64, 4, 3, 2), (64, 4, 3, 2, True), (64, 4, 2, 3, True), (64, 4, 2, 3), (32, 4, 3, 4),
                         (64, 4, 3, 2, True)],
         torch.bfloat16: [(64, 4, 3, 2), (64, 4, 3, 2, True), (64, 4, 2, 3, True), (64, 4, 3, 3)]}
# a 5th element True: REG_STORE (round 29: the state stored from registers, the slot refilled before the arithmetic)
if os.environ.get("DECODE_GLUON_AB_REG") == "1":   # round 29's A/B: the default config with and without it, 4x each
    SWEEP = {sd: [(64, 4, 3, 2), (64, 4, 3, 2, True)] * 4 for sd in (torch.bfloat16, torch.float32)}


def _sync():
    if CFG["dev"] == "cuda":
        torch.cuda.synchronize()


def _pool_case(B, H, HV, state_dtype, extra=None):
    """decode_gate's pool case with the backend under test: pool of 2B + 3 slots, every 4th row padded."""
    dev = CFG["dev"]
    x = dg._inputs(B, 1, H, HV)
    x.update(extra or {})
    slots = 2 * B + 3
    pool = (torch.randn(slots, HV, K, V, device=dev) * 0.5).to(state_dtype)
    idx = torch.randperm(slots, device=dev)[:B].to(torch.int32)
    idx[3::4] = -1
    before = pool.clone()
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**dg._f64(x), initial_state=ref_pool, state_indices=idx, inplace=True)
    with poisoned_allocations():
        o, ret = decode(**x, initial_state=pool, state_indices=idx, inplace=True, backend=CFG["backend"])
    _sync()
    live = idx[idx >= 0].long()
    unused = torch.ones(slots, dtype=torch.bool, device=dev)
    unused[live] = False
    pad = (idx < 0).nonzero().flatten()
    pad_zero = bool((o[pad] == 0).all())
    err_o, err_s = rel_rms(o, ro), rel_rms(pool[live], ref_pool[live])
    tol_o = TOL[torch.bfloat16]
    tol_s = TOL[torch.float32] if state_dtype == torch.float32 else dg.BF16_STATE_TOL
    untouched = bool(torch.equal(pool[unused], before[unused]))
    ok = err_o <= tol_o and err_s <= tol_s and ret is pool and pad_zero and untouched
    return dict(rel_rms_o=err_o, rel_rms_state=err_s, tol_o=tol_o, tol_state=tol_s, pad_rows_zero=pad_zero,
                unused_slots_untouched=untouched, status="pass" if ok else "FAIL")


def _out_of_range_case():
    dev = CFG["dev"]
    H, HV = CFG["H"], CFG["HV"]
    x = dg._inputs(8, 1, H, HV)
    buf = torch.randn(12, HV, K, V, device=dev)
    pool = buf[:8]
    before = buf.clone()
    idx = torch.tensor([8, 1, 11, 2, 1000, -1, 3, 9], device=dev, dtype=torch.int32)
    with poisoned_allocations():
        o, _ = decode(**x, initial_state=pool, state_indices=idx, inplace=True, backend=CFG["backend"])
    _sync()
    keep = [0, 4, 5, 6, 7, 8, 9, 10, 11]
    ok_guard = bool(torch.equal(buf[keep], before[keep]))
    ok_zero = bool((o[torch.tensor([0, 2, 4, 5, 7], device=dev)] == 0).all())
    return dict(guard_rows_untouched=ok_guard, padded_outputs_zero=ok_zero,
                status="pass" if ok_guard and ok_zero else "FAIL")


def _graph_case():
    B, H, HV = 32, 16, 32
    x = dg._inputs(B, 1, H, HV)
    pool = torch.randn(2 * B, HV, K, V, device="cuda")
    idx = torch.randperm(2 * B, device="cuda")[:B].to(torch.int32)
    p_eager, p_graph = pool.clone(), pool.clone()
    decode(**x, initial_state=p_graph, state_indices=idx, inplace=True, backend="gluon")   # compile first
    p_graph.copy_(pool)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        o_graph, _ = decode(**x, initial_state=p_graph, state_indices=idx, inplace=True, backend="gluon")
    torch.cuda.current_stream().wait_stream(s)
    p_graph.copy_(pool)
    fresh = dg._inputs(B, 1, H, HV)
    for n in x:
        x[n].copy_(fresh[n])
    graph.replay()
    o_eager, _ = decode(**x, initial_state=p_eager, state_indices=idx, inplace=True, backend="gluon")
    torch.cuda.synchronize()
    ok = torch.equal(o_graph, o_eager) and torch.equal(p_graph, p_eager)
    return dict(graph_equals_eager=bool(ok), status="pass" if ok else "FAIL")


def gate() -> dict:
    from common import case_runner
    cases = []
    run = case_runner(cases)

    H, HV = CFG["H"], CFG["HV"]
    for B in CFG["batches"]:
        for sd in (torch.float32, torch.bfloat16):
            run(f"pool H={H} HV={HV} B={B} state={str(sd)[6:]}", _pool_case, B=B, H=H, HV=HV, state_dtype=sd)
    Hg = H // 2
    Bg = CFG["batches"][1]
    for sd in (torch.float32, torch.bfloat16):
        run(f"GVA H={Hg} HV={HV} B={Bg} state={str(sd)[6:]}", _pool_case, B=Bg, H=Hg, HV=HV, state_dtype=sd)
    dev = CFG["dev"]
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    fused = dict(g=torch.randn(Bg, 1, HV, device=dev, generator=gen) * 3,
                 beta=torch.randn(Bg, 1, HV, device=dev, generator=gen) * 2,
                 A_log=torch.rand(HV, device=dev, generator=gen) * 2 - 1,
                 dt_bias=torch.randn(HV, device=dev, generator=gen), beta_sigmoid=True)
    run(f"fused gate + beta_sigmoid H={Hg} HV={HV} B={Bg}", _pool_case, B=Bg, H=Hg, HV=HV,
        state_dtype=torch.float32, extra=fused)
    if dev == "cuda":
        run("out-of-range indices", _out_of_range_case)
        run("CUDA graph", _graph_case)
    return dict(passed=all(c["status"] == "pass" for c in cases), cases=cases)


# ------------------------------------------------------------------------------------------------- bench
def _bench_pair(B, sd, fns_of):
    """Same inputs, same pool, same slot rotation for each entry of fns_of (name -> fn(x, pool, idx_i))."""
    H = HV = 32
    x = dg._inputs(B, 1, H, HV)
    esize = torch.empty((), dtype=sd).element_size()
    state_bytes = 2 * B * HV * K * V * esize
    n = dg._n_calls(state_bytes)
    pool = (torch.randn(n * B, HV, K, V, device="cuda") * 0.5).to(sd)
    perm = torch.randperm(n * B, device="cuda").to(torch.int32)
    idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(n)]
    out = dict(B=B, state=str(sd)[6:], calls_per_replay=n, state_bytes=state_bytes)
    for name, fn in fns_of.items():
        try:
            ms = dg._time_graph([lambda i=i: fn(x, pool, idx[i]) for i in range(n)])
            out[f"{name}_us"] = ms * 1e3
            out[f"{name}_tb_s"] = state_bytes / ms / 1e9
        except Exception as e:  # noqa: BLE001
            out[f"{name}_error"] = f"{e!r}"[:400]
    del pool
    torch.cuda.empty_cache()
    return out


def bench() -> dict:
    copy = dg._copy_bandwidth()
    res = dict(shape=dict(H=32, HV=32, K=K, V=V, T=1, qkv="bf16", mode="pool, inplace"), copy=copy, rows=[])
    fns = {b: (lambda x, pool, idx, b=b: decode(**x, initial_state=pool, state_indices=idx, inplace=True,
                                               backend=b)) for b in ("gluon", "triton")}
    for B in CFG["bench_batches"]:
        for sd in (torch.float32, torch.bfloat16):
            row = _bench_pair(B, sd, fns)
            for b in ("gluon", "triton"):
                if f"{b}_tb_s" in row:
                    row[f"{b}_of_copy_bw"] = row[f"{b}_tb_s"] / copy["tb_s"]
            if "gluon_us" in row and "triton_us" in row:
                row["gluon_speedup"] = row["triton_us"] / row["gluon_us"]
            res["rows"].append(row)
    rows = {(r["B"], r["state"]): r for r in res["rows"]}
    f32, b16 = rows.get((256, "float32"), {}), rows.get((256, "bfloat16"), {})
    t = {}
    if "gluon_of_copy_bw" in f32:
        t["gluon_b256_fp32_ge_90pct_copy"] = f32["gluon_of_copy_bw"] >= 0.90
    if "gluon_us" in f32 and "gluon_us" in b16:
        res["gluon_bf16_speedup_b256"] = f32["gluon_us"] / b16["gluon_us"]
        t["gluon_bf16_ge_1.7x_fp32_b256"] = res["gluon_bf16_speedup_b256"] >= 1.7
    res["targets"] = t
    return res


def sweep() -> dict:
    from linattn.ops.gated_delta_rule.gluon.decode import decode_gluon
    rows = []
    B = CFG["sweep_B"]
    for sd, configs in SWEEP.items():
        if time.time() - START > 100:
            rows.append(dict(state=str(sd)[6:], skipped="time budget"))
            continue
        x = dg._inputs(B, 1, 32, 32)
        # correctness of each config first: one call against the triton backend on the same start
        pool0 = (torch.randn(B + 7, 32, K, V, device="cuda") * 0.5).to(sd)
        idx0 = torch.randperm(B + 7, device="cuda")[:B].to(torch.int32)
        idx0[5::9] = -1
        want_pool = pool0.clone()
        want_o, _ = decode(**x, initial_state=want_pool, state_indices=idx0, inplace=True, backend="triton")
        for cfg in configs:
            row = dict(B=B, state=str(sd)[6:], BV=cfg[0], num_warps=cfg[1], stages=cfg[2], per_sm=cfg[3],
                       reg_store=bool(cfg[4]) if len(cfg) > 4 else False)
            try:
                p = pool0.clone()
                o = decode_gluon(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, p, idx0, config=cfg)
                row.update(vs_triton_rel_o=rel_rms(o, want_o), vs_triton_rel_pool=rel_rms(p, want_pool))
                r = _bench_pair(B, sd, {"gluon": lambda x_, pool, idx, cfg=cfg: decode_gluon(
                    x_["q"], x_["k"], x_["v"], x_["g"], x_["beta"], K ** -0.5, pool, idx, config=cfg)})
                row.update(us=r.get("gluon_us"), tb_s=r.get("gluon_tb_s"), error=r.get("gluon_error"))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{e!r}"[:300]
            rows.append(row)
        del pool0, want_pool
        torch.cuda.empty_cache()
    return dict(rows=rows)


def dry_sweep() -> dict:
    """CPU: every sweep config's launch arguments (descriptor, grid) build and mangle as the AOT signature."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.gluon.decode import aot_build, decode_launch
    rows = []
    x = dg._inputs(4, 1, 32, 32)
    for sd, configs in SWEEP.items():
        pool = torch.zeros(9, 32, K, V, dtype=sd)
        idx = torch.tensor([3, -1, 0, 8], dtype=torch.int32)
        for cfg in configs:
            _, grid, args, kw, _, n_tiles = decode_launch(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.1, pool, idx,
                                                          config=cfg, num_sms=132)
            _, sig, const, _ = aot_build({torch.float32: "fp32", torch.bfloat16: "bf16"}[sd], cfg[0], cfg[1], cfg[2],
                                         reg_store=bool(cfg[4]) if len(cfg) > 4 else False)
            want = [t for n, t in sig.items() if t != "constexpr" or const.get(n, 0) is None]
            got = [mangle_type(a) for a in args]
            rows.append(dict(state=str(sd)[6:], config=cfg, grid=grid, n_tiles=n_tiles, signature_ok=got == want))
    return dict(rows=rows, passed=all(r["signature_ok"] for r in rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU: the script's logic, Triton standing in")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run needs TRITON_INTERPRET=1 (the Triton backend stands in for the Gluon kernel)")
        dg.DEV = "cpu"
        CFG.update(dev="cpu", backend="triton", batches=(1, 5), H=4, HV=4)
    res = dict(environment=dg.environment(False), dry_run=args.dry_run)
    sections = [("gate", gate), ("sweep_launch_args", dry_sweep)] if args.dry_run else \
        [("gate", gate), ("bench", bench), ("sweep", sweep)]
    only = [n.strip() for n in os.environ.get("DECODE_GLUON_SECTIONS", "").split(",") if n.strip()]
    if only:                                   # e.g. DECODE_GLUON_SECTIONS=sweep with DECODE_GLUON_AB_REG=1
        sections = [(n, f) for n, f in sections if n in only]
    from common import run_sections
    run_sections(res, sections, os.path.join(args.out, "decode_gluon.json"))
    _print(res)


def _print(res):
    env = res["environment"]
    print(f"# {env.get('line', env)}")
    g = res.get("gate", {})
    print(f"gate ({'dry run, triton' if res.get('dry_run') else 'gluon'}): "
          f"{'PASS' if g.get('passed') else 'FAIL'}" + (f" ({g['error']})" if "error" in g else ""))
    for c in g.get("cases", []):
        errs = " ".join(f"{k}={c[k]:.2e}" for k in ("rel_rms_o", "rel_rms_state") if k in c)
        print(f"  {c['status']:7s} {c['case']:45s} {errs} {c.get('error', '')}")
    b = res.get("bench")
    if b and "rows" in b:
        print(f"copy bandwidth {b['copy']['tb_s']:.2f} TB/s")
        print(f"{'B':>4} {'state':>8} {'gluon us':>9} {'%copy':>6} {'triton us':>9} {'%copy':>6} {'speedup':>7}")
        for r in b["rows"]:
            print(f"{r['B']:>4} {r['state']:>8} {r.get('gluon_us', float('nan')):9.1f} "
                  f"{100 * r.get('gluon_of_copy_bw', float('nan')):5.1f}% {r.get('triton_us', float('nan')):9.1f} "
                  f"{100 * r.get('triton_of_copy_bw', float('nan')):5.1f}% {r.get('gluon_speedup', float('nan')):6.2f}x "
                  f"{r.get('gluon_error', '')}")
        print(f"gluon bf16 speedup at 256: {b.get('gluon_bf16_speedup_b256', float('nan')):.2f}x; "
              f"targets {b.get('targets')}")
    elif b:
        print(f"bench error: {b.get('error')}")
    for r in (res.get("sweep") or {}).get("rows", []):
        print(f"sweep {r}")
    s = res.get("sweep_launch_args")
    if s:
        print(f"sweep launch args (CPU): {'ok' if s.get('passed') else s}")
    print(f"sections (s): {res.get('section_s')}; total {time.time() - START:.0f} s")


if __name__ == "__main__":
    main()
