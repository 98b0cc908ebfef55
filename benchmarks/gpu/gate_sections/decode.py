"""Gate section decode: fused_recurrent_gated_delta_rule against its fp64 reference on state pools (fp32 and bf16,
padded rows, unused slots untouched), speculative and varlen steps, the fused gate, out-of-range indices, CUDA-graph
replay and torch.compile(fullgraph=True) against eager."""
from __future__ import annotations

import time

import torch
from common import run_listed

from gate_sections import base


def _decode_dims():
    """(K, V, H of the plain pools, the GVA pair, batches): real sizes on the GPU, tiny ones in a dry run."""
    return (32, 32, (4, (2, 4)), (1, 3)) if base.DRY else (128, 128, (32, (16, 32)), (1, 32, 256))


def _decode_inputs(B, T, H, HV):
    from linattn.testing import make_gdn_inputs
    K, V = _decode_dims()[:2]
    x = make_gdn_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=base.DEV, initial_state=False)
    del x["initial_state"]
    return x


def decode_pool_case(B, H, HV, state_dtype, T=1, extra=None, varlen=None):
    """A pool of 2N + 3 slots, every 4th sequence padded (-1), live slots a random permutation: o and the updated
    slots against the fp64 reference, padded outputs 0, unused slots bit-identical, the pool returned in place."""
    from linattn.ops.gated_delta_rule.fused_recurrent import (fused_recurrent_gated_delta_rule as decode,
                                                              fused_recurrent_reference)
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, random_cu_seqlens, rel_rms
    K, V = _decode_dims()[:2]
    if varlen is not None:
        x = _decode_inputs(1, sum(varlen), H, HV)
        x["cu_seqlens"] = random_cu_seqlens(varlen, device=base.DEV)
        N = len(varlen)
    else:
        x = _decode_inputs(B, T, H, HV)
        N = B
    x.update(extra() if extra else {})
    slots = 2 * N + 3
    pool = (torch.randn(slots, HV, K, V, device=base.DEV) * 0.5).to(state_dtype)
    idx = torch.randperm(slots, device=base.DEV)[:N]
    idx[3::4] = -1
    before = pool.clone()
    ref_pool = pool.double()
    ro, _ = fused_recurrent_reference(**base.f64(x), initial_state=ref_pool, state_indices=idx, inplace=True)
    with poisoned_allocations():
        o, ret = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    base.sync()
    live = idx[idx >= 0]
    unused = torch.ones(slots, dtype=torch.bool, device=base.DEV)
    unused[live] = False
    pad = (idx < 0).nonzero().flatten()
    if varlen is None:
        pad_rows_zero = bool((o[pad] == 0).all())
    else:
        cu = x["cu_seqlens"].tolist()
        pad_rows_zero = all(bool((o[0, cu[n]:cu[n + 1]] == 0).all()) for n in pad.tolist())
    err_o, err_s = rel_rms(o, ro), rel_rms(pool[live], ref_pool[live])
    tol_o = TOL[torch.bfloat16]                        # o is written in v's dtype (bf16)
    tol_s = TOL[torch.float32] if state_dtype == torch.float32 else BF16_STATE_TOL
    untouched = bool(torch.equal(pool[unused], before[unused]))
    return dict(rel_rms_o=err_o, rel_rms_state=err_s, tol_o=tol_o, tol_state=tol_s, pad_rows_zero=pad_rows_zero,
                unused_slots_untouched=untouched,
                passed=bool(err_o <= tol_o and err_s <= tol_s and ret is pool and pad_rows_zero and untouched))


BF16_STATE_TOL = 4e-3        # one bf16 rounding of the state: < 2^-9 relative (tests/test_fused_recurrent.py)


