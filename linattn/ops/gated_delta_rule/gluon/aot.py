"""AOT registrations of the Gluon GDN kernels (state pass, reverse state pass, fused forward, stage 2a) in the
configs their launchers pick: what `linattn inspect` compiles and tests check, at the production head shape H=16,
HV=32, K=V=128."""
from __future__ import annotations

from linattn.runtime.aot import AotKernel, register

H, HV, K, V, BT = 16, 32, 128, 128, 64


def desc_sig(dtype_name: str, block):
    """Exactly the string the JIT derives (triton.runtime.jit.mangle_type) for a Gluon TensorDescriptor."""
    from linattn.runtime.gluon_compat import gl
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    return f"tensordesc<{dtype_name}[{', '.join(map(str, block))}],{layout!r}>"


# ---- The state pass from W and U (gluon/chunk_state_tma.py; context parallelism's where N*HV <= 64): TMA ring,
# warpgroup_mma, the TMA store of h. Configs: launcher.state_config's for K=V=128.
INTENDED = ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "WARPGROUP")
# the pointer arguments the JIT marks 16-divisible (torch allocations are 256-byte aligned)
_PTRS_TMA = ("gcum_ptr", "vnew_ptr", "h0_ptr", "ht_ptr", "cu_ptr", "chunk_off_ptr")


def signature(dtype: str, BV: int):
    """The argument types of chunk_state_fwd_tma_kernel as the JIT sees them for a launcher call."""
    return {"k_desc": desc_sig(dtype, [BT, K]), "w_desc": desc_sig(dtype, [BT, K]), "u_desc": desc_sig(dtype, [BT, BV]),
            "gcum_ptr": "*fp32", "h_desc": desc_sig(dtype, [K, BV]), "vnew_ptr": f"*{dtype}",
            "h0_ptr": "*fp32", "ht_ptr": "*fp32", "cu_ptr": "*i64", "chunk_off_ptr": "*i64"}


def _build(dtype: str, BV: int, warps: int, stages: int):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import chunk_state_fwd_tma_kernel as fn
        constexprs = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_H0=True, STORE_HT=True, STAGES=stages,
                          DECAY="scalar")
        sig = signature(dtype, BV)
        sig.update({name: "constexpr" for name in constexprs})
        return fn, sig, constexprs, {"num_warps": warps}
    return build


CONFIGS = [("bf16", 64, 4, 2), ("bf16", 32, 4, 3), ("bf16", 32, 4, 2), ("fp16", 64, 4, 2)]   # (dtype, BV, warps, stages)


def kernel_name(dtype: str, BV: int, warps: int, stages: int) -> str:
    return f"gdn_state_gluon_wgmma_{dtype}_bv{BV}_w{warps}_s{stages}"


for _dt, _bv, _w, _s in CONFIGS:
    register(AotKernel(
        kernel_name(_dt, _bv, _w, _s), _build(_dt, _bv, _w, _s), INTENDED, div16=_PTRS_TMA,
        description=f"GDN forward state pass, Gluon TMA ring + wgmma, K=V=128 {_dt}, BV={_bv}, {_w} warps, "
                    f"{_s}-stage TMA ring"))


# ---- Backward stage 1 (the reverse state pass) in Gluon (gluon/chunk_state_bwd.py): q, k, w, dO, dVnew tiles by TMA
# into a STAGES-deep mbarrier ring (reverse chunk order), three wgmma products per chunk (dVnew with the decayed K as
# register A operand; dS with Q^T dO and W^T dVnew from shared memory), dh[chunk] by a TMA store. One warpgroup.
# Configs: state_bwd_config's (BV=32 with 3 stages at B=1 H16/HV32, BV=64 with 2 stages at B >= 3), each with stage
# 1a in the kernel (dv_local: the gluon backend's backward; 8 warps at BV=64) and without (context parallelism's
# reverse pass). dht fp32 (the gradient of an fp32 final state). The segment launch (seg: its reverse segment words and
# the slow pairs' selection, BV=64) and the unsegmented launch of the slow pairs (sel: BV=32) at B1 H16/HV32.
BWD_DH_INTENDED = ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "WARPGROUP")
BWD_DH_DIV16 = ("gcum_ptr", "dvnew_ptr", "dht_ptr", "dh0_ptr", "cu_ptr", "chunk_off_ptr")
BWD_DH_CONFIGS = [(dt, bv, 8 if local and bv == 64 else 4, st, local)       # (dtype, BV, warps, stages, dv_local)
                  for dt, bv, st in (("bf16", 32, 3), ("bf16", 64, 2), ("fp16", 64, 2)) for local in (True, False)]
