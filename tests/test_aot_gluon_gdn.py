"""The GDN forward's Gluon state pass (issue 7) on a CPU host: every variant compiles for sm_90a with the
instructions it is meant to use (HMMA for "literal"; UTMALDG, UTMASTG and SYNCS for "tma"; HGMMA on top for
"wgmma"), spills nothing and fits in shared memory; the launcher's arguments are exactly what was compiled;
and the "gluon" backend refuses CPU calls with a reason while backend="auto" still runs Triton.
Works with TRITON_INTERPRET=1 set (compiles run in a child process, linattn.runtime.aot). The kernels have not
been run here: benchmarks/gpu/gdn_gluon_round.py gates them on an H200."""
import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

SMEM_LIMIT_SM90 = 232448
_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()
GDN = sorted(n for n in REGISTRY if n.startswith("gdn_state_gluon_"))
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


def test_every_variant_registered():
    from linattn.ops.gated_delta_rule.gluon.launcher import VARIANTS
    for v in VARIANTS:
        assert any(f"_{v}_" in n for n in GDN), f"variant {v} has no AOT registration: {GDN}"


@needs_gluon
@pytest.mark.parametrize("name", GDN)
def test_compiles_with_intended_instructions(name):
    spec = REGISTRY[name]
    rep = inspect_kernel(spec)
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    assert 0 < rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
    if "_tma_" in name or "_wgmma_" in name:
        # the ring: a TMA load per tile (w, k, u) in the prologue and in the loop, waits on the ready barriers
        assert rep.families["UTMALDG"] >= 6 and rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 1
        assert rep.families["UTMASTG"] >= 1                 # h[chunk] leaves through the TMA store
    if "_wgmma_" in name:
        assert rep.families["HMMA"] == 0
        bv = int(name.split("_bv")[1].split("_")[0])
        # product 1: 64 x BV x 128 (8 k-steps); product 2: 128 x BV x 64 (2 M-halves x 4 k-steps)
        # (SASS spells the fp16 form without an operand suffix: HGMMA.64x64x16.F32)
        op = f"HGMMA.64x{bv}x16.F32" + (".BF16" if "_bf16_" in name else "")
        assert rep.sass.get(op, 0) == 16, rep.sass
    else:
        assert rep.families["HGMMA"] == 0 and rep.families["HMMA"] > 0


def _plan_and_buffers(B, T, H, HV, lens=None, dtype=torch.bfloat16):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    K = V = 128
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, slots, N = plan.T_total, plan.num_slots, plan.N
    k = torch.zeros(B, T, H, K, dtype=dtype)
    w = torch.zeros(T_tot, HV, K, dtype=dtype)
    u = torch.zeros(T_tot, HV, V, dtype=dtype)
    gcum = torch.zeros(T_tot, HV)
    h = torch.zeros(slots, HV, K, V, dtype=dtype)
    vnew = torch.zeros(T_tot, HV, V, dtype=dtype)
    h0 = torch.zeros(N, HV, K, V)
    ht = torch.zeros(N, HV, K, V)
    return plan, (k, w, u, gcum, h, vnew, h0, ht)


