"""AOT registrations of the GDN Gluon state pass (gluon/): what `linattn inspect` compiles and
tests/test_aot_gluon_gdn.py checks. One entry per variant and per launch config the launcher picks
(gluon/launcher.py state_config: BV=64 when there are at least as many programs as SMs, with 2 ring stages;
BV=32 otherwise, with 3), at the production head shape H=16, HV=32, K=V=128."""
from __future__ import annotations

from linattn.runtime.aot import AotKernel, register

# intended SASS per variant: mma.sync; TMA loads + mbarriers (+ the TMA store of h); WGMMA on top of that
INTENDED = {"literal": ("HMMA",), "tma": ("HMMA", "UTMALDG", "UTMASTG", "SYNCS"),
            "wgmma": ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "WARPGROUP")}
H, HV, K, V, BT = 16, 32, 128, 128, 64
# the pointer arguments the JIT marks 16-divisible (torch allocations are 256-byte aligned)
_PTRS_LITERAL = ("k_ptr", "w_ptr", "u_ptr", "gcum_ptr", "h_ptr", "vnew_ptr", "h0_ptr", "ht_ptr", "cu_ptr",
                 "chunk_off_ptr")
_PTRS_TMA = ("gcum_ptr", "vnew_ptr", "h0_ptr", "ht_ptr", "cu_ptr", "chunk_off_ptr")


def desc_sig(dtype_name: str, block):
    """Exactly the string the JIT derives (triton.runtime.jit.mangle_type) for a Gluon TensorDescriptor."""
    from linattn.runtime.gluon_compat import gl
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    return f"tensordesc<{dtype_name}[{', '.join(map(str, block))}],{layout!r}>"


def signature(variant: str, dtype: str, BV: int):
    """The argument types of the variant's kernel as the JIT sees them for a launcher call (state_launch)."""
    common = {"gcum_ptr": "*fp32"}
    if variant == "literal":
        sig = {"k_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "u_ptr": f"*{dtype}", **common,
               "h_ptr": f"*{dtype}", "vnew_ptr": f"*{dtype}"}
    else:
        sig = {"k_desc": desc_sig(dtype, [BT, K]), "w_desc": desc_sig(dtype, [BT, K]),
               "u_desc": desc_sig(dtype, [BT, BV]), **common, "h_desc": desc_sig(dtype, [K, BV]),
               "vnew_ptr": f"*{dtype}"}
    sig.update({"h0_ptr": "*fp32", "ht_ptr": "*fp32", "cu_ptr": "*i64", "chunk_off_ptr": "*i64"})
    return sig


def _build(variant: str, dtype: str, BV: int, warps: int, stages: int):
    def build():
        constexprs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_H0=True, STORE_HT=True)
        if variant == "literal":
            from linattn.ops.gated_delta_rule.gluon.chunk_state_literal import chunk_state_fwd_literal_kernel as fn
        else:
            from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import chunk_state_fwd_tma_kernel as fn
            constexprs.update(STAGES=stages, USE_WGMMA=variant == "wgmma")
        sig = signature(variant, dtype, BV)
        sig.update({name: "constexpr" for name in constexprs})
        return fn, sig, constexprs, {"num_warps": warps}
    return build


# (variant, dtype, BV, warps, stages): the configs state_config picks for K=V=128
CONFIGS = [
    ("literal", "bf16", 64, 8, 0), ("literal", "bf16", 32, 4, 0),
    ("tma", "bf16", 64, 4, 2), ("tma", "bf16", 32, 4, 3),
    ("wgmma", "bf16", 64, 4, 2), ("wgmma", "bf16", 32, 4, 3), ("wgmma", "fp16", 64, 4, 2),
]


def kernel_name(variant: str, dtype: str, BV: int, warps: int, stages: int) -> str:
    return f"gdn_state_gluon_{variant}_{dtype}_bv{BV}_w{warps}" + (f"_s{stages}" if stages else "")


for _v, _dt, _bv, _w, _s in CONFIGS:
    register(AotKernel(
        kernel_name(_v, _dt, _bv, _w, _s), _build(_v, _dt, _bv, _w, _s), INTENDED[_v],
        div16=_PTRS_LITERAL if _v == "literal" else _PTRS_TMA,
        description=f"GDN forward state pass, Gluon '{_v}', K=V=128 {_dt}, BV={_bv}, {_w} warps"
                    + (f", {_s}-stage TMA ring" if _s else "")))


# ---- GDN decode step in Gluon (gluon/decode.py, issue 6): TMA ring in, TMA store out, mbarrier phases.
# Appended by the decode engineer; the configs are gluon/decode.py's AOT_CONFIGS (the launcher's defaults and
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


