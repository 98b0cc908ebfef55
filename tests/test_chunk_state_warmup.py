"""Segment-parallel state pass with gate-truncated warm-ups (triton/chunk_state_warmup.py,
LINATTN_GDN_SEGMENT_WARMUP=1; benchmarks/SEGMENT_WARMUP.md).

Under TRITON_INTERPRET=1 with small shapes and segments forced short (MIN_SEG_CHUNKS patched, or seg_chunks given to
the launcher) so that many segments and warm-ups run:
  (i)   strong decay: o, final state, h, vnew equal the plain pass to fp32 rounding and the fp64 recurrence within TOL;
  (ii)  weak decay: every window reaches the sequence start, so the pass is the plain one (exact);
  (iii) truncation that matters (small thresholds): the error of every h is within the bound
        exp(window decay) * ||S(window start)||_F against the exact fp64 states; at THRESH = 20 it is invisible;
  (iv)  the switch: varlen, unnormalised keys, a state_pass hook or too short a sequence keep the plain pass;
  (v)   B=2 with GVA, with and without an initial state, T not a multiple of 64, fp32/bf16; gradients (the backward's
        recompute takes the switch too) against fp64 autograd;
plus the pure segment-count function and an ahead-of-time sm_90a build (no spills).
"""
import math

import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import chunk_reference, naive_recurrent
from linattn.ops.gated_delta_rule.triton import chunk_state_warmup as cw_mod
from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import chunk_state_warmup, warmup_segments
from linattn.ops.gated_delta_rule.triton.forward import CHUNK, chunk_gated_delta_rule_fwd
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens, rel_rms


# ---- the segment count (pure) -------------------------------------------------------------------------------------

@pytest.mark.parametrize("nch,progs,sms,per_sm,minL,want", [
    (1024, 32 * 4, 132, 2, 16, (2, 512)),      # B1 T65536 HV32 V128 BV32: 128 programs per segment, 2/SM -> 2 segs
    (1024, 8 * 4, 132, 2, 16, (8, 128)),       # B1 T65536 HV8: 32 programs per segment -> 8 segments
    (128, 32 * 4, 132, 2, 16, (2, 64)),        # B1 T8192 HV32
    (512, 32 * 4, 132, 3, 16, (3, 171)),       # 3 resident per SM (1-stage config)
    (1024, 32 * 4, 132, 9, 16, (4, 256)),      # per_sm clamped to 4
    (1024, 32 * 4, 132, 1, 16, (2, 512)),      # ... and to 2
    (31, 4, 132, 2, 16, (1, 31)),              # too short for two segments of 16 chunks: no split
    (40, 2, 132, 2, 4, (10, 4)),               # the tests' setting
    (64, 8 * 32 * 4, 132, 2, 16, (1, 64)),     # B8 HV32: one segment fills the GPU already
    (0, 4, 132, 2, 16, (1, 1)),                # empty
])
def test_warmup_segments(nch, progs, sms, per_sm, minL, want):
    S, L = warmup_segments(nch, progs, sms, per_sm, minL)
    assert (S, L) == want
    assert S * L >= nch and (S - 1) * L < max(nch, 1)         # every segment non-empty
    if S > 1:
        assert L >= minL and S * progs <= min(4, max(2, per_sm)) * sms


# ---- helpers ------------------------------------------------------------------------------------------------------

