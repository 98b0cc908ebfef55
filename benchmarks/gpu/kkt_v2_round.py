"""GPU round for stage 2a v2 (round 16's default; triton/intra_split.py kkt_solve_v2_kernel: kkt_solve_kernel's grid,
gcum and A, Tinv by block substitution on [4, 16, 16] batched tensors instead of four [64, 64] fp32 products) against
kkt_solve_kernel (v1): `python benchmarks/gpu/kkt_v2_round.py --out DIR [--budget 110] [--dry-run]`.

Per row (H16 HV32 K=V=128 bf16 on the GPU: B1 T8192, B1 T65536, B8 T4096, and the 24-sequence varlen row of
linattn.bench.presets.PRODUCTION_VARLEN):
1. both kernels launched into NaN-filled gcum and Tinv buffers (Tinv in bf16, the forward, and fp32, the backward's
   store_tinv): gcum torch.equal, every value finite; the Tinv error of both against torch.linalg.inv(I + A) with A
   built in float64 from the same k, g, beta, on a sample of (chunk, value head) pairs: relative RMS error
   (Frobenius) per pair, worst and mean; tinv_ok when v2's worst is <= 1.5 x kkt_solve_kernel's worst + a floor.
2. timing (median of CUDA-event repeats, eager launches, bf16 and fp32 Tinv) of both kernels and their ratio; the
   registers, spills and shared memory of both compiled kernels as the driver reports them.
Then the whole Triton forward with v2 launched in place of kkt_solve_kernel, and without, against the fp64
recurrent reference at one shape (B1 T2048 H4/HV8 K=V=128 bf16): relative RMS error of o and the final state, and
assert_close at linattn.testing.TOL.
A row that raises is recorded with its error; the next row still runs. No new row starts after --budget seconds.
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (H1 HV2, 2-3 chunks; host-clock
times, no claims). Writes DIR/kkt_v2.json after every row and prints a table.
The row and forward logic take the variants to run as an argument (VARIANTS: name -> kernel in intra_split.py, each
selected in the forward by LINATTN_GDN_KKT=name): kkt_v3_round.py runs it with v2 and v3 on the same rows.
"""
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)                                       # common
sys.path.insert(1, ROOT)                                       # linattn from this checkout
import torch  # noqa: E402
from common import median_ms, run_rows, start_round, write_json  # noqa: E402

# (B, T) or (1, "varlen")
ROWS = ((1, 8192), (1, 65536), (8, 4096), (1, "varlen"))
DRY_ROWS = ((1, 130), (2, 65), (1, "varlen"))
DRY_VARLEN = [1, 63, 1, 65, 70]
SAMPLE = 256                                                   # (chunk, value head) pairs checked against fp64
FLOOR = {torch.bfloat16: 1e-5, torch.float32: 1e-9}            # as tests/test_kkt_solve_v2.py (793452d)
START = time.time()
# LINATTN_GDN_KKT value -> intra_split kernel, or (kernel, extra constexpr arguments) for a form without a switch
VARIANTS = {"v2": "kkt_solve_v2_kernel", "v3": "kkt_solve_v3_kernel", "v4": "kkt_solve_v4_kernel",
            "v4o": ("kkt_solve_v4_kernel", {"LOWP_DIAG": False}), "v4h": ("kkt_solve_v4_kernel", {"HEADS_FAST": True}),
            "v4e": ("kkt_solve_v4_kernel", {"EARLY_K": True}),
            "v4eh": ("kkt_solve_v4_kernel", {"EARLY_K": True, "HEADS_FAST": True}),
            # round 21: v4eh compiles to 77 registers (6 CTAs per SM), v4e to 72 (7); ptxas capped at 72, 0 spill
            "v4ehr": ("kkt_solve_v4_kernel", {"EARLY_K": True, "HEADS_FAST": True, "maxnreg": 72})}
# bound on a variant's worst Tinv error: BOUND x kkt_solve_kernel's worst + FLOOR (1.5 unless named). v4 / v4o round
# the inverse's product operands to bf16 on purpose where Tinv is stored in bf16 (its consumers multiply it at bf16);
# under the interpreter their bf16 Tinv error is ~1.46x v3's, so they get 2.0 here, written before their first GPU
# run; their fp32 Tinv (the backward's) is v3's computation
BOUND = {"v4": 2.0, "v4o": 2.0, "v4h": 2.0, "v4e": 2.0, "v4eh": 2.0, "v4ehr": 2.0}


def shapes(dry):
    return (1, 2, 128) if dry else (16, 32, 128)          # H, HV, K (= V)


