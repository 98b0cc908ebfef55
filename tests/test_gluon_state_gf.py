"""The gluon backward's gate-free recompute (gluon/chunk_state_gf.py) on a CPU host: its sm_90a builds, its launch
arguments against the AOT signatures, and the Triton pieces it launches around the kernel (kkt_solve_kernel's 16-bit
copy of Tinv, wu_kernel's W-only launch) under the interpreter, and recompute_gf's host side (plans, segment words,
selections, h slots) with the kernel's torch model (testing/state_models.py) against the Triton recompute. The
kernel itself runs only on a GPU: the gate's `bwd` section checks every gradient of the gluon backend against fp64
through it (benchmarks/gpu/gate.py); the host path's launch list of the backward is checked in
test_bwd_host_path.py."""
import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

from test_gluon_fused_wu import SMEM_LIMIT_SM90  # tests/ on sys.path

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
PLAIN = "gdn_bwd_recompute_state_gf_gluon_bf16"


@needs_gluon
@pytest.mark.parametrize("name", [PLAIN, PLAIN + "_warm"])
def test_state_gf_build(name):
    """sm_90a: 16 warps (two state warpgroups, the store warpgroup, the producer warp's padded warpgroup), 0 spill
    and no local memory, shared memory in budget, TMA loads and stores, wgmma, no mma.sync and no cp.async."""
    rep = inspect_kernel(kernels()[name])
    assert not rep.missing, f"intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0 and rep.families["STL"] == 0 and rep.families["LDL"] == 0, (rep.spill_bytes, rep.sass)
    assert rep.num_warps == 16 and 0 < rep.smem <= SMEM_LIMIT_SM90, (rep.num_warps, rep.smem)
    assert rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0


def _buffers(B, T, H, HV, lens=None, dtype=torch.bfloat16):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    K = V = 128
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot = plan.T_total
    k, v = torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, HV, V, dtype=dtype)
    beta, gcum, tinv16 = torch.zeros(B, T, HV), torch.zeros(T_tot, HV), torch.zeros(T_tot, HV, 64, dtype=dtype)
    h, vnew = torch.zeros(plan.num_slots, HV, K, V, dtype=dtype), torch.zeros(T_tot, HV, V, dtype=dtype)
    return plan, (k, v, beta, gcum, tinv16, h, vnew, torch.zeros(plan.N, HV, K, V), None)


@needs_gluon
@pytest.mark.parametrize("B,T,lens,warm", [(1, 4096, None, False), (1, 3000, [1, 63, 65, 1000, 1871], False),
                                           (2, 8192, None, True)])