# ---- Backward stage 1 (the reverse state pass) in Gluon (gluon/chunk_state_bwd.py, LINATTN_GDN_GLUON_BWD_DH=1,
# benchmarks/GLUON_BWD_DH.md): q, k, w, dO, dVnew tiles by TMA into a STAGES-deep mbarrier ring (reverse chunk
# order), three wgmma products per chunk (dVnew with the decayed K as register A operand; dS with Q^T dO and W^T
# dVnew from shared memory), dh[chunk] by a TMA store. One warpgroup. Configs: the launcher's (state_bwd_config:
# BV=32 with 3 stages at B=1 H16/HV32, BV=64 with 2 stages at B >= 3), and the GPU round's sweep (BV=32 with 1 stage
# fits 2 CTAs per SM). dht fp32 (any float dtype is accepted; the gradient of an fp32 final state is fp32).
BWD_DH_INTENDED = ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "WARPGROUP")
BWD_DH_DIV16 = ("gcum_ptr", "dvnew_ptr", "dht_ptr", "dh0_ptr", "cu_ptr", "chunk_off_ptr")
BWD_DH_CONFIGS = [  # (dtype, BV, warps, stages); the first three are what state_bwd_config picks
    ("bf16", 32, 4, 3), ("bf16", 64, 4, 2), ("fp16", 64, 4, 2),
    ("bf16", 32, 4, 2), ("bf16", 32, 4, 1), ("bf16", 64, 4, 1),
]


def bwd_dh_signature(dtype: str, BV: int):
    """The argument types of chunk_state_bwd_tma_kernel as the JIT sees them for a state_bwd_launch call."""
    return {"q_desc": desc_sig(dtype, [BT, K]), "k_desc": desc_sig(dtype, [BT, K]), "w_desc": desc_sig(dtype, [BT, K]),
            "do_desc": desc_sig(dtype, [BT, BV]), "dv_desc": desc_sig(dtype, [BT, BV]), "gcum_ptr": "*fp32",
            "dh_desc": desc_sig(dtype, [K, BV]), "dvnew_ptr": f"*{dtype}", "dht_ptr": "*fp32", "dh0_ptr": "*fp32",
            "cu_ptr": "*i64", "chunk_off_ptr": "*i64", "scale": "fp32"}


def bwd_dh_kernel_name(dtype: str, BV: int, warps: int, stages: int) -> str:
    return f"gdn_bwd_dh_gluon_{dtype}_bv{BV}_w{warps}_s{stages}"


def _bwd_dh_build(dtype: str, BV: int, warps: int, stages: int):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import chunk_state_bwd_tma_kernel as fn
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=True, STORE_DH0=True, STAGES=stages)
        sig = bwd_dh_signature(dtype, BV)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": warps}
    return build


for _dt, _bv, _w, _s in BWD_DH_CONFIGS:
    register(AotKernel(
        bwd_dh_kernel_name(_dt, _bv, _w, _s), _bwd_dh_build(_dt, _bv, _w, _s), BWD_DH_INTENDED, div16=BWD_DH_DIV16,
        description=f"GDN backward stage 1 (reverse state pass), Gluon TMA ring + wgmma, H16/HV32 K=V=128 {_dt}, "
                    f"BV={_bv}, {_w} warps, {_s}-stage ring"))


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


# ---- The segment warm-up scheme on the Gluon TMA state pass (gluon/chunk_state_warmup_tma.py; opt-in
# LINATTN_GDN_SEGMENT_WARMUP=1 on the gluon backend, benchmarks/GLUON_WARMUP.md): chunk_state_fwd_tma_kernel's ring
# and products on a (V // BV, S * N * HV) grid, each program's warm-up window found on the device. Configs: the
# launcher's (chunk_state_warmup_tma.warmup_config: the plain pass's BV, 4 warps, 2 stages: 2 CTAs per SM) and the
# GPU round's sweep (1 and 3 stages; the "tma" variant). Their registers and shared memory are
# chunk_state_warmup_tma.AOT_USAGE, from which the segment count takes the residency (tests/test_gluon_state_warmup.py).
GLUON_WARMUP_CONFIGS = [  # (variant, dtype, BV, warps, stages)
    ("wgmma", "bf16", 32, 4, 2), ("wgmma", "bf16", 64, 4, 2), ("wgmma", "bf16", 32, 4, 1), ("wgmma", "bf16", 32, 4, 3),
    ("tma", "bf16", 32, 4, 2), ("tma", "bf16", 64, 4, 2),
]


def gluon_warmup_signature(variant: str, dtype: str, BV: int):
    """The argument types of chunk_state_warmup_tma_kernel for a warmup_launch call: the plain TMA kernel's, then N,
    the segment length and the threshold."""
    return dict(signature(variant, dtype, BV), N="i32", seg_chunks="i32", thresh="fp32")


