"""Segment-parallel state pass of the Triton GDN forward (triton/chunk_state_split.py, LINATTN_GDN_SPLIT_STATE=1).

The forward with the split pass against the fp64 step-by-step recurrence (NaN-poisoned buffers, the tolerances of
test_chunk_forward.py), against the plain pass to fp32 round-off, the device-side segment table, the opt-in switch,
and an ahead-of-time sm_90a build of the new kernels at K=V=128 (no spills).
"""
import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.gated_delta_rule.triton import forward as fwd_mod
from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
from linattn.ops.gated_delta_rule.triton.chunk_state_split import auto_seg_chunks, make_segment_plan
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens, rel_rms


def _fp64(x):
    return {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


def _weak_decay(x, factor=0.02):
    """Slow forgetting (|g| ~ 1e-3 per step): the state remembers across many segments, so the joins matter."""
    x["g"] = (x["g"].float() * factor).to(x["g"].dtype)
    return x


@pytest.fixture
def split_env(monkeypatch):
    def set_(chunks):
        monkeypatch.setenv("LINATTN_GDN_SPLIT_STATE", "1")
        monkeypatch.setenv("LINATTN_GDN_SPLIT_CHUNKS", str(chunks))
    return set_


def _run(x, cu_seqlens=None, output_final_state=True):
    with torch.no_grad(), poisoned_allocations():
        return linattn.chunk_gated_delta_rule(**x, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                              backend="triton")


def _check(x, dtype, cu_seqlens=None, output_final_state=True):
    o, ht = _run(x, cu_seqlens, output_final_state)
    ref_o, ref_ht = naive_recurrent(**_fp64(x), output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert_close("o", o, ref_o, TOL[dtype])
    if output_final_state:
        assert ht.dtype == torch.float32
        assert_close("final_state", ht, ref_ht, TOL[dtype])
    else:
        assert ht is None


def _spy(monkeypatch):
    calls = []
    orig = fwd_mod.chunk_state_split

    def spy(*a, **kw):
        calls.append(kw)
        return orig(*a, **kw)
    monkeypatch.setattr(fwd_mod, "chunk_state_split", spy)
    return calls


# (B, T, H, HV, K, V, dtype, segment chunks, initial state, final state, weak decay)
CASES = [
    (1, 1000, 2, 4, 32, 32, torch.float32, 3, True, True, True),       # 16 chunks -> 6 segments, T % 64 != 0
    (2, 333, 1, 2, 64, 64, torch.bfloat16, 2, True, True, True),       # B=2, GVA, 6 chunks -> 3 segments each
    (1, 500, 2, 2, 32, 64, torch.float16, 1, False, False, False),     # every chunk its own segment, no states
    (1, 260, 1, 2, 64, 32, torch.float32, 2, False, True, True),       # no initial state, K != V
    (1, 64, 1, 1, 32, 32, torch.bfloat16, 1, True, True, False),       # a single chunk: one segment
]


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,chunks,h0,ht,weak", CASES)
def test_split_matches_fp64_reference(monkeypatch, split_env, B, T, H, HV, K, V, dtype, chunks, h0, ht, weak):
    split_env(chunks)
    calls = _spy(monkeypatch)
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, initial_state=h0)
    if weak:
        _weak_decay(x)
    _check(x, dtype, output_final_state=ht)
    assert len(calls) == 1


def test_split_varlen_empty_and_one_token_sequences(monkeypatch, split_env):
    split_env(2)
    calls = _spy(monkeypatch)
    lengths = [1, 300, 0, 63, 1, 200, 65]
    cu = random_cu_seqlens(lengths)
    x = _weak_decay(make_gdn_inputs(1, sum(lengths), 2, 4, 32, 32, dtype=torch.bfloat16, num_states=len(lengths)))
    _check(x, torch.bfloat16, cu_seqlens=cu)
    assert len(calls) == 1


def test_split_long_sequence_8_segments_fp32(monkeypatch, split_env):
    """T=2048 in 8 segments of 4 chunks, slow decay: the M products carry the state across the whole sequence."""
    split_env(4)
    x = _weak_decay(make_gdn_inputs(1, 2048, 2, 4, 32, 32, dtype=torch.float32))
    o, ht = _run(x)
    ref_o, ref_ht = naive_recurrent(**_fp64(x), output_final_state=True)
    assert rel_rms(o, ref_o) <= 1e-5 and rel_rms(ht, ref_ht) <= 1e-5, (rel_rms(o, ref_o), rel_rms(ht, ref_ht))


@pytest.mark.parametrize("cu_lengths", [None, [700, 1, 0, 129]])
def test_split_equals_plain_pass_to_fp32_roundoff(monkeypatch, split_env, cu_lengths):
    """Every intermediate of the forward (h, vnew, final state) and o: split vs plain, fp32 inputs."""
    cu = random_cu_seqlens(cu_lengths) if cu_lengths else None
    T = sum(cu_lengths) if cu_lengths else 900
    x = _weak_decay(make_gdn_inputs(1, T, 1, 2, 32, 32, dtype=torch.float32,
                                    num_states=len(cu_lengths) if cu_lengths else None))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True, cu)
    with torch.no_grad(), poisoned_allocations():
        monkeypatch.setenv("LINATTN_GDN_SPLIT_STATE", "0")
        plain = fwd_mod.chunk_gated_delta_rule_fwd(*args)
        split_env(2)
        split = fwd_mod.chunk_gated_delta_rule_fwd(*args)
    nslots = int(plain.plan.chunk_offsets[-1])              # the slots in use (the rest are never written)
    for name in ("vnew", "final_state", "o"):
        err = rel_rms(getattr(split, name), getattr(plain, name))
        assert err <= 1e-6, (name, err)
    err = rel_rms(split.h[:nslots], plain.h[:nslots])
    assert err <= 1e-6, ("h", err)


