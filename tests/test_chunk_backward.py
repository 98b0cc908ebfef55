"""Backward of chunk_gated_delta_rule on the Triton path (CPU under TRITON_INTERPRET=1, or the GPU when present).

Every gradient (dq, dk, dv, dg, dbeta, d initial_state) is compared with autograd through the chunked reference
in fp64, by relative RMS error with linattn.testing.TOL of the operand dtype (or of the gradient's own dtype when
that is a 16-bit type: the gradient is then rounded to it). Inputs are fresh random data; every buffer the
kernels write is NaN-poisoned first (runtime.alloc.poisoned_allocations), so an unwritten element fails.

Case matrix (each dimension covered at least once, kept small because the interpreter is slow):
  T            1, 63, 64, 65, 200, varlen with 1-token sequences and sequences across chunk boundaries
  heads        H == HV, and GVA with HV // H = 2 and 3
  K, V         60, 64, 100, 128 each appear for K and for V; K = 256 and V = 256 (the largest), K = 16 (smallest)
  dtypes       fp32, bf16, fp16; mixed (fp16 q/k/v, fp32 beta, bf16 g, fp16 initial state)
  states       with and without initial_state; with and without the gradient of final_state
  options      use_qk_l2norm_in_kernel; only some inputs requiring grad; torch.compile(fullgraph=True)
plus a static check that no kernel of the backward feeds tl.trans(<dot result>) into a dot (the Triton 3.4-3.7
Hopper miscompile behind FLA issues 640 and 984), and an ahead-of-time sm_90a build of every backward kernel with
ptxas spill bounds (no GPU needed).
"""
import ast
import math
import pathlib

import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import chunk_reference
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.settings import settings
from linattn.testing import TOL, make_gdn_inputs, random_cu_seqlens, rel_rms

needs_interpreter = pytest.mark.skipif(not settings.interpret and not torch.cuda.is_available(),
                                       reason="the Triton path on the CPU needs TRITON_INTERPRET=1")

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _tol(dtype, grad_dtype):
    tol = TOL[dtype]
    if grad_dtype in (torch.bfloat16, torch.float16):
        tol = max(tol, TOL[grad_dtype])
    return tol


def _check(B, T, H, HV, K, V, *, dtype, device="cpu", lengths=None, h0=True, dht=True, l2norm=False,
           gate_dtype=torch.float32, beta_dtype=None, state_dtype=torch.float32, grad_of=NAMES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = random_cu_seqlens(lengths, device=device) if lengths is not None else None
    if lengths is not None:
        assert B == 1 and T == sum(lengths)
    inp = make_gdn_inputs(B, T, H, HV, K, V, dtype=dtype, gate_dtype=gate_dtype, beta_dtype=beta_dtype,
                          state_dtype=state_dtype, num_states=None if lengths is None else len(lengths),
                          initial_state=h0, normalize_k=not l2norm, generator=gen)
    inp = {n: (None if t is None else t.to(device)) for n, t in inp.items()}
    for name in grad_of:
        if inp[name] is not None:
            inp[name].requires_grad_(True)
    ref = {n: (None if t is None else t.detach().double().requires_grad_(t.requires_grad)) for n, t in inp.items()}
    o_ref, ht_ref = chunk_reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref["initial_state"],
                                    True, cu, l2norm)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(device)
    dht_t = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64).to(device) if dht else None
    loss = (o_ref * do).sum() + ((ht_ref * dht_t).sum() if dht else 0.)
    loss.backward()

    with poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                               initial_state=inp["initial_state"], output_final_state=dht,
                                               cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm, backend="triton")
        grads = [o]
        if dht:
            grads.append(ht)
        torch.autograd.backward(grads, [do.to(o.dtype)] + ([dht_t.to(ht.dtype)] if dht else []))

    errs = {"o": rel_rms(o, o_ref)}
    assert errs["o"] <= TOL[dtype], errs
    for name in NAMES:
        t = inp[name]
        if t is None or not t.requires_grad:
            continue
        assert t.grad is not None, f"d{name} missing"
        assert t.grad.dtype == t.dtype, f"d{name} is {t.grad.dtype}, the input is {t.dtype}"
        ref_grad = ref[name].grad
        assert ref_grad.norm() > 0, f"d{name}: the reference gradient is zero, the case checks nothing"
        errs[name] = rel_rms(t.grad, ref_grad)
    for name, err in errs.items():
        if name == "o":
            continue
        tol = _tol(dtype, inp[name].dtype)
        assert math.isfinite(err) and err <= tol, f"d{name}: relative RMS error {err:.3e} > {tol:.1e} (all: {errs})"
    return errs


