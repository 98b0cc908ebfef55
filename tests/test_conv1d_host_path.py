"""causal_conv1d's forward and backward launch through the host path's launch cache (conv1d.py `launches`): under
the stand-in sm_90 driver (launches recorded, not made; a child process without TRITON_INTERPRET), a repeat call
launches the same kernels, grids and arguments (each pointer the same tensor) through the compiled kernels' handles
as the JIT path makes (host_path.options(plan_cache=False, handle=False)), with and without the final state, initial
state, bias and varlen offsets; no JIT run once a signature was seen; the backward's dweight / dbias sums are
col_sum_kernel launches on the same path."""
from children import run_json_child   # tests/ is on sys.path

CHILD = r"""
import json, torch
from linattn.runtime.hostsim import count_jit_runs, fake_hopper
from linattn.ops.conv1d.triton import conv1d as C

def canon(drv, named):
    def one(a):
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            return next((n for n, t in named if t is not None and t.data_ptr() == p), "other")
        return repr(a)
    res = [[n, list(g), [one(a) for a in args]] for n, g, args in drv.launches]
    del drv.launches[:]
    return res

def same_as_jit(drv, call, names):
    # call() twice (compile, then keep the handle), then once through the handle and once through the JIT: their
    # launches (kernel, grid, each argument; a pointer named by the tensor of `names(result)` it is) and JIT runs
    for _ in range(2):
        call()
    del drv.launches[:]
    with count_jit_runs() as jit:
        a = canon(drv, names(call()))
    with C.host_path.options(plan_cache=False, handle=False):
        b = canon(drv, names(call()))
    return dict(same=a == b, jit=jit[0], launches=[l[0] for l in a])

out = {}
with fake_hopper() as drv, torch.no_grad():
    for name, (B, T, D, W, h0, final, bias, varlen) in {
            "plain": (2, 100, 256, 4, False, False, False, False),
            "states_bias": (2, 70, 128, 4, True, True, True, False),
            "varlen": (1, 90, 128, 3, True, True, False, True)}.items():
        x = torch.randn(B, T, D, dtype=torch.bfloat16)
        w = torch.randn(D, W)
        b = torch.randn(D) if bias else None
        cu = torch.tensor([0, 1, 40, 90]) if varlen else None
        N = 3 if varlen else B
        s0 = torch.randn(N, D, W, dtype=torch.bfloat16) if h0 else None
        dy = torch.randn_like(x)
        dht = torch.randn(N, D, W, dtype=torch.bfloat16) if final else None
        ins = [("x", x), ("w", w), ("b", b), ("h0", s0), ("cu", cu), ("dy", dy), ("dht", dht)]
        out[name] = same_as_jit(drv, lambda: C.conv1d_fwd(x, w, b, None, s0, final, True, cu),
                                lambda r: ins + [("y", r[0]), ("final", r[1])])
        # (the backward's dweight / dbias partials summed by col_sum_kernel, through the same host path)
        out[name + "_bwd"] = same_as_jit(drv, lambda: C.conv1d_bwd(x, w, b, s0, True, cu, dy, dht),
                                         lambda r: ins + [("dx", r[0]), ("dh0", r[3])])
print(json.dumps(out))
"""


def test_conv1d_launches_through_the_handle():
    r = run_json_child(CHILD)
    for case, c in r.items():
        assert c["same"] and c["jit"] == 0, (case, c)
    assert r["plain"]["launches"] == ["conv1d_fwd_kernel"], r
    assert r["states_bias"]["launches"] == ["conv1d_fwd_kernel", "conv1d_final_kernel"], r
    assert r["varlen"]["launches"] == ["conv1d_fwd_kernel", "conv1d_final_kernel"], r
    assert r["plain_bwd"]["launches"] == ["conv1d_bwd_kernel", "col_sum_kernel"], r
    assert r["states_bias_bwd"]["launches"] == ["conv1d_bwd_kernel", "col_sum_kernel", "col_sum_kernel",
                                                "conv1d_dh0_kernel"], r
    assert r["varlen_bwd"]["launches"] == ["conv1d_bwd_kernel", "col_sum_kernel", "conv1d_dh0_kernel"], r
