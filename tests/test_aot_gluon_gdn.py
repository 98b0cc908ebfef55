"""The GDN forward's Gluon state pass (the gluon backend's recompute in the backward) on a CPU host: every
registered config compiles for sm_90a with the instructions it is meant to use (HGMMA, UTMALDG, UTMASTG, SYNCS),
spills nothing and fits in shared memory, also through the real JIT path with the launcher's arguments; a torch model
of the ring kernel's arithmetic matches the Triton state pass; and the "gluon" backend refuses CPU calls with a
reason while backend="auto" still runs Triton, and takes under `auto` only the calls it is faster on.
Works with TRITON_INTERPRET=1 set (compiles run in a child process, linattn.runtime.aot)."""
import pytest
import torch

from linattn.runtime.aot import kernels

from markers import SMEM_LIMIT_SM90, built, needs_gluon   # tests/ is on sys.path

REGISTRY = kernels()
GDN = sorted(n for n in REGISTRY if n.startswith("gdn_state_gluon_"))


@needs_gluon
@pytest.mark.parametrize("name", GDN)
def test_compiles_with_intended_instructions(name):
    rep = built(name)
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    # the ring: a TMA load per tile (w, k, u) in the prologue and in the loop, waits on the ready barriers
    assert rep.families["UTMALDG"] >= 6 and rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 1
    assert rep.families["UTMASTG"] >= 1                 # h[chunk] leaves through the TMA store
    assert rep.families["HMMA"] == 0
    bv = int(name.split("_bv")[1].split("_")[0])
    # product 1: 64 x BV x 128 (8 k-steps); product 2: 128 x BV x 64 (2 M-halves x 4 k-steps)
    # (SASS spells the fp16 form without an operand suffix: HGMMA.64x64x16.F32)
    op = f"HGMMA.64x{bv}x16.F32" + (".BF16" if "_bf16_" in name else "")
    assert rep.sass.get(op, 0) == 16, rep.sass


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


def test_state_config_follows_triton_split_and_is_registered():
    from linattn.ops.gated_delta_rule.aot import CONFIGS, kernel_name
    from linattn.ops.gated_delta_rule.gluon.launcher import state_config
    assert state_config(1, 32, 128, 132).BV == 32          # 64 programs at BV=64 would leave SMs idle
    assert state_config(8, 32, 128, 132).BV == 64 and state_config(8, 32, 128, 132).stages == 2
    registered = {kernel_name(*c) for c in CONFIGS}
    for N in (1, 2, 8):
        cfg = state_config(N, 32, 128, 132)
        assert kernel_name("bf16", cfg.BV, cfg.num_warps, cfg.stages) in registered


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
    sequence-heads (GLUON_AUTO_MAX_SEQ_HEADS) when the call is long (T_total >= GLUON_AUTO_MIN_EAGER_TOKENS) or captured into a CUDA graph, and keeps the rest on
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
    from linattn.runtime import capture
    assert not capture.capturing(torch.empty(1))                        # a CPU tensor is never captured
    monkeypatch.setattr(capture, "capturing", lambda q: True)
    assert picked(**call(1, long_T // 4, 32))[0] == "gluon"             # short, but under capture


def test_gluon_backend_reasons_without_interpreter(monkeypatch):
    """Outside the interpreter the reason names the device."""
    from linattn.ops.gated_delta_rule.gluon import backend
    from linattn.testing import make_gdn_inputs
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = make_gdn_inputs(1, 10, 1, 2, 128, 128, dtype=torch.bfloat16, device="cpu")
    ok, reason = backend.supports(**x)
    assert not ok and "sm_90" in reason


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


def _jit_compile_main():
    """Child process: drive the real JIT launch path (binder, specialisation, compile) with the launcher's own
    arguments on CPU tensors, under a stand-in driver that reports an sm_90a target and never launches (warmup).
    Prints one JSON line per kernel."""
    import json

    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.launcher import cached_state_args, state_config

    use_compile_only_sm90_driver()
    for B, T, dtype, h0 in ((1, 300, torch.bfloat16, True), (8, 100, torch.float16, False)):
        plan, bufs = _plan_and_buffers(B, T, 16, 32, dtype=dtype)
        if not h0:
            bufs = bufs[:6] + (None,) + bufs[7:]
        cfg = state_config(plan.N, 32, 128, num_sms=132)
        sp, args = cached_state_args(*bufs, plan, cfg)
        k = sp.kernel.warmup(*args, grid=sp.grid, **sp.options)
        print(json.dumps(dict(B=B, dtype=str(dtype), BV=cfg.BV, stages=cfg.stages,
                              num_warps=k.metadata.num_warps, shared=k.metadata.shared,
                              tma_boxes=[m["block_size"] for m in (k.metadata.tensordesc_meta or [])])))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    """The JIT path the GPU takes (launcher args -> binder -> specialisation -> compile) works for bf16 and fp16,
    with and without initial state, with the TMA boxes the launcher meant."""
    from compile_only import jit_child_rows      # tests/ is on sys.path
    rows = jit_child_rows(__file__, timeout=900)
    assert len(rows) == 2
    for r in rows:
        assert r["num_warps"] == 4, r
        assert 0 < r["shared"] <= SMEM_LIMIT_SM90, r
        # w and k [64,128] boxes go as [64,64] messages (128-byte swizzle); u [64,BV]; h [128,BV]
        assert r["tma_boxes"] == [[64, 64], [64, 64], [64, r["BV"]], [128, r["BV"]]], r


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["jit"]:
        _jit_compile_main()

