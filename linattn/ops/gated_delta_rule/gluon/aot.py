"""AOT registrations of the Gluon GDN kernels (state pass, reverse state pass, fused forward, stage 2a):
what `linattn inspect` compiles and tests check, at the production head shape H=16, HV=32, K=V=128."""
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
