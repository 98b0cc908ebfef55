"""AOT registrations of the Triton GDN forward and backward stage kernels (`linattn inspect`)."""
from __future__ import annotations

from linattn.runtime.aot import AotKernel, register

H, HV, K, V, BT = 16, 32, 128, 128, 64


# ---- The Triton forward's stage kernels (triton/forward.py) and the opt-in fused stage 3+4 (triton/chunk_fused_fwd.py),
# so that `linattn inspect` reports their registers, spills, shared memory and SASS mix on a CPU (issue 7, step 2:
# "registers and spills from linattn inspect"). Configs as forward._configs / fused_config pick them on an H200
# at H=16, HV=32, K=V=128, bf16: BV_state 32 at B=1 (64 programs of BV=64 would leave SMs idle), 64 at B >= 3.
_X, _F, _I64, _I32 = "*bf16", "*fp32", "*i64", "*i32"
# each stage: (module, kernel, signature without constexprs, stage-specific constexprs)
_TRITON_FWD_STAGES = {
    "intra": ("intra_chunk", "intra_chunk_wy_kernel",
              dict(k_ptr=_X, v_ptr=_X, g_ptr=_F, beta_ptr=_F, gcum_ptr=_F, w_ptr=_X, u_ptr=_X, tinv_ptr=_F,
                   cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32"), dict(STORE_TINV=False)),
    "state": ("chunk_state", "chunk_state_fwd_kernel",
              dict(k_ptr=_X, w_ptr=_X, u_ptr=_X, gcum_ptr=_F, h_ptr=_X, vnew_ptr=_X, h0_ptr=_F, ht_ptr=_F,
                   cu_ptr=_I64, chunk_off_ptr=_I64), dict(USE_H0=True, STORE_HT=True)),
    "output": ("chunk_output", "chunk_output_kernel",
               dict(q_ptr=_X, k_ptr=_X, vnew_ptr=_X, h_ptr=_X, gcum_ptr=_F, o_ptr=_X, cu_ptr=_I64,
                    chunk_idx_ptr=_I32, chunk_off_ptr=_I64, N="i32", scale="fp32"), {}),
    "fused": ("chunk_fused_fwd", "chunk_fused_fwd_kernel",
              dict(q_ptr=_X, k_ptr=_X, w_ptr=_X, u_ptr=_X, gcum_ptr=_F, o_ptr=_X, h0_ptr=_F, ht_ptr=_F, cu_ptr=_I64,
                   chunk_off_ptr=_I64, scale="fp32"), dict(USE_H0=True, STORE_HT=True)),
}
# the state pass with the decay on Vnew (LINATTN_GDN_STATE_DECAY_V, the forward's default since round 21): the same
# kernel and signature, one more constexpr
_TRITON_FWD_STAGES["state_dv"] = (*_TRITON_FWD_STAGES["state"][:3], dict(USE_H0=True, STORE_HT=True, DECAY_V=True))


def _triton_fwd_build(which: str, BV: int, warps: int, stages: int):
    def build():
        import importlib
        mod, kname, sig, extra = _TRITON_FWD_STAGES[which]
        fn = getattr(importlib.import_module(f"linattn.ops.gated_delta_rule.triton.{mod}"), kname)
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=BV, DOT_PREC="tf32", **extra)
        return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": warps, "num_stages": stages}
    return build


# (name, stage, BV, warps, stages, intended SASS on sm_90a, what it is). Triton lowers the [64, 128]-sized products
# of stages 3 and 4 to WGMMA (HGMMA) and stage 2's 16-row block products to mma.sync (HMMA).
TRITON_FWD = [
    ("gdn_fwd_triton_intra_bv64_w4", "intra", 64, 4, 2, ("HMMA",), "stage 2: gate cumsum, block inverse, W and U"),
    ("gdn_fwd_triton_state_bv32_w4", "state", 32, 4, 2, ("HGMMA",), "stage 3: state pass, B=1 config"),
    ("gdn_fwd_triton_state_bv64_w4", "state", 64, 4, 2, ("HGMMA",), "stage 3: state pass, B>=3 config"),
    ("gdn_fwd_triton_state_bv16_w4", "state", 16, 4, 2, ("HGMMA",),
     "stage 3: state pass, BV=16 (B1-B2 at HV8; LINATTN_GDN_STATE_BV16=0 off)"),
    ("gdn_fwd_triton_state_dv_bv16_w4", "state_dv", 16, 4, 2, ("HGMMA",),
     "stage 3: state pass with the decay on Vnew (LINATTN_GDN_STATE_DECAY_V), BV=16"),
    ("gdn_fwd_triton_state_dv_bv32_w4", "state_dv", 32, 4, 2, ("HGMMA",),
     "stage 3: state pass with the decay on Vnew (LINATTN_GDN_STATE_DECAY_V), B=1 config"),
    ("gdn_fwd_triton_state_dv_bv64_w4", "state_dv", 64, 4, 2, ("HGMMA",),
     "stage 3: state pass with the decay on Vnew (LINATTN_GDN_STATE_DECAY_V), B>=3 config"),
    ("gdn_fwd_triton_output_bv64_w4", "output", 64, 4, 2, ("HGMMA",), "stage 4: output, v1 (LINATTN_GDN_OUTPUT=v1)"),
    ("gdn_fwd_triton_fused_bv32_w8", "fused", 32, 8, 1, ("HGMMA",), "opt-in fused stage 3+4, B=1 config"),
]
for _name, _which, _bv, _w, _s, _intended, _what in TRITON_FWD:
    register(AotKernel(_name, _triton_fwd_build(_which, _bv, _w, _s), _intended, archs=("sm_90a",),
                       language="triton",      # torch allocations are 256-byte aligned: the JIT marks pointers so
                       div16=tuple(n for n, t in _TRITON_FWD_STAGES[_which][2].items() if t.startswith("*")),
                       description=f"GDN forward {_what}, Triton, H16/HV32 K=V=128 bf16, BV={_bv}, {_w} warps"))


# ---- Stage 4 as forward.py launches it since round 13 (chunk_output.OUTPUT_V2: K loop, BK 64, BV 128, 8 warps,
# heads grouped), through aot_output's spec
def _register_output_v2():
    from linattn.ops.gated_delta_rule.aot_output import spec
    from linattn.ops.gated_delta_rule.triton.chunk_output import OUTPUT_V2
    register(spec(OUTPUT_V2))


_register_output_v2()


# ---- The two-kernel stage 2 (triton/intra_split.py; the default since round 12), at the configs
# split_intra_config picks for H16/HV32 K=V=128 bf16: kkt_solve (K K^T as one [64, 128] x [128, 64] WGMMA, the
# inverse's [64, 64] products as TF32 WGMMA, the batched 16x16 diagonal inverses as mma.sync) storing Tinv in bf16
# (the forward) or fp32 (store_tinv, the backward's recompute); wu reading either ([64, 64] x [64, 64] WGMMA).
_KKT_KERNELS = {"kkt": "kkt_solve_kernel", "kkt_gva": "kkt_solve_gva_kernel", "kkt_v2": "kkt_solve_v2_kernel",
               "kkt_v3": "kkt_solve_v3_kernel", "kkt_v4": "kkt_solve_v4_kernel", "kkt_v4o": "kkt_solve_v4_kernel",
               "kkt_v4h": "kkt_solve_v4_kernel", "kkt_v4e": "kkt_solve_v4_kernel", "kkt_v4eh": "kkt_solve_v4_kernel"}
# v4's own constexpr arguments per build: v4o has the diagonal inverses at TF32, v4h the head-fastest program order
# (intra_split.kkt_order: the launches' choice from 768 chunk slots on), v4e / v4eh the loads issued before the cumsum
# (EARLY_K, kkt_order's default since round 21)
_KKT_EXTRA = {"kkt_v4": dict(LOWP_DIAG=True, HEADS_FAST=False, EARLY_K=False),
              "kkt_v4o": dict(LOWP_DIAG=False, HEADS_FAST=False, EARLY_K=False),
              "kkt_v4h": dict(LOWP_DIAG=True, HEADS_FAST=True, EARLY_K=False),
              "kkt_v4e": dict(LOWP_DIAG=True, HEADS_FAST=False, EARLY_K=True),
              "kkt_v4eh": dict(LOWP_DIAG=True, HEADS_FAST=True, EARLY_K=True)}


def _split_intra_build(which: str, tinv: str):
    def build():
        from linattn.ops.gated_delta_rule.triton import intra_split as m
        cfg = m.split_intra_config(K, V)
        if which in _KKT_KERNELS:        # kkt_solve_kernel and its opt-in variants: one signature and config
            fn, warps = getattr(m, _KKT_KERNELS[which]), cfg.warps_kkt
            sig = dict(k_ptr=_X, g_ptr=_F, beta_ptr=_F, gcum_ptr=_F, tinv_ptr=tinv, cu_ptr=_I64, chunk_idx_ptr=_I32,
                       N="i32")
            const = dict(H=H, HV=HV, K=K, BT=BT, BK=cfg.BK_kkt, DOT_PREC="tf32", **_KKT_EXTRA.get(which, {}))
        else:
            fn, warps = m.wu_kernel, cfg.warps_wu
            sig = dict(k_ptr=_X, v_ptr=_X, beta_ptr=_F, gcum_ptr=_F, tinv_ptr=tinv, w_ptr=_X, u_ptr=_X, cu_ptr=_I64,
                       chunk_idx_ptr=_I32, N="i32")
            const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=cfg.BK, BV=cfg.BV, DOT_PREC="tf32")
        return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": warps, "num_stages": 2}
    return build


