"""KDA decode's per-signature direct launch (kda/fused_recurrent.py _DIRECT, through GDN's direct_decode): a repeat
eager call of a signature skips the checks, the backend choice and the launcher, and makes the launch the launcher
made (kernel, grid, every argument; fresh outputs of the same shape, strides and dtype), on new tensors too. Under the
stand-in sm_90 driver (linattn.runtime.hostsim: launches recorded, not made; a child process without
TRITON_INTERPRET), with the signature memo switched on for CPU tensors as it is for CUDA ones. No stale hit: another
gate option, lower_bound or dt_bias shape goes through the launcher, and a bad call still raises."""
from children import run_json_child   # tests/ is on sys.path

CHILD = r"""
import json, torch
import linattn
from linattn.runtime.hostsim import count_jit_runs, fake_hopper, normalise
from linattn.ops.gated_delta_rule import fused_recurrent as F
from linattn.ops.kda import fused_recurrent as KF

from linattn.runtime import call_memo
call_memo.memo_applies = lambda q: True
KF._backends.backends["triton"].supports = lambda **_: (True, "")
launcher_calls = [0]
real_impl = F._triton_impl
def counted(*a, **kw):
    launcher_calls[0] += 1
    return real_impl(*a, **kw)
F._triton_impl = counted

def inputs(N=2, H=2, HV=4, K=32, V=16, pool=False, v_first=False, gate=False, dt_2d=False):
    x = dict(q=torch.randn(N, 1, H, K, dtype=torch.bfloat16), k=torch.randn(N, 1, H, K, dtype=torch.bfloat16),
             v=torch.randn(N, 1, HV, V, dtype=torch.bfloat16), g=-torch.rand(N, 1, HV, K),
             beta=torch.rand(N, 1, HV))
    shape = (HV, V, K) if v_first else (HV, K, V)
    if pool:
        x["initial_state"] = torch.randn(2 * N + 1, *shape)
        x["state_indices"] = torch.randperm(2 * N + 1)[:N].to(torch.int32)
    else:
        x["initial_state"] = torch.randn(N, *shape)
    if gate:
        x.update(g=torch.randn(N, 1, HV, K), A_log=torch.randn(HV),
                 dt_bias=torch.randn(HV, K) if dt_2d else torch.randn(HV * K), use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True)
    if v_first:
        x["state_v_first"] = True
    return x

def run(drv, x, **opts):
    launcher_calls[0] = 0
    with count_jit_runs() as jit:
        o, ht = linattn.fused_recurrent_kda(**x, **opts)
    outs = {t.data_ptr() for t in (o, ht) if t is not None and t is not x["initial_state"]}
    launches = [[name, list(grid), [repr(("out",) + normalise(a)[2:]) if isinstance(a, torch.Tensor) and
                                    a.data_ptr() in outs else repr(normalise(a)) for a in args]]
                for name, grid, args in drv.launches]
    del drv.launches[:]
    return dict(launches=launches, launcher=launcher_calls[0], jit=jit[0], pool=ht is x["initial_state"],
                o=[list(o.shape), str(o.dtype)])

CASES = {
    "log_pool_v_first_in_place": (dict(pool=True, v_first=True), dict(inplace=True)),
    "log_out_of_place": (dict(), dict(output_final_state=True, use_qk_l2norm_in_kernel=True)),
    "gate_2d_dt_bias": (dict(gate=True, dt_2d=True), dict(output_final_state=True)),
    "gate_lower_bound": (dict(gate=True), dict(lower_bound=-5.0)),
}
out = {}
with fake_hopper() as drv, torch.no_grad():
    for name, (ikw, opts) in CASES.items():
        KF._DIRECT.clear()
        x = inputs(**ikw)
        first, second = run(drv, x, **opts), run(drv, x, **opts)
        y = inputs(**ikw)
        fresh = run(drv, y, **opts)
        KF._DIRECT.clear()
        fresh_ref = run(drv, y, **opts)
        out[name] = dict(first=first, second=second, fresh=fresh, fresh_ref=fresh_ref, entries=len(KF._DIRECT))
    KF._DIRECT.clear()
    x = inputs(gate=True)
    run(drv, x, lower_bound=-5.0)
    stale = {}
    for vname, kw in {"bound": dict(lower_bound=-3.0), "no_bound": dict(), "bound_int": dict(lower_bound=-5),
                      "dt_2d": dict(dt_bias=x["dt_bias"].view(4, 32), lower_bound=-5.0),
                      "no_beta_sigmoid": dict(use_beta_sigmoid_in_kernel=False, lower_bound=-5.0)}.items():
        stale[vname] = [run(drv, dict(x, **{k: v for k, v in kw.items() if k in x}),
                            **{k: v for k, v in kw.items() if k not in x})["launcher"] for _ in range(2)]
    errors = []
    for bad in (dict(g=torch.randn(2, 1, 4, 16)), dict(lower_bound=1.0), dict(lower_bound=True)):
        try:
            run(drv, dict(x, **{k: v for k, v in bad.items() if k in x}),
                **{k: v for k, v in bad.items() if k not in x})
            errors.append(False)
        except ValueError as e:
            errors.append(True)
print(json.dumps(dict(cases=out, stale=stale, errors=errors)))
"""


def test_kda_direct_launch_matches_the_launcher_and_never_hits_stale():
    res = run_json_child(CHILD)
    for name, r in res["cases"].items():
        first, second, fresh, ref = r["first"], r["second"], r["fresh"], r["fresh_ref"]
        assert first["launcher"] == 1 and len(first["launches"]) == 1, (name, first)
        assert first["launches"][0][0] == "fused_recurrent_gdn_fwd_kernel", name
        assert r["entries"] == 1, name
        for direct in (second, fresh):
            assert direct["launcher"] == 0 and direct["jit"] == 0, (name, direct)
        assert second["launches"] == first["launches"], name
        assert fresh["launches"] == ref["launches"] and fresh["launches"] != first["launches"], name
        assert first["o"] == second["o"] == fresh["o"] and first["pool"] == second["pool"], name
    # another lower_bound value, a 2-D dt_bias, another option: each first call runs the launcher, its repeat is
    # direct; an int bound of the same value is the same call (the kernel takes float(lower_bound)): direct at once
    bound_int = res["stale"].pop("bound_int")
    assert bound_int == [0, 0], bound_int
    for name, counts in res["stale"].items():
        assert counts == [1, 0], (name, counts)
    assert res["errors"] == [True, True, True], res["errors"]
