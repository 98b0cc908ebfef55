"""`linattn bench --modes decode`: the GDN decode step (`fused_recurrent_gated_delta_rule`, one token per sequence)
timed like every bench row (each backend in fresh processes, eager calls and CUDA-graph replays over input sets
spanning >= 3x the L2), against the copy bandwidth and against FLA's fused_recurrent_gated_delta_rule on the same
inputs.

A decode shape is a dict B, T (= 1), H, HV, K, V, `state` ("float32" or "bfloat16") and `pool`:
- pool=True, the serving mode (issue 6's target): the states live in a pool [B, HV, K, V] in a random slot order,
  `state_indices` picks each sequence's slot and the kernel writes the updated states back in place. FLA 0.6.0's
  decode has no pool: it runs in its own mode on the same start states (gathered once, outside the timing) and
  writes a new final state; the same state bytes move.
- pool=False, FLA's mode for both: initial_state [B, HV, K, V] read, a new final state written.
A shape with decay="channel" times KDA's decode instead (`fused_recurrent_kda`, g [B, 1, HV, K] the log decay per
key channel; FLA's peer fla.ops.kda.fused_recurrent_kda; presets kda_decode / kda_decode_tiny), the same modes.

The roofline is the state's bandwidth: `bytes` counts the state read and written once (q, k, v, o and the gates,
under 1% of the bytes at batch 256, are left out), so `% floor` is the percentage of the measured copy bandwidth
that the state's bytes reach. Outputs are compared with the first backend's; that backend's o (and its final
state in FLA's mode) is checked against the reference computed in fp64 from the same start states. Each backend's
first call in a process starts from the start states: args() puts them back into the pool.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

from linattn.bench.base import BenchOp, Runner, Unavailable

OP = "fused_recurrent_gated_delta_rule"
KDA_OP = "fused_recurrent_kda"


def _kda(shape: Dict) -> bool:
    return shape.get("decay") == "channel"

DECODE_BYTES_MODEL = ("decode: the state read and written once (B*HV*K*V elements of the state's dtype, twice); "
                      "q, k, v, o and the gates (< 1% at batch 256) are not counted, so % floor is the share of the "
                      "measured copy bandwidth the state's bytes reach (issue 6's target: >= 90% at batch 256).")


def _state_dtype(shape: Dict) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[shape["state"]]


def decode_inputs(shape: Dict, device, seed: int, mode: str = "decode", dtype=torch.bfloat16) -> Dict:
    """bf16 q, k (L2-normalised), v; fp32 g (log decay, mean about -0.02 per token; [B, 1, HV, K] for KDA) and beta
    in (0, 1); the start states h0 [B, HV, K, V] ([B, HV, V, K] for a shape with v_first; x 0.5, in the state's
    dtype) and, in pool mode, a pool of B slots holding them in a random order (pool[idx[n]] = h0[n]). Drawn on the
    device."""
    if mode != "decode":
        raise ValueError(f"the decode bench op has only the 'decode' mode, got {mode!r}")
    B, H, HV, K, V = (shape[x] for x in ("B", "H", "HV", "K", "V"))
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, device=dev, generator=gen, dtype=torch.float32)

    g_shape = (B, 1, HV, K) if _kda(shape) else (B, 1, HV)
    out = dict(q=rnd(B, 1, H, K).to(dtype), k=F.normalize(rnd(B, 1, H, K), dim=-1).to(dtype),
               v=rnd(B, 1, HV, V).to(dtype), g=F.logsigmoid(rnd(*g_shape) + 4.0),
               beta=torch.sigmoid(rnd(B, 1, HV)),
               h0=(rnd(*((B, HV, V, K) if shape.get("v_first") else (B, HV, K, V))) * 0.5).to(_state_dtype(shape)))
    if shape["pool"]:
        idx = torch.randperm(B, device=dev, generator=gen).to(torch.int32)
        pool = torch.empty_like(out["h0"])
        pool[idx.long()] = out["h0"]
        out.update(pool=pool, idx=idx)
    return out


def decode_flops(shape: Dict, mode: str, runner: str = "") -> float:
    """gdn-math.md's recurrent step: ~6*K*V per token and value head (decay, k^T S, the rank-1 update, q^T S)."""
    return 6.0 * shape["B"] * shape["T"] * shape["HV"] * shape["K"] * shape["V"]


