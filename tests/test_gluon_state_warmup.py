"""The segment warm-up scheme on the Gluon TMA state pass (gluon/chunk_state_warmup_tma.py; opt-in
LINATTN_GDN_SEGMENT_WARMUP=1 on the gluon backend; benchmarks/GLUON_WARMUP.md) on a CPU host:
  - AOT: every registered config compiles for sm_90a without spills, with the plain ring's instructions (HGMMA or HMMA,
    3 TMA loads per issue, one TMA store, one mbarrier per slot), and the registers / shared memory that the segment
    count's residency is computed from (AOT_USAGE) are the compiled ones;
  - the residency, config and segment plan at the production shapes (pure functions);
  - the launcher's arguments mangle to the AOT signature; grid (V/BV, S*N*HV), N, L and thresh (launch stubbed);
  - a torch model of the kernel's per-program arithmetic (window walk in fp32 from c0, h0 only when cw == 0, h / vnew
    stored only for the program's own chunks, each exactly once, final only from the last chunk's segment, empty
    segments exit, the ring indexed from the window start) against the Triton warm-up kernel under TRITON_INTERPRET=1:
    bf16 at several fixed lengths (T a multiple of 64 or not, B 1 and 2, with and without h0), fp32 with truncation
    that matters (small thresholds: the windows must be the Triton kernel's), and the exact case (weak decay: every
    window reaches the start; model and kernels equal their plain passes bit for bit);
  - the switch: off by default; its conditions; through the gluon backend's op and the api (keys_normalised from
    use_qk_l2norm_in_kernel), with the Gluon launch replaced by a stand-in that runs the Triton warm-up kernel on the
    launcher's own arguments;
  - the GPU round's --dry-run.
The Gluon kernel itself has not run here (no GPU): benchmarks/gpu/gluon_warmup_round.py gates it on an H200.
Run only what this file covers: `python -m pytest tests/test_gluon_state_warmup.py`."""
import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMEM_LIMIT_SM90 = 232448
_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()
NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_fwd_gluon_state_warmup_"))
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
BT = 64


def _round_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))
    import gluon_warmup_round
    return gluon_warmup_round


# ---------------------------------------------------------------- AOT

def test_registered_configs_cover_the_launcher_and_the_usage_table():
    from linattn.ops.gated_delta_rule.aot import GLUON_WARMUP_CONFIGS, gluon_warmup_kernel_name
    from linattn.ops.gated_delta_rule.gluon.chunk_state_warmup_tma import AOT_USAGE, warmup_config
    assert {gluon_warmup_kernel_name(*c) for c in GLUON_WARMUP_CONFIGS} == set(NAMES)
    assert {(v, bv, s) for v, _, bv, _, s in GLUON_WARMUP_CONFIGS} == set(AOT_USAGE)
    for N, HV in ((1, 32), (1, 8), (8, 32)):              # the launcher's configs at the round's shapes
        cfg = warmup_config("wgmma", N, HV, 128, 132)
        assert gluon_warmup_kernel_name("wgmma", "bf16", cfg.BV, cfg.num_warps, cfg.stages) in NAMES


@needs_gluon
@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_spill_with_the_ring_instructions(name):
    from linattn.ops.gated_delta_rule.gluon.chunk_state_warmup_tma import AOT_USAGE
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, rep.sass
    assert 0 < rep.smem <= SMEM_LIMIT_SM90 and rep.num_warps == 4
    variant = name.split("_warmup_")[1].split("_")[0]
    bv = int(name.split("_bv")[1].split("_")[0])
    stages = int(name.rsplit("_s", 1)[1])
    assert (rep.regs, rep.smem) == AOT_USAGE[(variant, bv, stages)], (rep.regs, rep.smem)
    if variant == "wgmma":       # product 1: 64 x BV x 128 (8 k-steps); product 2: 128 x BV x 64 (2 M-halves x 4)
        assert rep.sass.get(f"HGMMA.64x{bv}x16.F32.BF16", 0) == 16, rep.sass
    else:                        # the plain "tma" kernel's mma.sync count
        assert rep.sass.get("HMMA.16816.F32.BF16", 0) == 2 * bv, rep.sass
    assert rep.sass.get("UTMALDG.2D", 0) == 3 * stages, rep.sass    # w, k, u: STAGES-1 prologue issues + 1 in the loop
    assert rep.sass.get("UTMASTG.2D", 0) == 1, rep.sass             # h[chunk], under the own-chunk branch
    assert rep.sass.get("SYNCS.EXCH.64", 0) == stages, rep.sass     # one mbarrier per ring slot
    assert rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 1


