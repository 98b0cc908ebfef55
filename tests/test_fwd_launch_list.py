"""The gluon forward's per-signature launch list (runtime/launch_list.py, gluon/launcher.py fwd_eager): a plain eager
fixed-length call records its buffers and direct launches once, and later calls of the signature replay them with
their own pointers. Under the stand-in sm_90 driver (linattn.runtime.hostsim: launches recorded, not made; a child
process without TRITON_INTERPRET):
- a replayed call makes the launches the host path makes on the same tensors (kernel, grid, every argument; each
  pointer the same input or output at the same offset, the other buffers in the same pattern; descriptors with the
  same fields), segmented (the segment window, stage 2a, the W/U kernel with its selection, the segment launch) and
  unsegmented, with and without states; no JIT run and no host-path launch key in a replay;
- no stale replay: another scale or an option makes a new list; a launch hook, the host path's options or an
  unaligned input make the replay decline (the host path runs, with its copy of the unaligned input);
- an input the host path copies (a non-contiguous q) never gets a list; poisoned allocations are honoured.
What a GPU adds (the C launcher, the event steps between the two streams) is checked by the GPU gate's eager_repeat
cases (benchmarks/gpu/gate_sections/fwd.py)."""
from children import run_json_child   # tests/ is on sys.path

COMMON = r"""
import json, torch
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.hostsim import TensorMap, count_jit_runs, fake_hopper
from linattn.runtime.launch_list import LaunchList
from linattn.ops.gated_delta_rule.gluon import launcher as L
from linattn.ops.gated_delta_rule.gluon import chunk_fused_gf as gfm
from linattn.ops.gated_delta_rule.gluon.host import host_path, launches as cache
from linattn.testing import make_gdn_inputs

def inputs(B, T, H=16, HV=32, h0=True):
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16, initial_state=h0)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])

def with_launch_hook(fn):
    # fn() with a Triton launch-enter hook registered (a profiler's: replays and direct paths decline)
    from triton import knobs
    hook = lambda *a, **k: None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        return fn()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)

def canon(drv, ins, outs):
    # launches as data: a pointer is (input i / output j, offset) when it lies in one, else its order of first
    # appearance (buffers of the call, kept plans); descriptors by their fields and base
    named = [(("in", i), t) for i, t in enumerate(ins) if t is not None]
    named += [(("out", j), t) for j, t in enumerate(outs) if t is not None]
    seen = {}
    def ptr(p):
        for name, t in named:
            lo = t.data_ptr()
            if lo <= p < lo + t.numel() * t.element_size():
                return repr(name + (p - lo,))
        return "other%d" % seen.setdefault(p, len(seen))
    def one(a):
        if isinstance(a, torch.Tensor):
            return ptr(a.data_ptr())
        if type(a) is int and a >= 2 ** 32:            # a replay passes pointers as ints (no scalar is this large)
            return ptr(a)
        if hasattr(a, "block_shape"):
            return repr(("desc", ptr(a.base.data_ptr()), list(a.shape), list(a.strides), list(a.block_shape),
                         repr(a.layout), a.padding))
        if isinstance(a, TensorMap):                   # a descriptor as the C launch gets it (c_launcher=True)
            return repr(("map", ptr(a[0])) + tuple(a[1:]))
        return repr(a)
    res = [[n, list(g), [one(a) for a in args]] for n, g, args in drv.launches]
    del drv.launches[:]
    return res
"""