def gluon_warmup_kernel_name(variant: str, dtype: str, BV: int, warps: int, stages: int) -> str:
    return f"gdn_fwd_gluon_state_warmup_{variant}_{dtype}_bv{BV}_w{warps}_s{stages}"


def _gluon_warmup_build(variant: str, dtype: str, BV: int, warps: int, stages: int):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_state_warmup_tma import chunk_state_warmup_tma_kernel as fn
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_H0=True, STORE_HT=True, STAGES=stages,
                     USE_WGMMA=variant == "wgmma")
        sig = gluon_warmup_signature(variant, dtype, BV)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": warps}
    return build


for _v, _dt, _bv, _w, _s in GLUON_WARMUP_CONFIGS:
    register(AotKernel(
        gluon_warmup_kernel_name(_v, _dt, _bv, _w, _s), _gluon_warmup_build(_v, _dt, _bv, _w, _s), INTENDED[_v],
        div16=_PTRS_TMA,
        description=f"GDN forward state pass with segment warm-ups, Gluon '{_v}', K=V=128 {_dt}, BV={_bv}, "
                    f"{_w} warps, {_s}-stage TMA ring"))


# ---- Stages 3 + 4 of the forward fused in one warp-specialised Gluon kernel (gluon/chunk_fused_ws.py,
# LINATTN_GDN_GLUON_FUSED_WS=1, benchmarks/GLUON_FUSED_WS.md): a 1-warp TMA producer (q, k, w, u ring), the state
# chain (default partition, 1 warpgroup) publishing S_c and vnew_c in shared memory, the output (1 warpgroup).
# Configs: fused_ws_config's (BV=32 with a 3-stage ring at B=1 H16/HV32, BV=64 with 2 stages at B >= 3), fp16, and
# the optional h/vnew stores (STORE_H, STORE_VNEW) that the forward does not use.
FUSED_WS_INTENDED = ("HGMMA", "UTMALDG", "SYNCS", "WARPGROUP")
FUSED_WS_DIV16 = ("gcum_ptr", "o_ptr", "vnew_ptr", "h0_ptr", "ht_ptr", "cu_ptr", "chunk_off_ptr")
FUSED_WS_CONFIGS = [  # (dtype, BV, stages, store_h_vnew); the first two are what fused_ws_config picks
    ("bf16", 32, 3, False), ("bf16", 64, 2, False), ("fp16", 64, 2, False), ("bf16", 32, 3, True),
]


def fused_ws_signature(dtype: str, BV: int, store: bool, states: bool = True):
    """The argument types of chunk_fused_ws_kernel as the JIT sees them for a fused_ws_launch call (None -> constexpr)."""
    return {"q_desc": desc_sig(dtype, [BT, K]), "k_desc": desc_sig(dtype, [BT, K]), "w_desc": desc_sig(dtype, [BT, K]),
            "u_desc": desc_sig(dtype, [BT, BV]), "gcum_ptr": "*fp32", "o_ptr": f"*{dtype}",
            "h_desc": desc_sig(dtype, [K, BV]) if store else "constexpr", "vnew_ptr": f"*{dtype}" if store else "constexpr",
            "h0_ptr": "*fp32" if states else "constexpr", "ht_ptr": "*fp32" if states else "constexpr",
            "cu_ptr": "*i64", "chunk_off_ptr": "*i64", "scale": "fp32"}


def fused_ws_kernel_name(dtype: str, BV: int, stages: int, store: bool) -> str:
    return f"gdn_fwd_fused_ws_gluon_{dtype}_bv{BV}_s{stages}" + ("_store_h_vnew" if store else "")


def _fused_ws_build(dtype: str, BV: int, stages: int, store: bool):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_fused_ws import (NPUB, OUTPUT_REGS, PRODUCER_REGS,
                                                                       chunk_fused_ws_kernel as fn)
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, STAGES=stages, NPUB=NPUB, USE_H0=True, STORE_HT=True,
                     STORE_H=store, STORE_VNEW=store, OUTPUT_REGS=OUTPUT_REGS, PRODUCER_REGS=PRODUCER_REGS)
        if not store:
            const.update(h_desc=None, vnew_ptr=None)
        sig = fused_ws_signature(dtype, BV, store)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": 4}
    return build


for _dt, _bv, _s, _st in FUSED_WS_CONFIGS:
    register(AotKernel(
        fused_ws_kernel_name(_dt, _bv, _s, _st), _fused_ws_build(_dt, _bv, _s, _st),
        FUSED_WS_INTENDED + (("UTMASTG",) if _st else ()),
        div16=tuple(n for n in FUSED_WS_DIV16 if _st or n != "vnew_ptr"),
        description=f"GDN forward stages 3+4 fused, warp-specialised Gluon (TMA producer warp, state warpgroup, output "
                    f"warpgroup), H16/HV32 K=V=128 {_dt}, BV={_bv}, {_s}-stage ring"
                    + (", h and vnew stored" if _st else "")))


