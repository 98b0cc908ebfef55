"""The Gluon stage 2a (gluon/kkt_solve.py, opt-in LINATTN_GDN_GLUON_KKT) on a CPU host: its sm_90a builds per form,
its launch arguments against the AOT signature, and the switch in chunk_fused_wu_ws.kkt_solve with its fallbacks.
The kernel itself runs only on a GPU: benchmarks/gpu/kkt_gluon_round.py checks each form's gcum and Tinv against the
Triton kernel and fp64, and the Gluon gate runs the whole forward with the switch on."""
import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
KKT = "gdn_fwd_kkt_solve_gluon_bf16"


def _plan_inputs(B, T, H, HV, lens=None, dtype=torch.bfloat16, K=128):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    cu = None
    if lens is not None:
        T = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype)     # l2-normalised, as models feed
    g = -torch.rand(B, T, HV)
    beta = torch.rand(B, T, HV)
    return k, g, beta, make_chunk_plan(B, T, cu, 64, "cpu")


FORM_STEPS = [KKT + "_r80", KKT + "_shift_r80", KKT + "_split_r80", KKT + "_ftz_r80"]


@needs_gluon
@pytest.mark.parametrize("step", range(len(FORM_STEPS)))
def test_kkt_forms_issue_fewer_instructions(step):
    """sm_90a at the 80-register cap: each form keeps the plain form's tensor-core work (16 HGMMA 64x64x16: K K^T
    once per value head; 60 HMMA: the block substitution), four warps, shared memory for six CTAs per SM, and issues
    fewer instructions than the form before it (the round-25 times said the kernel is issue-bound: OPT_LOG 26.1):
    SHIFT_SMEM moves the row-block shifts to shared memory (ldmatrix loads, half the thread barriers), BANDS_SPLIT
    drops the selects-and-sums of A's bands, EXP_FTZ the exponential's range fix-up."""
    name = FORM_STEPS[step]
    rep = inspect_kernel(kernels()[name])
    assert not rep.missing and rep.regs == 80 and rep.num_warps == 4, (rep.missing, rep.regs, rep.num_warps)
    assert 0 < rep.smem and 6 * (rep.smem + 1024) <= 228 * 1024, rep.smem
    assert rep.sass.get("HGMMA.64x64x16.F32.BF16") == 16 and rep.sass.get("HMMA.16816.F32.BF16") == 60, rep.sass
    assert rep.instructions > 1000, rep.instructions
    if step:
        before = inspect_kernel(kernels()[FORM_STEPS[step - 1]])
        assert rep.instructions < 0.95 * before.instructions, (name, rep.instructions, before.instructions)
    if step == 1:
        assert rep.families["BAR"] * 1.5 < before.families["BAR"], (rep.families, before.families)
        assert rep.families["LDSM"] > before.families["LDSM"], (rep.families, before.families)


def _sass_lines(name):
    from linattn.runtime.aot import kernel_asm
    return [ln for ln in kernel_asm(name, "sass").splitlines() if ln[:1] in "-0123456789abcdef" and ":" in ln[:3]]


def _first(lines, op):
    return next(i for i, ln in enumerate(lines) if op in ln)


@needs_gluon
def test_kkt_early_and_direct_order_their_loads():
    """Round 27's two forms change where loads sit, not what is computed (the same tensor-core work and, within a
    few, the same instructions as ftz): "early" issues every value head's g and beta loads before the wait on the
    key tile (ftz issues the first head's after it), and "direct" issues no global load before the key tile's
    TMA (ftz loads the chunk index, then cu, first)."""
    ftz, early, direct = (_sass_lines(KKT + f"_{f}_r80") for f in ("ftz", "early", "direct"))
    for lines in (early, direct):
        assert sum("HGMMA.64x64x16" in ln for ln in lines) == 16 and sum("HMMA.16816" in ln for ln in lines) == 60
        assert abs(len(lines) - len(ftz)) < 0.02 * len(ftz), (len(lines), len(ftz))

    def loads_before_wait(lines):
        return sum("LDG" in ln for ln in lines[:_first(lines, "SYNCS.PHASECHK")])
    # ftz: chunk index (2), cu for the TMA (1), bos / eos (2); early: + 2 heads x (g, beta: 1 + 2 per thread)
    assert loads_before_wait(early) >= loads_before_wait(ftz) + 6, (loads_before_wait(early), loads_before_wait(ftz))
    assert sum("LDG" in ln for ln in ftz[:_first(ftz, "UTMALDG")]) >= 2
    assert sum("LDG" in ln for ln in direct[:_first(direct, "UTMALDG")]) == 0