SPLIT_INTRA = [  # (name, kernel, Tinv type, intended SASS, what it is)
    ("gdn_fwd_triton_split_kkt_solve_w4", "kkt", _X, ("HGMMA",), "opt-in split stage 2a: gcum and Tinv (bf16)"),
    ("gdn_fwd_triton_split_kkt_solve_f32_w4", "kkt", _F, ("HGMMA",), "opt-in split stage 2a, fp32 Tinv (backward)"),
    ("gdn_fwd_triton_split_wu_bv64_w4", "wu", _X, ("HGMMA",), "opt-in split stage 2b: W and U from bf16 Tinv"),
    ("gdn_fwd_triton_split_wu_f32_bv64_w4", "wu", _F, ("HGMMA",), "opt-in split stage 2b, fp32 Tinv (backward)"),
]
_SPLIT_PTRS = {"kkt": ("k_ptr", "g_ptr", "beta_ptr", "gcum_ptr", "tinv_ptr", "cu_ptr", "chunk_idx_ptr"),
               "wu": ("k_ptr", "v_ptr", "beta_ptr", "gcum_ptr", "tinv_ptr", "w_ptr", "u_ptr", "cu_ptr", "chunk_idx_ptr")}
for _name, _which, _tinv, _intended, _what in SPLIT_INTRA:
    register(AotKernel(_name, _split_intra_build(_which, _tinv), _intended, archs=("sm_90a",), language="triton",
                       div16=_SPLIT_PTRS[_which],
                       description=f"GDN forward {_what}, Triton, H16/HV32 K=V=128 bf16, 4 warps"))