def decode_bytes(shape: Dict, mode: str, runner: str = "") -> float:
    es = torch.empty((), dtype=_state_dtype(shape)).element_size()
    return 2.0 * shape["B"] * shape["HV"] * shape["K"] * shape["V"] * es


def _common(inp: Dict) -> Dict:
    return {n: inp[n] for n in ("q", "k", "v", "g", "beta")}


def _layout(shape: Dict) -> Dict:
    """The state layout keyword of every runner: FLA, linattn and the reference all take state_v_first."""
    return dict(state_v_first=True) if shape.get("v_first") else {}


def _outs(shape: Dict) -> tuple:
    """The outputs compared: o, and the new final state in FLA's mode (in pool mode the states are in the pool)."""
    return ("o",) if shape["pool"] else ("o", "final_state")


def _ours_kwargs(shape: Dict, inp: Dict) -> Dict:
    state = (dict(initial_state=inp["pool"], state_indices=inp["idx"], inplace=True) if shape["pool"]
             else dict(initial_state=inp["h0"], output_final_state=True))
    return dict(_common(inp), **state, **_layout(shape))


def _ours_args(shape: Dict):
    def args(inp: Dict, mode: str):
        if shape["pool"]:
            # the set's slots back to its start states, so that every backend's check call (the first call after
            # args) starts where the first backend's did; timed calls then keep updating the pool in place
            inp["pool"][inp["idx"].long()] = inp["h0"]
        return _ours_kwargs(shape, inp), (), ()
    return args


def _prepare_ours(name: str, shape: Dict, inputs: Dict) -> Runner:
    import linattn  # noqa: F401  (registers the op's backends)
    from linattn.backends import op_backends
    if _kda(shape):
        from linattn.ops.kda.fused_recurrent import fused_recurrent_kda as op_fn
    else:
        from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as op_fn
    op = KDA_OP if _kda(shape) else OP
    reg = op_backends(op)
    kw = _ours_kwargs(shape, inputs)
    if name == "auto":
        try:
            picked = reg.select("auto", **kw).name
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"auto picks nothing: {e}")
        how = f"backend='auto' (picks {picked})"
    elif name in reg.backends:
        ok, reason = reg.backends[name].supports(**kw)
        if not ok:
            raise Unavailable(f"supports() rejects: {reason}")
        how = f"backend={name!r}"
    else:
        raise Unavailable(f"not registered for {op} (registered: {reg.names()})")
    notes = [how + (", pool updated in place" if shape["pool"] else ", FLA's mode (new final state)")]
    return Runner(name, lambda **a: op_fn(**a, backend=name), _ours_args(shape), _outs(shape), (), notes=notes)


def _prepare_reference(shape: Dict, inputs: Dict) -> Runner:
    """fp64 from the set's start states h0 (never the pool, which earlier rows updated)."""
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference

    def args(inp, mode):
        kw = {n: t.double() for n, t in _common(inp).items()}
        if _kda(shape):                               # the per-key-channel log decay
            kw.update(g=None, gk=kw["g"], gk_mode="log")
        return dict(kw, initial_state=inp["h0"].double(), output_final_state=True, **_layout(shape)), (), ()
    return Runner("reference", fused_recurrent_reference, args, _outs(shape), (), notes=["fp64, from the start states"])


def _prepare_fla(shape: Dict, inputs: Dict) -> Runner:
    try:
        import fla
        if _kda(shape):
            from fla.ops.kda import fused_recurrent_kda as fla_decode
        else:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_decode
    except Exception as e:                            # ImportError, or a driver query failing on a CPU
        raise Unavailable(f"fla not importable: {type(e).__name__}: {e}")
    what = "fla.ops.kda.fused_recurrent_kda" if _kda(shape) else "fused_recurrent_gated_delta_rule"

    def args(inp, mode):
        return dict(_common(inp), initial_state=inp["h0"], output_final_state=True, **_layout(shape)), (), ()
    return Runner("fla", lambda **kw: fla_decode(**kw), args, _outs(shape), (), family="peer",
                  notes=[f"fla {getattr(fla, '__version__', '?')} {what}: its own mode "
                         "(h0 -> a new final state; no pool)" if shape["pool"] else
                         f"fla {getattr(fla, '__version__', '?')} {what}"])


