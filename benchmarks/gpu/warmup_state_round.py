"""GPU round for the segment-parallel state pass with gate-truncated warm-ups (triton/chunk_state_warmup.py,
LINATTN_GDN_SEGMENT_WARMUP=1; benchmarks/SEGMENT_WARMUP.md).

    python benchmarks/gpu/warmup_state_round.py --out DIR [--budget 140] [--no-timing]
    TRITON_INTERPRET=1 python benchmarks/gpu/warmup_state_round.py --out DIR --dry-run   # CPU: tiny shapes, code paths

1. gate (switch on, use_qk_l2norm_in_kernel=True, NaN-poisoned buffers, fp64 chunk reference, relative RMS, TOL
   per dtype), each case also against the plain forward (switch off) on the same inputs, with the warm-up window
   lengths the kernel finds (computed on the host from g, for the record): B1 T65536 H16/HV32 K=V=128 bf16 with
   make_gdn_inputs' default gates (g = 4 logsigmoid(N(0,1) + 4): mean ~-0.12 per token, ~-7.4 per chunk, so
   windows of ~3 chunks), strong decay (g ~ -0.5 per token: 1 chunk), weak decay (g ~ -1e-4 per token: every
   window reaches the sequence start, the pass is exact), H2/HV8 default gates, and fp32 T8192 H4/HV8 K=V=64 with
   forced 8-chunk segments; plus stage-3 outputs (h, vnew, final) warm-up vs plain at T65536, and a sync-free check
   (torch.cuda.set_sync_debug_mode("error")) of the forward with the switch on.
2. only if the gate is green: stage 3 alone, plain kernel vs the warm-up launcher on identical stage-2 outputs
   (CUDA-graph replay median, ms), at B1 T8192/T32768/T65536 H16/HV32 and B1 T65536 H2/HV8, default gates: the
   automatic segment count and its neighbours, the 1-stage launch (3 programs per SM) at its own count, and at
   T65536 H16/HV32 the weak-decay worst case (last segment walks the whole sequence).
Writes DIR/warmup_state.json after every step (a timeout keeps what was measured) and prints a table.
"""
import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                       # common
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))     # linattn from this checkout
import torch  # noqa: E402
from common import graph_ms, median_ms, round_result, write_json  # noqa: E402
from linattn.testing import rel_rms  # noqa: E402

BF, FP32 = torch.bfloat16, torch.float32
TIMING = ((1, 8192, 16, 32), (1, 32768, 16, 32), (1, 65536, 16, 32), (1, 65536, 2, 8))


def _set(on, keys_normalised=False):
    os.environ["LINATTN_GDN_SEGMENT_WARMUP"] = "1" if on else "0"
    os.environ["LINATTN_GDN_KEYS_NORMALISED"] = "1" if keys_normalised else "0"


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _gates(x, kind, gen):
    if kind == "strong":
        x["g"] = -0.5 * (torch.rand(x["g"].shape, generator=gen) + 0.5).to(x["g"].device, x["g"].dtype)
    elif kind == "weak":
        x["g"] = -1e-4 * (torch.rand(x["g"].shape, generator=gen) + 0.5).to(x["g"].device, x["g"].dtype)
    return x                                                 # "default": make_gdn_inputs' gates


def window_stats(g, S, L, thresh):
    """Warm-up window lengths (chunks) the kernel finds for segments 1..S-1 of sequence 0, every head: the same walk
    (whole chunks back from the segment start until the summed chunk decay is <= -thresh or chunk 0)."""
    g = g[0].double().cpu()                                 # [T, HV]
    T, HV = g.shape
    n = T // 64
    dec = g[:n * 64].reshape(n, 64, HV).sum(1)               # [n, HV]
    lens, to_start = [], 0
    for s in range(1, S):
        c0 = min(s * L, n)
        back = dec[:c0].flip(0).cumsum(0)                   # back[j]: decay of the window of j + 1 chunks
        for hv in range(HV):
            hit = torch.nonzero(back[:, hv] <= -thresh)
            w = int(hit[0]) + 1 if len(hit) else c0
            lens.append(w)
            to_start += int(w == c0)
    if not lens:
        return dict(mean=0.0, max=0, reach_start=0, windows=0)
    return dict(mean=sum(lens) / len(lens), max=max(lens), reach_start=to_start, windows=len(lens),
                chunk_decay_mean=float(dec.mean()))