# ---- The opt-in stage-2a variants at kkt_solve's config (BK_kkt, warps_kkt), built by _split_intra_build: the GVA
# form (intra_split.kkt_solve_gva_kernel: one program per (chunk slot, key head), K K^T once per key head, then a
# static loop over the HV // H = 2 value heads; benchmarks/gpu/kkt_gva_round.py, tests/test_kkt_solve_gva.py) and v2
# (intra_split.kkt_solve_v2_kernel: the same grid and outputs as kkt_solve_kernel, Tinv by block substitution on
# [4, 16, 16] batched tensors instead of four [64, 64] products; benchmarks/gpu/kkt_v2_round.py,
# tests/test_kkt_solve_v2.py) and v3 (intra_split.kkt_solve_v3_kernel: v2's products, its cross-warp moves as one
# broadcast per moved tensor and in-register selects instead of tl.gather; benchmarks/gpu/kkt_v3_round.py,
# tests/test_kkt_solve_v3.py).
KKT_VARIANTS = [  # (name, kernel, Tinv type, what it is)
    ("gdn_fwd_triton_split_kkt_solve_gva_w4", "kkt_gva", _X,
     "opt-in GVA kkt_solve (K K^T once per key head), bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v2_w4", "kkt_v2", _X,
     "kkt_solve v2 (block substitution on 16x16 blocks; LINATTN_GDN_KKT=v2), bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v3_w4", "kkt_v3", _X,
     "kkt_solve v3 (v2 with broadcast-and-select cross-warp moves; the default since round 17), bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v4_w4", "kkt_v4", _X,
     "kkt_solve v4 (v3 with bf16 operands for the inverse's products; LINATTN_GDN_KKT=v4), bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v4o_w4", "kkt_v4o", _X,
     "kkt_solve v4, bf16 operands for the off-diagonal products only, bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v4h_w4", "kkt_v4h", _X,
     "kkt_solve v4 with its programs numbered head-fastest (the default from 768 chunk slots on), bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v4e_w4", "kkt_v4e", _X,
     "kkt_solve v4 with g, beta and the k tile loaded before gam's cumsum (EARLY_K; the default below 768 chunk "
     "slots since round 21), bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v4eh_w4", "kkt_v4eh", _X,
     "kkt_solve v4 with EARLY_K and the head-fastest program order (the default from 768 chunk slots), bf16 Tinv"),
    ("gdn_fwd_triton_split_kkt_solve_v4_f32_w4", "kkt_v4", _F,
     "kkt_solve v4 with fp32 Tinv (the backward's recompute: v3's products at TF32)"),
]
for _name, _which, _tinv, _what in KKT_VARIANTS:
    register(AotKernel(_name, _split_intra_build(_which, _tinv), ("HGMMA",), archs=("sm_90a",), language="triton",
                       div16=_SPLIT_PTRS["kkt"],
                       description=f"GDN forward {_what}, Triton, H16/HV32 K=V=128 bf16, 4 warps"))


