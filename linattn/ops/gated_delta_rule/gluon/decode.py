"""Gluon (sm_90a) kernel for the plain GDN decode step (issue 6): T = 1, no cu_seqlens, a state pool indexed by
`state_indices`, updated in place; fp32 or bf16 states; K = V = 128; GVA; optional fused gate (A_log, dt_bias)
and beta_sigmoid. Backend "gluon" of `fused_recurrent_gated_delta_rule`: `auto` takes it for bf16 pools at
batch >= 32 (fused_recurrent.py, _gluon_auto_filter); by name it takes every call supports() accepts.

Persistent grid (PER_SM CTAs per SM); CTA p walks tiles t = p, p + G, p + 2G, ... (G = grid size), a tile being
(sequence n, value head hv, V-block vb) with t = (n * HV + hv) * NV + vb. The state tile S[:, vb*BV:(vb+1)*BV]
([K, BV]) moves by TMA over the pool viewed as 2-D [num_slots * HV * K, V]: box [K, BV] at
(slot * HV * K + hv * K, vb * BV). Math per tile is exactly `_decode_token` of triton/decode_kernels.py.

Register layout: warps split along V only (warps_per_cta [1, NW]), 8 lanes along K and 4 along V, so both
reductions over K (S^T k, S^T q) stay inside a warp (in-thread sums + 3 shuffles), no shared-memory round trip, no
CTA barrier. Rows per thread SPT_K chosen so that gl.bank_conflicts of the smem
reads/writes against the 128B-swizzled NVMMA tile is 0 (checked at compile time, static_assert).

Shared-memory ring (STAGES buffers `ring[s]` of [K, BV] in the pool dtype, barriers `ready[s]`). Local tile j
(the CTA's j-th) lives in slot j % STAGES and its load completes phase j // STAGES of ready[j % STAGES]:
  prologue  local tiles 0 .. STAGES-2 are issued: for a live row, expect(ready, box bytes) + TMA load; for a
            padded row (index < 0, >= num_slots, or == PAD_SLOT when that is >= 0) a plain arrive on ready instead
            (nothing is read, the phase still completes, so the parity bookkeeping stays uniform); for j >= the
            CTA's tile count nothing.
  steady    iteration i: wait ready[i % S] with parity (i // S) & 1; read the tile into registers (generic
            proxy) and compute; for a live row write the new tile into the SAME buffer, fence_async_shared
            (generic writes -> async proxy), TMA store. Then tma.store_wait(1) if this tile stored, else
            store_wait(0): either way the store of tile i-1 (slot (i-1) % S) has finished reading its buffer.
            fence_async_shared in every thread (its generic reads of slot (i-1) % S ordered before the
            async-proxy write to come), thread_barrier (every warp has passed that point, and the issuing
            thread's store_wait is done), then refill slot (i-1) % S with local tile i + S - 1 (TMA load, or
            the arrive for a padded row, or nothing past the end).
  drain     loads past the CTA's last tile are never issued, so no load is in flight and nobody waits on a phase
            that never completes; store_wait(0) before the barriers are invalidated and the CTA exits.
The slot index of tile i + S - 1 is loaded one iteration ahead (carried in a register), and the small inputs
(q, k, v, g, beta, slot) of tile i + 1 are loaded at the top of iteration i, so neither is on the critical path.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from linattn.ops.gated_delta_rule.gluon.host import gl_dtype
from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, tma_load,
                                          tma_store, tma_store_wait)

K_SUPPORTED = V_SUPPORTED = 128
STATE_DTYPES = (torch.float32, torch.bfloat16)

if GLUON_OK:

    @gluon.constexpr_function
    def state_reg_layout(BV, elem_bits, num_warps):
        """[K, BV] register layout: 4 lanes x VEC columns along V per warp, warps along V, 8 lanes along K.
        SPT_K (consecutive rows per thread) from the gl.bank_conflicts sweep against the 128B-swizzled tile:
        conflict-free with 128-byte rows at 2 rows per thread, with 256-byte rows at 4."""
        vec = BV // (4 * num_warps)
        row_bytes = BV * elem_bits // 8
        spt_k = 4 if row_bytes >= 256 else 2
        return gl.BlockedLayout([spt_k, vec], [8, 4], [1, num_warps], [1, 0])

    @gluon.jit
    def _tile_slot(state_indices, t, num_slots, HV: gl.constexpr, NV: gl.constexpr, INDEXED: gl.constexpr):
        n = t // (HV * NV)
        if INDEXED:
            idx = gl.load(state_indices + n).to(gl.int64)
        else:
            idx = n.to(gl.int64)
        return idx

    @gluon.jit
    def _slot_live(idx, num_slots, PAD_SLOT: gl.constexpr):
        """Whether pool index idx names a slot: in [0, num_slots) and not PAD_SLOT (when >= 0, e.g. vLLM's 0)."""
        ok = (idx >= 0) & (idx < num_slots)
        if PAD_SLOT >= 0:
            ok = ok & (idx != PAD_SLOT)
        return ok

    @gluon.jit
    def _issue(desc, ring, ready, j, n_my, idx, t, num_slots, HV: gl.constexpr, K: gl.constexpr,
               BV: gl.constexpr, NV: gl.constexpr, STAGES: gl.constexpr, PAD_SLOT: gl.constexpr):
        """Local tile j (global tile t, pool slot idx) into ring slot j % STAGES: TMA load for a live row, a
        plain arrive for a padded row, nothing past the CTA's last tile."""
        s = j % STAGES
        inb = j < n_my
        ok = _slot_live(idx, num_slots, PAD_SLOT)
        live = inb & ok
        pad = inb & (ok == 0)
        hv = (t // NV) % HV
        vb = t % NV
        row = ((gl.where(live, idx, 0) * HV + hv) * K).to(gl.int32)
        mbarrier.expect(ready.index(s), desc.block_type.nbytes, pred=live)
        tma_load(desc, [row, (vb * BV).to(gl.int32)], ready.index(s), ring.index(s), pred=live)
        mbarrier.arrive(ready.index(s), pred=pad)

    @gluon.jit(do_not_specialize=["num_slots", "n_tiles"])
    def gdn_decode_gluon_kernel(
        desc,                                   # TMA over the pool [num_slots * HV * K, V], box [K, BV]
        q, k, v, g, beta, A_log, dt_bias, o, state_indices,
        scale, num_slots, n_tiles,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        USE_G: gl.constexpr, FUSED_GATE: gl.constexpr, HAS_DT_BIAS: gl.constexpr, BETA_SIGMOID: gl.constexpr,
        INDEXED: gl.constexpr, STAGES: gl.constexpr, PAD_SLOT: gl.constexpr,
    ):
        NW: gl.constexpr = gl.num_warps()
        FAR: gl.constexpr = STAGES - 1                 # local tiles ahead of the current one in flight
        NV: gl.constexpr = V // BV
        dt: gl.constexpr = desc.dtype
        L: gl.constexpr = state_reg_layout(BV, dt.primitive_bitwidth, NW)
        LK: gl.constexpr = gl.SliceLayout(1, L)
        LV: gl.constexpr = gl.SliceLayout(0, L)

        pid = gl.program_id(0)
        G = gl.num_programs(0)
        n_my = (n_tiles - pid + G - 1) // G

        ring = gl.allocate_shared_memory(dt, [STAGES, K, BV], desc.layout)
        gl.static_assert(gl.bank_conflicts(gl.zeros([K, BV], dt, L).type, ring.index(0).type) == 0)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s0 in gl.static_range(STAGES):
            mbarrier.init(ready.index(s0), count=1)
        fence_async_shared()

        # prologue: local tiles 0 .. FAR-1
        for j0 in gl.static_range(FAR):
            t0 = (pid + j0 * G).to(gl.int64)
            idx0 = _tile_slot(state_indices, gl.minimum(t0, n_tiles - 1), num_slots, HV, NV, INDEXED)
            _issue(desc, ring, ready, j0, n_my, idx0, t0, num_slots, HV, K, BV, NV, STAGES, PAD_SLOT)
        # slot index of the first refill (local tile FAR), loaded ahead
        t_far = (pid + FAR * G).to(gl.int64)
        idx_far = _tile_slot(state_indices, gl.minimum(t_far, n_tiles - 1), num_slots, HV, NV, INDEXED)

        ok = gl.arange(0, K, layout=LK)
        ov = gl.arange(0, BV, layout=LV)
        # small inputs of local tile 0
        t_c = pid.to(gl.int64)
        n_c = t_c // (HV * NV)
        hv_c = (t_c // NV) % HV
        h_c = hv_c // (HV // H)
        vb_c = t_c % NV
        m0 = n_my > 0
        b_q = gl.load(q + (n_c * H + h_c) * K + ok, mask=(ok < K) & m0, other=0.).to(gl.float32)
        b_k = gl.load(k + (n_c * H + h_c) * K + ok, mask=(ok < K) & m0, other=0.).to(gl.float32)
        b_v = gl.load(v + (n_c * HV + hv_c) * V + vb_c * BV + ov, mask=(ov < BV) & m0, other=0.).to(gl.float32)
        b_beta = gl.load(beta + n_c * HV + hv_c, mask=m0, other=0.).to(gl.float32)
        if USE_G:
            b_g = gl.load(g + n_c * HV + hv_c, mask=m0, other=0.).to(gl.float32)
        else:
            b_g = 0.0
        idx_c = _tile_slot(state_indices, gl.minimum(t_c, n_tiles - 1), num_slots, HV, NV, INDEXED)

        for i in range(n_my):
            # ---- prefetch the small inputs of local tile i + 1 (masked off past the end)
            t_n = (pid + (i + 1) * G).to(gl.int64)
            mn = (i + 1) < n_my
            tn_c = gl.minimum(t_n, n_tiles - 1)
            n_n = tn_c // (HV * NV)
            hv_n = (tn_c // NV) % HV
            h_n = hv_n // (HV // H)
            vb_n = tn_c % NV
            nq = gl.load(q + (n_n * H + h_n) * K + ok, mask=(ok < K) & mn, other=0.)
            nk = gl.load(k + (n_n * H + h_n) * K + ok, mask=(ok < K) & mn, other=0.)
            nvv = gl.load(v + (n_n * HV + hv_n) * V + vb_n * BV + ov, mask=(ov < BV) & mn, other=0.)
            nbeta = gl.load(beta + n_n * HV + hv_n, mask=mn, other=0.)
            if USE_G:
                ng = gl.load(g + n_n * HV + hv_n, mask=mn, other=0.)
            idx_n = _tile_slot(state_indices, tn_c, num_slots, HV, NV, INDEXED)
            # slot index of local tile i + 1 + FAR, used by the next iteration's refill
            t_far_n = (pid + (i + 1 + FAR) * G).to(gl.int64)
            idx_far_n = _tile_slot(state_indices, gl.minimum(t_far_n, n_tiles - 1), num_slots, HV, NV, INDEXED)

            # ---- the current tile
            s = i % STAGES
            live = _slot_live(idx_c, num_slots, PAD_SLOT)
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            b_h = ring.index(s).load(L).to(gl.float32)
            b_h = gl.where(live, b_h, 0.0)               # padded row: nothing was loaded; keep garbage out
            # _decode_token (QK_L2NORM=False)
            bq = b_q * scale
            bb = b_beta
            if BETA_SIGMOID:
                bb = 1.0 / (1.0 + gl.exp(-bb))
            if USE_G:
                bg = b_g
                if FUSED_GATE:
                    neg_a = -gl.exp(gl.load(A_log + hv_c).to(gl.float32))
                    if HAS_DT_BIAS:
                        bg = bg + gl.load(dt_bias + hv_c).to(gl.float32)
                    bg = neg_a * (gl.maximum(bg, 0.0) + gl.log(1.0 + gl.exp(-gl.abs(bg))))
                b_h = b_h * gl.exp(bg)
            kS = gl.sum(b_h * gl.expand_dims(b_k, 1), axis=0)
            qS = gl.sum(b_h * gl.expand_dims(bq, 1), axis=0)
            u = bb * (b_v - kS)
            b_o = qS + gl.sum(bq * b_k, axis=0) * u
            b_h = b_h + gl.expand_dims(b_k, 1) * gl.expand_dims(u, 0)
            b_o = gl.where(live, b_o, 0.0)
            gl.store(o + (n_c * HV + hv_c) * V + vb_c * BV + ov, b_o.to(o.dtype.element_ty))
            if live:
                ring.index(s).store(b_h.to(dt))
                fence_async_shared()
                row = ((idx_c * HV + hv_c) * K).to(gl.int32)
                tma_store(desc, [row, (vb_c * BV).to(gl.int32)], ring.index(s))
                tma_store_wait(1)                        # tile i-1's store has read its buffer
            else:
                tma_store_wait(0)
            fence_async_shared()                         # this thread's generic reads/writes of the ring
            gl.thread_barrier()                          # ... and everybody's, before the refill is issued
            # ---- refill slot (i - 1) % STAGES with local tile i + STAGES - 1
            _issue(desc, ring, ready, i + FAR, n_my, idx_far, (pid + (i + FAR) * G).to(gl.int64),
                   num_slots, HV, K, BV, NV, STAGES, PAD_SLOT)

            # ---- rotate the prefetched values
            idx_far = idx_far_n
            t_c = t_n
            n_c = n_n
            hv_c = hv_n
            vb_c = vb_n
            idx_c = idx_n
            b_q = nq.to(gl.float32)
            b_k = nk.to(gl.float32)
            b_v = nvv.to(gl.float32)
            b_beta = nbeta.to(gl.float32)
            if USE_G:
                b_g = ng.to(gl.float32)

        tma_store_wait(0)
        for s1 in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s1))


# ---------------------------------------------------------------------------------------------------- configs
# (BV, num_warps, STAGES, CTAs per SM) per pool dtype. Ring bytes per CTA = STAGES * K * BV * elem; the CTAs of
# one SM must fit 228 KB (233472 B incl. 1 KB reserved per CTA): fp32 BV=64 is 32 KB a stage, bf16 BV=64 16 KB.
# bf16: 2 CTAs per SM, faster than 3 at batch 256 (157.2 against 175.6 us on an H200, same binary).
DEFAULT_CONFIGS = {torch.float32: (64, 4, 3, 2), torch.bfloat16: (64, 4, 3, 2)}
SMEM_PER_SM = 233472


def smem_layout(BV: int, dtype: torch.dtype, K: int = 128):
    return gl.NVMMASharedLayout.get_default_for([K, BV], gl_dtype(dtype))


def make_descriptor(pool: torch.Tensor, BV: int):
    """TMA descriptor over the pool viewed as [num_slots * HV * K, V], box [K, BV]."""
    from linattn.runtime.gluon_compat import TensorDescriptor
    S, HV, K, V = pool.shape
    flat = pool.view(S * HV * K, V)
    return TensorDescriptor(flat, [S * HV * K, V], [V, 1], [K, BV], smem_layout(BV, pool.dtype, K))


def decode_launch(q, k, v, g, beta, scale: float, pool: torch.Tensor, state_indices: Optional[torch.Tensor],
                  A_log=None, dt_bias=None, beta_sigmoid: bool = False, config: Optional[tuple] = None,
                  out: Optional[torch.Tensor] = None, num_sms: Optional[int] = None, pad_slot_id: int = -1):
    """(kernel, grid, args, kwargs) of one launch; separate from the launch so that a CPU test can check the
    arguments against the AOT signature. Inputs assumed checked (supports())."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = state_indices.shape[0] if state_indices is not None else B
    BV, warps, stages, per_sm = config or DEFAULT_CONFIGS[pool.dtype]
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    if out is None:
        from linattn.runtime.alloc import empty
        out = empty(*v.shape, dtype=v.dtype, device=v.device)
    if num_sms is None:
        from linattn.runtime.device import device_facts
        num_sms = device_facts(q.device).num_sms
    n_tiles = N * HV * (V // BV)
    grid = (max(1, min(n_tiles, per_sm * num_sms)),)
    args = (make_descriptor(pool, BV), q, k, v, g, beta, A_log, dt_bias, out, state_indices, float(scale),
            pool.shape[0], n_tiles)
    kwargs = dict(H=H, HV=HV, K=K, V=V, BV=BV, USE_G=g is not None, FUSED_GATE=A_log is not None,
                  HAS_DT_BIAS=dt_bias is not None, BETA_SIGMOID=bool(beta_sigmoid),
                  INDEXED=state_indices is not None, STAGES=stages, PAD_SLOT=pad_slot_id, num_warps=warps)
    return gdn_decode_gluon_kernel, grid, args, kwargs, out, n_tiles


def decode_gluon(q, k, v, g, beta, scale, pool, state_indices, A_log=None, dt_bias=None, beta_sigmoid=False,
                 config=None, out=None, pad_slot_id: int = -1):
    """Run the kernel; returns o. The pool is updated in place. pad_slot_id >= 0: that index is a padded row too."""
    kernel, grid, args, kwargs, out, n_tiles = decode_launch(q, k, v, g, beta, scale, pool, state_indices, A_log,
                                                             dt_bias, beta_sigmoid, config, out,
                                                             pad_slot_id=pad_slot_id)
    if n_tiles == 0:
        return out
    with torch.cuda.device(q.device):
        kernel[grid](*args, **kwargs)
    return out


# ------------------------------------------------------------------------------------------ op + backend
@torch.library.custom_op("linattn::fused_recurrent_gdn_gluon_inplace", mutates_args=("initial_state",))
def _gluon_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                     beta: torch.Tensor, scale: float, initial_state: torch.Tensor,
                     state_indices: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
                     dt_bias: Optional[torch.Tensor], beta_sigmoid: bool, pad_slot_id: int = -1) -> torch.Tensor:
    if initial_state.data_ptr() % 16 != 0:
        # only reachable from a torch.compile'd call (eager calls are checked by supports()): a pool whose base
        # TMA cannot address runs through the Triton kernel, same semantics (pool updated in place)
        from linattn.ops.gated_delta_rule.triton.fused_recurrent import fused_recurrent_gdn_fwd
        return fused_recurrent_gdn_fwd(q, k, v, g, beta, scale, initial_state, None, state_indices, A_log, dt_bias,
                                       use_qk_l2norm=False, beta_sigmoid=beta_sigmoid, output_final_state=False,
                                       inplace=True, pad_slot_id=pad_slot_id)[0]
    return decode_gluon(q, k, v, g, beta, scale, initial_state, state_indices, A_log, dt_bias, beta_sigmoid,
                        pad_slot_id=pad_slot_id)


@_gluon_decode_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, state_indices, A_log, dt_bias, beta_sigmoid, pad_slot_id=-1):
    return torch.empty_like(v)


def impl(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
         use_qk_l2norm_in_kernel=False, state_indices=None, inplace=False, A_log=None, dt_bias=None,
         beta_sigmoid=False, pad_slot_id=None, **_):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    pad = -1 if pad_slot_id is None or pad_slot_id < 0 else int(pad_slot_id)
    o = torch.ops.linattn.fused_recurrent_gdn_gluon_inplace(q, k, v, g, beta, scale, initial_state, state_indices,
                                                            A_log, dt_bias, beta_sigmoid, pad)
    return o, initial_state


def supports(q=None, k=None, v=None, g=None, beta=None, initial_state=None, cu_seqlens=None,
             use_qk_l2norm_in_kernel=False, state_indices=None, inplace=False, A_log=None, dt_bias=None,
             num_accepted_tokens=None, pad_slot_id=None, state_v_first=False, allow_neg_eigval=False,
             gk=None, **_) -> Tuple[bool, str]:
    if q is None or v is None:
        return False, "the Gluon decode needs the call's tensors to decide"
    if gk is not None:
        return False, "gk (a per-key-channel decay): Triton runs it"
    # The serving options below run on the Triton kernels. A 2-D state_indices reads one slot and writes another
    # per token; state_v_first needs [BV, K] TMA boxes and a register layout whose K reductions stay in-warp on the
    # transposed tile (not a load/store-site change); allow_neg_eigval and mixed q/k/v dtypes are not in the
    # kernel's AOT-checked builds.
    if state_indices is not None and state_indices.dim() != 1:
        return False, "a 2-D state_indices (speculative decoding): Triton runs it"
    if num_accepted_tokens is not None:
        return False, "num_accepted_tokens (speculative decoding): Triton runs it"
    if state_v_first:
        return False, "state_v_first: the Gluon decode's TMA boxes and register layout are built for [K, V] states"
    if allow_neg_eigval:
        return False, "allow_neg_eigval: not in the Gluon decode (Triton runs it)"
    if k is not None and not (q.dtype == k.dtype == v.dtype):
        return False, "q, k and v of different dtypes: not in the Gluon decode (Triton runs it)"
    from linattn.runtime.device import hopper_gluon_ready
    ok, reason = hopper_gluon_ready(q, "the Gluon decode", needs="TMA")
    if not ok:
        return False, reason
    if q.shape[1] != 1:
        return False, f"T={q.shape[1]}: the Gluon decode takes one token per sequence (Triton handles T > 1)"
    if cu_seqlens is not None:
        return False, "cu_seqlens: the Gluon decode takes no varlen batch (Triton handles it)"
    K, V = q.shape[-1], v.shape[-1]
    if K != K_SUPPORTED or V != V_SUPPORTED:
        return False, f"K={K}, V={V}: the Gluon decode is built for K == V == 128"
    if use_qk_l2norm_in_kernel:
        return False, "use_qk_l2norm_in_kernel: not in the Gluon decode (Triton does it)"
    if q.dtype == torch.float64:
        return False, "fp64 q/k/v: use the reference backend"
    for name, t in (("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and t.dtype == torch.float64:
            return False, f"fp64 {name}: use the reference backend"
    if initial_state is None or not inplace:
        return False, "the Gluon decode updates a state pool in place: pass initial_state and inplace=True"
    if initial_state.dtype not in STATE_DTYPES:
        return False, f"state dtype {initial_state.dtype}: the Gluon decode keeps states in fp32 or bf16"
    if not initial_state.is_contiguous():
        return False, "the state pool must be contiguous (TMA descriptor over [slots*HV*K, V])"
    from linattn.runtime.device import under_torch_compile
    # a trace has no addresses: under torch.compile the op checks the base at run time (_gluon_decode_op)
    if not under_torch_compile() and initial_state.data_ptr() % 16 != 0:
        return False, "the state pool's base is not 16-byte aligned (TMA needs it)"
    if (V * initial_state.element_size()) % 16 != 0:
        return False, "the state pool's row stride is not a multiple of 16 bytes (TMA needs it)"
    if initial_state.shape[0] * v.shape[2] * K >= 2 ** 31:
        return False, "pool too large for the 32-bit TMA row coordinate (num_slots * HV * K >= 2^31)"
    return True, ""


# ---------------------------------------------------------------------------------------------------- AOT
def desc_sig(state: str, BV: int, K: int = 128) -> str:
    gdt = {"fp32": gl.float32, "bf16": gl.bfloat16}[state]
    layout = gl.NVMMASharedLayout.get_default_for([K, BV], gdt)
    return f"tensordesc<{state}[{K}, {BV}],{layout!r}>"


def aot_build(state: str, BV: int, warps: int, stages: int, H: int = 32, fused: bool = False, pad_slot: int = -1):
    """(fn, signature, constexprs, options) of one config, as the JIT sees decode_launch's call (bf16 q/k/v/o,
    fp32 g/beta, int32 indices; pad_slot: the padding index the call names, -1 for none)."""
    sig = dict(desc=desc_sig(state, BV), q="*bf16", k="*bf16", v="*bf16", g="*fp32", beta="*fp32",
               A_log="*fp32" if fused else "constexpr", dt_bias="*fp32" if fused else "constexpr", o="*bf16",
               state_indices="*i32", scale="fp32", num_slots="i32", n_tiles="i32")
    const = dict(H=H, HV=32, K=128, V=128, BV=BV, USE_G=True, FUSED_GATE=fused, HAS_DT_BIAS=fused,
                 BETA_SIGMOID=fused, INDEXED=True, STAGES=stages, PAD_SLOT=pad_slot)
    constexprs = {n: None for n, t in sig.items() if t == "constexpr"}
    constexprs.update(const)
    sig.update({n: "constexpr" for n in const})
    return gdn_decode_gluon_kernel, sig, constexprs, dict(num_warps=warps)

