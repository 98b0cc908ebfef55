"""Triton kernels of the Gated DeltaNet decode: the step-by-step recurrence (shared/gdn-math.md, "The recurrence")
fused over the T tokens of each sequence, for serving (T = 1 decode, a few tokens for speculative decoding).
The launcher and its launch configs are in fused_recurrent.py.

A program owns one (sequence, value head, V-block) tile at a time: the state block S[:, v0:v0+BV] ([BK, BV], fp32)
lives in registers while the tile's tokens are applied, so the state is read once and written once per call
whatever T is. That state traffic is the whole cost at large batch (q, k, v, g, beta are a few hundred bytes per
head), so both kernels are about bandwidth: contiguous 16-byte accesses along V and several vector loads in flight
per thread.

- fused_recurrent_gdn_fwd_kernel: one tile per program, T >= 1 tokens, varlen (cu_seqlens).
- fused_recurrent_gdn_fwd_persistent_kernel: T = 1, no cu_seqlens; each program walks tiles with a stride of the
  grid size and loads the next tile's state into registers while it updates the current one.

Serving mode: `state_indices[n]` names the pool slot of sequence n. A negative index, one >= num_slots, or one
equal to PAD_SLOT (when PAD_SLOT >= 0: vLLM's null block 0) is a padded row: the program computes nothing that
reaches memory except zeros in its output rows (and in its rows of an out-of-place final state); it never touches
the pool. The check is done here, in the kernel, so the host never reads the indices (no synchronisation,
CUDA-graph safe). Speculative decoding (SPEC, one-tile kernel only): state_indices is [N, idx_cols]; the state is
read from slot state_indices[n, num_accepted[n] - 1] (column 0 without num_accepted), a column outside
[0, idx_cols) making the row padded, and in place the state after token t is written to slot state_indices[n, t]
(a padded entry, or t >= idx_cols, skips that write). V_FIRST: states stored [.., V, K] (FLA's state_v_first); the
register block stays [BK, BV], only the addressing changes.

Per-key-channel decay (GK_MODE): gk [.., HV, K] is loaded as a [BK] vector per token and
scales the state's rows, S <- diag(exp(gk_t)) S, after the scalar decay of g (FLA's order). GK_MODE "" (the default:
none, the GDN path's code unchanged), "log" (gk is the log decay: GDN's gk, or KDA's precomputed g), or a KDA gate on
the raw input gk with dt_bias [HV * K] (FLA's kda gate): "softplus" -exp(A_log) softplus(gk + dt_bias);
"lower_bound" LOWER_BOUND sigmoid(exp(A_log) (gk + dt_bias)); "lower_bound_no_a" LOWER_BOUND sigmoid(gk + dt_bias).
"""
import triton
import triton.language as tl

from linattn.ops.gated_delta_rule.triton.common import kda_gate_act