# ---- The Triton backward's own kernels (triton/backward*.py), at the configs backward._configs picks on an H200 at
# H=16, HV=32, K=V=128, bf16 (benchmarks/BWD_PROFILE.md): the local and WY stages in [64, 64] blocks (BK = BV = 64,
# 8 warps), the reverse state pass with the whole K = 128 and BV = 32 at B=1 (N*HV*V/64 = 64 programs would leave
# SMs idle), BV = 64 at B >= 3. The backward's recompute of the forward is covered above (split stage 2 with the
# fp32 Tinv, the state pass). dht is fp32 here (any float dtype is accepted), dh0 fp32.
_TRITON_BWD_STAGES = {
    "dv_local": ("backward_dv_local", "chunk_dv_local_kernel",
                 dict(q_ptr=_X, k_ptr=_X, gcum_ptr=_F, do_ptr=_X, dvnew_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32,
                      N="i32", scale="fp32"), {}),
    "state": ("backward_state", "chunk_state_bwd_kernel",
              dict(q_ptr=_X, k_ptr=_X, w_ptr=_X, gcum_ptr=_F, do_ptr=_X, dh_ptr=_X, dvnew_ptr=_X, dht_ptr=_F,
                   dh0_ptr=_F, cu_ptr=_I64, chunk_off_ptr=_I64, scale="fp32"), dict(USE_DHT=True, STORE_DH0=True)),
    "local": ("backward_local", "chunk_local_bwd_kernel",
              dict(q_ptr=_X, k_ptr=_X, vnew_ptr=_X, h_ptr=_X, gcum_ptr=_F, do_ptr=_X, dvnew_ptr=_X, dh_ptr=_X,
                   dq_ptr=_X, dk_ptr=_F, dw_ptr=_X, dgam_ptr=_F, cu_ptr=_I64, chunk_idx_ptr=_I32, chunk_off_ptr=_I64,
                   N="i32", T_tot="i32", scale="fp32"), {}),
    "wy": ("backward_wy", "chunk_wy_bwd_kernel",
           dict(k_ptr=_X, v_ptr=_X, beta_ptr=_F, gcum_ptr=_F, tinv_ptr=_F, dvnew_ptr=_X, dw_ptr=_X, dk_part_ptr=_F,
                dgam_ptr=_F, dk_ptr=_X, dv_ptr=_X, dg_ptr=_F, dbeta_ptr=_F, cu_ptr=_I64, chunk_idx_ptr=_I32,
                N="i32", T_tot="i32"), dict(NK=K // 64)),
}


def _triton_bwd_build(which: str, BK: int, BV: int, warps: int, stages: int):
    def build():
        import importlib
        mod, kname, sig, extra = _TRITON_BWD_STAGES[which]
        fn = getattr(importlib.import_module(f"linattn.ops.gated_delta_rule.triton.{mod}"), kname)
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, DOT_PREC="tf32", **extra)
        return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": warps, "num_stages": stages}
    return build


# (name, stage, BK, BV, warps, stages, intended SASS on sm_90a, known spill bytes, what it is). Every product is a
# WGMMA (HGMMA), but the local and WY stages take all 255 registers at 8 warps and still spill (ptxas, Triton 3.6):
# one CTA of 8 warps per SM. Their spill is registered as a known defect (BWD_PROFILE.md, first hypothesis); the
# AOT test fails if it grows.
TRITON_BWD = [
    ("gdn_bwd_triton_dv_local_w4", "dv_local", 64, 64, 4, 2, ("HGMMA",), 0, "stage 1a: P^T dO (intra-chunk dVnew)"),
    ("gdn_bwd_triton_state_bv32_w8", "state", 128, 32, 8, 2, ("HGMMA",), 0, "stage 1: reverse state pass, B=1 config"),
    ("gdn_bwd_triton_state_bv64_w8", "state", 128, 64, 8, 2, ("HGMMA",), 0,
     "stage 1: reverse state pass, B>=3 config"),
    ("gdn_bwd_triton_local_w8", "local", 64, 64, 8, 2, ("HGMMA",), 296, "stage 2: dQ, dK part, dW, gate terms"),
    ("gdn_bwd_triton_wy_w8", "wy", 64, 64, 8, 2, ("HGMMA",), 400, "stage 3: through the WY form: dV, dK, dbeta, dg"),
]
for _name, _which, _bk, _bv, _w, _s, _intended, _spill, _what in TRITON_BWD:
    register(AotKernel(_name, _triton_bwd_build(_which, _bk, _bv, _w, _s), _intended, archs=("sm_90a",),
                       language="triton", known_spill_bytes=_spill,
                       div16=tuple(n for n, t in _TRITON_BWD_STAGES[_which][2].items() if t.startswith("*")),
                       description=f"GDN backward {_what}, Triton, H16/HV32 K=V=128 bf16, BK={_bk} BV={_bv}, {_w} warps"))


# ---- The opt-in segment-parallel state pass with gate-truncated warm-ups (triton/chunk_state_warmup.py,
# LINATTN_GDN_SEGMENT_WARMUP=1, benchmarks/SEGMENT_WARMUP.md), at the launch the forward gives it at B=1 on an H200
# (the plain pass's config: BV=32, 4 warps, 2 stages) and the 1-stage variant (3 programs per SM) the GPU round times.
def _warmup_build(BV: int, warps: int, stages: int):
    def build():
        from linattn.ops.gated_delta_rule.triton.chunk_state_warmup import chunk_state_warmup_kernel as fn
        sig = dict(_TRITON_FWD_STAGES["state"][2], N="i32", seg_chunks="i32", thresh="fp32")
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=BV, DOT_PREC="tf32", USE_H0=True, STORE_HT=True)
        return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": warps, "num_stages": stages}
    return build