def _launch(kernel, k, g, beta, gcum, tinv, plan, H, HV, K, prec, per_key_head=False, extra=None):
    """One stage-2a launch at the frozen config on (chunk slots, HV), or (chunk slots, H) with per_key_head (the GVA
    variant); returns the compiled kernel (for its registers)."""
    from linattn.ops.gated_delta_rule.triton.intra_split import CHUNK, split_intra_config
    cfg = split_intra_config(K, K)
    return kernel[(plan.num_slots, H if per_key_head else HV)](
        k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N,
        H=H, HV=HV, K=K, BT=CHUNK, BK=cfg.BK_kkt, DOT_PREC=prec, num_warps=cfg.warps_kkt, **(extra or {}))


def launch_ref(*a):
    """kkt_solve_kernel as the forward and gluon/chunk_fused_wu_ws.py kkt_solve launch it (frozen config)."""
    from linattn.ops.gated_delta_rule.triton.intra_split import kkt_solve_kernel
    return _launch(kkt_solve_kernel, *a)


def launcher(variant):
    """The variant's kernel (VARIANTS) as intra_split.kkt_solve_v2 / kkt_solve_v3 launch it (the launch returns the
    compiled kernel, for its registers)."""
    def launch(*a):
        from linattn.ops.gated_delta_rule.triton import intra_split
        name, extra = (VARIANTS[variant], None) if isinstance(VARIANTS[variant], str) else VARIANTS[variant]
        return _launch(getattr(intra_split, name), *a, extra=extra)
    return launch


launch_v2 = launcher("v2")


def kernel_facts(compiled):
    """Registers / spills / shared memory of a compiled launch (None under the interpreter)."""
    if compiled is None or not hasattr(compiled, "n_regs"):
        return None
    return dict(regs=int(compiled.n_regs), spills=int(compiled.n_spills), smem=int(compiled.metadata.shared))


def chunk_list(B, T, cu):
    bounds = cu.tolist() if cu is not None else [b * T for b in range(B + 1)]
    return [(s + c, min(64, e - s - c)) for s, e in zip(bounds[:-1], bounds[1:]) for c in range(0, e - s, 64)]


def tinv_errors(tinvs, k, g, beta, pairs, H, HV):
    """Relative RMS error (Frobenius) of each Tinv in `tinvs` against inv(I + A) in float64, per (chunk, head) pair."""
    errs = {n: [] for n in tinvs}
    kf = k.reshape(-1, H, k.shape[-1])
    g2, b2 = g.reshape(-1, HV), beta.reshape(-1, HV)
    for (bos, n), hv in pairs:
        kc = kf[bos:bos + n, hv // (HV // H)].double()
        gam = g2[bos:bos + n, hv].double().cumsum(0)
        a = torch.tril(b2[bos:bos + n, hv].double()[:, None] * (kc @ kc.T)
                       * torch.exp(torch.tril(gam[:, None] - gam[None, :], -1)), -1)
        ref = torch.zeros(n, 64, dtype=torch.float64, device=k.device)
        ref[:, :n] = torch.linalg.inv(torch.eye(n, dtype=torch.float64, device=k.device) + a)
        for name, t in tinvs.items():
            errs[name].append(float((t[bos:bos + n, hv].double() - ref).norm() / ref.norm()))
    return {n: dict(max=max(e), mean=sum(e) / len(e)) for n, e in errs.items()}


def row_inputs(B, T, dev, dry):
    """One row's stage-2a inputs (bf16, seeded by the row): (k, g, beta, cu, T, plan, row) with T the total tokens
    and row the record's shape fields. T == "varlen": PRODUCTION_VARLEN's lengths (DRY_VARLEN in a dry run)."""
    from linattn.bench.presets import PRODUCTION_VARLEN
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.testing import make_gdn_inputs
    H, HV, K = shapes(dry)
    cu, N = None, B
    if T == "varlen":
        lens = DRY_VARLEN if dry else PRODUCTION_VARLEN["lengths"]
        T, N = sum(lens), len(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64, device=dev)
    gen = torch.Generator().manual_seed(1000 + B * 7 + T)
    x = make_gdn_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16, device=dev, num_states=N, initial_state=False,
                        generator=gen)
    plan = make_chunk_plan(B, T, cu, 64, dev)
    row = dict(B=B, T=T, N=N, H=H, HV=HV, K=K, varlen=cu is not None, slots=plan.num_slots)
    return x["k"], x["g"], x["beta"], cu, T, plan, row