def decode_prepare(backend: str, shape: Dict, inputs: Dict, mode: str) -> Runner:
    if mode != "decode":
        raise Unavailable(f"the decode bench op has only the 'decode' mode, got {mode!r}")
    if backend == "fla":
        return _prepare_fla(shape, inputs)
    if backend == "reference":
        return _prepare_reference(shape, inputs)
    if backend in ("flashqla", "sdpa"):
        raise Unavailable(f"{backend} has no decode step to compare")
    return _prepare_ours(backend, shape, inputs)


GATED_DELTA_RULE_DECODE = BenchOp(
    name="gated_delta_rule_decode", registry_op=OP, linattn_backends=("auto", "triton", "gluon", "reference"),
    peers=("fla", "flashqla", "sdpa"), make_inputs=decode_inputs, flops=decode_flops, bytes=decode_bytes,
    bytes_model=DECODE_BYTES_MODEL, prepare=decode_prepare, typical_call=lambda device: None,
    api_module="linattn.ops.gated_delta_rule.fused_recurrent", max_sets=64, modes=("decode",))


def decode_targets(rows, column: str = "graph") -> Dict:
    """Issue 6's targets from a decode bench's rows, in one timing column ("graph" or "eager"; the first linattn
    backend that ran each shape in that column): batch 256 fp32 pool >= 90% of copy, batch 1 and 32 fp32 pool no
    slower than FLA, batch 1 <= 8 us, bf16 pool >= 1.7x fp32's speed at batch 256; from KDA rows (decay "channel")
    issue 35's batch 256 fp32 pool >= 90% of copy (per state layout). A target whose rows did not run is absent."""
    ours, fla = {}, {}
    for r in rows:
        col = r.get(column) or {}
        if r.get("status") != "ok" or col.get("status") != "ok" or r["mode"] != "decode" or not r["shape"].get("pool"):
            continue
        key = (r["shape"]["B"], r["shape"]["state"])
        if r["shape"].get("v_first"):
            key = ("v_first",) + key
        if _kda(r["shape"]):
            key = ("kda",) + key
        if r["backend"] == "fla":
            fla[key] = col
        elif r.get("family") == "linattn" and r["backend"] != "reference" and key not in ours:
            ours[key] = col
    t = {}
    for layout in ((), ("v_first",)):
        c = ours.get(("kda",) + layout + (256, "float32"))
        if c and c.get("pct_of_floor") is not None:
            name = "kda_" + "".join(x + "_" for x in layout) + "batch256"
            t[name + "_fp32_pct_of_copy"] = c["pct_of_floor"]
            t[name + "_ge_90pct_copy"] = c["pct_of_floor"] >= 90.0
    c = ours.get((256, "float32"))
    if c and c.get("pct_of_floor") is not None:
        t["batch256_fp32_pct_of_copy"] = c["pct_of_floor"]
        t["batch256_ge_90pct_copy"] = c["pct_of_floor"] >= 90.0
    for B in (1, 32):
        if (B, "float32") in ours and (B, "float32") in fla:
            t[f"batch{B}_not_slower_than_fla"] = ours[(B, "float32")]["median_ms"] <= fla[(B, "float32")]["median_ms"]
    if (1, "float32") in ours:
        t["batch1_us"] = ours[(1, "float32")]["median_ms"] * 1e3
        t["batch1_le_8us"] = t["batch1_us"] <= 8.0
    if (256, "float32") in ours and (256, "bfloat16") in ours:
        t["bf16_speedup_b256"] = ours[(256, "float32")]["median_ms"] / ours[(256, "bfloat16")]["median_ms"]
        t["bf16_ge_1.7x_b256"] = t["bf16_speedup_b256"] >= 1.7
    return t
