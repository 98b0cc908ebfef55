"""AOT registrations of KDA's Triton kernels (`linattn inspect`; linattn/runtime/aot.py imports this module): its
own stage 2a and local backward kernels, and GDN's shared stages in their per-key-channel form (DECAY "channel"), at
the configs KDA's launchers pick for H16/HV32, K = V = 128, bf16. KDA's own kernels walk the key row in blocks
(INTRA_BK, WY_BK, PAIR_BK channels), which keeps each build free of spills (ptxas, Triton 3.6.0, sm_90a) except the
WY kernel's 112 bytes (at the 3 pipelining stages it runs with), kept because its 32-channel blocks run faster than
16 spill-free ones; the test of the registry (tests/test_aot_gluon.py) fails any build that spills more than
registered or lacks its HGMMA. The backward's local kernels are built with the stages their launches use."""
from __future__ import annotations

from linattn.ops.kda.triton.backward import (DG_BK, GVA_SUM_ROWS, PAIR_BK, PAIR_STAGES, PAIR_WARPS, WY_BK, WY_STAGES,
                                             WY_WARPS)
from linattn.ops.kda.triton.forward import CUMSUM_BK, DIAG_BH, INTRA_BK
from linattn.runtime.aot import AotKernel, register

H, HV, K, V, BT = 16, 32, 128, 128, 64
_X, _F, _I64, _I32 = "*bf16", "*fp32", "*i64", "*i32"
_DEFAULT_STAGES = 3         # the kernels whose launches pass no num_stages run with Triton's default


def _build(mod: str, kname: str, sig: dict, const: dict, warps: int, stages: int):
    def build():
        import importlib
        fn = getattr(importlib.import_module(mod), kname)
        return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": warps, "num_stages": stages}
    return build


def _register(name, mod, kname, sig, const, warps, stages, what, intended=("HGMMA",), known_spill_bytes=0):
    register(AotKernel(name, _build(mod, kname, sig, const, warps, stages), intended, archs=("sm_90a",),
                       language="triton", known_spill_bytes=known_spill_bytes,
                       div16=tuple(n for n, t in sig.items() if t.startswith("*")),
                       description=f"KDA {what}, Triton, H16/HV32 K=V=128 bf16, {warps} warps"))