@pytest.mark.parametrize("fused", [False, True])
def test_launcher_direct_fused_phase1(monkeypatch, fused):
    """chunk_state_split called directly (as the GPU script does), phase 1 in one launch or two, against the plain
    state pass on the same intermediates: h, vnew and the final state to fp32 round-off."""
    from dataclasses import replace

    from linattn.ops.gated_delta_rule.triton.chunk_state_split import chunk_state_split, split_configs
    monkeypatch.setenv("LINATTN_GDN_SPLIT_STATE", "0")
    lengths = [300, 1, 450]
    cu = random_cu_seqlens(lengths)
    K = V = 32
    x = _weak_decay(make_gdn_inputs(1, sum(lengths), 1, 2, K, V, dtype=torch.float32, num_states=len(lengths)))
    with torch.no_grad(), poisoned_allocations():
        res = fwd_mod.chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5,
                                                 x["initial_state"], True, cu, compute_output=False)
        h, vnew, ht = torch.full_like(res.h, float("nan")), torch.full_like(res.vnew, float("nan")), \
            torch.full_like(res.final_state, float("nan"))
        cfg = replace(split_configs(K, V), fused_phase1=fused)
        sp = chunk_state_split(x["k"], res.w, res.u, res.gcum, h, vnew, x["initial_state"], ht, res.plan,
                               H=1, HV=2, K=K, V=V, dot_prec="ieee", seg_chunks=2, cfg=cfg)
    assert int(sp.seg_offsets[-1]) == 3 + 1 + 4
    used = int(res.plan.chunk_offsets[-1])
    for name, a, b in (("h", h[:used], res.h[:used]), ("vnew", vnew, res.vnew), ("final", ht, res.final_state)):
        err = rel_rms(a, b)
        assert err <= 1e-6, (name, err)


def test_default_is_the_plain_pass(monkeypatch):
    monkeypatch.delenv("LINATTN_GDN_SPLIT_STATE", raising=False)
    calls = _spy(monkeypatch)
    x = make_gdn_inputs(1, 70, 1, 1, 16, 16, dtype=torch.float32)
    _check(x, torch.float32)
    assert calls == []


