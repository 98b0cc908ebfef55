"""The warp-specialised Gluon fused forward that forms W and U itself (stages 2b+3+4, gluon/chunk_fused_wu_ws.py,
benchmarks/GLUON_FUSED_WU.md) on a CPU host: a torch model of the per-CTA schedule (emulate_fused_wu_ws: four
partitions interleaved at random at their mbarrier waits, the in-place buffers modelled in place) gives wu_kernel's
W and U (up to fp32 accumulation order), o bit-equal to the current fused path's model (emulate_fused_ws) on them,
and the Triton forward's o and final state, within TOL of the fp64 recurrence; a broken protocol deadlocks or gives
wrong data. The kernel has not run here (Gluon needs a GPU): benchmarks/gpu/gluon_fused_wu_round.py gates it.
Run only this file: `python -m pytest tests/test_gluon_fused_wu.py`."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the per-CTA schedule, modelled in torch

def _inputs(B, T, lens, dtype, h0, H=1, HV=2, seed=0):
    from linattn.testing import make_gdn_inputs
    gen = torch.Generator().manual_seed(seed)
    N = B if lens is None else len(lens)
    x = make_gdn_inputs(B, T, H, HV, 128, 128, dtype=dtype, num_states=N, initial_state=h0, generator=gen)
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    return x, cu


MODEL_CASES = [  # (B, T, lens, dtype, initial state, H, HV, BV, stages, nwu, npub)
    (1, 1, None, torch.bfloat16, True, 1, 2, 32, 3, 2, 2),
    (1, 63, None, torch.bfloat16, False, 1, 2, 64, 2, 2, 2),
    (2, 65, None, torch.float16, True, 1, 2, 32, 3, 2, 2),
    (1, 300, None, torch.bfloat16, True, 2, 4, 64, 2, 2, 2),
    (1, 260, [1, 63, 1, 130, 64, 1], torch.bfloat16, True, 1, 2, 32, 3, 2, 2),
    (1, 200, [65, 1, 64, 70], torch.float16, False, 1, 2, 64, 2, 2, 2),
    (1, 257, None, torch.bfloat16, True, 1, 2, 32, 1, 1, 1),          # every buffer single: still correct
    (1, 200, None, torch.float16, False, 1, 2, 64, 3, 1, 2),
]


@pytest.mark.parametrize("B,T,lens,dtype,h0,H,HV,BV,stages,nwu,npub", MODEL_CASES)
def test_schedule_model_matches_triton_forward(device, B, T, lens, dtype, h0, H, HV, BV, stages, nwu, npub):
    """The fused-wu forward (kkt_solve under the interpreter, then the schedule model with the partitions interleaved
    at random) on fresh random inputs, every output NaN-poisoned first: W and U equal to wu_kernel's rows < eos but
    for rare 1-ulp differences (accumulation order); o and final bit-equal to the current fused path's model on
    the same W and U, and within 1e-3 of it on wu_kernel's; within 3e-3 of the Triton
    forward, and within TOL of the fp64 recurrence. Covers T = 1, 63, 65, 200-300 (T not a multiple of 64), B2,
    varlen with 1-token sequences, GVA (HV = 2H), with and without h0, bf16 and fp16, BV 32/64, ring depths 1-3,
    NWU 1-2, NPUB 1-2."""
    if device != "cpu":
        pytest.skip("CPU model check")
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import emulate_fused_ws
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (chunk_gated_delta_rule_fwd_fused_wu,
                                                                      emulate_fused_wu_ws)
    from linattn.ops.gated_delta_rule.reference import naive_recurrent
    from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd
    from linattn.runtime.alloc import poisoned_allocations
    from linattn.testing import TOL, rel_rms
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))              # fresh inputs and interleaving every run
    x, cu = _inputs(B, T, lens, dtype, h0, H, HV, seed=seed)
    scale = 128 ** -0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], True, cu)
    with poisoned_allocations():
        ref = chunk_gated_delta_rule_fwd(*args)
    seen = {}

    def fused(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_):
        assert torch.isnan(o).all() and torch.isnan(final).all()          # poisoned by the allocator
        assert tinv.dtype == dtype and gcum.dtype == torch.float32
        seen["w"], seen["u"] = torch.full_like(ref.w, float("nan")), torch.full_like(ref.u, float("nan"))
        emulate_fused_wu_ws(q, k, v, beta, gcum, tinv, o, initial_state, final, plan, scale_, BV=BV, stages=stages,
                            nwu=nwu, npub=npub, w_out=seen["w"], u_out=seen["u"], seed=seed, stats=seen)
    with poisoned_allocations():
        res = chunk_gated_delta_rule_fwd_fused_wu(*args, fused_pass=fused)
    assert seen["steps"] > 0 and res.w is None and res.u is None and res.h is None and res.vnew is None
    # W and U: wu_kernel's rounding points, so equal to its W and U up to the fp32 accumulation order of the two
    # products (an element now and then one 16-bit ulp apart)
    for mine, theirs in ((seen["w"], ref.w), (seen["u"], ref.u)):
        assert torch.isfinite(mine).all()
        assert (mine != theirs).float().mean() < 1e-3 and rel_rms(mine, theirs) < 1e-4
    assert torch.equal(res.gcum, ref.gcum)
    # the state chain and the output are the current fused path's: chunk_fused_ws's model on these W and U gives
    # the same bits, and on wu_kernel's W and U the same o up to those ulps
    o_ws, f_ws = torch.full_like(ref.o, float("nan")), torch.full_like(ref.final_state, float("nan"))
    emulate_fused_ws(x["q"], x["k"], seen["w"], seen["u"], ref.gcum, o_ws, x["initial_state"], f_ws, ref.plan,
                     scale, BV=BV, stages=stages, npub=npub, seed=seed)
    assert torch.equal(res.o, o_ws) and torch.equal(res.final_state, f_ws)
    emulate_fused_ws(x["q"], x["k"], ref.w, ref.u, ref.gcum, o_ws, x["initial_state"], f_ws, ref.plan,
                     scale, BV=BV, stages=stages, npub=npub, seed=seed)
    assert rel_rms(res.o, o_ws) < 1e-3 and rel_rms(res.final_state, f_ws) < 1e-3
    assert rel_rms(res.o, ref.o) < 3e-3 and rel_rms(res.final_state, ref.final_state) < 3e-3
    o64, f64 = naive_recurrent(*(t.double() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])), scale=scale,
                               initial_state=None if x["initial_state"] is None else x["initial_state"].double(),
                               output_final_state=True, cu_seqlens=cu)
    assert rel_rms(res.o, o64) < TOL[dtype] and rel_rms(res.final_state, f64) < TOL[dtype]
    assert rel_rms(ref.o, o64) < TOL[dtype]


def _small_call(T=200, seed=0, lens=None):
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import kkt_solve
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    x, cu = _inputs(1, T, lens, torch.bfloat16, True, seed=seed)
    plan = make_chunk_plan(1, T, cu, 64, "cpu")
    gcum, tinv = kkt_solve(x["k"], x["g"], x["beta"], plan, 2)
    o = torch.full_like(x["v"], float("nan"))
    final = torch.full_like(x["initial_state"], float("nan"))
    return x, plan, (x["q"], x["k"], x["v"], x["beta"], gcum, tinv, o, x["initial_state"], final, plan, 128 ** -0.5)


def test_schedule_model_detects_a_deadlock():
    """The model is able to hang: the ring's empty barriers (count 3, the only ones) read with the wrong parity
    never let the producer start."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    _, _, call = _small_call()
    orig = fw._MBar.passes
    try:
        fw._MBar.passes = lambda self, parity: (self.done & 1) == parity if self.count == 3 else orig(self, parity)
        with pytest.raises(RuntimeError, match="deadlock"):
            fw.emulate_fused_wu_ws(*call, BV=32, stages=2)
    finally:
        fw._MBar.passes = orig


