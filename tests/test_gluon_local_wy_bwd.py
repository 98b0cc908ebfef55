"""The Gluon kernel of the GDN backward's stages 2 + 3 (gluon/chunk_local_wy_bwd.py, the gluon backend's local and WY
terms) on a CPU host: every registered build compiles for sm_90a with the products it is meant to issue and fits in
shared memory; the launcher's arguments are exactly what was compiled, through the real JIT path too; and the
kernel's formulas (its docstring, written out here in torch per chunk and key head) give the Triton stages'
gradients when plugged into chunk_gated_delta_rule_bwd's local_wy hook. The kernel itself runs on the GPU only
(benchmarks/gpu/gate.py)."""
import json
import os
import sys

import pytest
import torch

from linattn.runtime.aot import kernels

from markers import SMEM_LIMIT_SM90, built, needs_gluon   # tests/ is on sys.path
from bwd_cases import HOOK_CASES, assert_same_grads, fp32_bwd_args

REGISTRY = kernels()
NAMES = sorted(n for n in REGISTRY if n.startswith("gdn_bwd_local_wy_gluon_"))


@needs_gluon
@pytest.mark.parametrize("name", NAMES)
def test_compiles_with_intended_products(name):
    rep = built(name, REGISTRY[name].known_spill_bytes)
    assert rep.num_warps == 8 and rep.families["HMMA"] == 0
    suffix = ".BF16" if "_bf16_" in name else ""
    # [64, 128] results, each warpgroup 64 columns: dO S^T, dVnew S^T, Vnew dS^T over 128 (8 k-steps each);
    # Pm K, Pm^T Q, Tinv^T dVnew, (M + M^T) K, Tinv^T dW over 64 (4 each)
    assert rep.sass.get(f"HGMMA.64x64x16.F32{suffix}", 0) == 3 * 8 + 5 * 4, rep.sass
    # [64, 64] results, 32 columns each: dO Vnew^T (in both passes), dW K^T, dVnew V^T, K K^T over 128
    assert rep.sass.get(f"HGMMA.64x32x16.F32{suffix}", 0) == 5 * 8, rep.sass
    # the dA chain on TF32: dTinv Tinv^T and Tinv^T z over 64 (8 k-steps of 8)
    assert rep.sass.get("HGMMA.64x32x8.F32.TF32", 0) == 2 * 8, rep.sass


@needs_gluon
def test_no_transposed_view_of_a_shared_buffer_over_256_rows():
    """Triton 3.6 lays an NVMMA shared buffer out in 64-column slabs of at most 256 rows; a .permute view of a buffer
    with more rows addresses the slabs differently from the plain view that cp.async and stores write through (the
    kernel's first build read h, k and v from the wrong places in six products: found by reading the wgmma
    descriptors' addresses in its PTX). Every transposed view in the TTGIR comes from a buffer of <= 256 rows."""
    import re
    from linattn.runtime.aot import kernel_asm
    ttgir = kernel_asm(NAMES[0], "ttgir")
    trans = re.findall(r"ttg\.memdesc_trans [^\n]*?\} : !ttg\.memdesc<([^>]*)>", ttgir)
    assert trans, "no transposed shared-memory view found: the pattern no longer matches this Triton's TTGIR"
    for t in trans:
        fields = [f.strip() for f in t.split(",")]
        # a view of part of a buffer names the allocation's shape last; a view of a whole buffer only its own
        shape = fields[-1] if re.fullmatch(r"\d+(x\d+)+", fields[-1]) else fields[0]
        assert int(shape.split("x")[0]) <= 256, t


def _plan_and_buffers(B, T, H, HV, lens=None, dtype=torch.bfloat16, K=128):
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, slots = plan.T_total, plan.num_slots

    def z(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt)
    bufs = (z(B, T, H, K), z(B, T, H, K), z(B, T, HV, K), z(T_tot, HV, K), z(slots, HV, K, K), z(slots, HV, K, K),
            z(T_tot, HV, dt=torch.float32), z(B, T, HV, dt=torch.float32), z(T_tot, HV, 64),
            z(B, T, HV, K), z(T_tot, HV, K), z(B, T, H, K), z(B, T, H, K), z(B, T, HV, K),
            z(B, T, HV, dt=torch.float32), z(B, T, HV, dt=torch.float32))
    return plan, bufs