BWD_DH_SEG_CONFIGS = [("bf16", 64, 8, 2, True, "seg"), ("bf16", 32, 4, 3, True, "sel")]


def bwd_dh_signature(dtype: str, BV: int, launch: str = ""):
    """The argument types of chunk_state_bwd_tma_kernel as the JIT sees them for a state_bwd_launch call; launch
    "seg" (selection and segment words) or "sel" (selection only)."""
    return {"q_desc": desc_sig(dtype, [BT, K]), "k_desc": desc_sig(dtype, [BT, K]), "w_desc": desc_sig(dtype, [BT, K]),
            "do_desc": desc_sig(dtype, [BT, BV]), "dv_desc": desc_sig(dtype, [BT, BV]), "gcum_ptr": "*fp32",
            "dh_desc": desc_sig(dtype, [K, BV]), "dvnew_ptr": f"*{dtype}", "dht_ptr": "*fp32", "dh0_ptr": "*fp32",
            "cu_ptr": "*i64", "chunk_off_ptr": "*i64", "scale": "fp32",
            "sel_ptr": "*i32" if launch else "constexpr", "seg_ptr": "*i32" if launch == "seg" else "constexpr",
            "seq_len": "i32"}


def bwd_dh_kernel_name(dtype: str, BV: int, warps: int, stages: int, dv_local: bool, launch: str = "") -> str:
    return (f"gdn_bwd_dh_gluon_{dtype}_bv{BV}_w{warps}_s{stages}" + ("_local" if dv_local else "")
            + (f"_{launch}" if launch else ""))


def _bwd_dh_build(dtype: str, BV: int, warps: int, stages: int, dv_local: bool, launch: str = ""):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import chunk_state_bwd_tma_kernel as fn
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=True, STORE_DH0=True, STAGES=stages,
                     DV_LOCAL=dv_local, DECAY="scalar")
        if launch != "seg":
            const["seg_ptr"] = None
        if not launch:
            const["sel_ptr"] = None
        sig = bwd_dh_signature(dtype, BV, launch)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": warps}
    return build


for _dt, _bv, _w, _s, _local in BWD_DH_CONFIGS:
    register(AotKernel(
        bwd_dh_kernel_name(_dt, _bv, _w, _s, _local), _bwd_dh_build(_dt, _bv, _w, _s, _local), BWD_DH_INTENDED,
        div16=BWD_DH_DIV16,
        description=f"GDN backward stage 1 (reverse state pass{', with stage 1a' if _local else ''}), Gluon TMA ring "
                    f"+ wgmma, H16/HV32 K=V=128 {_dt}, BV={_bv}, {_w} warps, {_s}-stage ring"))
for _dt, _bv, _w, _s, _local, _launch in BWD_DH_SEG_CONFIGS:
    register(AotKernel(
        bwd_dh_kernel_name(_dt, _bv, _w, _s, _local, _launch), _bwd_dh_build(_dt, _bv, _w, _s, _local, _launch),
        BWD_DH_INTENDED, div16=BWD_DH_DIV16 + (("sel_ptr", "seg_ptr") if _launch == "seg" else ("sel_ptr",)),
        description=f"GDN backward stage 1 with stage 1a, Gluon, H16/HV32 K=V=128 {_dt}, BV={_bv}, {_w} warps, "
                    + ("the segment launch (reverse segment words, warm-ups past each segment's end)"
                       if _launch == "seg" else "the unsegmented launch of the selected (slow) pairs")))


# ---- Stages 2b + 3 + 4 of the forward in one warp-specialised Gluon kernel that forms W and U itself from kkt_solve's
# Tinv (gluon/chunk_fused_wu_ws.py): a 1-warp TMA producer (q, k, v, Tinv ring), the wu warpgroup (Tinv as wgmma's
# register A operand against the ring's k and v tiles), the state chain and the output warpgroups. Configs:
# fused_forward.fused_wu_config's: BV=32 (3-stage ring) and BV=16 with the output's q k^T one chunk ahead (OUT_PIPE),
# output / wu warpgroups at 160 / 160 registers; BV=64 (2 stages) at 136 / 192, bf16 and fp16; and the BV=32 / 16 /
# 64 launches with the per-(sequence, head) selection of the segment-parallel forward's unsegmented pairs.
FUSED_WU_INTENDED = ("HGMMA", "UTMALDG", "SYNCS", "WARPGROUP")
FUSED_WU_DIV16 = ("beta_ptr", "gcum_ptr", "o_ptr", "h0_ptr", "ht_ptr", "cu_ptr", "chunk_off_ptr")