def test_state_gf_launch_matches_aot_signature(B, T, lens, warm):
    """state_gf_launch's arguments mangle to the AOT signature; one CTA per (sequence or segment, value head); the
    boxes: k, v, Tinv by [64, 128] / [64, 128] / [64, 64], h by [128, 128] over its [slots * HV * K, V] view, Vnew by
    [64, 128]. The segment launch (warm): the segment plan, select over the sequences, seg over the segments, T."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import state_gf_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_state_gf import state_gf_launch
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    plan, bufs = _buffers(B, T, 16, 32, lens)
    extra = {}
    if warm:
        S, L = 4, T // 64 // 4
        plan = segment_plan(B, T, S, L, "cpu")
        extra = dict(select=torch.zeros(B, 32, dtype=torch.int32),
                     seg=torch.zeros(B * S * 32, dtype=torch.int32), seq_len=T)
    kernel, grid, args, kwargs = state_gf_launch(*bufs, plan, **extra)
    sig = state_gf_signature("bf16", warm=warm)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (plan.N * 32,)
    assert [a.block_shape for a in args[:5]] == [[64, 128], [64, 128], [64, 64], [128, 128], [64, 128]]
    assert list(args[3].shape) == [bufs[5].shape[0] * 32 * 128, 128]
    assert kwargs["STORE_HT"] is False and kwargs["USE_H0"] is True and kwargs["BV"] == 128
    assert args[-1] == (T if warm else 0)
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")


def test_state_gf_launch_checks_its_buffers():
    """A 16-bit Tinv of the wrong shape or dtype, or an h in another dtype, is refused by name."""
    from linattn.ops.gated_delta_rule.gluon.chunk_state_gf import state_gf_launch
    plan, (k, v, beta, gcum, tinv16, h, vnew, h0, fin) = _buffers(1, 128, 2, 4)
    with pytest.raises(ValueError, match="tinv16"):
        state_gf_launch(k, v, beta, gcum, tinv16.float(), h, vnew, h0, fin, plan)
    with pytest.raises(ValueError, match="h and vnew"):
        state_gf_launch(k, v, beta, gcum, tinv16, h.float(), vnew, h0, fin, plan)


@pytest.mark.parametrize("B,T,lens,dtype", [(1, 150, None, torch.bfloat16), (2, 65, None, torch.float16),
                                            (1, 200, [1, 63, 70, 66], torch.bfloat16)])
def test_recompute_tinv16_and_w_only(device, B, T, lens, dtype):
    """The recompute's Triton launches on fresh inputs, outputs NaN-poisoned: kkt_solve_kernel's tinv16 is its fp32
    Tinv rounded to the operand dtype, element for element, and wu_kernel without U (u_ptr None, reading tinv16)
    writes the same W, bit for bit, as the launch that forms U too and reads the fp32 Tinv (which it rounds to the
    operand dtype first)."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.common import dot_precision
    from linattn.ops.gated_delta_rule.triton.intra_split import kkt_solve_kernel, split_intra_config, wu_kernel
    H, HV, K, V = 2, 4, 32, 32
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device=device).to(dtype)
    g = -torch.rand(B, T, HV, device=device) * 0.2
    beta = torch.rand(B, T, HV, device=device)
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device)
    plan = make_chunk_plan(B, T, cu, 64, device)
    T_tot, prec, cfg = plan.T_total, dot_precision(dtype), split_intra_config(K, V)

    def nan(*shape, dt=torch.float32):
        return torch.full(shape, float("nan"), device=device, dtype=dt)
    gcum, tinv, tinv16 = nan(T_tot, HV), nan(T_tot, HV, 64), nan(T_tot, HV, 64, dt=dtype)
    grid = (plan.num_slots, HV)
    kkt_solve_kernel[grid](k, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N, H=H, HV=HV, K=K, BT=64,
                           BK=cfg.BK_kkt, DOT_PREC=prec, tinv16_ptr=tinv16)
    assert torch.isfinite(tinv).all() and torch.equal(tinv16, tinv.to(dtype))
    w, u, w_only = nan(T_tot, HV, K, dt=dtype), nan(T_tot, HV, V, dt=dtype), nan(T_tot, HV, K, dt=dtype)
    consts = dict(H=H, HV=HV, K=K, V=V, BT=64, BK=cfg.BK, BV=cfg.BV, DOT_PREC=prec)
    wu_kernel[grid](k, v, beta, gcum, tinv, w, u, plan.cu, plan.chunk_indices, plan.N, **consts)
    wu_kernel[grid](k, v, beta, gcum, tinv16, w_only, None, plan.cu, plan.chunk_indices, plan.N, **consts)
    assert torch.isfinite(w).all() and torch.isfinite(u).all()
    assert torch.equal(w_only, w)


def test_recompute_hook_takes_the_default_options_only():
    """The backward's recompute hook (the gluon backend's) is refused with FLA's in-kernel gate, beta sigmoid or
    [N, HV, V, K] states: those run on the Triton recompute, which applies them."""
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
    q = torch.randn(1, 64, 1, 16)
    v, g, beta = torch.randn(1, 64, 1, 16), torch.zeros(1, 64, 1), torch.rand(1, 64, 1)

    def hook(*a):
        raise AssertionError("not to be called")
    for kw in (dict(A_log=torch.zeros(1)), dict(beta_scale=1), dict(state_v_first=True)):
        with pytest.raises(NotImplementedError, match="recompute hook"):
            chunk_gated_delta_rule_bwd(q, q, v, g, beta, 0.25, None, None, torch.randn_like(v), None, recompute=hook,
                                       **kw)