def run_row(B, T, dev, dry, variants=("v2",)):
    """One row: kkt_solve_kernel ("ref") and each of `variants`; tinv_ok when every variant's worst error is within
    the bound; speedup_* is ref / the last variant, and with several variants the last one's ratio to each other is
    recorded too (e.g. v2_over_v3_ms_bf16) with whether their Tinv are bit-equal (tinv_equal_v2_v3_bf16)."""
    H, HV, K = shapes(dry)
    k, g, beta, cu, T, plan, row = row_inputs(B, T, dev, dry)
    Tt = plan.T_total
    chunks = chunk_list(B, T, cu)
    pick = torch.Generator().manual_seed(7)
    n_pairs = min(SAMPLE, len(chunks) * HV)
    idx = torch.randperm(len(chunks) * HV, generator=pick)[:n_pairs].tolist()
    pairs = [(chunks[j // HV], j % HV) for j in idx]
    row["sampled_pairs"] = n_pairs
    gcum_equal, tinv_ok = True, True
    for tname, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        bufs = {}
        for which, launch in (("ref", launch_ref),) + tuple((v, launcher(v)) for v in variants):
            gcum = torch.full((Tt, HV), float("nan"), dtype=torch.float32, device=dev)
            tinv = torch.full((Tt, HV, 64), float("nan"), dtype=tdt, device=dev)
            facts = kernel_facts(launch(k, g, beta, gcum, tinv, plan, H, HV, K, "tf32"))
            bufs[which] = (gcum, tinv)
            if facts is not None:
                row[f"{which}_kernel_{tname}"] = facts
        if dev == "cuda":
            torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t).all()) for pair in bufs.values() for t in pair)
        eq = all(bool(torch.equal(bufs[v][0], bufs["ref"][0])) for v in variants)
        err = tinv_errors({w: bufs[w][1] for w in bufs}, k, g, beta, pairs, H, HV)
        ok = finite and all(err[v]["max"] <= BOUND.get(v, 1.5) * err["ref"]["max"] + FLOOR[tdt] for v in variants)
        for v in variants[:-1]:
            row[f"tinv_equal_{v}_{variants[-1]}_{tname}"] = bool(torch.equal(bufs[v][1], bufs[variants[-1]][1]))
        row[f"finite_{tname}"], row[f"gcum_equal_{tname}"] = finite, eq
        row[f"tinv_err_{tname}"], row[f"tinv_ok_{tname}"] = err, ok
        gcum_equal, tinv_ok = gcum_equal and eq, tinv_ok and ok
        del bufs
    row["gcum_equal"], row["tinv_ok"] = gcum_equal, tinv_ok

    # timing: the same buffers for every call of one kernel (no NaN fills inside the timed calls)
    warm, reps = (1, 1) if dry else (5, 20)
    rounds = int(os.environ.get("KKT_TIMING_ROUNDS", "1"))   # > 1: the kernels timed in turn that often, median kept
    for tname, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        gcum = torch.empty(Tt, HV, dtype=torch.float32, device=dev)
        tinv = torch.empty(Tt, HV, 64, dtype=tdt, device=dev)
        runs = {}
        for _ in range(rounds):
            for which, launch in (("ref", launch_ref),) + tuple((v, launcher(v)) for v in variants):
                runs.setdefault(which, []).append(median_ms(
                    lambda: launch(k, g, beta, gcum, tinv, plan, H, HV, K, "tf32"), warmup=warm, repeats=reps))
        for which, ms in runs.items():
            row[f"{which}_ms_{tname}"] = sorted(ms)[len(ms) // 2]
            if rounds > 1:
                row[f"{which}_ms_{tname}_runs"] = ms
        row[f"speedup_{tname}"] = row[f"ref_ms_{tname}"] / row[f"{variants[-1]}_ms_{tname}"]
        for v in variants[:-1]:
            row[f"{v}_over_{variants[-1]}_ms_{tname}"] = row[f"{v}_ms_{tname}"] / row[f"{variants[-1]}_ms_{tname}"]
        del gcum, tinv
    for which in ("ref",) + tuple(variants):
        row[f"{which}_ms"] = row[f"{which}_ms_bf16"]
    return row


def forward_check(dev, dry, variant="v2"):
    """The whole Triton forward with LINATTN_GDN_KKT=variant and with v1 ("ref") against the fp64 recurrent
    reference; the variant's kernel must launch exactly once, in its pass."""
    import linattn
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.ops.gated_delta_rule.triton import intra_split as sm
    from linattn.testing import TOL, assert_close, make_gdn_inputs
    B, T, H, HV, K = (1, 130, 1, 2, 64) if dry else (1, 2048, 4, 8, 128)
    x = make_gdn_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16, device=dev,
                        generator=torch.Generator().manual_seed(5))
    x64 = {n: (v.detach().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for n, v in x.items()}
    ref_o, ref_ht = naive_recurrent(**x64, output_final_state=True)
    out = dict(B=B, T=T, H=H, HV=HV, K=K)
    name = VARIANTS[variant]
    if not isinstance(name, str):        # a form without a LINATTN_GDN_KKT value (e.g. v4h): nothing to switch
        return dict(out, ok=True, skipped=f"{variant} has no LINATTN_GDN_KKT value")
    real, calls = getattr(sm, name), []

    class Spy:                           # counts the variant kernel's launches (each grid), launches the real one
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]
    os.environ["LINATTN_GDN_SPLIT_INTRA"] = "1"
    ok = True
    for which in ("ref", variant):
        os.environ["LINATTN_GDN_KKT"] = which if which == variant else "v1"  # the switch picks the kernel
        setattr(sm, name, Spy())
        try:
            with torch.no_grad():
                o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="triton")
        finally:
            setattr(sm, name, real)
            os.environ.pop("LINATTN_GDN_KKT")
        e_o = float((o.double() - ref_o).norm() / ref_o.norm())
        e_h = float((ht.double() - ref_ht).norm() / ref_ht.norm())
        try:
            assert_close("o", o, ref_o, TOL[torch.bfloat16])
            assert_close("final_state", ht, ref_ht, TOL[torch.bfloat16])
            close = True
        except AssertionError as e:
            close, out[f"{which}_assert"] = False, str(e)[:400]
        out[which] = dict(o_rel_rms=e_o, state_rel_rms=e_h, within_tol=close)
        ok = ok and close
    out[f"{variant}_launched"] = len(calls) == 1        # once, in the variant's pass only
    out["ok"] = ok and out[f"{variant}_launched"]
    return out


