"""AOT registrations of the Triton GDN forward and backward stage kernels (`linattn inspect`), so that their
registers, spills, shared memory and SASS mix can be read on a CPU. Each at the launch config the launchers pick on an
H200 at H=16, HV=32, K=V=128, bf16."""
from __future__ import annotations

from linattn.ops.col_sum import COL_SUM_COLS, COL_SUM_ROWS
from linattn.runtime.aot import AotKernel, register

H, HV, K, V, BT = 16, 32, 128, 128, 64
_X, _F, _I64, _I32 = "*bf16", "*fp32", "*i64", "*i32"


def _ptrs(sig: dict) -> tuple:
    # torch allocations are 256-byte aligned: the JIT marks pointers so
    return tuple(n for n, t in sig.items() if t.startswith("*"))


def _build(mod: str, kname: str, sig: dict, const: dict, warps: int, stages: int):
    def build():
        import importlib
        path = mod if mod.startswith("linattn.") else f"linattn.ops.gated_delta_rule.triton.{mod}"
        fn = getattr(importlib.import_module(path), kname)
        return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": warps, "num_stages": stages}
    return build


def _register(name: str, mod: str, kname: str, sig: dict, const: dict, warps: int, stages: int, what: str,
              intended=("HGMMA",), known_spill_bytes: int = 0):
    register(AotKernel(name, _build(mod, kname, sig, const, warps, stages), intended, archs=("sm_90a",),
                       language="triton", known_spill_bytes=known_spill_bytes, div16=_ptrs(sig),
                       description=f"GDN {what}, Triton, H16/HV32 K=V=128 bf16, {warps} warps"))


# ---- Forward stage 2 (intra_split.py) at split_intra_config's configs: kkt_solve_kernel (K K^T as one
# [64, 128] x [128, 64] WGMMA, the block substitution's 16x16 products on mma.sync) storing Tinv in bf16 (the
# forward; in the default program order and head-fastest, kkt_order's choice from 768 chunk slots on) or fp32 (the
# backward's recompute); wu_kernel reading either ([64, 64] x [64, 64] WGMMA).
_KKT_SIG = dict(k_ptr=_X, g_ptr=_F, beta_ptr=_F, gcum_ptr=_F, tinv_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32")
# FLA's options at their defaults (the pointers None, the switches off): compiled out, the default path's kernel
_KKT_FLA_OFF = dict(A_log_ptr=None, dt_bias_ptr=None, beta_out_ptr=None, GATE_IN_KERNEL=False, HAS_DT_BIAS=False,
                    BETA_SCALE=0, tinv16_ptr=None)   # (and no 16-bit copy of Tinv: the gluon backward's adds one store)
_KKT_CONST = dict(H=H, HV=HV, K=K, BT=BT, BK=128, DOT_PREC="tf32", **_KKT_FLA_OFF)
for _name, _tinv, _hf, _what in (
        ("gdn_fwd_triton_kkt_solve_w4", _X, False, "stage 2a: gcum and Tinv (bf16)"),
        ("gdn_fwd_triton_kkt_solve_hf_w4", _X, True, "stage 2a: gcum and Tinv (bf16), programs head-fastest"),
        ("gdn_fwd_triton_kkt_solve_f32_w4", _F, False, "stage 2a: gcum and Tinv (fp32, the backward's recompute)")):
    _register(_name, "intra_split", "kkt_solve_kernel", dict(_KKT_SIG, tinv_ptr=_tinv),
              dict(_KKT_CONST, HEADS_FAST=_hf), 4, 2, f"forward {_what}")
# fp16 inputs: the inverse's fp32 products at TF32x3 (dot_precision), Tinv stored in fp16
_register("gdn_fwd_triton_kkt_solve_fp16_w4", "intra_split", "kkt_solve_kernel",
          dict(_KKT_SIG, k_ptr="*fp16", tinv_ptr="*fp16"), dict(_KKT_CONST, DOT_PREC="tf32x3", HEADS_FAST=False), 4, 2,
          "forward stage 2a at fp16: gcum and Tinv (fp16), the inverse's products at TF32x3")

_WU_SIG = dict(k_ptr=_X, v_ptr=_X, beta_ptr=_F, gcum_ptr=_F, tinv_ptr=_X, w_ptr=_X, u_ptr=_X, cu_ptr=_I64,
               chunk_idx_ptr=_I32, N="i32")
for _name, _tinv, _what in (("gdn_fwd_triton_wu_bv64_w4", _X, "stage 2b: W and U from bf16 Tinv"),
                            ("gdn_fwd_triton_wu_f32_bv64_w4", _F, "stage 2b: W and U from fp32 Tinv (backward)")):
    _register(_name, "intra_split", "wu_kernel", dict(_WU_SIG, tinv_ptr=_tinv),
              dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, DOT_PREC="tf32", DECAY="scalar"), 4, 2,
              f"forward {_what}")

# ---- Forward stage 3 (chunk_state.py) at forward._configs's three V blocks: BV=16 where even 16-column blocks fit
# one wave (B1-B2 at H2/HV8), 32 at B=1 here (64 programs of BV=64 would leave SMs idle), 64 at B >= 3.
_STATE_SIG = dict(k_ptr=_X, w_ptr=_X, u_ptr=_X, gcum_ptr=_F, h_ptr=_X, vnew_ptr=_X, h0_ptr=_F, ht_ptr=_F,
                  cu_ptr=_I64, chunk_off_ptr=_I64)