# ---- Stages 2b + 3 + 4 of the forward in one warp-specialised Gluon kernel that forms W and U itself from kkt_solve's
# Tinv (gluon/chunk_fused_wu_ws.py, benchmarks/GLUON_FUSED_WU.md; opt-in, not yet wired): a 1-warp TMA producer (q,
# k, v, Tinv ring), the wu warpgroup (W, U by wgmma into shared buffers), the state chain and the output warpgroups.
# Configs: fused_wu_config's (BV=32 with a 3-stage ring at B=1 H16/HV32, BV=64 with 2 stages at B >= 3) and fp16.
FUSED_WU_INTENDED = ("HGMMA", "UTMALDG", "SYNCS", "WARPGROUP")
FUSED_WU_DIV16 = ("beta_ptr", "gcum_ptr", "o_ptr", "h0_ptr", "ht_ptr", "cu_ptr", "chunk_off_ptr")
FUSED_WU_CONFIGS = [  # (dtype, BV, stages); the first two are what fused_wu_config picks
    ("bf16", 32, 3), ("bf16", 64, 2), ("fp16", 64, 2),
]


def fused_wu_signature(dtype: str, BV: int, states: bool = True, beta: str = "fp32", select: bool = False,
                       warm: bool = False):
    """The argument types of chunk_fused_wu_ws_kernel as the JIT sees them for a fused_wu_launch call (None ->
    constexpr for absent states and selection; beta in its own dtype, fp32 from make_gdn_inputs and the api's
    callers)."""
    return {"q_desc": desc_sig(dtype, [BT, K]), "k_desc": desc_sig(dtype, [BT, K]), "v_desc": desc_sig(dtype, [BT, BV]),
            "t_desc": desc_sig(dtype, [BT, BT]), "beta_ptr": f"*{beta}", "gcum_ptr": "*fp32", "o_ptr": f"*{dtype}",
            "h0_ptr": "*fp32" if states else "constexpr", "ht_ptr": "*fp32" if states else "constexpr",
            "cu_ptr": "*i64", "chunk_off_ptr": "*i64", "scale": "fp32", "sel_ptr": "*i32" if select else "constexpr",
            "seg_ptr": "*i32" if warm else "constexpr"}


def fused_wu_kernel_name(dtype: str, BV: int, stages: int, areg: bool = False, regs=None, out_pipe: bool = False,
                         select: bool = False, warm: bool = False) -> str:
    return (f"gdn_fwd_fused_wu_ws_gluon_{dtype}_bv{BV}_s{stages}" + ("_areg" if areg else "")
            + ("_opipe" if out_pipe else "") + (f"_o{regs[0]}_w{regs[1]}" if regs else "") + ("_sel" if select else "")
            + ("_warm" if warm else ""))


def _fused_wu_build(dtype: str, BV: int, stages: int, areg: bool = False, regs=None, out_pipe: bool = False,
                    select: bool = False, warm: bool = False):
    """regs: (OUTPUT_REGS, WU_REGS) in place of the module's (a config's output_regs / wu_regs); select: with the
    per-(sequence, head) selection the segment-parallel forward passes (sel_ptr); warm: the segment launch, with the
    segment words (seg_ptr: each segment's warm-up runs in the kernel)."""
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (NPUB, NWU, OUTPUT_REGS, PRODUCER_REGS,
                                                                          WU_REGS, chunk_fused_wu_ws_kernel as fn)
        out_regs, wu_regs = regs or (OUTPUT_REGS, WU_REGS)
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, STAGES=stages, NWU=NWU, NPUB=NPUB, USE_H0=True,
                     STORE_HT=True, OUTPUT_REGS=out_regs, WU_REGS=wu_regs, PRODUCER_REGS=PRODUCER_REGS,
                     WU_AREG=areg, OUT_PIPE=out_pipe)
        if not select:
            const["sel_ptr"] = None
        if not warm:
            const["seg_ptr"] = None
        sig = fused_wu_signature(dtype, BV, select=select, warm=warm)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": 4}
    return build


for _dt, _bv, _s in FUSED_WU_CONFIGS:
    register(AotKernel(
        fused_wu_kernel_name(_dt, _bv, _s), _fused_wu_build(_dt, _bv, _s), FUSED_WU_INTENDED, div16=FUSED_WU_DIV16,
        description=f"GDN forward stages 2b+3+4 fused, warp-specialised Gluon (TMA producer warp, W/U warpgroup, state "
                    f"warpgroup, output warpgroup), H16/HV32 K=V=128 {_dt}, BV={_bv}, {_s}-stage ring"))

