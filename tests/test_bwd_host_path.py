"""A training step's host path under the stand-in sm_90 driver (linattn.runtime.hostsim: launches recorded, not made;
a child process without TRITON_INTERPRET):
- the Triton backward's launches go through triton/host.py's `launches` (the compiled kernel's handle per launch
  signature): a repeated backward makes no JIT run and the JIT path's launches (kernel, grid, every argument, each
  pointer by the input or buffer it lies in), with states, without, varlen, with FLA's in-kernel gate;
- bwd_eager's launch lists (triton/backward.py) for both backends' backward ops replay the host path's launches with
  no JIT run and no torch device op in what they record, FLA's in-kernel gate included; a large call, the host
  path's options off and poisoned allocations as launch_list.py says;
- both forward ops, as autograd calls them, replay the forward's launch list."""
from children import run_json_child   # tests/ is on sys.path
from test_fwd_launch_list import COMMON

CHILD = COMMON + r"""
from linattn.runtime.hostsim import count_jit_runs, fake_hopper
from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
from linattn.ops.gated_delta_rule.triton.host import host_path as thp

def bwd(x, do, dht, cu, opts):
    return chunk_gated_delta_rule_bwd(*x[:5], 128 ** -0.5, x[5], cu, do, dht, **opts)

out = {}
with fake_hopper() as drv, torch.no_grad():
    gate = dict(A_log=torch.randn(32), dt_bias=torch.randn(32), beta_scale=2)
    cases = {"states": (1, 1024, True, False, {}), "no_states": (2, 300, False, False, {}),
             "varlen": (1, 700, True, True, {}), "fla_gate": (2, 200, True, False, gate)}
    for name, (B, T, h0, varlen, opts) in cases.items():
        x = inputs(B, T, h0=h0)
        cu = torch.tensor([0, 130, 450, 700]) if varlen else None
        if varlen:
            x = x[:5] + (torch.randn(3, 32, 128, 128) if h0 else None,)
        do = torch.randn_like(x[2])
        dht = torch.randn_like(x[5]) if h0 else None
        bwd(x, do, dht, cu, opts)                       # compile and plan
        del drv.launches[:]
        with count_jit_runs() as jit:
            res = bwd(x, do, dht, cu, opts)
        ins = x + (do, dht) + tuple(opts.get(n) for n in ("A_log", "dt_bias"))
        a = canon(drv, ins, res)
        with thp.options(plan_cache=False, handle=False), count_jit_runs() as jit_off:
            res2 = bwd(x, do, dht, cu, opts)
        b = canon(drv, ins, res2)
        out[name] = dict(jit=jit[0], jit_off=jit_off[0], same=a == b, launches=[l[0] for l in a],
                         diff=[(p, q) for p, q in zip(a, b) if p != q][:2])
print(json.dumps(out))
"""


def test_triton_backward_launches_through_the_host_path():
    r = run_json_child(CHILD)
    for name in ("states", "no_states", "varlen", "fla_gate"):
        c = r[name]
        sums = ["col_sum_kernel"] * 2 if name == "fla_gate" else []      # dA_log's and d dt_bias's over the slots
        assert c["launches"][-4 - len(sums):] == ["chunk_dv_local_kernel", "chunk_state_bwd_kernel",
                                                  "chunk_local_bwd_kernel", "chunk_wy_bwd_kernel"] + sums, \
            (name, c["launches"])
        assert c["jit"] == 0, (name, c)                 # every launch of the repeat through a kept handle
        assert c["jit_off"] == len(c["launches"]), (name, c)
        assert c["same"], (name, c["diff"])


