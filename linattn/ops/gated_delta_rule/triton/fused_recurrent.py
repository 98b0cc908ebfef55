"""Gated DeltaNet decode on Triton: launch configs, the launcher and the AOT specs of the decode kernels
(decode_kernels.py). Two kernels, chosen by shape:
- the persistent kernel (decode_persistent_config): K-first fp32 states, one token per sequence, no cu_seqlens,
  K <= 128, and at least 32 tiles of BV = 64 per SM (large-batch serving);
- the one-tile kernel (decode_launch_config) everywhere else: V-first states, small batches, bf16 states,
  speculative T > 1, varlen, K > 128.
"""
import contextlib
from operator import itemgetter
from typing import Callable, Optional

import torch

from linattn.ops.gated_delta_rule.triton.decode_kernels import (fused_recurrent_gdn_fwd_kernel,
                                                                fused_recurrent_gdn_fwd_persistent_kernel)
from linattn.runtime.alloc import empty, poisoning
from linattn.runtime.device import device_facts
from linattn.runtime.host_path import (HostPath, MAX_PLANS, cdiv, current_device, hooks_active, kept_direct, launch,
                                       next_power_of_2, plain_c_launch)

# Decode is host-bound at small batches (3.5 us of kernel at batch 1 against tens of us of Python per call): the
# launch configs are kept per shape, and a launch goes through the compiled kernel's handle once its signature has
# been seen (runtime/host_path.py), skipping the JIT's argument binding and specialisation. `host_path.options`
# turns both off for a block (tests compare the two paths' launches).
host_path = HostPath(plan_cache=True, handle=True)
_CONFIGS: dict = {}
_PLANS: dict = {}


