"""The warp-specialised Gluon fused forward that forms W and U itself (stages 2b+3+4, gluon/chunk_fused_wu_ws.py) on
a CPU host: every registered build compiles for sm_90a without spill; the launch arguments mangle to the AOT
signatures, through the real JIT path too; a torch model of the per-CTA schedule (testing/fused_model.py: four
partitions interleaved at random at their mbarrier waits, the in-place buffers modelled in place) gives the Triton
forward's o and final state within TOL of the fp64 recurrence; a broken protocol deadlocks or gives wrong data. The
kernel runs only on a GPU (benchmarks/gpu/gate.py). Run only this file: `python -m pytest tests/test_gluon_fused_wu.py`."""
import json
import re
import sys

import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

SMEM_LIMIT_SM90 = 232448
_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()
NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_fwd_fused_wu_ws_gluon_"))
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


# ---------------------------------------------------------------- AOT builds (sm_90a)

def test_launcher_configs_are_registered():
    from linattn.ops.gated_delta_rule.aot import FUSED_WU_CONFIGS, fused_wu_kernel_name
    from linattn.ops.gated_delta_rule.gluon.fused_forward import fused_wu_config
    names = {fused_wu_kernel_name(dt, bv, s, regs, out_pipe=op, select=sel)
             for dt, bv, s, regs, op, sel in FUSED_WU_CONFIGS}
    assert names == set(NAMES) and len(NAMES) == 7
    assert (fused_wu_config(1, 32, 128, 132).BV, fused_wu_config(1, 32, 128, 132).stages) == (32, 3)
    assert (fused_wu_config(8, 32, 128, 132).BV, fused_wu_config(8, 32, 128, 132).stages) == (64, 2)
    assert fused_wu_config(1, 8, 128, 132).BV == 16          # 64 CTAs at BV=16 fit one wave
    for N, HV in ((1, 32), (8, 32), (1, 8), (2, 8)):
        cfg = fused_wu_config(N, HV, 128, 132)
        for dt in ("bf16", "fp16") if cfg.BV == 64 else ("bf16",):
            for sel in (False, True) if dt == "bf16" else (False,):
                assert fused_wu_kernel_name(dt, cfg.BV, cfg.stages, (cfg.output_regs, cfg.wu_regs), cfg.out_pipe,
                                            sel) in REGISTRY, cfg