@needs_gluon
@pytest.mark.parametrize("B,T,lens", [(1, 4096, None), (8, 512, None), (1, 3000, [1, 63, 65, 1000, 1871])])
def test_launch_matches_aot_signature(B, T, lens):
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.aot import local_wy_signature
    from linattn.ops.gated_delta_rule.gluon.chunk_local_wy_bwd import local_wy_launch
    plan, bufs = _plan_and_buffers(B, T, 16, 32, lens)
    kernel, grid, args, kwargs = local_wy_launch(*bufs, plan, 128 ** -0.5)
    sig = local_wy_signature("bf16")
    assert len(args) == len(sig)
    for (name, want), arg in zip(sig.items(), args):
        assert mangle_type(arg) == want, f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {want}"
    assert grid == (plan.num_slots, 16)
    assert kwargs == dict(H=16, HV=32, K=128, V=128, BT=64, num_warps=8)
    assert all(a is b for a, b in zip(args[:16], bufs))
    assert args[16] is plan.cu and args[17] is plan.chunk_indices and args[18] is plan.chunk_offsets
    names = list(kernel.arg_names)
    assert names[:len(args)] == list(sig) and sorted(names[len(args):]) == sorted(k for k in kwargs if k != "num_warps")


def _jit_compile_main():
    """Child process: the real JIT path (binder, specialisation, compile) with the launcher's own arguments on CPU
    tensors, under a stand-in driver that reports sm_90a and never launches (warmup). One JSON line per case."""
    from compile_only import use_compile_only_sm90_driver                 # tests/ is on sys.path
    from linattn.ops.gated_delta_rule.gluon.chunk_local_wy_bwd import local_wy_launch

    use_compile_only_sm90_driver()
    for B, T, dtype in ((1, 300, torch.bfloat16), (8, 100, torch.float16)):
        plan, bufs = _plan_and_buffers(B, T, 16, 32, dtype=dtype)
        kernel, grid, args, kwargs = local_wy_launch(*bufs, plan, 128 ** -0.5)
        k = kernel.warmup(*args, grid=grid, **kwargs)
        print(json.dumps(dict(B=B, num_warps=k.metadata.num_warps, shared=k.metadata.shared)))


@needs_gluon
def test_jit_launch_path_compiles_for_sm90():
    from compile_only import jit_child_rows      # tests/ is on sys.path
    rows = jit_child_rows(__file__, timeout=900)
    assert [r["B"] for r in rows] == [1, 8]
    for r in rows:
        assert r["num_warps"] == 8 and 0 < r["shared"] <= SMEM_LIMIT_SM90, r


