"""KDA's Triton backward (triton/backward.py chunk_kda_bwd, with its recomputed forward) launches through the Triton
host path's launch cache: under the stand-in sm_90 driver (launches recorded, not made; a child process without
TRITON_INTERPRET), a repeat call makes no JIT run and the same launches (kernel, grid, every argument, each pointer
the same input or output at the same offset) as the JIT path (host_path.options(plan_cache=False, handle=False)),
with states and without, with FLA's in-kernel gate, GVA and varlen offsets."""
from children import run_json_child   # tests/ is on sys.path
from test_fwd_launch_list import COMMON

CHILD = COMMON + r"""
import sys
sys.path.insert(0, "tests")
from kda_cases import kda_inputs
from linattn.ops.kda.triton.backward import chunk_kda_bwd
from linattn.ops.gated_delta_rule.triton.host import host_path as thp

def same_as_jit(drv, call, ins):
    for _ in range(2):                                 # compile, then keep the handles
        call()
    del drv.launches[:]
    with count_jit_runs() as jit:
        a = canon(drv, ins, call())
    with thp.options(plan_cache=False, handle=False):
        b = canon(drv, ins, call())
    return dict(same=a == b, jit=jit[0], launches=[x[0] for x in a])

out = {}
with fake_hopper(c_launcher=True) as drv, torch.no_grad():
    for name, (B, T, H, HV, states, gated, varlen) in {
            "states": (1, 150, 2, 2, True, False, False),
            "gate_gva_varlen": (1, 200, 2, 4, False, True, True)}.items():
        K = V = 64
        x = kda_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, h0=states, num_states=3 if varlen else None)
        cu = torch.tensor([0, 70, 130, 200]) if varlen else None
        A_log, dt_bias = (torch.randn(HV), torch.randn(HV * K)) if gated else (None, None)
        do = torch.randn(B, T, HV, V, dtype=torch.bfloat16)
        dht = torch.randn(1, HV, K, V) if states else None
        ins = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], A_log, dt_bias, do, dht)
        call = lambda: chunk_kda_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"], cu,
                                     A_log, dt_bias, "softplus" if gated else "", 0.0, False, False, do, dht)
        out[name] = same_as_jit(drv, call, ins)
print(json.dumps(out))
"""


def test_kda_backward_launches_through_the_handle():
    r = run_json_child(CHILD)
    want = ["kda_cumsum_kernel", "kda_diag_kernel", "kda_inter_solve_kernel", "wu_kernel", "chunk_state_fwd_kernel",
            "chunk_dv_local_kernel", "chunk_state_bwd_kernel", "kda_wy_bwd_kernel", "kda_pair_diag_bwd_kernel",
            "kda_pair_bwd_kernel", "kda_dg_kernel"]
    for case, c in r.items():
        assert c["same"] and c["jit"] == 0, (case, c)
        gva = ["kda_gva_sum_kernel"] * 2 if "gva" in case else []         # dq's and dk's sums over value heads
        gate = ["col_sum_kernel"] * 2 if "gate" in case else []       # dA_log's and d dt_bias's over slots
        assert c["launches"] == want + gva + gate, (case, c)
