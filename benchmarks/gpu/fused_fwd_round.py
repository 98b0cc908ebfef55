"""GPU round for the fused state pass + output of the Triton GDN forward (triton/chunk_fused_fwd.py,
LINATTN_GDN_FUSED_FWD=1): `python benchmarks/gpu/fused_fwd_round.py --out DIR` (< 150 s on an H200).

1. gate: the forward gate's case matrix (gdn_fwd_gate.cases(): T in {1, 63, 64, 65, 8192, 65536}, B=8, GVA, fp16
   without initial state, varlen at T=65536 with 1-token sequences, small varlen fp32, K/V in {64, 60/100, 100/60,
   256, 16/32}, mixed dtypes, in-kernel L2 norm) through the public op with the switch on, NaN-poisoned buffers,
   against the fp64 chunk reference (relative RMS, TOL per dtype); per case also whether the fused kernel was
   taken (the forward takes it for 16-bit inputs with K <= 128 on a GPU: chunk_fused_fwd.fused_fwd_wanted) and
   its distance from the unfused forward on the same inputs. No new case starts after --gate-budget seconds (the
   skipped ones are listed; only a failed case stops the timing). Then gdn_fwd_gate's sync-free checks (sync debug
   mode "error", CUDA-graph capture of a varlen call replayed on new data) with the switch on.
2. only if the gate is green, timing by CUDA-graph replay (median) at the production rows B1 T8192/32768/65536,
   B8 T4096, B4 T16384 (H16 HV32 K=V=128 bf16, initial and final state): the whole forward unfused vs fused;
   stages 3+4 alone (chunk_state_fwd_kernel + chunk_output_kernel as forward.py launches them) vs the fused
   launcher at its default config and at BV in {32, 64} x warps in {4, 8} without pipelining, plus BV=32, 4 warps,
   num_stages=2 (each config's o and final state checked against the unfused ones; BV=64 and the pipelined config
   spill on sm_90a: the AOT table in benchmarks/FUSED_FWD.md).
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (host-clock times, no graphs).
Writes DIR/fused_fwd.json after every case and row (a timeout keeps what was measured) and prints a table.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                       # common, switch_round, gdn_fwd_gate
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))     # linattn from this checkout
import torch  # noqa: E402
import switch_round  # noqa: E402
from switch_round import BF, Switch, forward_ms, gate_case, ms, sync  # noqa: E402

# (BV, warps, stages): the BV x warps grid without pipelining, and BV=32/4 warps pipelined (56 bytes of spills)
SWEEP = [(32, 4, 1), (32, 8, 1), (64, 4, 1), (64, 8, 1), (32, 4, 2)]
FUSED = Switch(env="LINATTN_GDN_FUSED_FWD", attr="chunk_fused_fwd", name="fused", off="unfused")


# ---------------------------------------------------------------- gate

def run_gate_case(case, dev):
    # the forward takes the fused kernel only for some shapes (fused_fwd_wanted): where the switch left a shape
    # unfused, the switch-on run is the unfused forward and is not run twice
    return gate_case(case, dev, FUSED, reuse_when_untaken=True)


# ---------------------------------------------------------------- timing

def _stage_inputs(B, T, dev, H, HV, K, V):
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=BF, device=dev)
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"],
                                         True, None, compute_output=False)
    return x, res


def _unfused_runner(x, res, o, final):
    """Stages 3 and 4 exactly as forward.py launches them by default (h and vnew written and read back)."""
    import triton
    from linattn.ops.gated_delta_rule.triton.chunk_output import chunk_output_kernel
    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2
    q, k, plan = x["q"], x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)
    h, vnew = torch.empty_like(res.h), torch.empty_like(res.vnew)

    def run():
        chunk_state_fwd_kernel[(triton.cdiv(V, cfg.BV_state), plan.N * HV)](
            k, res.w, res.u, res.gcum, h, vnew, x["initial_state"], final, plan.cu, plan.chunk_offsets,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state, USE_H0=True, STORE_HT=True,
            DOT_PREC="tf32", num_warps=cfg.warps_state, num_stages=cfg.stages)
        chunk_output_kernel[(triton.cdiv(V, cfg.BV_out), plan.num_slots, HV)](
            q, k, vnew, h, res.gcum, o, plan.cu, plan.chunk_indices, plan.chunk_offsets, plan.N, K ** -0.5,
            H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_out, DOT_PREC="tf32",
            num_warps=cfg.warps_out, num_stages=cfg.stages)
    return run, dict(BV_state=cfg.BV_state, warps_state=cfg.warps_state, BV_out=cfg.BV_out)


def _fused_runner(x, res, o, final, cfg=None):
    from linattn.ops.gated_delta_rule.triton.chunk_fused_fwd import chunk_fused_fwd, fused_config
    q, k, plan = x["q"], x["k"], res.plan
    H, K = k.shape[2], k.shape[3]
    HV, V = res.u.shape[1], res.u.shape[2]
    cfg = cfg or fused_config(K, V, plan.N, HV, k.device)

    def run():
        chunk_fused_fwd(q, k, res.w, res.u, res.gcum, o, x["initial_state"], final, plan, K ** -0.5,
                        H=H, HV=HV, K=K, V=V, dot_prec="tf32", cfg=cfg)
    return run, cfg


def timing_row(B, T, dev, dry):
    from linattn.ops.gated_delta_rule.triton.chunk_fused_fwd import FusedConfig
    from linattn.testing import rel_rms
    H, HV, K, V = (1, 2, 64, 64) if dry else (16, 32, 128, 128)
    x, res = _stage_inputs(B, T, dev, H, HV, K, V)
    N = res.plan.N
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V)
    o_ref, f_ref = torch.empty_like(x["v"]), torch.empty(N, HV, K, V, device=dev)
    run, ucfg = _unfused_runner(x, res, o_ref, f_ref)
    run()
    sync(dev)
    row["unfused_cfg"] = ucfg
    row["stages34_unfused_ms"] = ms(run, dev)
    o, f = torch.empty_like(o_ref), torch.empty_like(f_ref)
    row["fused"] = []
    default = _fused_runner(x, res, o, f)[1]
    for cfg in [default] + [FusedConfig(BV=bv, warps=w, stages=st) for bv, w, st in SWEEP]:
        ent = dict(BV=cfg.BV, warps=cfg.warps, stages=cfg.stages, default=cfg == default and not row["fused"])
        try:
            o.fill_(float("nan"))
            f.fill_(float("nan"))
            r = _fused_runner(x, res, o, f, cfg)[0]
            r()
            sync(dev)
            ent["o_vs_unfused"], ent["state_vs_unfused"] = rel_rms(o, o_ref), rel_rms(f, f_ref)
            ent["ms"] = ms(r, dev)
        except Exception as e:  # noqa: BLE001
            ent["error"] = repr(e)[:300]
        row["fused"].append(ent)
    best = min((e for e in row["fused"] if "ms" in e), key=lambda e: e["ms"], default=None)
    if best is not None:
        row["stages34_speedup_default"] = row["stages34_unfused_ms"] / row["fused"][0].get("ms", float("nan"))
        row["stages34_speedup_best"] = row["stages34_unfused_ms"] / best["ms"]
        row["best"] = dict(BV=best["BV"], warps=best["warps"], stages=best["stages"])
    forward_ms(row, x, dev, FUSED, "fwd_unfused_ms", "fwd_fused_ms")
    row["fwd_speedup"] = row["fwd_unfused_ms"] / row["fwd_fused_ms"]
    return row


def table_row(r):
    """A timing row that ran (switch_round.row_line prints the ones with an error)."""
    fz = " ".join(f"bv{e['BV']}w{e['warps']}s{e['stages']}{'*' if e.get('default') else ''} {e['ms']:.3f}"
                  for e in r["fused"] if "ms" in e)
    return (f"  B{r['B']} T{r['T']}: stages 3+4 unfused {r['stages34_unfused_ms']:.3f} ms | fused {fz} | "
            f"x{r.get('stages34_speedup_best', float('nan')):.2f} | fwd {r['fwd_unfused_ms']:.3f} -> "
            f"{r['fwd_fused_ms']:.3f} ms (x{r['fwd_speedup']:.2f})")


def main():
    switch_round.main("fused_fwd_round.py", "fused_fwd.json", FUSED, run_gate_case, timing_row, table_row,
                      budget=140.0, gate_budget=85.0, margin=25)


if __name__ == "__main__":
    main()