@needs_gluon
@pytest.mark.parametrize("form", ["plain", "persist", "shift", "split", "ftz", "early", "direct"])
@pytest.mark.parametrize("B,T,lens", [(1, 8192, None), (2, 100, None), (3, 1, None), (1, 0, [1, 63, 1, 65, 70])])
def test_kkt_launch_matches_aot_signature(monkeypatch, form, B, T, lens):
    """kkt_solve_gluon's launch: its arguments mangle to the AOT signature, every constexpr of the kernel is passed
    (the form's switches with their defaults filled in, so the host path's key names the compiled kernel AOT checks),
    the register cap is the form's default, the key tile's box is [64, 128], and the grid has one program per (chunk
    slot, key head), or the persistent form's CTAs-per-SM bound."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import kkt_gluon_signature
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    from linattn.ops.gated_delta_rule.gluon import launcher
    from linattn.runtime import device as device_mod

    calls = []
    monkeypatch.setattr(launcher, "launches", lambda kernel, grid, args, kwargs: calls.append((kernel, grid, args,
                                                                                              kwargs)))
    monkeypatch.setattr(device_mod, "device_facts", lambda dev: type("F", (), {"num_sms": 132})())
    H, HV = 16, 32
    k, g, beta, plan = _plan_inputs(B, T, H, HV, lens)
    gcum, tinv = gk.kkt_solve_gluon(k, g, beta, plan, HV, form)
    assert gcum.shape == (plan.T_total, HV) and gcum.dtype == torch.float32
    assert tinv.shape == (plan.T_total, HV, 64) and tinv.dtype == torch.bfloat16
    (kernel, grid, args, kwargs), = calls
    sig = kkt_gluon_signature("bf16")
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert args[0].block_shape == [64, 128] and args[-2] == plan.num_slots * H
    switches = gk.kernel_switches(form)
    # FIXED_LEN (form "direct") only where the plan says every sequence has one length of at least 2 tokens
    fixed = switches["FIXED_LEN"] and lens is None and T >= 2
    assert plan.seq_len == (T if lens is None else 0)
    switches["FIXED_LEN"] = fixed
    assert args[-1] == (T if fixed else 2)
    assert kwargs == dict(H=H, HV=HV, K=128, BT=64, **switches, num_warps=gk.KKT_WARPS,
                          **({"maxnreg": gk.DEFAULT_MAXNREG[form]} if gk.DEFAULT_MAXNREG[form] else {}))
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(
        n for n in kwargs if n not in ("num_warps", "maxnreg"))
    if switches["PERSIST"]:
        assert grid == (gk.persist_grid(plan.num_slots * H, 132, None),) and grid[0] <= 132 * 3
    else:
        assert grid == (plan.num_slots * H,)


def test_kkt_forms_and_switch(monkeypatch):
    """LINATTN_GDN_GLUON_KKT: unset, "1" and "on" are the default form (round 27: "direct"), "0" and an unknown name
    off, each FORMS name itself; an unknown form is refused by kkt_solve_gluon with the names it takes."""
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    from linattn.runtime.settings import settings
    assert gk.DEFAULT_FORM == "direct"
    for value, want in [(None, "direct"), ("1", "direct"), ("on", "direct"), ("0", "off"), ("fast", "off")] + \
            [(f, f) for f in gk.FORMS]:
        if value is None:
            monkeypatch.delenv("LINATTN_GDN_GLUON_KKT", raising=False)
        else:
            monkeypatch.setenv("LINATTN_GDN_GLUON_KKT", value)
        assert settings.gdn_gluon_kkt == want, value
    with pytest.raises(ValueError, match="ftz"):
        gk.kernel_switches("fastest")
    # each form's switches are a superset of the one before (the forms are cumulative steps)
    steps = [gk.kernel_switches(f) for f in ("plain", "shift", "split", "ftz", "early", "direct")]
    for before, after in zip(steps, steps[1:]):
        assert all(after[n] for n, on in before.items() if on) and sum(after.values()) == sum(before.values()) + 1


@pytest.mark.parametrize("dtype,K,why", [(torch.bfloat16, 128, "cpu"), (torch.float32, 128, "float32"),
                                         (torch.float16, 128, "float16"), (torch.bfloat16, 64, "K=64")])
@pytest.mark.parametrize("env", [None, "split"])
def test_kkt_switch_falls_back_with_reason(monkeypatch, dtype, K, why, env):
    """kkt_gluon_supported refuses, with its reason, k that is not bf16, K != 128, and k off a CUDA device (so the
    CPU tests' forward never launches a Gluon kernel, with the switch at its default or set); chunk_fused_wu_ws.kkt_solve
    then runs the Triton kernel and returns what it returns with the switch off."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    monkeypatch.setattr(gk, "kkt_solve_gluon", lambda *a, **kw: pytest.fail("the Gluon stage 2a was launched"))
    k, g, beta, plan = _plan_inputs(1, 70, 1, 2, dtype=dtype, K=K)
    ok, reason = gk.kkt_gluon_supported(k, 2, plan.T_total)
    assert not ok and why in reason, reason
    if env is None:
        monkeypatch.delenv("LINATTN_GDN_GLUON_KKT", raising=False)
    else:
        monkeypatch.setenv("LINATTN_GDN_GLUON_KKT", env)
    out = chunk_fused_wu_ws.kkt_solve(k, g, beta, plan, 2)
    monkeypatch.setenv("LINATTN_GDN_GLUON_KKT", "0")
    ref = chunk_fused_wu_ws.kkt_solve(k, g, beta, plan, 2)
    assert all(torch.equal(a, b) for a, b in zip(out, ref)) and torch.isfinite(out[1].float()).all()


@pytest.mark.parametrize("env,form", [(None, "direct"), ("split", "split"), ("0", None)])
def test_kkt_switch_routes_supported_calls(monkeypatch, env, form):
    """Where kkt_gluon_supported accepts the call (stood in here: a CPU host has no CUDA device), kkt_solve hands it
    to kkt_solve_gluon in the switch's form with the register cap setting, and with the switch "0" it does not."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws
    from linattn.ops.gated_delta_rule.gluon import kkt_solve as gk
    seen = []
    monkeypatch.setattr(gk, "kkt_gluon_supported", lambda k, HV, T: (True, ""))
    monkeypatch.setattr(gk, "kkt_solve_gluon", lambda k, g, beta, plan, HV, f, cap: seen.append((f, cap)) or (1, 2))
    if env is None:
        monkeypatch.delenv("LINATTN_GDN_GLUON_KKT", raising=False)
    else:
        monkeypatch.setenv("LINATTN_GDN_GLUON_KKT", env)
    monkeypatch.setenv("LINATTN_GDN_GLUON_KKT_MAXNREG", "72")
    k, g, beta, plan = _plan_inputs(1, 70, 1, 2)
    out = chunk_fused_wu_ws.kkt_solve(k, g, beta, plan, 2)
    if form is None:
        assert seen == [] and out[1].shape == (70, 2, 64)
    else:
        assert seen == [(form, 72)] and out == (1, 2)


@pytest.mark.parametrize("B,T", [(1, 8192), (3, 100), (2, 64), (5, 1), (4, 65)])
def test_fixed_len_arithmetic_matches_the_plan(B, T):
    """FIXED_LEN (form "direct") computes a slot's (sequence, chunk) as (slot // cdiv(T, 64), slot % cdiv(T, 64)) and
    its first token as sequence * T instead of reading chunk_indices and cu: that holds only while a fixed-length
    plan lays its slots out sequence-major with no surplus slot, and carries seq_len = T (0 for varlen)."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import build_chunk_plan, make_chunk_plan
    plan = make_chunk_plan(B, T, None, 64, "cpu")
    nch = -(-T // 64)
    slots = torch.arange(plan.num_slots)
    assert plan.seq_len == T and plan.num_slots == B * nch
    assert torch.equal(plan.chunk_indices[:, 0].long(), slots // nch)
    assert torch.equal(plan.chunk_indices[:, 1].long(), slots % nch)
    assert torch.equal(plan.cu[:-1], torch.arange(B) * T) and int(plan.cu[-1]) == B * T
    cu = torch.tensor([0, 5, 70, 70, 200])
    assert build_chunk_plan(1, 200, cu, 64, "cpu").seq_len == 0
