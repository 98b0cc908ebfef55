"""The decode's per-signature direct launch (fused_recurrent.py _DIRECT, triton/fused_recurrent.py direct_decode):
a repeat call of a signature whose launcher call took the caller's own tensors allocates its outputs and calls the
kept compiled kernel's `run` with the argument tuple flattened once. Under the stand-in sm_90 driver
(linattn.runtime.hostsim: launches recorded, not made; a child process without TRITON_INTERPRET), the signature memo
switched on for CPU tensors as it is for CUDA ones:
- a direct call makes the launch the launcher makes (kernel, grid, every argument; fresh outputs of the same shape,
  strides and dtype), without the launcher or the JIT, on new tensors too (their pointers), for the one-tile and the
  persistent kernel, in place, out of place, with and without a final state, state_v_first, the fused gate;
- no stale hit: another dtype, shape, stride, option, scale or grad requirement goes through the launcher (and a
  bad call still raises); a call whose launcher copies an input (non-contiguous q) never gets a direct launch;
- the host path's options, a registered Triton launch hook and poisoned allocations are honoured per call.
Both with the default stand-in launcher (the direct launch calls `run`) and with one of Triton's CudaLauncher structure
(it calls the C launch under it, runtime/c_launch.py). What a GPU adds (the C launcher running the kernel) is the same
call with the same arguments."""
import pytest

from children import run_json_child   # tests/ is on sys.path

CHILD = r"""
import json, math, torch
import linattn
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.hostsim import count_jit_runs, fake_hopper, normalise
from linattn.ops.gated_delta_rule import fused_recurrent as F
from linattn.ops.gated_delta_rule.triton import fused_recurrent as L

from linattn.runtime import call_memo
call_memo.memo_applies = lambda q: True
F._backends.backends["triton"].supports = lambda **_: (True, "")
L.device_facts = lambda device=None: type("Facts", (), {"num_sms": 2})()   # the persistent kernel from N * HV >= 64
launcher_calls = [0]
real_launcher = F.fused_recurrent_gdn_fwd
def counted(*a, **kw):
    launcher_calls[0] += 1
    return real_launcher(*a, **kw)
F.fused_recurrent_gdn_fwd = counted

def inputs(N, H=2, HV=4, K=32, V=32, dtype=torch.bfloat16, state=torch.float32, pool=False, v_first=False,
           gate=False):
    x = dict(q=torch.randn(N, 1, H, K, dtype=dtype), k=torch.randn(N, 1, H, K, dtype=dtype),
             v=torch.randn(N, 1, HV, V, dtype=dtype), g=-torch.rand(N, 1, HV), beta=torch.rand(N, 1, HV))
    shape = (HV, V, K) if v_first else (HV, K, V)
    if pool:
        x["initial_state"] = torch.randn(2 * N + 1, *shape).to(state)
        x["state_indices"] = torch.randperm(2 * N + 1)[:N]
    else:
        x["initial_state"] = torch.randn(N, *shape).to(state)
    if gate:
        x.update(A_log=torch.randn(HV), dt_bias=torch.randn(HV), use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True)
    if v_first:
        x["state_v_first"] = True
    return x

def launches(drv, outs):
    # normalised launches; output tensors by shape, strides and dtype (fresh allocations differ in pointer)
    ptrs = {t.data_ptr() for t in outs if t is not None}
    res = []
    for name, grid, args in drv.launches:
        res.append([name, list(grid), [repr(("out",) + normalise(a)[2:]) if isinstance(a, torch.Tensor) and
                                       a.data_ptr() in ptrs else repr(normalise(a)) for a in args]])
    del drv.launches[:]
    return res

def run(drv, x, **opts):
    launcher_calls[0] = 0
    with count_jit_runs() as jit:
        o, ht = linattn.fused_recurrent_gated_delta_rule(**x, **opts)
    outs = (o, ht if ht is not x["initial_state"] else None)
    return dict(launches=launches(drv, outs), launcher=launcher_calls[0], jit=jit[0],
                o=[list(o.shape), list(o.stride()), str(o.dtype)],
                ht=None if ht is None else ("pool" if ht is x["initial_state"] else
                                            [list(ht.shape), list(ht.stride()), str(ht.dtype)]),
                nan=bool(o.isnan().all()) and (ht is None or ht is x["initial_state"] or bool(ht.isnan().all())))

CASES = {  # name: (inputs, call options)
    "fla_fp32_out_of_place": (dict(N=1), dict(output_final_state=True)),
    "pool_bf16_in_place": (dict(N=3, state=torch.bfloat16, pool=True), dict(inplace=True)),
    "persistent_fp32_in_place": (dict(N=64, pool=True), dict(inplace=True)),
    "persistent_fp32_out_of_place": (dict(N=64, pool=True), dict(output_final_state=True)),
    "gate_v_first_no_final": (dict(N=2, v_first=True, gate=True), dict()),
    "v_first_out_of_place": (dict(N=2, v_first=True), dict(output_final_state=True)),
}
out = {}
with fake_hopper(c_launcher=C_LAUNCHER) as drv, torch.no_grad():
    for name, (ikw, opts) in CASES.items():
        F._DIRECT.clear(); F._CHECKED.clear()
        x = inputs(**ikw)
        v0 = x["initial_state"]._version
        first = run(drv, x, **opts)
        second = run(drv, x, **opts)
        y = inputs(**ikw)                                  # same signature, new tensors
        fresh = run(drv, y, **opts)
        F._DIRECT.clear()
        fresh_ref = run(drv, y, **opts)                    # the launcher's launch on them
        out[name] = dict(first=first, second=second, fresh=fresh, fresh_ref=fresh_ref, entries=len(F._DIRECT),
                         bumped=x["initial_state"]._version - v0)

    # no stale hits: each variant of the first case's signature goes through the launcher
    F._DIRECT.clear(); F._CHECKED.clear()
    x = inputs(1)
    run(drv, x, output_final_state=True)
    base = run(drv, x, output_final_state=True)
    variants = {
        "v_fp16": dict(x, v=x["v"].half()),
        "k_fp32": dict(x, k=x["k"].float()),
        "longer_K": inputs(1, K=64),
        "more_heads": inputs(1, HV=8),
        "batch_2": inputs(2),
        "state_bf16": dict(x, initial_state=x["initial_state"].bfloat16()),
        "q_strided": dict(x, q=torch.randn(1, 1, 32, 2, dtype=torch.bfloat16).transpose(-1, -2)),
        "g_size1_strides": dict(x, g=torch.rand(1, 4, 1).neg_().transpose(1, 2)),    # contiguous, other strides
        "no_g": dict(x, g=None),
    }
    stale = {}
    for vname, vx in variants.items():
        stale[vname] = [run(drv, vx, output_final_state=True)["launcher"] for _ in range(2)]
    options = {"l2norm": dict(use_qk_l2norm_in_kernel=True), "scale": dict(scale=0.25),
               "no_final": dict(output_final_state=False), "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
               "backend_named": dict(backend="triton")}
    for oname, okw in options.items():
        kw = dict(output_final_state=True); kw.update(okw)
        stale["opt_" + oname] = [run(drv, x, **kw)["launcher"] for _ in range(2)]
    scale_launch = run(drv, x, output_final_state=True, scale=0.25)["launches"]
    with torch.enable_grad():
        errors = []
        # an input that requires grad after the signature was remembered: not the direct launch, the forward-only
        # path (the outputs require grad; their backward raises)
        o_g, _ = linattn.fused_recurrent_gated_delta_rule(**dict(x, v=x["v"].clone().requires_grad_()),
                                                          output_final_state=True)
        try:
            o_g.float().sum().backward()
        except NotImplementedError as e:
            errors.append(o_g.requires_grad and "no backward" in str(e))
        try:
            linattn.fused_recurrent_gated_delta_rule(**dict(x, g=torch.randn(1, 1, 5)), output_final_state=True)
        except ValueError as e:
            errors.append("g" in str(e))
        try:
            linattn.fused_recurrent_gated_delta_rule(**x, output_final_state=True, pad_slot_id=True)
        except (TypeError, ValueError) as e:
            errors.append("pad_slot_id" in str(e))
    copied = [run(drv, variants["q_strided"], output_final_state=True)["launcher"] for _ in range(2)]
    # per-call switches
    with L.host_path.options(handle=False):
        off = run(drv, x, output_final_state=True)
    from triton import knobs
    knobs.runtime.launch_enter_hook.add(lambda *a, **k: None)
    try:
        hooked = run(drv, x, output_final_state=True)
    finally:
        knobs.runtime.launch_enter_hook.calls.clear()
    with poisoned_allocations():
        poisoned = run(drv, x, output_final_state=True)
    out["_checks"] = dict(base=base, stale=stale, scale_launch=scale_launch, errors=errors, copied=copied,
                          off=off["launcher"], hooked=hooked["launcher"], poisoned=poisoned,
                          direct_again=run(drv, x, output_final_state=True)["launcher"])
print(json.dumps(out))
"""


