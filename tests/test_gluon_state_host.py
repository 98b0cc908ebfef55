"""The host path of the GDN Gluon state pass (gluon/launcher.py, linattn/runtime/host_path.py): the cached launch
(a plan per call signature, descriptors copied from a template, the compiled-handle launch) gives the kernel
exactly the arguments of the same launch with the cache off (every descriptor built by its constructor), hits its
plan for new tensors of the same signature and misses it when the signature changes. In-process checks build the arguments on CPU tensors (descriptors need no
GPU); the launch itself runs in a child process under linattn/runtime/hostsim.py's stand-in sm_90 driver
(TRITON_INTERPRET=1 would turn the kernels into interpreted functions). Works with TRITON_INTERPRET=1 set."""
import json
import os
import subprocess
import sys

import pytest
import torch

from linattn.runtime.gluon_compat import gluon_status

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
pytestmark = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF, FP16 = torch.bfloat16, torch.float16

# (B, T, H, HV, lens, initial state, final state, dtype)
SIGNATURES = [
    (1, 8192, 16, 32, None, True, True, BF),             # the production row: BV=32, 3 stages
    (8, 300, 16, 32, None, False, True, BF),             # BV=64, 2 stages; no initial state
    (1, 3000, 16, 32, [1, 63, 65, 1000, 1871], True, False, BF),   # varlen, no final state
    (2, 130, 4, 4, None, False, False, FP16),            # not GVA, fp16, neither state
    (1, 300, 8, 32, [1, 1, 63, 235], True, True, BF),    # GVA 4:1, varlen with 1-token sequences
]


def _ids(sig):
    B, T, H, HV, lens, h0, ht, dtype = sig
    return (f"B{B}T{T}-H{H}HV{HV}" + ("-varlen" if lens else "") + ("-h0" if h0 else "")
            + ("-ht" if ht else "") + ("-fp16" if dtype == FP16 else ""))


@pytest.fixture
def L():
    from linattn.ops.gated_delta_rule.gluon import launcher
    launcher.clear_plans()
    with launcher.host_path.options(plan_cache=True, handle=True):
        yield launcher
    launcher.clear_plans()


def _buffers(B, T, H, HV, lens, h0, ht, dtype):
    from linattn.ops.gated_delta_rule.gluon.hostsim import state_buffers
    return state_buffers(B, T, H, HV, lens, h0, ht, dtype)


def _same_arg(a, b, same_base=True):
    """Field by field: a descriptor's base pointer and dtype, shape, strides, block, layout, padding; a tensor's
    identity; a scalar's value."""
    if hasattr(b, "block_shape"):
        assert type(a) is type(b)
        if same_base:
            assert a.base.data_ptr() == b.base.data_ptr()
        assert a.base.dtype == b.base.dtype
        assert list(a.shape) == list(b.shape) and list(a.strides) == list(b.strides)
        assert list(a.block_shape) == list(b.block_shape) and a.layout == b.layout and a.padding == b.padding
        assert repr(a.layout) == repr(b.layout)
    elif isinstance(b, torch.Tensor):
        assert a is b
    else:
        assert a == b and type(a) is type(b)


