"""Stage 2a of the gluon forward in Gluon: gcum and Tinv = (I + A)^-1 per chunk and value head, the outputs of
triton/intra_split.py kkt_solve_kernel (its docstring gives the math), with what the Triton form cannot express:

  * one program per (chunk slot, key head) instead of per (chunk slot, value head): the chunk's key tile [64, K] comes
    in once by TMA, straight into the WGMMA operand layout, and K K^T is one [64, K] x [K, 64] warpgroup_mma; then a
    loop over the HV / H value heads of that key head does each head's gates, A and block substitution. Triton kept
    both heads' work live at once (177-225 registers); the loop here is a real loop, so one head's
    tensors are live at a time.
  * every value head's g and beta loads are issued before the wait on the key tile, so they are in flight with its
    TMA; a fixed-length batch's chunk bounds are computed (FIXED_LEN) instead of loaded from the plan.

Per value head the arithmetic is kkt_solve_kernel's at its defaults for a bf16 Tinv (LOWP and LOWP_DIAG): gam as
_gam_of (cumsum inside each 16-row block on a [4, 16] tile plus the sum of the earlier blocks), A masked before
the exponential, the 16x16 diagonal inverses by the nilpotent product, the block recurrence with bf16 operands on
mma.sync ([4, 16, 16] batched tensors, row block i in warp i), A's block diagonals split off in registers (bands),
the row-block shifts of the recurrence through zero-padded shared buffers (_shifted), the gate factors by
ex2.approx.ftz, the four block diagonals stored. Rows of the key tile past the sequence end hold the next
sequence's tokens (TMA zero-fills only rows past T_tot): A's rows there are selected away (gl.where), so they cannot
reach Tinv; its columns there only meet those rows (A is strictly lower).

Only bf16 k with K = 128 and a Tinv in k's dtype (the forward's); the backward's fp32 Tinv stays on Triton.

Shared memory: k_smem [64, K] written once by TMA (ready[0], phase 0), read by the wgmma, which is waited before any
later use; nothing is reused. The shift buffers sd, se1, se2 [128, 16] bf16 hold zeros in rows 0..63 (written once)
and the blocks to shift in rows 64..127.
"""
from __future__ import annotations

import torch

from linattn.runtime.gluon_compat import (GLUON_OK, gl, gluon, mbarrier, fence_async_shared, mma_v2, tma_load,
                                          warpgroup_mma)

BT = 64
KKT_WARPS = 4