def fused_wu_signature(dtype: str, BV: int, states: bool = True, beta: str = "fp32", select: bool = False):
    """The argument types of chunk_fused_wu_ws_kernel as the JIT sees them for a fused_wu_launch call (None ->
    constexpr for absent states and selection; beta in its own dtype, fp32 from make_gdn_inputs and the api's
    callers)."""
    return {"q_desc": desc_sig(dtype, [BT, K]), "k_desc": desc_sig(dtype, [BT, K]), "v_desc": desc_sig(dtype, [BT, BV]),
            "t_desc": desc_sig(dtype, [BT, BT]), "beta_ptr": f"*{beta}", "gcum_ptr": "*fp32", "o_ptr": f"*{dtype}",
            "h0_ptr": "*fp32" if states else "constexpr", "ht_ptr": "*fp32" if states else "constexpr",
            "cu_ptr": "*i64", "chunk_off_ptr": "*i64", "scale": "fp32", "sel_ptr": "*i32" if select else "constexpr"}


def fused_wu_kernel_name(dtype: str, BV: int, stages: int, regs, out_pipe: bool = False, select: bool = False) -> str:
    return (f"gdn_fwd_fused_wu_ws_gluon_{dtype}_bv{BV}_s{stages}_areg" + ("_opipe" if out_pipe else "")
            + f"_o{regs[0]}_w{regs[1]}" + ("_sel" if select else ""))


def _fused_wu_build(dtype: str, BV: int, stages: int, regs, out_pipe: bool = False, select: bool = False):
    """regs: (OUTPUT_REGS, WU_REGS); select: with the per-(sequence, head) selection (sel_ptr)."""
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import (NPUB, NWU, PRODUCER_REGS,
                                                                          chunk_fused_wu_ws_kernel as fn)
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, STAGES=stages, NWU=NWU, NPUB=NPUB, USE_H0=True,
                     STORE_HT=True, OUTPUT_REGS=regs[0], WU_REGS=regs[1], PRODUCER_REGS=PRODUCER_REGS,
                     OUT_PIPE=out_pipe)
        if not select:
            const["sel_ptr"] = None
        sig = fused_wu_signature(dtype, BV, select=select)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": 4}
    return build


# (dtype, BV, stages, (output, wu registers), OUT_PIPE, select)
FUSED_WU_CONFIGS = [
    ("bf16", 32, 3, (160, 160), True, False), ("bf16", 64, 2, (136, 192), False, False),
    ("fp16", 64, 2, (136, 192), False, False), ("bf16", 16, 3, (160, 160), True, False),
    ("bf16", 32, 3, (160, 160), True, True), ("bf16", 64, 2, (136, 192), False, True),
    ("bf16", 16, 3, (160, 160), True, True),
]
for _dt, _bv, _s, _regs, _op, _sel in FUSED_WU_CONFIGS:
    register(AotKernel(
        fused_wu_kernel_name(_dt, _bv, _s, _regs, out_pipe=_op, select=_sel),
        _fused_wu_build(_dt, _bv, _s, _regs, out_pipe=_op, select=_sel),
        FUSED_WU_INTENDED, div16=FUSED_WU_DIV16 + (("sel_ptr",) if _sel else ()),
        description="GDN forward stages 2b+3+4 fused, warp-specialised Gluon (TMA producer warp, W/U warpgroup, state "
                    "warpgroup, output warpgroup" + (" with q k^T one chunk ahead" if _op else "") + ")"
                    + (", with a per-(sequence, head) selection" if _sel else "")
                    + f", H16/HV32 K=V=128 {_dt}, BV={_bv}, {_s}-stage ring, output / wu warpgroups at "
                    f"{_regs[0]} / {_regs[1]} registers"))


# ---- Stages 2b + 3 + 4 at BV = 128 in the gate-free form (gluon/chunk_fused_gf.py): one CTA per (sequence, value
# head), two state partitions of 64 columns each, the output and the TMA producer; Vnew = Tinv diag(beta) (V -
# diag(e^gam) K S) with no W and no U. The plain launch and the segment launch (seg_ptr: segment words, each
# segment's warm-up in the kernel; sel_ptr indexed by the whole sequence).
def fused_gf_signature(dtype: str, states: bool = True, beta: str = "fp32", select: bool = False,
                       warm: bool = False):
    sig = fused_wu_signature(dtype, 128, states=states, beta=beta, select=select)
    sig["seg_ptr"] = "*i32" if warm else "constexpr"
    return sig


