"""AOT view of stage 4 of the Triton GDN forward (triton/chunk_output.py) over launch configs, for
benchmarks/OUTPUT_STAGE.md: registers, spills, shared memory, WGMMA (HGMMA) vs mma.sync (HMMA) and cp.async (LDGSTS)
counts on sm_90a at H16/HV32 K=V=128 bf16, and the CTAs per SM that registers and shared memory allow.

`python -m linattn.ops.gated_delta_rule.aot_output [--json]` prints the whole sweep (about 2 s per config).
`register_candidates()` registers the GPU round's candidates (chunk_output.OUTPUT_CANDIDATES) with linattn.runtime.aot
under gdn_fwd_triton_output_<config name>, so that `linattn inspect` sees them once gated_delta_rule/aot.py calls it.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from linattn.runtime.aot import AotKernel, register

H, HV, K, V, BT = 16, 32, 128, 128, 64
_X, _F, _I64, _I32 = "*bf16", "*fp32", "*i64", "*i32"
SIG = dict(q_ptr=_X, k_ptr=_X, vnew_ptr=_X, h_ptr=_X, gcum_ptr=_F, o_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32,
           chunk_off_ptr=_I64, N="i32", scale="fp32")
DIV16 = tuple(n for n, t in SIG.items() if t.startswith("*"))
# sm_90: 64 K 32-bit registers and 228 KB of shared memory per SM (227 KB usable by one CTA, 1 KB reserved per
# CTA), at most 32 CTAs and 64 warps; registers are allocated per warp in units of 256 (8 per thread).
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED, MAX_WARPS = 65536, 233472, 1024, 64


def spec(cfg) -> AotKernel:
    """An AotKernel for stage 4 at the launch config cfg (chunk_output.OutputConfig)."""
    def build():
        from linattn.ops.gated_delta_rule.triton import chunk_output as m
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=cfg.BK or K, BV=cfg.BV, DOT_PREC="tf32")
        if cfg.kernel == "one":
            fn = m.chunk_output_kernel
        else:
            fn = m.chunk_output_loop_kernel
            const.update(GROUP_HEADS=cfg.group_heads, VN_FIRST=cfg.vn_first)
        return fn, {**SIG, **{n: "constexpr" for n in const}}, const, {"num_warps": cfg.warps,
                                                                      "num_stages": cfg.stages}
    return AotKernel(f"gdn_fwd_triton_output_{cfg.name}", build, ("HGMMA",), archs=("sm_90a",), language="triton",
                     div16=DIV16, description=f"GDN forward stage 4 ({cfg.kernel} kernel), Triton, H16/HV32 K=V=128 "
                                              f"bf16, BK={cfg.BK or K} BV={cfg.BV}, {cfg.warps} warps, "
                                              f"{cfg.stages} stages" + (", heads grouped" if cfg.group_heads else ""))


def occupancy(regs: int, smem: int, warps: int) -> dict:
    """CTAs per SM allowed by registers, by shared memory and by warps, and the resulting occupancy."""
    regs_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_warp * warps)
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED) if smem else 32
    by_warps = MAX_WARPS // warps
    ctas = min(by_regs, by_smem, by_warps, 32)
    return dict(ctas_regs=by_regs, ctas_smem=by_smem, ctas=ctas, warps_per_sm=ctas * warps,
                occupancy=ctas * warps / MAX_WARPS)


def sweep_configs():
    """The configs of the OUTPUT_STAGE.md table: the one-block kernel over BV x warps x stages, then the K loop."""
    from linattn.ops.gated_delta_rule.triton.chunk_output import OUTPUT_CANDIDATES, OutputConfig
    out = [OutputConfig("one", 0, bv, w, s) for bv in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)]
    out += [OutputConfig("loop", bk, bv, w, s, vn_first=vf)
            for bk, bv, w in ((64, 64, 4), (64, 64, 8), (64, 128, 8), (64, 32, 4), (32, 64, 4), (128, 128, 8))
            for s in (2, 3) for vf in (False, True)]
    return out + [c for c in OUTPUT_CANDIDATES if c not in out]


def _aot_report(cfg):
    """runtime.aot's report of spec(cfg); compiled in a child process under TRITON_INTERPRET=1 (the reason is in
    runtime/aot.py _inspect_in_subprocess; the child finds the config by name here, not in the registry)."""
    from linattn.runtime import aot
    if not aot._interpreting():
        return aot._inspect_here(spec(cfg), "sm_90a")
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "linattn.ops.gated_delta_rule.aot_output", "--report", cfg.name],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT compile of {cfg.name} failed:\n{proc.stderr[-4000:]}")
    return aot.AotReport(**json.loads(proc.stdout.strip().splitlines()[-1]))


def report(cfg) -> dict:
    r = _aot_report(cfg)
    return dict(config=cfg.name, regs=r.regs, spill_bytes=r.spill_bytes, smem=r.smem, warps=r.num_warps,
                hgmma=r.families["HGMMA"], hmma=r.families["HMMA"], ldgsts=r.families["LDGSTS"],
                local=r.families["LDL"] + r.families["STL"], **occupancy(r.regs, r.smem, r.num_warps))


def register_candidates():
    from linattn.ops.gated_delta_rule.triton.chunk_output import OUTPUT_CANDIDATES
    for c in OUTPUT_CANDIDATES:
        register(spec(c))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--candidates", action="store_true", help="only the GPU round's candidates")
    ap.add_argument("--report", metavar="CONFIG", help="print the AotReport of one config (by name) as JSON")
    a = ap.parse_args(argv)
    from linattn.ops.gated_delta_rule.triton.chunk_output import OUTPUT_CANDIDATES
    if a.report:
        from linattn.runtime.aot import _inspect_here
        cfg = {c.name: c for c in sweep_configs()}[a.report]
        print(json.dumps(asdict(_inspect_here(spec(cfg), "sm_90a"))))
        return None
    rows = []
    print("| config | regs | spills | smem KB | HGMMA | HMMA | LDGSTS | CTAs/SM regs | smem | occupancy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cfg in (OUTPUT_CANDIDATES if a.candidates else sweep_configs()):
        try:
            r = report(cfg)
        except Exception as e:  # noqa: BLE001
            r = dict(config=cfg.name, error=repr(e)[:300])
            print(f"| {cfg.name} | ERROR {r['error'][:120]} |", flush=True)
        else:
            print(f"| {r['config']} | {r['regs']} | {r['spill_bytes']} | {r['smem'] / 1024:.0f} | {r['hgmma']} | "
                  f"{r['hmma']} | {r['ldgsts']} | {r['ctas_regs']} | {r['ctas_smem']} | "
                  f"{r['occupancy'] * 100:.1f}% ({r['ctas']} x {r['warps']} warps) |", flush=True)
        rows.append(r)
    if a.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
