"""GDN decode (`fused_recurrent_gated_delta_rule`): the Triton kernels under TRITON_INTERPRET=1 against the fp64
step-by-step reference, the chunk reference, the serving pool contract, fused gating, bf16 states, input
validation (inputs that require grad refused) and torch.compile; the persistent kernel against the one-tile kernel
bit for bit; sm_90a AOT builds of the launch configs. Fresh random inputs every run; fp32 q/k/v so that the fp32
tolerance applies."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

from linattn.backends import op_backends
from linattn.ops.gated_delta_rule.fused_recurrent import (
    fused_recurrent_gated_delta_rule as decode, fused_recurrent_reference)
from linattn.ops.gated_delta_rule.reference import chunk_reference, naive_recurrent
from linattn.ops.gated_delta_rule.triton.fused_recurrent import decode_launch_config, fused_recurrent_gdn_fwd
from linattn.runtime.alloc import poisoned_allocations
from linattn.runtime.aot import kernel_asm
from linattn.testing import TOL, assert_close, make_gdn_inputs, poison_, random_cu_seqlens

from launch_spy import spy_grids   # tests/ is on sys.path

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernel needs TRITON_INTERPRET=1 on a CPU")

F32 = TOL[torch.float32]
# One rounding of an fp32 state to bf16 moves each element by at most 2^-9 relative (8-bit mantissa, round to
# nearest), so the relative RMS error of a freshly written bf16 state is below 2^-9 = 1.95e-3; 4e-3 allows the
# fp32 part of the error on top and nothing else.
BF16_STATE = 4e-3


@pytest.fixture(autouse=True)
def _poisoned():
    """Every buffer the launcher allocates starts as NaN: an element the kernel does not write fails."""
    with poisoned_allocations():
        yield


def _f64(d):
    return {n: (t.double() if t is not None and t.is_floating_point() else t) for n, t in d.items()}


def _inputs(B, T, H, HV, K, V, **kw):
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=torch.float32, **kw)
    if x["initial_state"] is None:
        del x["initial_state"]
    return x


@pytest.mark.parametrize("B,T,H,HV,K,V,l2,h0", [
    (2, 1, 2, 2, 16, 16, False, True),      # plain decode
    (3, 4, 2, 4, 32, 32, True, True),       # speculative decode, GVA, in-kernel L2 norm
    (1, 3, 4, 4, 64, 64, False, False),     # no initial state
    (2, 2, 1, 2, 100, 100, False, True),    # K, V not powers of 2: masked rows and V-blocks
])
def test_matches_naive_recurrent_fp64(B, T, H, HV, K, V, l2, h0):
    x = _inputs(B, T, H, HV, K, V, initial_state=h0)
    if l2:
        x["k"] = torch.randn_like(x["k"])       # unnormalised, so the in-kernel norm matters
    o = poison_(torch.empty_like(x["v"]))
    ht = poison_(torch.empty(B, HV, K, V))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x.get("initial_state"), None, None,
                            None, None, l2, False, True, False, out=o, final_out=ht)
    ro, rht = naive_recurrent(**_f64(x), output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert_close("o", o, ro, F32)
    assert_close("final_state", ht, rht, F32)
    # the public function (auto backend = Triton) gives the same answer
    o2, ht2 = decode(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert torch.equal(o2, o) and torch.equal(ht2, ht)


def test_varlen_matches_naive_recurrent_fp64():
    lengths = [1, 3, 0, 2]
    x = _inputs(1, sum(lengths), 2, 4, 32, 32, num_states=len(lengths))
    cu = random_cu_seqlens(lengths)
    o, ht = decode(**x, output_final_state=True, cu_seqlens=cu, scale=0.3)
    ro, rht = naive_recurrent(**_f64(x), output_final_state=True, cu_seqlens=cu, scale=0.3)
    assert_close("o", o, ro, F32)
    assert_close("final_state", ht, rht, F32)
    assert torch.equal(ht[2], x["initial_state"][2])    # an empty sequence passes its state through


@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)])
def test_decode_reaches_chunk_reference_state(H, HV):
    """T tokens in one call, and the same T tokens one call each through a pool, end at the chunk form's state."""
    T, K, V = 9, 32, 32
    x = _inputs(2, T, H, HV, K, V)
    _, want = chunk_reference(**_f64(x), output_final_state=True, chunk_size=4)   # 3 chunks, the last partial
    _, want64 = chunk_reference(**_f64(x), output_final_state=True)                  # the default chunk of 64
    _, ht = decode(**x, output_final_state=True)
    assert_close("one call, T tokens", ht, want, F32)
    assert_close("one call vs C=64", ht, want64, F32)
    pool = torch.randn(4, HV, K, V)
    slots = torch.tensor([3, 1])
    pool[slots] = x["initial_state"]
    for t in range(T):
        step = {n: x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        _, ret = decode(**step, initial_state=pool, state_indices=slots, inplace=True)
        assert ret is pool
    assert_close("T calls of one token", pool[slots], want, F32)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)])
