"""GPU round for the segment-parallel state pass of the Triton GDN forward (triton/chunk_state_split.py).

    python benchmarks/gpu/split_state_round.py --out DIR [--budget 150] [--no-timing] [--sweep]
    TRITON_INTERPRET=1 python benchmarks/gpu/split_state_round.py --out DIR --smoke   # CPU: tiny shapes, code paths

1. gate (LINATTN_GDN_SPLIT_STATE=1, NaN-poisoned buffers, fp64 chunk reference, relative RMS, TOL per dtype):
   B=1 T=65536 H16/HV32 K=V=128 bf16 with the automatic plan, the same with slow decay (g * 0.02: the segment
   joins carry the state), varlen at T=65536 (forced segments of 16 chunks), T=1000 fp16 without initial state
   and fp32 T=1000 (forced short segments); plus split vs plain state-stage outputs (h, vnew, final) at T=65536
   and a sync-free check (torch.cuda.set_sync_debug_mode("error")) of the split forward.
2. only if the gate is green: state stage alone, plain kernel vs split launcher on identical inputs (CUDA events
   and CUDA-graph replay, median), at B=1 T=8192/32768/65536 and B=8 T=4096, H16/HV32 K=V=128 bf16; the split
   at its automatic segment length and at half and double; then the whole forward with the switch off and on.
   --sweep: also other launch configs of the split (sweep_configs(): BV=32, pipelined 8 warps, phase 1 fused
   into one launch) at B=1 T=65536 and B=8 T=4096.
Writes DIR/split_state.json after every step (a timeout keeps what was measured) and prints a table.
"""
import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                       # common
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))     # linattn from this checkout
import torch  # noqa: E402
from common import graph_ms, median_ms, round_result  # noqa: E402

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TIMING_SHAPES = ((1, 8192), (1, 32768), (1, 65536), (8, 4096))


def _write(path, obj):
    from common import write_json
    write_json(path, obj)


def _set_split(on, chunks=0):
    os.environ["LINATTN_GDN_SPLIT_STATE"] = "1" if on else "0"
    os.environ["LINATTN_GDN_SPLIT_CHUNKS"] = str(chunks)


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _ms(fn, dev, warmup=3, repeats=15):
    return median_ms(fn, warmup=warmup, repeats=repeats)


def _rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- gate

def gate_cases(smoke):
    # (name, B, T, H, HV, K, V, dtype, varlen lengths, forced segment chunks (0 = auto), g factor, initial state)
    if smoke:
        return [("smoke_auto", 1, 300, 2, 4, 32, 32, BF, None, 0, 1.0, True),
                ("smoke_weak_decay", 1, 600, 2, 4, 32, 32, BF, None, 2, 0.02, True),
                ("smoke_varlen", 1, 400, 2, 4, 32, 32, BF, [1, 250, 0, 149], 2, 0.02, True),
                ("smoke_fp32", 1, 333, 1, 2, 32, 32, FP32, None, 1, 0.02, False)]
    g = torch.Generator().manual_seed(1)
    lens = [1, 4096, 1, 63, 65, 1000] + torch.randint(256, 4096, (18,), generator=g).tolist()
    lens += [65536 - sum(lens)]
    return [("T1000_fp16_no_h0_L2", 2, 1000, 16, 32, 128, 128, FP16, None, 2, 0.02, False),
            ("fp32_T1000_L3", 1, 1000, 4, 4, 128, 128, FP32, None, 3, 0.02, True),
            ("T65536_auto", 1, 65536, 16, 32, 128, 128, BF, None, 0, 1.0, True),
            ("T65536_auto_weak_decay", 1, 65536, 16, 32, 128, 128, BF, None, 0, 0.02, True),
            ("varlen_T65536_L16", 1, 65536, 16, 32, 128, 128, BF, lens, 16, 0.02, True)]


def run_gate_case(case, dev):
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, random_cu_seqlens, rel_rms
    name, B, T, H, HV, K, V, dtype, lens, chunks, gfac, h0 = case
    cu = random_cu_seqlens(lens, dev) if lens else None
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=dev, num_states=len(lens) if lens else None,
                        initial_state=h0)
    x["g"] = x["g"] * gfac
    _set_split(True, chunks)
    try:
        with torch.no_grad(), poisoned_allocations():
            o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend="triton")
        _sync(dev)
    finally:
        _set_split(False)
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        ro, rh = chunk_reference(**x64, output_final_state=True, cu_seqlens=cu)
    eo, eh = rel_rms(o, ro), rel_rms(ht, rh)
    tol = TOL[dtype]
    return dict(case=name, B=B, T=T, dtype=str(dtype), seg_chunks=chunks or "auto", g_factor=gfac,
                err_o=eo, err_state=eh, tol=tol, passed=bool(eo <= tol and eh <= tol))


def _state_inputs(B, T, dev, H=16, HV=32, K=128, V=128, gfac=1.0):
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=BF, device=dev)
    x["g"] = x["g"] * gfac
    _set_split(False)
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"],
                                         True, None, compute_output=False)
    return x, res