CASES = [
    # B, T, H, HV, K, V, extra
    pytest.param(2, 1, 2, 2, 64, 64, dict(dtype=torch.float32), id="T1-fp32"),
    pytest.param(1, 63, 1, 1, 60, 100, dict(dtype=torch.bfloat16, dht=False), id="T63-bf16-nodht"),
    pytest.param(1, 64, 2, 4, 128, 64, dict(dtype=torch.float16, h0=False), id="T64-gva-fp16-noh0"),
    pytest.param(2, 65, 1, 2, 100, 128, dict(dtype=torch.bfloat16, l2norm=True), id="T65-gva-bf16-l2norm"),
    pytest.param(1, 200, 2, 4, 60, 100, dict(dtype=torch.float32), id="T200-gva-fp32"),
    pytest.param(1, 200, 1, 3, 64, 60, dict(dtype=torch.bfloat16, lengths=[1, 63, 1, 70, 65], l2norm=True),
                 id="varlen-gva3-bf16-l2norm"),
    pytest.param(1, 100, 1, 1, 128, 100, dict(dtype=torch.float16, lengths=[37, 1, 62], beta_dtype=torch.float32,
                                              gate_dtype=torch.bfloat16, state_dtype=torch.float16),
                 id="varlen-mixed-dtypes"),
    pytest.param(1, 80, 1, 1, 256, 48, dict(dtype=torch.bfloat16, h0=False, dht=False), id="K256-bf16-nostates"),
    pytest.param(1, 70, 1, 2, 64, 64, dict(dtype=torch.float32, grad_of=("v", "g")), id="partial-grads"),
    pytest.param(1, 131, 2, 4, 16, 256, dict(dtype=torch.float32, lengths=[1, 64, 65, 1], h0=False),
                 id="varlen-noh0-dht-K16-V256"),
]


@needs_interpreter
@pytest.mark.parametrize("B,T,H,HV,K,V,extra", CASES)
def test_backward_matches_fp64_reference(device, B, T, H, HV, K, V, extra):
    _check(B, T, H, HV, K, V, device=device, **extra)