def test_pool_with_padding(index_dtype, H, HV):
    N, T, K, V, slots = 5, 2, 32, 64, 8
    x = _inputs(N, T, H, HV, K, V, initial_state=False)
    pool = torch.randn(slots, HV, K, V)
    idx = torch.tensor([6, -1, 0, 3, -1], dtype=index_dtype)
    before = pool.clone()
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True)

    # out of place: the pool is only read; padded rows give zero outputs and zero final states
    o = poison_(torch.empty_like(x["v"]))
    ht = poison_(torch.empty(N, HV, K, V))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, None, None,
                            False, False, True, False, out=o, final_out=ht)
    assert torch.equal(pool, before)
    assert_close("o", o, ro, F32)
    assert torch.equal(o[[1, 4]], torch.zeros_like(o[[1, 4]]))
    assert torch.equal(ht[[1, 4]], torch.zeros_like(ht[[1, 4]]))
    assert_close("final rows", ht[[0, 2, 3]], ref_pool[[6, 0, 3]], F32)

    # in place: live slots updated, every other slot bit-identical
    o2, ret = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    assert ret is pool
    assert torch.equal(o2, o)
    unused = [1, 2, 4, 5, 7]
    assert torch.equal(pool[unused], before[unused])
    assert_close("pool", pool, ref_pool, F32)


def test_out_of_range_slot_is_padding_in_the_kernel():
    """The GPU path does not read the indices on the host: an index >= num_slots must not write anywhere.
    The pool is a view of a larger buffer whose extra rows must stay bit-identical."""
    HV, K, V, slots = 2, 16, 32, 3
    x = _inputs(3, 1, 2, HV, K, V, initial_state=False)
    buf = torch.randn(slots + 2, HV, K, V)
    before = buf.clone()
    pool = buf[:slots]
    idx = torch.tensor([slots, 1, slots + 1])
    o = poison_(torch.empty_like(x["v"]))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, None, None,
                            False, False, False, True, out=o)
    keep = [0, 2, 3, 4]
    assert torch.equal(buf[keep], before[keep])
    assert not torch.equal(buf[1], before[1])
    assert torch.equal(o[[0, 2]], torch.zeros_like(o[[0, 2]]))
    assert torch.isfinite(o[1]).all()


@pytest.mark.parametrize("dt_bias", [True, False])
def test_fused_gate_and_beta_sigmoid(dt_bias):
    N, T, H, HV, K, V = 3, 2, 2, 4, 32, 32
    x = _inputs(N, T, H, HV, K, V)
    x["g"] = torch.randn(N, T, HV) * 3           # raw gate input, both signs, some beyond softplus' linear part
    x["g"][0, 0, 0] = 25.0
    x["beta"] = torch.randn(N, T, HV) * 2        # logits
    A_log = torch.rand(HV) * 2 - 1
    bias = torch.randn(HV) if dt_bias else None
    o, ht = decode(**x, output_final_state=True, A_log=A_log, dt_bias=bias, beta_sigmoid=True)
    # the formulas written out here, independent of the reference wrapper
    x64 = _f64(x)
    graw = x64["g"] + (bias.double() if dt_bias else 0)
    x64["g"] = -torch.exp(A_log.double()) * F.softplus(graw)
    x64["beta"] = torch.sigmoid(x64["beta"])
    ro, rht = naive_recurrent(**x64, output_final_state=True)
    assert_close("o", o, ro, F32)
    assert_close("final_state", ht, rht, F32)
    wo, wht = fused_recurrent_reference(**_f64(x), output_final_state=True, A_log=A_log.double(),
                                        dt_bias=None if bias is None else bias.double(), beta_sigmoid=True)
    assert_close("reference wrapper o", wo, ro, 1e-12)
    assert_close("reference wrapper state", wht, rht, 1e-12)


