"""AOT registrations of the causal convolution's Triton kernels (`linattn inspect`): the forward and backward at the
configs the launchers pick for the GatedDeltaNet layer's value convolution (D = 4096 channels, W = 4, SiLU, bf16, no
bias or states, equal-length sequences, x contiguous: the JIT makes a unit stride a constant; the q / k
convolutions differ only in D)."""
from __future__ import annotations

from linattn.runtime.aot import AotKernel, register

MOD = "linattn.ops.conv1d.triton.conv1d"
D, W = 4096, 4
_X, _F, _I64 = "*bf16", "*fp32", "*i64"


def _build(kname: str, sig: dict, const: dict, warps: int):
    def build():
        import importlib
        fn = getattr(importlib.import_module(MOD), kname)
        return fn, {**sig, **{name: "constexpr" for name in const}}, const, {"num_warps": warps, "num_stages": 1}
    return build


def _register(name: str, kname: str, sig: dict, const: dict, warps: int, what: str):
    register(AotKernel(name, _build(kname, sig, const, warps), ("LDG.E",), archs=("sm_90a",), language="triton",
                       div16=tuple(n for n, t in sig.items()
                                   if t.startswith("*") or n in ("D", "stride_b", "stride_t")),
                       description=f"causal_conv1d {what}, Triton, D={D} W={W} SiLU bf16, {warps} warps"))


_OFF = dict(W=W, LOG_N=0, SILU=True, HAS_BIAS=False, HAS_H0=False, IS_VARLEN=False)
_register("conv1d_fwd_w4", "conv1d_fwd_kernel",
          dict(x=_X, weight=_X, bias=_X, residual=_X, h0=_X, cu_seqlens=_I64, y=_X, T="i32", N="i32", D="i32",
               stride_b="i32", stride_t="i32"),
          dict(_OFF, stride_d=1, L=128, U=8, BD=256, HAS_RES=False), 1, "forward: the token stream")
_register("conv1d_bwd_w4", "conv1d_bwd_kernel",
          dict(x=_X, weight=_X, bias=_X, h0=_X, cu_seqlens=_I64, dy=_X, dht=_X, dx=_X, dw_part=_F, db_part=_F,
               T="i32", N="i32", D="i32", NSEG="i32", stride_b="i32", stride_t="i32"),
          dict(_OFF, stride_d=1, L=128, U=8, BD=256, HAS_DHT=False), 1,
          "backward: the token stream's da, dx and dweight partials")
