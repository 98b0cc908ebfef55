"""chunk_kda's eager backward through per-signature launch lists (kda/eager.py bwd_eager): under the stand-in sm_90
driver with Triton's CudaLauncher structure (launches recorded, not made; a child process without TRITON_INTERPRET),
each backend accepting CPU tensors and the signature memo on for them as for CUDA ones:
- a repeat call of the backward op (chunk.py's chunk_kda_bwd on one forward's saved tensors) replays the list (the
  backward's launcher chunk_kda_bwd is not entered, no JIT run) and makes the launches the host path makes on the
  same tensors: the recompute's and the backward's kernels, grids, every argument, each pointer the same input,
  output or buffer in the same pattern; for either backend's backward, with and without an initial state, and with
  the gluon backend's Gluon state passes and WY stage (their CUDA test patched away: the list then holds launches of
  both host paths); a repeat public training step replays it too;
- GVA (HV > H: dq and dk summed over the value heads by kda_gva_sum_kernel) and FLA's in-kernel gate (dA_log and
  d dt_bias summed over the chunk slots by col_sum_kernel) are listed as well;
- the Triton or Gluon host path's options off take the host path.
Numerics of the replays on fresh inputs against fp64: the GPU gate's kda section (its train repeat cases)."""
from children import run_json_child   # tests/ is on sys.path
from test_fwd_launch_list import COMMON