@needs_interpreter
def test_gate_gradient_under_strong_decay_matches_fp64(device):
    """The regime of a trained model's layer (found by the transformers training test: A_log's gradient 1e-3 off):
    strong, varied decay (g down to -60), l2-normalised q and k, dO up to 20x larger on some tokens. dg's true value
    is then far below the pair terms that its reverse cumsum cancels, and A_log's gradient, sum_t dg_t g_t per head,
    cancels further. fp32 throughout: its per-head sum within 1e-3 of fp64's (the torch chunked algorithm in fp32
    reaches 2-7e-4 here; forming each intra-chunk pair twice, as q_i . dQ_i and k_j . dK_j, gives 1.6-3e-3)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, T, H, HV, K = 2, 150, 2, 4, 32
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, K, generator=gen)
    g = -torch.empty(B, T, HV).uniform_(0.3, 60, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    do = torch.randn(B, T, HV, K, generator=gen) * torch.exp(3 * torch.rand(B, T, 1, 1, generator=gen))
    dg = {}
    for dt in (torch.float64, torch.float32):
        x = [t.to(device, dt).clone().requires_grad_() for t in (q, k, v, g, beta)]
        with poisoned_allocations():
            if dt == torch.float64:
                o = chunk_reference(*x, use_qk_l2norm_in_kernel=True)[0]
            else:
                o = linattn.chunk_gated_delta_rule(*x, use_qk_l2norm_in_kernel=True, backend="triton")[0]
            o.backward(do.to(device, dt))
        dg[dt] = x[3].grad.double()
    g = g.to(device, torch.float64)
    err = rel_rms(dg[torch.float32], dg[torch.float64])
    assert math.isfinite(err) and err <= TOL[torch.float32], err
    sums = [(d * g).sum((0, 1)) for d in (dg[torch.float32], dg[torch.float64])]
    assert sums[1].abs().min() > 0
    assert rel_rms(*sums) <= 1e-3, (rel_rms(*sums), sums)


@needs_interpreter
def test_torch_compile_fullgraph_forward_backward(device):
    """A small model calling the op, compiled with fullgraph=True (a graph break raises), forward and backward,
    checked against the fp64 reference."""
    gen = torch.Generator().manual_seed(1)
    inp = make_gdn_inputs(1, 70, 1, 2, 32, 48, dtype=torch.float32, generator=gen)
    inp = {n: t.to(device).requires_grad_() for n, t in inp.items()}
    w = (torch.randn(48, 48, generator=gen, dtype=torch.float32) * 0.1).to(device)

    def model(q, k, v, g, beta, h0, w):
        o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, backend="triton")
        return (o @ w).square().sum() + ht.square().sum()

    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(*inp.values(), w)
    loss.backward()
    ref = {n: t.detach().double().requires_grad_() for n, t in inp.items()}
    o, ht = chunk_reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref["initial_state"], True,
                            None, True)
    ref_loss = (o @ w.double()).square().sum() + ht.square().sum()
    ref_loss.backward()
    assert rel_rms(loss, ref_loss) <= TOL[torch.float32]
    for n, t in inp.items():
        err = rel_rms(t.grad, ref[n].grad)
        assert err <= TOL[torch.float32], f"d{n}: {err:.3e}"


def _is_tl(node, attr):
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl")


def _dot_tainted_trans(fn: ast.FunctionDef):
    """Names in `fn` that hold a tl.dot result (directly or through elementwise ops; flow-insensitive, to a fixed
    point), and every tl.trans whose argument contains a tl.dot or one of those names."""
    assigns = [n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign))]
    tainted = set()
    while True:
        before = len(tainted)
        for node in assigns:
            if _is_tl(node.value, "load"):
                continue
            if any(_is_tl(s, "dot") or (isinstance(s, ast.Name) and s.id in tainted) for s in ast.walk(node.value)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name):
                        tainted.add(t.id)
        if len(tainted) == before:
            break
    bad = []
    for node in ast.walk(fn):
        if _is_tl(node, "trans"):
            for sub in ast.walk(node.args[0]):
                if _is_tl(sub, "dot") or (isinstance(sub, ast.Name) and sub.id in tainted):
                    bad.append(f"line {node.lineno}: tl.trans of a dot result")
    return tainted, bad


def test_hazard_check_detects_a_transposed_dot_result():
    src = """def f(a, b, c):
    x = tl.dot(a, b)
    y = x * 2.
    z = tl.dot(tl.trans(y), c)
    w = tl.dot(tl.trans(tl.dot(a, b)), c)
    ok = tl.dot(tl.trans(a), c)