for _bv, _w, _s in ((32, 4, 2), (32, 4, 1)):
    register(AotKernel(f"gdn_fwd_triton_state_warmup_bv{_bv}_w{_w}_s{_s}", _warmup_build(_bv, _w, _s), ("HGMMA",),
                       archs=("sm_90a",), language="triton",
                       div16=tuple(n for n, t in _TRITON_FWD_STAGES["state"][2].items() if t.startswith("*")),
                       description=f"GDN forward opt-in stage 3 in segments with gate-truncated warm-ups, Triton, "
                                   f"H16/HV32 K=V=128 bf16, BV={_bv}, {_w} warps, {_s} stages"))


# ---- Opt-in restructured WY stage (triton/backward_wy_v2.py, LINATTN_GDN_BWD_WY=v2) at the config the launcher takes
# for H16/HV32 K=V=128 bf16 (B1 T65536 and B8 T4096 alike): BK = BV = 64, 4 warps, 1 stage, M^T through dk's rows.
# One warpgroup, every product a full-width 64x64 WGMMA (24 bf16 64x64x16, 16 TF32 64x64x8): 255 registers, no spill
# at G = HV / H = 2 (218 registers at G = 1), 32 KB smem, 2 CTAs/SM (was 380 B spilled before the gate vectors were
# loaded one per thread and the tile addresses made per-phase: benchmarks/BWD_WY_V2.md).
def _wy_v2_build():
    from linattn.ops.gated_delta_rule.triton import backward_wy_v2 as m
    fn = m.chunk_wy_bwd_v2_kernel
    sig = dict(_TRITON_BWD_STAGES["wy"][2])
    sig = {**{k: v for k, v in sig.items() if k not in ("cu_ptr", "chunk_idx_ptr", "N", "T_tot")}, "m_ptr": _X,
           "cu_ptr": _I64, "chunk_idx_ptr": _I32, "N": "i32", "T_tot": "i32"}
    const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, NK=K // 64, NKP=K // 64, M_IN_DK=K >= BT,
                 DOT_PREC="tf32")
    return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": m.WARPS_V2,
                                                                        "num_stages": m.STAGES_V2}