@needs_gluon
@pytest.mark.parametrize("variant", ["literal", "tma", "wgmma"])
@pytest.mark.parametrize("B,T,lens", [(1, 65536, None), (8, 4096, None), (1, 3000, [1, 63, 65, 1000, 1871])])
def test_launch_matches_aot_signature(variant, B, T, lens):
    """The launcher's arguments (on CPU tensors: descriptors build without a GPU) mangle to exactly the
    signature compiled in aot.py, and the config it picks at the production shapes is a registered one."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import CONFIGS, kernel_name, signature
    from linattn.ops.gated_delta_rule.gluon.launcher import state_config, state_launch
    plan, bufs = _plan_and_buffers(B, T, 16, 32, lens)
    cfg = state_config(variant, plan.N, 32, 128, num_sms=132)
    kernel, grid, args, kwargs = state_launch(*bufs, plan, variant, cfg)
    sig = signature(variant, "bf16", cfg.BV)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (128 // cfg.BV, plan.N * 32)
    assert kwargs["BV"] == cfg.BV and kwargs["num_warps"] == cfg.num_warps
    if variant != "literal":
        assert kwargs["STAGES"] == cfg.stages and kwargs["USE_WGMMA"] == (variant == "wgmma")
    if lens is None:
        stages = cfg.stages if variant != "literal" else 0
        assert kernel_name(variant, "bf16", cfg.BV, cfg.num_warps, stages) in {kernel_name(*c) for c in CONFIGS}


def test_state_config_follows_triton_split():
    from linattn.ops.gated_delta_rule.gluon.launcher import state_config
    assert state_config("wgmma", 1, 32, 128, 132).BV == 32      # 64 programs at BV=64 would leave SMs idle
    assert state_config("wgmma", 8, 32, 128, 132).BV == 64
    assert state_config("literal", 8, 32, 128, 132).num_warps == 8
    with pytest.raises(ValueError):
        state_config("nope", 1, 32, 128, 132)


def test_gluon_backend_refuses_cpu_and_auto_runs_triton(device, monkeypatch):
    import linattn
    from linattn.backends import BackendError, op_backends
    from linattn.testing import make_gdn_inputs
    if device != "cpu":
        pytest.skip("CPU behaviour")
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    table = op_backends("chunk_gated_delta_rule")
    assert "gluon" in table.names() and table.backends["gluon"].auto_filter is not None
    x = make_gdn_inputs(1, 70, 2, 4, 128, 128, dtype=torch.bfloat16, device="cpu")
    ok, reason = table.backends["gluon"].supports(**x)
    assert not ok and reason
    with pytest.raises(BackendError, match="gluon"):
        linattn.chunk_gated_delta_rule(**x, backend="gluon")
    assert table.select("auto", **x).name == "triton"
    rows = {name: (ok, why) for name, ok, why in table.explain(**x)}
    assert rows["gluon"][0] is False and rows["gluon"][1]


def test_auto_hands_gluon_only_what_it_was_measured_faster_on(monkeypatch):
    """With the Gluon backend's supports() pretending a Hopper GPU (none here), `auto` picks it for N*HV <= 768
    sequence-heads (GLUON_AUTO_MAX_SEQ_HEADS, round 14) when the call is long (T_total >= GLUON_AUTO_MIN_EAGER_TOKENS) or captured into a CUDA graph, and keeps the rest on
    Triton with a reason; by name it takes them all."""
    import dataclasses

    from linattn.backends import op_backends
    from linattn.ops.gated_delta_rule.gluon import backend
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    table = op_backends("chunk_gated_delta_rule")
    real = table.backends["gluon"]
    monkeypatch.setitem(table.backends, "gluon", dataclasses.replace(real, supports=lambda **_: (True, "")))
    long_T = backend.GLUON_AUTO_MIN_EAGER_TOKENS

    def call(B, T, HV, cu=None):
        e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt)  # noqa: E731
        return dict(q=e(B, T, 2, 128), k=e(B, T, 2, 128), v=e(B, T, HV, 128), g=e(B, T, HV, dt=torch.float32),
                    beta=e(B, T, HV, dt=torch.float32), initial_state=None, cu_seqlens=cu)

    def picked(**c):
        name = table.select("auto", **c).name
        why = {n: r for n, ok, r in table.explain(**c)}["gluon"]
        assert (why == "") == (name == "gluon"), why
        assert table.select("gluon", **c).name == "gluon"
        return name, why

    assert backend.GLUON_AUTO_MAX_SEQ_HEADS == 768
    assert picked(**call(1, long_T, 32))[0] == "gluon"                  # B1 HV32: N*HV = 32
    assert picked(**call(8, long_T // 8, 32))[0] == "gluon"             # B8 HV32: N*HV = 256
    assert picked(**call(1, long_T, 768))[0] == "gluon"                 # N*HV = 768
    name, why = picked(**call(1, long_T, 800))
    assert name == "triton" and "N*HV = 800" in why
    name, why = picked(**call(1, long_T // 4, 32))                      # eager, short
    assert name == "triton" and "eager" in why
    cu = torch.tensor([0, 100, long_T // 2, long_T], dtype=torch.int64)  # varlen: N = 3 sequences of one row
    assert picked(**call(1, long_T, 256, cu))[0] == "gluon"             # N*HV = 768
    assert picked(**call(1, long_T, 272, cu))[0] == "triton"            # N*HV = 816
    assert not backend._capturing(torch.empty(1))                       # a CPU tensor is never captured
    monkeypatch.setattr(backend, "_capturing", lambda q: True)
    assert picked(**call(1, long_T // 4, 32))[0] == "gluon"             # short, but under capture


def test_gluon_backend_reasons_without_interpreter(monkeypatch):
    """Outside the interpreter the reason names the device; a bad variant name is reported first on a GPU,
    here the device check comes first."""
    from linattn.ops.gated_delta_rule.gluon import backend
    from linattn.testing import make_gdn_inputs
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = make_gdn_inputs(1, 10, 1, 2, 128, 128, dtype=torch.bfloat16, device="cpu")
    ok, reason = backend.supports(**x)
    assert not ok and "sm_90" in reason
    monkeypatch.setenv("LINATTN_GDN_GLUON_VARIANT", "tma")
    assert backend.selected_variant() == "tma"
    monkeypatch.delenv("LINATTN_GDN_GLUON_VARIANT")
    assert backend.selected_variant() == "wgmma"


def test_gpu_round_script_dry_run(tmp_path):
    """benchmarks/gpu/gdn_gluon_round.py --dry-run: imports everything it uses, builds the gate's case list (all
    K=V=128 16-bit, varlen lengths consistent) and finds the launcher's configs in the AOT registry."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "gpu", "gdn_gluon_round.py")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--dry-run"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "gdn_gluon_dryrun.json").read_text())
    assert out["passed"] and len(out["cases"]) >= 15
    assert {"gluon_varlen_1tok", "T65536_gva", "varlen_T65536_gva", "gluon_T63_gva_h0"} <= set(out["cases"])