if GLUON_OK:
    # 2^x by one MUFU.EX2 (ex2.approx.ftz), the fused kernels' gate exponential
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import _ex2_ftz

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _bf16_dot(a, b, acc, MMA: gl.constexpr):
        """acc + a @ b on mma.sync with bf16 operands (kkt_solve_kernel's _dot_op with LOWP)."""
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        return mma_v2(gl.convert_layout(a.to(gl.bfloat16), DA), gl.convert_layout(b.to(gl.bfloat16), DB), acc)

    @gluon.jit
    def bands(a):
        """The four block diagonals of A [64, 64] (strictly lower): b_s[i] = A_{i, i-s} as [4, 16, 16] for s = 0..3
        (zero where i < s). The column-block axis is split off into four tensors v_c (in the
        wgmma accumulator layout every thread holds all four column blocks of its rows, so the reshape, permute and
        splits move no data), then b_s = v_{i - s} by three selects per element; where i < s the chain ends at v_3,
        the block (i, 3), which lies above the diagonal and is zero."""
        x = gl.permute(gl.reshape(a, [4, 16, 2, 2, 16]), (0, 1, 4, 2, 3))      # (i, r, c, c1, c0): cb = 2 c1 + c0
        x0, x1 = gl.split(x)                                                    # c0 = 0, 1
        v0, v2 = gl.split(x0)
        v1, v3 = gl.split(x1)
        L: gl.constexpr = v0.type.layout
        rb = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L))), 1), 2)
        b0 = gl.where(rb == 0, v0, gl.where(rb == 1, v1, gl.where(rb == 2, v2, v3)))
        b1 = gl.where(rb == 1, v0, gl.where(rb == 2, v1, gl.where(rb == 3, v2, v3)))
        b2 = gl.where(rb == 2, v0, gl.where(rb == 3, v1, v3))
        b3 = gl.where(rb == 3, v0, v3)
        return b0, b1, b2, b3

    @gluon.jit
    def _eye16(L: gl.constexpr):
        """The 16x16 identity as [1, 16, 16] in the 3-D layout L (broadcast over the four blocks)."""
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(0, L)))
        c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(0, L)))
        return gl.where(gl.expand_dims(gl.expand_dims(r, 1), 0) == gl.expand_dims(gl.expand_dims(c, 0), 0), 1., 0.)

    @gluon.jit
    def _inv_unit_lower16(nb, MMA: gl.constexpr):
        """(I + n)^-1 of the four strictly lower 16x16 blocks nb [4, 16, 16]: (I - n)(I + n^2)(I + n^4)(I + n^8) with
        bf16 operands (kkt_solve_kernel's LD); I - n in nb's layout, the rest in the accumulator's (MMA)."""
        eye = _eye16(MMA)
        NL: gl.constexpr = nb.type.layout
        z = gl.zeros([4, 16, 16], gl.float32, MMA)
        n2 = _bf16_dot(nb, nb, z, MMA)
        n4 = _bf16_dot(n2, n2, z, MMA)
        n8 = _bf16_dot(n4, n4, z, MMA)
        x = _bf16_dot(_eye16(NL) - nb, eye + n2, z, MMA)
        x = _bf16_dot(x, eye + n4, z, MMA)
        return _bf16_dot(x, eye + n8, z, MMA)

    @gluon.jit
    def _store_diagonals(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV: gl.constexpr, BT: gl.constexpr,
                         SL: gl.constexpr):
        """The four block diagonals of Tinv (d = T_ii, t1 = T_{i,i-1}, ...; [4, 16, 16], row block i): diagonal s
        at column block (i - s) mod 4, its exact zeros (i < s) above the diagonal, so all of Tinv's rows t0 ..
        min(t0 + 64, eos) are written."""
        b = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL)))
        rw = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        cw = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(0, SL)))
        blk4 = gl.expand_dims(gl.expand_dims(b, 1), 2)
        rr = t0 + blk4.to(gl.int64) * 16 + gl.expand_dims(gl.expand_dims(rw, 0), 2)
        cc = gl.expand_dims(gl.expand_dims(cw, 0), 0)
        rowm = (rr < eos) & (cc < 16)
        base_p = tinv_ptr + (rr * HV + hv) * BT + cc
        ty: gl.constexpr = tinv_ptr.dtype.element_ty
        gl.store(base_p + blk4 * 16, gl.convert_layout(d.to(ty), SL), mask=rowm)
        gl.store(base_p + ((blk4 + 3) % 4) * 16, gl.convert_layout(t1.to(ty), SL), mask=rowm)
        gl.store(base_p + ((blk4 + 2) % 4) * 16, gl.convert_layout(t2.to(ty), SL), mask=rowm)
        gl.store(base_p + ((blk4 + 1) % 4) * 16, gl.convert_layout(t3.to(ty), SL), mask=rowm)

    @gluon.jit
    def _shifted(buf, x, MMA: gl.constexpr):
        """x [4, 16, 16] (row block i in warp i) into rows 64..127 of buf [128, 16] (bf16; rows 0..63 zeros); returns
        (x shifted by 1, 2, 3 row blocks) as mma.sync B operands: y_s[i] = x[i - s], exact zeros where i < s (rows
        64 - 16 s .. of buf viewed [4, 16, 16]): one store and three loads, where a broadcast to every warp would take a
        [4, 4, 16, 16] tensor and its selects and sums."""
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        L: gl.constexpr = buf.type.layout
        buf.slice(4, 4).store(x.to(gl.bfloat16))
        y1 = buf.slice(3, 1)._reinterpret(gl.bfloat16, [4, 16, 16], L).load(DB)
        y2 = buf.slice(2, 1)._reinterpret(gl.bfloat16, [4, 16, 16], L).load(DB)
        y3 = buf.slice(1, 1)._reinterpret(gl.bfloat16, [4, 16, 16], L).load(DB)
        return y1, y2, y3

    @gluon.jit
    def shift_buffers():
        """solve_store's shift buffers sd, se1, se2: [128, 16] bf16 each (as [8, 16, 16]), rows 0..63 zeros (written
        here, once), rows 64..127 the blocks to shift."""
        SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        sd = gl.allocate_shared_memory(gl.bfloat16, [8, 16, 16], SH)
        se1 = gl.allocate_shared_memory(gl.bfloat16, [8, 16, 16], SH)
        se2 = gl.allocate_shared_memory(gl.bfloat16, [8, 16, 16], SH)
        ZL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 16, 2], [4, 1, 1], [2, 1, 0])
        zero = gl.zeros([4, 16, 16], gl.bfloat16, ZL)
        sd.slice(0, 4).store(zero)
        se1.slice(0, 4).store(zero)
        se2.slice(0, 4).store(zero)
        return sd, se1, se2

    @gluon.jit
    def _gates(g_ptr, beta_ptr, t0, eos, hv, HV: gl.constexpr, BT: gl.constexpr, ACC: gl.constexpr):
        """One value head's gate inputs of the chunk at t0: g as the [4, 16] gate tile (G4) and beta [BT] in A's row
        layout (SliceLayout(1, ACC)), zeros past eos."""
        G4: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])          # [4, 16] gate tile
        gb = gl.arange(0, 4, layout=gl.SliceLayout(1, G4))
        gw = gl.arange(0, 16, layout=gl.SliceLayout(0, G4))
        r2 = t0 + gl.expand_dims(gb, 1).to(gl.int64) * 16 + gl.expand_dims(gw, 0)
        g4 = gl.load(g_ptr + r2 * HV + hv, mask=r2 < eos, other=0.).to(gl.float32)
        ri = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ACC)).to(gl.int64)
        beta = gl.load(beta_ptr + ri * HV + hv, mask=ri < eos, other=0.).to(gl.float32)
        return g4, beta

    @gluon.jit
    def _head(kk, g4, beta, gcum_ptr, tinv_ptr, t0, eos, hv, sd, se1, se2, HV: gl.constexpr,
              BT: gl.constexpr, ACC: gl.constexpr):
        """One value head's part of an item: gam (stored as gcum) from its gate inputs (g4, beta: _gates), A from
        K K^T (kk, the wgmma accumulator in ACC), Tinv by block substitution, stored; the row-block shifts through
        the zero-padded shared buffers sd, se1, se2 (_shifted)."""
        G4: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])          # [4, 16] gate tile
        # gam: _gam_of's order (cumsum inside each 16-row block, plus the earlier blocks' sums)
        gb = gl.arange(0, 4, layout=gl.SliceLayout(1, G4))
        gw = gl.arange(0, 16, layout=gl.SliceLayout(0, G4))
        r2 = t0 + gl.expand_dims(gb, 1).to(gl.int64) * 16 + gl.expand_dims(gw, 0)
        m2 = r2 < eos
        ri = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ACC)).to(gl.int64)
        sums = gl.convert_layout(gl.sum(g4, axis=1), gl.SliceLayout(0, G4))
        bj = gl.arange(0, 4, layout=gl.SliceLayout(0, G4))
        base = gl.sum(gl.where(gl.expand_dims(bj, 0) < gl.expand_dims(gb, 1), gl.expand_dims(sums, 0), 0.), axis=1)
        gam4 = gl.associative_scan(g4, 1, _add) + gl.expand_dims(base, 1)
        gl.store(gcum_ptr + r2 * HV + hv, gam4, mask=m2)
        gam = gl.reshape(gam4, [BT])
        gi = gl.convert_layout(gam, gl.SliceLayout(1, ACC))
        gj = gl.convert_layout(gam, gl.SliceLayout(0, ACC))
        i = gl.arange(0, BT, layout=gl.SliceLayout(1, ACC))
        j = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))
        lower = gl.expand_dims(i, 1) > gl.expand_dims(j, 0)
        lower = lower & gl.expand_dims(ri < eos, 1)              # rows past the end: the next sequence's keys
        dg = gl.where(lower, gl.expand_dims(gi, 1) - gl.expand_dims(gj, 0), 0.)
        gexp = _ex2_ftz(dg * 1.4426950408889634)     # gl.exp's lowering without its denormal range fix-up
        a = gl.where(lower, gl.expand_dims(beta, 1) * kk * gexp, 0.)
        a0, a1, a2, a3 = bands(a)
        solve_store(a0, a1, a2, a3, tinv_ptr, t0, eos, hv, sd, se1, se2, HV, BT)

    @gluon.jit
    def solve_store(a0, a1, a2, a3, tinv_ptr, t0, eos, hv, sd, se1, se2, HV: gl.constexpr, BT: gl.constexpr):
        """Tinv = (I + A)^-1 of one chunk and value head from A's four block diagonals (bands; a0 in its layout,
        strictly lower, rows past the sequence end zero) by block substitution with bf16 operands, its block
        diagonals stored (_store_diagonals); the row-block shifts through the zero-padded shared buffers sd, se1,
        se2 (_shifted). GDN's stage 2a here and KDA's (kda/gluon/intra.py) share it."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
        SL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 4, 2], [1, 4, 1], [2, 0, 1])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        a1 = gl.convert_layout(a1.to(gl.bfloat16), DA)                  # as the products' A operands at once
        a2 = gl.convert_layout(a2.to(gl.bfloat16), DA)
        a3 = gl.convert_layout(a3.to(gl.bfloat16), DA)
        d = _inv_unit_lower16(a0, MMA)
        z = gl.zeros([4, 16, 16], gl.float32, MMA)
        d1, d2, d3 = _shifted(sd, d, MMA)                               # D_{i-1}, D_{i-2}, D_{i-3}
        e1 = _bf16_dot(a1, d1, z, MMA)                                  # E_s[i] = A_{i,i-s} D_{i-s}
        e2 = _bf16_dot(a2, d2, z, MMA)
        e3 = _bf16_dot(a3, d3, z, MMA)
        t1 = -_bf16_dot(d, e1, z, MMA)
        e11, e12, _e13 = _shifted(se1, e1, MMA)                         # E_1[i-1], E_1[i-2]
        e21, _e22, _e23 = _shifted(se2, e2, MMA)                        # E_2[i-1]
        t2 = -_bf16_dot(d, e2, _bf16_dot(t1, e11, z, MMA), MMA)
        t3 = _bf16_dot(t1, e21, z, MMA)
        t3 = -_bf16_dot(d, e3, _bf16_dot(t2, e12, t3, MMA), MMA)
        _store_diagonals(tinv_ptr, t0, eos, hv, d, t1, t2, t3, HV, BT, SL)

    @gluon.jit
    def _slot_of(chunk_idx_ptr, slot, valid, N, seq_len, BT: gl.constexpr, FIXED_LEN: gl.constexpr):
        """(sequence n, chunk c) of a chunk slot, n = N where not valid: from the plan's chunk_indices, or with
        FIXED_LEN (every sequence seq_len > 0 tokens, the plan's slots sequence-major) by arithmetic, no load."""
        if FIXED_LEN:
            nch = (seq_len + BT - 1) // BT
            n = gl.where(valid, slot // nch, N)
            c = slot % nch
        else:
            n = gl.load(chunk_idx_ptr + slot * 2, mask=valid, other=N)
            c = gl.load(chunk_idx_ptr + slot * 2 + 1, mask=valid, other=0)
        return n, c

    @gluon.jit
    def _seq_start(cu_ptr, n, valid, seq_len, FIXED_LEN: gl.constexpr):
        """cu[n] (0 where not valid), or n * seq_len with FIXED_LEN."""
        if FIXED_LEN:
            bos = n.to(gl.int64) * seq_len
        else:
            bos = gl.load(cu_ptr + n, mask=valid, other=0)
        return bos

    @gluon.jit
    def _item(kt, bar, phase, g_ptr, beta_ptr, gcum_ptr, tinv_ptr, cu_ptr, n, c, hk, sd, se1, se2, seq_len,
              HV: gl.constexpr, BT: gl.constexpr, G: gl.constexpr, ACC: gl.constexpr, FIXED_LEN: gl.constexpr):
        """One (chunk, key head) item whose key tile arrives in kt (barrier bar, phase): its G value heads, their g
        and beta loads issued before the wait on the tile; FIXED_LEN: the sequence's bounds by arithmetic instead of
        loads of cu."""
        if FIXED_LEN:
            bos = n.to(gl.int64) * seq_len
            eos = bos + seq_len
        else:
            bos = gl.load(cu_ptr + n)
            eos = gl.load(cu_ptr + n + 1)
        t0 = bos + c * BT
        # every head's gate loads in flight with the key tile's TMA
        gs = ()
        bs = ()
        for j in gl.static_range(G):
            g4, beta = _gates(g_ptr, beta_ptr, t0, eos, hk * G + j, HV, BT, ACC)
            gs = gs + (g4,)
            bs = bs + (beta,)
        mbarrier.wait(bar, phase)
        for j in gl.static_range(G):
            # K K^T again per head: a tensor-core pass over shared memory is cheaper than keeping the [64, 64] fp32
            # accumulator live across the head loop (32 registers)
            kk = warpgroup_mma(kt, kt.permute((1, 0)), gl.zeros([BT, BT], gl.float32, ACC), use_acc=False)
            _head(kk, gs[j], bs[j], gcum_ptr, tinv_ptr, t0, eos, hk * G + j, sd, se1, se2, HV, BT, ACC)

    @gluon.jit
    def kkt_solve_gluon_kernel(
        k_desc,                                   # TMA descriptor over k viewed [T_tot, H * K], box [BT, K]
        g_ptr, beta_ptr,                          # g / beta [T_tot, HV]
        gcum_ptr, tinv_ptr,                       # gcum fp32 [T_tot, HV], tinv [T_tot, HV, BT] (k's dtype)
        cu_ptr, chunk_idx_ptr, N, num_items,      # num_items = chunk slots * H
        seq_len,                                  # every sequence's length where FIXED_LEN (else unused)
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr, FIXED_LEN: gl.constexpr = False,
    ):
        """One item per program: lin = slot * H + key head (head-fastest, as kkt_solve_kernel's head-fastest
        order)."""
        gl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
        G: gl.constexpr = HV // H
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        dt: gl.constexpr = k_desc.dtype
        k_smem = gl.allocate_shared_memory(dt, [1, BT, K], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(ready.index(0), count=1)
        sd, se1, se2 = shift_buffers()
        fence_async_shared()
        pid = gl.program_id(0)
        n0, c0 = _slot_of(chunk_idx_ptr, pid // H, pid < num_items, N, seq_len, BT, FIXED_LEN)
        ok0 = n0 < N
        bos0 = _seq_start(cu_ptr, n0, ok0, seq_len, FIXED_LEN)
        mbarrier.expect(ready.index(0), k_desc.block_type.nbytes, pred=ok0)
        tma_load(k_desc, [(bos0 + c0 * BT).to(gl.int32), (pid % H) * K], ready.index(0), k_smem.index(0), pred=ok0)
        if n0 < N:
            _item(k_smem.index(0), ready.index(0), 0, g_ptr, beta_ptr, gcum_ptr, tinv_ptr, cu_ptr, n0, c0,
                  pid % H, sd, se1, se2, seq_len, HV, BT, G, ACC, FIXED_LEN)
        mbarrier.invalidate(ready.index(0))


# ---------------------------------------------------------------- host side

# The register cap: at 80, 6 CTAs per SM (ptxas keeps 20 bytes of loop-invariant values in local memory there),
# faster than the uncapped ~130-register build at 3 CTAs per SM (benchmarks/OPT_LOG.md).
MAXNREG = 80


def kkt_gluon_supported(k: torch.Tensor, HV: int, T_total: int):
    """(ok, reason): the Gluon stage 2a takes bf16 k on a CUDA device with K = 128, HV a multiple of H, and token
    rows that TMA's 32-bit coordinates reach."""
    H, K = k.shape[-2], k.shape[-1]
    if k.dtype != torch.bfloat16:
        return False, (f"k is {k.dtype}; the Gluon stage 2a takes bf16 (its products have bf16 operands, as "
                       f"kkt_solve_kernel's only where Tinv is bf16)")
    if K != 128:
        return False, f"K={K}; the Gluon stage 2a is built for K=128"
    if HV % H:
        return False, f"HV={HV} is not a multiple of H={H}"
    if T_total >= 2 ** 31:
        return False, "more than 2^31 - 1 tokens: TMA coordinates are 32-bit"
    if not k.is_cuda:
        return False, f"k is on {k.device}; the Gluon stage 2a runs on a CUDA (sm_90) device"
    return True, ""


def kkt_solve_gluon(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan, HV: int, gcum=None, tinv=None):
    """Stage 2a as kkt_solve_gluon_kernel: (gcum fp32 [T_tot, HV], Tinv [T_tot, HV, 64] in k's dtype), the outputs of
    fused_forward.kkt_solve. k [B, T, H, K] (or [T_tot, H, K]), g / beta [.., HV] fp32 contiguous; one program per
    (chunk slot, key head)."""
    from linattn.ops.gated_delta_rule.gluon.host import aligned, fused_desc, gl_dtype, launches
    from linattn.runtime.alloc import empty
    from linattn.runtime.gluon_compat import TensorDescriptor
    H, K = k.shape[-2], k.shape[-1]
    T_tot = plan.T_total
    if gcum is None:
        gcum = empty(T_tot, HV, dtype=torch.float32, device=k.device)
    if tinv is None:
        tinv = empty(T_tot, HV, BT, dtype=k.dtype, device=k.device)
    num_items = plan.num_slots * H
    k_desc = fused_desc(TensorDescriptor, aligned(k.reshape(T_tot, H * K)), [BT, K], gl_dtype(k.dtype))
    seq_len = getattr(plan, "seq_len", 0)        # a plan without it (not a ChunkPlan): the bounds from cu
    # a varlen plan (0): the bounds come from cu; so they do for 1-token sequences, as Triton would specialise an int
    # argument of 1 into a constant (a launch key that is not the AOT signature's)
    fixed_len = seq_len >= 2
    seq_arg = seq_len if fixed_len else 2        # unused then: one value, one compiled kernel
    kwargs = dict(H=H, HV=HV, K=K, BT=BT, FIXED_LEN=fixed_len, num_warps=KKT_WARPS, maxnreg=MAXNREG)
    launches(kkt_solve_gluon_kernel, (num_items,), (k_desc, g, beta, gcum, tinv, plan.cu, plan.chunk_indices, plan.N,
                                                    num_items, int(seq_arg)), kwargs)
    return gcum, tinv
