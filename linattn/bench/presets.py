"""Shape presets. A shape is a dict: B, T, H, HV, K, V and, for varlen, `lengths` (then B = 1 and T = sum).

`production`: the sizes people train and serve at (shared/anchors.md); `quick`: three rows for `verify`;
`tiny`: small enough for the Triton interpreter on a 2-core CPU. `production_hv32` / `_hv64` / `_hv8` split
`production` by head configuration, so each part fits one lease call on the H200 (FLA re-autotunes per
head configuration: see benchmarks/gpu/bench_production.sh for the estimate).
"""
import random
from typing import Dict, List

HEADS = {"hv32": (16, 32), "hv64": (16, 64), "hv8": (2, 8)}
PRODUCTION_BT = [(1, 8192), (1, 32768), (1, 65536), (8, 4096), (4, 16384)]


def varlen_lengths(n: int, lo: int, hi: int, seed: int) -> List[int]:
    """n sequence lengths uniform in [lo, hi] from a fixed seed: the same mix on every machine and run."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def varlen_shape(lengths, H, HV, K, V) -> Dict:
    return dict(B=1, T=sum(lengths), H=H, HV=HV, K=K, V=V, lengths=list(lengths))


def _dense(B, T, H, HV, K=128, V=128) -> Dict:
    return dict(B=B, T=T, H=H, HV=HV, K=K, V=V)


# 24 sequences of 256..4096 tokens, H=16, HV=32: the varlen row of anchors.md
PRODUCTION_VARLEN = varlen_shape(varlen_lengths(24, 256, 4096, seed=2024), 16, 32, 128, 128)


# The default gates decay fast (mean log decay -0.116 per token, -7.4 per 64-token chunk): a kernel that drops history
# once its summed decay is negligible (FlashQLA's segment warm-up) looks back only ~2
# chunks there. Long-memory heads decay far slower: this row scales g by 0.01 (-0.074 per chunk).
SLOW_DECAY = dict(_dense(1, 65536, 16, 32), g_scale=0.01)


def _production_part(tag: str) -> List[Dict]:
    H, HV = HEADS[tag]
    rows = [_dense(B, T, H, HV) for B, T in PRODUCTION_BT]
    return rows + ([PRODUCTION_VARLEN, SLOW_DECAY] if tag == "hv32" else [])


PRESETS = {
    "production_hv32": _production_part("hv32"),
    "production_hv64": _production_part("hv64"),
    "production_hv8": _production_part("hv8"),
    "quick": [_dense(1, 8192, 16, 32), _dense(8, 4096, 16, 32), PRODUCTION_VARLEN],
    # short calls, where an eager call is host-bound (a decode-time prefill chunk, a small training batch)
    "short": [_dense(1, 256, 16, 32), _dense(1, 1024, 16, 32), _dense(1, 4096, 16, 32), _dense(8, 512, 16, 32)],
    # interpreter-sized: one dense row of two chunks and a varlen row with a 1-token sequence
    "tiny": [_dense(1, 128, 2, 4, 32, 32), varlen_shape([1] + varlen_lengths(2, 20, 90, seed=7), 2, 4, 32, 32)],
}
PRESETS["production"] = PRESETS["production_hv32"] + PRESETS["production_hv64"] + PRESETS["production_hv8"]


def _decode(B, state="float32", pool=True, H=32, HV=32, K=128, V=128, decay=None, v_first=False) -> Dict:
    s = dict(B=B, T=1, H=H, HV=HV, K=K, V=V, state=state, pool=pool)
    if decay:                                      # "channel": KDA's decode (linattn.bench.decode)
        s["decay"] = decay
    if v_first:                                    # states [.., V, K] (state_v_first=True) in every runner
        s["v_first"] = True
    return s


# decode (`--modes decode`, issue 6's targets): H = HV = 32, K = V = 128, the serving pool at batch 1 / 32 / 256 with
# an fp32 state, 256 with a bf16 state, batch 256 in FLA's mode (no pool, a new final state) and with V-first states
PRESETS["decode"] = [_decode(1), _decode(32), _decode(256), _decode(256, "bfloat16"), _decode(256, pool=False),
                     _decode(256, v_first=True)]
PRESETS["decode_tiny"] = [_decode(3, H=2, HV=4, K=32, V=32), _decode(2, "bfloat16", H=2, HV=2, K=32, V=32),
                          _decode(2, pool=False, H=1, HV=2, K=32, V=32)]
# KDA's decode (`--modes decode --preset kda_decode`, issue 35's target: >= 90% of the copy bandwidth at batch 256)
PRESETS["kda_decode"] = [_decode(1, decay="channel"), _decode(256, decay="channel"),
                         _decode(256, pool=False, decay="channel"), _decode(256, decay="channel", v_first=True)]
PRESETS["kda_decode_tiny"] = [_decode(3, H=2, HV=4, K=32, V=32, decay="channel"),
                              _decode(2, pool=False, H=1, HV=2, K=32, V=32, decay="channel"),
                              _decode(2, H=1, HV=2, K=32, V=16, decay="channel", v_first=True),
                              _decode(2, pool=False, H=1, HV=2, K=32, V=16, decay="channel", v_first=True)]

# chunk_kda (`--op kda`): Kimi Linear's heads, H = HV = 32, K = V = 128, with states; tiny for the interpreter (two
# chunks with a ragged end, and varlen with a 1-token sequence)
PRESETS["kda_production"] = [_dense(1, 32768, 32, 32), _dense(8, 4096, 32, 32), _dense(4, 16384, 32, 32)]
PRESETS["kda_tiny"] = [_dense(1, 100, 1, 2, 16, 16), varlen_shape([1, 70, 5], 1, 2, 16, 16)]

# the GatedDeltaNet layer (`--op layer_gdn`): issue 34's sizes (hidden 2048, 16 q/k heads, 32 v heads, head dim 128)
PRESETS["layer"] = [dict(_dense(1, 8192, 16, 32), hidden=2048), dict(_dense(8, 4096, 16, 32), hidden=2048)]
PRESETS["layer_tiny"] = [dict(_dense(1, 80, 2, 4, 16, 16), hidden=64)]
# the layer's decode step (`--op layer_gdn --modes step`): B sequences, one new token each after a 16-token prefill
PRESETS["layer_step"] = [dict(_dense(1, 1, 16, 32), hidden=2048), dict(_dense(64, 1, 16, 32), hidden=2048)]
PRESETS["layer_step_tiny"] = [dict(_dense(3, 1, 2, 4, 16, 16), hidden=64)]
# the Kimi Delta Attention layer (`--op layer_kda`): Kimi Linear's heads (hidden 2304, 32 heads, head dim 128)
PRESETS["layer_kda"] = [dict(_dense(1, 8192, 32, 32), hidden=2304), dict(_dense(8, 4096, 32, 32), hidden=2304)]
PRESETS["layer_kda_tiny"] = [dict(_dense(1, 80, 2, 4, 16, 16), hidden=64)]
PRESETS["layer_kda_step"] = [dict(_dense(1, 1, 32, 32), hidden=2304), dict(_dense(64, 1, 32, 32), hidden=2304)]
PRESETS["layer_kda_step_tiny"] = [dict(_dense(3, 1, 2, 4, 16, 16), hidden=64)]

CPU_PRESETS = ("tiny", "decode_tiny", "kda_decode_tiny", "kda_tiny", "layer_tiny", "layer_step_tiny", "layer_kda_tiny",
               "layer_kda_step_tiny")


def shape_label(s: Dict) -> str:
    head = f"H{s['H']}/HV{s['HV']} K{s['K']} V{s['V']}"
    decay = f" g x{s['g_scale']:g}" if s.get("g_scale", 1.0) != 1.0 else ""
    if s.get("lengths"):
        return f"varlen{len(s['lengths'])} T{s['T']} {head}{decay}"
    if "state" in s:                               # a decode shape (linattn.bench.decode)
        mode = ("pool in place" if s.get("pool") else "no pool") + (", V-first" if s.get("v_first") else "")
        kda = "KDA " if s.get("decay") == "channel" else ""
        return f"{kda}B{s['B']} T{s['T']} {head} {s['state']} state, {mode}"
    layer = f" hidden {s['hidden']}" if "hidden" in s else ""
    return f"B{s['B']} T{s['T']} {head}{decay}{layer}"


def get_preset(name: str) -> List[Dict]:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return [dict(s) for s in PRESETS[name]]