CHILD = COMMON + r"""

def replay_vs_host(drv, ins, scale=128 ** -0.5, final=True):
    # the call through fwd_eager, then the host path on the same tensors; JIT runs and launch-key computations of
    # the fwd_eager call
    keys0 = cache.jit_launches
    with count_jit_runs() as jit:
        o, ht = L.fwd_eager(*ins[:5], scale, ins[5], final)
    a = canon(drv, ins, (o, ht))
    res = L.chunk_gated_delta_rule_fwd_gluon(*ins[:5], scale, ins[5], final, None)
    b = canon(drv, ins, (res.o, res.final_state if final else None))
    return dict(same=a == b, launches=[x[0] for x in a], jit=jit[0], host_path_jit=cache.jit_launches - keys0,
                final_none=ht is None, diff=[(x, y) for x, y in zip(a, b) if x != y][:2])

out = {}
gfm.GF_SEG_MIN_EAGER_TOKENS = 0                    # the segment path for every call
with fake_hopper() as drv, torch.no_grad():
    for name, (B, T, h0, final) in {"segmented": (1, 4096, True, True), "unsegmented_no_states": (2, 300, False, False),
                                    "unsegmented_h0": (3, 200, True, True)}.items():
        L.EAGER_LISTS.clear()
        for _ in range(2):                             # compile, then record
            L.fwd_eager(*inputs(B, T, h0=h0)[:5], 128 ** -0.5, inputs(B, T, h0=h0)[5], final)
        del drv.launches[:]
        kinds = [type(v).__name__ for v in L.EAGER_LISTS.lists.values()]
        out[name] = dict(kinds=kinds, fresh=replay_vs_host(drv, inputs(B, T, h0=h0), final=final))

    # the segmented signature again: variants
    L.EAGER_LISTS.clear()
    x = inputs(1, 4096)
    for _ in range(3):
        L.fwd_eager(*x[:5], 128 ** -0.5, x[5], True)
    del drv.launches[:]
    n0 = len(L.EAGER_LISTS.lists)
    out["scale"] = replay_vs_host(drv, x, scale=0.25)
    out["scale_again"] = replay_vs_host(drv, x, scale=0.25)
    out["lists_after_scale"] = len(L.EAGER_LISTS.lists) - n0
    declined = {}
    real_call = LaunchList.__call__
    def spy(self, *a):
        r = real_call(self, *a)
        declined["last"] = r is None
        return r
    LaunchList.__call__ = spy
    with host_path.options(handle=False):
        out["handle_off"] = dict(replay_vs_host(drv, x), declined=declined.pop("last"))
    from triton import knobs
    hook = lambda *a: None
    knobs.runtime.launch_enter_hook.add(hook)
    hooked = bool(knobs.runtime.launch_enter_hook.calls)
    if hooked:
        out["hook"] = dict(replay_vs_host(drv, x), declined=declined.pop("last"))
    knobs.runtime.launch_enter_hook.remove(hook)
    # an unaligned q (same shape and strides, storage offset of one element): declined, the host path copies q
    big = torch.randn(1 * 4096 * 16 * 128 + 1).to(torch.bfloat16)
    qu = big[1:].view(1, 4096, 16, 128)
    xu = (qu,) + x[1:]
    o_u, _ = L.fwd_eager(*xu[:5], 128 ** -0.5, xu[5], True)
    out["unaligned_declined"] = declined.pop("last")
    del drv.launches[:]
    LaunchList.__call__ = real_call
    # poisoned allocations in a replay
    with poisoned_allocations():
        o_p, h_p = L.fwd_eager(*x[:5], 128 ** -0.5, x[5], True)
    out["poisoned"] = bool(o_p.isnan().all()) and bool(h_p.isnan().all())
    # a strided q: the host path copies it, so no list (MAX_RECORDINGS tries, then the host path only)
    L.EAGER_LISTS.clear()
    qs = torch.randn(1, 4096, 128, 16).to(torch.bfloat16).transpose(-1, -2)
    xs = (qs,) + x[1:]
    for _ in range(L.EAGER_LISTS.MAX_RECORDINGS + 2):
        L.fwd_eager(*xs[:5], 128 ** -0.5, xs[5], True)
    out["strided_entries"] = list(L.EAGER_LISTS.lists.values())
    # a list keeps no tensor of the call it was recorded from (inputs, outputs, buffers)
    import gc, weakref
    L.EAGER_LISTS.clear()
    y = inputs(1, 4096)
    o_y, h_y = L.fwd_eager(*y[:5], 128 ** -0.5, y[5], True)
    refs = [weakref.ref(t) for t in y + (o_y, h_y)]
    del y, o_y, h_y, drv.launches[:]            # (the stand-in driver keeps each launch's arguments)
    gc.collect()
    out["list_recorded"] = [type(v).__name__ for v in L.EAGER_LISTS.lists.values()]
    out["alive_after_record"] = sum(r() is not None for r in refs)
    out["hooked"] = hooked
    del drv.launches[:]
print(json.dumps(out))
"""


def _assert_replayed(r, names):
    """Each case recorded one list, and its replay on fresh inputs made the host path's launches without a JIT run
    or a host-path launch key."""
    for name in names:
        case = r[name]
        assert case["kinds"] == ["LaunchList"], (name, case)
        fresh = case["fresh"]
        assert fresh["same"], (name, fresh["diff"])
        assert fresh["jit"] == 0 and fresh["host_path_jit"] == 0, (name, fresh)


