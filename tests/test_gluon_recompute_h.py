"""The backward's recompute of h on sm_90a (gluon/recompute.py: stage 2a with Tinv in fp32 and 16-bit, W, then the
gate-free kernel's state-only mode, chunk_fused_gf.py) on a CPU host: the state-only builds for sm_90a, their launch
arguments against the AOT signatures, the schedule model of the state-only mode (testing/fused_model.emulate_fused
with h_out) driven by recompute_h_gluon against the Triton recompute and the fp64 recurrence (plain, varlen, the
forward's segments with steep, slow and mixed decay), and the Triton backward with that recompute against fp64
autograd. The kernel itself runs only on a GPU (benchmarks/gpu/gate.py, section bwd)."""
import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

from test_gluon_fused_wu import SMEM_LIMIT_SM90, _buffers  # tests/ on sys.path

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


@needs_gluon
@pytest.mark.parametrize("suffix", ["", "_warm", "_sel"])
def test_state_only_builds(suffix):
    """sm_90a: 12 warps (two state warpgroups, the producer warp's padded warpgroup), 0 spill and no local memory,
    shared memory in budget and below the forward's (no q ring, no published vnew), HGMMA, TMA loads and the TMA
    store of h, no mma.sync."""
    from linattn.ops.gated_delta_rule.gluon.aot import gf_state_only_kernel_name
    rep = inspect_kernel(kernels()[gf_state_only_kernel_name(suffix)])
    assert not rep.missing, f"intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0 and rep.families["STL"] == 0 and rep.families["LDL"] == 0, (rep.spill_bytes, rep.sass)
    assert rep.num_warps == 12 and 0 < rep.smem <= 140 * 1024 < SMEM_LIMIT_SM90, (rep.num_warps, rep.smem)
    assert rep.families["HMMA"] == 0 and rep.families["UTMASTG"] >= 2


def _state_only_bufs(B, T, HV, lens=None, h0=True):
    plan, (q, k, v, beta, gcum, tinv, o, h0_, fin) = _buffers(B, T, 16, HV, lens, states=h0)
    h = torch.zeros(plan.num_slots, HV, 128, 128, dtype=k.dtype)
    vnew = torch.zeros(plan.T_total, HV, 128, dtype=k.dtype)
    return plan, (k, v, beta, gcum, tinv, h, vnew, h0_)