def gate_cases(dry):
    # (name, B, T, H, HV, K, V, dtype, gates, forced segment chunks or None, initial state)
    if dry:
        return [("dry_default", 1, 64 * 12, 1, 2, 32, 32, BF, "default", None, True),
                ("dry_strong_fp32", 1, 64 * 12 + 7, 1, 2, 32, 32, FP32, "strong", None, True),
                ("dry_weak", 2, 64 * 10, 1, 2, 32, 32, FP32, "weak", None, False)]
    return [("T65536_default_gates", 1, 65536, 16, 32, 128, 128, BF, "default", None, True),
            ("T65536_strong_decay", 1, 65536, 16, 32, 128, 128, BF, "strong", None, True),
            ("T65536_weak_decay", 1, 65536, 16, 32, 128, 128, BF, "weak", None, True),
            ("T65536_H2_HV8_default_gates", 1, 65536, 2, 8, 128, 128, BF, "default", None, True),
            ("fp32_T8192_H4_HV8_K64_L8", 1, 8192, 4, 8, 64, 64, FP32, "default", 8, False)]


def run_gate_case(case, dev):
    import linattn
    from linattn.ops.gated_delta_rule.reference import chunk_reference
    from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as cwm
    from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, make_gdn_inputs, rel_rms
    name, B, T, H, HV, K, V, dtype, gates, forced, h0 = case
    gen = torch.Generator().manual_seed(7)
    x = _gates(make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, device=dev, initial_state=h0, generator=gen),
               gates, gen)
    launched = []
    orig = fwd_mod.chunk_state_warmup

    def spy(*a, **kw):
        if forced:
            kw["seg_chunks"] = forced
        launched.append(orig(*a, **kw))
        return launched[-1]
    fwd_mod.chunk_state_warmup = spy
    try:
        out = {}
        for on in (True, False):
            _set(on)
            with torch.no_grad(), poisoned_allocations():
                out[on] = linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton",
                                                         use_qk_l2norm_in_kernel=True)
            _sync(dev)
    finally:
        fwd_mod.chunk_state_warmup = orig
        _set(False)
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    with torch.no_grad():
        ro, rh = chunk_reference(**x64, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (o, ht), (po, pht) = out[True], out[False]
    eo, eh = rel_rms(o, ro), rel_rms(ht, rh)
    tol = TOL[dtype]
    S, L = launched[0] if launched else (1, None)
    return dict(case=name, B=B, T=T, H=H, HV=HV, dtype=str(dtype), gates=gates, segments=S, seg_chunks=L,
                taken=bool(launched), err_o=eo, err_state=eh, plain_err_o=rel_rms(po, ro),
                plain_err_state=rel_rms(pht, rh), vs_plain_o=rel_rms(o, po), vs_plain_state=rel_rms(ht, pht),
                windows=window_stats(x["g"], S, L or 1, cwm.THRESH), tol=tol,
                passed=bool(launched and eo <= tol and eh <= tol))


def _stage2(B, T, H, HV, K, V, dev, gates="default"):
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(3)
    x = _gates(make_gdn_inputs(B, T, H, HV, K, V, dtype=BF, device=dev, generator=gen), gates, gen)
    _set(False)
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"],
                                         True, None, compute_output=False)
    return x, res


def _bufs(res):
    return (torch.empty_like(res.h), torch.empty_like(res.vnew), torch.empty_like(res.final_state))


def _plain_runner(x, res, out):
    import triton
    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2
    k, plan = x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)
    dp = "ieee" if k.dtype == FP32 else "tf32"

    def run():
        chunk_state_fwd_kernel[(triton.cdiv(V, cfg.BV_state), plan.N * HV)](
            k, res.w, res.u, res.gcum, out[0], out[1], x["initial_state"], out[2], plan.cu, plan.chunk_offsets,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state, USE_H0=True, STORE_HT=True,
            DOT_PREC=dp, num_warps=cfg.warps_state, num_stages=cfg.stages)
    return run