CHILD = COMMON + r"""
import sys
sys.path.insert(0, "tests")
import linattn
from kda_cases import kda_inputs
from linattn.ops.kda import chunk as kc, eager as E
from linattn.ops.kda.triton import backward as KB
from linattn.ops.gated_delta_rule import validation
from linattn.ops.gated_delta_rule.gluon.host import host_path as gluon_hp
from linattn.ops.gated_delta_rule.triton.hostsim import _patched
from linattn.ops.gated_delta_rule.triton.host import host_path as triton_hp
from linattn.runtime import call_memo

entered = [0]
real_bwd = KB.chunk_kda_bwd
def counted(*a, **kw):
    entered[0] += 1
    return real_bwd(*a, **kw)
patches = [(call_memo, "memo_applies", lambda q: True), (KB, "chunk_kda_bwd", counted)]
for bname in ("gluon", "triton"):
    patches.append((kc._backends.backends[bname], "supports", lambda **_: (True, "")))
for name in dir(validation):
    if name.startswith("check_") and "value" in name:
        patches.append((validation, name, lambda *_, **__: None))

def leaves(H, HV, T, h0=True, gate=False):
    x = kda_inputs(1, T, H, HV, 128, 128, dtype=torch.bfloat16, h0=h0)
    x = {n: (t.requires_grad_() if t is not None else None) for n, t in x.items()}
    if gate:
        x.update(A_log=torch.randn(HV).requires_grad_(), dt_bias=torch.randn(HV * 128).requires_grad_())
    return x

def step(x, backend, gate=False):
    # o, ht; the gradients of every leaf; the upstream gradients (made first: an address the forward frees and a
    # later tensor reuses would be named as that tensor by canon)
    opts = dict(use_gate_in_kernel=True) if gate else {}
    v = x["v"]
    do = torch.randn(v.shape, dtype=v.dtype)
    dht = torch.randn(v.shape[0], v.shape[2], x["q"].shape[-1], v.shape[-1])
    o, ht = linattn.chunk_kda(**{n: t for n, t in x.items() if t is not None}, output_final_state=True,
                              backend=backend, **opts)
    names = [n for n, t in x.items() if t is not None]
    grads = torch.autograd.grad((o, ht), [x[n] for n in names], (do, dht))
    return (o, ht) + tuple(grads), (do, dht)

def listed():
    return sum(type(v).__name__ == "LaunchList" for v in E.bwd_lists().lists.values())

def replay_vs_host(drv, backend, H=4, HV=4, h0=True, gate=False):
    # the backward op's impl on one forward's saved tensors: three calls (compile, record, replay) then the host path
    # on the same tensors; canon over one backward call (every buffer of the host path lives to its end)
    E.bwd_lists().clear()
    x = leaves(H, HV, 200, h0, gate)
    q, k, v, g, beta, s0 = (x[n] if x[n] is None else x[n].detach() for n in ("q", "k", "v", "g", "beta",
                                                                               "initial_state"))
    A_log, dt_bias, mode = (x["A_log"].detach(), x["dt_bias"].detach(), "softplus") if gate else (None, None, "")
    scale = 128 ** -0.5
    saved = kc._chunk_kda_fwd.impl(q, k, v, g, beta, scale, s0, True, None, A_log, dt_bias, mode, 0.0, False, False,
                                   False, kc.SAVE_STAGE2A, backend)[2:6]
    do = torch.randn(v.shape, dtype=v.dtype)
    dht = torch.randn(1, HV, 128, 128)
    gluon_state = backend == "gluon"
    def bwd():
        return kc._chunk_kda_bwd.impl(q, k, v, g, beta, scale, s0, None, A_log, dt_bias, mode, 0.0, False, False,
                                      False, do, dht, list(saved), gluon_state)
    for _ in range(3):
        bwd()
    del drv.launches[:]
    ins = (q, k, v, g, beta, s0, do, dht, A_log, dt_bias) + tuple(saved)
    e0 = entered[0]
    with count_jit_runs() as jit:
        outs = bwd()
    a = canon(drv, ins, outs)
    res = dict(entered=entered[0] - e0, jit=jit[0], listed=listed())
    E.bwd_lists().clear()
    e0 = entered[0]
    outs = bwd()
    b = canon(drv, ins, outs)
    res.update(entered_host=entered[0] - e0, same=a == b, launches=[l[0] for l in a],
               diff=[(i, [x for x, y in zip(p[2], q[2]) if x != y], [y for x, y in zip(p[2], q[2]) if x != y])
                     for i, (p, q) in enumerate(zip(a, b)) if p != q][:3])
    # the public training step replays it too: its backward's launcher is not entered on a repeat step
    x = leaves(H, HV, 200, h0, gate)
    for _ in range(3):
        step(x, backend, gate)
    e0 = entered[0]
    step(x, backend, gate)
    res["public_entered"] = entered[0] - e0
    del drv.launches[:]
    return res

from linattn.ops.kda.gluon import state as KS, wy_bwd as KW
# the gluon backend's Gluon state passes and WY stage on CPU tensors (their CUDA test patched away): the list then
# holds launches of both host paths
gluon_hooks = [(KS, "kda_state_gluon_supported", lambda *_: (True, "")),
               (KS, "kda_state_fwd_gluon_wanted", lambda *_: True),
               (KW, "kda_wy_bwd_gluon_supported", lambda *_: (True, ""))]

out = {}
with fake_hopper(c_launcher=True) as drv, _patched(patches):
    for backend in ("gluon", "triton"):
        out[backend] = replay_vs_host(drv, backend)
        out[backend + "_no_h0"] = replay_vs_host(drv, backend, h0=False)
    with _patched(gluon_hooks):
        out["gluon_hooks"] = replay_vs_host(drv, "gluon")
    out["gva"] = replay_vs_host(drv, "gluon", H=2, HV=4)
    out["gate"] = replay_vs_host(drv, "gluon", gate=True)
    E.bwd_lists().clear()
    x = leaves(4, 4, 130)
    for _ in range(3):
        step(x, "gluon")
    for hp in (triton_hp, gluon_hp):
        e0 = entered[0]
        with hp.options(plan_cache=False):
            step(x, "gluon")
        out.setdefault("options_off_entered", []).append(entered[0] - e0)
    e0 = entered[0]
    step(x, "gluon")
    out["options_back_entered"] = entered[0] - e0
    del drv.launches[:]
print(json.dumps(out))
"""


def test_kda_backward_replays_its_launch_list():
    r = run_json_child(CHILD)
    gluon_kernels = {"chunk_state_fwd_tma_kernel", "chunk_state_bwd_tma_kernel", "kda_wy_bwd_gluon_kernel"}
    assert gluon_kernels <= set(r["gluon_hooks"]["launches"]), r["gluon_hooks"]
    for case in ("gluon", "triton", "gluon_no_h0", "triton_no_h0", "gluon_hooks", "gva", "gate"):
        c = r[case]
        assert c["listed"] == 1 and c["entered"] == 0 and c["jit"] == 0, (case, c)
        assert c["entered_host"] == 1 and c["same"] and c["public_entered"] == 0, (case, c)
        assert "kda_wy_bwd_kernel" in c["launches"] or "kda_wy_bwd_gluon_kernel" in " ".join(c["launches"]), c
    assert r["gva"]["launches"].count("kda_gva_sum_kernel") == 2, r["gva"]
    assert r["gate"]["launches"].count("col_sum_kernel") == 2, r["gate"]         # dA_log, d dt_bias
    assert r["options_off_entered"] == [1, 1] and r["options_back_entered"] == 0, r