def _plain_runner(x, res, out):
    import triton
    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2
    k, plan = x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)

    def run():
        chunk_state_fwd_kernel[(triton.cdiv(V, cfg.BV_state), plan.N * HV)](
            k, res.w, res.u, res.gcum, out[0], out[1], x["initial_state"], out[2], plan.cu, plan.chunk_offsets,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state, USE_H0=True, STORE_HT=True,
            DOT_PREC="tf32", num_warps=cfg.warps_state, num_stages=cfg.stages)
    return run


def sweep_configs():
    """Split-pass launch configs worth comparing (all compile without spills for sm_90a, K=V=128 bf16)."""
    from dataclasses import replace

    from linattn.ops.gated_delta_rule.triton.chunk_state_split import split_configs
    base = split_configs(128, 128)
    return {"bv32_w4_s1": replace(base, BV=32, BV_M=32, BV_JOIN=32, per_sm=2),     # R/out 3 per SM, M 2
            "bv32_w4_s2": replace(base, BV=32, BV_M=32, BV_JOIN=32, stages=2, per_sm=2),   # pipelined loads
            "bv64_w8_pipelined": replace(base, warps=8, stages=2, warps_m=8, stages_m=3, per_sm=1),
            "fused_phase1": replace(base, fused_phase1=True)}       # R and M in one launch: w, k read once


def _split_runner(x, res, out, seg_chunks=None, cfg=None):
    from linattn.ops.gated_delta_rule.triton.chunk_state_split import chunk_state_split, make_segment_plan
    k, plan = x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    kw = dict(H=H, HV=HV, K=K, V=V, dot_prec="tf32")
    sp = chunk_state_split(k, res.w, res.u, res.gcum, out[0], out[1], x["initial_state"], out[2], plan,
                           seg_chunks=seg_chunks, cfg=cfg, **kw)           # builds the segment plan once

    def run():
        chunk_state_split(k, res.w, res.u, res.gcum, out[0], out[1], x["initial_state"], out[2], plan,
                          seg_plan=sp, cfg=cfg, **kw)
    return run, sp


def split_vs_plain(dev, smoke):
    B, T = (1, 700) if smoke else (1, 65536)
    H, HV, K, V = (2, 4, 32, 32) if smoke else (16, 32, 128, 128)
    out = {}
    for gfac in (1.0, 0.02):
        x, res = _state_inputs(B, T, dev, H, HV, K, V, gfac)
        bufs = {n: (torch.empty_like(res.h), torch.empty_like(res.vnew), torch.empty_like(res.final_state))
                for n in ("plain", "split")}
        _plain_runner(x, res, bufs["plain"])()
        _, sp = _split_runner(x, res, bufs["split"], 2 if smoke else None)
        _sync(dev)
        used = int(res.plan.chunk_offsets[-1])
        out[f"g_factor_{gfac}"] = dict(
            segments=int(sp.seg_offsets[-1]), seg_chunks=sp.seg_chunks,
            h=_rel(bufs["split"][0][:used], bufs["plain"][0][:used]),
            vnew=_rel(bufs["split"][1], bufs["plain"][1]), final=_rel(bufs["split"][2], bufs["plain"][2]))
    return out


def sync_free_check():
    import linattn
    from linattn.testing import make_gdn_inputs, random_cu_seqlens
    lens = [1, 500, 63, 1, 3000]
    cu = random_cu_seqlens(lens, "cuda")
    x = make_gdn_inputs(1, sum(lens), 16, 32, 128, 128, dtype=BF, device="cuda", num_states=len(lens))
    _set_split(True, 8)
    try:
        with torch.no_grad():
            linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend="triton")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, backend="triton")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        return "passed"
    except Exception as e:  # noqa: BLE001
        return "FAILED: " + repr(e)[:300]
    finally:
        _set_split(False)


# ---------------------------------------------------------------- timing