def _fp64(x):
    return {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


def _inputs(B, T, H, HV, K, V, dtype, g_per_token=None, h0=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, initial_state=h0, generator=gen)
    if g_per_token is not None:                 # g ~ g_per_token * U(0.5, 1.5)
        u = torch.rand(x["g"].shape, generator=gen) + 0.5
        x["g"] = (u * g_per_token).to(x["g"].dtype)
    return x


@pytest.fixture
def short_segments(monkeypatch):
    """Segments of >= 4 chunks (planning as for 132 SMs: at these head counts, as many segments as that allows)."""
    monkeypatch.setattr(cw_mod, "MIN_SEG_CHUNKS", 4)
    monkeypatch.setenv("LINATTN_GDN_SEGMENT_WARMUP", "1")


def _spy(monkeypatch):
    calls = []
    orig = fwd_mod.chunk_state_warmup

    def spy(*a, **kw):
        calls.append(orig(*a, **kw))
        return calls[-1]
    monkeypatch.setattr(fwd_mod, "chunk_state_warmup", spy)
    return calls


def _forward(x, l2norm=True, cu_seqlens=None):
    with torch.no_grad(), poisoned_allocations():
        return linattn.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu_seqlens, backend="triton",
                                              use_qk_l2norm_in_kernel=l2norm)


def _stage3_both(x, seg_chunks, thresh=cw_mod.THRESH):
    """Stage 3 twice on the same stage-2 outputs: the plain kernel and the warm-up launcher (NaN-poisoned outputs).
    Returns ((h, vnew, final) plain, (h, vnew, final) warm-up, fwd result, (S, L))."""
    q, k, v = x["q"], x["k"], x["v"]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    h0 = x["initial_state"]
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(q, k, v, x["g"], x["beta"], K ** -0.5, h0, True, None, compute_output=False)
    plan = res.plan
    dp = "ieee" if q.dtype == torch.float32 else "tf32"

    def bufs():
        return (torch.full_like(res.h, float("nan")), torch.full_like(res.vnew, float("nan")),
                torch.full_like(res.final_state, float("nan")))
    plain, warm = bufs(), bufs()
    BV = 32 if V >= 32 else 16
    chunk_state_fwd_kernel[(triton_cdiv(V, BV), plan.N * HV)](
        k, res.w, res.u, res.gcum, plain[0], plain[1], h0 if h0 is not None else res.gcum, plain[2],
        plan.cu, plan.chunk_offsets, H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=max(16, K), BV=BV,
        USE_H0=h0 is not None, STORE_HT=True, DOT_PREC=dp)
    SL = chunk_state_warmup(k, res.w, res.u, res.gcum, warm[0], warm[1], h0, warm[2], plan, H=H, HV=HV, K=K, V=V,
                            dot_prec=dp, BV=BV, seg_chunks=seg_chunks, thresh=thresh)
    return plain, warm, res, SL