@needs_gluon
@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_spill_with_intended_instructions(name):
    """sm_90a: 0 spill, no local memory, shared memory in budget, 16 warps (state, output and wu warpgroups plus the
    producer warp's padded warpgroup), and the intended HGMMA / UTMALDG / SYNCS / WARPGROUP."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import NPUB, NWU
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    assert 0 < rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
    assert rep.num_warps == 16 and rep.regs == 128                # 512 threads x 128: the whole register file
    assert rep.families["HMMA"] == 0 and rep.families["LDGSTS"] == 0
    stages = int(re.search(r"_bv\d+_s(\d+)", name)[1])
    # q, k [64,128] go as two [64,64] messages each, v [64,BV] and Tinv [64,64] as one: 6, from the producer only
    assert rep.sass.get("UTMALDG.2D", 0) == 6 and rep.families["UTMASTG"] == 0, rep.sass
    # mbarrier inits: ready + empty per ring slot, wu_full + wu_empty per W buffer, s_full + v_full + pub_empty
    assert rep.sass.get("SYNCS.EXCH.64", 0) == 2 * stages + 2 * NWU + 3 * NPUB, rep.sass
    assert rep.sass.get("SYNCS.ARRIVE.TRANS64", 0) == 1                        # the producer's expect


@pytest.mark.parametrize("T,lens,stages,npub,BV", [(260, None, 3, 2, 32), (261, [1, 130, 64, 65, 1], 3, 2, 32),
                                                   (1, None, 3, 2, 32), (200, [70, 1, 129], 1, 1, 32),
                                                   (130, None, 2, 1, 32), (193, [1, 128, 64], 2, 2, 64)])
def test_schedule_model_out_pipe_matches_default_model(device, T, lens, stages, npub, BV):
    """The schedule model with out_pipe (the output partition waits for chunk c + 1's slot and takes its q k^T right
    after releasing chunk c's; gate factors 2^(log2e gam_i - log2e gam_j) flushed below 2^-126) against the WU_AREG
    model without it, on fresh inputs and interleavings, outputs NaN-poisoned: the final state bit-equal (the state
    chain does not read the output partition's values), o within 1e-3 (the exponentials round differently: a few
    16-bit ulps of att flip, 2e-4 of the elements in a CPU run) and within TOL of the fp64 recurrence, its error
    vs fp64 within 1.02x of the default model's. T = 1 (the q k^T issued ahead is the only one), varlen with 1-token
    sequences, ring depths 1-3 and one publication buffer (the protocol: a deadlock raises), BV 32 and 64."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.fused_forward import chunk_gated_delta_rule_fwd_fused_wu
    from linattn.testing.fused_model import emulate_fused
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    x, cu = _inputs(1, T, lens, torch.bfloat16, True, 1, 2, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    outs = {}
    for out_pipe in (False, True):
        stats = {}

        def fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_):
            assert torch.isnan(o).all() and torch.isnan(final).all()
            emulate_fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_, BV=BV,
                                stages=stages, npub=npub, seed=seed, stats=stats, areg=True, out_pipe=out_pipe)
        with poisoned_allocations():
            outs[out_pipe] = chunk_gated_delta_rule_fwd_fused_wu(*args, fused_pass=fused)
        assert stats["steps"] > 0
    res, res0 = outs[True], outs[False]
    assert torch.isfinite(res.o).all() and torch.equal(res.final_state, res0.final_state)
    assert rel_rms(res.o, res0.o) < 1e-3
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=x["initial_state"].double(), output_final_state=True, cu_seqlens=cu)
    assert rel_rms(res.o, o64) < TOL[torch.bfloat16] and rel_rms(res.final_state, f64) < TOL[torch.bfloat16]
    assert rel_rms(res.o, o64) <= 1.02 * rel_rms(res0.o, o64)


def _buffers(B, T, H, HV, lens=None, dtype=torch.bfloat16, states=True):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    K = V = 128
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, N = plan.T_total, plan.N
    q, k = torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, H, K, dtype=dtype)
    v, beta = torch.zeros(B, T, HV, V, dtype=dtype), torch.zeros(B, T, HV)
    gcum, tinv = torch.zeros(T_tot, HV), torch.zeros(T_tot, HV, 64, dtype=dtype)
    o = torch.zeros(B, T, HV, V, dtype=dtype)
    h0 = torch.zeros(N, HV, K, V) if states else None
    fin = torch.zeros(N, HV, K, V) if states else None
    return plan, (q, k, v, beta, gcum, tinv, o, h0, fin)


@needs_gluon
@pytest.mark.parametrize("B,T,lens,states", [(1, 4096, None, True), (8, 512, None, True),
                                             (1, 3000, [1, 63, 65, 1000, 1871], False)])