@pytest.mark.parametrize("c_launcher", [False, True])
def test_direct_launch_matches_the_launcher_and_never_hits_stale(c_launcher):
    # c_launcher: the stand-in's launcher has Triton's CudaLauncher structure, so the direct launch calls the C launch
    # under it (runtime/c_launch.py) and the launcher's launch goes through CudaLauncher.__call__
    res = run_json_child(f"C_LAUNCHER = {c_launcher}\n" + CHILD)
    checks = res.pop("_checks")
    kernels = set()
    for name, r in res.items():
        first, second, fresh, ref = r["first"], r["second"], r["fresh"], r["fresh_ref"]
        assert first["launcher"] == 1 and len(first["launches"]) == 1, (name, first)
        assert r["entries"] == 1, name                          # the direct launch was built from the first call
        for direct in (second, fresh):
            assert direct["launcher"] == 0 and direct["jit"] == 0, (name, direct)
        assert second["launches"] == first["launches"], name    # every argument, outputs by shape/strides/dtype
        assert fresh["launches"] == ref["launches"], name       # new tensors: their own pointers
        assert fresh["launches"] != first["launches"], name
        assert ref["launcher"] == 1, name
        for k in ("o", "ht"):
            assert first[k] == second[k] == fresh[k] == ref[k], (name, k)
        if first["ht"] == "pool":
            assert r["bumped"] >= 2, name                       # the version counter, as the mutating custom op
        kernels.add(first["launches"][0][0])
    assert kernels == {"fused_recurrent_gdn_fwd_kernel", "fused_recurrent_gdn_fwd_persistent_kernel"}, kernels
    assert checks["base"]["launcher"] == 0
    for name, counts in checks["stale"].items():
        # the first call of another signature runs the launcher; its repeat is direct unless the launcher copies
        assert counts[0] == 1, (name, counts)
    assert checks["stale"]["q_strided"] == [1, 1] and checks["copied"] == [1, 1]
    assert checks["stale"]["g_size1_strides"] == [1, 0]          # its own entry (the launcher takes g as it is)
    assert "0.25" in checks["scale_launch"][0][2]
    assert checks["errors"] == [True, True, True], checks["errors"]
    assert checks["off"] == 1 and checks["hooked"] == 1
    assert checks["poisoned"]["launcher"] == 0 and checks["poisoned"]["nan"], checks["poisoned"]
    assert checks["direct_again"] == 0