# The same kernel with WU_AREG (the default since round 16 at BV=32, since round 17 at BV=64; LINATTN_GDN_GLUON_WU_AREG=0
# off): the wu warpgroup scales Tinv's columns in registers and multiplies it as wgmma's register A operand against the
# ring's k and v tiles. BV=32 without OUT_PIPE (LINATTN_GDN_GLUON_OUT_PIPE=0); BV=64 as fused_wu_config takes it, with
# the output / wu warpgroups at 136 / 192 registers (state 160; at the default 160 / 152 the wu warpgroup spills 24
# bytes), bf16 and fp16.
FUSED_WU_AREG_CONFIGS = [("bf16", 32, 3, None), ("bf16", 64, 2, (136, 192)), ("fp16", 64, 2, (136, 192))]
for _dt, _bv, _s, _regs in FUSED_WU_AREG_CONFIGS:
    register(AotKernel(
        fused_wu_kernel_name(_dt, _bv, _s, areg=True, regs=_regs), _fused_wu_build(_dt, _bv, _s, areg=True, regs=_regs),
        FUSED_WU_INTENDED, div16=FUSED_WU_DIV16,
        description=f"GDN forward stages 2b+3+4 fused, W/U with Tinv as wgmma's register A operand (WU_AREG), "
                    f"H16/HV32 K=V=128 {_dt}, BV={_bv}, {_s}-stage ring"
                    + (f", output / wu warpgroups at {_regs[0]} / {_regs[1]} registers" if _regs else "")))

# OUT_PIPE (the BV=32 default since round 17; LINATTN_GDN_GLUON_OUT_PIPE=0 off): the output warpgroup issues chunk c + 1's q k^T before
# chunk c's gate work (chunk_fused_wu_ws._output_pipelined). On top of WU_AREG, as fused_wu_config takes it.
# BV=64 with OUT_PIPE is a sweep row of the gluon_fused_wu round (taken by fused_wu_config only with the opt-in LINATTN_GDN_GLUON_OUT_PIPE64=1: round 18, 1.05x at B8, 0.97x at B4), at the
# only split of a register sweep that compiles without spill: output / wu 152 / 176, state 160 (168 / 160: 96 bytes,
# 160 / 168: 8, 176 / 152: 4).
# BV=16 (the default since round 21 where N * HV * V / 16 programs still fit the SMs, B1-B2 at HV8;
# LINATTN_GDN_GLUON_BV16=0 off): the BV=32 default's config at 16 columns.
FUSED_WU_OPIPE_CONFIGS = [("bf16", 32, 3, (160, 160)), ("bf16", 64, 2, (152, 176)), ("bf16", 16, 3, (160, 160))]
for _dt, _bv, _s, _regs in FUSED_WU_OPIPE_CONFIGS:
    register(AotKernel(
        fused_wu_kernel_name(_dt, _bv, _s, areg=True, regs=_regs, out_pipe=True),
        _fused_wu_build(_dt, _bv, _s, areg=True, regs=_regs, out_pipe=True),
        FUSED_WU_INTENDED, div16=FUSED_WU_DIV16,
        description=f"GDN forward stages 2b+3+4 fused, WU_AREG and the output warpgroup's q k^T one chunk ahead "
                    f"(OUT_PIPE), H16/HV32 K=V=128 {_dt}, BV={_bv}, {_s}-stage ring"
                    + (f", output / wu warpgroups at {_regs[0]} / {_regs[1]} registers" if _regs else "")))


# The fused-wu launches of the segment-parallel forward (chunk_fused_wu_ws.chunk_gated_delta_rule_fwd_fused_wu): with
# the per-(sequence, head) selection sel_ptr, the W/U segments at BV=64 (WU_AREG, 136 / 192; opt-in
# LINATTN_GDN_GLUON_SEGMENTS=1) and the unsegmented heads at BV=32 or, where N * HV * 8 CTAs fit the SMs (H2/HV8 B1-B2),
# BV=16 (OUT_PIPE, 160 / 160), as fused_wu_config takes them.
FUSED_WU_SEL_CONFIGS = [("bf16", 32, 3, (160, 160), True), ("bf16", 64, 2, (136, 192), False),
                        ("bf16", 16, 3, (160, 160), True)]