@triton.jit
def _gate_params(A_log, dt_bias, i_hv, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """-exp(A_log) and dt_bias of value head i_hv for the fused Qwen3-Next gate (zeros when unused)."""
    b_neg_a = 0.0
    b_dt = 0.0
    if FUSED_GATE:
        b_neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_dt = tl.load(dt_bias + i_hv).to(tl.float32)
    return b_neg_a, b_dt


@triton.jit
def _channel_gate(b_gk, A_log, dt_bias, i_hv, o_k, mask_k, K: tl.constexpr, GK_MODE: tl.constexpr,
                  HAS_DT_BIAS: tl.constexpr, LOWER_BOUND: tl.constexpr):
    """The per-key-channel log decay [BK] from the loaded gk row (GK_MODE: see the module docstring)."""
    if GK_MODE == "log":
        return b_gk
    else:
        if HAS_DT_BIAS:
            b_gk = b_gk + tl.load(dt_bias + i_hv * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
        return kda_gate_act(b_gk, A_log, i_hv, GK_MODE, LOWER_BOUND)


@triton.jit
def _decode_token_prep(b_h, b_q, b_k, b_beta, b_g, b_neg_a, b_dt, scale,
                       USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                       BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr, NEG_EIGVAL: tl.constexpr,
                       b_gk=None):
    """The token's inputs as the recurrence uses them (q, k normalised if asked, q scaled, beta and the gate
    formed) and the decayed state exp(g) S: (state, q, k, beta). NEG_EIGVAL (FLA's allow_neg_eigval, with
    BETA_SIGMOID): beta = 2 sigmoid(logit), in (0, 2), so I - beta k k^T may have a negative eigenvalue."""
    if QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale
    if BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if NEG_EIGVAL:
            b_beta = b_beta * 2.0
    if USE_G:
        if FUSED_GATE:
            if HAS_DT_BIAS:
                b_g = b_g + b_dt
            # Qwen3-Next gate: g_eff = -exp(A_log) * softplus(g + dt_bias), per value head;
            # softplus(x) = max(x, 0) + log(1 + exp(-|x|)): no overflow for large x
            b_g = b_neg_a * (tl.maximum(b_g, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_g))))
        b_h = b_h * tl.exp(b_g)                         # S <- exp(g_t) S
    if b_gk is not None:
        b_h = b_h * tl.exp(b_gk)[:, None]               # S <- diag(exp(gk_t)) S: one decay per key row
    return b_h, b_q, b_k, b_beta


@triton.jit
def _decode_token(b_h, b_q, b_k, b_v, b_beta, b_g, b_neg_a, b_dt, scale,
                  USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                  BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr, NEG_EIGVAL: tl.constexpr, b_gk=None):
    """One token of the recurrence on a [BK, BV] fp32 state block: returns (new state, output row). b_gk: the
    token's per-key-channel log decay [BK] (None: none)."""
    b_h, b_q, b_k, b_beta = _decode_token_prep(b_h, b_q, b_k, b_beta, b_g, b_neg_a, b_dt, scale, USE_G, FUSED_GATE,
                                               HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM, NEG_EIGVAL, b_gk)
    # Both reductions read the decayed state, so they are independent and can overlap:
    #   u = beta (v - S^T k),  S' = S + k u^T,  o = S'^T q = S^T q + u (k . q)
    b_kS = tl.sum(b_h * b_k[:, None], 0)
    b_qS = tl.sum(b_h * b_q[:, None], 0)
    b_u = b_beta * (b_v - b_kS)
    b_o = b_qS + tl.sum(b_q * b_k) * b_u
    b_h = b_h + b_k[:, None] * b_u[None, :]
    return b_h, b_o


@triton.jit
def _slot_ok(idx, num_slots, PAD_SLOT: tl.constexpr):
    """Whether pool index idx names a slot: in [0, num_slots) and not the padding slot PAD_SLOT (when >= 0)."""
    ok = (idx >= 0) & (idx < num_slots)
    if PAD_SLOT >= 0:
        ok = ok & (idx != PAD_SLOT)
    return ok


@triton.jit
def _tile_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Offsets of the [BK, BV] block's elements inside one [K, V] state ([V, K] when V_FIRST)."""
    if V_FIRST:
        return o_v[None, :] * K + o_k[:, None]
    else:
        return o_k[:, None] * V + o_v[None, :]