def timing_row(B, T, dev, smoke, sweep=False):
    import linattn
    H, HV, K, V = (2, 4, 32, 32) if smoke else (16, 32, 128, 128)
    x, res = _state_inputs(B, T, dev, H, HV, K, V)
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V)
    mk = lambda: (torch.empty_like(res.h), torch.empty_like(res.vnew), torch.empty_like(res.final_state))  # noqa
    plain_out = mk()
    plain = _plain_runner(x, res, plain_out)
    row["plain_ms"] = _ms(plain, dev)
    if dev == "cuda":
        row["plain_graph_ms"] = graph_ms(plain)
    split_out = mk()
    run, sp = _split_runner(x, res, split_out, 2 if smoke else None)
    auto_L = sp.seg_chunks
    row["split"] = []
    for L in ((auto_L,) if smoke else (auto_L, max(1, auto_L // 2), auto_L * 2)):
        r, sp = (run, sp) if L == auto_L else _split_runner(x, res, split_out, L)
        _sync(dev)
        used = int(res.plan.chunk_offsets[-1])
        ent = dict(seg_chunks=L, segments=int(sp.seg_offsets[-1]), ms=_ms(r, dev),
                   final_vs_plain=_rel(split_out[2], plain_out[2]), h_vs_plain=_rel(split_out[0][:used],
                                                                                   plain_out[0][:used]))
        if dev == "cuda":
            ent["graph_ms"] = graph_ms(r)
        row["split"].append(ent)
    if sweep:
        for name, cfg in sweep_configs().items():
            try:
                r, sp = _split_runner(x, res, split_out, 2 if smoke else None, cfg)   # the config's own plan
                _sync(dev)
                ent = dict(config=name, seg_chunks=sp.seg_chunks, segments=int(sp.seg_offsets[-1]), ms=_ms(r, dev),
                           final_vs_plain=_rel(split_out[2], plain_out[2]))
                if dev == "cuda":
                    ent["graph_ms"] = graph_ms(r)
            except Exception as e:  # noqa: BLE001
                ent = dict(config=name, error=repr(e)[:300])
            row["split"].append(ent)
    best = min(e.get("graph_ms", e["ms"]) for e in row["split"] if "ms" in e)
    row["state_speedup_best"] = row.get("plain_graph_ms", row["plain_ms"]) / best
    for on in (False, True):
        _set_split(on)
        try:
            def call():
                return linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
            with torch.no_grad():
                key = "fwd_split" if on else "fwd_plain"
                row[f"{key}_ms"] = _ms(call, dev)
                if dev == "cuda":
                    row[f"{key}_graph_ms"] = graph_ms(call)
        finally:
            _set_split(False)
    return row


def table(res):
    lines = ["gate: " + ("ALL PASSED" if res.get("gate_passed") else "NOT PASSED")]
    for c in res.get("gate", []):
        lines.append(f"  {c.get('case')}: o {c.get('err_o', float('nan')):.2e} state "
                     f"{c.get('err_state', float('nan')):.2e} tol {c.get('tol')} {'ok' if c.get('passed') else 'FAIL'}"
                     if "error" not in c else f"  {c['case']}: ERROR {c['error'][:200]}")
    for r in res.get("timing", []):
        if "error" in r:
            lines.append(f"  B{r['B']} T{r['T']}: ERROR {r['error'][:200]}")
            continue
        sp = " ".join(f"{e.get('config', '')}L{e['seg_chunks']}/{e['segments']}seg {e.get('graph_ms', e['ms']):.3f}"
                      for e in r["split"] if "ms" in e)
        lines.append(f"  B{r['B']} T{r['T']}: plain {r.get('plain_graph_ms', r['plain_ms']):.3f} ms | split {sp} | "
                     f"x{r['state_speedup_best']:.2f} | fwd {r.get('fwd_plain_graph_ms', r['fwd_plain_ms']):.3f} -> "
                     f"{r.get('fwd_split_graph_ms', r['fwd_split_ms']):.3f} ms")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time other split configs at B1 T65536 and B8 T4096")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU under TRITON_INTERPRET=1")
    a = ap.parse_args()
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not a.smoke:
        sys.exit("no CUDA device: use --smoke (with TRITON_INTERPRET=1) for a CPU run of the code paths")
    path = os.path.join(a.out, "split_state.json")
    res = round_result("split_state_round.py", dev, smoke=a.smoke)
    torch.manual_seed(0)
    res["gate"] = []
    for case in gate_cases(a.smoke):
        try:
            res["gate"].append(run_gate_case(case, dev))
        except Exception:  # noqa: BLE001
            res["gate"].append(dict(case=case[0], passed=False, error=traceback.format_exc()[-1500:]))
        _write(path, res)
    try:
        res["split_vs_plain_state"] = split_vs_plain(dev, a.smoke)
    except Exception:  # noqa: BLE001
        res["split_vs_plain_state"] = dict(error=traceback.format_exc()[-1500:])
    if dev == "cuda":
        res["sync_free"] = sync_free_check()
    res["gate_passed"] = bool(all(c.get("passed") for c in res["gate"])
                              and res.get("sync_free", "passed") == "passed")
    res["gate_s"] = time.time() - t0
    _write(path, res)
    if res["gate_passed"] and not a.no_timing:
        res["timing"] = []
        for B, T in (((1, 300), (2, 200)) if a.smoke else TIMING_SHAPES):
            if time.time() - t0 > a.budget - 20:
                res["timing"].append(dict(B=B, T=T, error="skipped: budget"))
                continue
            try:
                res["timing"].append(timing_row(B, T, dev, a.smoke, a.sweep and (T == 65536 or B == 8 or a.smoke)))
            except Exception:  # noqa: BLE001
                res["timing"].append(dict(B=B, T=T, error=traceback.format_exc()[-1500:]))
            _write(path, res)
    res["total_s"] = time.time() - t0
    _write(path, res)
    print(table(res))
    print(f"results: {path} ({res['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