register(AotKernel("gdn_bwd_triton_wy_v2_w4", _wy_v2_build, ("HGMMA",), archs=("sm_90a",), language="triton",
                   div16=tuple(n for n, t in _TRITON_BWD_STAGES["wy"][2].items() if t.startswith("*")) + ("m_ptr",),
                   description="GDN backward stage 3, opt-in v2 (LINATTN_GDN_BWD_WY=v2): WY form, one warpgroup, "
                               "Triton, H16/HV32 K=V=128 bf16, BK=BV=64, 4 warps"))


# ---- Opt-in restructured local stage (triton/backward_local_v2.py, LINATTN_GDN_BWD_LOCAL=v2) at the config the
# launcher takes for H16/HV32 K=V=128 bf16 (B1 T65536 and B8 T4096 alike): BK = BV = 64 (NK = 2), 4 warps, 1 stage.
# Three phases of at most three [64, 64] fp32 tiles, every product a full-width 64x64 WGMMA (28 HGMMA 64x64x16):
# 255 registers, no spill, 32 KB smem, 2 CTAs/SM (v1 gdn_bwd_triton_local_w8: 8 warps, 255, 296 B, 80 KB, 1 CTA/SM,
# 64x32 WGMMAs). benchmarks/BWD_LOCAL_V2.md.
def _local_v2_build():
    from linattn.ops.gated_delta_rule.triton import backward_local_v2 as m
    sig = dict(_TRITON_BWD_STAGES["local"][2])
    const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, DOT_PREC="tf32")
    return m.chunk_local_bwd_v2_kernel, {**sig, **{name: "constexpr" for name in const}}, const, {
        "num_warps": m.WARPS_LOCAL_V2, "num_stages": m.STAGES_LOCAL_V2}


register(AotKernel("gdn_bwd_triton_local_v2_w4", _local_v2_build, ("HGMMA",), archs=("sm_90a",), language="triton",
                   known_spill_bytes=0,
                   div16=tuple(n for n, t in _TRITON_BWD_STAGES["local"][2].items() if t.startswith("*")),
                   description="GDN backward stage 2, opt-in v2 (LINATTN_GDN_BWD_LOCAL=v2): dQ, dK part, dW, gate "
                               "terms in three phases, one warpgroup, Triton, H16/HV32 K=V=128 bf16, BK=BV=64, 4 warps"))