def line(r, variants=("v2",)):
    if "error" in r:
        return f"  B{r['B']} T{r['T']}: ERROR {r['error'][:200]}"
    e = r["tinv_err_fp32"]
    last = variants[-1]
    return (f"  B{r['B']} T{r['T']}{' varlen' if r['varlen'] else ''}: gcum equal {r['gcum_equal']}, Tinv ok "
            f"{r['tinv_ok']} (fp32 Tinv rel err max ref {e['ref']['max']:.2e} "
            + " ".join(f"{v} {e[v]['max']:.2e}" for v in variants) + ") | bf16 Tinv: "
            f"kkt_solve {r['ref_ms_bf16']:.4f} ms, " + ", ".join(f"{v} {r[f'{v}_ms_bf16']:.4f} ms" for v in variants)
            + f" (ref/{last} x{r['speedup_bf16']:.2f}) | fp32 Tinv: {r['ref_ms_fp32']:.4f} -> "
            + " -> ".join(f"{r[f'{v}_ms_fp32']:.4f}" for v in variants) + f" ms (x{r['speedup_fp32']:.2f})"
            + (f" | regs {r['ref_kernel_bf16']['regs']} -> "
               + " -> ".join(str(r[f'{v}_kernel_bf16']['regs']) for v in variants)
               + f", spills {r[f'{last}_kernel_bf16']['spills']}, smem {r['ref_kernel_bf16']['smem']} -> "
               f"{r[f'{last}_kernel_bf16']['smem']}" if f"{last}_kernel_bf16" in r else ""))


def main(variants=("v2",), script="kkt_v2_round.py", json_name="kkt_v2.json"):
    """The round for `variants` against kkt_solve_kernel; the forward check runs the last variant. Returns (res, path,
    dry, dev) for a caller that adds sections."""
    args, dry, dev, path, res = start_round(script, json_name)
    res["variants"] = list(variants)
    run_rows(res, path, DRY_ROWS if dry else ROWS, lambda B, T: run_row(B, T, dev, dry, variants),
             lambda r: line(r, variants), args.budget, START)
    try:
        res["forward"] = forward_check(dev, dry, variants[-1])
    except Exception as e:  # noqa: BLE001
        res["forward"] = dict(ok=False, error=f"{e!r}"[:600], trace=traceback.format_exc()[-2000:])
    print(f"  forward vs fp64: {res['forward']}", flush=True)
    rows = res["rows"]
    res["all_ok"] = bool(rows) and all(r.get("gcum_equal") is True and r.get("tinv_ok") is True for r in rows)
    res["passed"] = res["all_ok"] and res["forward"].get("ok") is True and not res["skipped"]
    write_json(path, res)
    print(f"{json_name[:-5]}: all ok {res['all_ok']}, forward ok {res['forward'].get('ok')}, skipped {res['skipped']}, "
          f"{time.time() - START:.0f} s")
    return res, path, dry, dev


if __name__ == "__main__":
    main()