def test_forward_launch_list():
    r = run_json_child(CHILD)
    _assert_replayed(r, ("segmented", "unsegmented_no_states", "unsegmented_h0"))
    # CPU tensors take the Triton stage 2a (kkt_solve_kernel); CUDA ones the Gluon one, through the same host path
    assert r["segmented"]["fresh"]["launches"] == ["segment_window_kernel", "kkt_solve_kernel",
                                                   "chunk_fused_wu_ws_kernel", "chunk_fused_gf_kernel"], r["segmented"]
    assert r["unsegmented_no_states"]["fresh"]["final_none"]
    # a new scale: a new list (recorded on its second call), the same launches as the host path
    assert r["scale"]["same"] and r["scale_again"]["same"] and r["lists_after_scale"] == 1, r
    assert r["handle_off"]["declined"] and r["handle_off"]["same"], r["handle_off"]
    if r["hooked"]:
        assert r["hook"]["declined"] and r["hook"]["same"], r["hook"]
    assert r["unaligned_declined"]
    assert r["poisoned"]
    assert r["strided_entries"] == [3], r["strided_entries"]
    assert r["list_recorded"] == ["LaunchList"] and r["alive_after_record"] == 0, r


TRITON_CHILD = COMMON + r"""
from linattn.ops.gated_delta_rule.triton import forward as TF
from linattn.ops.gated_delta_rule.triton.host import host_path as thp, launches as tcache

def t_replay_vs_host(drv, ins, opts=None, final=True):
    opts = opts or {}
    keys0 = tcache.jit_launches
    with count_jit_runs() as jit:
        o, ht = TF.fwd_eager(*ins[:5], 128 ** -0.5, ins[5], final, *(opts.get(n) for n in ("A_log", "dt_bias")),
                             opts.get("beta_scale", 0))
    all_ins = ins + (opts.get("A_log"), opts.get("dt_bias"))
    a = canon(drv, all_ins, (o, ht))
    res = TF.chunk_gated_delta_rule_fwd(*ins[:5], 128 ** -0.5, ins[5], final, None, **opts)
    b = canon(drv, all_ins, (res.o, res.final_state if final else None))
    return dict(same=a == b, launches=[x[0] for x in a], jit=jit[0], host_path_jit=tcache.jit_launches - keys0,
                final_none=ht is None, diff=[(x, y) for x, y in zip(a, b) if x != y][:2])

out = {}
with fake_hopper() as drv, torch.no_grad():
    gate = dict(A_log=torch.randn(32), dt_bias=torch.randn(32), beta_scale=2)
    for name, (B, T, h0, final, opts) in {"states": (1, 4096, True, True, None), "no_states": (2, 300, False, False, None),
                                          "fla_gate": (3, 200, True, True, gate)}.items():
        TF.EAGER_LISTS.clear()
        for _ in range(2):                             # compile, then record
            x = inputs(B, T, h0=h0)
            TF.fwd_eager(*x[:5], 128 ** -0.5, x[5], final, *((opts or {}).get(n) for n in ("A_log", "dt_bias")),
                         (opts or {}).get("beta_scale", 0))
        del drv.launches[:]
        kinds = [type(v).__name__ for v in TF.EAGER_LISTS.lists.values()]
        out[name] = dict(kinds=kinds, fresh=t_replay_vs_host(drv, inputs(B, T, h0=h0), opts, final=final))
    # the host path's options off: the replay declines and the host path's launches follow
    x = inputs(1, 4096)
    with thp.options(handle=False):
        out["handle_off"] = t_replay_vs_host(drv, x)
    with poisoned_allocations():
        o_p, h_p = TF.fwd_eager(*x[:5], 128 ** -0.5, x[5], True)
    out["poisoned"] = bool(o_p.isnan().all()) and bool(h_p.isnan().all())
    del drv.launches[:]
print(json.dumps(out))
"""


def test_triton_forward_launch_list():
    """The Triton forward's list (triton/forward.py fwd_eager, launches through triton/host.py): a replay makes the
    host path's four launches on the same tensors, with and without states and with FLA's in-kernel gate and beta
    sigmoid (A_log, dt_bias as inputs), without a JIT run; the host path's options off make it decline; poisoned
    allocations are honoured."""
    r = run_json_child(TRITON_CHILD)
    _assert_replayed(r, ("states", "no_states", "fla_gate"))
    for name in ("states", "no_states", "fla_gate"):
        assert r[name]["fresh"]["launches"] == ["kkt_solve_kernel", "wu_kernel", "chunk_state_fwd_kernel",
                                                "chunk_output_kernel"], (name, r[name])
    assert r["no_states"]["fresh"]["final_none"]
    assert r["handle_off"]["same"] and r["handle_off"]["jit"] == 4, r["handle_off"]
    assert r["poisoned"]