@triton.jit
def _state_block(h0, state_indices, i_n, i_hv, i_v, num_slots, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, INDEXED: tl.constexpr,
                 col_keep, EVICT: tl.constexpr, slot_in, PAD_SLOT: tl.constexpr, V_FIRST: tl.constexpr):
    """The [BK, BV] state block of (sequence i_n, value head i_hv, V-block i_v), loaded as fp32 (zeros without an
    initial state), with what storing it back needs: (block, offsets in the pool, pool mask, full mask, valid,
    column offsets). With state_indices, slot = state_indices[i_n] (or `slot_in` when the caller loaded it ahead);
    a slot that _slot_ok refuses is a padded row (valid False): nothing is read from or written to the pool,
    so the kernel never addresses outside it. col_keep ([BV] booleans) is ANDed into both masks: the persistent
    walk masks off a prefetch past the program's last tile; None adds nothing to the code. EVICT: the load's L2
    eviction policy."""
    o_k = tl.arange(0, BK)
    # BV-contiguous, BV-aligned columns: lets the compiler use 16-byte vector loads and stores along V
    o_v = tl.max_contiguous(tl.multiple_of(i_v * BV + tl.arange(0, BV), BV), BV)
    mask_h = (o_k < K)[:, None] & (o_v < V)[None, :]
    if col_keep is not None:
        mask_h = mask_h & col_keep[None, :]
    if INDEXED:
        if slot_in is None:
            idx = tl.load(state_indices + i_n).to(tl.int64)
        else:
            idx = slot_in
        valid = _slot_ok(idx, num_slots, PAD_SLOT)
        slot = tl.where(valid, idx, 0)
        mask_io = mask_h & valid
    else:
        valid = i_n >= 0
        slot = i_n
        mask_io = mask_h
    state_off = (slot * HV + i_hv) * K * V + _tile_offsets(o_k, o_v, K, V, V_FIRST)
    if HAS_H0:
        b_h = tl.load(h0 + state_off, mask=mask_io, other=0.0, eviction_policy=EVICT).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    return b_h, state_off, mask_io, mask_h, valid, o_v


@triton.jit
def _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, INPLACE: tl.constexpr, INDEXED: tl.constexpr,
                 STORE_CACHE: tl.constexpr, V_FIRST: tl.constexpr):
    """The updated block back into its pool slot (in place; padded rows write nothing), or into row i_n of the
    out-of-place final state (padded rows get zeros). STORE_CACHE: the stores' cache modifier."""
    if INPLACE:
        tl.store(h0 + state_off, b_h.to(h0.dtype.element_ty), mask=mask_io, cache_modifier=STORE_CACHE)
    else:
        if INDEXED:
            b_h = tl.where(valid, b_h, 0.0)
        o_k = tl.arange(0, BK)
        p_ht = ht + (i_n * HV + i_hv) * K * V + _tile_offsets(o_k, o_v, K, V, V_FIRST)
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=mask_h, cache_modifier=STORE_CACHE)