def test_launch_matches_aot_signature(B, T, lens, states):
    """fused_wu_launch's arguments (descriptors build on CPU tensors) mangle to exactly the AOT signature; grid,
    constexprs, descriptor views and boxes are the intended ones; the tensors themselves are passed."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_wu_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import NPUB, NWU, PRODUCER_REGS
    from linattn.ops.gated_delta_rule.gluon.fused_forward import fused_wu_config, fused_wu_launch
    plan, bufs = _buffers(B, T, 16, 32, lens, states=states)
    cfg = fused_wu_config(plan.N, 32, 128, 132)
    kernel, grid, args, kwargs = fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg)
    sig = fused_wu_signature("bf16", cfg.BV, states)
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (128 // cfg.BV, plan.N * 32)
    # OUT_PIPE at BV=32 with the output / wu warpgroups at 160 / 160 registers; at BV=64 at 136 / 192
    regs = (160, 160) if cfg.BV == 32 else (136, 192)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, BV=cfg.BV, STAGES=cfg.stages, NWU=NWU, NPUB=NPUB,
                          USE_H0=states, STORE_HT=states, OUTPUT_REGS=regs[0], WU_REGS=regs[1],
                          PRODUCER_REGS=PRODUCER_REGS, OUT_PIPE=cfg.BV == 32, num_warps=4)
    T_tot = plan.T_total
    assert [list(a.shape) for a in args[:4]] == [[T_tot, 16 * 128]] * 2 + [[T_tot, 32 * 128], [T_tot, 32 * 64]]
    assert [a.block_shape for a in args[:4]] == [[64, 128]] * 2 + [[64, cfg.BV], [64, 64]]
    q, k, v, beta, gcum, tinv, o, h0, fin = bufs
    assert [a.base.data_ptr() for a in args[:4]] == [t.data_ptr() for t in (q, k, v, tinv)]
    assert args[4].data_ptr() == beta.data_ptr() and args[5] is gcum and args[6] is o
    assert args[7] is h0 and args[8] is fin and args[9] is plan.cu and args[10] is plan.chunk_offsets
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")


@needs_gluon
def test_selection_launch_matches_aot_signature():
    """The segment-parallel forward's unsegmented launch (the int32 selection [N * HV]) mangles to the registered
    _sel build's signature, the selection passed as itself; a wrong dtype or size is refused."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import fused_wu_kernel_name
    from linattn.ops.gated_delta_rule.gluon.fused_forward import fused_wu_config, fused_wu_launch
    from linattn.runtime.aot import kernels
    plan, bufs = _buffers(1, 4096, 16, 32)
    cfg = fused_wu_config(plan.N, 32, 128, 132)
    sel = torch.ones(plan.N * 32, dtype=torch.int32)
    _, grid, args, kwargs = fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, sel)
    name = fused_wu_kernel_name("bf16", cfg.BV, cfg.stages, (cfg.output_regs, cfg.wu_regs), cfg.out_pipe, True)
    _, sig, const, _ = kernels()[name].build()
    runtime = [n for n in sig if sig[n] != "constexpr"]
    assert [mangle_type(a) for a in args if a is not None] == [sig[n] for n in runtime]
    assert {k: v for k, v in kwargs.items() if k in const} == {k: v for k, v in const.items() if k in kwargs}
    assert args[12] is sel and grid == (128 // cfg.BV, plan.N * 32)
    with pytest.raises(ValueError, match="select must be a contiguous int32"):
        fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, sel.long())
    with pytest.raises(ValueError, match="select must be a contiguous int32"):
        fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg, torch.ones(3, dtype=torch.int32))


def test_supported():
    from linattn.ops.gated_delta_rule.gluon.fused_forward import fused_wu_supported
    q, v = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    assert fused_wu_supported(q, v, torch.zeros(1, 8, 4))[0]
    assert not fused_wu_supported(q.float(), v.float())[0]
    assert not fused_wu_supported(q[..., :64], v)[0]
    assert not fused_wu_supported(q[:, :0], v[:, :0])[0]
    assert not fused_wu_supported(torch.zeros(1, 8, 3, 128, dtype=torch.bfloat16), v)[0]
    assert not fused_wu_supported(q, v, torch.zeros(1, 8, 4, dtype=torch.int32))[0]


