"""The discard_l2 variant of the persistent decode kernel (round 29, opt-in): each state block's 128-byte lines are
dropped from the L2 by PTX discard.global.L2 between the block's read and its write-back in place. It is inline PTX,
so it does not run under the interpreter; here: the launcher's refusals on the CPU, and ahead of time for sm_90a
(a child process without the interpreter) the order the variant relies on for soundness, read in the SASS of the
tile loop. Its results against the default's (bit for bit) and against fp64 are the GPU gate's
(benchmarks/gpu/decode_inplace_round.py)."""
import re

import pytest
import torch

from linattn.ops.gated_delta_rule.triton.fused_recurrent import (PERSISTENT_GPU_ONLY, discard_l2_refusal,
                                                                 fused_recurrent_gdn_fwd, persistent_variant_flags)
from decode_aot import tile_loop_lines                                   # tests/ is on sys.path
from linattn.runtime.aot import kernel_asm
from linattn.testing import make_gdn_inputs

BUILD = "gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk_discard_l2"
DEFAULT = "gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk"


def test_flags_and_refusals():
    assert "discard_l2" in PERSISTENT_GPU_ONLY
    assert persistent_variant_flags("prefetch_qk+discard_l2")["DISCARD_L2"]
    assert not persistent_variant_flags("prefetch_qk")["DISCARD_L2"]
    for bad in ("kwarp+discard_l2", "split_tail+discard_l2"):
        with pytest.raises(ValueError, match="discard_l2"):
            persistent_variant_flags(bad)
    pool = torch.zeros(4, 2, 128, 128)
    # a CPU tensor (or the interpreter) is refused with the reason; so is every case a discarded line would not be
    # overwritten whole by the same program
    assert "CUDA" in discard_l2_refusal(True, pool, 128, 128, 128, 64)
    assert "CUDA" in discard_l2_refusal(True, None, 128, 128, 128, 64)


def test_launcher_refuses_it_off_the_gpu():
    x = make_gdn_inputs(2, 1, 2, 2, 32, 32, dtype=torch.float32, initial_state=False)
    pool = torch.randn(3, 2, 32, 32)
    idx = torch.tensor([2, 0])
    with pytest.raises(ValueError, match="discard_l2: needs a CUDA device"):
        fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, pool, None, idx, None, None, False,
                                False, False, True, config=(32, 1, 2, 1, None, "prefetch_qk+discard_l2"))


@pytest.fixture(scope="module")
def sass():
    return {n: kernel_asm(n, "sass") for n in (BUILD, DEFAULT)}


def test_aot_discards_sit_between_the_wait_and_a_barrier_before_the_stores(sass):
    """What soundness needs, in the sm_90a SASS of the tile loop: the two discards per thread (a [128, 64] fp32 block
    is 256 lines over 128 threads) come after the loop's wait for the tile's copies (DEPBAR) and the barrier after
    it, and after the read of beta from shared memory, whose value predicates them; a CTA barrier separates the last
    discard from the first state store, so no thread's discard can land after another thread's store to the same
    line. The pipeliner still pipelines the loop (16-byte cp.async state copies, LDGSTS.E.BYPASS.128)."""
    loop = tile_loop_lines(sass[BUILD])
    idx = lambda pat: [i for i, l in enumerate(loop) if re.search(pat, l)]  # noqa: E731
    cctl, wait, bars = idx(r"CCTL\.E\.RML2"), idx(r"DEPBAR\.LE"), idx(r"BAR\.SYNC")
    stores = idx(r"STG\.E\.128")
    assert len(cctl) == 2 and all("@P" in loop[i] for i in cctl), [loop[i] for i in cctl]
    assert len(stores) == 16 and len(idx(r"LDGSTS\.E\.BYPASS\.128")) == 16
    assert wait and wait[0] < min(cctl) and any(wait[0] < b < min(cctl) for b in bars)
    assert any(max(cctl) < b < min(stores) for b in bars)
    # shared-memory reads of the tile (beta among them, whose value predicates the discards) before the discards
    assert any(wait[0] < i < min(cctl) for i in idx(r"\bLDS\b"))
    # the default has none
    assert not re.search(r"CCTL", sass[DEFAULT])


def test_aot_fits_two_programs_per_sm():
    from linattn.runtime.aot import inspect_kernel, kernels
    r = inspect_kernel(kernels()[BUILD])
    base = inspect_kernel(kernels()[DEFAULT])
    assert r.regs <= 255 and r.spill_bytes == 0 and r.smem == base.smem, (r.regs, r.spill_bytes, r.smem, base.smem)
