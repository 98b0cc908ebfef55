"""chunk_kda's eager forward without autograd through launch lists (kda/eager.py), on the Gluon stages and on the
Triton ones, and its direct path (chunk.py _DIRECT, each backend's direct hook). Under the stand-in sm_90 driver with Triton's CudaLauncher structure
(launches recorded, not made; a child process without TRITON_INTERPRET), the signature memo on for CPU tensors as it
is for CUDA ones and the gluon backend accepting them:
- a replayed call makes the launches the host path (chunk_kda_fwd on the Gluon stages) makes on the same tensors:
  kernel, grid, every argument, each pointer the same input or output at the same offset; with and without states,
  with FLA's in-kernel gate (A_log, dt_bias inputs of the list), and the autograd forward's (stage 2a's outputs
  kept: outputs of the list); the Triton stages' six launches likewise (states, none, the gate with state_v_first);
  no JIT run in a replay;
- a repeat public call replays the list without entering the backend's impl, on the same tensors and on new ones,
  for either backend;
- nothing stale: forgotten lists, a launch hook, an input requiring grad, l2norm in the kernel, an initial state the
  call converts (bf16), a shape the fused stages decline (state_v_first: the Triton stages 2b-4, launched through
  the JIT, never listed) each take the full path."""
from children import run_json_child   # tests/ is on sys.path
from test_fwd_launch_list import COMMON

CHILD = COMMON + r"""
import sys
sys.path.insert(0, "tests")
import linattn
from kda_cases import kda_inputs
from linattn.ops.kda import chunk as kc, eager as E
from linattn.ops.kda.triton.forward import chunk_kda_fwd
from linattn.ops.gated_delta_rule import validation
from linattn.ops.gated_delta_rule.triton.hostsim import _patched
from linattn.runtime import call_memo

impl_calls = [0]                                        # either backend's impl: both accept CPU tensors here
patches = [(call_memo, "memo_applies", lambda q: True)]
for bname in ("gluon", "triton"):
    reg = kc._backends.backends[bname]
    def counted(*a, _real=reg.impl, **kw):
        impl_calls[0] += 1
        return _real(*a, **kw)
    patches += [(reg, "supports", lambda **_: (True, "")), (reg, "impl", counted)]
for name in dir(validation):
    if name.startswith("check_") and "value" in name:
        patches.append((validation, name, lambda *_, **__: None))

def kin(B, T, h0=True):
    x = kda_inputs(B, T, 4, 8, 128, 128, dtype=torch.bfloat16, h0=h0)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])

def replay_vs_host(drv, ins, final=True, gate=None, save=False, intra="gluon", v_first=False):
    A_log, dt_bias, mode = gate or (None, None, "")
    args = ins[:5] + (128 ** -0.5, ins[5], final)
    flat = lambda r: r[:2] + r[2] if save else r
    with count_jit_runs() as jit:
        res = flat(E.fwd_eager(*args, A_log, dt_bias, mode, 0.0, False, False, save_stage2a=save,
                               state_v_first=v_first, intra=intra))
    a = canon(drv, ins + (A_log, dt_bias), res)
    res2 = flat(chunk_kda_fwd(*args, None, A_log, dt_bias, mode, 0.0, False, False, intra=intra,
                              save_stage2a=save, state_v_first=v_first))
    b = canon(drv, ins + (A_log, dt_bias), res2)
    return dict(same=a == b, launches=[x[0] for x in a], jit=jit[0], final_none=res[1] is None, outputs=len(res),
                shapes_same=[tuple(t.shape) for t in res if t is not None] == [tuple(t.shape) for t in res2
                                                                                if t is not None])

def public(x, **kw):
    q, k, v, g, beta, h0 = x
    n0 = impl_calls[0]
    res = linattn.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    return res, impl_calls[0] - n0

def direct_vs_full(drv, x, **kw):
    direct, n_direct = public(x, **kw)
    a = canon(drv, x, direct)
    kc._DIRECT.clear()
    full, n_full = public(x, **kw)
    b = canon(drv, x, full)
    return dict(same=a == b, direct_impl=n_direct, full_impl=n_full, launches=len(a))

out = {}
with fake_hopper(c_launcher=True) as drv, torch.no_grad(), _patched(patches):
    for name, (B, T, h0, final, gated, save, intra, v_first) in {
            "states": (1, 300, True, True, False, False, "gluon", False),
            "no_states": (2, 200, False, False, False, False, "gluon", False),
            "gate": (1, 256, True, True, True, False, "gluon", False),
            "save_stage2a": (1, 300, True, True, False, True, "gluon", False),
            "triton_states": (1, 300, True, True, False, False, "triton", False),
            "triton_no_states": (2, 200, False, False, False, False, "triton", False),
            "triton_gate_v_first": (1, 256, True, True, True, False, "triton", True)}.items():
        lists = E.fwd_lists(intra)
        lists.clear()
        gate = (torch.randn(8), torch.randn(8 * 128), "softplus") if gated else None
        for _ in range(2):                             # compile, then record
            x = kin(B, T, h0)
            E.fwd_eager(*x[:5], 128 ** -0.5, x[5], final, *(gate or (None, None, ""))[:3], 0.0, False, False,
                        save_stage2a=save, state_v_first=v_first, intra=intra)
        del drv.launches[:]
        out[name] = replay_vs_host(drv, kin(B, T, h0), final, gate, save, intra, v_first)
        out[name]["listed"] = sum(type(v).__name__ == "LaunchList" for v in lists.lists.values())
    E.fwd_lists("gluon").clear()
    x = kin(1, 300)
    for _ in range(3):                                 # compile, record the list, keep the direct path
        public(x)
    del drv.launches[:]
    out["same_tensors"] = direct_vs_full(drv, x)
    y = kin(1, 300)
    public(y)
    del drv.launches[:]
    out["new_tensors"] = direct_vs_full(drv, y)
    for _ in range(3):                                 # the triton backend's own list and direct path
        public(x, backend="triton")
    del drv.launches[:]
    out["triton_direct"] = direct_vs_full(drv, x, backend="triton")
    E.fwd_lists("gluon").clear()
    out["lists_forgotten"] = [public(x)[1] for _ in range(3)]      # full (declined; records a new list), direct x2
    out["hooked"] = with_launch_hook(lambda: public(x)[1])
    with torch.enable_grad():
        xg = (x[0], x[1], x[2].clone().requires_grad_()) + x[3:]
        out["requires_grad"] = [public(xg)[1] for _ in range(3)]
        # the autograd forward's custom op keeps stage 2a's outputs: a list of its own (save_stage2a)
        out["requires_grad_lists"] = sum(type(v).__name__ == "LaunchList" and k[-1]
                                         for k, v in E.fwd_lists("gluon").lists.items())
    out["l2norm"] = [public(x, use_qk_l2norm_in_kernel=True)[1] for _ in range(3)]
    out["h0_bf16"] = [public(x[:5] + (x[5].bfloat16(),))[1] for _ in range(3)]
    out["direct_again"] = public(x)[1]
    xv = x[:5] + (x[5].transpose(-1, -2).contiguous(),)
    n = len(E.fwd_lists("gluon").lists)
    out["state_v_first"] = [public(xv, state_v_first=True)[1] for _ in range(3)]
    out["state_v_first_lists"] = len(E.fwd_lists("gluon").lists) - n
    del drv.launches[:]
print(json.dumps(out))
"""


