"""The small public ops' launch lists (runtime/op_lists.py): causal_conv1d_update, causal_conv1d_update3,
rms_norm_gated and causal_conv1d (forward without autograd) keep, per checked call signature, the launch list of a
plain eager call and replay it on a repeat call. Under the stand-in sm_90 driver with Triton's CudaLauncher structure
(runtime/hostsim.py: launches recorded, not made; a child process without TRITON_INTERPRET), each op's Triton
backend accepting CPU tensors:
- a repeat call replays (the Triton launcher is not entered, no JIT run) and makes the launches its host path makes
  on the same tensors: kernel, grid, every argument, each pointer the same input or output at the same offset; on
  new tensors of the signature too; outputs of the host path's shapes (a launcher's `y.view(x.shape)` included);
- poisoned allocations are honoured by a replay (its outputs NaN: the stand-in launches write nothing);
- nothing stale: a launch hook, the host path's options off, a call recording autograd (rms_norm_gated and
  causal_conv1d with an input requiring grad keep their autograd graph), another signature, and a weight the host
  path copies (non-contiguous: never a list) each take the host path;
- rms_norm_gated's backward (autograd's) repeats through the host path's handles (no JIT run), its dweight summed by
  col_sum_kernel (no torch sum or cast); l2norm's forward and backward passes repeat through handles too.
Numerics of a replay on fresh inputs against fp64: the GPU gate's layer_ops section (its repeat cases)."""
from children import run_json_child   # tests/ is on sys.path
from test_fwd_launch_list import COMMON