def _jit_compile_main():
    """Child process: the real JIT launch path with the launcher's own arguments on CPU tensors, under a stand-in
    driver that reports sm_90a and never launches (warmup). One JSON line per case."""
    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.fused_forward import fused_wu_config, fused_wu_launch

    use_compile_only_sm90_driver()
    for B, T, dtype, states in ((1, 300, torch.bfloat16, True), (8, 100, torch.float16, False)):
        plan, bufs = _buffers(B, T, 16, 32, dtype=dtype, states=states)
        cfg = fused_wu_config(plan.N, 32, 128, 132)
        kernel, grid, args, kwargs = fused_wu_launch(*bufs, plan, 128 ** -0.5, cfg)
        k = kernel.warmup(*args, grid=grid, **kwargs)
        ptx = k.asm["ptx"]
        print(json.dumps(dict(B=B, BV=cfg.BV, stages=cfg.stages, num_warps=k.metadata.num_warps,
                              shared=k.metadata.shared, reqntid=re.findall(r"\.reqntid (\d+)", ptx),
                              maxnreg=re.findall(r"\.maxnreg (\d+)", ptx),
                              setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)",
                                                               ptx))),
                              tma_boxes=[m["block_size"] for m in (k.metadata.tensordesc_meta or [])],
                              cta_bars=sorted(set(re.findall(r"\b(?:bar|barrier)\.sync\s+(\d+)\s*;", ptx))),
                              part_bars=sorted(set(re.findall(r"\b(?:bar|barrier)\.sync\s+(\d+),\s*(\d+)\s*;",
                                                              ptx))),
                              expect_tx=re.findall(r"mbarrier\.arrive\.expect_tx\S*\s+_,\s*\[[^\]]+\],\s*(\d+)",
                                                   ptx))))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    """The launcher's arguments through the real JIT (a compile-only sm_90a driver): 16 warps, the setmaxnreg split of
    the default configs (BV=32 state 168 / output 160 / wu 160, BV=64 state 160 / output 136 / wu
    192; producer 24: the whole 64 K register file), TMA boxes q, k as [64,64]
    messages, v [64,BV], Tinv [64,64]; every barrier inside a partition is partition-local (bar.sync id, 128:
    ids 0 state, 2 output, 3 wu), the only CTA-wide one is warp_specialize's (id 1); the expect counts the four
    full boxes."""
    from compile_only import jit_child_rows      # tests/ is on sys.path
    rows = jit_child_rows(__file__, timeout=900)
    assert [(r["B"], r["BV"], r["stages"]) for r in rows] == [(1, 32, 3), (8, 64, 2)]
    for r in rows:
        assert r["num_warps"] == 16 and r["reqntid"] == ["512"] and 0 < r["shared"] <= SMEM_LIMIT_SM90, r
        assert r["maxnreg"] == ["128"], r
        state, output, wu = (168, 160, 160) if r["BV"] == 32 else (160, 136, 192)
        inside = {("dec", str(state)), ("inc", str(output)), ("inc", str(wu)), ("dec", "24")}
        assert inside <= set(map(tuple, r["setmaxnreg"])), r
        assert state + output + wu + 24 == 512                       # x 128 threads = 65 536 registers
        assert r["tma_boxes"] == [[64, 64]] * 2 + [[64, r["BV"]], [64, 64]], r
        assert r["cta_bars"] == ["1"], r
        assert {i for i, _ in r["part_bars"]} == {"0", "2", "3"} and all(n == "128" for _, n in r["part_bars"]), r
        assert r["expect_tx"] == [str(2 * (2 * 64 * 128 + 64 * r["BV"] + 64 * 64))], r


# ---------------------------------------------------------------- the launcher with a stand-in kernel