def serving_case(decode, reference, x, HV, K, V, state_dtype, state_v_first=False, spec=False, **opts):
    """One in-place serving call of a decode op (GDN's or KDA's public function `decode`) against `reference` (the
    same call in plain PyTorch on fp64 copies: fused_recurrent_reference). x: the token inputs of N sequences of T
    tokens, [N, T, ...]; opts: the op's gate and beta options. The pool has 2 N T + 3 slots, [K, V] or (state_v_first)
    [V, K]. 1-D state_indices: one slot per sequence, rows 1, 5, 9, ... padded with -1. spec (vLLM's speculative form):
    state_indices [N, T], num_accepted_tokens drawn in 1..T, slot 0 the null block (pad_slot_id=0), row N // 2 all
    padding, each live row's token states written to its slots. o and every written slot against the reference,
    padded rows' outputs 0, the other slots bit-identical, the pool returned in place."""
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL
    N, T = x["q"].shape[:2]
    slots = 2 * N * T + 3
    pool = (torch.randn((slots, HV, V, K) if state_v_first else (slots, HV, K, V), device=base.DEV) * 0.5
            ).to(state_dtype)
    live = torch.randperm(slots - 1, device=base.DEV) + 1             # slot 0 is never a live slot
    if spec:
        idx = live[:N * T].view(N, T).clone()
        idx[N // 2] = 0
        serve = dict(state_indices=idx, num_accepted_tokens=torch.randint(1, T + 1, (N,), device=base.DEV),
                     pad_slot_id=0)
        pad = [N // 2]
    else:
        idx = live[:N].clone()
        idx[1::4] = -1
        serve = dict(state_indices=idx)
        pad = list(range(1, N, 4))
    before = pool.clone()
    ref_pool = pool.double()
    ro, _ = reference(**base.f64(x), **opts, **serve, initial_state=ref_pool, inplace=True,
                      state_v_first=state_v_first)
    with poisoned_allocations():
        o, ret = decode(**x, **opts, **serve, initial_state=pool, inplace=True, state_v_first=state_v_first)
    base.sync()
    written = (ref_pool != before.double()).flatten(1).any(1)
    err_o, err_s = base.rel(o, ro), base.rel(pool[written], ref_pool[written])
    tol_o = TOL[x["v"].dtype]
    tol_s = TOL[torch.float32] if state_dtype == torch.float32 else BF16_STATE_TOL
    pad_rows_zero = all(bool((o[n] == 0).all()) for n in pad)
    untouched = bool(torch.equal(pool[~written], before[~written]))
    return dict(rel_rms_o=err_o, rel_rms_state=err_s, tol_o=tol_o, tol_state=tol_s, slots_written=int(written.sum()),
                pad_rows_zero=pad_rows_zero, unused_slots_untouched=untouched,
                passed=bool(err_o <= tol_o and err_s <= tol_s and ret is pool and pad_rows_zero and untouched
                            and bool(written.any())))


def decode_out_of_range_case():
    """Indices >= num_slots (not checked on the host) are treated as padded; the guard rows stay untouched."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    from linattn.runtime.alloc import poisoned_allocations
    K, V, (H, _), _ = _decode_dims()
    x = _decode_inputs(8, 1, H, H)
    buf = torch.randn(12, H, K, V, device=base.DEV)
    pool = buf[:8]
    before = buf.clone()
    idx = torch.tensor([8, 1, 11, 2, 1000, -1, 3, 9], device=base.DEV)
    with poisoned_allocations():
        o, _ = decode(**x, initial_state=pool, state_indices=idx, inplace=True)
    base.sync()
    keep = [0, 4, 5, 6, 7, 8, 9, 10, 11]
    ok_guard = bool(torch.equal(buf[keep], before[keep]))
    ok_zero = bool((o[torch.tensor([0, 2, 4, 5, 7], device=base.DEV)] == 0).all())
    return dict(guard_rows_untouched=ok_guard, padded_outputs_zero=ok_zero, passed=ok_guard and ok_zero)


def decode_graph_case():
    """One CUDA-graph replay gives the eager result (pool state and outputs), with new inputs copied in."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    B, H, HV, K, V = 32, 16, 32, 128, 128
    x = _decode_inputs(B, 1, H, HV)
    pool = torch.randn(2 * B, HV, K, V, device=base.DEV)
    idx = torch.randperm(2 * B, device=base.DEV)[:B].to(torch.int32)
    p_eager, p_graph = pool.clone(), pool.clone()
    decode(**x, initial_state=p_graph, state_indices=idx, inplace=True)        # compile outside the capture
    p_graph.copy_(pool)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        o_graph, _ = decode(**x, initial_state=p_graph, state_indices=idx, inplace=True)
    torch.cuda.current_stream().wait_stream(s)
    p_graph.copy_(pool)
    fresh = _decode_inputs(B, 1, H, HV)
    for n in x:
        x[n].copy_(fresh[n])
    graph.replay()
    o_eager, _ = decode(**x, initial_state=p_eager, state_indices=idx, inplace=True)
    base.sync()
    ok = bool(torch.equal(o_graph, o_eager) and torch.equal(p_graph, p_eager))
    return dict(graph_equals_eager=ok, passed=ok)


def decode_compile_case(B, state_dtype):
    """torch.compile(fullgraph=True) of one in-place step equals eager, bit for bit. B8 fp32 pool: the Triton
    kernel; B32 bf16 pool: what `auto` gives the Gluon decode on sm_90 (fused_recurrent._gluon_auto_filter)."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    H, HV, K, V = 16, 32, 128, 128
    x = _decode_inputs(B, 1, H, HV)
    pool = torch.randn(2 * B, HV, K, V, device=base.DEV).to(state_dtype)
    idx = torch.randperm(2 * B, device=base.DEV)[:B]
    idx[1::6] = -1
    want = pool.clone()
    wo, _ = decode(**x, initial_state=want, state_indices=idx, inplace=True)

    def step(q, k, v, g, beta, pool, idx):
        return decode(q, k, v, g, beta=beta, initial_state=pool, state_indices=idx, inplace=True)[0]

    t0 = time.time()
    o = torch.compile(step, fullgraph=True)(**x, pool=pool, idx=idx)
    base.sync()
    ok = bool(torch.equal(o, wo) and torch.equal(pool, want))
    return dict(compile_s=round(time.time() - t0, 1), matches_eager=ok, passed=ok)


def decode_cases():
    """(name, fn, kwargs)."""
    F32, BF = torch.float32, torch.bfloat16
    _, _, (H, (Hg, HVg)), batches = _decode_dims()
    out = []
    for h, hv in ((H, H), (Hg, HVg)):
        for B in batches:
            for sd in (F32, BF):
                out.append((f"pool H={h} HV={hv} B={B} state={str(sd)[6:]}", decode_pool_case,
                            dict(B=B, H=h, HV=hv, state_dtype=sd)))
    Bs = batches[1]
    out.append((f"spec decode T=4 H={Hg} HV={HVg} B={Bs}", decode_pool_case,
                dict(B=Bs, H=Hg, HV=HVg, state_dtype=F32, T=4)))
    N = 6 if base.DRY else 24
    out.append((f"varlen 1..4 tokens H={Hg} HV={HVg} N={N}", decode_pool_case,
                dict(B=None, H=Hg, HV=HVg, state_dtype=F32, varlen=[1 + (n * 7) % 4 for n in range(N)])))

    def fused():                                       # g is the raw gate, beta a logit: the kernel maps both
        gen = torch.Generator(device=base.DEV)
        gen.manual_seed(1)
        return dict(g=torch.randn(Bs, 1, HVg, device=base.DEV, generator=gen) * 3,
                    beta=torch.randn(Bs, 1, HVg, device=base.DEV, generator=gen) * 2,
                    A_log=torch.rand(HVg, device=base.DEV, generator=gen) * 2 - 1,
                    dt_bias=torch.randn(HVg, device=base.DEV, generator=gen), beta_sigmoid=True)
    out.append((f"fused gate + beta_sigmoid H={Hg} HV={HVg} B={Bs}", decode_pool_case,
                dict(B=Bs, H=Hg, HV=HVg, state_dtype=F32, extra=fused)))
    if not base.DRY:                                        # on the CPU, indices are checked on the host instead
        out.append(("out-of-range indices", decode_out_of_range_case, {}))
        out.append(("CUDA graph", decode_graph_case, {}))
        out.append(("torch.compile fullgraph", decode_compile_case, dict(B=8, state_dtype=F32)))
        out.append(("torch.compile fullgraph bf16 pool B=32", decode_compile_case, dict(B=32, state_dtype=BF)))
    return out


def case_names():
    return [name for name, _, _ in decode_cases()]


def section(save):
    return run_listed(decode_cases(), save)