for _dt, _bv, _s, _regs, _op in FUSED_WU_SEL_CONFIGS:
    register(AotKernel(
        fused_wu_kernel_name(_dt, _bv, _s, areg=True, regs=_regs, out_pipe=_op, select=True),
        _fused_wu_build(_dt, _bv, _s, areg=True, regs=_regs, out_pipe=_op, select=True),
        FUSED_WU_INTENDED, div16=FUSED_WU_DIV16 + ("sel_ptr",),
        description=f"GDN forward stages 2b+3+4 fused with a per-(sequence, head) selection (the segment-parallel "
                    f"forward's two launches), WU_AREG" + (" and OUT_PIPE" if _op else "")
                    + f", H16/HV32 K=V=128 {_dt}, BV={_bv}, {_s}-stage ring, output / wu warpgroups at "
                    f"{_regs[0]} / {_regs[1]} registers"))
# The segment launch with the warm-up in the kernel (opt-in LINATTN_GDN_GLUON_SEGMENTS=1): seg_ptr
# (segment words), sel_ptr indexed by the whole sequence, h0 / the final state gated by the word.
register(AotKernel(
    fused_wu_kernel_name("bf16", 64, 2, areg=True, regs=(136, 192), select=True, warm=True),
    _fused_wu_build("bf16", 64, 2, areg=True, regs=(136, 192), select=True, warm=True),
    FUSED_WU_INTENDED, div16=FUSED_WU_DIV16 + ("sel_ptr", "seg_ptr"),
    description="GDN forward stages 2b+3+4 fused, the segment launch with each segment's warm-up in the kernel "
                "(seg_ptr: the chain starts wl chunks early, o not stored there, h0 / final gated by the segment "
                "word), WU_AREG, H16/HV32 K=V=128 bf16, BV=64, 2-stage ring, output / wu warpgroups at 136 / 192 "
                "registers"))


# ---- Stages 2b + 3 + 4 at BV = 128 in the gate-free form (gluon/chunk_fused_gf.py, benchmarks/GLUON_BV128.md; the
# gluon forward's default since round 22 where chunk_fused_gf.gf_wanted holds): one CTA per (sequence, value head),
# three partitions (state, output, TMA producer; the state2 builds below: two state partitions), Vnew = Tinv diag(beta)
# (V - diag(e^gam) K S) with no W and no U.
def fused_gf_signature(dtype: str, states: bool = True, beta: str = "fp32", select: bool = False,
                       warm: bool = False):
    return fused_wu_signature(dtype, 128, states=states, beta=beta, select=select, warm=warm)


def _fused_gf_build(dtype: str, output_regs=None, out_pipe: bool = True, warm: bool = False, ks_pipe: bool = False,
                    state2: bool = False, gate_at: int = 0, state_t: bool = False, release_fence: bool = True):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_BV, GF_NPUB, GF_OUTPUT_REGS, GF_SPLIT,
                                                                       GF_STAGES, GF_STATE2_OUTPUT_REGS,
                                                                       GF_STATE2_SPLIT, GF_STATE2_STATE_REGS,
                                                                       PRODUCER_REGS, chunk_fused_gf_kernel as fn)
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=GF_BV, STAGES=GF_STAGES, NPUB=GF_NPUB, USE_H0=True,
                     STORE_HT=True, OUTPUT_REGS=output_regs or GF_OUTPUT_REGS, PRODUCER_REGS=PRODUCER_REGS,
                     OUT_PIPE=out_pipe, SPLIT=GF_SPLIT, KS_PIPE=ks_pipe, STATE_WGS=1, STATE_REGS=0, GATE_AT=gate_at,
                     STATE_T=state_t, RELEASE_FENCE=release_fence)
        if not warm:                   # the segment launch has both, the plain launch neither
            const.update(sel_ptr=None, seg_ptr=None)
        if state2:                     # two state partitions (LINATTN_GDN_GLUON_GF_STATE2)
            const.update(OUTPUT_REGS=GF_STATE2_OUTPUT_REGS, SPLIT=GF_STATE2_SPLIT, STATE_WGS=2,
                         STATE_REGS=GF_STATE2_STATE_REGS)
        if state_t:                    # transposed state partitions (LINATTN_GDN_GLUON_GF_STATE_T)
            from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_STATE_T_OUTPUT_REGS,
                                                                           GF_STATE_T_STATE_REGS)
            const.update(OUTPUT_REGS=GF_STATE_T_OUTPUT_REGS, STATE_REGS=GF_STATE_T_STATE_REGS)
        sig = fused_gf_signature(dtype, select=warm, warm=warm)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": 4}
    return build


for _dt in ("bf16", "fp16"):
    register(AotKernel(
        f"gdn_fwd_fused_gf_gluon_{_dt}_bv128", _fused_gf_build(_dt), FUSED_WU_INTENDED, div16=FUSED_WU_DIV16,
        description=f"GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form (no W, no U: Vnew = Tinv "
                    f"diag(beta) (V - diag(e^gam) K S)), warp-specialised Gluon (TMA producer warp, state warpgroup, "
                    f"output warpgroup with q k^T one chunk ahead), H16/HV32 K=V=128 {_dt}, 2-stage ring"))