def _warm_runner(x, res, out, num_segments=None, stages=2, BV=32, warps=4):
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import chunk_state_warmup
    k, plan = x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    kw = dict(H=H, HV=HV, K=K, V=V, dot_prec="ieee" if k.dtype == FP32 else "tf32", BV=BV, num_warps=warps,
              num_stages=stages, num_segments=num_segments)

    def run():
        return chunk_state_warmup(k, res.w, res.u, res.gcum, out[0], out[1], x["initial_state"], out[2], plan, **kw)
    return run


def stage3_vs_plain(dev, dry):
    B, T, H, HV, K, V = (1, 64 * 12, 1, 2, 32, 32) if dry else (1, 65536, 16, 32, 128, 128)
    out = {}
    for gates in ("default", "weak"):
        x, res = _stage2(B, T, H, HV, K, V, dev, gates)
        p, w = _bufs(res), _bufs(res)
        _plain_runner(x, res, p)()
        S, L = _warm_runner(x, res, w)()
        _sync(dev)
        used = int(res.plan.chunk_offsets[-1])
        out[gates] = dict(segments=S, seg_chunks=L, h=rel_rms(w[0][:used], p[0][:used]), vnew=rel_rms(w[1], p[1]),
                          final=rel_rms(w[2], p[2]))
    return out


def sync_free_check():
    import linattn
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(1, 8192, 16, 32, 128, 128, dtype=BF, device="cuda")
    _set(True)
    try:
        with torch.no_grad():
            linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton", use_qk_l2norm_in_kernel=True)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton",
                                               use_qk_l2norm_in_kernel=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        return "passed"
    except Exception as e:  # noqa: BLE001
        return "FAILED: " + repr(e)[:300]
    finally:
        _set(False)


def _time(fn, dev):
    return graph_ms(fn) if dev == "cuda" else median_ms(fn, warmup=1, repeats=1)


def timing_row(B, T, H, HV, dev, dry):
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import plan_warmup
    K = V = 32 if dry else 128
    x, res = _stage2(B, T, H, HV, K, V, dev)
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V)
    p = _bufs(res)
    plain = _plain_runner(x, res, p)
    row["plain_ms"] = _time(plain, dev)
    w = _bufs(res)
    S_auto, L_auto = plan_warmup(res.plan, HV, V, 32, x["k"].device)
    S3, _ = plan_warmup(res.plan, HV, V, 32, x["k"].device, per_sm=3)
    row["auto"] = dict(segments=S_auto, seg_chunks=L_auto)
    variants = [("s2", S_auto, 2)] + [("s2", S, 2) for S in sorted({max(2, S_auto - 1), S_auto + 1, 2 * S_auto})
                                      if S != S_auto]
    variants += [("s1", S3, 1)]
    row["warmup"] = []
    used = int(res.plan.chunk_offsets[-1])
    for cfg, S, stages in variants:
        run = _warm_runner(x, res, w, num_segments=S, stages=stages)
        got = run()
        _sync(dev)
        row["warmup"].append(dict(config=cfg, segments=got[0], seg_chunks=got[1], ms=_time(run, dev),
                                  final_vs_plain=rel_rms(w[2], p[2]), h_vs_plain=rel_rms(w[0][:used], p[0][:used])))
    best = min(e["ms"] for e in row["warmup"])
    row["speedup_auto"] = row["plain_ms"] / row["warmup"][0]["ms"]
    row["speedup_best"] = row["plain_ms"] / best
    if T == max(t for _, t, _, _ in (TIMING_DRY if dry else TIMING)) and HV == (2 if dry else 32):
        xw, resw = _stage2(B, T, H, HV, K, V, dev, "weak")          # worst case: windows reach the start
        ww = _bufs(resw)
        run = _warm_runner(xw, resw, ww)
        run()
        row["weak_decay_warmup_ms"] = _time(run, dev)
        row["weak_decay_plain_ms"] = _time(_plain_runner(xw, resw, _bufs(resw)), dev)
    return row