def test_gluon_entry_launches_the_kernel_with_the_forward_tensors(monkeypatch):
    """chunk_gated_delta_rule_fwd_fused_wu with no fused_pass goes through chunk_fused_wu_ws_gluon (config from the
    device's SM count), fused_wu_launch and one kernel[grid](...) call; here the kernel is a stand-in that records
    the call and runs the schedule model on the tensors behind the launcher's own descriptors, so o and the final
    state come out as the Triton forward's."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as kmod
    from linattn.ops.gated_delta_rule.gluon import fused_forward as fw
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.testing import rel_rms
    from linattn.testing.fused_model import emulate_fused
    if not _GLUON_OK:
        pytest.skip(_GLUON_REASON)
    calls = []

    class StandIn:
        arg_names = kmod.chunk_fused_wu_ws_kernel.arg_names

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append((grid, args, kwargs))
                q_d, k_d, v_d, t_d, beta, gcum, o, h0, final, cu, offs, scale, sel = args
                plan = seen["plan"]
                B, T = o.shape[:2]
                H, HV = kwargs["H"], kwargs["HV"]
                view = lambda d, *shape: d.base.reshape(*shape)                # noqa: E731
                emulate_fused(view(q_d, B, T, H, 128), view(k_d, B, T, H, 128),
                              view(v_d, B, T, HV, 128), beta, gcum, view(t_d, plan.T_total, HV, 64), o,
                              h0, final, plan, scale, BV=kwargs["BV"], stages=kwargs["STAGES"],
                              nwu=kwargs["NWU"], npub=kwargs["NPUB"], out_pipe=kwargs["OUT_PIPE"], select=sel)
            return run
    seen = {}
    real_launch = fw.fused_wu_launch

    def spy_launch(*a):
        seen["plan"] = a[9]
        return real_launch(*a)
    monkeypatch.setattr(kmod, "chunk_fused_wu_ws_kernel", StandIn())
    monkeypatch.setattr(fw, "fused_wu_launch", spy_launch)
    x, cu = _inputs(1, 150, [1, 100, 49], torch.bfloat16, True, seed=3)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True, cu)
    ref = chunk_gated_delta_rule_fwd(*args)
    res = fw.chunk_gated_delta_rule_fwd_fused_wu(*args)
    assert len(calls) == 1
    grid, kargs, kwargs = calls[0]
    cfg = fw.fused_wu_config(3, 2, 128, 2)                               # the CPU's device facts: 2 "SMs"
    assert grid == (128 // cfg.BV, 3 * 2) and kwargs["STAGES"] == cfg.stages and kwargs["BV"] == cfg.BV
    assert kargs[0].base.data_ptr() == x["q"].data_ptr() and kargs[2].base.data_ptr() == x["v"].data_ptr()
    assert kargs[4].data_ptr() == x["beta"].data_ptr() and kargs[6] is res.o and kargs[8] is res.final_state
    assert kargs[7] is x["initial_state"] and kargs[3].base.dtype == torch.bfloat16
    assert rel_rms(res.o, ref.o) < 3e-3 and rel_rms(res.final_state, ref.final_state) < 3e-3


if __name__ == "__main__" and sys.argv[1:] == ["jit"]:
    _jit_compile_main()
    sys.exit(0)


# ---------------------------------------------------------------- the per-CTA schedule, modelled in torch

def _inputs(B, T, lens, dtype, h0, H=1, HV=2, seed=0):
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(seed)
    N = B if lens is None else len(lens)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, num_states=N, initial_state=h0, generator=gen)
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    return x, cu


MODEL_CASES = [  # (B, T, lens, dtype, initial state, H, HV, BV, stages, nwu, npub)
    (1, 1, None, torch.bfloat16, True, 1, 2, 32, 3, 2, 2),
    (1, 63, None, torch.bfloat16, False, 1, 2, 64, 2, 2, 2),
    (2, 65, None, torch.float16, True, 1, 2, 32, 3, 2, 2),
    (1, 300, None, torch.bfloat16, True, 2, 4, 64, 2, 2, 2),
    (1, 260, [1, 63, 1, 130, 64, 1], torch.bfloat16, True, 1, 2, 32, 3, 2, 2),
    (1, 200, [65, 1, 64, 70], torch.float16, False, 1, 2, 64, 2, 2, 2),
    (1, 257, None, torch.bfloat16, True, 1, 2, 32, 1, 1, 1),          # every buffer single: still correct
    (1, 200, None, torch.float16, False, 1, 2, 64, 3, 1, 2),
]


@pytest.mark.parametrize("B,T,lens,dtype,h0,H,HV,BV,stages,nwu,npub", MODEL_CASES)
def test_schedule_model_matches_triton_forward(device, B, T, lens, dtype, h0, H, HV, BV, stages, nwu, npub):
    """The fused-wu forward (kkt_solve under the interpreter, then the schedule model with the partitions interleaved
    at random) on fresh random inputs, every output NaN-poisoned first: gcum equal to the Triton forward's, o and the
    final state within TOL of the fp64 recurrence. Covers T = 1, 63, 65, 200-300 (T not a multiple of 64), B2,
    varlen with 1-token sequences, GVA (HV = 2H), with and without h0, bf16 and fp16, BV 32/64, ring depths 1-3,
    NWU 1-2, NPUB 1-2."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.fused_forward import chunk_gated_delta_rule_fwd_fused_wu
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    from linattn.testing.fused_model import emulate_fused
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))              # fresh inputs and interleaving every run
    x, cu = _inputs(B, T, lens, dtype, h0, H, HV, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    with poisoned_allocations():
        ref = chunk_gated_delta_rule_fwd(*args)
    seen = {}

    def fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_):
        assert torch.isnan(o).all() and torch.isnan(final).all()          # poisoned by the allocator
        assert tinv.dtype == dtype and gcum.dtype == torch.float32
        emulate_fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_, BV=BV, stages=stages,
                      nwu=nwu, npub=npub, seed=seed, stats=seen, out_pipe=BV == 32)
    with poisoned_allocations():
        res = chunk_gated_delta_rule_fwd_fused_wu(*args, fused_pass=fused)
    assert seen["steps"] > 0 and res.w is None and res.u is None and res.h is None and res.vnew is None
    assert torch.equal(res.gcum, ref.gcum)
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True, cu_seqlens=cu)
    assert rel_rms(res.o, o64) < TOL[dtype] and rel_rms(res.final_state, f64) < TOL[dtype]
    assert rel_rms(ref.o, o64) < TOL[dtype]