def _fused_gf_build(dtype: str, warm: bool = False):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import (GF_BV, GF_NPUB, GF_OUTPUT_REGS, GF_SPLIT,
                                                                       GF_STAGES, GF_STATE_REGS, PRODUCER_REGS,
                                                                       chunk_fused_gf_kernel as fn)
        const = dict(H=H, HV=HV, K=K, V=V, BT=BT, BV=GF_BV, STAGES=GF_STAGES, NPUB=GF_NPUB, USE_H0=True,
                     STORE_HT=True, OUTPUT_REGS=GF_OUTPUT_REGS, PRODUCER_REGS=PRODUCER_REGS, OUT_PIPE=True,
                     SPLIT=GF_SPLIT, STATE_REGS=GF_STATE_REGS)
        if not warm:                   # the segment launch has both, the plain launch neither
            const.update(sel_ptr=None, seg_ptr=None)
        sig = fused_gf_signature(dtype, select=warm, warm=warm)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": 4}
    return build


for _warm in (False, True):
    register(AotKernel(
        "gdn_fwd_fused_gf_gluon_bf16_bv128_state2_kspipe" + ("_warm" if _warm else ""),
        _fused_gf_build("bf16", warm=_warm), FUSED_WU_INTENDED,
        div16=FUSED_WU_DIV16 + (("sel_ptr", "seg_ptr") if _warm else ()),
        description="GDN forward stages 2b+3+4 fused at BV=128 in the gate-free form (no W, no U), two state "
                    "partitions of 64 columns each, product 1's column parts pipelined, H16/HV32 K=V=128 bf16"
                    + (", the segment launch" if _warm else "")))


# ---- Stage 2a in Gluon (gluon/kkt_solve.py): one program per (chunk slot, key head), the key tile by TMA, K K^T once
# per key head by warpgroup_mma, then the HV / H value heads' block substitution on mma.sync; a fixed-length batch's
# launch (FIXED_LEN) and the register cap (80: ptxas keeps 20 bytes of loop-invariant values in local memory there).
def kkt_gluon_signature(dtype: str = "bf16"):
    return {"k_desc": desc_sig(dtype, [BT, K]), "g_ptr": "*fp32", "beta_ptr": "*fp32", "gcum_ptr": "*fp32",
            "tinv_ptr": f"*{dtype}", "cu_ptr": "*i64", "chunk_idx_ptr": "*i32", "N": "i32", "num_items": "i32",
            "seq_len": "i32"}


def _kkt_gluon_build(dtype: str):
    def build():
        from linattn.ops.gated_delta_rule.gluon.kkt_solve import KKT_WARPS, MAXNREG, kkt_solve_gluon_kernel
        const = dict(H=H, HV=HV, K=K, BT=BT, FIXED_LEN=True)
        sig = kkt_gluon_signature(dtype)
        sig.update({name: "constexpr" for name in const})
        return kkt_solve_gluon_kernel, sig, const, {"num_warps": KKT_WARPS, "maxnreg": MAXNREG}
    return build


register(AotKernel(
    "gdn_fwd_kkt_solve_gluon_bf16_direct_r80", _kkt_gluon_build("bf16"), ("HGMMA", "UTMALDG", "HMMA"),
    div16=("g_ptr", "beta_ptr", "gcum_ptr", "tinv_ptr", "cu_ptr", "chunk_idx_ptr"), known_spill_bytes=20,
    description="GDN forward stage 2a in Gluon: K K^T once per key head (TMA, warpgroup_mma), each value head's "
                "Tinv by block substitution on mma.sync, H16/HV32 K=128 bf16, registers capped at 80"))


# ---- Backward stages 2 + 3 in one Gluon kernel (gluon/chunk_local_wy_bwd.py): one program per (chunk slot, key
# head) over its value heads in two passes, tiles by cp.async, every product a synchronous warpgroup_mma, the TF32 dA
# chain included. Known spill: 8 B at HV = 2H (0 at HV = H): pass 2's loop body sits at 255 registers.
LOCAL_WY_PTRS = ("q_ptr", "k_ptr", "v_ptr", "vnew_ptr", "h_ptr", "dh_ptr", "gcum_ptr", "beta_ptr", "tinv_ptr",
                 "do_ptr", "dvnew_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dg_ptr", "dbeta_ptr", "cu_ptr",
                 "chunk_idx_ptr", "chunk_off_ptr")