def _compare(L, bufs, plan, same_base=True):
    """The cached plan and arguments against the same call's with the cache off (descriptors built by their
    constructor, as TensorDescriptor.from_tensor) and against the config and constexprs state_config gives."""
    from linattn.runtime.device import device_facts
    k, u = bufs[0], bufs[2]
    cfg = L.state_config(plan.N, u.shape[1], u.shape[2], device_facts(k.device).num_sms)
    n_plans = len(L._PLANS)
    with L.host_path.options(plan_cache=False):
        sp_ref, ref = L.cached_state_args(*bufs, plan)
    assert len(L._PLANS) == n_plans
    sp, full = L.cached_state_args(*bufs, plan)
    kernel = sp.kernel
    assert sp_ref.kernel is kernel and sp.cfg == cfg == sp_ref.cfg
    assert sp.grid == (u.shape[2] // cfg.BV, plan.N * u.shape[1], 1)
    assert sp.options == {"num_warps": 4}
    assert len(full) == len(ref) == len(kernel.arg_names)
    nrt = kernel.arg_names.index("H")
    for a, b in zip(full[:nrt], ref[:nrt]):
        _same_arg(a, b, same_base)
    consts = dict(zip(kernel.arg_names[nrt:], full[nrt:]))
    assert consts == dict(H=k.shape[-2], HV=u.shape[1], K=128, V=128, BT=64, BV=cfg.BV, USE_H0=bufs[6] is not None,
                          STORE_HT=bufs[7] is not None, STAGES=cfg.stages, DECAY="scalar")
    assert full[nrt:] == ref[nrt:]
    return sp, full


@pytest.mark.parametrize("sig", SIGNATURES, ids=_ids)
def test_cached_arguments_equal_uncached(L, sig):
    plan, bufs = _buffers(*sig)
    _compare(L, bufs, plan)
    _compare(L, bufs, plan)          # the second call copies the templates: still the same arguments
    assert len(L._PLANS) == 1


@pytest.mark.parametrize("sig", [SIGNATURES[1], SIGNATURES[4]], ids=_ids)
def test_same_signature_hits_with_new_pointers_and_a_new_shape_misses(L, sig):
    plan, bufs = _buffers(*sig)
    sp1, args1 = L.cached_state_args(*bufs, plan)
    plan2, bufs2 = _buffers(*sig)
    sp2, args2 = _compare(L, bufs2, plan2)
    assert sp2 is sp1 and len(L._PLANS) == 1
    ptr = lambda a: a.base.data_ptr() if hasattr(a, "base") else a.data_ptr()
    for i in (0, 1, 2, 4):                    # k, w, u, h: this call's tensors, not the first call's
        assert ptr(args2[i]) == bufs2[i].data_ptr() != bufs[i].data_ptr()
        assert ptr(args1[i]) == bufs[i].data_ptr()
    for i in (3, 5, 6, 7):
        assert args2[i] is (bufs2[i] if bufs2[i] is not None else bufs2[3])
    assert args2[8] is plan2.cu and args2[9] is plan2.chunk_offsets
    B, T, H, HV, lens, h0, ht, dtype = sig
    longer = None if lens is None else lens[:-1] + [lens[-1] + 64]
    plan3, bufs3 = _buffers(B, T + 64, H, HV, longer, h0, ht, dtype)
    sp3, _ = _compare(L, bufs3, plan3)
    assert sp3 is not sp1 and len(L._PLANS) == 2
    plan4, bufs4 = _buffers(B, T, H, HV, lens, not h0, ht, dtype)       # a constexpr flag changes
    assert L.cached_state_args(*bufs4, plan4)[0] is not sp1 and len(L._PLANS) == 3


def test_key_follows_dtype_alignment_and_config(L):
    plan, bufs = _buffers(*SIGNATURES[1])
    sp = L.cached_state_args(*bufs, plan)[0]
    plan16, bufs16 = _buffers(8, 300, 16, 32, None, False, True, FP16)
    assert L.cached_state_args(*bufs16, plan16)[0] is not sp
    # a vnew at a 2-byte offset: the JIT would compile a kernel without the 16-byte divisibility of vnew_ptr
    k, w, u, gcum, h, vnew, h0, ht = bufs
    odd = torch.zeros(vnew.numel() + 1, dtype=vnew.dtype)[1:].view(vnew.shape)
    sp_odd, args = L.cached_state_args(k, w, u, gcum, h, odd, h0, ht, plan)
    assert sp_odd is not sp and args[5] is odd
    cfg = L.StateConfig(32, 4, 3)
    sp_cfg = L.cached_state_args(*bufs, plan, cfg)[0]
    assert sp_cfg is not sp and sp_cfg.cfg == cfg and sp_cfg.grid == (4, 8 * 32, 1)
    assert len(L._PLANS) == 4


def test_strided_and_misaligned_k_get_their_own_descriptors(L):
    """k from a fused projection (row stride wider than H*K) keys its own plan with its strides; a k at an odd
    offset is copied (as the uncached path does) and the copy's contiguous strides do not match that plan's template
    (taken on an aligned call), so its descriptor is built afresh."""
    plan, bufs = _buffers(1, 300, 16, 32, None, True, True, BF)
    k = bufs[0]
    wide = torch.zeros(1, 300, 3 * 16 * 128, dtype=BF)[:, :, 16 * 128:2 * 16 * 128].view(1, 300, 16, 128)
    sp, args = _compare(L, (wide,) + bufs[1:], plan)
    assert list(args[0].strides) == [3 * 16 * 128, 1] and args[0].base.data_ptr() == wide.data_ptr()
    sp_k = L.cached_state_args(*bufs, plan)[0]
    assert sp_k is not sp and list(sp_k.descs[0].spec[1]) == [16 * 128, 1]
    # odd offset, wide rows: the key's alignment bit differs; the first call's copy sets the template
    flat = torch.zeros(300 * 3 * 16 * 128 + 8, dtype=BF)
    odd = flat[1:1 + 300 * 3 * 16 * 128].view(1, 300, 3 * 16 * 128)[:, :, :16 * 128].view(1, 300, 16, 128)
    assert odd.data_ptr() % 16
    _compare(L, (odd,) + bufs[1:], plan, same_base=False)
    sp_odd, args = _compare(L, (odd,) + bufs[1:], plan, same_base=False)
    assert args[0].base.data_ptr() % 16 == 0 and list(args[0].strides) == [16 * 128, 1]
    assert len(L._PLANS) == 3 and k.shape == odd.shape
    # w's strides are not in the key (the forward allocates it contiguous): a strided w of the same signature
    # hits the plan, and its view's strides differ from the template's, so its descriptor is built, not copied
    w = bufs[1]
    w_wide = torch.empty(w.shape[0], 2 * w.shape[1], w.shape[2], dtype=BF)[:, :w.shape[1]]
    sp_w, args = _compare(L, (k, w_wide) + bufs[2:], plan)
    assert sp_w is sp_k and list(args[1].strides) == [2 * 32 * 128, 1] and args[1].base.data_ptr() == w_wide.data_ptr()
    assert list(sp_w.descs[1].spec[1]) == [32 * 128, 1]          # the template is left as it was


def test_cached_arguments_mangle_to_the_aot_signature(L):
    """The cached arguments' types are exactly what aot.py compiles, and the production configs are registered
    ones."""
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import CONFIGS, kernel_name, signature
    registered = {kernel_name(*c) for c in CONFIGS}
    for B, T, lens in ((1, 8192, None), (8, 4096, None), (1, 3000, [1, 63, 65, 1000, 1871])):
        plan, bufs = _buffers(B, T, 16, 32, lens, True, True, BF)
        sp, full = L.cached_state_args(*bufs, plan)
        sig = signature("bf16", sp.cfg.BV)
        for (name, want), arg in zip(sig.items(), full):
            assert mangle_type(arg) == want, (name, mangle_type(arg), want)
        if lens is None:
            assert kernel_name("bf16", sp.cfg.BV, sp.cfg.num_warps, sp.cfg.stages) in registered


def test_kda_channel_call_mangles_to_its_aot_signature_and_keys_apart(L):
    """KDA's recompute on the same kernel (decay "channel", kda/gluon/state.py): the decayed keys per value head
    [T_tot, HV, K] as k (boxes at the value head's columns), gcum [T_tot, HV, K]; the arguments mangle to the AOT
    signature of kda/aot.py's builds with DECAY "channel", whose configs are registered; a GDN call of the same
    shapes gets its own plan; a call that mixes the forms is refused by name."""
    from triton.runtime.jit import mangle_type

    import linattn.ops.kda.aot  # noqa: F401  (registers the KDA builds)
    from linattn.ops.gated_delta_rule.aot import signature
    from linattn.runtime.aot import kernels
    for B, T, lens in ((1, 8192, None), (8, 4096, None), (1, 3000, [1, 63, 65, 1000, 1871])):
        plan, bufs = _buffers(B, T, 32, 32, lens, True, False, BF)
        _k, w, u, gcum, h, vnew, h0, ht = bufs
        kdec = torch.empty(plan.T_total, 32, 128, dtype=BF)
        gk = torch.empty(plan.T_total, 32, 128)
        sp, full = L.cached_state_args(kdec, w, u, gk, h, vnew, h0, ht, plan, decay="channel")
        for (name, want), arg in zip(signature("bf16", sp.cfg.BV).items(), full):
            assert mangle_type(arg) == want, (name, mangle_type(arg), want)
        consts = dict(zip(sp.kernel.arg_names[-len(sp.constexprs):], sp.constexprs))
        assert consts["DECAY"] == "channel" and consts["H"] == consts["HV"] == 32 and not consts["STORE_HT"]
        assert list(full[0].shape) == [plan.T_total, 32 * 128] and full[3] is gk
        if lens is None:
            assert f"kda_bwd_gluon_recompute_state_bv{sp.cfg.BV}_s{sp.cfg.stages}" in kernels()
        sp_gdn, full_gdn = L.cached_state_args(kdec.view(B, -1, 32, 128) if lens is None else kdec[None], w, u,
                                               gcum, h, vnew, h0, ht, plan)
        assert sp_gdn is not sp and dict(zip(sp_gdn.kernel.arg_names[-len(sp_gdn.constexprs):],
                                             sp_gdn.constexprs))["DECAY"] == "scalar"
        with pytest.raises(ValueError, match="decay 'channel'"):
            L.cached_state_args(kdec, w, u, gcum, h, vnew, h0, ht, plan, decay="channel")
        with pytest.raises(ValueError, match="decay 'channel'"):
            L.cached_state_args(torch.empty(plan.T_total, 16, 128, dtype=BF), w, u, gk, h, vnew, h0, ht, plan,
                                decay="channel")       # keys per key head (GVA): not the decayed keys
    with pytest.raises(ValueError, match="decay must be"):
        L.cached_state_args(kdec, w, u, gk, h, vnew, h0, ht, plan, decay="vector")


def test_cache_off_stores_nothing_and_builds_every_descriptor(L):
    plan, bufs = _buffers(*SIGNATURES[1])
    with L.host_path.options(plan_cache=False):
        sp1, a1 = L.cached_state_args(*bufs, plan)
        sp2, a2 = L.cached_state_args(*bufs, plan)
        assert sp1 is not sp2 and len(L._PLANS) == 0
        _same_arg(a1[1], a2[1])


def hostsim_child(flag: str, timeout: int) -> dict:
    """python -m linattn.ops.gated_delta_rule.gluon.hostsim <flag> in a child process without TRITON_INTERPRET: its
    last stdout line as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "linattn.ops.gated_delta_rule.gluon.hostsim", flag],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_launches_through_the_stand_in_driver():
    """Child process (no TRITON_INTERPRET) under the stand-in sm_90 driver (python -m
    linattn.ops.gated_delta_rule.gluon.hostsim --check): for fixed and varlen, with and without initial/final
    state, GVA or not, bf16 and fp16, the launcher receives the same kernel, grid and arguments with the cache
    off, plans only and plans + handle; the handle path never enters the JIT; new tensors of the same signature
    hit the plan and reach the launcher with their own pointers; a longer T adds a plan."""
    res = hostsim_child("--check", 600)
    from linattn.ops.gated_delta_rule.gluon.hostsim import CHECK_CASES
    assert set(res) == set(CHECK_CASES)
    for name, r in res.items():
        assert r["same"] and r["n_launches"] == 1, (name, r)
        assert r["jit_runs"] == {"jit": 1, "plan": 1, "plan+handle": 0}, (name, r)
        assert r["hit"] == dict(plans_added=0, jit_runs=0, new_pointers=True, first_pointers=False,
                                same_as_uncached=True), (name, r)
        assert r["miss_plans_added"] == 1, (name, r)