@pytest.mark.parametrize("lengths,L", [([1, 300, 0, 63, 1, 2000, 65], 3), ([64 * 37], 5), ([0], 4), ([5, 0, 0], 1)])
def test_segment_table_covers_every_chunk_once(lengths, L):
    cu = random_cu_seqlens(lengths)
    plan = make_chunk_plan(1, sum(lengths), cu, 64, "cpu")
    sp = make_segment_plan(plan, L)
    seg = sp.seg.tolist()
    N = len(lengths)
    assert len(seg) == sp.num_rows
    offs = sp.seg_offsets.tolist()
    assert offs[-1] <= sp.num_rows
    for n, ln in enumerate(lengths):
        nch = -(-ln // 64)
        rows = seg[offs[n]:offs[n + 1]]
        assert rows and all(r[0] == n for r in rows)
        covered = [c for _, c0, nc in rows for c in range(c0, c0 + nc)]
        assert covered == list(range(nch)), (n, rows)
        assert all(nc >= 1 for _, _, nc in rows) or nch == 0
        assert len(rows) == max(1, -(-nch // L))
        sizes = [nc for _, _, nc in rows]
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]      # balanced: equal but the last
    assert all(r[0] == N for r in seg[offs[-1]:])


def test_auto_plan_h200_shapes(monkeypatch):
    """The wave model's choices at H16/HV32 K=V=128 with the default config (2 programs per SM, 132 SMs)."""
    from linattn.ops.gated_delta_rule.triton.chunk_state_split import split_configs
    monkeypatch.delenv("LINATTN_GDN_SPLIT_CHUNKS", raising=False)
    cfg = split_configs(128, 128)
    got = {}
    for B, T in ((1, 8192), (1, 65536), (8, 4096), (1, 1024)):
        plan = make_chunk_plan(B, T, None, 64, "cpu")
        sp = make_segment_plan(plan, auto_seg_chunks(plan, 32, 128, 128, cfg, "cpu"))
        got[(B, T)] = int(sp.seg_offsets[-1])
    assert got == {(1, 8192): 4, (1, 65536): 4, (8, 4096): 16, (1, 1024): 1}, got
    monkeypatch.setenv("LINATTN_GDN_SPLIT_CHUNKS", "7")
    assert auto_seg_chunks(make_chunk_plan(1, 65536, None, 64, "cpu"), 32, 128, 128, cfg, "cpu") == 7


# ---- ahead-of-time build for sm_90a (no GPU needed) ---------------------------------------------------------------

def _aot_specs(K: int = 128, V: int = 128, H: int = 16, HV: int = 32):
    """(name, jit fn, signature, constexprs, options) of each kernel as the launcher configures it, bf16."""
    from linattn.ops.gated_delta_rule.triton import chunk_state_split as cs
    cfg = cs.split_configs(K, V)
    x, f, i64, i32 = "*bf16", "*fp32", "*i64", "*i32"
    sig = dict(k_ptr=x, w_ptr=x, u_ptr=x, gcum_ptr=f, h_ptr=x, vnew_ptr=x, s0_ptr=f, end_ptr=f, m_ptr=f, cu_ptr=i64,
               chunk_off_ptr=i64, seg_ptr=i32, N="i32")
    common = dict(H=H, HV=HV, K=K, V=V, BT=64, BK=cfg.BK, USE_H0=True, DOT_PREC="tf32")
    out = []
    modes = [("split_r", cs.MODE_R, cfg.BV, cfg.warps, cfg.stages),
             ("split_m", cs.MODE_M, cfg.BV_M, cfg.warps_m, cfg.stages_m),
             ("split_out", cs.MODE_OUT, cfg.BV, cfg.warps, cfg.stages)]
    if cfg.BV_M == cfg.BV:                      # the fused phase 1 needs one block width for R and M
        modes.append(("split_p1_fused", cs.MODE_P1, cfg.BV, cfg.warps, cfg.stages))
    for name, mode, bv, warps, stages in modes:
        out.append((name, cs._segment_pass_kernel, sig,
                    dict(common, BV=bv, MODE=mode, STORE_HT=mode == cs.MODE_OUT),
                    dict(num_warps=warps, num_stages=stages)))
    out.append(("split_join", cs._segment_join_kernel,
                dict(m_ptr=f, r_ptr=f, h0_ptr=f, sstart_ptr=f, seg_off_ptr=i64),
                dict(HV=HV, K=K, V=V, BKB=cfg.BKB_JOIN, BV=cfg.BV_JOIN, USE_H0=True, DOT_PREC="tf32"),
                dict(num_warps=cfg.warps_join)))
    return out


def _aot_main(K: int, V: int):
    """Child process (TRITON_INTERPRET unset): compile each kernel for sm_90a, print one JSON line per kernel."""
    from linattn.testing.aot import print_reports
    print_reports(_aot_specs(K, V), K, V)


@pytest.mark.parametrize("K,V", [(128, 128), (256, 256)])
def test_aot_sm90a_compiles_without_spills(K, V):
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(linattn.__file__)))     # this checkout, not an install
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, __file__, "aot", str(K), str(V)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    names = ["split_join", "split_m", "split_out", "split_r"] + (["split_p1_fused"] if K <= 128 else [])
    assert sorted(r["name"] for r in reports) == sorted(names)
    for r in reports:
        assert r["spill_bytes"] == 0, r


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 4 and sys.argv[1] == "aot":
        _aot_main(int(sys.argv[2]), int(sys.argv[3]))
