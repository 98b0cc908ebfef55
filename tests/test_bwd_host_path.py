"""The Triton backward's launches through the host path (triton/host.py `launches`: the compiled kernel's handle per
launch signature instead of the JIT's binding). Under the stand-in sm_90 driver (linattn.runtime.hostsim: launches
recorded, not made; a child process without TRITON_INTERPRET): a repeated backward of one signature makes no JIT run,
and its launches (kernel, grid, every argument, each pointer by the input or buffer it lies in) are the ones the JIT
path makes on the same tensors, with states, without them, varlen, and with FLA's in-kernel gate and beta sigmoid
(their tensors passed as the WY kernel's optional pointers)."""
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
    for name, (B, T, h0, varlen, opts) in {"states": (1, 1024, True, False, {}), "no_states": (2, 300, False, False, {}),
                                           "varlen": (1, 700, True, True, {}), "fla_gate": (2, 200, True, False, gate)}.items():
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
        assert c["launches"][-4:] == ["chunk_dv_local_kernel", "chunk_state_bwd_kernel", "chunk_local_bwd_kernel",
                                      "chunk_wy_bwd_kernel"], (name, c["launches"])
        assert c["jit"] == 0, (name, c)                 # every launch of the repeat through a kept handle
        assert c["jit_off"] == len(c["launches"]), (name, c)
        assert c["same"], (name, c["diff"])
