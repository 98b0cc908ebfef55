"""KDA's Gluon stage 2a (linattn/ops/kda/gluon/intra.py) on a CPU host: its sm_90a build, its launch arguments against
the AOT signature, the backend's refusal off a Hopper GPU, and its formulas in torch (every pair through its row
block's first row, operands rounded to bf16, the chunks flagged pairwise replaced by their in-block pairs) against the
Triton stage 2a under the interpreter. The kernel itself runs only on a GPU (gate section kda)."""
import math

import pytest
import torch

from markers import built, needs_gluon   # tests/ is on sys.path

NAME = "kda_fwd_gluon_intra_w4"


@needs_gluon
def test_build_fits_and_uses_the_tensor_cores():
    """The registered build (H16/HV32, K=128): Aqk and Akk by mma.sync, a warp per row block: 128 HMMA 16x8x16
    (two products, two key tiles of 64, 8 column tiles of 8 and 4 k-steps each per warp) plus the block
    substitution's 30; no warpgroup_mma; within the 227 KB of shared memory, no spill."""
    rep = built(NAME)
    assert rep.smem <= 2 ** 17, rep.smem
    assert rep.families["HGMMA"] == 0 and rep.sass.get("HMMA.16816.F32.BF16") == 128 + 30, rep.sass


@pytest.mark.parametrize("B,T,lens,gate", [(1, 8192, None, ""), (2, 100, None, "softplus"),
                                           (1, 0, [1, 63, 1, 65, 70], "lower_bound")])