_GDN = "linattn.ops.gated_delta_rule.triton"
_register("kda_fwd_triton_cumsum_w4", "linattn.ops.kda.triton.intra", "kda_cumsum_kernel",
          dict(q_ptr=_X, k_ptr=_X, g_ptr=_F, beta_ptr=_F, gcum_ptr=_F, beta_out_ptr=_F, kdec_ptr=_X, qdec_ptr=_X,
               pairwise_ptr="*i8", cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32"),
          dict(A_log=None, dt_bias=None, H=H, HV=HV, K=K, BT=BT, BK=CUMSUM_BK, GATE="", HAS_DT_BIAS=False,
               LOWER_BOUND=0.0, BETA_SIGMOID=False, NEG_EIGVAL=False), 4, _DEFAULT_STAGES,
          "forward stage 2a (1/3): gates' cumsum, effective beta, decayed keys and queries, pairwise flag",
          intended=("LDG",))
_register(f"kda_fwd_triton_diag_w{DIAG_BH}", "linattn.ops.kda.triton.intra", "kda_diag_kernel",
          dict(q_ptr=_X, k_ptr=_X, gcum_ptr=_F, pairwise_ptr="*i8", akkd_ptr=_F, aqkd_ptr=_F, cu_ptr=_I64,
               chunk_idx_ptr=_I32, N="i32"),
          dict(H=H, HV=HV, K=K, BT=BT, BK=K, BH=DIAG_BH, FTZ=True), DIAG_BH, _DEFAULT_STAGES,
          "forward stage 2a (2/3): in-block pairs of Akk / Aqk token by token, chunks flagged pairwise",
          intended=("LDG",))
_register("kda_fwd_triton_inter_solve_w4", "linattn.ops.kda.triton.intra", "kda_inter_solve_kernel",
          dict(q_ptr=_X, k_ptr=_X, gcum_ptr=_F, beta_eff_ptr=_F, pairwise_ptr="*i8", akkd_ptr=_F, aqkd_ptr=_F,
               tinv_ptr=_X, aqk_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32"),
          dict(H=H, HV=HV, K=K, BT=BT, BK=INTRA_BK, DOT_PREC="tf32", FTZ=True), 4, _DEFAULT_STAGES,
          "forward stage 2a (3/3): Akk / Aqk through each block's first row, Tinv")
_register("kda_fwd_triton_wu_w4", f"{_GDN}.intra_split", "wu_kernel",
          dict(k_ptr=_X, v_ptr=_X, beta_ptr=_F, gcum_ptr=_F, tinv_ptr=_X, w_ptr=_X, u_ptr=_X, cu_ptr=_I64,
               chunk_idx_ptr=_I32, N="i32"),
          dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, DOT_PREC="tf32", DECAY="channel"), 4, _DEFAULT_STAGES,
          "forward stage 2b: W and U, per-channel decay")
_register("kda_fwd_triton_state_w4", f"{_GDN}.chunk_state", "chunk_state_fwd_kernel",
          dict(k_ptr=_X, w_ptr=_X, u_ptr=_X, gcum_ptr=_F, h_ptr=_X, vnew_ptr=_X, h0_ptr=_F, ht_ptr=_F, cu_ptr=_I64,
               chunk_off_ptr=_I64),
          dict(H=HV, HV=HV, K=K, V=V, BT=BT, BK=K, BV=32, DOT_PREC="tf32", USE_H0=True, STORE_HT=True,
               V_FIRST=False, DECAY="channel"), 4, 2, "forward stage 3: state pass, per-channel decay")
_register("kda_fwd_triton_output_w8", f"{_GDN}.chunk_output", "chunk_output_kernel",
          dict(q_ptr=_X, k_ptr=_X, vnew_ptr=_X, h_ptr=_X, gcum_ptr=_F, o_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32,
               chunk_off_ptr=_I64, N="i32", scale="fp32", aqk_ptr=_X),
          dict(H=HV, HV=HV, K=K, V=V, BT=BT, BK=64, BV=128, DOT_PREC="tf32", DECAY="channel"), 8, 2,
          "forward stage 4: output from the decayed queries and Aqk")
_register("kda_bwd_triton_recompute_wu_w4", "linattn.ops.kda.triton.intra", "kda_recompute_wu_kernel",
          dict(q_ptr=_X, k_ptr=_X, v_ptr=_X, gcum_ptr=_F, beta_eff_ptr=_F, tinv_ptr=_X, kdec_ptr=_X, qdec_ptr=_X,
               w_ptr=_X, u_ptr=_X, pairwise_ptr="*i8", cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32"),
          dict(H=HV, HV=HV, K=K, V=V, BT=BT, BK=32, BV=64, DOT_PREC="tf32"), 4, _DEFAULT_STAGES,
          "backward stage 0: the decayed keys and queries, the pairwise flags, W and U from the saved gcum, beta, Tinv")
_register("kda_bwd_triton_dv_local_w4", f"{_GDN}.backward_dv_local", "chunk_dv_local_kernel",
          dict(q_ptr=_X, k_ptr=_X, gcum_ptr=_F, do_ptr=_X, dvnew_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32",
               scale="fp32", aqk_ptr=_X),
          dict(H=HV, HV=HV, K=K, V=V, BT=BT, BK=K, BV=64, DOT_PREC="tf32", DECAY="channel"), 4, _DEFAULT_STAGES,
          "backward stage 1a: scale Aqk^T dO")
_register("kda_bwd_triton_state_w8", f"{_GDN}.backward_state", "chunk_state_bwd_kernel",
          dict(q_ptr=_X, k_ptr=_X, w_ptr=_X, gcum_ptr=_F, do_ptr=_X, dh_ptr=_X, dvnew_ptr=_X, dht_ptr=_F,
               dh0_ptr=_F, cu_ptr=_I64, chunk_off_ptr=_I64, scale="fp32"),
          dict(H=HV, HV=HV, K=K, V=V, BT=BT, BK=K, BV=32, DOT_PREC="tf32", USE_DHT=True, STORE_DH0=True,
               STORE_DH=True, V_FIRST=False, DECAY="channel"), 8, 1, "backward stage 1: reverse state pass")
_register("kda_bwd_triton_wy_w8", "linattn.ops.kda.triton.backward", "kda_wy_bwd_kernel",
          dict(q_ptr=_X, k_ptr=_X, v_ptr=_X, gcum_ptr=_F, beta_eff_ptr=_F, tinv_ptr=_F, h_ptr=_X, vnew_ptr=_X,
               do_ptr=_X, dh_ptr=_X, dvnew_ptr=_X, dq_ptr=_F, dk_ptr=_F, dv_ptr=_X, dgam_ptr=_F, dbeta_ptr=_F,
               dakk_ptr=_F, daqk_ptr=_F, cu_ptr=_I64, chunk_idx_ptr=_I32, chunk_off_ptr=_I64, N="i32",
               scale="fp32"),
          dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=WY_BK, BV=V, DOT_PREC="tf32"), WY_WARPS, WY_STAGES,
          "backward stage 2a: output, state and WY terms, dAkk and dAqk, in key blocks",
          known_spill_bytes=112)
_register(f"kda_bwd_triton_pair_diag_w{DIAG_BH}", "linattn.ops.kda.triton.backward", "kda_pair_diag_bwd_kernel",
          dict(k_ptr=_X, q_ptr=_X, gcum_ptr=_F, beta_eff_ptr=_F, dakk_ptr=_F, daqk_ptr=_F, pairwise_ptr="*i8",
               dq_ptr=_F, dk_ptr=_F, dgam_ptr=_F, dbeta_ptr=_F, cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32"),
          dict(H=H, HV=HV, K=K, BT=BT, BK=K, BH=DIAG_BH, FTZ=True), DIAG_BH, _DEFAULT_STAGES,
          "backward stage 2b (1/2): pairwise gradients of Akk / Aqk inside 16-row blocks of chunks flagged pairwise, "
          "token by token", intended=("LDG",))
_register(f"kda_bwd_triton_pair_w{PAIR_WARPS}", "linattn.ops.kda.triton.backward", "kda_pair_bwd_kernel",
          dict(k_ptr=_X, q_ptr=_X, gcum_ptr=_F, beta_eff_ptr=_F, beta_ptr=_F, dakk_ptr=_F, daqk_ptr=_F,
               dbeta_in_ptr=_F, pairwise_ptr="*i8", dq_ptr=_F, dk_ptr=_F, dgam_ptr=_F, dbeta_ptr=_F, dq_out_ptr=_X,
               dk_out_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32"),
          dict(H=H, HV=HV, K=K, BT=BT, BK=PAIR_BK, DOT_PREC="tf32", BETA_SIGMOID=False, NEG_EIGVAL=False,
               FTZ=True),
          PAIR_WARPS, PAIR_STAGES,
          "backward stage 2b (2/2): pairwise gradients of Akk / Aqk across 16-row blocks (and inside them where the "
          "chunk is not flagged), in key blocks",
          intended=("HMMA",), known_spill_bytes=8)
_register("kda_bwd_triton_dg_w4", "linattn.ops.kda.triton.backward", "kda_dg_kernel",
          dict(g_ptr=_F, dgam_ptr=_F, dg_ptr=_F, dA_ptr=_F, dbias_ptr=_F, cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32"),
          dict(A_log=None, dt_bias=None, HV=HV, K=K, BT=BT, BK=DG_BK, GATE="", HAS_DT_BIAS=False, LOWER_BOUND=0.0),
          4, _DEFAULT_STAGES, "backward stage 2c: dg, the reverse cumsum inside the chunk, and the gate's chain rule",
          intended=("LDG",))

_register("kda_bwd_triton_gva_sum_w4", "linattn.ops.kda.triton.backward", "kda_gva_sum_kernel",
          dict(x_ptr=_F, y_ptr=_X, n_rows="i32"), dict(G=HV // H, K=K, BR=GVA_SUM_ROWS, BK=K), 4, _DEFAULT_STAGES,
          "backward GVA: dq / dk summed over each key head's value heads", intended=("LDG",))


def kda_intra_gluon_signature():
    """The argument types of kda_intra_gluon_kernel as the JIT sees them for kda_intra_gluon's launch (no gate:
    A_log and dt_bias None, constexpr)."""
    return dict(q_ptr=_X, k_ptr=_X, g_ptr=_F, beta_ptr=_F, A_log="constexpr", dt_bias="constexpr", gcum_ptr=_F,
                beta_out_ptr=_F, kdec_ptr=_X, qdec_ptr=_X, tinv_ptr=_X, aqk_ptr=_X, kg_ptr=_X, cu_ptr=_I64,
                chunk_idx_ptr=_I32, N="i32")


def _gluon_intra_build():
    from linattn.ops.kda.gluon.intra import INTRA_WARPS, kda_intra_gluon_kernel
    const = dict(A_log=None, dt_bias=None, H=H, HV=HV, K=K, BT=BT, GATE="", HAS_DT_BIAS=False, LOWER_BOUND=0.0,
                 BETA_SIGMOID=False, NEG_EIGVAL=False, GCUM_LAST=True)
    sig = kda_intra_gluon_signature()
    sig.update({n: "constexpr" for n in const})
    return kda_intra_gluon_kernel, sig, const, {"num_warps": INTRA_WARPS}


register(AotKernel(
    "kda_fwd_gluon_intra_w4", _gluon_intra_build, ("HMMA",), archs=("sm_90a",),
    div16=("q_ptr", "k_ptr", "g_ptr", "beta_ptr", "gcum_ptr", "beta_out_ptr", "kdec_ptr", "qdec_ptr", "tinv_ptr",
           "aqk_ptr", "kg_ptr", "cu_ptr", "chunk_idx_ptr"),
    description="KDA forward stage 2a in Gluon: gate cumsum, decayed keys / queries, Akk / Aqk by mma.sync (a warp "
                "per row block), Tinv by block substitution, H16/HV32 K=128 bf16, one warpgroup"))


def kda_fused_signature(BV: int = 64, states: bool = True):
    """The argument types of kda_fused_forward_kernel as the JIT sees them for kda_fused_forward's launch."""
    from linattn.ops.gated_delta_rule.gluon.aot import desc_sig
    d, t = desc_sig("bf16", [BT, K]), desc_sig("bf16", [BT, BT])
    st = _F if states else "constexpr"
    return dict(qd_desc=d, kd_desc=d, kg_desc=d, v_desc=desc_sig("bf16", [BT, BV]), t_desc=t, a_desc=t,
                beta_ptr=_F, gcum_ptr=_F, o_ptr=_X, h0_ptr=st, ht_ptr=st, cu_ptr=_I64, chunk_off_ptr=_I64,
                scale="fp32")


def _gluon_fused_build(BV: int, nwu: int):
    def build():
        from linattn.ops.kda.gluon import fused_forward as ff
        const = dict(HV=HV, K=K, V=V, BT=BT, BV=BV, STAGES_A=ff.kda_fused_stages_a(BV), STAGES=ff.STAGES, NWU=nwu,
                     NPUB=ff.NPUB, USE_H0=True,
                     STORE_HT=True, OUTPUT_REGS=ff.OUTPUT_REGS, WU_REGS=ff.WU_REGS, PRODUCER_REGS=ff.PRODUCER_REGS)
        sig = kda_fused_signature(BV)
        sig.update({n: "constexpr" for n in const})
        return ff.kda_fused_forward_kernel, sig, const, {"num_warps": 4}
    return build


for _bv, _nwu in ((64, 1), (32, 2)):          # fused_forward.kda_fused_config's two configs
    register(AotKernel(
        f"kda_fwd_gluon_fused_bv{_bv}_s2_nwu{_nwu}", _gluon_fused_build(_bv, _nwu),
        ("HGMMA", "UTMALDG", "SYNCS", "WARPGROUP"), archs=("sm_90a",),
        div16=("beta_ptr", "gcum_ptr", "o_ptr", "h0_ptr", "ht_ptr", "cu_ptr", "chunk_off_ptr"),
        description=f"KDA forward stages 2b-4 in one warp-specialised Gluon kernel: TMA producer, W/U, state chain "
                    f"with the per-channel decay, output from Qdec and Aqk; BV={_bv}, Kg / Tinv / V ring of "
                    f"{3 if _bv == 32 else 2} slots, the others 2, {_nwu} W buffers, H16/HV32 K=V=128 bf16"))


_GLUON = "linattn.ops.gated_delta_rule.gluon"


def _gluon_state_build(module: str, kernel: str, signature: str, const: dict):
    """The build of one of GDN's Gluon state passes (_GLUON.module.kernel) with KDA's per-channel decay: its AOT
    signature (the function `signature` of GDN's gluon/aot.py) and every constexpr named (an AOT build applies no
    defaults)."""
    def build():
        import importlib
        fn = getattr(importlib.import_module(f"{_GLUON}.{module}"), kernel)
        sig = getattr(importlib.import_module(f"{_GLUON}.aot"), signature)("bf16", const["BV"])
        sig.update({n: "constexpr" for n in const})
        return fn, sig, const, {"num_warps": 4}
    return build


# the reverse state pass at chunk_state_bwd.state_bwd_config's two configs without stage 1a, the recompute's state
# pass at launcher.state_config's configs at B1 and B8 H32
for _bv, _stages in ((32, 3), (64, 2)):
    register(AotKernel(
        f"kda_bwd_gluon_state_bv{_bv}_s{_stages}",
        _gluon_state_build("chunk_state_bwd", "chunk_state_bwd_tma_kernel", "bwd_dh_signature",
                           dict(H=HV, HV=HV, K=K, V=V, BT=BT, BV=_bv, USE_DHT=True, STORE_DH0=True, STAGES=_stages,
                                DV_LOCAL=False, DECAY="channel", seg_ptr=None, sel_ptr=None)),
        ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS"), archs=("sm_90a",),
        div16=("gcum_ptr", "dvnew_ptr", "dht_ptr", "dh0_ptr", "cu_ptr", "chunk_off_ptr"),
        description=f"KDA backward stage 1 (reverse state pass) in Gluon: GDN's TMA ring + wgmma kernel with the "
                    f"per-channel decay (decayed q / k tiles, dS rows by exp(gam_C)); BV={_bv}, {_stages}-stage ring, "
                    f"HV32 K=V=128 bf16"))
    register(AotKernel(
        f"kda_bwd_gluon_recompute_state_bv{_bv}_s{_stages}",
        _gluon_state_build("chunk_state_tma", "chunk_state_fwd_tma_kernel", "signature",
                           dict(H=HV, HV=HV, K=K, V=V, BT=BT, BV=_bv, USE_H0=True, STORE_HT=False, STAGES=_stages,
                                DECAY="channel")),
        ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS"), archs=("sm_90a",),
        div16=("gcum_ptr", "vnew_ptr", "h0_ptr", "ht_ptr", "cu_ptr", "chunk_off_ptr"),
        description=f"KDA backward's recompute, stage 3 (state pass) in Gluon: GDN's TMA ring + wgmma kernel with the "
                    f"per-channel decay (decayed key tiles, S rows by exp(gam_C)); BV={_bv}, {_stages}-stage ring, "
                    f"HV32 K=V=128 bf16"))


def _gluon_wy_build():
    from linattn.ops.kda.gluon.wy_bwd import BK, WARPS, kda_wy_bwd_gluon_kernel
    const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK)
    sig = dict(q_ptr=_X, k_ptr=_X, v_ptr=_X, gcum_ptr=_F, beta_ptr=_F, tinv_ptr=_X, h_ptr=_X, vnew_ptr=_X,
               do_ptr=_X, dh_ptr=_X, dvnew_ptr=_X, dq_ptr=_F, dk_ptr=_F, dv_ptr=_X, dgam_ptr=_F, dbeta_ptr=_F,
               dakk_ptr=_F, daqk_ptr=_F, cu_ptr=_I64, chunk_idx_ptr=_I32, chunk_off_ptr=_I64, N="i32", scale="fp32")
    sig.update({n: "constexpr" for n in const})
    return kda_wy_bwd_gluon_kernel, sig, const, {"num_warps": WARPS}


register(AotKernel(
    "kda_bwd_gluon_wy_w8", _gluon_wy_build, ("HGMMA",), archs=("sm_90a",),
    div16=("q_ptr", "k_ptr", "v_ptr", "gcum_ptr", "beta_ptr", "tinv_ptr", "h_ptr", "vnew_ptr", "do_ptr", "dh_ptr",
           "dvnew_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dgam_ptr", "dbeta_ptr", "dakk_ptr", "daqk_ptr", "cu_ptr",
           "chunk_idx_ptr", "chunk_off_ptr"),
    description="KDA backward stage 2a (WY) in Gluon: value side and key blocks of 32 channels on warpgroup_mma, "
                "cp.async tiles, H16/HV32 K=V=128 bf16, two warpgroups"))
