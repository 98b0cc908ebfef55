"""KDA's stage 2a in Gluon for Hopper: what triton/intra.py's three kernels (kda_cumsum_kernel, kda_diag_kernel,
kda_inter_solve_kernel) compute, in one program per (chunk slot, value head) of one warpgroup, with the same outputs
for the same later stages: gcum, the effective beta, the decayed keys and queries, Tinv in k's dtype, Aqk. The math
and its numerical safety are triton/intra.py's docstring's. What differs:

  * the gate, its cumsum and every gate factor are formed per block of BK = 64 key channels on a [4, 16, BK] tile
    (row block, row, channel; row block b in warp b): the cumsum inside each 16-row block by a scan within the warp,
    plus the sums of the earlier blocks;
  * the pairs as mma.sync products with bf16 operands from shared memory, one warp per row block: warp I takes its
    rows' K exp(gam - gam_r) and Q exp(gam - gam_r) against K exp(gam_r(I) - gam) over the rows of blocks <= I (zero
    after), over all K channels (a batched [4, 16, K] x [4, K, 64] product: no row is computed against another block's
    column factors, and the result is already in the warpgroup accumulator layout the block substitution takes). A
    block's reference gam_r is gam before it (the cumsum's base: the earlier blocks' sums, 0 for the first), where the
    Triton stage takes the block's first row: the same bounds (row factors <= 1, column factors <= 1 off the diagonal
    block), the span one gate longer, and no row of gam picked out by a reduction;
  * the in-block pairs always go through that reference. Where the chunk is flagged pairwise (kda_cumsum_kernel's
    test, the span measured from this reference: a factor times the largest |k|, |q| squared past 2^SPAN_LOG2),
    those entries may hold inf or NaN and are replaced by the pairs formed one key channel at a time, each factor
    exp of its own difference <= 0 (kda_diag_kernel's sums), read back from this program's stores;
  * Tinv by GDN's Gluon block substitution (gluon/kkt_solve.py solve_store: bf16 operands, as kda_inter_solve_kernel
    runs for a bf16 Tinv), stored in k's dtype: the autograd forward keeps it so for the backward, as FLA keeps its
    Akk inverse in k's dtype;
  * where only the fused stages 2b-4 read it (gcum_last), gcum is stored at each chunk's last valid row only (a
    flagged chunk stores every row, which its in-block pairs read back); the autograd forward stores every row.

Shared memory: the products' operands, NKB x [64, 64] bf16 tiles of each row's factors (keys, queries) and 4 NKB of
the columns' (one set per row block I, a key block's four together), swizzled for ldmatrix (_swizzled), written once
and read after a CTA barrier; the block substitution's shift buffers (kkt_solve.shift_buffers). Every key block's g,
k and q come by cp.async at the program's start into that key block's own column-factor tiles (32 KB: g, then k,
then q; unswizzled [4, 16, 64] views in the gate tile's layout, so each thread reads back its own copies), all of
them in flight at once where plain loads had the second block's wait behind the first's; the column factors
overwrite them after a CTA barrier. The pairwise test's maxima go through a shared buffer of 8 floats per key block,
a slot per (key block, row block), reduced by every thread after the CTA barrier that precedes the products: no
reduction across warps; the gate's block sums, which every warp needs, through a [4, 64] buffer per key block
(one barrier each, where a layout conversion took three).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from linattn.runtime.gluon_compat import GLUON_OK, async_copy as cp, gl, gluon, mma_v2

BT = 64
BK = 64             # key channels per gate block (one [64, BK] operand tile)
INTRA_WARPS = 4

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import _ex2_ftz
    from linattn.ops.gated_delta_rule.gluon.kkt_solve import _add, bands, shift_buffers, solve_store
    from linattn.ops.gated_delta_rule.triton.common import kda_gate_act

    LOG2E = gl.constexpr(1.4426950408889634)
    SPAN_LOG2 = gl.constexpr(100.0)      # triton/intra.py's SPAN_LOG2

    @gluon.jit
    def _gate(x, A_log, dt_bias, hv, ck, K: gl.constexpr, GATE: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
              LOWER_BOUND: gl.constexpr):
        """FLA's KDA gate on the raw input x of value head hv at key channels ck (triton/intra.py _kda_gate)."""
        if GATE == "":
            return x
        else:
            if HAS_DT_BIAS:
                x = x + gl.load(dt_bias + hv * K + ck).to(gl.float32)
            return kda_gate_act(x, A_log, hv, GATE, LOWER_BOUND)

    @gluon.jit
    def _beta_eff(beta_ptr, tok, valid, hv, HV: gl.constexpr, BETA_SIGMOID: gl.constexpr,
                  NEG_EIGVAL: gl.constexpr):
        """The effective beta of the tokens tok (0 where not valid)."""
        beta = gl.load(beta_ptr + tok * HV + hv, mask=valid, other=0.).to(gl.float32)
        if BETA_SIGMOID:
            beta = 1. / (1. + gl.exp(-beta))
            if NEG_EIGVAL:
                beta = beta * 2.
        return gl.where(valid, beta, 0.)

    @gluon.constexpr_function
    def _l3(BK):
        """The [4, 16, BK] gate tile's layout (row block, row, channel; row block b in warp b)."""
        return gl.BlockedLayout([1, 4, 4], [1, 4, 8], [4, 1, 1], [2, 1, 0])

    @gluon.jit
    def _tile_index(kb, t0, eos, hv, hk, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, BK: gl.constexpr):
        """Key channels kb * BK .. + BK of the chunk on a [4, 16, BK] tile: (row block [4, 1, 1], row in the block
        [1, 16, 1], channel [1, 1, BK], valid mask, offsets into [T_tot, HV, K] and [T_tot, H, K])."""
        L3: gl.constexpr = _l3(BK)
        b1 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        b3 = gl.expand_dims(gl.expand_dims(b1, 1), 2)                                     # [4, 1, 1]
        r1 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        r3 = gl.expand_dims(gl.expand_dims(r1, 0), 2)                                     # [1, 16, 1]
        c1 = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        ck = kb * BK + gl.expand_dims(gl.expand_dims(c1, 0), 1)                           # [1, 1, BK]
        tok = t0 + (b3 * 16 + r3).to(gl.int64)
        m = (tok < eos) & (ck < K)                                                        # [4, 16, BK]
        return b3, r3, ck, m, (tok * HV + hv) * K + ck, (tok * H + hk) * K + ck

    @gluon.jit
    def _gate_cumsum(x, m, b3, ck, A_log, dt_bias, hv, tot_s, K: gl.constexpr, BK: gl.constexpr, GATE: gl.constexpr,
                     HAS_DT_BIAS: gl.constexpr, LOWER_BOUND: gl.constexpr):
        """The gate of the raw input tile x ([4, 16, BK], _tile_index's) and its cumsum gam: the cumsum inside each
        16-row block by a scan within the warp, plus the sums of the earlier blocks (rows past the end add 0).
        Returns gam, gam before the row's block and the block's own sum ([4, 1, BK] each: gam at the block's last
        row is their sum) and every block's sum in every warp ([4 (block j), BK], _blocks_before's input)."""
        L3: gl.constexpr = _l3(BK)
        if GATE != "":                      # the raw input is already 0 past the end (masked copies and loads)
            x = gl.where(m, _gate(x, A_log, dt_bias, hv, ck, K, GATE, HAS_DT_BIAS, LOWER_BOUND), 0.)
        own = gl.sum(x, axis=1)                                                           # [4, BK]: warp b, b
        if tot_s is None:
            tot = gl.convert_layout(own, gl.SliceLayout(0, L3))                           # [4 (block j), BK]
        else:
            # through a buffer of its own: one barrier, no scratch shared with other exchanges to guard
            tot_s.store(own)
            gl.thread_barrier()
            tot = tot_s.load(gl.SliceLayout(0, L3))
        bj = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0), 2)
        base = gl.sum(gl.where(bj < b3, gl.expand_dims(tot, 0), 0.), axis=1)             # [4, BK]
        base = gl.expand_dims(base, 1)
        return gl.associative_scan(x, 1, _add) + base, base, gl.expand_dims(own, 1), tot

    @gluon.jit
    def _blocks_before(tot, blk: gl.constexpr):
        """[1, 1, BK]: the sum of the row blocks before blk of tot ([4 (block j), BK], held by every warp), i.e. gam
        before block blk (0 for the first, the chunk's last gam for blk = 4); no reduction across warps."""
        L2: gl.constexpr = tot.type.layout
        bj = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, L2)), 1)
        return gl.expand_dims(gl.expand_dims(gl.sum(gl.where(bj < blk, tot, 0.), axis=0), 0), 0)

    @gluon.jit
    def _staged(kr_s, kb, i: gl.constexpr, dtype: gl.constexpr, BK: gl.constexpr):
        """Key block kb's staging views ([4, 16, BK], unswizzled) in its own 32 KB of kr_s, tiles kb * 4 .. + 3
        (written by the block's column factors only after its g, k, q are read): i = 0 g (the first 16 KB, fp32 or
        16-bit), 1 k, 2 q (8 KB each after it)."""
        P3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        NB: gl.constexpr = kr_s.shape[0] * kr_s.shape[1] * kr_s.shape[2] // (16 * BK)    # 2-byte [16, BK] blocks
        if i == 0:
            if dtype == gl.float32:
                return kr_s._reinterpret(dtype, [NB // 2, 16, BK], P3).slice(kb * 8, 4)         # 4 KB blocks
            else:
                return kr_s._reinterpret(dtype, [NB, 16, BK], P3).slice(kb * 16, 4)
        else:
            gl.static_assert(dtype.primitive_bitwidth == 16, "k and q are staged as 16-bit tiles")
            return kr_s._reinterpret(dtype, [NB, 16, BK], P3).slice(kb * 16 + 4 + 4 * i, 4)     # blocks 8, 12

    @gluon.jit
    def _stage_block(g_ptr, k_ptr, q_ptr, kr_s, kb: gl.constexpr, t0, eos, hv, hk, H: gl.constexpr,
                     HV: gl.constexpr, K: gl.constexpr, BK: gl.constexpr):
        """cp.async of key block kb's g, k, q tiles into its staging views (rows past the end zero), one group."""
        b3, r3, ck, m, off_g, off_q = _tile_index(kb, t0, eos, hv, hk, H, HV, K, BK)
        cp.async_copy_global_to_shared(_staged(kr_s, kb, 0, g_ptr.dtype.element_ty, BK), g_ptr + off_g, mask=m)
        cp.async_copy_global_to_shared(_staged(kr_s, kb, 1, k_ptr.dtype.element_ty, BK), k_ptr + off_q, mask=m)
        cp.async_copy_global_to_shared(_staged(kr_s, kb, 2, q_ptr.dtype.element_ty, BK), q_ptr + off_q, mask=m)
        cp.commit_group()

    @gluon.jit
    def _gate_block(q_ptr, k_ptr, g_ptr, A_log, dt_bias, gcum_ptr, kdec_ptr, qdec_ptr, kg_ptr, kl_s, ql_s, kr_s,
                    red_s, tot_s, kb, t0, eos, hv, hk, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                    BT: gl.constexpr, BK: gl.constexpr, GATE: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
                    LOWER_BOUND: gl.constexpr, GCUM_LAST: gl.constexpr):
        """Key channels kb * BK .. + BK of the chunk: the gate and its cumsum gam (stored as gcum: every row, or with
        GCUM_LAST only the chunk's last row, all the fused stages read), the decayed keys and queries
        K exp(gam_C - gam), Q exp(gam) (and K exp(gam) where kg_ptr is given: the fused stages' W operand), the
        products' operands into shared memory (kl_s / ql_s tile kb: K, Q times exp(gam - gam_r), gam_r gam before
        the row's block; kr_s tile kb * 4 + I: K exp(gam_r(I) - gam) on the rows of blocks <= I, 0 after), and this
        key block's inputs to kda_cumsum_kernel's pairwise test into red_s: each row block's (warp's) largest |gam -
        gam_r| at kb * 4 + b and largest |k|, |q| at (NKB + kb) * 4 + b, reduced by the caller after its barrier."""
        NKB: gl.constexpr = K // BK
        L3: gl.constexpr = _l3(BK)
        b3, r3, ck, m, off_g, off_q = _tile_index(kb, t0, eos, hv, hk, H, HV, K, BK)
        cp.wait_group(NKB - 1 - kb)                  # this block's staged tiles (each thread reads its own copies)
        x = _staged(kr_s, kb, 0, g_ptr.dtype.element_ty, BK).load(L3).to(gl.float32)
        kf = _staged(kr_s, kb, 1, k_ptr.dtype.element_ty, BK).load(L3).to(gl.float32)
        qf = _staged(kr_s, kb, 2, q_ptr.dtype.element_ty, BK).load(L3).to(gl.float32)
        red_s.slice((NKB + kb) * 4, 4).store(gl.max(gl.max(gl.maximum(gl.abs(kf), gl.abs(qf)), axis=2), axis=1))
        gam, g0, own, tot = _gate_cumsum(x, m, b3, ck, A_log, dt_bias, hv, tot_s.index(kb), K, BK, GATE,
                                         HAS_DT_BIAS, LOWER_BOUND)
        row = b3 * 16 + r3
        last = gl.minimum(eos - t0, BT) - 1
        if GCUM_LAST:
            gl.store(gcum_ptr + off_g, gam, mask=m & (row == last))
        else:
            gl.store(gcum_ptr + off_g, gam, mask=m)
        # two exps per element, of differences <= 0 inside the row's 16-row block: el = exp(gam - gam_r) (gam_r
        # gam before the block, the cumsum's own base) and el2 = exp(gam_e - gam) (e the block's last row); every
        # other factor is el or el2 times a factor per (block, channel)
        gam_last = _blocks_before(tot, 4)                                                 # [1, 1, BK]
        ge = g0 + own                                                                     # [4, 1, BK]: gam_e
        d = gam - g0
        el = _ex2_ftz(d * LOG2E)
        el2 = _ex2_ftz((ge - gam) * LOG2E)
        kel2 = kf * el2
        kel = kf * el
        qel = qf * el
        dt: gl.constexpr = kdec_ptr.dtype.element_ty
        gl.store(kdec_ptr + off_g, (kel2 * _ex2_ftz((gam_last - ge) * LOG2E)).to(dt), mask=m)   # exps of <= 0
        eg0 = _ex2_ftz(g0 * LOG2E)
        gl.store(qdec_ptr + off_g, (qel * eg0).to(dt), mask=m)
        if kg_ptr is not None:
            gl.store(kg_ptr + off_g, (kel * eg0).to(dt), mask=m)
        red_s.slice(kb * 4, 4).store(gl.max(gl.max(gl.abs(d), axis=2), axis=1))
        kl_s.index(kb).store(gl.reshape(kel, [BT, BK]).to(gl.bfloat16))
        ql_s.index(kb).store(gl.reshape(qel, [BT, BK]).to(gl.bfloat16))
        gl.thread_barrier()                          # every warp has read the staged tiles the column factors overwrite
        for blk in gl.static_range(4):
            # exp(gam_r(I) - gam) = exp(gam_r(I) - gam_e) el2 on the rows of blocks <= I, 0 after
            ref = _blocks_before(tot, blk)                                                # [1, 1, BK]: gam_r(I)
            f = _ex2_ftz(gl.where(b3 <= blk, (ref - ge) * LOG2E, float("-inf")))         # [4, 1, BK]
            kr_s.index(kb * 4 + blk).store(gl.reshape(kel2 * f, [BT, BK]).to(gl.bfloat16))

    @gluon.jit
    def _in_block_pairs(q_ptr, k_ptr, gcum_ptr, beta_eff_ptr, aqk_ptr, t0, eos, hv, hk, H: gl.constexpr,
                        HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr):
        """A chunk flagged pairwise: the pairs inside each 16-row block one key channel at a time (kda_diag_kernel's
        sums), from this program's gcum and effective beta (stored before the caller's CTA barrier). Stores Aqk's
        diagonal blocks (j <= i; zeros above) and returns Akk's, beta_i sum_d k_id k_jd exp(gam_id - gam_jd) for
        j < i, as [4, 16, 16] (row block, row, column)."""
        LD: gl.constexpr = gl.BlockedLayout([1, 2, 4], [1, 8, 4], [4, 1, 1], [2, 1, 0])     # [4, 16, 16]
        LI: gl.constexpr = gl.SliceLayout(2, LD)
        LJ: gl.constexpr = gl.SliceLayout(1, LD)
        rowi = (gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, LI)), 1) * 16
                + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, LI)), 0))        # [4, 16]
        rowj = (gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, LJ)), 1) * 16
                + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, LJ)), 0))
        toki = t0 + rowi.to(gl.int64)
        tokj = t0 + rowj.to(gl.int64)
        mi = toki < eos
        mj = tokj < eos
        ri3 = gl.expand_dims(rowi, 2)
        rj3 = gl.expand_dims(rowj, 1)
        # both rows inside the sequence: past its end gcum reads 0, so gam_i - gam_j could overflow to inf there and
        # turn the zeroed row's 0 * inf into NaN, which the block substitution's products carry into valid rows
        lower_eq = (rj3 <= ri3) & gl.expand_dims(mi, 2) & gl.expand_dims(mj, 1)
        strict = rj3 < ri3
        dk = gl.zeros([4, 16, 16], gl.float32, LD)
        dq = gl.zeros([4, 16, 16], gl.float32, LD)
        for d in range(K):
            ki = gl.load(k_ptr + (toki * H + hk) * K + d, mask=mi, other=0.).to(gl.float32)
            qi = gl.load(q_ptr + (toki * H + hk) * K + d, mask=mi, other=0.).to(gl.float32)
            gi = gl.load(gcum_ptr + (toki * HV + hv) * K + d, mask=mi, other=0.)
            kj = gl.load(k_ptr + (tokj * H + hk) * K + d, mask=mj, other=0.).to(gl.float32)
            gj = gl.load(gcum_ptr + (tokj * HV + hv) * K + d, mask=mj, other=0.)
            e = _ex2_ftz(gl.where(lower_eq, (gl.expand_dims(gi, 2) - gl.expand_dims(gj, 1)) * LOG2E,
                                  float("-inf")))
            kje = gl.expand_dims(kj, 1) * e
            dk += gl.where(strict, gl.expand_dims(ki, 2) * kje, 0.)
            dq += gl.expand_dims(qi, 2) * kje
        gl.store(aqk_ptr + (gl.expand_dims(toki, 2) * HV + hv) * BT + rj3, dq.to(aqk_ptr.dtype.element_ty),
                 mask=gl.expand_dims(mi, 2) & (rj3 >= 0))
        beta = gl.load(beta_eff_ptr + toki * HV + hv, mask=mi, other=0.)
        return dk * gl.expand_dims(beta, 2)

    @gluon.constexpr_function
    def _swizzled(rank):
        """The products' operand tiles' shared layout: rows of 64 bf16 (128 B) in 16-byte vectors XOR-swizzled by the
        row mod 8 (ldmatrix reads without bank conflicts); the same bytes as a [64, 64] tile (rank 2) and as
        [4, 16, 64] row blocks or [4, 64, 64] tiles (rank 3)."""
        return gl.SwizzledSharedLayout(8, 1, 8, [1, 0] if rank == 2 else [2, 1, 0])

    @gluon.jit
    def _row_block_products(xl_s, kr_s, NKB: gl.constexpr, BT: gl.constexpr, ACC: gl.constexpr):
        """[64, 64] in ACC: row i of (the rows' factors in xl_s) times (the columns' factors of row block i // 16 in
        kr_s)^T over the NKB key tiles. Warp b computes its own row block b by mma.sync, reading tile kb * 4 + b of
        kr_s: a batched [4, 16, BK] x [4, BK, 64] product, no rows computed for another block."""
        gl.static_assert(gl.num_warps() == 4, "one warp per 16-row block")
        M3: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M3, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=M3, k_width=2)
        BKC: gl.constexpr = xl_s.shape[2]
        SW3: gl.constexpr = _swizzled(3)
        xl3 = xl_s._reinterpret(gl.bfloat16, [NKB * 4, 16, BKC], SW3)       # [key tile * 4 + row block, row, channel]
        kr3 = kr_s._reinterpret(gl.bfloat16, [NKB * 4, BT, BKC], SW3)
        acc = gl.zeros([4, 16, BT], gl.float32, M3)
        for kb in gl.static_range(NKB):
            a = xl3.slice(kb * 4, 4).load(DA)
            b = kr3.slice(kb * 4, 4).permute((0, 2, 1)).load(DB)
            acc = mma_v2(a, b, acc)
        return gl.convert_layout(gl.reshape(acc, [BT, BT]), ACC)

    @gluon.jit
    def kda_intra_gluon_kernel(
        q_ptr, k_ptr, g_ptr, beta_ptr, A_log, dt_bias,     # q, k [T_tot, H, K]; g [T_tot, HV, K]; beta [T_tot, HV]
        gcum_ptr, beta_out_ptr, kdec_ptr, qdec_ptr,        # gcum [T_tot, HV, K] fp32, beta fp32; kdec, qdec (k's dtype)
        tinv_ptr, aqk_ptr,                                 # [T_tot, HV, BT] in k's dtype
        kg_ptr,                                            # K exp(gam) [T_tot, HV, K] in k's dtype, or None
        cu_ptr, chunk_idx_ptr, N,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr,
        GATE: gl.constexpr, HAS_DT_BIAS: gl.constexpr, LOWER_BOUND: gl.constexpr,
        BETA_SIGMOID: gl.constexpr, NEG_EIGVAL: gl.constexpr, GCUM_LAST: gl.constexpr,
    ):
        """Grid (chunk slots, HV), one warpgroup: stage 2a of chunk slot program_id(0), value head program_id(1)."""
        gl.static_assert(BT == 64, "the block inverse is written for 64-token chunks (four 16-row blocks)")
        gl.static_assert(K % 64 == 0, "K: a multiple of 64 (whole operand tiles)")
        BKC: gl.constexpr = 64
        NKB: gl.constexpr = K // BKC
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        ST: gl.constexpr = _swizzled(2)
        kl_s = gl.allocate_shared_memory(gl.bfloat16, [NKB, BT, BKC], ST)
        ql_s = gl.allocate_shared_memory(gl.bfloat16, [NKB, BT, BKC], ST)
        kr_s = gl.allocate_shared_memory(gl.bfloat16, [4 * NKB, BT, BKC], ST)
        sd, se1, se2 = shift_buffers()
        red_s = gl.allocate_shared_memory(gl.float32, [8 * NKB], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tot_s = gl.allocate_shared_memory(gl.float32, [NKB, 4, BKC], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        slot = gl.program_id(0)
        hv = gl.program_id(1)
        hk = hv // (HV // H)
        n = gl.load(chunk_idx_ptr + 2 * slot)
        c = gl.load(chunk_idx_ptr + 2 * slot + 1)
        if n < N:
            bos = gl.load(cu_ptr + n)
            eos = gl.load(cu_ptr + n + 1)
            t0 = bos + c.to(gl.int64) * BT
            for kb in gl.static_range(NKB):          # every key block's g, k, q in flight at once
                _stage_block(g_ptr, k_ptr, q_ptr, kr_s, kb, t0, eos, hv, hk, H, HV, K, BKC)
            i = gl.arange(0, BT, layout=gl.SliceLayout(1, ACC))
            j = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))
            ri = t0 + i.to(gl.int64)
            vi = ri < eos
            beta = _beta_eff(beta_ptr, ri, vi, hv, HV, BETA_SIGMOID, NEG_EIGVAL)
            gl.store(beta_out_ptr + ri * HV + hv, beta, mask=vi)
            for kb in gl.static_range(NKB):
                _gate_block(q_ptr, k_ptr, g_ptr, A_log, dt_bias, gcum_ptr, kdec_ptr, qdec_ptr, kg_ptr, kl_s, ql_s,
                            kr_s, red_s, tot_s, kb, t0, eos, hv, hk, H, HV, K, BT, BKC, GATE, HAS_DT_BIAS, LOWER_BOUND,
                            GCUM_LAST)
            gl.thread_barrier()
            # the pairs through each row block's reference, Aqk first (stored) then Akk: one [64, 64] product live
            # beside its running result
            i2 = gl.expand_dims(i, 1)
            j2 = gl.expand_dims(j, 0)
            # kda_cumsum_kernel's test on every warp's span and amax (red_s, read by every thread after the barrier
            # above); a NaN makes the chunk pairwise
            LR: gl.constexpr = gl.BlockedLayout([4 * NKB], [32], [4], [0])
            span = gl.max(red_s.slice(0, 4 * NKB).load(LR), axis=0)
            amax = gl.maximum(gl.max(red_s.slice(4 * NKB, 4 * NKB).load(LR), axis=0), 1.)
            bits = span * LOG2E + 2. * gl.log2(amax)
            safe = bits <= SPAN_LOG2
            pairwise = (bits > SPAN_LOG2) | (bits != bits)
            aqk = _row_block_products(ql_s, kr_s, NKB, BT, ACC)
            gl.store(aqk_ptr + gl.expand_dims(ri * HV + hv, 1) * BT + j2,
                     gl.where(j2 <= i2, aqk, 0.).to(aqk_ptr.dtype.element_ty),
                     mask=gl.expand_dims(vi, 1) & (safe | ((i2 // 16) != (j2 // 16))))
            akk = _row_block_products(kl_s, kr_s, NKB, BT, ACC)
            a = gl.where((j2 < i2) & gl.expand_dims(vi, 1), gl.expand_dims(beta, 1) * akk, 0.)
            a0, a1, a2, a3 = bands(a)
            if pairwise:
                if GCUM_LAST:
                    # gcum was stored at the last row only: the in-block pairs read every row
                    for kb in gl.static_range(NKB):
                        b3, r3, ck, m, off_g, off_q = _tile_index(kb, t0, eos, hv, hk, H, HV, K, BKC)
                        x = gl.load(g_ptr + off_g, mask=m, other=0.).to(gl.float32)
                        gam, _, _, _ = _gate_cumsum(x, m, b3, ck, A_log, dt_bias, hv, None, K, BKC, GATE, HAS_DT_BIAS,
                                                    LOWER_BOUND)
                        gl.store(gcum_ptr + off_g, gam, mask=m)
                gl.thread_barrier()              # this program's gcum and beta stores, read back
                dk = _in_block_pairs(q_ptr, k_ptr, gcum_ptr, beta_out_ptr, aqk_ptr, t0, eos, hv, hk, H, HV, K, BT)
                a0 = gl.convert_layout(dk, a0.type.layout)
            solve_store(a0, a1, a2, a3, tinv_ptr, t0, eos, hv, sd, se1, se2, HV, BT)


# ---------------------------------------------------------------- host side

def kda_intra_gluon_supported(q: torch.Tensor) -> Tuple[bool, str]:
    """(ok, reason): the Gluon stage 2a takes bf16 q / k with K = 64 or 128 on a CUDA device."""
    if not GLUON_OK:
        return False, "this Triton has no Gluon"
    if q.dtype != torch.bfloat16:
        return False, f"q is {q.dtype}; the Gluon stage 2a takes bf16 (bf16 products and Tinv)"
    if q.shape[-1] not in (64, 128):
        return False, f"K={q.shape[-1]}; the Gluon stage 2a takes K = 64 or 128"
    if not q.is_cuda:
        return False, f"q is on {q.device}; the Gluon stage 2a runs on a CUDA (sm_90) device"
    return True, ""


def kda_intra_gluon(q, k, g, beta, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], gate: str,
                    lower_bound: float, beta_sigmoid: bool, neg_eigval: bool, plan, HV: int, gcum, beta_eff, tinv,
                    aqk, kdec, qdec, kg=None, gcum_last: bool = False) -> None:
    """Stage 2a into the given outputs (chunk_kda_fwd's allocations, triton/forward.py; kg for the fused stages;
    gcum_last: gcum at each chunk's last valid row only, all the fused stages read), one launch through the Gluon
    host path."""
    from linattn.ops.gated_delta_rule.gluon.host import launches
    H, K = q.shape[-2], q.shape[-1]
    kwargs = dict(H=H, HV=HV, K=K, BT=BT, GATE=gate, HAS_DT_BIAS=dt_bias is not None,
                  LOWER_BOUND=float(lower_bound) if gate.startswith("lower_bound") else 0.0,
                  BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=neg_eigval, GCUM_LAST=bool(gcum_last), num_warps=INTRA_WARPS)
    launches(kda_intra_gluon_kernel, (plan.num_slots, HV),
             (q, k, g, beta, A_log, dt_bias, gcum, beta_eff, kdec, qdec, tinv, aqk, kg, plan.cu,
              plan.chunk_indices, plan.N), kwargs)