"""
    tainted, bad = _dot_tainted_trans(ast.parse(src).body[0])
    assert {"x", "y", "z", "w", "ok"} <= tainted and len(bad) == 2, (tainted, bad)


def test_no_transposed_dot_result_feeds_a_dot():
    """Triton 3.4-3.7 on Hopper miscompiles tl.trans of a dot result (MMA layout) used as a dot operand (FLA issues
    640/984). The backward kernels avoid it by construction; this keeps it so."""
    folder = pathlib.Path(linattn.__file__).parent / "ops" / "gated_delta_rule" / "triton"
    files = sorted(folder.glob("backward_*.py"))
    assert len(files) >= 3
    for path in files:
        tree = ast.parse(path.read_text())
        kernels = [f for f in tree.body if isinstance(f, ast.FunctionDef)]
        assert kernels, path
        for fn in kernels:
            tainted, bad = _dot_tainted_trans(fn)
            assert tainted, f"{path.name}:{fn.name}: no dot results found, the check would be vacuous"
            assert not bad, f"{path.name}:{fn.name}: {bad}"


# ---- ahead-of-time build for sm_90a (no GPU needed): the kernels compile, and the register budget holds ----------

def _aot_specs(K: int = 128, V: int = 128, H: int = 16, HV: int = 32):
    """(name, jit fn, signature, constexprs, options) of each backward kernel as the launcher configures it, bf16."""
    from linattn.ops.gated_delta_rule.triton import backward as bw
    from linattn.ops.gated_delta_rule.triton.backward_dv_local import chunk_dv_local_kernel
    from linattn.ops.gated_delta_rule.triton.backward_local import STAGES_LOCAL, WARPS_LOCAL, chunk_local_bwd_kernel
    from linattn.ops.gated_delta_rule.triton.backward_state import chunk_state_bwd_kernel
    from linattn.ops.gated_delta_rule.triton.backward_wy import STAGES_WY, WARPS_WY, chunk_wy_bwd_kernel
    cfg = bw._configs(K, V, 1, HV, "cpu")            # on a GPU the V split may only get narrower (fewer registers)
    x, f, i64, i32 = "*bf16", "*fp32", "*i64", "*i32"
    common = dict(H=H, HV=HV, K=K, V=V, BT=64, DOT_PREC="tf32")
    return [
        ("dv_local", chunk_dv_local_kernel,
         dict(q_ptr=x, k_ptr=x, gcum_ptr=f, do_ptr=x, dvnew_ptr=x, cu_ptr=i64, chunk_idx_ptr=i32, N="i32", scale="fp32"),
         dict(common, BK=cfg.BK, BV=cfg.BV, DECAY="scalar", aqk_ptr=None),
         dict(num_warps=cfg.warps_dv_local, num_stages=2)),
        ("state_bwd", chunk_state_bwd_kernel,
         dict(q_ptr=x, k_ptr=x, w_ptr=x, gcum_ptr=f, do_ptr=x, dh_ptr=x, dvnew_ptr=x, dht_ptr=f, dh0_ptr=f, cu_ptr=i64,
              chunk_off_ptr=i64, scale="fp32"),
         dict(common, BK=cfg.BK_state, BV=cfg.BV_state, USE_DHT=True, STORE_DH0=True, STORE_DH=True,
              V_FIRST=False, DECAY="scalar"),
         dict(num_warps=cfg.warps_state, num_stages=cfg.stages_state)),
        ("local_bwd", chunk_local_bwd_kernel,
         dict(q_ptr=x, k_ptr=x, vnew_ptr=x, h_ptr=x, gcum_ptr=f, do_ptr=x, dvnew_ptr=x, dh_ptr=x, dq_ptr=x, dk_ptr=f,
              dw_ptr=x, dgam_ptr=f, cu_ptr=i64, chunk_idx_ptr=i32, chunk_off_ptr=i64, N="i32", T_tot="i32",
              scale="fp32"),
         dict(common, BK=cfg.BK, BV=cfg.BV), dict(num_warps=WARPS_LOCAL, num_stages=STAGES_LOCAL)),
        ("wy_bwd", chunk_wy_bwd_kernel,
         dict(k_ptr=x, v_ptr=x, beta_ptr=f, gcum_ptr=f, tinv_ptr=f, dvnew_ptr=x, dw_ptr=x, dk_part_ptr=f, dgam_ptr=f,
              dk_ptr=x, dv_ptr=x, dg_ptr=f, dbeta_ptr=f, m_ptr=x, cu_ptr=i64, chunk_idx_ptr=i32, N="i32", T_tot="i32"),
         dict(common, BK=cfg.BK, BV=cfg.BV, NK=triton_cdiv(K, cfg.BK), NKP=triton_cdiv(K, cfg.BK), M_IN_DK=K >= 64,
              g_raw_ptr=None, A_log_ptr=None, dt_bias_ptr=None, dgate_ptr=None, beta_raw_ptr=None,
              GATE_IN_KERNEL=False, HAS_DT_BIAS=False, BETA_SCALE=0),      # FLA's options off (the default path)
         dict(num_warps=WARPS_WY, num_stages=STAGES_WY)),
    ]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aot_main(K: int, V: int):
    """Child process (TRITON_INTERPRET unset): compile each kernel for sm_90a, print one JSON line per kernel."""
    from linattn.testing.aot import print_reports
    print_reports(_aot_specs(K, V), K, V)


# spill bounds (ptxas, Triton 3.6.0, sm_90a, bf16): the sequential reverse state pass must not spill (it is the
# critical path); the chunk-parallel local and WY stages stay under 1 KB
SPILL_LIMIT = {"dv_local": 0, "state_bwd": 0, "local_bwd": 1024, "wy_bwd": 1024}


@pytest.mark.parametrize("K,V", [(128, 128), (100, 60), (256, 256)])
def test_aot_sm90a_compiles_within_register_budget(K, V):
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "aot", str(K), str(V)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["name"] for r in reports) == sorted(SPILL_LIMIT)
    for r in reports:
        assert r["spill_bytes"] <= SPILL_LIMIT[r["name"]], r


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 4 and sys.argv[1] == "aot":
        _aot_main(int(sys.argv[2]), int(sys.argv[3]))