def test_kda_eager_list_and_direct_path():
    r = run_json_child(CHILD)
    for case in ("states", "no_states", "gate", "save_stage2a", "triton_states", "triton_no_states",
                 "triton_gate_v_first"):
        c = r[case]
        assert c["same"] and c["shapes_same"] and c["jit"] == 0 and c["listed"] == 1, (case, c)
        want = (["kda_intra_gluon_kernel", "kda_fused_forward_kernel"] if not case.startswith("triton") else
                ["kda_cumsum_kernel", "kda_diag_kernel", "kda_inter_solve_kernel", "wu_kernel",
                 "chunk_state_fwd_kernel", "chunk_output_kernel"])
        assert c["launches"] == want, (case, c)
    assert r["save_stage2a"]["outputs"] == 6 and r["states"]["outputs"] == 2, r
    assert r["no_states"]["final_none"] and not r["states"]["final_none"], r
    for case in ("same_tensors", "new_tensors", "triton_direct"):
        c = r[case]
        assert c["same"] and c["direct_impl"] == 0 and c["launches"] == (2 if case != "triton_direct" else 6), (case, c)
    assert r["same_tensors"]["full_impl"] == 1, r
    assert r["lists_forgotten"] == [1, 0, 0], r
    assert r["hooked"] == 1, r
    assert r["requires_grad"] == [1, 1, 1] and r["requires_grad_lists"] == 1, r
    assert r["l2norm"] == [1, 1, 1] and r["h0_bf16"] == [1, 1, 1], r
    assert r["direct_again"] == 0, r
    assert r["state_v_first"] == [1, 1, 1] and r["state_v_first_lists"] == 0, r