# ---------------------------------------------------------------- residency, config, segment plan (pure)

def test_residency_config_and_segment_plan():
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    # registers x 128 threads and shared memory (+1 KB per CTA) against 64K registers / 228 KB per SM
    assert gw.resident_per_sm(108, 98320) == 2            # smem-bound: 2 x 99344 <= 233472 < 3 x 99344
    assert gw.resident_per_sm(167, 114704) == 2
    assert gw.resident_per_sm(114, 61448) == 3
    assert gw.resident_per_sm(112, 135192) == 1           # the plain pass's 3-stage ring: 1 per SM
    assert gw.resident_per_sm(255, 1000) == 2             # register-bound: 256 x 128 = 32768 per CTA
    assert gw.warmup_config("wgmma", 1, 32, 128, 132) == gw.warmup_config("tma", 1, 32, 128, 132)
    cfg = gw.warmup_config("wgmma", 1, 32, 128, 132)
    assert (cfg.BV, cfg.num_warps, cfg.stages) == (32, 4, 2) and gw.warmup_residency("wgmma", cfg) == 2
    with pytest.raises(ValueError):
        gw.warmup_config("literal", 1, 32, 128, 132)

    def plan(N, T, HV):
        p = SimpleNamespace(N=N, num_slots=N * (-(-T // BT)))
        c = gw.warmup_config("wgmma", N, HV, 128, 132)
        return gw.plan_gluon_warmup(p, HV, 128, "wgmma", c, "cpu"), c.BV
    # (the Triton warm-up's table, SEGMENT_WARMUP.md: the same S and L at 2 CTAs per SM)
    assert plan(1, 65536, 32) == ((2, 512), 32)
    assert plan(1, 32768, 32) == ((2, 256), 32)
    assert plan(1, 8192, 32) == ((2, 64), 32)
    assert plan(1, 65536, 8) == ((8, 128), 32)
    assert plan(8, 4096, 32) == ((1, 64), 64)             # one segment fills the GPU: the plain pass
    assert plan(1, 1984, 32) == ((1, 31), 32)             # 31 chunks: too short for two 16-chunk segments
    c1 = dataclasses.replace(cfg, stages=1)                # 3 per SM: S = 3
    assert gw.plan_gluon_warmup(SimpleNamespace(N=1, num_slots=1024), 32, 128, "wgmma", c1, "cpu") == (3, 342)


# ---------------------------------------------------------------- launcher arguments

def _plan_and_buffers(B, T, H, HV, dtype=torch.bfloat16, h0=True, ht=True):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    plan = make_chunk_plan(B, T, None, BT, "cpu")
    T_tot, slots, N = plan.T_total, plan.num_slots, plan.N
    bufs = (torch.zeros(B, T, H, 128, dtype=dtype), torch.zeros(T_tot, HV, 128, dtype=dtype),
            torch.zeros(T_tot, HV, 128, dtype=dtype), torch.zeros(T_tot, HV),
            torch.zeros(slots, HV, 128, 128, dtype=dtype), torch.zeros(T_tot, HV, 128, dtype=dtype),
            torch.zeros(N, HV, 128, 128) if h0 else None, torch.zeros(N, HV, 128, 128) if ht else None)
    return plan, bufs


@needs_gluon
@pytest.mark.parametrize("B,T,HV", [(1, 64 * 40, 32), (2, 64 * 33 + 5, 8)])
def test_launch_matches_aot_signature(B, T, HV):
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import gluon_warmup_signature
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import THRESH
    plan, bufs = _plan_and_buffers(B, T, 2 if HV == 8 else 16, HV)
    cfg = gw.warmup_config("wgmma", plan.N, HV, 128, 132)
    kernel, grid, args, kwargs = gw.warmup_launch(*bufs, plan, "wgmma", cfg, 3, 17)
    assert kernel is gw.chunk_state_warmup_tma_kernel
    sig = gluon_warmup_signature("wgmma", "bf16", cfg.BV)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (128 // cfg.BV, 3 * plan.N * HV)
    assert args[-3:] == (plan.N, 17, THRESH)
    assert kwargs == dict(H=bufs[0].shape[2], HV=HV, K=128, V=128, BT=64, BV=cfg.BV, USE_H0=True, STORE_HT=True,
                          STAGES=cfg.stages, USE_WGMMA=True, num_warps=4)
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")
    k, w, u, gcum, h, vnew, h0, ht = bufs
    assert args[3] is gcum and args[5] is vnew and args[6] is h0 and args[7] is ht
    assert args[4].base.data_ptr() == h.data_ptr() and args[4].block_shape == [128, cfg.BV]


@needs_gluon
def test_launcher_grid_and_plan_with_the_launch_stubbed(monkeypatch):
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as tw
    launches = []

    class Stub:
        arg_names = gw.chunk_state_warmup_tma_kernel.arg_names

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((grid, a, kw))
    monkeypatch.setattr(gw, "chunk_state_warmup_tma_kernel", Stub())
    plan, bufs = _plan_and_buffers(1, 64 * 40 + 3, 1, 2, h0=False)
    got = gw.chunk_state_warmup_gluon(*bufs, plan)
    # 41 chunks, 8 programs per segment (BV 32), 2 per SM on 132 "SMs", >= 16 chunks: S = 2, L = 21
    assert got == (2, 21) and launches[-1][0] == (4, 2 * 2) and launches[-1][1][-3:] == (1, 21, tw.THRESH)
    assert launches[-1][2]["USE_H0"] is False and launches[-1][2]["STAGES"] == 2
    monkeypatch.setattr(tw, "MIN_SEG_CHUNKS", 4)
    assert gw.chunk_state_warmup_gluon(*bufs, plan) == (10, 5) and launches[-1][0] == (4, 10 * 2)
    assert gw.chunk_state_warmup_gluon(*bufs, plan, seg_chunks=8) == (6, 8) and launches[-1][1][-2] == 8
    assert gw.chunk_state_warmup_gluon(*bufs, plan, num_segments=3, thresh=5.0) == (3, 14)
    assert launches[-1][1][-3:] == (1, 14, 5.0)


# ---------------------------------------------------------------- the per-program arithmetic, modelled in torch

def _emulate_warmup_tma(k, w, u, gcum, h0, plan, BV, L, thresh, plain=False):
    """What chunk_state_warmup_tma_kernel computes, program by program, in torch: the window walk (fp32 sum of the
    chunks' last-row gcum from c0 back, > -thresh, chunk 0 stops it), the start state (h0 only when cw == 0), the
    ring's chunk sequence cw .. c1 - 1 indexed from base = bos + cw * BT (whole boxes, zero past T_tot), h and vnew
    written only for j >= c0 - cw, final only when c1 >= nch; the chunk arithmetic and roundings of chunk_state_tma
    (wgmma variant). plain=True: one segment, no window (the plain kernel). Returns h, vnew, final (NaN where never
    written) and per-element write counts."""
    dt = w.dtype
    T_tot, HV, K = w.shape
    H, V = k.shape[2], u.shape[2]
    kf = k.reshape(T_tot, H, K)
    pad = lambda t: torch.cat([t, t.new_zeros(BT, *t.shape[1:])])       # noqa: E731  TMA zero-fill past T_tot
    kf, wp, up = pad(kf), pad(w), pad(u)
    h = torch.full((plan.num_slots, HV, K, V), float("nan"), dtype=dt)
    vnew = torch.full_like(u, float("nan"))
    final = torch.full((plan.N, HV, K, V), float("nan"))
    cnt = dict(h=torch.zeros(plan.num_slots, HV, V // BV, dtype=torch.int32),
               vnew=torch.zeros(T_tot, HV, V // BV, dtype=torch.int32),
               final=torch.zeros(plan.N, HV, V // BV, dtype=torch.int32))
    cu, offs = plan.cu.tolist(), plan.chunk_offsets.tolist()
    nch_max = max(-(-(cu[n + 1] - cu[n]) // BT) for n in range(plan.N))
    S = 1 if plain else -(-max(nch_max, 1) // L)
    L = max(nch_max, 1) if plain else L
    thr = torch.tensor(thresh, dtype=torch.float32)
    for seg in range(S):
        for n in range(plan.N):
            bos, eos, slot0 = cu[n], cu[n + 1], offs[n]
            nchunks = -(-max(eos - bos, 0) // BT)
            c0 = seg * L
            if c0 >= nchunks and seg > 0:
                continue
            c1 = min(c0 + L, nchunks)
            for hv in range(HV):
                hk = hv // (HV // H)
                cw, acc = c0, torch.zeros((), dtype=torch.float32)
                while cw > 0 and bool(acc > -thr):
                    cw -= 1
                    acc = acc + gcum[bos + cw * BT + BT - 1, hv]
                base, nj, jown = bos + cw * BT, c1 - cw, c0 - cw
                for vb in range(V // BV):
                    cols = slice(vb * BV, (vb + 1) * BV)
                    s = h0[n, hv, :, cols].clone() if (h0 is not None and cw == 0) else torch.zeros(K, BV)
                    for j in range(nj):
                        t0 = base + j * BT
                        own = j >= jown
                        valid = (torch.arange(BT) + t0) < eos
                        if own:
                            h[slot0 + cw + j, hv, :, cols] = s.to(dt)
                            cnt["h"][slot0 + cw + j, hv, vb] += 1
                        wb, kb, ub = wp[t0:t0 + BT, hv], kf[t0:t0 + BT, hk], up[t0:t0 + BT, hv, cols]
                        gam = torch.where(valid, pad(gcum)[t0:t0 + BT, hv], 0.)
                        g_last = gcum[t0 + min(eos - t0, BT) - 1, hv]
                        vn = ub.float() - wb.float() @ s.to(dt).float()
                        if own:
                            rows = torch.arange(t0, t0 + BT)[valid]
                            vnew[rows, hv, cols] = vn[valid].to(dt)
                            cnt["vnew"][rows, hv, vb] += 1
                        vs = torch.where(valid[:, None], vn.to(dt).float() * torch.exp(g_last - gam)[:, None],
                                         0.).to(dt)
                        s = s * torch.exp(g_last) + kb.T.float() @ vs.float()
                    if c1 >= nchunks:
                        final[n, hv, :, cols] = s
                        cnt["final"][n, hv, vb] += 1
    return h, vnew, final, cnt


def _stage2(B, T, H, HV, dtype, gates=None, h0=True, seed=0):
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, initial_state=h0, generator=gen)
    if gates is not None:                                  # g ~ gates * U(0.5, 1.5) per token
        x["g"] = (gates * (torch.rand(x["g"].shape, generator=gen) + 0.5)).to(x["g"].dtype)
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"],
                                         True, None, compute_output=False)
    return x, res


def _triton_stage3(x, res, L=None, thresh=None, BV=32):
    """The Triton warm-up kernel (L given) or the plain kernel (L None) on NaN-poisoned outputs."""
    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import chunk_state_warmup
    k, plan, h0 = x["k"], res.plan, x["initial_state"]
    H, HV = k.shape[2], res.u.shape[1]
    dp = "ieee" if k.dtype == torch.float32 else "tf32"
    out = (torch.full_like(res.h, float("nan")), torch.full_like(res.vnew, float("nan")),
           torch.full_like(res.final_state, float("nan")))
    if L is None:
        chunk_state_fwd_kernel[(128 // BV, plan.N * HV)](
            k, res.w, res.u, res.gcum, out[0], out[1], h0 if h0 is not None else res.gcum, out[2], plan.cu,
            plan.chunk_offsets, H=H, HV=HV, K=128, V=128, BT=BT, BK=128, BV=BV, USE_H0=h0 is not None,
            STORE_HT=True, DOT_PREC=dp)
    else:
        chunk_state_warmup(k, res.w, res.u, res.gcum, out[0], out[1], h0, out[2], plan, H=H, HV=HV, K=128, V=128,
                           dot_prec=dp, BV=BV, seg_chunks=L, thresh=thresh)
    return out


def _rel(a, b):
    from linattn.testing import rel_rms
    return rel_rms(a, b)


@pytest.mark.parametrize("B,T,h0", [(1, 64 * 12, True), (1, 64 * 12 + 13, False), (2, 64 * 7 + 1, True),
                                    (1, 64 * 5, True)])
def test_model_matches_triton_warmup_kernel_bf16(device, B, T, h0):
    """Default gates (windows of a few chunks), bf16, 3-chunk segments: the model of the Gluon kernel and the Triton
    warm-up kernel agree to 16-bit rounding (they differ only where the decay is applied: K rows vs Vnew rows), every
    h slot, vnew row and final state is written by exactly one program, and nothing is left NaN."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import THRESH
    x, res = _stage2(B, T, 1, 2, torch.bfloat16, h0=h0)
    L = 3
    mh, mv, mf, cnt = _emulate_warmup_tma(x["k"], res.w, res.u, res.gcum, x["initial_state"], res.plan, 32, L, THRESH)
    th, tv, tf = _triton_stage3(x, res, L, THRESH)
    assert bool((cnt["h"] == 1).all() and (cnt["vnew"] == 1).all() and (cnt["final"] == 1).all())
    for name, a, b in (("h", mh, th), ("vnew", mv, tv), ("final", mf, tf)):
        assert bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()), name
        assert _rel(a, b) < 3e-3, (name, _rel(a, b))          # one bf16 rounding apart (measured ~1e-3 or less)
    # and the model with segments equals the model's plain pass to the same rounding (windows of ~3 chunks)
    ph, pv, pf, _ = _emulate_warmup_tma(x["k"], res.w, res.u, res.gcum, x["initial_state"], res.plan, 32, L, THRESH,
                                        plain=True)
    assert _rel(mf, pf) < 3e-3 and _rel(mh, ph) < 3e-3


@pytest.mark.parametrize("thresh", [2.0, 4.0, 20.0])
def test_model_windows_are_the_triton_kernels(device, thresh):
    """fp32, g ~ -0.03 per token (-1.9 per chunk), 2-chunk segments: at small thresholds the truncation changes the
    result far beyond fp32 rounding (checked against the plain kernel), so agreement of the model with the Triton
    warm-up kernel to ~1e-6 means the same window for every program (the same walk, constant and fp32 sum)."""
    if device != "cpu":
        pytest.skip("CPU model check")
    x, res = _stage2(1, 64 * 10, 1, 2, torch.float32, gates=-0.03, seed=1)
    mh, mv, mf, cnt = _emulate_warmup_tma(x["k"], res.w, res.u, res.gcum, x["initial_state"], res.plan, 32, 2, thresh)
    th, tv, tf = _triton_stage3(x, res, 2, thresh)
    ph, pv, pf = _triton_stage3(x, res)
    for name, a, b in (("h", mh, th), ("vnew", mv, tv), ("final", mf, tf)):
        assert _rel(a, b) < 2e-5, (name, thresh, _rel(a, b))
    if thresh <= 4.0:                                       # the test can tell windows apart
        assert _rel(th, ph) > 1e-4 and _rel(mh, ph) > 1e-4, (_rel(th, ph), _rel(mh, ph))
    else:
        assert _rel(th, ph) < 2e-5


@pytest.mark.parametrize("h0", [True, False])
def test_exact_when_every_window_reaches_the_start(device, h0):
    """Weak decay (g ~ -1e-4 per token): every window walks back to chunk 0 and starts from h0, so the model with
    segments equals the model's plain pass bit for bit, and so does the Triton warm-up kernel its plain kernel."""
    if device != "cpu":
        pytest.skip("CPU model check")
    x, res = _stage2(1, 64 * 9 + 20, 1, 2, torch.bfloat16, gates=-1e-4, h0=h0, seed=2)
    from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import THRESH
    m = _emulate_warmup_tma(x["k"], res.w, res.u, res.gcum, x["initial_state"], res.plan, 32, 2, THRESH)
    p = _emulate_warmup_tma(x["k"], res.w, res.u, res.gcum, x["initial_state"], res.plan, 32, 2, THRESH, plain=True)
    for a, b in zip(m[:3], p[:3]):
        assert torch.equal(a, b)
    tw, tp = _triton_stage3(x, res, 2, THRESH), _triton_stage3(x, res)
    for a, b in zip(tw, tp):
        assert torch.equal(a, b)
    for a, b in zip(m[:3], tw):     # and model vs kernel: 16-bit roundings, accumulating without decay (3.8e-3 seen)
        assert _rel(a, b) < 1e-2


# ---------------------------------------------------------------- the switch

def test_switch_is_off_by_default(monkeypatch):
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as tw
    from linattn.runtime.settings import settings
    for var in ("LINATTN_GDN_SEGMENT_WARMUP", "LINATTN_GDN_KEYS_NORMALISED"):
        monkeypatch.delenv(var, raising=False)
    assert settings.gdn_segment_warmup is False
    plan = SimpleNamespace(N=1, num_slots=1024)
    assert not gw.gluon_warmup_wanted(None, True, plan, 32, 128, "wgmma", "cpu")
    monkeypatch.setenv("LINATTN_GDN_SEGMENT_WARMUP", "1")
    assert gw.gluon_warmup_wanted(None, True, plan, 32, 128, "wgmma", "cpu")
    assert gw.gluon_warmup_wanted(None, True, plan, 32, 128, "tma", "cpu")
    assert not gw.gluon_warmup_wanted(None, True, plan, 32, 128, "literal", "cpu")
    assert not gw.gluon_warmup_wanted(None, False, plan, 32, 128, "wgmma", "cpu")        # keys not known normalised
    assert not gw.gluon_warmup_wanted(torch.tensor([0, 65536]), True, plan, 32, 128, "wgmma", "cpu")   # varlen
    assert not gw.gluon_warmup_wanted(None, True, SimpleNamespace(N=1, num_slots=31), 32, 128, "wgmma", "cpu")
    assert not gw.gluon_warmup_wanted(None, True, SimpleNamespace(N=8, num_slots=8 * 64), 32, 128, "wgmma", "cpu")
    monkeypatch.setenv("LINATTN_GDN_KEYS_NORMALISED", "1")
    assert gw.gluon_warmup_wanted(None, False, plan, 32, 128, "wgmma", "cpu")
    monkeypatch.setattr(tw, "MIN_SEG_CHUNKS", 4)
    assert gw.gluon_warmup_wanted(None, False, SimpleNamespace(N=1, num_slots=31), 32, 128, "wgmma", "cpu")


@pytest.fixture
def stand_ins(monkeypatch):
    """The Gluon launches replaced (Gluon kernels cannot run on a CPU): the warm-up kernel object by the round's
    StandInKernel (records, then runs the Triton warm-up kernel on the launcher's own arguments), the plain pass by
    a recorder around the Triton state kernel."""
    from linattn.ops.gated_delta_rule.gluon import chunk_state_warmup_tma as gw
    from linattn.ops.gated_delta_rule.gluon import launcher
    from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as tw
    rnd = _round_module()
    warm = rnd.StandInKernel()
    plain = []
    # the fused stages 3+4 (on by default since round 14, with W and U formed inside since round 15) take
    # precedence over the warm-up pass: these tests are about the unfused forward's state pass
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WS", "0")
    monkeypatch.setenv("LINATTN_GDN_GLUON_FUSED_WU", "0")

    def plain_pass(*a, **kw):
        plain.append(1)
        rnd.plain_stand_in(*a, **kw)
    monkeypatch.setattr(gw, "chunk_state_warmup_tma_kernel", warm, raising=False)
    monkeypatch.setattr(launcher, "chunk_state_gluon", plain_pass)
    monkeypatch.setattr(tw, "MIN_SEG_CHUNKS", 2)
    monkeypatch.delenv("LINATTN_GDN_KEYS_NORMALISED", raising=False)
    return SimpleNamespace(warm=warm, plain=plain)


@needs_gluon
def test_gluon_backend_op_takes_the_warmup_pass_when_switched_on(device, monkeypatch, stand_ins):
    """backend.impl (the op linattn::chunk_gdn_fwd_gluon) with keys_normalised=True: switch off -> the plain pass
    only; on -> one warm-up launch with the grid and segment plan of the launcher, o and final within TOL of fp64 and
    of the switch-off result; keys_normalised not given -> the plain pass even with the switch on."""
    if device != "cpu":
        pytest.skip("CPU orchestration check")
    from linattn.ops.gated_delta_rule.gluon import backend
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.testing import TOL, assert_close, make_gdn_inputs
    x = make_gdn_inputs(1, 64 * 6 + 9, 1, 2, 128, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True, None)
    monkeypatch.delenv("LINATTN_GDN_SEGMENT_WARMUP", raising=False)
    with torch.no_grad():
        o_off, ht_off = backend.impl(*args, keys_normalised=True)
    assert stand_ins.warm.launches == [] and len(stand_ins.plain) == 1
    monkeypatch.setenv("LINATTN_GDN_SEGMENT_WARMUP", "1")
    with torch.no_grad():
        o_on, ht_on = backend.impl(*args, keys_normalised=True)
    assert len(stand_ins.warm.launches) == 1 and len(stand_ins.plain) == 1
    grid, largs, kw = stand_ins.warm.launches[0]
    # 7 chunks, BV 32 (4 V blocks), 2 heads, MIN_SEG_CHUNKS 2 -> S = 3, L = 3
    assert grid == (4, 3 * 2) and largs[-3:-1] == (1, 3) and kw["STAGES"] == 2 and kw["USE_H0"] is True
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    ro, rh = naive_recurrent(**x64, output_final_state=True)
    assert_close("o", o_on, ro, TOL[torch.bfloat16])
    assert_close("final", ht_on, rh, TOL[torch.bfloat16])
    assert _rel(o_on, o_off) < 3e-3 and _rel(ht_on, ht_off) < 3e-3
    with torch.no_grad():
        backend.impl(*args)                                   # keys not declared normalised
    assert len(stand_ins.warm.launches) == 1 and len(stand_ins.plain) == 2


def test_api_passes_keys_normalised_to_the_gluon_backend(monkeypatch):
    """use_qk_l2norm_in_kernel=True reaches the gluon backend's impl as keys_normalised=True (as the Triton
    backend's); without it the impl is called exactly as before (no keyword)."""
    import linattn
    from linattn.backends import op_backends
    from linattn.testing import make_gdn_inputs
    table = op_backends("chunk_gated_delta_rule")
    seen = []

    def impl(*a, **kw):
        seen.append(kw)
        return a[2].clone(), None
    monkeypatch.setitem(table.backends, "gluon", dataclasses.replace(table.backends["gluon"], impl=impl,
                                                                     supports=lambda **_: (True, "")))
    x = make_gdn_inputs(1, 16, 1, 2, 128, 128, dtype=torch.bfloat16)
    linattn.chunk_gated_delta_rule(**x, backend="gluon", use_qk_l2norm_in_kernel=True)
    linattn.chunk_gated_delta_rule(**x, backend="gluon")
    assert seen == [dict(keys_normalised=True), {}]


# ---------------------------------------------------------------- the GPU round's dry run

@needs_gluon
def test_gpu_round_dry_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LINATTN_GDN_SEGMENT_WARMUP", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_warmup_round.py"), "--out",
                           str(tmp_path), "--dry-run"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "gluon_warmup.json").read_text())
    assert out["dry_run"] and out["gate_passed"], proc.stdout[-3000:]
    assert any("STAND-IN" in s.upper() or "->" in s for s in out["stand_ins"]) and len(out["stand_ins"]) == 3
    cases = {c["case"]: c for c in out["gate"]}
    assert {"dry_default", "dry_weak_exact", "dry_strong_L2_ragged_no_h0", "forward_gluon_backend_switch"} <= set(cases)
    assert cases["dry_weak_exact"]["vs_plain_max_rel"] == 0.0 and cases["forward_gluon_backend_switch"]["launches"] == 1
    assert cases["dry_default"]["segments"] >= 2
    row = out["timing"][0]
    assert {"gluon_plain_ms", "gluon_warm", "triton_warm", "triton_plain_ms", "sweep"} <= set(row)
    assert "weak_decay" in out["extras"] and "forward_gluon_backend_ms" in out["extras"]


@needs_gluon
def test_gpu_round_reports_a_hang(tmp_path):
    """A gate case that never returns (as an mbarrier deadlock would) is reported as a timeout by the round's watched
    child (benchmarks/gpu/case_watchdog.py); the other cases, the forward case included, still run and pass."""
    env = dict(os.environ, TRITON_INTERPRET="1", WARMUP_ROUND_FAKE_HANG="dry_weak_exact",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LINATTN_GDN_SEGMENT_WARMUP", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "gluon_warmup_round.py"), "--out",
                           str(tmp_path), "--dry-run", "--case-timeout", "20"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "gluon_warmup.json").read_text())
    cases = {c["case"]: c for c in out["gate"]}
    assert list(cases) == ["dry_default", "dry_weak_exact", "dry_strong_L2_ragged_no_h0",
                           "forward_gluon_backend_switch"]
    hung = cases["dry_weak_exact"]
    assert not hung["passed"] and hung["error"].startswith("timeout") and hung["timed_out"]
    assert all(c["passed"] for n, c in cases.items() if n != "dry_weak_exact")
    assert cases["forward_gluon_backend_switch"]["launches"] == 1
    assert not out["gate_passed"] and "timing" not in out
