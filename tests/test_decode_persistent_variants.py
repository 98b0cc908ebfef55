"""Opt-in variants of the persistent decode kernel (PERSISTENT_VARIANTS: streaming state stores, q/k prefetch,
contiguous tile runs), the round-13 sweep candidates. On the CPU (TRITON_INTERPRET=1, which ignores cache hints):
each variant gives the default's results bit for bit on a pool with padded and out-of-range rows, every tile
done exactly once for any program count. Ahead of time for sm_90a (a child process without the interpreter):
each switch changes the PTX the way it is meant to, and still fits 3 programs of 4 warps per SM."""
import json
import os
import subprocess
import sys

import pytest
import torch

from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
from linattn.ops.gated_delta_rule.triton.fused_recurrent import (PERSISTENT_GPU_ONLY, PERSISTENT_OWN_WALK,
                                                                 PERSISTENT_REORDERING,
                                                                 PERSISTENT_VARIANTS, fused_recurrent_gdn_fwd,
                                                                 persistent_variant_flags)
from linattn.testing import TOL, assert_close, make_gdn_inputs, poison_

# bit-exact variants only; kwarp (another summation order) has its own tests in test_decode_kwarp.py; discard_l2
# (inline PTX, GPU only) is checked ahead of time in test_decode_discard_l2.py and by the GPU gate
# (benchmarks/gpu/decode_inplace_round.py); the reg_prefetch walk combines with store_cs only and has its own tests
# (test_decode_reg_prefetch.py)
EXACT = sorted(set(PERSISTENT_VARIANTS) - PERSISTENT_REORDERING - PERSISTENT_GPU_ONLY - PERSISTENT_OWN_WALK)
VARIANTS = EXACT + ["+".join(EXACT)]
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernel needs TRITON_INTERPRET=1 on a CPU")


def _call(x, pool, idx, cfg, inplace, ht=None):
    o = poison_(torch.empty_like(x["v"]))
    fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, pool, None, idx,
                            x["A_log"], x["dt_bias"], False, True, not inplace, inplace, config=cfg, out=o,
                            final_out=ht)
    return o


@interpreter
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("programs", [None, 5, 7])
@pytest.mark.parametrize("inplace", [True, False])
def test_variant_matches_default(variant, programs, inplace):
    """Same pool, same inputs: the variant's o and pool (or out-of-place final state) equal the default's bit for
    bit. 48 tiles of BV=16 over 2 programs ("1 per SM" on this host), 5 or 7 (neither divides 48: uneven runs);
    an in-place tile done twice or skipped would change the pool. Slots 7, 0, 3, 5 live, -1 and 11 padded."""
    N, H, HV, K, V, slots = 6, 2, 4, 32, 32, 9
    x = make_gdn_inputs(N, 1, H, HV, K, V, dtype=torch.float32, initial_state=False)
    del x["initial_state"]
    x.update(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV), beta=torch.randn_like(x["beta"]))
    pool0 = torch.randn(slots, HV, K, V)
    idx = torch.tensor([7, -1, 0, 3, 11, 5])
    base = (16, 1, 2, 1, programs)
    got, want = {}, {}
    for res, cfg in ((want, base), (got, base + (variant,))):
        res["pool"] = pool0.clone()
        res["ht"] = None if inplace else poison_(torch.empty(N, HV, K, V))
        res["o"] = _call(x, res["pool"], idx, cfg, inplace, res["ht"])
    assert torch.equal(got["o"], want["o"]) and torch.equal(got["pool"], want["pool"])
    if not inplace:
        assert torch.equal(got["ht"], want["ht"])
        assert torch.equal(got["pool"], pool0)
    # and the default itself against the fp64 reference (padded rows: zero output, pool rows untouched)
    f64 = {n: (t.double() if t is not None else None) for n, t in x.items()}
    ref_pool = pool0.double()
    ro, _ = fused_recurrent_reference(**f64, initial_state=ref_pool, state_indices=idx, inplace=True,
                                      beta_sigmoid=True)
    live = [0, 2, 3, 5]
    assert_close("o", got["o"][live].double(), ro[live], TOL[torch.float32])
    assert torch.equal(got["o"][[1, 4]], torch.zeros_like(got["o"][[1, 4]]))
    if inplace:
        assert_close("pool", got["pool"].double(), ref_pool, TOL[torch.float32])


def test_variant_names_and_config_checks():
    assert persistent_variant_flags("") == persistent_variant_flags(None)
    assert persistent_variant_flags("store_cs+prefetch_qk")["STORE_CACHE"] == ".cs"
    with pytest.raises(ValueError, match="unknown persistent decode variant"):
        persistent_variant_flags("store_cs+nope")
    x = make_gdn_inputs(2, 1, 2, 2, 16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs the persistent kernel"):
        fused_recurrent_gdn_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, x["initial_state"], None, None,
                                None, None, False, False, True, False, config=(16, 1, 0, 0, None, "store_cs"))