LIST_CHILD = COMMON + r"""
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.hostsim import count_jit_runs, fake_hopper
from linattn.ops.gated_delta_rule.triton import backward as TB
from linattn.ops.gated_delta_rule.triton.hostsim import count_torch_ops
from linattn.ops.gated_delta_rule.triton.host import host_path as thp, launches as tcache

def case(B, T, h0, opts):
    x = inputs(B, T, h0=h0)
    return x, torch.randn_like(x[2]), (torch.randn_like(x[5]) if h0 else None)

def eager(x, do, dht, opts):
    return TB.bwd_eager(*x[:5], 128 ** -0.5, x[5], do, dht, *(opts.get(n) for n in ("A_log", "dt_bias")),
                        opts.get("beta_scale", 0))

out = {}
with fake_hopper() as drv, torch.no_grad():
    gate = dict(A_log=torch.randn(32), dt_bias=torch.randn(32), beta_scale=2)
    for name, (B, T, h0, opts) in {"states": (1, 1024, True, {}), "no_states": (2, 300, False, {}),
                                   "fla_gate": (2, 200, True, gate)}.items():
        TB.BWD_LISTS.clear()
        for _ in range(2):                             # compile, then record
            eager(*case(B, T, h0, opts), opts)
        kinds = [type(v).__name__ for v in TB.BWD_LISTS.lists.values()]
        del drv.launches[:]
        x, do, dht = case(B, T, h0, opts)
        keys0 = tcache.jit_launches
        with count_jit_runs() as jit:
            res = eager(x, do, dht, opts)
        ins = x + (do, dht) + tuple(opts.get(n) for n in ("A_log", "dt_bias"))
        a = canon(drv, ins, res)
        res2 = TB.chunk_gated_delta_rule_bwd(*x[:5], 128 ** -0.5, x[5], None, do, dht, **opts)
        b = canon(drv, ins, res2)
        # the host path that a list records makes no torch op that launches device work
        ops = count_torch_ops(lambda: TB.chunk_gated_delta_rule_bwd(*x[:5], 128 ** -0.5, x[5], None, do, dht,
                                                                    free_u=False, **opts))
        del drv.launches[:]
        out[name] = dict(kinds=kinds, same=a == b, launches=[l[0] for l in a], jit=jit[0],
                         host_path_jit=tcache.jit_launches - keys0, device_ops=ops["device_ops"],
                         outs=[t is not None for t in res], diff=[(p, q) for p, q in zip(a, b) if p != q][:2])
    # a call above BWD_LIST_MAX_TOKEN_HEADS takes the host path and records nothing
    TB.BWD_LISTS.clear()
    saved, TB.BWD_LIST_MAX_TOKEN_HEADS = TB.BWD_LIST_MAX_TOKEN_HEADS, 1024 * 32 - 1
    for _ in range(2):
        eager(*case(1, 1024, True, {}), {})
    out["large_lists"] = len(TB.BWD_LISTS.lists)
    TB.BWD_LIST_MAX_TOKEN_HEADS = saved
    # the host path's options off: the replay declines and the host path's launches follow
    for _ in range(2):
        eager(*case(1, 1024, True, {}), {})
    x, do, dht = case(1, 1024, True, {})
    del drv.launches[:]
    with thp.options(handle=False), count_jit_runs() as jit:
        eager(x, do, dht, {})
    out["handle_off_jit"] = jit[0]
    with poisoned_allocations():
        r = eager(x, do, dht, {})
    out["poisoned"] = all(bool(t.isnan().all()) for t in r[:6])
    del drv.launches[:]
print(json.dumps(out))
"""


def test_triton_backward_launch_list():
    """bwd_eager (triton/backward.py): a fixed-length backward's second call of a signature records a list, and a
    replay makes the host path's seven launches on the same tensors (each pointer the same input or output at the
    same offset, the buffers in the same pattern) without a JIT run or a launch key, with and without states, and with
    FLA's in-kernel gate (two more launches: dA_log's and d dt_bias's column sums over the chunk slots); the recorded
    host path launches no torch device op; a call above BWD_LIST_MAX_TOKEN_HEADS records nothing; the host path's
    options off make the replay decline; poisoned allocations are honoured (every gradient NaN: the stand-in driver
    runs no kernel)."""
    r = run_json_child(LIST_CHILD)
    seven = ["kkt_solve_kernel", "wu_kernel", "chunk_state_fwd_kernel", "chunk_dv_local_kernel",
             "chunk_state_bwd_kernel", "chunk_local_bwd_kernel", "chunk_wy_bwd_kernel"]
    for name in ("states", "no_states", "fla_gate"):
        c = r[name]
        assert c["kinds"] == ["LaunchList"], (name, c)
        sums = ["col_sum_kernel"] * 2 if name == "fla_gate" else []
        assert c["launches"] == seven + sums and c["same"], (name, c["launches"], c["diff"])
        assert c["jit"] == 0 and c["host_path_jit"] == 0, (name, c)
        assert c["device_ops"] == [], (name, c["device_ops"])
    assert r["no_states"]["outs"] == [True] * 5 + [False] * 3
    assert r["fla_gate"]["outs"] == [True] * 8
    assert r["large_lists"] == 0
    assert r["handle_off_jit"] == 7
    assert r["poisoned"]


GLUON_CHILD = COMMON + r"""
from linattn.runtime.hostsim import count_jit_runs, fake_hopper
from linattn.ops.gated_delta_rule.triton import backward as TB
from linattn.ops.gated_delta_rule.triton.hostsim import count_torch_ops
from linattn.ops.gated_delta_rule.gluon import backend as GB

def kept(x):
    # what the autograd forward keeps for this backward: stage 2a's gcum and Tinv (values immaterial here)
    B, T, HV = x[2].shape[:3]
    return torch.randn(B * T, HV).cumsum(0), torch.randn(B * T, HV, 64).to(x[1].dtype)

def call(x, do, dht, st):
    return GB._chunk_gdn_bwd_gluon.impl(*x[:5], 128 ** -0.5, x[5], None, do, dht, *st)

out = {}
with fake_hopper() as drv, torch.no_grad():
    for name, (B, T, h0) in {"states": (1, 1024, True), "no_states": (2, 300, False),
                             "segments": (1, 8192, True)}.items():
        TB.BWD_LISTS.clear()
        for _ in range(2):                             # compile, then record
            x = inputs(B, T, h0=h0)
            call(x, torch.randn_like(x[2]), torch.randn_like(x[5]) if h0 else None, kept(x))
        kinds = [type(v).__name__ for v in TB.BWD_LISTS.lists.values()]
        x = inputs(B, T, h0=h0)
        do, dht, st = torch.randn_like(x[2]), (torch.randn_like(x[5]) if h0 else None), kept(x)
        del drv.launches[:]
        with count_jit_runs() as jit:
            res = call(x, do, dht, st)
        ins = x + (do, dht) + st
        a = canon(drv, ins, res)
        saved, TB.BWD_LIST_MAX_TOKEN_HEADS = TB.BWD_LIST_MAX_TOKEN_HEADS, 0      # the host path
        b = canon(drv, ins, call(x, do, dht, st))
        ops = count_torch_ops(lambda: call(x, do, dht, st))
        TB.BWD_LIST_MAX_TOKEN_HEADS = saved
        del drv.launches[:]
        out[name] = dict(kinds=kinds, same=a == b, launches=[l[0] for l in a], jit=jit[0],
                         device_ops=ops["device_ops"], diff=[(p, q) for p, q in zip(a, b) if p != q][:2])
print(json.dumps(out))
"""