TIMING_DRY = ((1, 64 * 12, 1, 2), (1, 64 * 12, 1, 1))


def table(res):
    lines = ["gate: " + ("ALL PASSED" if res.get("gate_passed") else "NOT PASSED")]
    for c in res.get("gate", []):
        if "error" in c:
            lines.append(f"  {c['case']}: ERROR {c['error'][:300]}")
            continue
        wn = c.get("windows", {})
        lines.append(f"  {c['case']}: S={c['segments']} L={c['seg_chunks']} o {c['err_o']:.2e} (plain "
                     f"{c['plain_err_o']:.2e}) state {c['err_state']:.2e} (plain {c['plain_err_state']:.2e}) "
                     f"vs plain o {c['vs_plain_o']:.1e} state {c['vs_plain_state']:.1e} | window mean "
                     f"{wn.get('mean', 0):.1f} max {wn.get('max', 0)} chunks | {'ok' if c['passed'] else 'FAIL'}")
    for r in res.get("timing", []):
        if "error" in r:
            lines.append(f"  B{r['B']} T{r['T']}: ERROR {r['error'][:300]}")
            continue
        ws = " ".join(f"{e['config']}/S{e['segments']} {e['ms']:.3f}" for e in r["warmup"])
        extra = (f" | weak decay: warm-up {r['weak_decay_warmup_ms']:.3f} vs plain {r['weak_decay_plain_ms']:.3f}"
                 if "weak_decay_warmup_ms" in r else "")
        lines.append(f"  B{r['B']} T{r['T']} H{r['H']}/HV{r['HV']}: plain {r['plain_ms']:.3f} ms | warm-up {ws} | "
                     f"auto x{r['speedup_auto']:.2f} best x{r['speedup_best']:.2f}{extra}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=140.0)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    a = ap.parse_args()
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not a.dry_run:
        sys.exit("no CUDA device: use --dry-run (with TRITON_INTERPRET=1) for a CPU run of the code paths")
    if a.dry_run:
        from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as cwm
        cwm.MIN_SEG_CHUNKS = 2                               # several segments at the tiny shapes
    path = os.path.join(a.out, "warmup_state.json")
    res = round_result("warmup_state_round.py", dev, dry_run=a.dry_run)
    res["gate"] = []
    for case in gate_cases(a.dry_run):
        try:
            res["gate"].append(run_gate_case(case, dev))
        except Exception:  # noqa: BLE001
            res["gate"].append(dict(case=case[0], passed=False, error=traceback.format_exc()[-1500:]))
        write_json(path, res)
    try:
        res["stage3_vs_plain"] = sv = stage3_vs_plain(dev, a.dry_run)
        sv_ok = sv["weak"]["h"] == 0 or sv["weak"]["h"] <= 1e-6
    except Exception:  # noqa: BLE001
        res["stage3_vs_plain"] = dict(error=traceback.format_exc()[-1500:])
        sv_ok = False
    if dev == "cuda":
        res["sync_free"] = sync_free_check()
    res["gate_passed"] = bool(all(c.get("passed") for c in res["gate"]) and sv_ok
                              and res.get("sync_free", "passed") == "passed")
    res["gate_s"] = time.time() - t0
    write_json(path, res)
    if res["gate_passed"] and not a.no_timing:
        res["timing"] = []
        for B, T, H, HV in (TIMING_DRY if a.dry_run else TIMING):
            if time.time() - t0 > a.budget - 15:
                res["timing"].append(dict(B=B, T=T, H=H, HV=HV, error="skipped: budget"))
                continue
            try:
                res["timing"].append(timing_row(B, T, H, HV, dev, a.dry_run))
            except Exception:  # noqa: BLE001
                res["timing"].append(dict(B=B, T=T, H=H, HV=HV, error=traceback.format_exc()[-1500:]))
            write_json(path, res)
    res["total_s"] = time.time() - t0
    write_json(path, res)
    print(table(res))
    print(f"results: {path} ({res['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