CHILD = COMMON + r"""
import linattn
from linattn.runtime.launch_list import LaunchList
from linattn.ops.conv1d import api as ca, update as cu
from linattn.ops.conv1d.triton import conv1d as C, update as U
from linattn.ops.norm import api as na
from linattn.ops.norm.triton import rms_norm_gated as N
from linattn.ops.gated_delta_rule.triton.hostsim import _patched, count_torch_ops

bf = torch.bfloat16
entered = [0]
def counted(mod, name):
    real = getattr(mod, name)
    def f(*a, **k):
        entered[0] += 1
        return real(*a, **k)
    return (mod, name, f)

patches = [(m._backends.backends["triton"], "supports", lambda **_: (True, "")) for m in (ca, cu, na)]
patches += [counted(U, "conv1d_update"), counted(U, "conv1d_update3"), counted(N, "rms_norm_gated_fwd"),
            counted(C, "conv1d_fwd")]

def flat_canon(drv, ins, outs):
    # COMMON's canon with update3's triples of inputs flattened
    return canon(drv, [t for i in ins for t in (i if isinstance(i, tuple) else (i,))], outs)

def outs_of(r):
    return tuple(r) if isinstance(r, (tuple, list)) else (r,)

def check(drv, lists, make, call):
    # make() -> fresh inputs of one signature; call(ins) -> the public call's result
    lists.clear()
    ins = make()
    for _ in range(3):                        # the first call compiles (no list); then recorded
        call(ins)
    del drv.launches[:]
    n_lists = sum(isinstance(v, LaunchList) for v in lists.lists.lists.values())
    e0 = entered[0]
    with count_jit_runs() as jit:
        r = outs_of(call(ins))
    a = flat_canon(drv, ins, r)
    replay = dict(entered=entered[0] - e0, jit=jit[0], lists=n_lists)
    ins2 = make()                              # new tensors of the signature
    e0 = entered[0]
    r2 = outs_of(call(ins2))
    a2 = flat_canon(drv, ins2, r2)
    replay["entered_new"] = entered[0] - e0
    lists.clear()                              # the host path on the same tensors
    e0 = entered[0]
    rb = outs_of(call(ins))
    b = flat_canon(drv, ins, rb)
    replay["entered_host"] = entered[0] - e0
    shapes = [None if t is None else list(t.shape) for t in r]
    shapes_host = [None if t is None else list(t.shape) for t in rb]
    call(ins)                                  # recorded again: a list for what follows
    with poisoned_allocations():
        rp = outs_of(call(make()))
    del drv.launches[:]
    return dict(replay, same=a == b, same_new=a2 == b, launches=len(a), shapes=shapes == shapes_host,
                poisoned=all(bool(torch.isnan(t.float()).all()) for t in rp if t is not None))

D, W = 256, 4
def upd_in(N=3, T=None, bias=True):
    x = torch.randn(N, D, dtype=bf) if T is None else torch.randn(N, T, D, dtype=bf)
    return (x, torch.randn(N, D, W, dtype=bf), torch.randn(D, W), torch.randn(D) if bias else None)
def upd(ins):
    return linattn.causal_conv1d_update(ins[0], ins[1], ins[2], ins[3], activation="silu")
def upd3_in():
    return tuple(upd_in() for _ in range(3))
def upd3(ins):
    return cu.causal_conv1d_update3([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                                    [i[3] for i in ins], activation="silu")
def norm_in(grad=False):
    x = torch.randn(40, 4, 32, dtype=bf, requires_grad=grad)
    return (x, torch.randn(40, 4, 32, dtype=bf), torch.randn(32), None)
def norm(ins, **kw):
    return linattn.rms_norm_gated(ins[0], ins[1], ins[2], ins[3], group_size=32, **kw)
def conv_in(final=True, states=True, grad=False):
    x = torch.randn(2, 50, D, dtype=bf, requires_grad=grad)
    return (x, torch.randn(D, W), torch.randn(D), torch.randn(2, 50, D, dtype=bf),
            torch.randn(2, D, W, dtype=bf) if states else None)
def conv(ins, final=True):
    return linattn.causal_conv1d(ins[0], ins[1], ins[2], ins[3], ins[4], output_final_state=final, activation="silu")

out = {}
with fake_hopper(c_launcher=True) as drv, torch.no_grad(), _patched(patches):
    out["update"] = check(drv, U.LISTS, upd_in, upd)
    out["update_T2"] = check(drv, U.LISTS, lambda: upd_in(T=2, bias=False), upd)
    out["update3"] = check(drv, U.LISTS3, upd3_in, lambda ins: upd3(ins))
    out["norm"] = check(drv, N.LISTS, norm_in, norm)
    out["conv_final"] = check(drv, C.LISTS, conv_in, conv)
    out["conv_no_final"] = check(drv, C.LISTS, lambda: conv_in(states=False), lambda i: conv(i, final=False))

    # declines: the host path runs (the launcher is entered)
    ins = upd_in()
    for _ in range(3):
        upd(ins)
    v = ins[1]._version
    out["replay_entered"] = -entered[0]
    upd(ins)                                   # a replay: the pool's version counter moves as in the host path
    out["replay_entered"] += entered[0]
    out["version_step"] = ins[1]._version - v
    def entered_by(fn):
        e0 = entered[0]
        fn()
        return entered[0] - e0
    out["hook_entered"] = entered_by(lambda: with_launch_hook(lambda: upd(ins)))
    with U.host_path.options(handle=False):
        out["options_off_entered"] = entered_by(lambda: upd(ins))
    out["other_signature_entered"] = entered_by(lambda: upd(upd_in(N=5)))
    wt = torch.randn(W, D).t()                 # non-contiguous: the host path copies it, so no list
    xs = upd_in()
    for _ in range(4):
        linattn.causal_conv1d_update(xs[0], xs[1], wt, xs[3], activation="silu")
    out["copied_weight_entered"] = entered_by(lambda: linattn.causal_conv1d_update(xs[0], xs[1], wt, xs[3],
                                                                                  activation="silu"))
    del drv.launches[:]

with fake_hopper(c_launcher=True) as drv, _patched(patches):
    # grad mode on, an input requiring grad: the autograd path (a graph recorded), never a list
    N.LISTS.clear()
    C.LISTS.clear()
    g_ins = norm_in(grad=True)
    for _ in range(4):
        y = norm(g_ins)
    out["norm_grad_fn"] = y.grad_fn is not None
    c_ins = conv_in(grad=True)
    for _ in range(4):
        y, final = conv(c_ins)
    out["conv_grad_fn"] = y.grad_fn is not None
    out["grad_lists"] = sum(isinstance(v, LaunchList) for L in (N.LISTS, C.LISTS) for v in L.lists.lists.values())
    # the norm's backward (a training step's): its repeat goes through the host path's handles, no JIT run, and
    # dweight comes from col_sum_kernel (no torch sum or cast)
    dy = torch.randn_like(g_ins[0])
    w = g_ins[2].requires_grad_(True)
    for _ in range(2):
        norm(g_ins).backward(dy)
    del drv.launches[:]
    y = norm(g_ins)
    with count_jit_runs() as jit:
        ops = count_torch_ops(lambda: y.backward(dy))
    out["norm_bwd"] = dict(jit=jit[0], launches=[l[0] for l in drv.launches][1:],
                           sums=[o for o in ops["device_ops"] if "sum" in o or "_to_copy" in o],
                           dw=list(w.grad.shape), dw_dtype=str(w.grad.dtype))
    # l2norm's passes (q and k of every chunk op call with use_qk_l2norm_in_kernel) the same way
    from linattn.ops.norm.triton import l2norm as L2
    xq = torch.randn(3, 70, 2, 64, dtype=bf)
    def l2_pair():
        yq, rs = L2.l2norm_fwd(xq, 1e-6)
        return L2.l2norm_bwd(xq, rs, torch.randn_like(xq))
    l2_pair()
    del drv.launches[:]
    with count_jit_runs() as jit:
        l2_pair()
    out["l2norm"] = dict(jit=jit[0], launches=[l[0] for l in drv.launches])
    del drv.launches[:]
print(json.dumps(out))
"""


def test_small_ops_replay_their_launch_lists():
    r = run_json_child(CHILD)
    for name in ("update", "update_T2", "update3", "norm", "conv_final", "conv_no_final"):
        case = r[name]
        assert case["lists"] == 1, (name, case)
        assert case["entered"] == 0 and case["jit"] == 0 and case["entered_new"] == 0, (name, case)
        assert case["entered_host"] == 1, (name, case)         # the host path, for the comparison
        assert case["same"] and case["same_new"] and case["shapes"], (name, case)
        assert case["launches"] == (2 if name == "conv_final" else 1), (name, case)
        assert case["poisoned"], (name, case)
    for name in ("hook_entered", "options_off_entered", "other_signature_entered", "copied_weight_entered"):
        assert r[name] == 1, (name, r[name])
    assert r["replay_entered"] == 0 and r["version_step"] == 1
    assert r["norm_grad_fn"] and r["conv_grad_fn"]
    assert r["grad_lists"] == 0
    nb = r["norm_bwd"]
    assert nb["jit"] == 0 and nb["launches"] == ["rms_norm_gated_bwd_kernel", "col_sum_kernel"], nb
    assert nb["sums"] == [] and nb["dw"] == [32] and nb["dw_dtype"] == "torch.float32", nb
    assert r["l2norm"] == dict(jit=0, launches=["l2norm_fwd_kernel", "l2norm_bwd_kernel"]), r["l2norm"]