def test_schedule_model_detects_a_race_on_the_w_buffers():
    """The model sees in-place hazards: with the wu partition's wait on wu_empty dropped (its barriers pass at once),
    it rewrites wk_s[j] with a later chunk's W (or its scaled k) before product 1 has read it, so o goes wrong, or
    wu_full[j] completes twice ahead of the state partition (which then hangs on its parity), for some interleaving. Barriers are created per CTA in the kernel's order: ready, empty (STAGES each), wu_full,
    wu_empty (NWU each), then the published buffers' (3 NPUB)."""
    from linattn.ops.gated_delta_rule.gluon import chunk_fused_wu_ws as fw
    from linattn.testing import rel_rms
    x, plan, call = _small_call(T=640)
    stages, nwu, npub = 3, 2, 2
    fw.emulate_fused_wu_ws(*call, BV=64, stages=stages, nwu=nwu, npub=npub, seed=1)
    good = call[6].clone()
    per_cta = 2 * stages + 2 * nwu + 3 * npub
    first, last = 2 * stages + nwu, 2 * stages + 2 * nwu          # the wu_empty barriers' creation indices
    real = fw._MBar
    made = [0]

    class NoWuEmpty(real):
        def __init__(self, count):
            super().__init__(count)
            self.skip = first <= made[0] % per_cta < last
            made[0] += 1

        def passes(self, parity):
            return True if self.skip else super().passes(parity)
    wrong = 0
    try:
        fw._MBar = NoWuEmpty
        for seed in range(4):
            made[0] = 0
            call[6].fill_(float("nan"))
            try:
                fw.emulate_fused_wu_ws(*call, BV=64, stages=stages, nwu=nwu, npub=npub, seed=seed)
            except (RuntimeError, AssertionError, TypeError):
                wrong += 1          # wu_full completed twice ahead of its waiter (a hang), or no W yet
                continue
            wrong += rel_rms(call[6], good) > 1e-2
    finally:
        fw._MBar = real
    assert wrong >= 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