def _emulate_tma_state_pass(k, w, u, gcum, h0, plan, BV, BT=64):
    """What chunk_state_tma.py computes, in torch, box by box: each chunk reads full [BT, .] boxes starting at its
    first token (rows of the next sequence included, zero past T_tot), neutralises the rows past the sequence
    end in registers, applies the decay to Vnew's rows, and rounds where the kernel rounds."""
    dt = w.dtype
    T_tot, HV, K = w.shape
    H, V = k.shape[2], u.shape[2]
    kf = k.reshape(T_tot, H, K)
    pad = lambda t: torch.cat([t, t.new_zeros(BT, *t.shape[1:])])       # TMA zero-fill past T_tot
    kf, wp, up, gp = pad(kf), pad(w), pad(u), pad(gcum)
    h = torch.full((plan.num_slots, HV, K, V), float("nan"), dtype=dt)
    vnew = torch.full_like(u, float("nan"))
    final = torch.empty(plan.N, HV, K, V)
    cu, offs = plan.cu.tolist(), plan.chunk_offsets.tolist()
    for n in range(plan.N):
        bos, eos = cu[n], cu[n + 1]
        for hv in range(HV):
            hk = hv // (HV // H)
            for vb in range(V // BV):
                cols = slice(vb * BV, (vb + 1) * BV)
                s = h0[n, hv, :, cols].clone() if h0 is not None else torch.zeros(K, BV)
                for c in range(-(-(eos - bos) // BT)):
                    t0 = bos + c * BT
                    valid = (torch.arange(BT) + t0) < eos
                    h[offs[n] + c, hv, :, cols] = s.to(dt)
                    wb, kb, ub = wp[t0:t0 + BT, hv], kf[t0:t0 + BT, hk], up[t0:t0 + BT, hv, cols]
                    gam = torch.where(valid, gp[t0:t0 + BT, hv], 0.)
                    g_last = gcum[min(eos - t0, BT) - 1 + t0, hv]
                    vn = ub.float() - wb.float() @ s.to(dt).float()
                    vnew[torch.arange(t0, t0 + BT)[valid], hv, cols] = vn[valid].to(dt)
                    vs = torch.where(valid[:, None], vn.to(dt).float() * torch.exp(g_last - gam)[:, None], 0.).to(dt)
                    kt = torch.where(valid[None, :], kb.T, 0.)
                    s = s * torch.exp(g_last) + kt.float() @ vs.float()
                final[n, hv, :, cols] = s
    return h, vnew, final


@pytest.mark.parametrize("lens", [None, [1, 63, 1, 130, 64, 1]])
def test_tma_algorithm_matches_triton_state_pass(device, lens):
    """Model check of the ring kernel's arithmetic (not of the Gluon code, which needs a GPU): reading whole boxes
    that run into the next sequence, masking in registers and decaying Vnew instead of K give the Triton state
    pass's h, vnew and final state up to 16-bit rounding."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import make_gdn_inputs, random_cu_seqlens, rel_rms
    T = sum(lens) if lens else 100
    B = 1 if lens else 2
    x = make_gdn_inputs(B, T, 1, 2, 128, 128, dtype=torch.bfloat16, device="cpu",
                        num_states=len(lens) if lens else None)
    cu = random_cu_seqlens(lens, "cpu") if lens else None
    with torch.no_grad():
        res = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"],
                                         True, cu, compute_output=False)
    h, vnew, final = _emulate_tma_state_pass(x["k"], res.w, res.u, res.gcum, x["initial_state"], res.plan, BV=64)
    used = int(res.plan.chunk_offsets[-1])
    assert rel_rms(h[:used], res.h[:used]) < 3e-3         # measured ~4e-4: one bf16 rounding apart
    assert rel_rms(vnew, res.vnew) < 3e-3
    assert rel_rms(final, res.final_state) < 3e-3


def _triton_state_pass(k, w, u, gcum, h, vnew, h0, final, plan):
    """The Triton state stage, launched as triton/forward.py does (same arguments as chunk_state_gluon)."""
    import triton

    from linattn.ops.gated_delta_rule.triton.chunk_state import chunk_state_fwd_kernel
    from linattn.ops.gated_delta_rule.triton.forward import CHUNK, _configs, _pow2
    H, K = k.shape[2], k.shape[3]
    HV, V = u.shape[1], u.shape[2]
    cfg = _configs(K, V, plan.N, HV, k.device)
    chunk_state_fwd_kernel[(triton.cdiv(V, cfg.BV_state), plan.N * HV)](
        k, w, u, gcum, h, vnew, h0 if h0 is not None else gcum, final if final is not None else gcum,
        plan.cu, plan.chunk_offsets, H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=_pow2(K), BV=cfg.BV_state,
        USE_H0=h0 is not None, STORE_HT=final is not None, DOT_PREC="tf32", num_warps=cfg.warps_state)


@pytest.mark.parametrize("lens,h0", [(None, True), ([1, 63, 1, 70], False)])
def test_gluon_forward_orchestration(device, lens, h0):
    """The gluon backend's forward (Triton intra-chunk and output stages around the state pass, launched by
    gluon/launcher.py) with the Triton state kernel plugged in, under the interpreter: o and the final state
    match the fp64 recurrence. Checks the launcher's own stage-2/4 launches, not the Gluon kernel."""
    if device != "cpu":
        pytest.skip("CPU orchestration check")
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens
    T = sum(lens) if lens else 70
    B = 1 if lens else 2
    x = make_gdn_inputs(B, T, 1, 2, 128, 128, dtype=torch.bfloat16, device="cpu", initial_state=h0,
                        num_states=len(lens) if lens else None)
    cu = random_cu_seqlens(lens, "cpu") if lens else None
    with torch.no_grad(), poisoned_allocations():
        res = chunk_gated_delta_rule_fwd_gluon(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5,
                                               x["initial_state"], True, cu, state_pass=_triton_state_pass)
    x64 = {k: (v.double() if v is not None else None) for k, v in x.items()}
    ref_o, ref_ht = naive_recurrent(**x64, output_final_state=True, cu_seqlens=cu)
    assert_close("o", res.o, ref_o, TOL[torch.bfloat16])
    assert_close("final_state", res.final_state, ref_ht, TOL[torch.bfloat16])


def test_launch_kwargs_name_kernel_parameters():
    """Every argument the launcher passes (positional and constexpr keyword) is a parameter of the kernel."""
    if not _GLUON_OK:
        pytest.skip(_GLUON_REASON)
    from linattn.ops.gated_delta_rule.gluon.launcher import StateConfig, state_launch
    plan, bufs = _plan_and_buffers(1, 130, 2, 4)
    for variant in ("literal", "tma", "wgmma"):
        kernel, grid, args, kwargs = state_launch(*bufs, plan, variant, StateConfig(64, 4, 2))
        names = list(kernel.arg_names)
        passed = names[:len(args)] + [k for k in kwargs if k != "num_warps"]
        assert sorted(passed) == sorted(names), (variant, passed, names)


def _jit_compile_main():
    """Child process: drive the real JIT launch path (binder, specialisation, compile) of every variant with the
    launcher's own arguments on CPU tensors, under a stand-in driver that reports an sm_90a target and never
    launches (warmup). Prints one JSON line per kernel."""
    import json

    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.launcher import state_config, state_launch

    use_compile_only_sm90_driver()
    for variant in ("literal", "tma", "wgmma"):
        for B, T, dtype, h0 in ((1, 300, torch.bfloat16, True), (8, 100, torch.float16, False)):
            plan, bufs = _plan_and_buffers(B, T, 16, 32, dtype=dtype)
            if not h0:
                bufs = bufs[:6] + (None,) + bufs[7:]
            cfg = state_config(variant, plan.N, 32, 128, num_sms=132)
            kernel, grid, args, kwargs = state_launch(*bufs, plan, variant, cfg)
            k = kernel.warmup(*args, grid=grid, **kwargs)
            print(json.dumps(dict(variant=variant, B=B, dtype=str(dtype), BV=cfg.BV, stages=cfg.stages,
                                  num_warps=k.metadata.num_warps, shared=k.metadata.shared,
                                  tma_boxes=[m["block_size"] for m in (k.metadata.tensordesc_meta or [])])))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    """The JIT path the GPU takes (launcher args -> binder -> specialisation -> compile) works for every variant,
    bf16 and fp16, with and without initial state, with the TMA boxes the launcher meant."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "jit"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6
    for r in rows:
        assert r["num_warps"] == (8 if r["variant"] == "literal" and r["BV"] == 64 else 4), r
        assert 0 < r["shared"] <= SMEM_LIMIT_SM90, r
        if r["variant"] != "literal":
            # w and k [64,128] boxes go as [64,64] messages (128-byte swizzle); u [64,BV]; h [128,BV]
            assert r["tma_boxes"] == [[64, 64], [64, 64], [64, r["BV"]], [128, r["BV"]]], r


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["jit"]:
        _jit_compile_main()


def test_gluon_backward_recompute_takes_the_state_pass_hook(device, monkeypatch):
    """LINATTN_GDN_GLUON_BWD_STATE=1 (or unset, at N*HV <= 64): the gluon backend's backward recomputes the state
    pass through chunk_state_gluon (here replaced by the Triton state kernel, under the interpreter), once per
    backward, and gives the Triton backward's gradients bit for bit; "0" (with the dh pass off), the Triton
    backward op runs."""
    if device != "cpu":
        pytest.skip("CPU orchestration check")
    from types import SimpleNamespace

    from linattn.ops.gated_delta_rule.gluon import backend, launcher
    from linattn.testing import make_gdn_inputs
    calls = []

    def fake_state(k, w, u, gcum, h, vnew, h0, final, plan, variant):
        calls.append(variant)
        _triton_state_pass(k, w, u, gcum, h, vnew, h0, final, plan)

    monkeypatch.setattr(launcher, "chunk_state_gluon", fake_state)
    x = make_gdn_inputs(1, 70, 1, 2, 128, 128, dtype=torch.bfloat16, device="cpu")
    do = torch.randn(1, 70, 2, 128).to(torch.bfloat16)
    dfinal = torch.randn_like(x["initial_state"])
    ctx = SimpleNamespace(saved_tensors=(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], None),
                          scale=128 ** -0.5, output_final_state=True, variant="wgmma")
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_STATE", "0")
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_DH", "0")     # on by default since round 14: the Triton dh pass here
    # _triton_state_pass (the hook's stand-in) takes the state pass's decay on K, the Triton backward's recompute on
    # Vnew since round 22 unless this is "0": bit-equality needs the same form on both sides
    monkeypatch.setenv("LINATTN_GDN_STATE_DECAY_V_BWD", "0")
    want = backend._backward(ctx, do, dfinal)
    assert calls == []
    monkeypatch.setenv("LINATTN_GDN_GLUON_BWD_STATE", "1")
    got = backend._backward(ctx, do, dfinal)
    assert calls == ["wgmma"]
    monkeypatch.delenv("LINATTN_GDN_GLUON_BWD_STATE")       # unset: Gluon where N*HV <= 64 (here 2)
    again = backend._backward(ctx, do, dfinal)
    assert calls == ["wgmma", "wgmma"]
    for a, b in zip(again, want):
        assert (a is None and b is None) or torch.equal(a, b)
    q8, v8 = torch.empty(8, 1, 16, 1), torch.empty(8, 1, 32, 1)
    assert backend.recompute_state_in_gluon("auto", q8, v8, None) is False               # N*HV = 256
    assert backend.recompute_state_in_gluon("on", q8, v8, None) is True
    assert backend.recompute_state_in_gluon("auto", q8[:1], v8[:1], None) is True        # N*HV = 32
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int64)
    assert backend.recompute_state_in_gluon("auto", q8[:1], torch.empty(1, 3, 32, 1), cu) is False  # 3 * 32 = 96
    assert backend.recompute_state_in_gluon("off", x["q"], x["v"], None) is False
    assert len(got) == len(want) == 11         # the op's 11 inputs (variant, keys_normalised last)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
