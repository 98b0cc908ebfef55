"""The decode launcher's host path (triton/fused_recurrent.py): launches through the compiled kernel's handle once a
signature has been seen. Under a stand-in sm_90 driver (linattn.runtime.hostsim; a child process without
TRITON_INTERPRET, which would turn the kernels into interpreted functions), for the one-tile and the persistent
kernel, in place and out of place: the handle path makes the same launches (kernel, grid, every argument) as the
JIT path, and skips the JIT's run on repeated calls."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, torch
from linattn.runtime.hostsim import count_jit_runs, fake_hopper, normalise
from linattn.ops.gated_delta_rule.triton import fused_recurrent as fr

def case(N, state_dtype, inplace):
    H, HV, K, V, slots = 2, 4, 32, 32, 2 * N + 1
    q = torch.randn(N, 1, H, K, dtype=torch.bfloat16)
    k = torch.randn(N, 1, H, K, dtype=torch.bfloat16)
    v = torch.randn(N, 1, HV, V, dtype=torch.bfloat16)
    g, beta = -torch.rand(N, 1, HV), torch.rand(N, 1, HV)
    pool = torch.randn(slots, HV, K, V).to(state_dtype)
    idx = torch.randperm(slots)[:N]
    o, ht = torch.empty_like(v), (None if inplace else torch.empty(N, HV, K, V, dtype=state_dtype))
    def call():                                        # preallocated outputs: every pointer the same in each call
        return fr.fused_recurrent_gdn_fwd(q, k, v, g, beta, K ** -0.5, pool, None, idx, None, None, False, False,
                                          not inplace, inplace, out=o, final_out=ht)
    return call

out = {}
with fake_hopper() as drv:
    fr.device_facts = lambda device=None: type("F", (), {"num_sms": 2})()    # the persistent kernel from N * HV >= 64
    for name, args in {"one_tile_fp32_inplace": (3, torch.float32, True),
                       "one_tile_bf16_out_of_place": (3, torch.bfloat16, False),
                       "persistent_fp32_inplace": (64, torch.float32, True),
                       "persistent_fp32_out_of_place": (64, torch.float32, False)}.items():
        call = case(*args)
        rec = {}
        for path, opts in (("jit", dict(plan_cache=False, handle=False)), ("handle", {})):
            with fr.host_path.options(**opts):
                call()                                 # compiles, and keeps the handle on the handle path
                del drv.launches[:]
                with count_jit_runs() as runs:
                    res = call()
                rec[path] = dict(launches=[(kn, list(gr), [repr(normalise(a)) for a in a_]) for kn, gr, a_ in
                                           drv.launches], jit_runs=runs[0])
                del res
        out[name] = rec
print(json.dumps(out))
"""


def test_decode_handle_path_launches_as_the_jit():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 4
    kernels = set()
    for name, rec in res.items():
        jit, handle = rec["jit"], rec["handle"]
        assert len(jit["launches"]) == 1 and jit["jit_runs"] == 1, (name, jit)
        assert handle["launches"] == jit["launches"], name              # kernel, grid and every argument
        assert handle["jit_runs"] == 0, (name, handle)
        kernels.add(jit["launches"][0][0])
    assert kernels == {"fused_recurrent_gdn_fwd_kernel", "fused_recurrent_gdn_fwd_persistent_kernel"}, kernels