def _kernel_formulas(q, k, v, vnew, h, dh, gcum, beta, tinv, do, dvnew, dq, dk, dv, dg, dbeta, plan, scale):
    """The kernel's per-(chunk, key head) formulas (its docstring) in torch: operands rounded to q's dtype where
    the kernel rounds them, everything else fp32. Same arguments as chunk_local_wy_bwd_gluon."""
    dt = q.dtype
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    T_tot = plan.T_total
    q2, k2 = q.reshape(T_tot, H, K), k.reshape(T_tot, H, K)
    v2, do2 = v.reshape(T_tot, HV, V), do.reshape(T_tot, HV, V)
    outs = [t.view(T_tot, *t.shape[2:]) for t in (dq, dk, dv, dg, dbeta)]
    beta2 = beta.reshape(T_tot, HV).float()
    cu, idx, off = plan.cu.tolist(), plan.chunk_indices.tolist(), plan.chunk_offsets.tolist()

    def rnd(x):
        return x.to(dt).float()
    for n, c in idx:
        if n >= plan.N:
            continue
        t0 = cu[n] + 64 * c
        nt = min(cu[n + 1] - t0, 64)
        rows = slice(t0, t0 + nt)
        slot = off[n] + c
        lower = torch.ones(nt, nt).tril().bool()
        strict = torch.ones(nt, nt).tril(-1).bool()
        for hk in range(H):
            Q, Kt = q2[rows, hk].float(), k2[rows, hk].float()
            dq_acc = torch.zeros(nt, K)
            dk_acc = torch.zeros(nt, K)
            for hv in range(hk * (HV // H), (hk + 1) * (HV // H)):
                gam = gcum[rows, hv]
                gl_ = gam[-1]
                gam_d = torch.where(lower, gam[:, None] - gam[None, :], torch.zeros(()))
                dO, Vn, dVn, Vv = do2[rows, hv].float(), vnew[rows, hv].float(), dvnew[rows, hv].float(), v2[rows, hv].float()
                S, dS = h[slot, hv].float(), dh[slot, hv].float()
                Ti = tinv[rows, hv, :nt]
                b = beta2[rows, hv]
                pm = rnd(torch.where(lower, (dO @ Vn.T) * gam_d.exp(), torch.zeros(())))
                dqh = ((dO @ S.T) * gam.exp()[:, None] + pm @ Kt) * scale
                dgam = (dqh * Q).sum(1)
                dq_acc += dqh
                dW = rnd(-(dVn @ S.T))
                dks = (Vn @ dS.T) * (gl_ - gam).exp()[:, None]
                x = (dks * Kt).sum(1)
                dgam = dgam - x
                dgam[-1] += x.sum() + gl_.exp() * (S * dS).sum()
                dkh = (pm.T @ Q) * scale
                dgam = dgam - (dkh * Kt).sum(1)
                dk_acc += dks + dkh
                X = dW @ Kt.T
                rs_w = (Ti * X).sum(0)
                X = X * gam.exp()[None, :] + dVn @ Vv.T
                ti_op = rnd(Ti)
                outs[2][rows, hv] = ((ti_op.T @ dVn) * b[:, None]).to(dv.dtype)
                db = (Ti * X).sum(0)
                dTi = torch.where(strict, X * b[None, :], torch.zeros(()))
                da = Ti.T @ (dTi @ Ti.T)
                D = torch.where(strict, -da * gam_d.exp(), torch.zeros(()))
                KK = Kt @ Kt.T
                rs_d = (D * KK).sum(1)
                M = D * b[:, None]
                rs_m = (M * KK).sum(0)
                m_op = rnd(M)
                s_op = rnd(M + m_op.T)                        # fp32 M plus M^T read back rounded
                db = db + rs_d
                dgam = b * (gam.exp() * rs_w + rs_d) - rs_m + dgam
                outs[3][rows, hv] = dgam.flip(0).cumsum(0).flip(0).to(dg.dtype)
                outs[4][rows, hv] = db.to(dbeta.dtype)
                dk_acc += s_op @ Kt + (ti_op.T @ dW) * (b * gam.exp())[:, None]
            outs[0][rows, hk] = dq_acc.to(dq.dtype)
            outs[1][rows, hk] = dk_acc.to(dk.dtype)


@pytest.mark.parametrize("B,T,H,HV,lens", HOOK_CASES)
def test_formulas_give_the_triton_stages_gradients(B, T, H, HV, lens):
    """fp32 inputs (no rounding anywhere), fresh random values: the docstring's formulas through the local_wy hook
    against the Triton stages 2 and 3 on the same recompute and stage 1; every gradient, the partial last chunks
    and the varlen boundaries included."""
    from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd
    args = fp32_bwd_args(B, T, H, HV, lens)
    assert_same_grads(chunk_gated_delta_rule_bwd(*args, local_wy=_kernel_formulas), chunk_gated_delta_rule_bwd(*args))


@needs_gluon
@pytest.mark.parametrize("has_cp_async", [True, False])
def test_gluon_backward_takes_the_kernel_where_this_triton_has_cp_async(monkeypatch, has_cp_async):
    """The gluon backend's backward op hands chunk_gated_delta_rule_bwd the local_wy hook (this kernel), and keeps the
    Triton stages (no hook) on a Triton whose Gluon lacks cp.async; the reverse state pass stays Gluon either way."""
    from linattn.ops.gated_delta_rule.gluon import backend
    from linattn.ops.gated_delta_rule.triton import backward
    from linattn.runtime import gluon_compat
    seen = {}

    def fake_bwd(q, k, v, g, beta, scale, h0, cu, do, dht, **hooks):
        seen.update(hooks)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), None, None, None)
    monkeypatch.setattr(backward, "chunk_gated_delta_rule_bwd", fake_bwd)
    if not has_cp_async:
        monkeypatch.setattr(gluon_compat, "async_copy", None)
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    g, beta = torch.rand(1, 64, 4), torch.rand(1, 64, 4)
    gcum, tinv = torch.randn(64, 4), torch.randn(64, 4, 64).to(q.dtype)     # the forward's kept stage 2a outputs
    backend._chunk_gdn_bwd_gluon(q, q, v, g, beta, 0.1, None, None, torch.randn_like(v), None, gcum, tinv)
    assert callable(seen["state_bwd"])
    assert callable(seen["local_wy"]) if has_cp_async else seen["local_wy"] is None


if __name__ == "__main__" and sys.argv[1:] == ["jit"]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _jit_compile_main()