def local_wy_signature(dtype: str, gate: str = "fp32", beta: str = "fp32"):
    """The argument types of chunk_local_wy_bwd_kernel as the JIT sees them for a local_wy_launch call (g and beta
    in their own dtypes, fp32 from make_gdn_inputs)."""
    sig = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "vnew_ptr", "h_ptr", "dh_ptr")}
    sig.update(gcum_ptr="*fp32", beta_ptr=f"*{beta}", tinv_ptr=f"*{dtype}", do_ptr=f"*{dtype}", dvnew_ptr=f"*{dtype}",
               dq_ptr=f"*{dtype}", dk_ptr=f"*{dtype}", dv_ptr=f"*{dtype}", dg_ptr=f"*{gate}", dbeta_ptr=f"*{beta}",
               cu_ptr="*i64", chunk_idx_ptr="*i32", chunk_off_ptr="*i64", N="i32", scale="fp32")
    return sig


def _local_wy_build(dtype: str, hv: int):
    def build():
        from linattn.ops.gated_delta_rule.gluon.chunk_local_wy_bwd import WARPS, chunk_local_wy_bwd_kernel as fn
        const = dict(H=H, HV=hv, K=K, V=V, BT=BT)
        sig = local_wy_signature(dtype)
        sig.update({name: "constexpr" for name in const})
        return fn, sig, const, {"num_warps": WARPS}
    return build


for _dt, _hv, _spill in (("bf16", HV, 8), ("fp16", HV, 8), ("bf16", H, 0)):
    register(AotKernel(
        f"gdn_bwd_local_wy_gluon_{_dt}_hv{_hv}", _local_wy_build(_dt, _hv), ("HGMMA", "WARPGROUP", "LDGSTS"),
        div16=LOCAL_WY_PTRS, known_spill_bytes=_spill,
        description=f"GDN backward stages 2+3 (local terms and WY) in one Gluon kernel per (chunk, key head), "
                    f"cp.async tiles, synchronous warpgroup_mma, H16/HV{_hv} K=V=128 {_dt}, 8 warps"))


# ---- The backward's recompute of h and Vnew in the gate-free form (gluon/chunk_state_gf.py): chunk_fused_gf's two
# state partitions, a store partition (TMA stores of h and Vnew), the k / v / Tinv producer. The plain launch with an
# initial state and no final state (the backward's), and the segment launch (seg_ptr, sel_ptr, seq_len).
def state_gf_signature(dtype: str, warm: bool = False):
    sig = {"k_desc": desc_sig(dtype, [BT, K]), "v_desc": desc_sig(dtype, [BT, V]), "t_desc": desc_sig(dtype, [BT, BT]),
           "h_desc": desc_sig(dtype, [K, V]), "vn_desc": desc_sig(dtype, [BT, V]), "beta_ptr": "*fp32",
           "gcum_ptr": "*fp32", "vnew_ptr": f"*{dtype}", "h0_ptr": "*fp32", "ht_ptr": "constexpr", "cu_ptr": "*i64",
           "chunk_off_ptr": "*i64", "sel_ptr": "*i32" if warm else "constexpr",
           "seg_ptr": "*i32" if warm else "constexpr", "seq_len": "i32"}
    return sig


def _state_gf_build(dtype: str, warm: bool = False):
    def build():
        from linattn.ops.gated_delta_rule.gluon import chunk_state_gf as m
        const = dict(ht_ptr=None, H=H, HV=HV, K=K, V=V, BT=BT, BV=m.SGF_BV, STAGES=m.SGF_STAGES, NPUB=m.SGF_NPUB,
                     USE_H0=True, STORE_HT=False, SPLIT=m.SGF_SPLIT, STATE_REGS=m.SGF_STATE_REGS,
                     STORE_REGS=m.SGF_STORE_REGS, PRODUCER_REGS=m.PRODUCER_REGS)
        if not warm:
            const.update(sel_ptr=None, seg_ptr=None)
        sig = state_gf_signature(dtype, warm=warm)
        sig.update({name: "constexpr" for name in const})
        return m.chunk_state_gf_kernel, sig, const, {"num_warps": 4}
    return build


for _warm in (False, True):
    register(AotKernel(
        "gdn_bwd_recompute_state_gf_gluon_bf16" + ("_warm" if _warm else ""), _state_gf_build("bf16", warm=_warm),
        ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "WARPGROUP"),
        div16=("beta_ptr", "gcum_ptr", "vnew_ptr", "h0_ptr", "cu_ptr", "chunk_off_ptr")
        + (("sel_ptr", "seg_ptr") if _warm else ()),
        description="GDN backward's recompute of h and Vnew in the gate-free form (no W, no U): two state partitions "
                    "of 64 columns, a TMA-store partition, H16/HV32 K=V=128 bf16"
                    + (", the segment launch" if _warm else "")))
