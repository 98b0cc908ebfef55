"""GPU round for the two-kernel stage 2 of the Triton GDN forward (triton/intra_split.py, LINATTN_GDN_SPLIT_INTRA=1):
`python benchmarks/gpu/split_intra_round.py --out DIR` (< 120 s on an H200).

1. gate: the forward gate's case matrix (gdn_fwd_gate.cases(): T in {1, 63, 64, 65, 8192, 65536}, B=8, GVA, fp16
   without initial state, varlen at T=65536 with 1-token sequences, small varlen fp32, K/V in {64, 60/100, 100/60,
   256, 16/32}, mixed dtypes, in-kernel L2 norm) through the public op with the switch on, NaN-poisoned buffers,
   against the fp64 chunk reference (relative RMS, TOL per dtype); per case whether the split stage was taken (it
   always is with the switch on) and the distance of o from the one-kernel forward on the same inputs. No new case
   starts after --gate-budget seconds (skipped ones are listed; only a failed case stops the timing). Then
   gdn_fwd_gate's sync-free checks (sync debug mode "error", CUDA-graph capture of a varlen call) with the switch on.
2. only if the gate is green, timing by CUDA-graph replay (median) at the production rows B1 T8192/32768/65536,
   B8 T4096, B4 T16384 (H16 HV32 K=V=128 bf16, initial and final state): stage 2 alone as the forward launches it
   (intra_chunk_wy_kernel) vs the split launcher (kkt_solve + wu, Tinv through a bf16 buffer), each of the two split
   kernels alone, and the split launcher with the backward's fp32 Tinv (store_tinv); w and u of the split checked
   against the one-kernel stage's; then the whole forward with the switch off and on.
`--dry-run`: the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes (host-clock times, no graphs).
Writes DIR/split_intra.json after every case and row (a timeout keeps what was measured) and prints a table.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                       # common, switch_round, gdn_fwd_gate
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))     # linattn from this checkout
import torch  # noqa: E402
import switch_round  # noqa: E402
from switch_round import BF, FP32, Switch, forward_ms, gate_case, ms, sync  # noqa: E402

SPLIT = Switch(env="LINATTN_GDN_SPLIT_INTRA", attr="intra_split", name="split", off="one_kernel")


# ---------------------------------------------------------------- gate

def run_gate_case(case, dev):
    r = gate_case(case, dev, SPLIT)
    r["passed"] = bool(r["passed"] and r["split_taken"] == 1)     # with the switch on the split is always taken
    return r


# ---------------------------------------------------------------- timing

def timing_row(B, T, dev, dry):
    from linattn.ops.gated_delta_rule.triton import intra_split as sm
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs
    from linattn.ops.gated_delta_rule.triton.intra_chunk import intra_chunk_wy_kernel
    from linattn.testing import make_gdn_inputs, rel_rms
    H, HV, K, V = (1, 2, 64, 64) if dry else (16, 32, 128, 128)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=BF, device=dev)
    k, v, g, beta = x["k"], x["v"], x["g"], x["beta"]
    plan = make_chunk_plan(B, T, None, CHUNK, dev)
    Tt, slots, N = plan.T_total, plan.num_slots, plan.N
    cfg = _configs(K, V, N, HV, dev)
    scfg = sm.split_intra_config(K, V)
    row = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, split_cfg=vars(scfg))

    def bufs():
        return (torch.empty(Tt, HV, device=dev), torch.empty(Tt, HV, K, dtype=BF, device=dev),
                torch.empty(Tt, HV, V, dtype=BF, device=dev))
    g1, w1, u1 = bufs()

    def one_kernel():                          # stage 2 as forward.py launches it by default
        intra_chunk_wy_kernel[(slots, HV)](
            k, v, g, beta, g1, w1, u1, g1, plan.cu, plan.chunk_indices, N, H=H, HV=HV, K=K, V=V, BT=CHUNK,
            BK=cfg.BK_intra, BV=cfg.BV_intra, STORE_TINV=False, DOT_PREC="tf32", num_warps=cfg.warps_intra)
    g2, w2, u2 = bufs()
    tinv16 = torch.empty(Tt, HV, CHUNK, dtype=BF, device=dev)
    tinv32 = torch.empty(Tt, HV, CHUNK, dtype=FP32, device=dev)

    def kkt(tinv):
        sm.kkt_solve_kernel[(slots, HV)](k, g, beta, g2, tinv, plan.cu, plan.chunk_indices, N, H=H, HV=HV, K=K,
                                         BT=CHUNK, BK=scfg.BK_kkt, DOT_PREC="tf32", num_warps=scfg.warps_kkt)

    def wu(tinv):
        sm.wu_kernel[(slots, HV)](k, v, beta, g2, tinv, w2, u2, plan.cu, plan.chunk_indices, N, H=H, HV=HV, K=K,
                                  V=V, BT=CHUNK, BK=scfg.BK, BV=scfg.BV, DOT_PREC="tf32", num_warps=scfg.warps_wu)

    def split():                               # the launcher as the forward calls it (bf16 Tinv buffer inside)
        sm.intra_split(k, v, g, beta, g2, w2, u2, None, plan, H=H, HV=HV, K=K, V=V, dot_prec="tf32")
    one_kernel()
    for t in (g2, w2, u2):
        t.fill_(float("nan"))
    split()
    sync(dev)
    row["w_vs_one_kernel"], row["u_vs_one_kernel"] = rel_rms(w2, w1), rel_rms(u2, u1)
    row["gcum_vs_one_kernel"] = rel_rms(g2, g1)
    row["stage2_one_kernel_ms"] = ms(one_kernel, dev)
    row["stage2_split_ms"] = ms(split, dev)
    row["kkt_solve_ms"] = ms(lambda: kkt(tinv16), dev)
    row["wu_ms"] = ms(lambda: wu(tinv16), dev)
    row["kkt_solve_f32_ms"] = ms(lambda: kkt(tinv32), dev)
    row["wu_f32_ms"] = ms(lambda: wu(tinv32), dev)
    row["stage2_speedup"] = row["stage2_one_kernel_ms"] / row["stage2_split_ms"]
    del tinv16, tinv32
    forward_ms(row, x, dev, SPLIT, "fwd_one_kernel_ms", "fwd_split_ms")
    row["fwd_speedup"] = row["fwd_one_kernel_ms"] / row["fwd_split_ms"]
    return row


def table_row(r):
    """A timing row that ran (switch_round.row_line prints the ones with an error)."""
    return (f"  B{r['B']} T{r['T']}: stage 2 one kernel {r['stage2_one_kernel_ms']:.3f} ms | split "
            f"{r['stage2_split_ms']:.3f} (kkt_solve {r['kkt_solve_ms']:.3f} + wu {r['wu_ms']:.3f}; fp32 Tinv "
            f"{r['kkt_solve_f32_ms']:.3f} + {r['wu_f32_ms']:.3f}) x{r['stage2_speedup']:.2f} | w/u vs one kernel "
            f"{r['w_vs_one_kernel']:.1e}/{r['u_vs_one_kernel']:.1e} | fwd {r['fwd_one_kernel_ms']:.3f} -> "
            f"{r['fwd_split_ms']:.3f} ms (x{r['fwd_speedup']:.2f})")


def main():
    switch_round.main("split_intra_round.py", "split_intra.json", SPLIT, run_gate_case, timing_row, table_row,
                      budget=115.0, gate_budget=60.0, margin=20)


if __name__ == "__main__":
    main()