def test_gluon_backward_launch_list():
    """The gluon backend's backward (Triton stages with its Gluon hooks) through bwd_eager: the second call of a
    signature records a list, a replay makes the host path's launches (the Gluon state passes' and local/WY kernel's
    TMA descriptors by their fields and base) without a JIT run, and the host path it records launches no torch
    device op (the empty [0] stand-in for an absent dh0 and the window kernels' zeroed flags only); at B1 T8192 both
    passes in segments (the GPU gate's repeat case replays them against fp64)."""
    r = run_json_child(GLUON_CHILD)
    for name, c in r.items():
        assert c["kinds"] == ["LaunchList"], (name, c)
        assert c["same"] and c["jit"] == 0, (name, c["launches"], c["diff"])
        assert "chunk_state_bwd_tma_kernel" in c["launches"], (name, c["launches"])
        # (and, segmented, the window kernels' zeroed flags: recorded allocations, remade by a replay)
        allowed = {"aten.new_empty.default"} | ({"aten.zeros.default"} if name == "segments" else set())
        assert set(c["device_ops"]) <= allowed, (name, c["device_ops"])
    # the gate-free recompute from the forward's kept gcum and Tinv (no stage 2a): h and Vnew without U, W alone; at
    # B1 T8192 in segments: the window kernels, the flagged pairs' launches and the segment launches of both passes,
    # one stream
    for name in ("states", "no_states"):
        assert r[name]["launches"][:2] == ["chunk_state_gf_kernel", "wu_kernel"], r[name]
    assert r["segments"]["launches"] == ["segment_window_kernel", "chunk_state_gf_kernel",
                                         "chunk_state_gf_kernel", "wu_kernel", "segment_window_kernel",
                                         "chunk_state_bwd_tma_kernel", "chunk_state_bwd_tma_kernel",
                                         "chunk_local_wy_bwd_kernel"], r["segments"]["launches"]


FWD_OPS_CHILD = COMMON + r"""
from linattn.runtime.hostsim import count_jit_runs, fake_hopper
from linattn.ops.gated_delta_rule import api
from linattn.ops.gated_delta_rule.gluon import backend as GB
from linattn.ops.gated_delta_rule.triton import forward as TF

out = {}
with fake_hopper() as drv, torch.no_grad():
    for name, op, lists in (("triton", api._chunk_gdn_fwd, TF.EAGER_LISTS),
                            ("gluon", GB._chunk_gdn_fwd_gluon, L.EAGER_LISTS)):
        lists.clear()
        extra = (None, None, 0, False) if name == "triton" else ()
        for i in range(3):                             # compile, record, replay
            x = inputs(1, 1024)
            with count_jit_runs() as jit:
                res = op.impl(*x[:5], 128 ** -0.5, x[5], True, None, *extra)
            del drv.launches[:]
        out[name] = dict(kinds=[type(v).__name__ for v in lists.lists.values()], jit_last=jit[0],
                         shapes=[list(t.shape) for t in res], dtypes=[str(t.dtype) for t in res])
print(json.dumps(out))
"""


def test_forward_ops_take_their_launch_lists():
    """The forward custom ops' implementations (what autograd calls for a training step) go through the forward's
    launch list for a fixed-length call: after a compile and a record, the third call makes no JIT run."""
    r = run_json_child(FWD_OPS_CHILD)
    for name in ("triton", "gluon"):
        assert r[name]["kinds"] == ["LaunchList"] and r[name]["jit_last"] == 0, (name, r[name])
        assert r[name]["shapes"][:2] == [[1, 1024, 32, 128], [1, 32, 128, 128]], r[name]
    # the gluon op returns what its autograd keeps for the backward: stage 2a's gcum (fp32) and Tinv (k's dtype)
    assert r["gluon"]["shapes"][2:] == [[1024, 32], [1024, 32, 64]], r["gluon"]
    assert r["gluon"]["dtypes"][2:] == ["torch.float32", "torch.bfloat16"], r["gluon"]