# The segment launch of the gate-free kernel (the segment-parallel forward at BV=128, chunk_fused_wu_ws._segments with
# the gate-free segment plan): seg_ptr (segment words: the warm-up chunks run in the kernel, o not stored there, h0 /
# the final state gated by the word) and sel_ptr indexed by the whole sequence (its pairs run unsegmented elsewhere).
register(AotKernel(
    "gdn_fwd_fused_gf_gluon_bf16_bv128_warm", _fused_gf_build("bf16", warm=True), FUSED_WU_INTENDED,
    div16=FUSED_WU_DIV16 + ("sel_ptr", "seg_ptr"),
    description="GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form, the segment launch with each "
                "segment's warm-up in the kernel (seg_ptr, sel_ptr), H16/HV32 K=V=128 bf16, 2-stage ring"))

# KS_PIPE (the plain launch's default since round 23, LINATTN_GDN_GLUON_GF_KS_PIPE): product 1's halves pipelined in
# the state warpgroup, the output warpgroup at 232 registers (8 bytes of spill at 240); the segment launch with it
# ("1" only).
for _dt, _warm in (("bf16", False), ("fp16", False), ("bf16", True)):
    register(AotKernel(
        f"gdn_fwd_fused_gf_gluon_{_dt}_bv128_kspipe" + ("_warm" if _warm else ""),
        _fused_gf_build(_dt, output_regs=232, warm=_warm, ks_pipe=True), FUSED_WU_INTENDED,
        div16=FUSED_WU_DIV16 + (("sel_ptr", "seg_ptr") if _warm else ()),
        description=f"GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form with product 1's column halves "
                    f"pipelined (KS_PIPE), output warpgroup at 232 registers, H16/HV32 K=V=128 {_dt}"
                    + (", the segment launch" if _warm else "")))

# Two state partitions (LINATTN_GDN_GLUON_GF_STATE2, round 24): each holds the [128, 64] half of S's columns, four
# warpgroups (output 176, worker state 152, the default state Gluon's remainder); plain and segment launch, each with
# and without KS_PIPE.
for _warm, _ksp in ((False, False), (False, True), (True, False), (True, True)):
    register(AotKernel(
        "gdn_fwd_fused_gf_gluon_bf16_bv128_state2" + ("_kspipe" if _ksp else "") + ("_warm" if _warm else ""),
        _fused_gf_build("bf16", warm=_warm, ks_pipe=_ksp, state2=True), FUSED_WU_INTENDED,
        div16=FUSED_WU_DIV16 + (("sel_ptr", "seg_ptr") if _warm else ()),
        description="GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form with two state partitions of 64 "
                    "columns each (STATE_WGS=2)" + (", KS_PIPE" if _ksp else "") + ", H16/HV32 K=V=128 bf16"
                    + (", the segment launch" if _warm else "")))

# GATE_AT (round 28, LINATTN_GDN_GLUON_GF_GATE_AT): the default builds (two state partitions, KS_PIPE, plain and
# segment launch) with the next chunk's gate loads issued after S's publication (1) or after x's fence (2).
for _warm in (False, True):
    for _at in (1, 2):
        register(AotKernel(
            f"gdn_fwd_fused_gf_gluon_bf16_bv128_state2_kspipe_gate{_at}" + ("_warm" if _warm else ""),
            _fused_gf_build("bf16", warm=_warm, ks_pipe=True, state2=True, gate_at=_at), FUSED_WU_INTENDED,
            div16=FUSED_WU_DIV16 + (("sel_ptr", "seg_ptr") if _warm else ()),
            description=f"GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form, two state partitions, "
                        f"KS_PIPE, the next chunk's gates loaded after "
                        + ("S's publication" if _at == 1 else "x's fence") + " (GATE_AT=%d)" % _at
                        + (", the segment launch" if _warm else "") + ", H16/HV32 K=V=128 bf16"))

# RELEASE_FENCE off (round 28, LINATTN_GDN_GLUON_GF_RELEASE_FENCE=0): the default builds without the fence before
# the state partitions release their ring slot.
for _warm in (False, True):
    register(AotKernel(
        "gdn_fwd_fused_gf_gluon_bf16_bv128_state2_kspipe_nofence" + ("_warm" if _warm else ""),
        _fused_gf_build("bf16", warm=_warm, ks_pipe=True, state2=True, release_fence=False), FUSED_WU_INTENDED,
        div16=FUSED_WU_DIV16 + (("sel_ptr", "seg_ptr") if _warm else ()),
        description="GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form, two state partitions, KS_PIPE, "
                    "no fence before the ring slot's release" + (", the segment launch" if _warm else "")
                    + ", H16/HV32 K=V=128 bf16"))