def test_no_gate():
    x = _inputs(2, 3, 2, 2, 16, 32)
    g = x.pop("g")
    o, ht = decode(**x, g=None, output_final_state=True)
    ro, rht = naive_recurrent(**_f64(x), g=torch.zeros_like(g, dtype=torch.float64), output_final_state=True)
    assert_close("o", o, ro, F32)
    assert_close("final_state", ht, rht, F32)


@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)])
def test_bf16_state_pool(H, HV):
    """bf16 pool: read bf16, compute fp32, write bf16. Against fp64 from the same bf16 values."""
    N, T, K, V = 3, 2, 64, 64
    x = _inputs(N, T, H, HV, K, V, initial_state=False)
    pool = (torch.randn(5, HV, K, V) * 0.5).to(torch.bfloat16)
    idx = torch.tensor([2, -1, 4])
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True)
    before = pool.clone()
    o, _ = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    assert pool.dtype == torch.bfloat16
    assert_close("o (fp32 from the bf16 state)", o, ro, F32)
    assert_close("bf16 pool", pool[[2, 4]], ref_pool[[2, 4]], BF16_STATE)
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])
    # out of place with a bf16 initial state: an fp32 final state (FLA's rule), the state the pool's bf16 rounds
    _, ht = decode(**x, initial_state=before, state_indices=idx, output_final_state=True)
    assert ht.dtype == torch.float32 and torch.equal(ht[[0, 2]].to(torch.bfloat16), pool[[2, 4]])
    assert_close("fp32 final state", ht[[0, 2]], ref_pool[[2, 4]], F32)


def test_inplace_without_indices_and_bf16_qkv():
    x = make_gdn_inputs(2, 2, 2, 4, 32, 32, dtype=torch.bfloat16)
    h = x["initial_state"].clone()
    ro, rht = naive_recurrent(**_f64(x), output_final_state=True)
    o, ret = decode(**x | {"initial_state": h}, inplace=True)
    assert ret is h and o.dtype == torch.bfloat16
    assert_close("o", o, ro, TOL[torch.bfloat16])
    assert_close("state", h, rht, F32)           # inputs are bf16 values; the state math is fp32