def _small_call(T=200, seed=0, lens=None):
    from linattn.ops.gated_delta_rule.gluon.fused_forward import kkt_solve
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    x, cu = _inputs(1, T, lens, torch.bfloat16, True, seed=seed)
    plan = make_chunk_plan(1, T, cu, 64, "cpu")
    gcum, tinv = kkt_solve(x["k"], x["g"], x["beta"], plan, 2)
    o = torch.full_like(x["v"], float("nan"))
    final = torch.full_like(x["initial_state"], float("nan"))
    return x, plan, (x["q"], x["k"], x["v"], x["beta"], gcum, tinv, o, x["initial_state"], final, plan, 128 ** -0.5)


def test_schedule_model_detects_a_deadlock():
    """The model is able to hang: the ring's empty barriers (count 3, the only ones) read with the wrong parity
    never let the producer start."""
    from linattn.testing import fused_model as fw
    _, _, call = _small_call()
    orig = fw._MBar.passes
    try:
        fw._MBar.passes = lambda self, parity: (self.done & 1) == parity if self.count == 3 else orig(self, parity)
        with pytest.raises(RuntimeError, match="deadlock"):
            fw.emulate_fused(*call, BV=32, stages=2)
    finally:
        fw._MBar.passes = orig


def test_schedule_model_detects_a_race_on_the_w_buffers():
    """The model sees in-place hazards: with the wu partition's wait on wu_empty dropped (its barriers pass at once),
    it rewrites wk_s[j] with a later chunk's W (or its scaled k) before product 1 has read it, so o goes wrong, or
    wu_full[j] completes twice ahead of the state partition (which then hangs on its parity), for some
    interleaving. Barriers are created per CTA in the kernel's order: ready, empty (STAGES each), wu_full,
    wu_empty (NWU each), then the published buffers' (3 NPUB)."""
    from linattn.testing import fused_model as fw
    from linattn.testing import rel_rms
    x, plan, call = _small_call(T=640)
    stages, nwu, npub = 3, 2, 2
    fw.emulate_fused(*call, BV=64, stages=stages, nwu=nwu, npub=npub, seed=1)
    good = call[6].clone()
    per_cta = 2 * stages + 2 * nwu + 3 * npub
    first, last = 2 * stages + nwu, 2 * stages + 2 * nwu          # the wu_empty barriers' creation indices
    real = fw._MBar
    made = [0]

    class NoWuEmpty(real):
        def __init__(self, count):
            super().__init__(count)
            self.skip = first <= made[0] % per_cta < last
            made[0] += 1

        def passes(self, parity):
            return True if self.skip else super().passes(parity)
    wrong = 0
    try:
        fw._MBar = NoWuEmpty
        for seed in range(4):
            made[0] = 0
            call[6].fill_(float("nan"))
            try:
                fw.emulate_fused(*call, BV=64, stages=stages, nwu=nwu, npub=npub, seed=seed)
            except (RuntimeError, AssertionError, TypeError):
                wrong += 1          # wu_full completed twice ahead of its waiter (a hang), or no W yet
                continue
            wrong += rel_rms(call[6], good) > 1e-2
    finally:
        fw._MBar = real
    assert wrong >= 1
