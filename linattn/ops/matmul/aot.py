"""AOT registrations of the matmul kernels: what `linattn inspect` compiles and tests/test_aot_gluon.py checks."""
from __future__ import annotations

from linattn.runtime.aot import AotKernel, register

_GLUON_INTENDED = ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "WARPGROUP")


def _desc_sig(dtype_name: str, block):
    from linattn.runtime.gluon_compat import gl
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32}[dtype_name]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    # exactly the string the JIT derives (triton.runtime.jit.mangle_type) for a Gluon TensorDescriptor
    return f"tensordesc<{dtype_name}[{', '.join(map(str, block))}],{layout!r}>"


def _gluon_build(cfg_name: str, a_t: bool, b_t: bool, dtype: str):
    def build():
        from linattn.ops.matmul.gluon.matmul import CONFIGS, matmul_ws_persistent
        c = CONFIGS[cfg_name]
        a_block = [c.BK, c.BM] if a_t else [c.BM, c.BK]
        b_block = [c.BN, c.BK] if b_t else [c.BK, c.BN]
        # split-K writes fp32 partials
        c_dtype = "fp32" if c.split_k > 1 else dtype
        sig = {"a_desc": _desc_sig(dtype, a_block), "b_desc": _desc_sig(dtype, b_block),
               "c_desc": _desc_sig(c_dtype, [c.BM, c.BN]), "M": "i32", "N": "i32", "K": "i32",
               "A_T": "constexpr", "B_T": "constexpr", "STAGES": "constexpr", "GROUP_M": "constexpr",
               "SPLIT_K": "constexpr"}
        constexprs = {"A_T": a_t, "B_T": b_t, "STAGES": c.stages, "GROUP_M": c.group_m, "SPLIT_K": c.split_k}
        return matmul_ws_persistent, sig, constexprs, {"num_warps": c.num_warps}
    return build


def _triton_build(cfg_name: str, dtype: str):
    def build():
        from linattn.ops.matmul.triton.matmul import CONFIGS, matmul_grouped
        c = CONFIGS[cfg_name]
        sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32",
               "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32",
               "stride_cm": "i32", "stride_cn": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
               "GROUP_M": "constexpr", "EVEN_K": "constexpr"}
        # What the JIT specialises for a row-major call: unit inner strides are the constant 1.
        constexprs = {"stride_ak": 1, "stride_bn": 1, "stride_cn": 1, "BM": c.BM, "BN": c.BN, "BK": c.BK,
                      "GROUP_M": c.group_m, "EVEN_K": True}
        sig.update({k: "constexpr" for k in ("stride_ak", "stride_bn", "stride_cn")})
        return matmul_grouped, sig, constexprs, {"num_warps": c.num_warps, "num_stages": c.num_stages}
    return build


for _cfg in ("128x256x64_s3_w8", "128x128x64_s5_w8", "128x128x64_s5_w8_k2", "128x128x64_s5_w8_k4"):
    register(AotKernel(f"matmul_gluon_{_cfg}", _gluon_build(_cfg, False, False, "bf16"), _GLUON_INTENDED,
                       description=f"persistent warp-specialised TMA+WGMMA GEMM, {_cfg}, A and B row-major, bf16"))
register(AotKernel("matmul_gluon_128x256x64_s3_w8_tt_fp16", _gluon_build("128x256x64_s3_w8", True, True, "fp16"),
                   _GLUON_INTENDED, description="same kernel, A and B stored transposed, fp16"))
register(AotKernel("matmul_gluon_128x128x64_s5_w8_k4_tt_fp16", _gluon_build("128x128x64_s5_w8_k4", True, True, "fp16"),
                   _GLUON_INTENDED, description="split-K config, A and B stored transposed, fp16"))
register(AotKernel("matmul_triton_128x256x64_s3_w8", _triton_build("128x256x64_s3_w8", "bf16"), ("HGMMA",),
                   archs=("sm_90a", "sm_80"), language="triton",
                   div16=("a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_bk", "stride_cm"),
                   description="textbook grouped Triton GEMM (Triton pipelines it with WGMMA on sm_90a)"))



def _linear_group_build(BM: int):
    def build():
        from linattn.ops.matmul.linear_group import BK, BN
        from linattn.ops.matmul.triton.linear_group import linear_group_kernel
        sig = {"x": "*bf16", "table": "*i64", "out": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32",
               "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "DOT_PREC": "constexpr"}
        return linear_group_kernel, sig, {"BM": BM, "BN": BN, "BK": BK, "DOT_PREC": "tf32"}, \
            {"num_warps": 4, "num_stages": 4}
    return build


# LinearGroup at a decode step's rows (1 -> 16, 64), K = 2048 (the GatedDeltaNet layer's hidden size), bf16
for _bm, _mma in ((16, "HMMA"), (64, "HGMMA")):             # mma.sync below 64 rows, wgmma at 64
    register(AotKernel(f"linear_group_bm{_bm}_w4", _linear_group_build(_bm), (_mma, "LDGSTS"), language="triton",
                       div16=("x", "table", "out", "K", "stride_xm"),
                       description=f"LinearGroup: a decode step's projections in one launch, {_bm} rows, bf16"))