@triton.jit(do_not_specialize=["T", "num_slots", "idx_cols"])
def fused_recurrent_gdn_fwd_kernel(
    q, k, v, g, gk, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, state_indices, num_accepted,
    scale, T, num_slots, idx_cols,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    QK_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, INPLACE: tl.constexpr,
    IS_VARLEN: tl.constexpr, INDEXED: tl.constexpr, SPEC: tl.constexpr, HAS_NAT: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PAD_SLOT: tl.constexpr, V_FIRST: tl.constexpr,
    GK_MODE: tl.constexpr = "", LOWER_BOUND: tl.constexpr = 0.0,
):
    """One tile per program: the state block is loaded, the sequence's T tokens applied, the block stored (SPEC in
    place: stored after every token, into that token's slot). idx_cols: the columns of a 2-D state_indices.
    GK_MODE / LOWER_BOUND: the per-key-channel decay gk [.., HV, K] (module docstring)."""
    # int64 from the start: (slot * HV + head) * K * V overflows int32 for pools above 2^31 elements (8 GiB fp32)
    pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v = pid % NV
    i_nh = pid // NV
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)           # GVA: value head j reads query/key head j // (HV // H)

    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
        seq_len = T

    slot_in = None
    if SPEC:                          # the slot to read: column num_accepted[n] - 1 of the sequence's index row
        if HAS_NAT:
            col = tl.load(num_accepted + i_n).to(tl.int64) - 1
        else:
            col = tl.full([], 0, tl.int64)
        col_ok = (col >= 0) & (col < idx_cols)
        slot_in = tl.load(state_indices + i_n * idx_cols + tl.where(col_ok, col, 0)).to(tl.int64)
        slot_in = tl.where(col_ok, slot_in, -1)
    b_h, state_off, mask_io, mask_h, valid, o_v = _state_block(h0, state_indices, i_n, i_hv, i_v, num_slots, HV, K,
                                                               V, BK, BV, HAS_H0, INDEXED, None, "", slot_in,
                                                               PAD_SLOT, V_FIRST)
    o_k = tl.arange(0, BK)
    mask_k = o_k < K
    mask_v = o_v < V
    b_neg_a, b_dt = _gate_params(A_log, dt_bias, i_hv, FUSED_GATE, HAS_DT_BIAS)

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    p_beta = beta + bos * HV + i_hv
    if USE_G:
        p_g = g + bos * HV + i_hv
    if GK_MODE != "":
        p_gk = gk + (bos * HV + i_hv) * K + o_k
    for t in range(0, seq_len):
        b_q = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)
        if USE_G:
            b_g = tl.load(p_g).to(tl.float32)
        else:
            b_g = 0.0
        b_gk = None
        if GK_MODE != "":
            b_gk = _channel_gate(tl.load(p_gk, mask=mask_k, other=0.0).to(tl.float32), A_log, dt_bias, i_hv, o_k,
                                 mask_k, K, GK_MODE, HAS_DT_BIAS, LOWER_BOUND)
        b_h, b_o = _decode_token(b_h, b_q, b_k, b_v, b_beta, b_g, b_neg_a, b_dt, scale, USE_G, FUSED_GATE,
                                 HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM, NEG_EIGVAL, b_gk)
        if INDEXED:
            b_o = tl.where(valid, b_o, 0.0)                 # padded rows: zeros, never garbage
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
        if SPEC and INPLACE:          # the state after token t into slot state_indices[n, t]
            w_idx = tl.load(state_indices + i_n * idx_cols + tl.minimum(t, idx_cols - 1)).to(tl.int64)
            w_ok = valid & (t < idx_cols) & _slot_ok(w_idx, num_slots, PAD_SLOT)
            w_off = (tl.where(w_ok, w_idx, 0) * HV + i_hv) * K * V + _tile_offsets(o_k, o_v, K, V, V_FIRST)
            tl.store(h0 + w_off, b_h.to(h0.dtype.element_ty), mask=mask_h & w_ok)
        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_o += HV * V
        p_beta += HV
        if USE_G:
            p_g += HV
        if GK_MODE != "":
            p_gk += HV * K

    if STORE_HT and not (SPEC and INPLACE):
        _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV, K, V, BK, INPLACE, INDEXED,
                     "", V_FIRST)


