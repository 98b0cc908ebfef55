"""AOT registrations of the GDN decode kernels: the Gluon TMA ring (gluon/decode.py) and the Triton one-tile and
persistent kernels (triton/fused_recurrent.py's aot_specs), at the launch configs the backends use."""
from __future__ import annotations

import dataclasses

from linattn.runtime.aot import AotKernel, register

# ---- Gluon decode step (gluon/decode.py): TMA ring in, TMA store out, mbarrier phases. The launcher's default
# config per pool dtype (DEFAULT_CONFIGS), the fp32 one with GVA (H=16) and the fused gate, and the bf16 one with
# vLLM's padding slot (pad_slot_id=0: PAD_SLOT=0); HV=32, K=V=128, pool in place.
DECODE_INTENDED = ("UTMALDG", "UTMASTG", "SYNCS")
DECODE_DIV16 = ("q", "k", "v", "g", "beta", "o", "state_indices")
DECODE_CONFIGS = [  # (name, state, BV, warps, stages, H, fused, pad_slot)
    ("fp32_bv64_w4_s3", "fp32", 64, 4, 3, 32, False, -1),
    ("bf16_bv64_w4_s3", "bf16", 64, 4, 3, 32, False, -1),
    ("fp32_bv64_w4_s3_gva_gate", "fp32", 64, 4, 3, 16, True, -1),
    ("bf16_bv64_w4_s3_pad0", "bf16", 64, 4, 3, 32, False, 0),
]


def _build_decode(state: str, BV: int, warps: int, stages: int, H: int, fused: bool, pad_slot: int):
    def build():
        from linattn.ops.gated_delta_rule.gluon.decode import aot_build
        return aot_build(state, BV, warps, stages, H, fused, pad_slot)
    return build


for _n, _st, _bv, _w, _s, _h, _f, _p in DECODE_CONFIGS:
    register(AotKernel(
        f"gdn_decode_gluon_{_n}", _build_decode(_st, _bv, _w, _s, _h, _f, _p), DECODE_INTENDED, div16=DECODE_DIV16,
        description=f"GDN decode step (T=1), Gluon TMA ring, {_st} pool in place, BV={_bv}, {_w} warps, "
                    f"{_s} stages, H={_h} HV=32 K=V=128" + (", fused gate" if _f else "")
                    + (f", pad_slot_id={_p}" if _p >= 0 else "")))


# ---- Triton decode kernels (triton/fused_recurrent.py): the batch-256 fp32 default (persistent, in place), the
# batch-1 bf16 one-tile config, the K-first fp32 one-tile config of batch 32-64 and the V-first fp32 one, so that
# `linattn inspect` reports them beside the Gluon builds. The registry counts
# only SASS_FAMILIES opcodes, so the intended SASS is narrowed to the state loads (LDG.E.EL.128: the persistent
# walk's L2::evict_last; LDG.E.128: the one-tile kernel); tests/test_fused_recurrent.py checks the stores.
def _register_triton_decode():
    from linattn.ops.gated_delta_rule.triton.fused_recurrent import aot_specs
    loads = {"gdn_decode_persistent_fp32_bv64_w4": "LDG.E.EL.128", "gdn_decode_bf16_bv32_w2": "LDG.E.128",
             "gdn_decode_fp32_bv64_w2": "LDG.E.128", "gdn_decode_vfirst_fp32_bv8_w1": "LDG.E.128"}
    for spec in aot_specs():
        if spec.name in loads:
            register(dataclasses.replace(spec, intended=(loads[spec.name],)))


_register_triton_decode()
