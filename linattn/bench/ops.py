"""The bench op registry: for each op, how to make inputs, how much work and traffic it is (for the roofline),
and which implementations can be timed (linattn's backends by name, and peers: FLA, FlashQLA, SDPA).

A backend is prepared into a `Runner` or refused with `Unavailable(reason)`; the reason goes into the row,
so a missing package or a rejecting `supports()` is visible, never silently dropped.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from linattn.bench.base import BenchOp, Runner, Unavailable, delta_rule_inputs, gdn_flops  # noqa: F401  (re-exported: the bench's types)
from linattn.bench.decode import GATED_DELTA_RULE_DECODE
from linattn.bench.conv import CONV_GDN
from linattn.bench.kda import KDA
from linattn.bench.layer import LAYER_GDN, LAYER_KDA

GDN_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
GDN_LEAVES = ("q", "k", "v", "g", "beta", "initial_state")


# ---------------------------------------------------------------------------------------- Gated DeltaNet

def gdn_inputs(shape: Dict, device, seed: int, mode: str = "fwd", dtype=torch.bfloat16) -> Dict:
    """bf16 q/k/v (k L2-normalised), fp32 g (log decay in about [-0.3, 0), mean -0.116 per token; times the
    shape's "g_scale" where given: a slow-decay row), fp32 beta in (0, 1), fp32 initial state; with mode "fwdbwd" also the output gradients do, dht. Drawn on the device (production sizes are
    gigabytes: a CPU generator would dominate the run)."""
    return delta_rule_inputs(shape, device, seed, mode, dtype, GDN_LEAVES)


GDN_BYTES_MODEL = (
    "fwd: q,k read once (H heads, bf16), v read and o written once (HV heads, bf16), g and beta read (fp32), "
    "initial state read and final state written (fp32). fwd+bwd: the forward's bytes, plus the backward reading "
    "q,k,v,g,beta, the initial state, do and dht once and writing dq,dk,dv,dg,dbeta,dh0 once (recomputation "
    "and saved intermediates are not compulsory, so not counted). sdpa: q,k,v read and o written once "
    "(B,T,HV,K bf16); fwd+bwd adds q,k,v,o,do read and dq,dk,dv written.")


def gdn_bytes(shape: Dict, mode: str, runner: str = "") -> float:
    B, T, H, HV, K, V = (shape[x] for x in ("B", "T", "H", "HV", "K", "V"))
    es = 2                                         # bf16 operands
    if runner == "sdpa":
        one = B * T * HV * K * es
        return float(4 * one if mode == "fwd" else 12 * one)
    N = len(shape["lengths"]) if shape.get("lengths") else B
    qk = 2 * B * T * H * K * es
    v = B * T * HV * V * es
    o = v
    gb = 2 * B * T * HV * 4
    state = N * HV * K * V * 4
    fwd = qk + v + o + gb + 2 * state
    if mode == "fwd":
        return float(fwd)
    inputs = qk + v + gb + state
    return float(fwd + 2 * inputs + o + state)    # read inputs, do, dht; write grads of the inputs


def _gdn_call_args(inputs: Dict, mode: str, cu_dtype=None):
    """(kwargs, leaves, output grads). Called once per input set outside the timed region, so converting
    cu_seqlens to the peers' int64 costs nothing in the timing."""
    kw = {n: inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")}
    cu = inputs.get("cu_seqlens")
    kw.update(output_final_state=True, cu_seqlens=cu if cu is None or cu_dtype is None else cu.to(cu_dtype))
    if mode != "fwdbwd":
        return kw, (), ()
    return kw, tuple(inputs[n] for n in GDN_LEAVES), (inputs["do"], inputs["dht"])


def _ensure_gdn_registered():
    """Import the op's package so its backends register; None, or the import error as text."""
    try:
        import linattn  # noqa: F401
        import linattn.ops.gated_delta_rule.api  # noqa: F401
        return None
    except ImportError as e:                      # the API may not exist yet in this tree
        return f"linattn.ops.gated_delta_rule.api not importable: {e}"


def _gdn_public():
    import linattn
    fn = getattr(linattn, "chunk_gated_delta_rule", None)
    if fn is None:
        try:
            from linattn.ops.gated_delta_rule.api import chunk_gated_delta_rule as fn
        except ImportError:
            fn = None
    return fn


def linattn_gdn_callable(name: str, call: Optional[Dict] = None) -> Tuple[Callable, str]:
    """A callable (q, k, v, g, beta, ..., no backend) for linattn backend `name`, and how it is reached.
    Raises Unavailable when the registry lacks it or its supports() rejects `call`."""
    from linattn.backends import op_backends
    import_err = _ensure_gdn_registered()
    reg = op_backends("chunk_gated_delta_rule")
    if name in reg.backends:
        if call is not None:
            ok, reason = reg.backends[name].accepts(**call)
            if not ok:
                raise Unavailable(f"supports() rejects: {reason}")
        public = _gdn_public()
        if public is not None:
            return (lambda **kw: public(**kw, backend=name)), "linattn.chunk_gated_delta_rule(backend=...)"
        impl = reg.backends[name].impl
        return impl, "registry impl (public API not importable)"
    if name == "reference":
        from linattn.ops.gated_delta_rule.reference import chunk_gated_delta_rule as ref
        return ref, "reference module (not registered: " + (import_err or "no reference backend") + ")"
    raise Unavailable(f"not registered for chunk_gated_delta_rule (registered: {reg.names()}"
                      + (f"; {import_err}" if import_err else "") + ")")


def _prepare_linattn(name, shape, inputs, mode) -> Runner:
    call, _, _ = _gdn_call_args(inputs, "fwd")
    call["scale"] = None
    call["use_qk_l2norm_in_kernel"] = False
    fn, how = linattn_gdn_callable(name, call)
    return Runner(name, fn, lambda inp, m: _gdn_call_args(inp, m), ("o", "final_state"), GDN_GRADS,
                  notes=[how])


def _prepare_fla(shape, inputs, mode) -> Runner:
    # FLA dispatches to FlashQLA when that is installed, and its "common" ops to TileLang on Hopper: time
    # FLA's own Triton path (the anchors' FLA numbers), unless the user set these variables otherwise.
    os.environ["FLA_FLASH_QLA"] = "0"
    os.environ.setdefault("FLA_TILELANG", "0")
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except Exception as e:                            # ImportError, or a driver query failing on a CPU
        raise Unavailable(f"fla not importable: {type(e).__name__}: {e}")
    r = Runner("fla", lambda **kw: fla_gdn(**kw), lambda inp, m: _gdn_call_args(inp, m, torch.int64),
               ("o", "final_state"), GDN_GRADS, family="peer",
               notes=[f"fla {getattr(fla, '__version__', '?')}, FLA_FLASH_QLA=0, "
                      f"FLA_TILELANG={os.environ['FLA_TILELANG']}"])
    if mode == "fwdbwd" and _bypass_fla_hopper_guard():
        r.grads_verified = False
        r.notes.append("FLA refuses its gated backward on Hopper with Triton >= 3.4, < 3.7.1 (FLA issues 640, 984: "
                       "wrong dbeta/dg); guard bypassed for timing, gradients unverified")
    return r


def _bypass_fla_hopper_guard() -> bool:
    """FLA 0.6.0 raises in fla.ops.common.chunk_o.chunk_bwd_dqkwg when IS_NVIDIA_HOPPER and Triton is in
    [3.4, 3.7.1). The check reads module globals at call time, so flipping the module's TRITON_ABOVE_3_7_1
    lets its backward run. True when the guard would have fired (and is now bypassed)."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception:
        return False
    fires = (getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
             and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True))
    if fires:
        chunk_o.TRITON_ABOVE_3_7_1 = True
        chunk_o._linattn_guard_bypassed = True      # later calls in this process still report the bypass
    return bool(getattr(chunk_o, "_linattn_guard_bypassed", False))


def _prepare_flashqla(shape, inputs, mode) -> Runner:
    try:
        import flash_qla
    except Exception as e:
        raise Unavailable(f"flash_qla not importable: {type(e).__name__}: {e}")
    return Runner("flashqla", lambda **kw: flash_qla.chunk_gated_delta_rule(**kw),
                  lambda inp, m: _gdn_call_args(inp, m, torch.int64), ("o", "final_state"), GDN_GRADS,
                  family="peer", notes=[f"flash_qla {getattr(flash_qla, '__version__', '?')} (auto intra-card CP)"])


def _prepare_sdpa(shape, inputs, mode) -> Runner:
    """Causal softmax attention at the same B, T, heads = HV, head size = K, bf16: what a user would pick
    instead. It computes another function, so its output is not compared."""
    if shape.get("lengths"):
        raise Unavailable("varlen: plain SDPA has no cu_seqlens (would need nested tensors or a loop)")
    B, T, HV, K = shape["B"], shape["T"], shape["HV"], shape["K"]
    dev = inputs["q"].device
    gen = torch.Generator(device=dev).manual_seed(1234)
    t = [torch.randn(B, HV, T, K, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16)
         for _ in range(4)]
    if mode == "fwdbwd":
        for x in t[:3]:
            x.requires_grad_(True)

    def args(inp, m):
        kw = dict(query=t[0], key=t[1], value=t[2], is_causal=True)
        return (kw, (), ()) if m != "fwdbwd" else (kw, tuple(t[:3]), (t[3],))

    def fn(**kw):
        return (F.scaled_dot_product_attention(**kw),)

    return Runner("sdpa", fn, args, ("o",), ("dq", "dk", "dv"), compare=False, family="peer",
                  notes=["causal softmax attention, heads=HV, head size=K: another function, not compared"])


def gdn_prepare(backend: str, shape: Dict, inputs: Dict, mode: str) -> Runner:
    if backend == "fla":
        return _prepare_fla(shape, inputs, mode)
    if backend == "flashqla":
        return _prepare_flashqla(shape, inputs, mode)
    if backend == "sdpa":
        return _prepare_sdpa(shape, inputs, mode)
    return _prepare_linattn(backend, shape, inputs, mode)


def gdn_typical_call(device) -> Dict:
    """A typical training call (B=1, T=8192, H=16, HV=32, K=V=128, bf16, states) on a GPU; on the CPU a
    tiny one (the interpreter's sizes). Uninitialised tensors: supports() looks at shapes and dtypes only."""
    dev = torch.device(device)
    B, T, H, HV, K, V = (1, 8192, 16, 32, 128, 128) if dev.type == "cuda" else (1, 128, 2, 4, 32, 32)
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    return dict(q=e(B, T, H, K), k=e(B, T, H, K), v=e(B, T, HV, V), g=e(B, T, HV, dt=torch.float32),
                beta=e(B, T, HV, dt=torch.float32), scale=None,
                initial_state=e(B, HV, K, V, dt=torch.float32), output_final_state=True, cu_seqlens=None,
                use_qk_l2norm_in_kernel=False)


GATED_DELTA_RULE = BenchOp(
    name="gated_delta_rule", registry_op="chunk_gated_delta_rule",
    linattn_backends=("triton", "gluon", "reference"), peers=("fla", "flashqla", "sdpa"),
    make_inputs=gdn_inputs, flops=gdn_flops, bytes=gdn_bytes, bytes_model=GDN_BYTES_MODEL,
    prepare=gdn_prepare, typical_call=gdn_typical_call)

BENCH_OPS: Dict[str, BenchOp] = {"gated_delta_rule": GATED_DELTA_RULE}
# the names users may also type: the registry op name
BENCH_OPS["chunk_gated_delta_rule"] = GATED_DELTA_RULE
BENCH_OPS["gated_delta_rule_decode"] = GATED_DELTA_RULE_DECODE
BENCH_OPS["fused_recurrent_gated_delta_rule"] = GATED_DELTA_RULE_DECODE
BENCH_OPS["kda"] = KDA
BENCH_OPS["chunk_kda"] = KDA
BENCH_OPS["layer_gdn"] = LAYER_GDN
BENCH_OPS["layer_kda"] = LAYER_KDA
BENCH_OPS["conv_gdn"] = CONV_GDN


def get_bench_op(name: str) -> BenchOp:
    if name not in BENCH_OPS:
        raise KeyError(f"unknown op {name!r}; known: {sorted(BENCH_OPS)}")
    return BENCH_OPS[name]


def bench_op_for_registry(op: str) -> Optional[BenchOp]:
    return next((b for b in BENCH_OPS.values() if b.registry_op == op), None)


def no_kernel_here(device) -> str:
    """Why none of linattn's kernels can run on `device`, or "": CPU tensors in a process where Triton does not
    interpret (the registry then runs only the PyTorch reference)."""
    from linattn.runtime.device import interpreter_mismatch, triton_interprets
    if torch.device(device).type == "cuda" or triton_interprets():
        return ""
    return interpreter_mismatch() or ("no CUDA GPU here and Triton does not interpret in this process, so none of "
                                      "linattn's kernels can run: set TRITON_INTERPRET=1 before Python starts "
                                      "(e.g. `TRITON_INTERPRET=1 linattn ...`) to run the Triton kernels on the CPU")