@triton.jit
def _tile_inputs(q, k, v, g, gk, beta, t, live, o_k, mask_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, USE_G: tl.constexpr, GK_MODE: tl.constexpr):
    """Tile t's q, k rows (in their stored dtype), v columns, beta, g and the raw gk row (0 without GK_MODE), all
    masked off unless `live`."""
    i_v = t % NV
    i_hv = (t // NV) % HV
    i_n = (t // NV) // HV
    i_h = i_hv // (HV // H)
    o_v = i_v * BV + tl.arange(0, BV)
    r_q = tl.load(q + (i_n * H + i_h) * K + o_k, mask=mask_k & live, other=0.0)
    r_k = tl.load(k + (i_n * H + i_h) * K + o_k, mask=mask_k & live, other=0.0)
    r_v = tl.load(v + (i_n * HV + i_hv) * V + o_v, mask=(o_v < V) & live, other=0.0)
    r_beta = tl.load(beta + i_n * HV + i_hv, mask=live, other=0.0)
    if USE_G:
        r_g = tl.load(g + i_n * HV + i_hv, mask=live, other=0.0)
    else:
        r_g = 0.0
    if GK_MODE != "":
        r_gk = tl.load(gk + (i_n * HV + i_hv) * K + o_k, mask=mask_k & live, other=0.0)
    else:
        r_gk = 0.0
    return r_q, r_k, r_v, r_beta, r_g, r_gk


@triton.jit
def _persistent_walk(q, k, v, g, gk, beta, A_log, dt_bias, o, h0, ht, state_indices, scale, num_slots, n_tiles,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                     BETA_SIGMOID: tl.constexpr, QK_L2NORM: tl.constexpr, HAS_H0: tl.constexpr,
                     STORE_HT: tl.constexpr, INPLACE: tl.constexpr, INDEXED: tl.constexpr,
                     STORE_CACHE: tl.constexpr, EVICT: tl.constexpr, NEG_EIGVAL: tl.constexpr,
                     PAD_SLOT: tl.constexpr, V_FIRST: tl.constexpr, GK_MODE: tl.constexpr,
                     LOWER_BOUND: tl.constexpr):
    """The persistent kernel's tile walk (its docstring says how); EVICT: the state load's L2 eviction policy,
    STORE_CACHE: the state stores' cache modifier."""
    NV: tl.constexpr = (V + BV - 1) // BV
    o_k = tl.arange(0, BK)
    mask_k = o_k < K
    cols = tl.arange(0, BV)
    step = tl.num_programs(0)
    t = tl.full([], 0, tl.int64) + tl.program_id(0)
    live = t < n_tiles
    tc = tl.minimum(t, n_tiles - 1)
    b_h, state_off, mask_io, mask_h, valid, o_v = _state_block(
        h0, state_indices, (tc // NV) // HV, (tc // NV) % HV, tc % NV, num_slots, HV, K, V, BK, BV, HAS_H0, INDEXED,
        (cols < BV) & live, EVICT, None, PAD_SLOT, V_FIRST)
    c_q, c_k, c_v, c_beta, c_g, c_gk = _tile_inputs(q, k, v, g, gk, beta, tc, live, o_k, mask_k, H, HV, K, V, BV, NV,
                                                    USE_G, GK_MODE)
    t1 = tl.minimum(t + step, n_tiles - 1)
    if INDEXED:
        nxt_slot = tl.load(state_indices + (t1 // NV) // HV).to(tl.int64)
    else:
        nxt_slot = (t1 // NV) // HV
    for tile in tl.range(tl.program_id(0), n_tiles, step, num_stages=1):
        t = tl.full([], 0, tl.int64) + tile   # int64: slot * HV * K * V passes 2^31 in large pools
        # ---- the next tile: its state block (slot loaded last iteration), the slot after it, its small inputs
        tn = t + step
        live_n = tn < n_tiles
        tnc = tl.minimum(tn, n_tiles - 1)
        n_h, n_state_off, n_mask_io, n_mask_h, n_valid, n_o_v = _state_block(
            h0, state_indices, (tnc // NV) // HV, (tnc // NV) % HV, tnc % NV, num_slots, HV, K, V, BK, BV, HAS_H0,
            INDEXED, (cols < BV) & live_n, EVICT, nxt_slot, PAD_SLOT, V_FIRST)
        t2 = tl.minimum(t + 2 * step, n_tiles - 1)
        if INDEXED:
            nxt_slot = tl.load(state_indices + (t2 // NV) // HV).to(tl.int64)
        else:
            nxt_slot = (t2 // NV) // HV
        n_q, n_k, n_v, n_beta, n_g, n_gk = _tile_inputs(q, k, v, g, gk, beta, tnc, live_n, o_k, mask_k, H, HV, K, V,
                                                        BV, NV, USE_G, GK_MODE)
        # ---- the current tile
        i_v = t % NV
        i_nh = t // NV
        i_n = i_nh // HV
        i_hv = i_nh % HV
        b_neg_a, b_dt = _gate_params(A_log, dt_bias, i_hv, FUSED_GATE, HAS_DT_BIAS)
        b_gk = None
        if GK_MODE != "":
            b_gk = _channel_gate(c_gk.to(tl.float32), A_log, dt_bias, i_hv, o_k, mask_k, K, GK_MODE, HAS_DT_BIAS,
                                 LOWER_BOUND)
        b_h, b_o = _decode_token(b_h, c_q.to(tl.float32), c_k.to(tl.float32), c_v.to(tl.float32),
                                 c_beta.to(tl.float32), c_g.to(tl.float32) if USE_G else 0.0, b_neg_a, b_dt, scale,
                                 USE_G, FUSED_GATE, HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM, NEG_EIGVAL, b_gk)
        if INDEXED:
            b_o = tl.where(valid, b_o, 0.0)
        tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=o_v < V)
        if STORE_HT:
            _store_state(h0, ht, b_h, state_off, mask_io, mask_h, valid, i_n, i_hv, o_v, HV, K, V, BK, INPLACE,
                         INDEXED, STORE_CACHE, V_FIRST)
        # ---- rotate
        b_h, state_off, mask_io, mask_h, valid, o_v = n_h, n_state_off, n_mask_io, n_mask_h, n_valid, n_o_v
        c_q, c_k, c_v, c_beta, c_g, c_gk = n_q, n_k, n_v, n_beta, n_g, n_gk


@triton.jit(do_not_specialize=["num_slots", "n_tiles"])
def fused_recurrent_gdn_fwd_persistent_kernel(
    q, k, v, g, gk, beta, A_log, dt_bias, o, h0, ht, state_indices,
    scale, num_slots, n_tiles,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, FUSED_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    QK_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, INPLACE: tl.constexpr,
    INDEXED: tl.constexpr, NEG_EIGVAL: tl.constexpr, PAD_SLOT: tl.constexpr, V_FIRST: tl.constexpr,
    GK_MODE: tl.constexpr = "", LOWER_BOUND: tl.constexpr = 0.0,
):
    """One token per sequence (the serving decode step), persistent: each program walks tiles (sequence, value
    head, V-block) t = pid, pid + G, ... (G = grid size). Same semantics and arithmetic (_decode_token) as
    fused_recurrent_gdn_fwd_kernel with T = 1 and no cu_seqlens.

    The walk prefetches into registers, without Triton's software pipeliner: at the top of each iteration the next
    tile's state block is loaded by plain 16-byte loads, before the current tile's arithmetic and stores; its slot
    index is loaded a tile further ahead and its small inputs (q, k, v, beta, g, gk) a tile ahead, so no dependent load
    waits inside an iteration. The state load carries L2::evict_last, a hint the pipeliner's cp.async copies cannot
    carry: in place, the block's lines then stay in the L2 until the tile writes them back (271.2 us against 282.0
    for the pipelined walk at batch 256, fp32 pool; benchmarks/OPT_LOG.md, "the decode pool's tile"). Tiles never
    overlap (distinct slots are required in place), so loading tile i+1 while tile i is written back is safe."""
    # out of place the written lines are not read again in this call: streaming stores (270.6 us against 277.0)
    STORE_CACHE: tl.constexpr = "" if INPLACE else ".cs"
    _persistent_walk(q, k, v, g, gk, beta, A_log, dt_bias, o, h0, ht, state_indices, scale, num_slots, n_tiles, H, HV,
                     K, V, BK, BV, USE_G, FUSED_GATE, HAS_DT_BIAS, BETA_SIGMOID, QK_L2NORM, HAS_H0, STORE_HT,
                     INPLACE, INDEXED, STORE_CACHE, "evict_last", NEG_EIGVAL, PAD_SLOT, V_FIRST, GK_MODE, LOWER_BOUND)