def test_bad_inputs_raise_clear_errors():
    x = _inputs(2, 1, 2, 2, 16, 16, initial_state=False)
    pool = torch.randn(4, 2, 16, 16)
    cases = [
        (dict(initial_state=pool, state_indices=torch.tensor([0, 4])), "out of range"),
        (dict(initial_state=pool, state_indices=torch.tensor([1, 1]), inplace=True), "twice"),
        (dict(initial_state=pool, state_indices=torch.tensor([0.0, 1.0])), "int32 or int64"),
        (dict(initial_state=pool, state_indices=torch.tensor([0, 1, 2])), r"\[N\]"),
        (dict(initial_state=pool, state_indices=torch.tensor([0, 1], device="meta")), "is on meta"),
        (dict(state_indices=torch.tensor([0, 1])), "needs the state pool"),
        (dict(initial_state=torch.randn(4, 2, 16, 8), state_indices=torch.tensor([0, 1])), "num_slots"),
        (dict(inplace=True), "inplace=True needs initial_state"),
        (dict(initial_state=torch.randn(2, 2, 16, 32)[..., :16], inplace=True), "contiguous"),
        (dict(A_log=torch.zeros(3)), "A_log must be a tensor"),
        (dict(A_log=torch.zeros(2), dt_bias=torch.zeros(2, 1)), "dt_bias must be a tensor"),
        (dict(dt_bias=torch.zeros(2)), "pass A_log too"),
    ]
    for extra, msg in cases:
        with pytest.raises(ValueError, match=msg):
            decode(**x, **extra)
    with pytest.raises(ValueError, match=r"decode config \(16, 1, 2, 1\)"):
        fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, None, None, None, None, None, False,
                                False, True, False, config=(16, 1, 2, 1))
    # the failing call must not have touched the pool
    with pytest.raises(ValueError):
        before = pool.clone()
        decode(**x, initial_state=pool, state_indices=torch.tensor([0, 9]), inplace=True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"])
def test_inputs_that_require_grad_run_forward_only(name):
    """As FLA's fused_recurrent (whose own tests call it on inputs that require grad): the forward runs and equals the
    no_grad call; the outputs require grad and a backward through them raises NotImplementedError naming the op."""
    HV = 2
    x = _inputs(2, 1, 2, HV, 16, 16)
    x.update(A_log=torch.randn(HV) * 0.3, dt_bias=torch.randn(HV) * 0.3)
    with torch.no_grad():
        o_ref, ht_ref = decode(**x, output_final_state=True, use_gate_in_kernel=True)
    x[name] = x[name].clone().requires_grad_(True)
    o, ht = decode(**x, output_final_state=True, use_gate_in_kernel=True)
    assert o.requires_grad and ht.requires_grad
    assert_close("o", o.detach(), o_ref, F32)
    assert_close("state", ht.detach(), ht_ref, F32)
    with pytest.raises(NotImplementedError, match="fused_recurrent_gated_delta_rule has no backward.*chunk_gated_delta_rule"):
        (o.float().sum() + ht.sum()).backward()


def test_backends_and_launch_config():
    b = op_backends("fused_recurrent_gated_delta_rule")
    assert b.backends["triton"].priority == 10 and b.backends["reference"].priority == 100
    assert not b.backends["reference"].auto
    x = _inputs(2, 1, 2, 2, 16, 16)
    o, ht = decode(**x, output_final_state=True, backend="reference")
    o2, ht2 = decode(**x, output_final_state=True, backend="triton")
    assert_close("o", o2, o, F32)
    assert_close("state", ht2, ht, F32)
    ok, reason = b.backends["triton"].supports(**_f64(x))
    assert not ok and "fp64" in reason
    # on an H200 (132 SMs), batch 1 at H = 32, V = 128 must still fill the machine; batch 256 keeps wide blocks
    BK, BV, warps = decode_launch_config(1, 32, 128, 128, torch.float32, 132)
    assert (BK, BV, warps) == (128, 16, 1) and 32 * (128 // BV) >= 256         # 64-byte rows, 256 programs
    # fp32 K-first: 256-byte rows at 16 KB a warp once the grid is full
    assert decode_launch_config(256, 32, 128, 128, torch.float32, 132) == (128, 64, 2)
    assert decode_launch_config(64, 32, 128, 128, torch.float32, 132) == (128, 64, 2)
    assert decode_launch_config(256, 32, 128, 128, torch.bfloat16, 132) == (128, 64, 4)   # 128-byte rows
    assert decode_launch_config(1, 32, 128, 128, torch.bfloat16, 132)[1] == 32   # 64-byte rows in bf16 too
    # V-first states: one warp over 4 KB of whole K rows, at every batch
    for n in (1, 256):
        assert decode_launch_config(n, 32, 128, 128, torch.float32, 132, v_first=True) == (128, 8, 1)
        assert decode_launch_config(n, 32, 128, 128, torch.bfloat16, 132, v_first=True) == (128, 16, 1)
    assert decode_launch_config(4, 2, 32, 4, torch.float32, 132, v_first=True) == (32, 4, 1)   # BV capped at V


def test_torch_compile_fullgraph():
    """The public function compiles with fullgraph=True (no graph break: custom ops with fake implementations,
    no host reads of device data); the in-place pool update is visible after the compiled call."""
    x = _inputs(3, 1, 2, 4, 16, 16, initial_state=False)
    pool = torch.randn(6, 4, 16, 16)
    idx = torch.tensor([4, -1, 0])
    want = pool.clone()
    wo, _ = decode(**x, initial_state=want, state_indices=idx, inplace=True)

    def step(q, k, v, g, beta, pool, idx):
        o, _ = decode(q, k, v, g, beta=beta, initial_state=pool, state_indices=idx, inplace=True)
        o2, ht = decode(q, k, v, g, beta=beta, initial_state=pool, state_indices=idx, output_final_state=True)
        return o, o2, ht

    torch._dynamo.reset()
    o, o2, ht = torch.compile(step, fullgraph=True)(**x, pool=pool, idx=idx)
    assert torch.equal(o, wo) and torch.equal(pool, want)
    # the out-of-place call ran after the in-place one: it starts from the updated pool
    _, rht = fused_recurrent_reference(**_f64(x), initial_state=want.double(), state_indices=idx,
                                       output_final_state=True)
    assert_close("second call's state", ht, rht, F32)
    assert torch.isfinite(o2).all()


def test_aot_sm90_vector_accesses_no_spills():
    """The serving configs compile for sm_90a on this CPU host (in a child process without the interpreter,
    like linattn.runtime.aot does) with 16-byte state loads/stores, no spills and no local memory."""
    import json
    import subprocess
    import sys
    code = """
import collections, json, re
from triton.tools.disasm import get_sass
from linattn.runtime.aot import compile_kernel, ptxas_usage
from linattn.ops.gated_delta_rule.triton.fused_recurrent import aot_specs
out = []
for s in aot_specs():
    k = compile_kernel(s, "sm_90a")
    regs, spills = ptxas_usage(k.asm["ptx"], "sm_90a")
    ops = collections.Counter(m[2] for m in re.finditer(r"^\\S+\\s+(@!?U?P\\w+\\s+)?([A-Z][\\w.]+)",
                                                        get_sass(k.asm["cubin"]), re.M))
    out.append(dict(name=s.name, regs=regs, spills=spills, intended=list(s.intended),
                    ops={o: n for o, n in ops.items() if o.startswith(("LDG", "STG", "LDL", "STL"))}))
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    # 7 one-tile configs (2 of them V-first), 2 persistent ones (in place; GVA + fused gate out of place, streaming
    # stores)
    assert len(reports) == 9
    for r in reports:
        assert all(r["ops"].get(op, 0) > 0 for op in r["intended"]), f"{r['name']}: {r['ops']}"
        assert r["spills"] == 0 and not any(o.startswith(("LDL", "STL")) for o in r["ops"]), r


def _guarded(t, pad=4096, fill=float("nan")):
    """`t` copied into the middle of a buffer filled with `fill`: with NaN, a read past either end brings NaN
    into the result; with a finite sentinel, a write past either end changes the guard's bits (NaN would hide
    a NaN written over it). The interpreter itself does not check bounds."""
    buf = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype)
    view = buf[pad:pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf, pad


def test_gva_varlen_pool_stays_in_bounds():
    """FLA's decode hit an illegal memory access with GVA on the H200: every tensor of a GVA + varlen + pool
    call sits between NaN guards; the results must be finite and correct and the guards untouched."""
    lengths = [2, 1, 3]
    H, HV, K, V = 2, 4, 32, 64
    x = _inputs(1, sum(lengths), H, HV, K, V, initial_state=False)
    pool0 = torch.randn(5, HV, K, V)
    idx = torch.tensor([4, -1, 0])
    cu = random_cu_seqlens(lengths)
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**_f64(x), cu_seqlens=cu, initial_state=ref_pool, state_indices=idx,
                                      inplace=True)
    gx = {n: _guarded(t)[0] for n, t in x.items()}
    pool, pbuf, pad = _guarded(pool0, pad=pool0[0].numel(), fill=12345.0)     # a whole slot on each side
    o, obuf, opad = _guarded(torch.full_like(x["v"], float("nan")))
    fused_recurrent_gdn_fwd(gx["q"], gx["k"], gx["v"], gx["g"], gx["beta"], K ** -0.5, pool, cu, idx, None, None,
                            False, False, False, True, out=o)
    assert_close("o", o, ro, F32)
    assert_close("pool", pool, ref_pool, F32)
    assert (pbuf[:pad] == 12345.0).all() and (pbuf[pad + pool.numel():] == 12345.0).all()
    assert torch.isnan(obuf[:opad]).all() and torch.isnan(obuf[opad + o.numel():]).all()


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
def test_persistent_one_token_kernel(state_dtype, inplace):
    """The persistent kernel (the large-batch serving step): a grid smaller than the tile count, so every
    program walks several tiles, GVA, a pool with padded rows, fused gate; against the fp64 reference."""
    N, H, HV, K, V, slots = 6, 2, 4, 32, 64, 9
    x = _inputs(N, 1, H, HV, K, V, initial_state=False)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    x["beta"] = torch.randn_like(x["beta"])               # logits: beta_sigmoid=True
    pool = torch.randn(slots, HV, K, V).to(state_dtype)
    before = pool.clone()
    idx = torch.tensor([7, -1, 0, 3, 11, 5])               # -1 and 11 (>= slots) are padded rows
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True,
                                      A_log=A_log.double(), dt_bias=dt_bias.double(), beta_sigmoid=True)
    o = poison_(torch.empty_like(x["v"]))
    ht = None if inplace else poison_(torch.empty(N, HV, K, V, dtype=state_dtype))
    from linattn.runtime.device import device_facts
    n_tiles = N * HV * (V // 16)
    grid = min(n_tiles, 1 * device_facts(x["q"].device).num_sms)      # config: 1 program per SM
    assert n_tiles >= 4 * grid, "every program must walk several tiles"
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, A_log, dt_bias,
                            False, True, True, inplace, config=(16, 1, 1, 1), out=o, final_out=ht)
    live, padded = [0, 2, 3, 5], [1, 4]
    assert_close("o", o[live], ro[live], F32)
    assert torch.equal(o[padded], torch.zeros_like(o[padded]))
    tol = F32 if state_dtype == torch.float32 else 4e-3      # one bf16 rounding of the state
    if inplace:
        assert_close("pool", pool[[7, 0, 3, 5]].double(), ref_pool[[7, 0, 3, 5]], tol)
        unused = [1, 2, 4, 6, 8]
        assert torch.equal(pool[unused], before[unused])
    else:
        assert torch.equal(pool, before)
        assert_close("final", ht[live].double(), ref_pool[[7, 0, 3, 5]], tol)
        assert torch.equal(ht[padded], torch.zeros_like(ht[padded]))


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("num_sms", [2, 5, 7, 48])
def test_persistent_matches_one_tile_kernel_bit_for_bit(monkeypatch, inplace, num_sms):
    """48 tiles of BV=16 (6 sequences x 4 value heads x 2 V-blocks) walked by 2, 5, 7 or 48 programs (1 per
    "SM": uneven runs, one tile each): o and the pool (or the out-of-place final state) equal the one-tile
    kernel's bit for bit (the same tile, the same _decode_token arithmetic); an in-place tile done twice or
    skipped would change the pool. Slots 7, 0, 3, 5 live, -1 and 11 padded; GVA with the fused gate."""
    from linattn.ops.gated_delta_rule.triton import fused_recurrent as fr
    N, H, HV, K, V, slots = 6, 2, 4, 32, 32, 9
    x = _inputs(N, 1, H, HV, K, V, initial_state=False)
    A_log, dt_bias = torch.randn(HV) * 0.5, torch.randn(HV)
    x["beta"] = torch.randn_like(x["beta"])               # logits: beta_sigmoid=True
    pool0 = torch.randn(slots, HV, K, V)
    idx = torch.tensor([7, -1, 0, 3, 11, 5])
    monkeypatch.setattr(fr, "device_facts", lambda dev: type("F", (), {"num_sms": num_sms})())
    res = {}
    for name, cfg in (("one_tile", (16, 1)), ("persistent", (16, 1, 1, 1))):
        pool = pool0.clone()
        o = poison_(torch.empty_like(x["v"]))
        ht = None if inplace else poison_(torch.empty(N, HV, K, V))
        fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, None, idx, A_log,
                                dt_bias, False, True, not inplace, inplace, config=cfg, out=o, final_out=ht)
        res[name] = (o, pool if inplace else ht, pool)
    (o_a, s_a, _), (o_b, s_b, p_b) = res["one_tile"], res["persistent"]
    assert not torch.isnan(o_b).any() and not torch.isnan(s_b).any()
    assert torch.equal(o_b, o_a) and torch.equal(s_b, s_a)
    if not inplace:
        assert torch.equal(p_b, pool0)                     # out of place: the pool is only read
        assert torch.equal(s_b[[1, 4]], torch.zeros_like(s_b[[1, 4]]))
    assert torch.equal(o_b[[1, 4]], torch.zeros_like(o_b[[1, 4]]))
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True,
                                      A_log=A_log.double(), dt_bias=dt_bias.double(), beta_sigmoid=True)
    live = [0, 2, 3, 5]
    assert_close("o", o_b[live].double(), ro[live], F32)


def test_persistent_kernel_refuses_multi_token_and_varlen():
    x = _inputs(2, 3, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="one token per sequence"):
        fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, x["initial_state"], None, None,
                                None, None, False, False, True, False, config=(16, 1, 1, 1))


def test_persistent_heuristic():
    """The H200's choice: the persistent kernel (BV 64, 4 warps, 2 programs per SM) only for fp32 pools at large
    batch, one token, no varlen, K <= 128."""
    from linattn.ops.gated_delta_rule.triton.fused_recurrent import decode_persistent_config
    sms = 132
    assert decode_persistent_config(256, 32, 128, 128, 1, False, torch.float32, sms) == (64, 4, 1, 2)
    assert decode_persistent_config(256, 32, 128, 128, 1, False, torch.bfloat16, sms) is None           # bf16 pool
    assert decode_persistent_config(32, 32, 128, 128, 1, False, torch.float32, sms) is None             # batch 32
    assert decode_persistent_config(256, 32, 128, 128, 2, False, torch.float32, sms) is None            # speculative
    assert decode_persistent_config(256, 32, 128, 128, 1, True, torch.float32, sms) is None             # varlen
    assert decode_persistent_config(4096, 32, 128, 16, 1, False, torch.float32, sms) == (16, 4, 1, 2)
    assert decode_persistent_config(256, 32, 256, 128, 1, False, torch.float32, sms) is None           # K = 256
    assert decode_persistent_config(256, 32, 128, 128, 1, False, torch.float32, sms, v_first=True) is None


def test_public_decode_takes_the_persistent_kernel_at_large_batch(monkeypatch):
    """The public function at a batch large enough for the heuristic's persistent kernel (on this CPU: 2 'SMs',
    so 64 tiles), checked against the fp64 reference; the launcher is spied on to prove the kernel ran."""
    from linattn.ops.gated_delta_rule.triton import fused_recurrent as fr
    N, H, HV, K, V = 16, 2, 4, 32, 64
    assert fr.decode_persistent_config(N, HV, K, V, 1, False, torch.float32, 2) is not None
    launched = spy_grids(monkeypatch, fr, "fused_recurrent_gdn_fwd_persistent_kernel")
    monkeypatch.setattr(fr, "device_facts", lambda dev: type("F", (), {"num_sms": 2})())
    x = _inputs(N, 1, H, HV, K, V, initial_state=False)
    pool = torch.randn(N + 3, HV, K, V)
    idx = torch.randperm(N + 3)[:N]
    idx[5] = -1
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**_f64(x), initial_state=ref_pool, state_indices=idx, inplace=True)
    o, ret = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    assert launched == [(2 * 2,)]           # 2 programs per SM on 2 SMs, each walking 64 / 4 tiles
    assert ret is pool
    assert_close("o", o, ro, F32)
    assert_close("pool", pool, ref_pool, F32)


def _tile_loop_lines(sass: str) -> list:
    """The SASS lines of a kernel's tile loop: from the label of its longest backward branch to that branch."""
    lines = sass.splitlines()
    labels = {l.strip().rstrip(":"): i for i, l in enumerate(lines) if re.match(r"^\.?L\w+:$", l.strip())}
    back = [(labels[m[1]], i) for i, l in enumerate(lines) for m in [re.search(r"BRA (\.?L\w+)", l)]
            if m and m[1] in labels and labels[m[1]] < i]
    s, e = max(back, key=lambda b: b[1] - b[0])
    return lines[s:e + 1]


def test_aot_persistent_loads_the_next_tile_with_the_hint_before_the_arithmetic():
    """sm_90a: the persistent walk has no cp.async and no shared-memory ring; in its tile loop the next tile's 16
    state loads (16 bytes each, L2::evict_last) issue before the tile's first CTA barrier and its 16 state stores."""
    sass = kernel_asm("gdn_decode_persistent_fp32_bv64_w4", "sass")
    loop = _tile_loop_lines(sass)
    assert "LDGSTS" not in sass and "LDGDEPBAR" not in sass
    loads = [i for i, l in enumerate(loop) if re.search(r"\bLDG\.E\.EL\.128\b", l)]
    stores = [i for i, l in enumerate(loop) if re.search(r"\bSTG\.E\.128\b", l)]
    bars = [i for i, l in enumerate(loop) if "BAR.SYNC" in l]
    assert len(loads) == 16 and len(stores) == 16, (len(loads), len(stores))
    assert max(loads) < min(bars) and max(loads) < min(stores)