def _assert_states_close(got, ref, plan):
    """h (on the chunk slots the sequences fill: a varlen plan bounds its slot count from above, surplus slots stay
    unwritten), Vnew and W of a recompute within the bf16 tolerance of the reference recompute's."""
    from linattn.testing import TOL, rel_rms
    cus, offs = plan.cu.tolist(), plan.chunk_offsets.tolist()
    used = [o + c for n, o in enumerate(offs[:plan.N]) for c in range(-(-(cus[n + 1] - cus[n]) // 64))]
    for name in ("h", "vnew", "w"):
        a, b = getattr(got, name), getattr(ref, name)
        if name == "h":
            a, b = a[used], b[used]
        err = rel_rms(a, b)
        assert err < TOL[torch.bfloat16], (name, err)


@pytest.mark.parametrize("B,T,lens,h0,segments,decay", [
    (1, 150, None, True, None, "default"),
    (2, 130, None, False, None, "default"),            # T % 64 != 0: the next sequence's rows in the last box
    (1, 260, [1, 63, 65, 1, 130], True, None, "default"),   # varlen with 1-token sequences
    (1, 64 * 20, None, True, (4, 5), "steep"),          # segments with one-chunk warm-ups
    (2, 64 * 12 - 9, None, True, (4, 3), "steep_slow_odd"),   # segments, the odd heads flagged (run unsegmented)
])
def test_recompute_gf_with_the_kernel_model_matches_the_triton_recompute(device, B, T, lens, h0, segments, decay):
    """recompute_gf's host side (kkt_solve with the 16-bit Tinv, W alone, the window kernel, the segment plan and
    words, the flagged pairs' selection, the h slots) with testing/state_models.py in place of the Gluon kernel, on
    fresh inputs, outputs NaN-poisoned: h and Vnew within the bf16 tolerance of the Triton recompute's (W and U
    formed; fp32 Tinv), gcum and the fp32 Tinv equal to its, W within it; every h slot and Vnew row written."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.chunk_state_gf import recompute_gf
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import make_gdn_inputs
    from linattn.testing.state_models import emulate_state_gf
    H, HV, K, V = 2, 4, 32, 32
    N = B if lens is None else len(lens)
    x = make_gdn_inputs(B, T if lens is None else sum(lens), H, HV, K, V, dtype=torch.bfloat16, num_states=N,
                        initial_state=h0, generator=torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, ()))))
    if decay.startswith("steep"):       # ~-20 of log decay per chunk: warm-up windows of one chunk
        x["g"] = x["g"] * 0 - 0.32
    if decay.endswith("slow_odd"):
        x["g"][..., 1::2] *= 1e-3
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    q, k, v, g, beta, hs = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    plan = make_chunk_plan(q.shape[0], q.shape[1], cu, 64, device)
    with poisoned_allocations():
        got = recompute_gf(q, k, v, g, beta, hs, plan, segments=segments, state_pass=emulate_state_gf)
        ref = chunk_gated_delta_rule_fwd(q, k, v, g, beta, K ** -0.5, hs, False, cu, store_tinv=True,
                                         compute_output=False)
    _assert_states_close(got, ref, plan)
    assert torch.equal(got.gcum, ref.gcum) and torch.equal(got.tinv, ref.tinv)
    if decay.endswith("slow_odd"):      # the case reaches the flagged pairs' launch
        from linattn.ops.gated_delta_rule.triton.segment_start import segment_windows
        slow, _, _ = segment_windows(k, beta, g, plan, *segments)
        assert slow[:, 1::2].all() and not slow[:, 0::2].any()
    assert got.u is None and got.o is None


@pytest.mark.parametrize("B,T,lens,segments", [
    (2, 130, None, None),
    (1, 260, [1, 63, 65, 1, 130], None),
    (1, 64 * 20, None, (4, 5)),
])
def test_recompute_gf_takes_the_forwards_tinv_for_the_gluon_local_wy(device, B, T, lens, segments):
    """stage2a given (the gluon backward with its Gluon local/WY stage): gcum and Tinv are the forward's own stage 2a's
    as its autograd kept them (fused_forward.kkt_solve's, bit for bit: the Tinv the forward multiplied by),
    FwdResult.tinv is that 16-bit Tinv, and h, Vnew, W stay within the bf16 tolerance of the Triton recompute's (fp32
    Tinv). Fresh inputs, outputs NaN-poisoned."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.chunk_state_gf import recompute_gf
    from linattn.ops.gated_delta_rule.gluon.fused_forward import kkt_solve
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import make_gdn_inputs
    from linattn.testing.state_models import emulate_state_gf
    H, HV, K, V = 2, 4, 32, 32
    N = B if lens is None else len(lens)
    x = make_gdn_inputs(B, T if lens is None else sum(lens), H, HV, K, V, dtype=torch.bfloat16, num_states=N,
                        initial_state=True,
                        generator=torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31 - 1, ()))))
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    q, k, v, g, beta, hs = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    plan = make_chunk_plan(q.shape[0], q.shape[1], cu, 64, device)
    with poisoned_allocations():
        gcum_f, tinv_f = kkt_solve(k, g, beta, plan, HV)
        kept = gcum_f.clone(), tinv_f.clone()
        got = recompute_gf(q, k, v, g, beta, hs, plan, segments=segments, state_pass=emulate_state_gf,
                           stage2a=kept)
        ref = chunk_gated_delta_rule_fwd(q, k, v, g, beta, K ** -0.5, hs, False, cu, store_tinv=True,
                                         compute_output=False)
    assert got.tinv.dtype == k.dtype and torch.equal(got.tinv, tinv_f) and torch.equal(got.gcum, gcum_f)
    _assert_states_close(got, ref, plan)