# known spill (sm_90a): two values per state partition kept in local memory in the loop, one prologue value across
# the partitions' dispatch (chunk_fused_gf.GF_STATE_T_OUTPUT_REGS); an opt-in kernel under measurement
_STATE_T_SPILL = {False: 16, True: 8}
# STATE_T (round 28, LINATTN_GDN_GLUON_GF_STATE_T): the two state partitions hold S^T and take every product's A
# operand from registers (chunk_fused_gf._gf_state_t); plain and segment launch.
for _warm in (False, True):
    register(AotKernel(
        "gdn_fwd_fused_gf_gluon_bf16_bv128_state2t" + ("_warm" if _warm else ""),
        _fused_gf_build("bf16", warm=_warm, ks_pipe=True, state2=True, state_t=True), FUSED_WU_INTENDED,
        div16=FUSED_WU_DIV16 + (("sel_ptr", "seg_ptr") if _warm else ()), known_spill_bytes=_STATE_T_SPILL[_warm],
        description="GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form, two state partitions holding "
                    "S^T (every product's A operand in registers, STATE_T)" + (", the segment launch" if _warm else "")
                    + ", H16/HV32 K=V=128 bf16"))

# ---- Stage 2a in Gluon (gluon/kkt_solve.py, opt-in LINATTN_GDN_GLUON_KKT=<form>): one program per (chunk slot, key
# head), the key tile by TMA, K K^T once per key head by warpgroup_mma, then the HV / H value heads' block substitution
# on mma.sync (kkt_solve_v4's arithmetic); "persist": a persistent grid with the next item's key tile loaded meanwhile;
# "shift" / "split" / "ftz": round 26's instruction cuts, each on top of the one before (kkt_solve.FORMS).
def kkt_gluon_signature(dtype: str = "bf16"):
    return {"k_desc": desc_sig(dtype, [BT, K]), "g_ptr": "*fp32", "beta_ptr": "*fp32", "gcum_ptr": "*fp32",
            "tinv_ptr": f"*{dtype}", "cu_ptr": "*i64", "chunk_idx_ptr": "*i32", "N": "i32", "num_items": "i32",
            "seq_len": "i32"}


def _kkt_gluon_build(dtype: str, form: str, maxnreg=None):
    def build():
        from linattn.ops.gated_delta_rule.gluon.kkt_solve import KKT_WARPS, kernel_switches, kkt_solve_gluon_kernel
        const = dict(H=H, HV=HV, K=K, BT=BT, **kernel_switches(form))
        sig = kkt_gluon_signature(dtype)
        sig.update({name: "constexpr" for name in const})
        return kkt_solve_gluon_kernel, sig, const, {"num_warps": KKT_WARPS, **({"maxnreg": maxnreg} if maxnreg else {})}
    return build


# (form, register cap, known spill). The plain form at its launch default (kkt_solve.DEFAULT_MAXNREG: 80, chosen on the
# H200 in round 25 for 6 CTAs per SM; ptxas keeps 16 bytes of loop-invariant values in local memory there, measured
# faster than the 130-register build without them, OPT_LOG 25.1) and uncapped; the persistent form uncapped; round
# 26's forms at the same cap (24 / 12 / 16 bytes of such spill) and "ftz" uncapped (0)
for _form, _cap, _spill in (("plain", 80, 16), ("plain", None, 0), ("persist", None, 0), ("shift", 80, 24),
                            ("split", 80, 12), ("ftz", 80, 16), ("ftz", None, 0), ("early", 80, 20),
                            ("direct", 80, 20)):
    register(AotKernel(
        "gdn_fwd_kkt_solve_gluon_bf16" + ("" if _form == "plain" else f"_{_form}") + (f"_r{_cap}" if _cap else ""),
        _kkt_gluon_build("bf16", _form, _cap), ("HGMMA", "UTMALDG", "HMMA"),
        div16=("g_ptr", "beta_ptr", "gcum_ptr", "tinv_ptr", "cu_ptr", "chunk_idx_ptr"), known_spill_bytes=_spill,
        description="GDN forward stage 2a in Gluon: K K^T once per key head (TMA, warpgroup_mma), each value head's "
                    "Tinv by block substitution on mma.sync, H16/HV32 K=128 bf16"
                    + {"plain": "", "persist": ", persistent with the next key tile in flight"}.get(
                        _form, f", form {_form} (kkt_solve.FORMS)")
                    + (f", registers capped at {_cap}" if _cap else "")))