def decode_launch_config(N: int, HV: int, K: int, V: int, state_dtype: torch.dtype, num_sms: int,
                         v_first: bool = False):
    """(BK, BV, num_warps) of the one-tile kernel for N sequences.

    V-first states ([.., V, K]): a BV block is BV whole rows of K, contiguous at any BV, so the block is sized for
    one warp (4 KB of state, 32 fp32 values a thread; every reduction runs over K inside the warp). Measured on the
    H200 (H = 16, HV = 32, K = V = 128, fp32 pool in place, graph replays; benchmarks/OPT_LOG.md, "Decode: one-tile
    blocks by state layout"): BV = 8 with one warp ran batch 256 in 263 us (96% of the copy bandwidth) against
    362 us for the persistent walk and 302 us for BV = 64 with 8 warps; batch 64 in 68 us against 85 us; batch 1
    within noise (3.8-4.0 us). Two warps at the same BV cost 25% at batch 256.

    K-first fp32 states ([.., K, V]): 256-byte rows (BV = 64), halved while the grid has fewer than 4 programs per
    SM, down to 64-byte rows, and 16 KB of state per warp (fewer warps than bf16's rule below: the reductions over K
    cross fewer warps). Measured on the H200 (K = V = 128, pool in place, graph replays; OPT_LOG.md, "Decode: one-tile
    blocks by state layout"), against bf16's rule applied to fp32 (BV 32, 4 warps): KDA (H = HV = 32, per-channel
    decay) batch 256 300 against 341 us, batch 64 81 against 89; GDN (H16/HV32) batch 64 76.5 against 84.1, batch 32
    43.0 against 44.5; batch 1 within noise for both (4.2-5.0 us). GDN's batch 256 takes the persistent walk.

    bf16 K-first states: start at 128-byte state rows (64 columns: BK * 128 bytes of state per program, 4 warps at
    K = 128), and halve them while the grid has fewer than 4 programs per SM, down to 64-byte rows (32 columns).
    Measured on the H200 (H = HV = 32, K = V = 128; benchmarks/OPT_LOG.md, "Decode (fused_recurrent), iteration
    1"): bf16 at batch 256 ran 231 us with BV = 64 against 281 us with BV = 32; fp32 at batch 1 ran 3.7-3.9 us with
    16 columns against 4.2 us with 8 and 5.3 us with 4, the 64-byte floor of both rules (rows narrower than 64 bytes
    waste half of each 64-byte fetch)."""
    BK = next_power_of_2(K)
    elem = torch.empty((), dtype=state_dtype).element_size()
    vp2 = next_power_of_2(V)
    if v_first:
        return BK, max(1, min(vp2, 4096 // (BK * elem))), 1
    if elem == 4:
        BV = min(vp2, 64)
        while BV > 16 and N * HV * cdiv(V, BV) < 4 * num_sms:
            BV //= 2
        return BK, BV, max(1, min(8, BK * BV * elem // 16384))
    bv_min = min(vp2, max(1, 64 // elem))
    BV = min(vp2, max(bv_min, 128 // elem))
    target = 4 * num_sms
    while BV > bv_min and N * HV * cdiv(V, BV) < target:
        BV //= 2
    # about 32 state bytes x 4 per thread: 4 warps for a [128, 128-byte] block
    num_warps = max(1, min(8, BK * BV * elem // 4096))
    return BK, BV, num_warps


def decode_persistent_config(N: int, HV: int, K: int, V: int, T: int, varlen: bool, state_dtype: torch.dtype,
                             num_sms: int, v_first: bool = False):
    """(BV, num_warps, 1, programs per SM), the launcher's `config` form of the persistent kernel, or None for the
    one-tile kernel.

    Measured on the H200 (H = HV = 32, K = V = 128, T = 1, pool in place; benchmarks/OPT_LOG.md, "Decode,
    iteration 2" and "the decode pool's tile"): at batch 256 with an fp32 pool a persistent walk with BV = 64
    (256-byte rows) and 4 warps beat the one-tile kernel (289.6 against 324.0 us), BV = 32 did not (336.5 us);
    with a bf16 pool no persistent config beat the one-tile kernel (239.0 against 234.4 us), and at batch 32
    (15 tiles of BV = 64 per SM) the one-tile kernel was fastest (44.8 against 47.5 us). The walk is now the
    register-prefetching one with 2 programs per SM (271.2 us, 93% of the copy bandwidth). So: fp32 states, one
    token per sequence, no cu_seqlens (T > 1 loops over tokens inside the one-tile kernel), K <= 128 (64 state
    values per thread at 4 warps: the measured size; larger K would spill), and at least 32 tiles of BV = 64 per
    SM. Not for V-first states: the one-warp one-tile block beats the walk there (decode_launch_config)."""
    if v_first or T != 1 or varlen or state_dtype != torch.float32 or K > 128:
        return None
    BV = min(64, next_power_of_2(V))
    if N * HV * cdiv(V, BV) < 32 * num_sms:
        return None
    return BV, 4, 1, 2


def fused_recurrent_gdn_fwd(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                            cu_seqlens: Optional[torch.Tensor], state_indices: Optional[torch.Tensor],
                            A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                            use_qk_l2norm: bool, beta_sigmoid: bool, output_final_state: bool, inplace: bool,
                            config: Optional[tuple] = None, out: Optional[torch.Tensor] = None,
                            final_out: Optional[torch.Tensor] = None,
                            num_accepted_tokens: Optional[torch.Tensor] = None,
                            pad_slot_id: int = -1, state_v_first: bool = False, allow_neg_eigval: bool = False,
                            gk: Optional[torch.Tensor] = None, gk_mode: str = "", lower_bound: float = 0.0,
                            record: Optional[list] = None):
    """Launcher. Returns (o, final_state); final_state is None when inplace (the pool was updated) or when not
    requested, else a new fp32 tensor (FLA's rule), [N, HV, K, V] ([N, HV, V, K] with state_v_first). The
    arguments are assumed checked (fused_recurrent.py validates them). `out` / `final_out`: optional preallocated
    contiguous outputs (tests pass NaN-poisoned ones). `config` overrides the heuristics (tests and launch-config
    sweeps): (BV, num_warps) or (BV, num_warps, 0, _) runs the one-tile kernel with that block; (BV, num_warps, 1,
    programs per SM) the persistent kernel (T = 1, no cu_seqlens, 1-D state_indices).
    Serving options: a 2-D state_indices [N, T_max] with optional num_accepted_tokens [N] (speculative decoding:
    read slot state_indices[n, num_accepted_tokens[n] - 1], in place every token's state into state_indices[n, t]);
    pad_slot_id >= 0 makes that index a padded row too (negative indices always are); state_v_first: states
    [.., V, K]; allow_neg_eigval: beta = 2 sigmoid(beta) (with beta_sigmoid).
    gk [B, T, HV, K] with gk_mode (decode_kernels.py: "log", "softplus", "lower_bound", "lower_bound_no_a", the
    last two with lower_bound): the per-key-channel decay (GDN's gk, KDA's g), on the one-tile kernel.
    record: a list that receives (kernel, handles, grid, tensors, tail) of a launch made through the host path's
    plan (direct_decode builds a per-signature launch from it)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    spec = False
    idx_cols = 1
    if state_indices is not None:
        N = state_indices.shape[0]
        if state_indices.dim() == 2:
            spec, idx_cols = True, state_indices.shape[1]
        state_indices = state_indices.contiguous()
    elif cu_seqlens is not None:
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    # decode inputs are tiny; .contiguous() is a no-op for the usual contiguous projections. Outputs come from
    # runtime.alloc.empty: NaN-filled inside poisoned_allocations(), so an unwritten element fails a check
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    if gk is not None:
        gk = gk.contiguous()
    if num_accepted_tokens is not None:
        num_accepted_tokens = num_accepted_tokens.contiguous()
    if initial_state is not None and not inplace:
        initial_state = initial_state.contiguous()
    state_dtype = initial_state.dtype if initial_state is not None else torch.float32
    o = empty(*v.shape, dtype=v.dtype, device=v.device) if out is None else out
    ht = None
    if output_final_state and not inplace:
        ht_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        ht = empty(*ht_shape, dtype=torch.float32, device=q.device) if final_out is None else final_out
    num_sms = device_facts(q).num_sms
    (BK, BV, num_warps), auto_config = _shape_configs(N, HV, K, V, T, cu_seqlens is not None, state_dtype, num_sms,
                                                    state_v_first)
    if config is None:                  # the persistent walk reads and writes one slot per row
        config = None if spec else auto_config
    per_sm = None                                    # programs per SM of the persistent kernel; None: one-tile
    if config is not None:
        if len(config) not in (2, 4) or (len(config) == 4 and config[2] not in (0, 1)):
            raise ValueError(f"decode config {tuple(config)}: expected (BV, num_warps) or (BV, num_warps, 0 | 1, "
                             f"programs per SM)")
        BV, num_warps = config[:2]
        if len(config) == 4 and config[2] == 1:
            per_sm = config[3]
            if T != 1 or cu_seqlens is not None or spec:
                raise ValueError("the persistent decode kernel takes one token per sequence, no cu_seqlens and a "
                                 "1-D state_indices")
    n_tiles = N * HV * cdiv(V, BV)
    if n_tiles == 0:
        return o, ht
    num_slots = initial_state.shape[0] if state_indices is not None else 0
    # FUSED_GATE: the scalar g's gate (A_log without g belongs to gk's KDA gate)
    flags = dict(USE_G=g is not None, FUSED_GATE=A_log is not None and g is not None, HAS_DT_BIAS=dt_bias is not None,
                 BETA_SIGMOID=beta_sigmoid, QK_L2NORM=use_qk_l2norm, HAS_H0=initial_state is not None,
                 STORE_HT=inplace or output_final_state, INPLACE=inplace, INDEXED=state_indices is not None)
    serving = dict(NEG_EIGVAL=allow_neg_eigval, PAD_SLOT=pad_slot_id, V_FIRST=state_v_first)
    channel = dict(GK_MODE=gk_mode if gk is not None else "",
                   LOWER_BOUND=float(lower_bound) if gk is not None and gk_mode.startswith("lower_bound") else 0.0)
    # launches go to the current device: switch only when q lives on another one (a switch costs host time)
    other_device = q.is_cuda and q.get_device() != torch.cuda.current_device()
    with torch.cuda.device(q.device) if other_device else contextlib.nullcontext():
        if per_sm is not None:
            _launch(fused_recurrent_gdn_fwd_persistent_kernel, (min(n_tiles, per_sm * num_sms), 1, 1),
                    (q, k, v, g, gk, beta, A_log, dt_bias, o, initial_state, ht, state_indices),
                    (num_slots, n_tiles), float(scale),
                    dict(H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, **flags, **serving, **channel), num_warps, record)
            return o, ht
        _launch(fused_recurrent_gdn_fwd_kernel, (n_tiles, 1, 1),
                (q, k, v, g, gk, beta, A_log, dt_bias, o, initial_state, ht, cu_seqlens, state_indices,
                 num_accepted_tokens), (T, num_slots, idx_cols),
                float(scale), dict(H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None, **flags,
                                   SPEC=spec, HAS_NAT=num_accepted_tokens is not None, **serving, **channel),
                num_warps, record)
    return o, ht


def _launch(kernel, grid, tensors, ints, scale, constexprs, num_warps, record=None):
    """kernel[grid](*tensors, scale, *ints, **constexprs), through the compiled kernel's handle once the call's
    signature has been seen. The plan key fixes everything the JIT specialises on: each tensor's dtype (None for an
    absent one) and 16-byte alignment (a misaligned pointer goes through the JIT every time), the integers' values,
    the constexprs and num_warps. Narrower than runtime/host_path.LaunchCache, which keys every argument generically:
    that key cost more host time than the batch-1 kernel takes (the reason for this path)."""
    options = dict(num_warps=num_warps, num_stages=1)
    if host_path.plan_cache and host_path.handle:
        ptrs = 0
        for t in tensors:
            if t is not None:
                ptrs |= t.data_ptr()
        if ptrs & 15 == 0:
            key = (kernel, tuple(None if t is None else t.dtype for t in tensors), ints,
                   tuple(constexprs.values()), num_warps)
            plan = _PLANS.get(key)
            if plan is None:
                try:          # the constexprs in the kernel's parameter order (absent on a stand-in kernel object)
                    consts = tuple(constexprs[p.name] for p in kernel.params[len(tensors) + 1 + len(ints):])
                except (AttributeError, KeyError):
                    consts = None
                if len(_PLANS) >= MAX_PLANS:
                    _PLANS.clear()
                plan = _PLANS[key] = (consts, {})
            consts, handles = plan
            if consts is not None:
                tail = (scale,) + ints + consts
                launch(host_path, kernel, handles, "decode", grid, tensors + tail, options)
                if record is not None:
                    record.append((kernel, handles, grid, tensors, tail))
                return
    kernel[grid[:1]](*tensors, scale, *ints, **constexprs, **options)


# The tensor arguments of each decode kernel, in kernel order, as positions in a call's tensor tuple CALL_TENSORS
# followed by the launcher's outputs (o, ht).
CALL_TENSORS = ("q", "k", "v", "g", "gk", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "state_indices",
                "num_accepted_tokens")
_KERNEL_TENSORS = {fused_recurrent_gdn_fwd_kernel: (0, 1, 2, 3, 4, 5, 6, 7, 12, 8, 13, 9, 10, 11),
                   fused_recurrent_gdn_fwd_persistent_kernel: (0, 1, 2, 3, 4, 5, 6, 7, 12, 8, 13, 10)}


def direct_decode(record: list, tensors: tuple, o: torch.Tensor, ht: Optional[torch.Tensor],
                  result: str) -> Optional[Callable]:
    """A per-signature launch list of the decode: from the record of one launcher call (fused_recurrent_gdn_fwd's
    `record`) on the call's tensors (in CALL_TENSORS order) and its outputs o, ht (None in place), a function of a
    later call's tensors (positional, CALL_TENSORS order) that allocates o (and ht) as the launcher does and calls
    the kept compiled kernel's `run` with the argument tuple flattened once: the grid, the scalars and constexprs of
    this call, the tensors by position. It returns the public op's result: (o, ht) for result "final", (o, None) for
    "none", (o, the pool) for "pool" (in place: the pool's version counter bumped, as the mutating custom op would),
    or None (nothing launched) where the launch cannot be made directly: another current device, a Triton launch
    hook registered, the host path's plan cache or handle off, an input pointer not 16-byte aligned.
    The caller keys it by everything the launcher's choices read (shapes, strides, dtypes, devices, the options);
    a launcher call whose kernel took anything but the call's own tensors and fresh outputs (a contiguous copy) has
    no direct form (None)."""
    if len(record) != 1:
        return None
    kernel, handles, grid, launched, tail = record[0]
    pos = _KERNEL_TENSORS.get(kernel)
    src = tensors + (o, ht)
    if pos is None or len(launched) != len(pos) or any(t is not src[p] for t, p in zip(launched, pos)):
        return None
    q, v, h0 = tensors[0], tensors[2], tensors[8]
    dev = current_device()
    if q.is_cuda and q.get_device() != dev:
        return None
    raw = kept_direct(handles, "decode", dev)
    if raw is None:
        return None
    run, function, packed, get_stream = raw
    c = plain_c_launch(run)                        # the C launch under `run` where there is one (runtime/c_launch.py)
    args_of = itemgetter(*pos)
    inputs_of = itemgetter(*sorted({p for p in pos if p < len(tensors) and tensors[p] is not None}))
    gx, gy, gz = grid
    empty_like, contiguous = torch.empty_like, torch.contiguous_format
    o_like_v = v.stride() == o.stride()             # empty_like(v) keeps v's strides: the same as o's here
    # ht: 0 none, 1 like the initial state (same shape, strides and dtype), 2 a new contiguous fp32 tensor
    ht_mode = 0 if ht is None else 1 if (h0 is not None and h0.shape == ht.shape and h0.stride() == ht.stride()
                                          and h0.dtype == ht.dtype) else 2
    ht_shape = None if ht is None else tuple(ht.shape)
    hp = host_path
    ret = ("final", "none", "pool").index(result)
    increment_version = torch.autograd.graph.increment_version

    def call(*ts):
        if current_device() != dev or hooks_active() or not (hp.plan_cache and hp.handle):
            return None
        p = 0
        for t in inputs_of(ts):
            p |= t.data_ptr()
        if p & 15:
            return None
        o = empty_like(ts[2]) if o_like_v else empty_like(ts[2], memory_format=contiguous)
        ht = None if ht_mode == 0 else empty_like(ts[8]) if ht_mode == 1 else \
            ts[0].new_empty(ht_shape, dtype=torch.float32)
        if poisoning():
            o.fill_(float("nan"))
            if ht is not None:
                ht.fill_(float("nan"))
        if c is None:
            run(gx, gy, gz, get_stream(dev), function, packed, None, None, None, *args_of(ts + (o, ht)), *tail)
        else:
            c.c(gx, gy, gz, get_stream(dev), function, c.coop, c.pdl, None, None, packed, None, None, None,
                *args_of(ts + (o, ht)), *tail)
        if ret == 0:
            return o, ht
        if ret == 1:
            return o, None
        pool = ts[8]
        if not pool.is_inference():              # inference tensors carry no version counter
            increment_version(pool)
        return o, pool
    return call


def _shape_configs(N, HV, K, V, T, varlen, state_dtype, num_sms, v_first):
    """(the one-tile kernel's (BK, BV, num_warps), the persistent kernel's config or None), computed once per call
    shape, state layout and SM count."""
    key = (N, HV, K, V, T, varlen, state_dtype, num_sms, v_first)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = (decode_launch_config(N, HV, K, V, state_dtype, num_sms, v_first),
               decode_persistent_config(N, HV, K, V, T, varlen, state_dtype, num_sms, v_first))
        if len(_CONFIGS) >= 4096:
            _CONFIGS.clear()
        _CONFIGS[key] = cfg
    return cfg


# ------------------------------------------------------------------------------------------------------- AOT
def _aot_build(state, BV, warps, H=32, fused=False, varlen=False, inplace=True, persistent=False, v_first=False):
    """(jit function, signature, constexprs, options) of one decode launch at K = V = 128, HV = 32, as the launcher
    makes it (bf16 q/k/v/o, fp32 g/beta, int32 state indices, the pool as initial_state)."""
    sp = {"fp32": "*fp32", "bf16": "*bf16"}[state]
    opt = dict(A_log="*fp32" if fused else None, dt_bias="*fp32" if fused else None,
               ht=None if inplace else sp, cu_seqlens="*i32" if varlen else None, state_indices="*i32")
    sig = dict(q="*bf16", k="*bf16", v="*bf16", g="*fp32", gk=None, beta="*fp32", A_log=None, dt_bias=None,
               o="*bf16", h0=sp, ht=None, cu_seqlens=None, state_indices=None, num_accepted=None, scale="fp32",
               T="i32", num_slots="i32", idx_cols="i32")
    sig.update(opt)
    const = dict(H=H, HV=32, K=128, V=128, BK=128, BV=BV, USE_G=True, FUSED_GATE=fused, HAS_DT_BIAS=fused,
                 BETA_SIGMOID=fused, QK_L2NORM=False, HAS_H0=True, STORE_HT=True, INPLACE=inplace,
                 IS_VARLEN=varlen, INDEXED=True, SPEC=False, HAS_NAT=False, NEG_EIGVAL=False, PAD_SLOT=-1,
                 V_FIRST=v_first, GK_MODE="", LOWER_BOUND=0.0)
    constexprs = {n: None for n, t in sig.items() if t is None}
    constexprs.update(const)
    signature = {n: ("constexpr" if t is None else t) for n, t in sig.items()}
    signature.update({n: "constexpr" for n in const})
    kernel = fused_recurrent_gdn_fwd_kernel
    if persistent:                # no T, no cu_seqlens; n_tiles
        kernel = fused_recurrent_gdn_fwd_persistent_kernel
        one_tile_only = ("T", "cu_seqlens", "num_accepted", "idx_cols", "IS_VARLEN", "SPEC", "HAS_NAT")
        for n in one_tile_only:
            signature.pop(n)
            constexprs.pop(n, None)
        signature = {**{n: t for n, t in signature.items() if n != "H" and n in
                        ("q", "k", "v", "g", "gk", "beta", "A_log", "dt_bias", "o", "h0", "ht", "state_indices",
                         "scale", "num_slots")}, "n_tiles": "i32",
                     **{n: "constexpr" for n in const if n not in one_tile_only}}
    return kernel, signature, constexprs, dict(num_warps=warps, num_stages=1)


# (name, build arguments, intended SASS): the launch configs the heuristics pick at H = HV = 32, K = V = 128 on an
# H200. One-tile kernel: 16-byte state loads and stores. Persistent kernel: 16-byte state loads with L2::evict_last,
# stores plain in place and streaming (STG.E.EF.128) for an out-of-place final state.
AOT_CASES = [
    ("fp32_bv64_w2", dict(state="fp32", BV=64, warps=2), ("LDG.E.128", "STG.E.128")),          # fp32, batch 32
    ("fp32_bv16_w1", dict(state="fp32", BV=16, warps=1), ("LDG.E.128", "STG.E.128")),          # fp32, batch 1
    ("vfirst_fp32_bv8_w1", dict(state="fp32", BV=8, warps=1, v_first=True), ("LDG.E.128", "STG.E.128")),
    ("vfirst_bf16_bv16_w1", dict(state="bf16", BV=16, warps=1, v_first=True), ("LDG.E.128", "STG.E.128")),
    ("bf16_bv64_w4", dict(state="bf16", BV=64, warps=4), ("LDG.E.128", "STG.E.128")),          # bf16, batch 256
    ("bf16_bv32_w2", dict(state="bf16", BV=32, warps=2), ("LDG.E.128", "STG.E.128")),          # bf16, batch 1
    ("gva_varlen_gate_outofplace", dict(state="fp32", BV=32, warps=4, H=16, fused=True, varlen=True, inplace=False),
     ("LDG.E.128", "STG.E.128")),
    ("persistent_fp32_bv64_w4", dict(state="fp32", BV=64, warps=4, persistent=True),            # fp32, batch 256
     ("LDG.E.EL.128", "STG.E.128")),
    ("persistent_gva_gate_outofplace", dict(state="fp32", BV=64, warps=4, H=16, fused=True, inplace=False,
                                            persistent=True), ("LDG.E.EL.128", "STG.E.EF.128")),
]


def aot_specs():
    """AotKernel specs (linattn.runtime.aot) of AOT_CASES: named gdn_decode_<name>."""
    from linattn.runtime.aot import AotKernel
    div16 = ("q", "k", "v", "g", "beta", "o", "h0")
    return [AotKernel(f"gdn_decode_{name}", (lambda kw=kw: _aot_build(**kw)), intended=intended, language="triton",
                      div16=div16 + (("ht",) if kw.get("inplace", True) is False else ()),
                      description="GDN decode, K = V = 128, HV = 32" + (", persistent" if kw.get("persistent") else ""))
            for name, kw, intended in AOT_CASES]
