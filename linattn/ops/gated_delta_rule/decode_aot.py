"""AOT registrations of the GDN decode kernels (Triton one-tile and persistent, Gluon TMA ring)."""
from __future__ import annotations

from linattn.runtime.aot import AotKernel, register

# the GPU round's sweep), at H=32 (16 for the GVA + fused-gate case), HV=32, K=V=128, pool in place.
DECODE_INTENDED = ("UTMALDG", "UTMASTG", "SYNCS")
DECODE_DIV16 = ("pool", "q", "k", "v", "g", "beta", "o", "state_indices")
DECODE_CONFIGS = [  # (name, state, BV, warps, stages, H, fused); keep equal to gluon/decode.py AOT_CONFIGS
    ("fp32_bv64_w4_s3", "fp32", 64, 4, 3, 32, False),
    ("fp32_bv64_w4_s2", "fp32", 64, 4, 2, 32, False),
    ("fp32_bv32_w4_s3", "fp32", 32, 4, 3, 32, False),
    ("bf16_bv64_w4_s3", "bf16", 64, 4, 3, 32, False),
    ("bf16_bv128_w4_s3", "bf16", 128, 4, 3, 32, False),
    ("fp32_bv64_w4_s3_gva_gate", "fp32", 64, 4, 3, 16, True),
    ("fp32_bv64_w4_s3_reg", "fp32", 64, 4, 3, 32, False),       # REG_STORE (name suffix "_reg"), round 29
]


def _build_decode(state: str, BV: int, warps: int, stages: int, H: int, fused: bool, reg_store: bool = False):
    def build():
        from linattn.ops.gated_delta_rule.gluon.decode import aot_build
        return aot_build(state, BV, warps, stages, H, fused, reg_store)
    return build


for _n, _st, _bv, _w, _s, _h, _f in DECODE_CONFIGS:
    _reg = _n.endswith("_reg")             # REG_STORE: plain stores from registers, no TMA store
    register(AotKernel(
        f"gdn_decode_gluon_{_n}", _build_decode(_st, _bv, _w, _s, _h, _f, _reg),
        ("UTMALDG", "SYNCS") if _reg else DECODE_INTENDED, div16=DECODE_DIV16,
        description=f"GDN decode step (T=1), Gluon TMA ring, {_st} pool in place, BV={_bv}, {_w} warps, "
                    f"{_s} stages, H={_h} HV=32 K=V=128" + (", fused gate" if _f else "")
                    + (", state stored from registers (REG_STORE)" if _reg else "")))

# ---- GDN decode, Triton persistent kernel (triton/fused_recurrent.py): the batch-256 fp32 serving default (3 stages
# since round 15; the 2-stage build of rounds 12-14 beside it) and its
# opt-in variants: `kwarp` (K rows inside one warp, warps along V; benchmarks/DECODE_KWARP.md), `split_tail` (the
# last round's tiles as half tiles; benchmarks/DECODE_TAIL.md), and round 29's `discard_l2`, `store_first` and
# `prefetch_qk_early` (OPT_LOG 29.1, 29.3, 29.8), round 30's `fused_reduce`, `qk_join`, `o_asm` and the PDL builds, so that `linattn inspect` reports them side by side. Appended by the
# decode engineer; the specs are fused_recurrent's own aot_specs, with the intended SASS narrowed to the 16-byte
# cp.async state copies (LDGSTS.E.BYPASS.128): the registry counts only the SASS_FAMILIES opcodes, so STG.E.128 is
# checked by tests/test_decode_kwarp.py instead.
def _register_decode_persistent():
    import dataclasses
    from linattn.ops.gated_delta_rule.triton.fused_recurrent import aot_specs as decode_specs
    pdl = ("ACQBULK",)                          # griddepcontrol.wait: the PDL builds (round 30)
    for spec in decode_specs() + decode_specs(variants=True):
        if spec.name in ("gdn_decode_persistent_fp32_bv64_w4_s2", "gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk") \
                or spec.name.endswith(("_kwarp", "_split_tail", "_discard_l2", "_store_first", "_prefetch_qk_early",
                                       "_fused_reduce", "_qk_join", "_o_asm", "_s3_prefetch_qk_pdl")):
            register(dataclasses.replace(spec, intended=("LDGSTS.E.BYPASS.128",) + (pdl if "_pdl" in spec.name else ())))
        elif "_reg_prefetch" in spec.name:
            # round 30's reg_prefetch walk (the batch-256 fp32 default with evict_last): plain 16-byte state loads,
            # with the named L2 hint
            load = {"evict_last": "LDG.E.EL.128", "evict_first": "LDG.E.EF.128"}.get(spec.name.split("_reg_prefetch")[-1]
                                                                                   .strip("_"), "LDG.E.128")
            register(dataclasses.replace(spec, intended=(load,)))
        elif spec.name in ("gdn_decode_bf16_bv32_w4", "gdn_decode_bf16_bv32_w4_pdl"):
            # round 30: the one-tile kernel (batch 1 / 32, bf16 pools) with and without PDL (tests/test_decode_pdl.py)
            register(dataclasses.replace(spec, intended=("LDG.E.128",) + (pdl if "_pdl" in spec.name else ())))


_register_decode_persistent()