for _bv, _what in ((16, "BV=16 config"), (32, "B=1 config"), (64, "B>=3 config")):
    _register(f"gdn_fwd_triton_state_bv{_bv}_w4", "chunk_state", "chunk_state_fwd_kernel", _STATE_SIG,
              dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=_bv, DOT_PREC="tf32", USE_H0=True, STORE_HT=True,
                   V_FIRST=False, DECAY="scalar"), 4, 2,
              f"forward stage 3: state pass, {_what}")

# ---- Forward stage 4 (chunk_output.py): K loop of BK 64, BV 128, 8 warps, heads grouped.
_register("gdn_fwd_triton_output_bv128_w8", "chunk_output", "chunk_output_kernel",
          dict(q_ptr=_X, k_ptr=_X, vnew_ptr=_X, h_ptr=_X, gcum_ptr=_F, o_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32,
               chunk_off_ptr=_I64, N="i32", scale="fp32"),
          dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=128, DOT_PREC="tf32", DECAY="scalar", aqk_ptr=None), 8, 2,
          "forward stage 4: output")

# ---- The backward's own kernels (backward*.py) at backward._configs's picks: stage 1a in [64, 64] blocks, the reverse
# state pass with the whole K = 128 and BV = 32 at B=1 (BV = 64 would leave SMs idle), BV = 64 at B >= 3; the local
# and WY stages as one warpgroup, BK = BV = 64, one stage, no spill. The recompute of the forward is covered above.
# dht is fp32 here (any float dtype is accepted), dh0 fp32.
_register("gdn_bwd_triton_dv_local_w4", "backward_dv_local", "chunk_dv_local_kernel",
          dict(q_ptr=_X, k_ptr=_X, gcum_ptr=_F, do_ptr=_X, dvnew_ptr=_X, cu_ptr=_I64, chunk_idx_ptr=_I32, N="i32",
               scale="fp32"),
          dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, DOT_PREC="tf32", DECAY="scalar", aqk_ptr=None), 4, 2,
          "backward stage 1a: P^T dO (intra-chunk dVnew)")
for _bv, _what in ((32, "B=1 config"), (64, "B>=3 config")):
    _register(f"gdn_bwd_triton_state_bv{_bv}_w8", "backward_state", "chunk_state_bwd_kernel",
              dict(q_ptr=_X, k_ptr=_X, w_ptr=_X, gcum_ptr=_F, do_ptr=_X, dh_ptr=_X, dvnew_ptr=_X, dht_ptr=_F,
                   dh0_ptr=_F, cu_ptr=_I64, chunk_off_ptr=_I64, scale="fp32"),
              dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=_bv, DOT_PREC="tf32", USE_DHT=True, STORE_DH0=True,
                   STORE_DH=True, V_FIRST=False, DECAY="scalar"), 8, 2,
              f"backward stage 1: reverse state pass, {_what}")
_register("gdn_bwd_triton_local_w4", "backward_local", "chunk_local_bwd_kernel",
          dict(q_ptr=_X, k_ptr=_X, vnew_ptr=_X, h_ptr=_X, gcum_ptr=_F, do_ptr=_X, dvnew_ptr=_X, dh_ptr=_X,
               dq_ptr=_X, dk_ptr=_F, dw_ptr=_X, dgam_ptr=_F, cu_ptr=_I64, chunk_idx_ptr=_I32, chunk_off_ptr=_I64,
               N="i32", T_tot="i32", scale="fp32"),
          dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, DOT_PREC="tf32"), 4, 1,
          "backward stage 2: dQ, dK part, dW, gate terms in three phases")
_register("gdn_bwd_triton_wy_w4", "backward_wy", "chunk_wy_bwd_kernel",
          dict(k_ptr=_X, v_ptr=_X, beta_ptr=_F, gcum_ptr=_F, tinv_ptr=_F, dvnew_ptr=_X, dw_ptr=_X, dk_part_ptr=_F,
               dgam_ptr=_F, dk_ptr=_X, dv_ptr=_X, dg_ptr=_F, dbeta_ptr=_F, m_ptr=_X, cu_ptr=_I64,
               chunk_idx_ptr=_I32, N="i32", T_tot="i32"),
          dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=64, BV=64, NK=K // 64, NKP=K // 64, M_IN_DK=True, DOT_PREC="tf32",
               g_raw_ptr=None, A_log_ptr=None, dt_bias_ptr=None, dgate_ptr=None, beta_raw_ptr=None,
               GATE_IN_KERNEL=False, HAS_DT_BIAS=False, BETA_SCALE=0),
          4, 1, "backward stage 3: through the WY form: dV, dK, dbeta, dg")
_register("gdn_bwd_triton_col_sum_w4", "linattn.ops.col_sum", "col_sum_kernel",
          dict(x_ptr=_F, y_ptr=_F, R="i32", C="i32"), dict(BR=COL_SUM_ROWS, BC=COL_SUM_COLS),
          4, 3,      # launched without num_stages: Triton's default 3
          "backward, in-kernel gate (KDA's too; rms_norm_gated's dweight): dA_log / d dt_bias summed over the chunk "
          "slots' partials", intended=("LDG",))

# ---- Context parallelism's forward summary (cp_summary.py): [C | M] of one sequence at B=1's state-pass config
# (BV = 32: 4 blocks of C and 4 of M per value head).
_register("gdn_cp_triton_summary_bv32_w4", "cp_summary", "chunk_state_summary_kernel",
          dict(k_ptr=_X, w_ptr=_X, u_ptr=_X, gcum_ptr=_F, h0_ptr=_F, hm_ptr=_F, cu_ptr=_I64, beta_ptr=_F,
               thresh="fp32"),
          dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=32, USE_H0=True, DOT_PREC="tf32", DECAY="scalar", WINDOW=True,
               MAXW=16, BETA_SCALE=0), 4, 2,
          "context-parallel summary: C and the transition M of one sequence, from its tail window")