def triton_cdiv(a, b):
    return -(-a // b)


def _chunk_decays(x):
    """[B, nch_full, HV] total log decay of each full chunk (fp64)."""
    g = x["g"].double()
    B, T, HV = g.shape
    n = T // CHUNK
    return g[:, :n * CHUNK].reshape(B, n, CHUNK, HV).sum(2)


def _window_start(dec, c0, thresh):
    """The kernel's walk: first chunk of the warm-up window before chunk c0 and the window's summed decay."""
    cw, acc = c0, 0.0
    while cw > 0 and acc > -thresh:
        cw -= 1
        acc += float(dec[cw])
    return cw, acc


def _exact_chunk_states(x):
    """fp64 states at every chunk start [B, nch, HV, K, V] by the step-by-step recurrence, and the final state."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    k = k.repeat_interleave(rep, dim=2)
    S = x["initial_state"].double().clone() if x["initial_state"] is not None else torch.zeros(B, HV, K, V,
                                                                                              dtype=torch.float64)
    states = []
    for t in range(T):
        if t % CHUNK == 0:
            states.append(S.clone())
        S = S * torch.exp(g[:, t])[:, :, None, None]
        kt = k[:, t]                                        # [B, HV, K]
        u = beta[:, t][:, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[:, :, :, None] * u[:, :, None, :]
    return torch.stack(states, 1), S


# ---- (i) strong decay, (ii) weak decay: against the plain pass and fp64 -------------------------------------------

@pytest.mark.parametrize("g_per_token,expect_exact", [(-0.5, False), (-1e-4, True)], ids=["strong", "weak"])
def test_warmup_matches_plain_and_fp64(monkeypatch, short_segments, g_per_token, expect_exact):
    B, T, H, HV, K, V = 1, 64 * 40, 1, 2, 32, 32
    x = _inputs(B, T, H, HV, K, V, torch.float32, g_per_token)
    calls = _spy(monkeypatch)
    o, ht = _forward(x)
    assert calls == [(10, 4)], calls                        # 10 segments of 4 chunks
    monkeypatch.setenv("LINATTN_GDN_SEGMENT_WARMUP", "0")
    o_p, ht_p = _forward(x)
    assert len(calls) == 1
    assert rel_rms(o, o_p) <= 1e-5 and rel_rms(ht, ht_p) <= 1e-5, (rel_rms(o, o_p), rel_rms(ht, ht_p))
    ref_o, ref_ht = naive_recurrent(**_fp64(x), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close("o", o, ref_o, TOL[torch.float32])
    assert_close("final_state", ht, ref_ht, TOL[torch.float32])

    # stage 3 alone: h and vnew as the plain kernel writes them
    plain, warm, res, SL = _stage3_both(x, 4)
    assert SL == (10, 4)
    dec = _chunk_decays(x)[0]
    windows = [_window_start(dec[:, hv], 4 * s, cw_mod.THRESH)[0] for s in range(1, 10) for hv in range(HV)]
    if expect_exact:
        assert all(w == 0 for w in windows)                 # every warm-up reaches the sequence start
        for a, b in zip(warm, plain):
            assert torch.equal(a, b)                        # the plain pass's arithmetic from h0: bit-identical
    else:
        assert all(w > 0 for w in windows[2 * HV:])         # truncated from segment 1 on (one chunk is -32)
        for name, a, b in zip(("h", "vnew", "final"), warm, plain):
            assert not torch.isnan(a).any(), name
            assert rel_rms(a, b) <= 1e-5, (name, rel_rms(a, b))


# ---- (iii) truncation that matters: the bound -----------------------------------------------------------------

@pytest.mark.parametrize("thresh", [2.0, 4.0, 20.0])
def test_truncation_error_within_bound(thresh):
    B, T, H, HV, K, V = 1, 64 * 24, 1, 2, 32, 32
    L = 3
    x = _inputs(B, T, H, HV, K, V, torch.float32, -0.03, seed=3)     # ~-1.9 per chunk: windows of 1-11 chunks
    plain, warm, res, SL = _stage3_both(x, L, thresh)
    assert SL == (8, 3)
    exact, exact_final = _exact_chunk_states(x)             # [1, nch, HV, K, V] fp64
    nch = exact.shape[1]
    h_w = warm[0][:nch].double()                             # [nch, HV, K, V]
    h_p = plain[0][:nch].double()
    dec = _chunk_decays(x)[0]
    worst_ratio, truncated = 0.0, 0
    for hv in range(HV):
        for s in range(SL[0]):
            c0 = s * L
            cwin, acc = _window_start(dec[:, hv], c0, thresh)
            if cwin == 0:
                continue
            truncated += 1
            bound = math.exp(acc) * exact[0, cwin, hv].norm().item()
            for c in range(c0, min(c0 + L, nch)):
                err = (h_w[c, hv] - exact[0, c, hv]).norm().item()
                noise = (h_p[c, hv] - exact[0, c, hv]).norm().item()        # the plain pass's own fp32 error
                assert err <= bound * 1.01 + 4 * noise + 1e-6 * exact[0, c, hv].norm().item(), (hv, s, c, err, bound)
                worst_ratio = max(worst_ratio, (err - noise) / bound)
    assert truncated >= (HV * (SL[0] - 2) if thresh <= 4.0 else HV * 4)     # at 20: segments 4..7 (windows ~11)
    if thresh <= 4.0:
        assert worst_ratio > 1e-3, worst_ratio             # the dropped history is visible: the test sees truncation
    else:
        # THRESH = 20: the truncation is below fp32 rounding
        for name, a, b in zip(("h", "vnew", "final"), warm, plain):
            assert rel_rms(a, b) <= 1e-6, (name, rel_rms(a, b))
        assert rel_rms(warm[2], exact_final) <= 1e-5


# ---- (iv) the switch -------------------------------------------------------------------------------------------

def test_switch_conditions(monkeypatch, short_segments):
    x = _inputs(1, 64 * 12, 1, 2, 32, 32, torch.float32, -0.5)
    calls = _spy(monkeypatch)
    _forward(x, l2norm=True)
    assert len(calls) == 1                                          # taken: fixed length, l2norm, 3 segments
    _forward(x, l2norm=False)                                       # k normalised by the caller, but not declared
    assert len(calls) == 1
    monkeypatch.setenv("LINATTN_GDN_KEYS_NORMALISED", "1")
    _forward(x, l2norm=False)                                       # declared
    assert len(calls) == 2
    cu = random_cu_seqlens([64 * 6, 64 * 6], "cpu")
    x2 = dict(x, initial_state=torch.zeros(2, 2, 32, 32))
    _forward(x2, l2norm=True, cu_seqlens=cu)                        # varlen: plain
    assert len(calls) == 2
    _forward(_inputs(1, 64 * 7, 1, 2, 32, 32, torch.float32, -0.5), l2norm=True)   # 7 chunks: < 2 segments of 4
    assert len(calls) == 2
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    hooked = []
    with torch.no_grad():                                           # a state_pass hook (Gluon) replaces stage 3
        chunk_gated_delta_rule_fwd(q, k, v, g, beta, 32 ** -0.5, None, True, None, keys_normalised=True,
                                   state_pass=lambda *a: hooked.append(1))
    assert hooked == [1] and len(calls) == 2
    monkeypatch.setenv("LINATTN_GDN_SEGMENT_WARMUP", "0")
    _forward(x, l2norm=True)                                        # switch off
    assert len(calls) == 2


# ---- (v) B=2 GVA, initial state or not, T % 64 != 0, 16-bit; gradients -----------------------------------------

@pytest.mark.parametrize("dtype,h0,g_per_token", [(torch.float32, True, -0.3), (torch.float32, False, -0.02),
                                                  (torch.bfloat16, True, -0.3), (torch.bfloat16, False, None)])
def test_warmup_batch_gva_ragged(monkeypatch, short_segments, dtype, h0, g_per_token):
    B, T, H, HV, K, V = 2, 64 * 37 + 13, 1, 2, 32, 32       # 38 chunks, the last of 13 tokens
    x = _inputs(B, T, H, HV, K, V, dtype, g_per_token, h0=h0, seed=5)
    calls = _spy(monkeypatch)
    o, ht = _forward(x)
    assert calls == [(9, 5)], calls                          # by_fill 132 // (2*2) = 33, by length 38 // 4 = 9
    ref_o, ref_ht = naive_recurrent(**_fp64(x), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close("o", o, ref_o, TOL[dtype])
    assert_close("final_state", ht, ref_ht, TOL[dtype])
    monkeypatch.setenv("LINATTN_GDN_SEGMENT_WARMUP", "0")
    o_p, ht_p = _forward(x)
    tol = 1e-5 if dtype == torch.float32 else TOL[dtype]
    assert rel_rms(o, o_p) <= tol and rel_rms(ht, ht_p) <= tol, (rel_rms(o, o_p), rel_rms(ht, ht_p))


def test_warmup_backward_matches_fp64(monkeypatch, short_segments):
    """The backward recomputes h and vnew through chunk_gated_delta_rule_fwd; with LINATTN_GDN_KEYS_NORMALISED=1 the
    switch applies there too (the recompute is spied), and the gradients match fp64 autograd."""
    monkeypatch.setenv("LINATTN_GDN_KEYS_NORMALISED", "1")
    B, T, H, HV, K, V = 1, 64 * 12 + 5, 1, 2, 32, 32
    x = _inputs(B, T, H, HV, K, V, torch.float32, -0.3, seed=7)
    calls = _spy(monkeypatch)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    inp = {n: x[n].clone().requires_grad_(True) for n in names}
    ref = {n: x[n].double().clone().requires_grad_(True) for n in names}
    o_ref, ht_ref = chunk_reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref["initial_state"],
                                    True, None, False)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    with poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                               initial_state=inp["initial_state"], output_final_state=True,
                                               backend="triton")
        torch.autograd.backward([o, ht], [do.float(), dht.float()])
    assert len(calls) == 2, calls                            # the forward and the backward's recompute
    assert_close("o", o, o_ref, TOL[torch.float32])
    for n in names:
        assert_close(f"d{n}", inp[n].grad, ref[n].grad, TOL[torch.float32])


# ---- ahead-of-time build for sm_90a ------------------------------------------------------------------------------

def _aot_specs():
    x, f, i64 = "*bf16", "*fp32", "*i64"
    sig = dict(k_ptr=x, w_ptr=x, u_ptr=x, gcum_ptr=f, h_ptr=x, vnew_ptr=x, h0_ptr=f, ht_ptr=f, cu_ptr=i64,
               chunk_off_ptr=i64, N="i32", seg_chunks="i32", thresh="fp32")
    out = []
    for bv, warps, stages in ((32, 4, 2), (32, 4, 1)):       # the forward's B=1 config; the 3-per-SM variant
        const = dict(H=16, HV=32, K=128, V=128, BT=64, BK=128, BV=bv, USE_H0=True, STORE_HT=True, DOT_PREC="tf32")
        out.append((f"warmup_bv{bv}_w{warps}_s{stages}", cw_mod.chunk_state_warmup_kernel, sig, const,
                    dict(num_warps=warps, num_stages=stages)))
    return out


def test_aot_sm90a_compiles_without_spills():
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, __file__, "aot"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["name"] for r in reports) == ["warmup_bv32_w4_s1", "warmup_bv32_w4_s2"]
    for r in reports:
        assert r["spill_bytes"] == 0, r
        assert r["regs"] <= 224, r          # 2 programs of 4 warps per SM (the segment plan's RESIDENT_PER_SM)


def test_aot_registration_matches_the_kernel():
    """linattn inspect's registrations (ops/gated_delta_rule/aot.py): run-time arguments in the kernel's order."""
    import inspect

    from linattn.runtime.aot import kernels
    reg = kernels()
    for name in ("gdn_fwd_triton_state_warmup_bv32_w4_s2", "gdn_fwd_triton_state_warmup_bv32_w4_s1"):
        fn, sig, const, opts = reg[name].build()
        params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
        runtime = [n for n in sig if sig[n] != "constexpr"]
        assert sorted(sig) == sorted(params) and runtime == params[:len(runtime)], name


def test_round_script_dry_run(tmp_path):
    """benchmarks/gpu/warmup_state_round.py --dry-run: gate cases, stage 3 vs plain and the timing rows on the CPU."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "warmup_state_round.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "warmup_state.json").read_text())
    assert res["gate_passed"], res
    assert [c["case"] for c in res["gate"]] == ["dry_default", "dry_strong_fp32", "dry_weak"]
    for c in res["gate"]:
        assert c["taken"] and c["segments"] >= 2, c
    assert res["gate"][2]["windows"]["reach_start"] == res["gate"][2]["windows"]["windows"]    # weak: all exact
    assert res["stage3_vs_plain"]["weak"]["h"] == 0.0
    assert len(res["timing"]) == 2
    for row in res["timing"]:
        assert "error" not in row, row
        assert row["plain_ms"] > 0 and all(e["ms"] > 0 for e in row["warmup"]), row


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 2 and sys.argv[1] == "aot":
        from linattn.testing.aot import print_reports
        print_reports(_aot_specs(), 128, 128)
