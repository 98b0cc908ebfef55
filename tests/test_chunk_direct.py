"""chunk_gated_delta_rule's direct path (api.py _DIRECT, gluon/backend.py direct): a repeat plain eager call of a
signature whose call ran the gluon forward's launch list on the caller's own tensors replays that list from the
public call, without the option handling, the normalisation and the backend's dispatch. Under the stand-in sm_90
driver with Triton's CudaLauncher structure (launches recorded; a child process without TRITON_INTERPRET), the
signature memo on for CPU tensors as it is for CUDA ones and the gluon backend accepting them:
- the repeat call makes the launches the full path makes on the same tensors (each pointer the same input or
  output at the same offset), without entering the backend's impl, on the same tensors and on new ones;
- the same for the Triton backend's launch list (backend="triton");
- nothing stale: forgotten launch lists, a registered launch hook, an input requiring grad, an option the direct path
  does not cover (l2norm in the kernel), an initial state the call converts (bf16) each take the full path."""
from children import run_json_child   # tests/ is on sys.path
from test_fwd_launch_list import COMMON

CHILD = COMMON + r"""
import linattn
from linattn.ops.gated_delta_rule import api, validation
from linattn.ops.gated_delta_rule.triton.hostsim import _patched
from linattn.runtime import call_memo

patches = [(call_memo, "memo_applies", lambda q: True)]
for name in dir(validation):
    if name.startswith("check_") and "value" in name:
        patches.append((validation, name, lambda *_, **__: None))
impl_calls = {}
for bname in ("gluon", "triton"):                       # both accept CPU tensors; their impls count their calls
    reg = api._backends.backends[bname]
    impl_calls[bname] = [0]
    def counted(*a, _real=reg.impl, _n=impl_calls[bname], **kw):
        _n[0] += 1
        return _real(*a, **kw)
    patches += [(reg, "supports", lambda **_: (True, "")), (reg, "impl", counted)]

def public(x, backend="auto", **kw):
    # (o, ht) of the public call, and how many times the backend's impl ran for it
    q, k, v, g, beta, h0 = x
    n = impl_calls["triton" if backend == "triton" else "gluon"]
    n0 = n[0]
    res = linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         backend=backend, **kw)
    return res, n[0] - n0

def direct_vs_full(drv, x, backend="auto"):
    # a direct call, then the full path on the same tensors: their launches and impl counts
    direct, n_direct = public(x, backend)
    a = canon(drv, x, direct)
    api._DIRECT.clear()
    full, n_full = public(x, backend)
    b = canon(drv, x, full)
    return dict(same=a == b, direct_impl=n_direct, full_impl=n_full, launches=len(a))

out = {}
gfm.GF_SEG_MIN_EAGER_TOKENS = 0
with fake_hopper(c_launcher=True) as drv, torch.no_grad(), _patched(patches):
    x = inputs(1, 4096)
    for _ in range(3):                                  # compile, record the list, keep the direct path
        public(x)
    del drv.launches[:]
    out["same_tensors"] = direct_vs_full(drv, x)
    y = inputs(1, 4096)                                 # new tensors, same signature
    public(y)                                           # (the direct path kept again)
    del drv.launches[:]
    out["new_tensors"] = direct_vs_full(drv, y)
    # nothing stale
    public(x)
    L.EAGER_LISTS.clear()
    out["lists_forgotten"] = [public(x)[1] for _ in range(2)]      # full (declined; records a new list), direct
    out["hooked"] = with_launch_hook(lambda: public(x)[1])
    with torch.enable_grad():
        xg = (x[0], x[1], x[2].clone().requires_grad_()) + x[3:]
        out["requires_grad"] = [public(xg)[1] for _ in range(2)]
    out["l2norm"] = [public(x, use_qk_l2norm_in_kernel=True)[1] for _ in range(3)]
    xb = x[:5] + (x[5].bfloat16(),)
    out["h0_bf16"] = [public(xb)[1] for _ in range(3)]
    out["direct_again"] = public(x)[1]
    # the Triton backend's direct path (its own launch list, api._triton_direct)
    z = inputs(2, 300)
    for _ in range(3):
        public(z, "triton")
    del drv.launches[:]
    out["triton"] = direct_vs_full(drv, z, "triton")
    del drv.launches[:]
print(json.dumps(out))
"""


def test_chunk_direct_path():
    r = run_json_child(CHILD)
    for case in ("same_tensors", "new_tensors"):
        c = r[case]
        assert c["same"] and c["direct_impl"] == 0, (case, c)
    assert r["same_tensors"]["full_impl"] == 1 and r["same_tensors"]["launches"] == 4, r
    assert r["lists_forgotten"] == [1, 0], r
    assert r["hooked"] == 1, r
    assert r["requires_grad"] == [1, 1], r
    assert r["l2norm"] == [1, 1, 1] and r["h0_bf16"] == [1, 1, 1], r
    assert r["direct_again"] == 0, r
    t = r["triton"]
    assert t["same"] and t["direct_impl"] == 0 and t["full_impl"] == 1 and t["launches"] >= 3, t