@needs_gluon
@pytest.mark.parametrize("mode", ["plain", "sel", "warm"])
def test_state_only_launch_matches_aot_signature(mode):
    """gf_state_only_launch's arguments mangle to the registered build's signature (q, o and the final state None,
    h's descriptor [128, 64] boxes over [slots * HV * 128, 128]); one CTA per (sequence or segment, value head)."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_gf_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import gf_state_only_launch
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    plan, bufs = _state_only_bufs(1, 4096, 32)
    kw = {}
    if mode == "sel":
        kw = dict(select=torch.zeros(1, 32, dtype=torch.int32))
    elif mode == "warm":
        kw = dict(select=torch.zeros(1, 32, dtype=torch.int32), seg=torch.zeros(4, 32, dtype=torch.int32))
        plan = segment_plan(1, 4096, 4, 16, "cpu")
    kernel, grid, args, kwargs = gf_state_only_launch(*bufs, plan, **kw)
    sig = fused_gf_signature("bf16", select=mode != "plain", warm=mode == "warm", state_only=True)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (plan.N * 32,) and kwargs["STORE_HT"] is False and kwargs["USE_H0"] is True
    assert args[14].block_shape == [128, 64] and list(args[14].shape) == [bufs[5].shape[0] * 32 * 128, 128]
    with pytest.raises(ValueError, match="tinv_lo is"):
        gf_state_only_launch(*bufs[:4], bufs[4][:-1], *bufs[5:], plan, **kw)
    with pytest.raises(ValueError, match="h must be"):
        gf_state_only_launch(*bufs[:5], bufs[5][:, :16], *bufs[6:], plan, **kw)


def test_segment_plan_slots_are_the_sequence_slots():
    """The segment launch stores h at its plan's chunk offsets: those are the sequence plan's slots of each segment's
    first chunk (segment s of sequence n starts at slot n * chunks + s * L), T a multiple of 64 or not."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    for B, T, S, L in ((1, 4096, 4, 16), (2, 2047, 2, 16), (3, 5000, 3, 27)):
        nch = -(-T // 64)
        seq = make_chunk_plan(B, T, None, 64, "cpu")
        sp = segment_plan(B, T, S, L, "cpu")
        want = [n * nch + s * L for n in range(B) for s in range(S)]
        assert sp.chunk_offsets[:B * S].tolist() == want and seq.num_slots == B * nch, (B, T, S, L)
        assert sp.chunk_offsets[B * S].item() == B * nch


def _model(seed, stages=2, npub=1):
    from linattn.testing.fused_model import emulate_fused

    def run(k, v, beta, gcum, tinv_lo, h, vnew, h0, plan, select=None, seg=None):
        emulate_fused(None, k, v, beta, gcum, tinv_lo, None, h0, None, plan, 1.0, BV=v.shape[-1], stages=stages,
                      npub=npub, gate_free=True, select=select, seg=seg, h_out=h, vnew_out=vnew, seed=seed)
    return run


def _gdn(B, T, lens, H, HV, KV, dtype, h0, seed, decay=None):
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(seed)
    N = B if lens is None else len(lens)
    x = make_gdn_inputs(B, T, H, HV, KV, KV, dtype=dtype, num_states=N, initial_state=h0, generator=gen)
    if decay == "steep":
        x["g"] = x["g"] * 0 - 0.32                      # -20 every chunk: one-chunk windows
    elif decay == "mixed":                              # head 0 steep, head 1 without decay (its pair unsegmented)
        x["g"] = torch.stack([x["g"][..., 0] * 0 - 0.32, x["g"][..., 1] * 0], -1).contiguous()
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    return x, cu


RECOMPUTE_CASES = [  # (B, T, lens, dtype, h0, segments, decay)
    (1, 1, None, torch.bfloat16, True, None, None),
    (2, 130, None, torch.float16, False, None, None),
    (1, 260, [1, 63, 1, 130, 64, 1], torch.bfloat16, True, None, None),
    (1, 640, None, torch.bfloat16, True, (3, 4), "steep"),
    (2, 600, None, torch.bfloat16, True, (2, 5), "mixed"),
    (1, 520, None, torch.float16, False, (3, 3), None),      # default gates: slow, every pair unsegmented
]


@pytest.mark.parametrize("B,T,lens,dtype,h0,segments,decay", RECOMPUTE_CASES)
def test_recompute_model_matches_triton_recompute(device, B, T, lens, dtype, h0, segments, decay):
    """recompute_h_gluon with the state-only schedule model (K = V = 32, stage 2a, W and the segment windows under
    the interpreter), every output NaN-poisoned, fresh inputs and interleaving per run: gcum, fp32 Tinv and W
    bit-identical to the Triton recompute's (the same kernels), h (every slot: no chunk left unwritten, warm-up
    chunks not stored over the previous segment's) and vnew within TOL of the fp64 recurrence's chunk-start states
    and corrected values, and of the Triton recompute's."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.recompute import recompute_h_gluon
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x, cu = _gdn(B, T, lens, 1, 2, 32, dtype, h0, seed, decay)
    args = (x["k"], x["v"], x["g"], x["beta"], x["initial_state"], cu)
    with poisoned_allocations():
        rc = recompute_h_gluon(*args, segments=segments or (1, -(-T // 64)), state_pass=_model(seed))
        ref = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 1.0, x["initial_state"], False,
                                         cu, store_tinv=True, plan=rc.plan, compute_output=False)
    assert torch.equal(rc.gcum, ref.gcum) and torch.equal(rc.tinv, ref.tinv) and torch.equal(rc.w, ref.w)
    assert rc.beta is x["beta"] and rc.h.dtype == dtype and rc.vnew.dtype == dtype
    h64, vn64 = _chunk_states_fp64(x, cu, rc.plan)
    used = int(rc.plan.chunk_offsets[-1])              # varlen: num_slots is a bound; the slots past it are unused
    tol = TOL[dtype]
    for name, got, want, trit in (("h", rc.h[:used], h64[:used], ref.h[:used]), ("vnew", rc.vnew, vn64, ref.vnew)):
        assert torch.isfinite(got).all(), (name, seed)
        err, err_t = rel_rms(got, want), rel_rms(trit, want)
        assert err < tol and rel_rms(got, trit) < tol, (name, err, err_t, seed)


def _chunk_states_fp64(x, cu, plan):
    """h (each chunk's start state) and vnew (Tinv diag(beta) (V - diag(e^gam) K S)) in fp64 by the chunk form
    (gdn-math.md), chunk by chunk with an exact inverse, in the plan's slots."""
    k, v, g, beta = (x[n].double() for n in ("k", "v", "g", "beta"))
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    k, v, g, beta = k.reshape(-1, H, K), v.reshape(-1, HV, V), g.reshape(-1, HV), beta.reshape(-1, HV)
    bounds = plan.cu.tolist()
    offs = plan.chunk_offsets.tolist()
    h = torch.zeros(plan.num_slots, HV, K, V, dtype=torch.float64)
    vn = torch.zeros(plan.T_total, HV, V, dtype=torch.float64)
    for n in range(plan.N):
        bos, eos = bounds[n], bounds[n + 1]
        for hv in range(HV):
            hk = hv // (HV // H)
            S = (x["initial_state"][n, hv].double() if x["initial_state"] is not None
                 else torch.zeros(K, V, dtype=torch.float64))
            for c, t0 in enumerate(range(bos, eos, 64)):
                h[offs[n] + c, hv] = S
                t1 = min(t0 + 64, eos)
                gam = g[t0:t1, hv].cumsum(0)
                kc, vc, bc = k[t0:t1, hk], v[t0:t1, hv], beta[t0:t1, hv]
                a = torch.tril((bc[:, None] * kc @ kc.T) * torch.exp(gam[:, None] - gam[None, :]), -1)
                tinv = torch.linalg.inv(torch.eye(t1 - t0, dtype=torch.float64) + a)
                vnew = tinv @ (bc[:, None] * (vc - torch.exp(gam)[:, None] * (kc @ S)))
                vn[t0:t1, hv] = vnew
                S = torch.exp(gam[-1]) * S + (torch.exp(gam[-1] - gam)[:, None] * kc).T @ vnew
    return h, vn


@pytest.mark.parametrize("B,T,lens,segments,decay,fused", [(1, 200, [1, 63, 70, 65, 1], None, None, True),
                                                           (1, 640, None, (3, 4), "mixed", True),
                                                           (1, 640, None, (3, 4), "mixed", False)])
def test_backward_with_recompute_model_matches_fp64(device, B, T, lens, segments, decay, fused):
    """The Triton backward with recompute_h_gluon (state-only model) as its recompute: dq, dk, dv, dg, dbeta and
    d initial_state within TOL of fp64 autograd through the recurrence, NaN-poisoned outputs, varlen with 1-token
    sequences and the segment path with a pair left unsegmented; the fused kernel (recompute without W and vnew)
    and the four-kernel path."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.recompute import recompute_h_gluon
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x, cu = _gdn(B, T, lens, 1, 2, 32, torch.bfloat16, True, seed, decay)
    scale = 32 ** -0.5
    names = ("q", "k", "v", "g", "beta", "initial_state")
    ref = {n: x[n].detach().double().requires_grad_() for n in names}
    o64, f64 = naive_recurrent(*(ref[n] for n in names[:5]), scale=scale, initial_state=ref["initial_state"],
                               output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(seed + 1)
    do, dht = torch.randn(o64.shape, generator=gen, dtype=torch.float64), torch.randn(f64.shape, generator=gen,
                                                                                      dtype=torch.float64)
    torch.autograd.backward([o64, f64], [do, dht])
    segs = segments or (1, -(-T // 64))

    def recompute(plan, fused_):
        return recompute_h_gluon(x["k"], x["v"], x["g"], x["beta"], x["initial_state"], cu, plan=plan,
                                 segments=segs, state_pass=_model(seed), store_vnew=not fused_, store_w=not fused_)
    with poisoned_allocations():
        got = chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], cu,
                                         do.to(torch.bfloat16), dht.float(), recompute=recompute,
                                         fused=fused)[:6]
    for name, gr in zip(names, got):
        err = rel_rms(gr, ref[name].grad)
        assert err < TOL[torch.bfloat16], (name, err, seed)


def test_recompute_rules_and_errors():
    """recompute_h_applies: V == 128 and where the forward runs the gate-free kernel (segments, or a wave of
    sequence-heads); the recompute refuses mixed or 32-bit dtypes and segments with cu_seqlens; the backward refuses
    FLA's options with a custom recompute."""
    from linattn.ops.gated_delta_rule.gluon.recompute import recompute_h_applies, recompute_h_gluon
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
    e = torch.empty
    assert recompute_h_applies(e(1, 65536, 16, 128), e(1, 65536, 32, 128), None)      # segments (4, 256)
    assert recompute_h_applies(e(8, 64, 16, 128), e(8, 64, 32, 128), None)            # 256 sequence-heads
    assert not recompute_h_applies(e(1, 8192, 16, 128), e(1, 8192, 32, 128), None)    # eager, short: V-split pass
    assert not recompute_h_applies(e(8, 64, 16, 128), e(8, 64, 32, 64), None)         # V = 64
    cu = torch.tensor([0, 65536])
    assert not recompute_h_applies(e(1, 65536, 16, 128), e(1, 65536, 32, 128), cu)
    k = torch.zeros(1, 64, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one 16-bit dtype"):
        recompute_h_gluon(k.float(), k.float(), None, None, None, None)
    with pytest.raises(ValueError, match="fixed-length batches only"):
        recompute_h_gluon(k, k, None, None, None, torch.tensor([0, 64]), segments=(2, 1))
    x = {n: torch.zeros(1, 64, 1, s, dtype=torch.bfloat16) for n, s in (("q", 32), ("k", 32), ("v", 32))}
    with pytest.raises(NotImplementedError, match="FLA's options"):
        chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], torch.zeros(1, 64, 1), torch.zeros(1, 64, 1), 1.0, None,
                                   None, x["v"], None, beta_scale=1, recompute=lambda plan, fused: None)