def test_launch_matches_aot_signature(monkeypatch, B, T, lens, gate):
    """kda_intra_gluon's launch (with kg, as the fused forward calls it): one program per (chunk slot, value head);
    without a gate its arguments mangle to the AOT signature; every constexpr of the kernel is passed (with a gate,
    A_log and dt_bias as tensors)."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.gluon import host
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.kda.aot import kda_intra_gluon_signature
    from linattn.ops.kda.gluon import intra

    calls = []
    monkeypatch.setattr(host, "launches", lambda kernel, grid, args, kwargs: calls.append((kernel, grid, args,
                                                                                              kwargs)))
    H, HV, K = 16, 32, 128
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    T = T if lens is None else sum(lens)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    q = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    g, beta = torch.randn(B, T, HV, K), torch.rand(B, T, HV)
    A_log, dt_bias = (torch.randn(HV), torch.randn(HV * K)) if gate else (None, None)
    T_tot = plan.T_total
    outs = [torch.empty(T_tot, HV, K), torch.empty(T_tot, HV), torch.empty(T_tot, HV, 64, dtype=torch.bfloat16),
            torch.empty(T_tot, HV, 64, dtype=torch.bfloat16), torch.empty(T_tot, HV, K, dtype=torch.bfloat16),
            torch.empty(T_tot, HV, K, dtype=torch.bfloat16), torch.empty(T_tot, HV, K, dtype=torch.bfloat16)]
    intra.kda_intra_gluon(q, q, g, beta, A_log, dt_bias, gate, -5.0, bool(gate), False, plan, HV, *outs)
    (kernel, grid, args, kwargs), = calls
    assert grid == (plan.num_slots, HV)
    sig = kda_intra_gluon_signature()
    assert list(kernel.arg_names[:len(args)]) == list(sig)
    if not gate:
        for (name, want), arg in zip(sig.items(), args):
            assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    else:
        assert args[4] is A_log and args[5] is dt_bias
    assert sorted(kernel.arg_names[len(args):]) == sorted(n for n in kwargs if n != "num_warps")
    assert kwargs["GATE"] == gate and kwargs["HAS_DT_BIAS"] == bool(gate) and kwargs["num_warps"] == 4
    assert kwargs["LOWER_BOUND"] == (-5.0 if gate == "lower_bound" else 0.0)


def test_gluon_backend_refuses_off_hopper_and_auto_keeps_triton():
    """On this host chunk_kda(backend="gluon") is refused with the reason (the interpreter or no sm_90 device), auto
    passes it over with that reason, and auto's filter leaves disable_recompute's autograd forward (W, h, Vnew kept)
    to the Triton backend, not forwards with autograd in general."""
    import linattn
    from linattn.backends import BackendError, op_backends
    x = dict(q=torch.randn(1, 64, 1, 64), k=torch.randn(1, 64, 1, 64), v=torch.randn(1, 64, 1, 64),
             g=-torch.rand(1, 64, 1, 64), beta=torch.rand(1, 64, 1))
    with pytest.raises(BackendError, match="gluon.*(TRITON_INTERPRET|sm_90|cpu)"):
        linattn.chunk_kda(**x, backend="gluon")
    ob = op_backends("chunk_kda")
    assert ob.select("auto", **x).name == "triton"
    assert any(n == "gluon" and not ok and reason for n, ok, reason in ob.explain(**x))
    filt = ob.backends["gluon"].auto_filter
    assert filt(**x) == (True, "")
    xg = dict(x, q=x["q"].requires_grad_())
    assert filt(**xg) == (True, "")
    ok, reason = filt(**xg, disable_recompute=True)
    assert not ok and "disable_recompute" in reason
    with torch.no_grad():
        assert filt(**xg, disable_recompute=True) == (True, "")
    with torch.no_grad():
        assert filt(**x)[0]


def _model_stage2a(q, k, g, beta, pairwise_bits=100.0):
    """The kernel's formulas for one chunk [64, K] (fp64 but for the bf16 operand roundings): (Aqk, Tinv, flagged)."""
    gam = g.cumsum(0)
    i = torch.arange(64)
    before = torch.cat([torch.zeros_like(gam[:1]), gam])      # before[r]: gam before row r (0 before the chunk)
    d = gam - before[16 * (i // 16)]
    amax = max(1.0, float(k.abs().max()), float(q.abs().max()))
    flagged = not (float(d.abs().max()) * math.log2(math.e) + 2 * math.log2(amax) <= pairwise_bits)
    rnd = lambda x: x.to(torch.bfloat16).double()  # noqa: E731
    kl, ql = rnd(k * d.exp()), rnd(q * d.exp())
    akk, aqk = torch.zeros(64, 64, dtype=torch.float64), torch.zeros(64, 64, dtype=torch.float64)
    for blk in range(4):
        e = torch.where((i // 16 <= blk)[:, None], before[16 * blk][None, :] - gam, -math.inf).exp()
        kr = rnd(k * e)
        rows = i // 16 == blk
        akk[rows] = (kl @ kr.T)[rows]
        aqk[rows] = (ql @ kr.T)[rows]
    if flagged:
        same = (i[:, None] // 16) == (i[None, :] // 16)
        pair = (gam[:, None, :] - gam[None, :, :]).clamp(max=0).exp()
        akk = torch.where(same, (k[:, None, :] * k[None, :, :] * pair).sum(-1), akk)
        aqk = torch.where(same, (q[:, None, :] * k[None, :, :] * pair).sum(-1), aqk)
    a = torch.tril(akk, -1) * beta[:, None]
    return torch.tril(aqk), torch.linalg.inv(torch.eye(64, dtype=torch.float64) + a), flagged


@pytest.mark.parametrize("decay", [0.05, 8.0])       # no chunk flagged; every chunk flagged pairwise
def test_formulas_match_the_triton_stage(decay):
    """The kernel's formulas give the Triton stage 2a's Aqk and Tinv (interpreter, fp32) to bf16 operand precision
    (relative RMS < 1e-2; a wrong reference row, mask or selection is O(1) off), with slow decays (no chunk flagged)
    and strong ones (every chunk flagged pairwise: its in-block products overflow and are replaced)."""
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    from linattn.testing.compare import rel_rms
    T, H, K = 128, 1, 32
    q, k, v = torch.randn(1, T, H, K), torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1), \
        torch.randn(1, T, H, K)
    g = -torch.rand(1, T, H, K) * decay
    beta = torch.rand(1, T, H)
    _, _, it = chunk_kda_fwd(q, k, v, g, beta, K ** -0.5, None, False, None, keep=True)
    for c in range(T // 64):
        s = slice(64 * c, 64 * c + 64)
        aqk, tinv, flagged = _model_stage2a(q[0, s, 0].double(), k[0, s, 0].double(), g[0, s, 0].double(),
                                            beta[0, s, 0].double())
        assert flagged == (decay > 1)
        assert rel_rms(it.aqk[s, 0].double(), aqk) < 1e-2
        assert rel_rms(it.tinv[s, 0].double(), tinv) < 1e-2


@needs_gluon
@pytest.mark.parametrize("name", ["kda_fwd_gluon_fused_bv64_s2_nwu1", "kda_fwd_gluon_fused_bv32_s2_nwu2"])
def test_fused_builds_fit(name):
    """The fused stages 2b-4 at both configs of kda_fused_config: TMA, wgmma and mbarriers present, no spill, within
    sm_90's shared memory (two W buffers at BV = 64 would not be)."""
    built(name)


@pytest.mark.parametrize("N,HV,sms,want", [(1, 32, 132, (32, 2)), (8, 32, 132, (64, 1)), (2, 32, 132, (32, 2)), (3, 32, 132, (64, 1)),
                                           (1, 8, 132, (32, 2))])
def test_fused_config(N, HV, sms, want):
    from linattn.ops.kda.gluon.fused_forward import kda_fused_config
    assert kda_fused_config(N, HV, 128, sms) == want


@pytest.mark.parametrize("lens,states", [(None, True), ([1, 63, 1, 65, 70], False)])
def test_fused_launch_matches_aot_signature(monkeypatch, lens, states):
    """kda_fused_forward's launch: descriptors over Qdec, Kdec, Kg ([64, 128] boxes), v ([64, BV]), Tinv and Aqk
    ([64, 64]); its arguments mangle to the AOT signature (states None: constexpr), every constexpr passed, grid
    (V / BV, N * HV)."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.gluon import host
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.kda.aot import kda_fused_signature
    from linattn.ops.kda.gluon import fused_forward as ff
    from linattn.runtime import device as device_mod

    calls = []
    monkeypatch.setattr(host, "launches", lambda kernel, grid, args, kwargs: calls.append((kernel, grid, args,
                                                                                              kwargs)))
    monkeypatch.setattr(device_mod, "device_facts", lambda dev: type("F", (), {"num_sms": 132})())
    HV, K, B = 32, 128, 1
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    T = 300 if lens is None else sum(lens)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    bf = dict(dtype=torch.bfloat16)
    x = lambda *s, **kw: torch.empty(*s, **kw)  # noqa: E731
    t3 = lambda w: x(T, HV, w, **bf)  # noqa: E731
    N = plan.N
    h0, fin = (x(N, HV, K, K), x(N, HV, K, K)) if states else (None, None)
    ff.kda_fused_forward(t3(K), t3(K), t3(K), x(B, T, HV, K, **bf), t3(64), t3(64), x(T, HV), x(T, HV, K),
                         x(B, T, HV, K, **bf), h0, fin, plan, K ** -0.5)
    (kernel, grid, args, kwargs), = calls
    BV, nwu = ff.kda_fused_config(N, HV, K, 132)
    sig = kda_fused_signature(BV, states)
    assert list(kernel.arg_names[:len(args)]) == list(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert sorted(kernel.arg_names[len(args):]) == sorted(n for n in kwargs if n != "num_warps")
    assert grid == (K // BV, N * HV) and kwargs["NWU"] == nwu and kwargs["USE_H0"] == states


def test_gluon_forward_routes_stages(monkeypatch):
    """chunk_kda_fwd(intra="gluon"): the Gluon stage 2a with kg and then the fused stages where nothing is kept and
    the shapes fit (gcum at each chunk's last row only, unless the autograd forward saves stage 2a's outputs: then
    every row, and those four tensors come back); with state_v_first the Gluon stage 2a (no kg) then the Triton
    stages 2b-4."""
    from linattn.ops.kda.gluon import fused_forward as ff
    from linattn.ops.kda.gluon import intra
    from linattn.ops.kda.triton import forward as fw
    seen = []
    monkeypatch.setattr(intra, "kda_intra_gluon",
                        lambda *a, gcum_last: seen.append(("intra", a[-1] is not None, gcum_last)))
    monkeypatch.setattr(ff, "kda_fused_forward", lambda *a: seen.append(("fused",)))
    monkeypatch.setattr(fw, "_after_intra", lambda *a, **kw: seen.append(("triton",)) or (None, None))
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    g, beta = -torch.rand(1, 64, 2, 128), torch.rand(1, 64, 2)
    fw.chunk_kda_fwd(q, q, q, g, beta, 0.1, None, True, None, intra="gluon")
    assert seen == [("intra", True, True), ("fused",)]
    seen.clear()
    out = fw.chunk_kda_fwd(q, q, q, g, beta, 0.1, None, True, None, intra="gluon", save_stage2a=True)
    assert seen == [("intra", True, False), ("fused",)]
    gcum, beta_eff, tinv, aqk = out[2]
    assert gcum.shape == (64, 2, 128) and gcum.dtype == torch.float32 and beta_eff.shape == (64, 2)
    assert tinv.dtype == aqk.dtype == torch.bfloat16 and tinv.shape == aqk.shape == (64, 2, 64)
    seen.clear()
    fw.chunk_kda_fwd(q, q, q, g, beta, 0.1, None, True, None, intra="gluon", state_v_first=True)
    assert seen == [("intra", False, False), ("triton",)]


def _fused_model(qdec, kdec, kg, v, tinv, aqk, beta, gcum, h0, B: int, T: int, scale: float):
    """The fused stages 2b-4 in torch (fp64) for B sequences of T tokens ([B * T, HV, .] rows of stage 2a's outputs,
    v [B, T, HV, V], h0 [B, HV, K, V] or None), per chunk: W = (Tinv diag(beta)) Kg, U = (Tinv diag(beta)) V,
    vnew = U - W S, o = (Qdec S + Aqk vnew) scale, S <- diag(exp(gam_C)) S + Kdec^T vnew, gam_C the chunk's last valid
    row of gcum. Returns (o [B, T, HV, V], final [B, HV, K, V])."""
    d = lambda t: t.double()  # noqa: E731
    HV, K, V = kdec.shape[1], kdec.shape[2], v.shape[-1]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    fin = torch.zeros(B, HV, K, V, dtype=torch.float64)
    for n in range(B):
        for h in range(HV):
            S = d(h0[n, h]) if h0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for t0 in range(0, T, 64):
                r = slice(n * T + t0, n * T + min(t0 + 64, T))
                c = r.stop - r.start
                tb = d(tinv[r, h, :c]) * d(beta[r, h])[None, :]
                w, u = tb @ d(kg[r, h]), tb @ d(v[n, t0:t0 + c, h])
                vnew = u - w @ S
                o[n, t0:t0 + c, h] = (d(qdec[r, h]) @ S + d(aqk[r, h, :c]) @ vnew) * scale
                S = d(gcum[r.stop - 1, h]).exp()[:, None] * S + d(kdec[r, h]).T @ vnew
            fin[n, h] = S
    return o, fin


def test_fused_stage_formulas_match_the_triton_forward():
    """The fused kernel's formulas in torch (fp64, _fused_model) from stage 2a's outputs, with Kg = K exp(gam),
    partial last chunks included: they give the Triton forward's o and final state (interpreter, fp32) to 1e-5."""
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    from linattn.testing.compare import rel_rms
    T, H, K, V = 150, 2, 32, 16
    q = torch.randn(1, T, H, K)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1)
    v = torch.randn(1, T, H, V)
    g = -torch.rand(1, T, H, K) * 0.3
    beta, h0, scale = torch.rand(1, T, H), torch.randn(1, H, K, V), K ** -0.5
    o_ref, fin_ref = chunk_kda_fwd(q, k, v, g, beta, scale, h0, True, None)
    _, _, it = chunk_kda_fwd(q, k, v, g, beta, scale, h0, True, None, keep=True)
    kg = k[0].double() * it.gcum.double().exp()
    o, fin = _fused_model(it.qdec, it.kdec, kg, v, it.tinv, it.aqk, it.beta, it.gcum, h0, 1, T, scale)
    assert rel_rms(o_ref.double(), o) < 1e-5 and rel_rms(fin_ref.double(), fin) < 1e-5


def test_autograd_forward_on_the_gluon_stages(monkeypatch):
    """The gluon backend's training path on a CPU: its two Gluon launches stand in by the Triton stage 2a's outputs
    (Tinv rounded to q's dtype, as the Gluon solve stores it) and _fused_model; the rest is the real path: the custom
    op saves gcum (every row: the stage is asked for it), beta, the bf16 Tinv and Aqk, and the Triton backward
    (interpreter) rebuilds from them. o, the final state and every gradient match fp64 at bf16's tolerance, and the
    backward's WY kernel read the bf16 Tinv."""
    from linattn.ops.kda import chunk as kda_chunk
    from linattn.ops.kda.gluon import fused_forward as ff
    from linattn.ops.kda.gluon import intra
    from linattn.ops.kda.reference import naive_recurrent_kda
    from linattn.ops.kda.triton import backward as bw
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    from linattn.testing import TOL, assert_close
    B, T, H, K, V = 2, 100, 2, 32, 16
    bf = torch.bfloat16
    seen = []

    def stage2a(q, k, g, beta, A_log, dt_bias, gate, lb, bs, ne, plan, HV, gcum, beta_eff, tinv, aqk, kdec, qdec,
                kg=None, gcum_last=False):
        seen.append((kg is not None, gcum_last))
        z = torch.zeros(*q.shape[:3], V, dtype=q.dtype)
        _, _, it = chunk_kda_fwd(q, k, z, g, beta, 1.0, None, False, None, A_log, dt_bias, gate, lb, bs, ne,
                                 keep=True)
        for out, src in ((gcum, it.gcum), (beta_eff, it.beta), (tinv, it.tinv), (aqk, it.aqk), (kdec, it.kdec),
                         (qdec, it.qdec)):
            out.copy_(src.to(out.dtype))
        if kg is not None:
            kg.copy_((k.reshape(-1, H, K).float() * it.gcum.exp()).to(kg.dtype))

    def fused(qdec, kdec, kg, v, tinv, aqk, beta, gcum, o, h0, final, plan, scale):
        o_m, fin = _fused_model(qdec, kdec, kg, v, tinv, aqk, beta, gcum, h0, B, T, scale)
        o.copy_(o_m.to(o.dtype))
        if final is not None:
            final.copy_(fin.float())

    monkeypatch.setattr(intra, "kda_intra_gluon", stage2a)
    monkeypatch.setattr(ff, "kda_fused_forward", fused)
    monkeypatch.setattr(ff, "kda_fused_supported", lambda *a: (True, ""))
    wy_tinv = []
    real_wy = bw.kda_wy_bwd_kernel

    class WySpy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                wy_tinv.append(args[5].dtype)
                return real_wy[grid](*args, **kw)
            return launch

    monkeypatch.setattr(bw, "kda_wy_bwd_kernel", WySpy())
    x = dict(q=torch.randn(B, T, H, K).to(bf), k=torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(bf),
             v=torch.randn(B, T, H, V).to(bf), g=torch.nn.functional.logsigmoid(torch.randn(B, T, H, K) + 3.0),
             beta=torch.rand(B, T, H), initial_state=torch.randn(B, H, K, V) * 0.5)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, ht = kda_chunk._triton_impl(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], K ** -0.5,
                                   leaves["initial_state"], True, None, None, None, "", 0.0, False, False, False,
                                   intra="gluon")
    do, dht = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    assert seen == [(True, False)] and wy_tinv == [bf]
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    o_ref, ht_ref = naive_recurrent_kda(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], K ** -0.5,
                                        ref["initial_state"], True)
    ((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum()).backward()
    tol = TOL[bf]
    assert_close("o", o, o_ref, tol)
    assert_close("final_state", ht, ht_ref, tol)
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype, n
        assert_close(f"d{n}", t.grad, ref[n].grad, tol)


@pytest.mark.parametrize("shape,v_first,why", [((1, 64, 2, 64), False, "K=64"), ((1, 64, 2, 128), True,
                                                                                  "state_v_first"),
                                               ((1, 0, 2, 128), False, "no tokens")])
def test_fused_refuses_with_reason(shape, v_first, why):
    """kda_fused_supported names why the Triton stages 2b-4 run instead (the Gluon stage 2a may still run)."""
    from linattn.ops.kda.gluon.fused_forward import kda_fused_supported
    q = torch.empty(*shape, dtype=torch.bfloat16)
    ok, reason = kda_fused_supported(q, q, v_first)
    assert not ok and why in reason, reason
    assert kda_fused_supported(torch.empty(2, 64, 2, 128, dtype=torch.bfloat16),
                               torch.empty(2, 64, 4, 128, dtype=torch.bfloat16), False) == (True, "")


@pytest.mark.parametrize("intra,save,tinv_dtype", [("gluon", 1, torch.bfloat16), ("triton", 1, torch.float32),
                                                   ("gluon", 2, torch.float32)])
def test_fake_forward_saves_the_backends_tinv(intra, save, tinv_dtype):
    """torch.compile's view of the autograd forward (the custom op's fake): stage 2a's saved Tinv comes in q's dtype
    from the Gluon stages (as chunk_kda_fwd(save_stage2a=True) returns it) and in fp32 from the Triton ones, which
    disable_recompute's forward (save 2) always runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import linattn.ops.kda.chunk  # noqa: F401  (registers the op)
    with FakeTensorMode():
        q = torch.empty(1, 128, 2, 64, dtype=torch.bfloat16)
        g, beta = torch.empty(1, 128, 2, 64), torch.empty(1, 128, 2)
        out = torch.ops.linattn.chunk_kda_fwd(q, q, q, g, beta, 0.125, None, False, None, None, None, "", 0.0,
                                              False, False, False, save, intra)
    assert out[4].dtype == tinv_dtype and out[4].shape == (128, 2, 64)
    assert out[2].dtype == torch.float32 and out[2].shape == (128, 2, 64)


def test_gluon_state_hooks_fall_back_to_triton_off_cuda():
    """The gluon backend's backward passes both state passes as hooks (kda/gluon/state.py: the recompute's and the
    reverse one); where the Gluon kernels cannot run (here: CPU tensors) they hand the same arguments to the Triton
    passes, so the backward with the hooks gives bit-for-bit the gradients it gives without them (slow decays, varlen
    with a 1-token sequence, initial state and a final-state gradient)."""
    from linattn.ops.kda.gluon.state import kda_state_fwd_gluon_wanted, kda_state_gluon_supported
    from linattn.ops.kda.chunk import SAVE_STAGE2A
    # the recompute's Gluon pass only where it runs 32 value columns (B1 / B2 at H32 on 132 SMs), as measured
    assert [kda_state_fwd_gluon_wanted(N, 32, 128, 132) for N in (1, 2, 3, 8)] == [True, True, False, False]

    torch.manual_seed(torch.seed() % 2 ** 31)
    lens = [1, 70, 57]
    T, H, K = sum(lens), 2, 64
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    q, k = torch.randn(1, T, H, K), torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1)
    v = torch.randn(1, T, H, K)
    g = -(0.01 + 0.1 * torch.rand(1, T, H, K))
    beta = torch.rand(1, T, H)
    h0 = torch.randn(len(lens), H, K, K)
    ok, reason = kda_state_gluon_supported(q[0], v)
    assert not ok and "cpu" in reason, reason
    out = torch.ops.linattn.chunk_kda_fwd(q, k, v, g, beta, K ** -0.5, h0, True, cu, None, None, "", 0.0, False,
                                          False, False, SAVE_STAGE2A, "triton")
    saved = list(out[2:6])
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    grads = [torch.ops.linattn.chunk_kda_bwd(q, k, v, g, beta, K ** -0.5, h0, cu, None, None, "", 0.0, False, False,
                                             False, do, dht, saved, hooks) for hooks in (False, True)]
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[0], grads[1]):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, name
        assert torch.equal(a, b), name