_AOT = """
import collections, json, re
from linattn.runtime.aot import compile_kernel, ptxas_usage
from linattn.ops.gated_delta_rule.triton.fused_recurrent import aot_specs
specs = [s for s in aot_specs() if s.name == "gdn_decode_persistent_fp32_bv64_w4_s2"] + aot_specs(variants=True)
out = {}
for s in specs:
    k = compile_kernel(s, "sm_90a")
    ptx = k.asm["ptx"]
    regs, spills = ptxas_usage(ptx, "sm_90a")
    body = ptx.split(".section\\t.debug")[0]
    lines = [l.split("//")[0].strip() for l in body.splitlines()]
    ops = [l.split()[1] if l.startswith("@") else l.split()[0] for l in lines if l and not l.startswith((".", "$", "{", "}", ")"))]
    loop = re.search(r"scf\\.for %\\S+ = %(\\S+) to %(\\S+) step %(\\S+)", k.asm["ttgir"])
    out[s.name.replace("gdn_decode_persistent_fp32_", "")] = dict(
        regs=regs, spills=spills, smem=int(k.metadata.shared), ops=dict(collections.Counter(ops)), loop=loop.groups(),
        order=[o for o in ops if o.startswith(("st.global", "ld.global", "cp.async.cg"))])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def aot():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _last_loop_iteration(order):
    """The global memory ops of the loop body: after the prologue's last 16-byte state copy group."""
    i = max(n for n, o in enumerate(order) if o.startswith("st.global"))
    j = max(n for n, o in enumerate(order[:i]) if o.startswith("cp.async.cg"))
    return order[j + 1:]


def test_aot_variants_change_the_ptx_as_intended(aot):
    base = aot["bv64_w4_s2_novariant"]
    # the serving spec (decode_persistent_config's default since round 12) is the prefetch_qk variant
    assert aot["bv64_w4_s2"]["ops"] == aot["bv64_w4_s2_prefetch_qk"]["ops"]
    # the default: 16-byte state copies in, plain 16-byte stores out, q and k as 2-byte loads in the loop
    assert base["ops"].get("st.global.v4.b32") == 16 and "st.global.cs.v4.b32" not in base["ops"]
    assert base["ops"].get("ld.global.b16") == 2 and base["loop"][2] != "c1_i64"
    # store_cs: every state store streaming (st.global.cs -> STG.E.EF.128), nothing else changes
    cs = aot["bv64_w4_s2_store_cs"]
    assert cs["ops"].get("st.global.cs.v4.b32") == 16 and "st.global.v4.b32" not in cs["ops"]
    assert {o: n for o, n in cs["ops"].items() if "st.global" not in o} == \
        {o: n for o, n in base["ops"].items() if "st.global" not in o}
    # prefetch_qk: q, k loaded once before the loop and once in it, after the tile's state stores (for the next
    # tile), not after the wait for the state
    pf = aot["bv64_w4_s2_prefetch_qk"]
    assert pf["ops"].get("ld.global.b16") == 4
    body = _last_loop_iteration(pf["order"])
    last_store = max(n for n, o in enumerate(body) if o.startswith("st.global.v4"))
    assert [o for o in body[last_store:] if o == "ld.global.b16"] == ["ld.global.b16"] * 2, body
    # contiguous_tiles: the loop steps by 1 from the program's first tile to its last
    assert aot["bv64_w4_s2_contiguous_tiles"]["loop"][2] == "c1_i64"
    assert aot["bv64_w4_s2_contiguous_tiles"]["loop"][1] != "n_tiles"
    # every variant still fits 3 programs of 4 warps per SM (65536 / 384 = 170 -> 168 registers), no spills
    for name, r in aot.items():
        if name.startswith("bv64_w4_s2"):
            assert r["regs"] <= 168 and r["spills"] == 0, (name, r["regs"], r["spills"])
    # BV=128 at 4 warps: 2 programs per SM (<= 255 registers), no spills, 16-byte copies of the whole row
    wide = aot["bv128_w4_s2"]
    assert wide["spills"] == 0 and wide["ops"].get("cp.async.cg.shared.global") == 64
    assert 2 * wide["smem"] <= 227 * 1024


def test_aot_three_stages_do_not_fit_three_programs_per_sm(aot):
    """Why the sweep has no (64, 4, 3, 3): at 3 stages the pipeliner keeps a second tile's addresses live, 242
    registers (2 programs per SM); forcing 168 (maxnreg) spills about 300 bytes per thread."""
    assert aot["bv64_w4_s3"]["regs"] > 170 and aot["bv64_w4_s3"]["spills"] == 0
