"""Stages 2b + 3 + 4 of the KDA forward in one warp-specialised Gluon kernel (sm_90a): GDN's fused forward
(gluon/chunk_fused_wu_ws.py, its docstring gives the organisation and the barriers) with the per-key-channel decay,
whose gates stage 2a (kda/gluon/intra.py) has already put into the tiles it stores:

  wu partition (GDN's _wu_worker with no scalar gate): W = (Tinv diag(beta)) Kg, U = (Tinv diag(beta)) V, with
      Kg = K exp(gam) the ring's key tile;
  state partition (ws_partitions._ws_state, CHANNEL): vnew = U - W S_c;  S_{c+1} = diag(exp(gam_C)) S_c + Kdec^T
      vnew, Kdec = K exp(gam_C - gam) the ring's tile, gam_C the chunk's last row of gcum (a [K] vector, loaded one
      chunk ahead);
  output partition (_kda_output): o = (Qdec S_c + Aqk vnew) * scale, Qdec = Q exp(gam) and Aqk (lower triangular,
      zeros above) ring tiles, so the output needs no gate at all;
  producer (1 warp): TMA of Qdec, Kdec, Kg ([BT, K] boxes at the value head's columns), V ([BT, BV]), Tinv and Aqk
      ([BT, BT]) as three rings, each slot refilled once its own consumers released it: Kg, Tinv, V in STAGES_A
      slots (the W/U partition, and the state partition, which reads U where W/U wrote it over V and releases the
      slot right after product 1), Kdec in STAGES (the state partition, after product 2), Qdec and Aqk in STAGES
      (the output partition, which finishes each chunk last).

Rows of a box past the sequence end hold the next sequence's tokens: beta is 0 there and the sequence's last chunk
goes through the wu partition's row-selected copies (as GDN's), vnew's rows there are selected to 0, Aqk's columns
past the end meet only those zero rows (its valid rows are zero above the diagonal), and o's rows past the end are
not stored.

Why three Kg / Tinv / V slots at BV = 32 (B1-like grids, one CTA per SM walking every chunk): with two, the copies
of chunk c start only once chunk c - 2 is done, and the W/U partition, then the state partition waiting for its W,
waited for them. At BV = 64 a third slot does not fit. Shared memory at BV = 32: Kg / Tinv / V 3 x 28 KB, Kdec 2 x 16,
Qdec / Aqk 2 x 24, W 2 x 16, the published S 2 x 8 and vnew 2 x 4, with the barriers and the compiler's scratch
229,852 B; at BV = 64 (2 + 2 slots, one W buffer) 221,624 B.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from linattn.runtime.gluon_compat import GLUON_OK, fence_async_shared, gl, gluon, mbarrier, tma_load, warpgroup_mma

BT = 64
STAGES = 2
NPUB = 2
OUTPUT_REGS = 104       # setmaxnreg of the output / wu warpgroups (the state's follows: 512 - 24 - both)
WU_REGS = 192
PRODUCER_REGS = 24

if GLUON_OK:
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_wu_ws import _wu_worker
    from linattn.ops.gated_delta_rule.gluon.chunk_state_tma import _sequence_span
    from linattn.ops.gated_delta_rule.gluon.ws_partitions import (_ws_barriers, _ws_barriers_invalidate,
                                                                  _ws_output_index, _ws_state, _ws_store_o,
                                                                  ring_barriers, ring_barriers_invalidate,
                                                                  ws_acc_layout, ws_rows_layout, ws_smem_layout)

    @gluon.jit
    def _kda_producer(qd_desc, kd_desc, kg_desc, v_desc, t_desc, a_desc, qd_s, kd_s, kg_s, v_s, t_s, a_s, ready_a,
                      empty_a, ready, empty, ready_o, empty_o, nchunks, bos, hv, vb, K: gl.constexpr,
                      V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, STAGES_A: gl.constexpr,
                      STAGES: gl.constexpr):
        """Three rings, each refilled once its own consumers released the slot: Kg, Tinv, V (ready_a / empty_a,
        STAGES_A slots: the W/U partition, and the state partition, which reads U where W/U wrote it over V), Kdec
        (ready / empty: the state partition) and Qdec, Aqk (ready_o / empty_o: the output partition, which finishes a
        chunk after the state partition has)."""
        nbytes_a: gl.constexpr = kg_desc.block_type.nbytes + v_desc.block_type.nbytes + t_desc.block_type.nbytes
        nbytes: gl.constexpr = kd_desc.block_type.nbytes
        nbytes_o: gl.constexpr = qd_desc.block_type.nbytes + a_desc.block_type.nbytes
        for c in range(nchunks):
            sa = c % STAGES_A
            s = c % STAGES
            row = (bos + c * BT).to(gl.int32)
            mbarrier.wait(empty_a.index(sa), ((c // STAGES_A) & 1) ^ 1)   # W/U and state released use c - STAGES_A
            mbarrier.expect(ready_a.index(sa), nbytes_a)                 # full boxes: TMA counts zero-filled bytes
            tma_load(kg_desc, [row, hv * K], ready_a.index(sa), kg_s.index(sa))
            tma_load(t_desc, [row, hv * BT], ready_a.index(sa), t_s.index(sa))
            tma_load(v_desc, [row, hv * V + vb * BV], ready_a.index(sa), v_s.index(sa))
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)       # the state released use c - STAGES
            mbarrier.expect(ready.index(s), nbytes)
            tma_load(kd_desc, [row, hv * K], ready.index(s), kd_s.index(s))
            mbarrier.wait(empty_o.index(s), ((c // STAGES) & 1) ^ 1)     # the output released use c - STAGES
            mbarrier.expect(ready_o.index(s), nbytes_o)
            tma_load(qd_desc, [row, hv * K], ready_o.index(s), qd_s.index(s))
            tma_load(a_desc, [row, hv * BT], ready_o.index(s), a_s.index(s))

    @gluon.jit
    def _kda_output(qd_s, a_s, ready, empty, s_pub, v_pub, s_full, v_full, pub_empty, o_ptr, scale, nchunks, bos,
                    eos, hv, vb, HV: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                    STAGES: gl.constexpr, NPUB: gl.constexpr):
        """o = (Qdec S_c + Aqk vnew) * scale per chunk, rows < eos stored."""
        dt: gl.constexpr = qd_s.dtype
        ACC_A: gl.constexpr = ws_acc_layout(BT)
        ACC_O: gl.constexpr = ws_acc_layout(BV)
        LO: gl.constexpr = ws_rows_layout(BV, dt.primitive_bitwidth, 4)
        _r_a, _lower, r_o, c_o = _ws_output_index(vb, BT, BV, ACC_A, LO)
        for c in range(nchunks):
            t0 = bos + c * BT
            st = c % STAGES
            j = c % NPUB
            mbarrier.wait(ready.index(st), (c // STAGES) & 1)
            mbarrier.wait(s_full.index(j), (c // NPUB) & 1)
            o = warpgroup_mma(qd_s.index(st), s_pub.index(j), gl.zeros([BT, BV], gl.float32, ACC_O), use_acc=False)
            mbarrier.wait(v_full.index(j), (c // NPUB) & 1)
            o = warpgroup_mma(a_s.index(st), v_pub.index(j), o)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st))                   # Qdec, Aqk read by wgmma only (async -> async)
            mbarrier.arrive(pub_empty.index(j))                # s_pub[j], v_pub[j] likewise
            _ws_store_o(o, o_ptr, scale, t0, eos, hv, r_o, c_o, HV, V, LO)

    @gluon.jit
    def kda_fused_forward_kernel(
        qd_desc, kd_desc, kg_desc,            # TMA over Qdec, Kdec, Kg [T_tot, HV*K], box [BT, K]
        v_desc, t_desc, a_desc,               # over v [T_tot, HV*V] (box [BT, BV]), Tinv and Aqk [T_tot, HV*BT]
        beta_ptr, gcum_ptr, o_ptr,            # effective beta [T_tot, HV] fp32, gcum [T_tot, HV, K] fp32, o
        h0_ptr, ht_ptr,                       # optional initial / final state [N, HV, K, V] fp32 (or None)
        cu_ptr, chunk_off_ptr, scale,
        HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
        STAGES_A: gl.constexpr, STAGES: gl.constexpr, NWU: gl.constexpr, NPUB: gl.constexpr, USE_H0: gl.constexpr,
        STORE_HT: gl.constexpr, OUTPUT_REGS: gl.constexpr, WU_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """Grid (V / BV, N * HV): one CTA per V block and (sequence, value head)."""
        dt: gl.constexpr = kd_desc.dtype
        vb = gl.program_id(0)
        n, hv, _hk, bos, eos, _slot0, nchunks = _sequence_span(gl.program_id(1), cu_ptr, chunk_off_ptr, HV, HV, BT)
        qd_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], qd_desc.layout)
        kd_s = gl.allocate_shared_memory(dt, [STAGES, BT, K], kd_desc.layout)
        kg_s = gl.allocate_shared_memory(dt, [STAGES_A, BT, K], kg_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [STAGES_A, BT, BV], v_desc.layout)
        t_s = gl.allocate_shared_memory(dt, [STAGES_A, BT, BT], t_desc.layout)
        a_s = gl.allocate_shared_memory(dt, [STAGES, BT, BT], a_desc.layout)
        wk_s = gl.allocate_shared_memory(dt, [NWU, BT, K], kg_desc.layout)
        s_pub = gl.allocate_shared_memory(dt, [NPUB, K, BV], ws_smem_layout(BV, dt.primitive_bitwidth))
        v_pub = gl.allocate_shared_memory(dt, [NPUB, BT, BV], v_desc.layout)
        wu_full = gl.allocate_shared_memory(gl.int64, [NWU, 1], mbarrier.MBarrierLayout())
        wu_empty = gl.allocate_shared_memory(gl.int64, [NWU, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NWU):
            mbarrier.init(wu_full.index(i), count=1)
            mbarrier.init(wu_empty.index(i), count=1)
        ready_a, empty_a = ring_barriers(STAGES_A, 2)                               # wu and state consume
        ready, empty, s_full, v_full, pub_empty = _ws_barriers(STAGES, NPUB, 1)   # the state consumes
        ready_o, empty_o = ring_barriers(STAGES, 1)                                 # the output consumes
        fence_async_shared()

        gl.warp_specialize(
            [(_ws_state, (kd_s, wk_s, v_s, ready, empty, wu_full, wu_empty, s_pub, v_pub, None, s_full, v_full,
                          pub_empty, gcum_ptr, h0_ptr, ht_ptr, nchunks, bos, eos, n, hv, vb,
                          HV, K, V, BT, BV, STAGES, NWU, NPUB, USE_H0, STORE_HT, True,     # per-channel decay
                          empty_a, STAGES_A, True)),
             (_kda_output, (qd_s, a_s, ready_o, empty_o, s_pub, v_pub, s_full, v_full, pub_empty, o_ptr, scale,
                            nchunks, bos, eos, hv, vb, HV, V, BT, BV, STAGES, NPUB)),
             (_wu_worker, (kg_s, v_s, t_s, wk_s, ready_a, empty_a, wu_full, wu_empty, beta_ptr, None, nchunks, bos,
                           eos, hv, HV, K, BT, BV, STAGES_A, NWU)),
             (_kda_producer, (qd_desc, kd_desc, kg_desc, v_desc, t_desc, a_desc, qd_s, kd_s, kg_s, v_s, t_s, a_s,
                              ready_a, empty_a, ready, empty, ready_o, empty_o, nchunks, bos, hv, vb, K, V, BT, BV,
                              STAGES_A, STAGES))],
            worker_num_warps=[4, 4, 1], worker_num_regs=[OUTPUT_REGS, WU_REGS, PRODUCER_REGS])

        ring_barriers_invalidate(ready_a, empty_a, STAGES_A)
        _ws_barriers_invalidate(ready, empty, s_full, v_full, pub_empty, STAGES, NPUB)
        ring_barriers_invalidate(ready_o, empty_o, STAGES)
        for i in gl.static_range(NWU):
            mbarrier.invalidate(wu_full.index(i))
            mbarrier.invalidate(wu_empty.index(i))


# ---------------------------------------------------------------- host side

def kda_fused_config(N: int, HV: int, V: int, num_sms: int) -> Tuple[int, int]:
    """(BV, NWU): BV = 64 unless N * HV * V / 64 CTAs would leave SMs idle, then 32. W buffers: one at BV = 64 (two
    would need 237,948 B of shared memory, past sm_90's 232,448), two at BV = 32."""
    return (64, 1) if N * HV * (V // 64) >= num_sms else (32, 2)


def kda_fused_stages_a(BV: int) -> int:
    """Slots of the Kg / Tinv / V ring: three at BV = 32 (the W/U partition then forms W and U a chunk earlier than
    two slots let the copies land), two at BV = 64 (three would pass sm_90's shared memory)."""
    return 3 if BV == 32 else 2


def kda_fused_supported(q: torch.Tensor, v: torch.Tensor, state_v_first: bool) -> Tuple[bool, str]:
    """(ok, reason), on top of the Gluon stage 2a's checks: K = V = 128 (the state tile), states [N, HV, K, V], a
    token count that TMA's 32-bit row coordinates reach (else the Triton stages 2b-4 run)."""
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return False, f"K={q.shape[-1]}, V={v.shape[-1]}: the fused KDA forward is built for K == V == 128"
    if state_v_first:
        return False, "state_v_first: the fused KDA forward loads and stores [N, HV, K, V] states"
    if v.dtype != q.dtype:
        return False, f"v is {v.dtype}, q is {q.dtype}: one 16-bit dtype"
    tokens = q.shape[0] * q.shape[1]
    if tokens == 0:
        return False, "no tokens: the TMA descriptors need a non-empty [T, heads*dim] view"
    if tokens >= 2 ** 31:
        return False, "2^31 tokens or more: TMA's row coordinates are 32-bit"
    return True, ""


def kda_fused_forward_launch(qdec, kdec, kg, v, tinv, aqk, beta_eff, gcum, o, initial_state: Optional[torch.Tensor],
                             final: Optional[torch.Tensor], plan, scale: float, BV: int, NWU: int):
    """(kernel, grid, args, kwargs) of kda_fused_forward_kernel. qdec, kdec, kg [T_tot, HV, K], v [.., HV, V], tinv
    and aqk [T_tot, HV, 64], all in one 16-bit dtype; beta_eff [T_tot, HV] and gcum [T_tot, HV, K] fp32 (stage 2a's
    outputs); o [B, T, HV, V] (written); initial_state / final [N, HV, K, V] fp32 or None."""
    from linattn.ops.gated_delta_rule.gluon.host import aligned, fused_desc, gl_dtype
    from linattn.runtime.gluon_compat import TensorDescriptor
    HV, K = kdec.shape[-2], kdec.shape[-1]
    V = v.shape[-1]
    T_tot = plan.T_total
    gdt = gl_dtype(kdec.dtype)

    def desc(t, width, block):
        return fused_desc(TensorDescriptor, aligned(t.reshape(T_tot, width)), block, gdt)

    args = (desc(qdec, HV * K, [BT, K]), desc(kdec, HV * K, [BT, K]), desc(kg, HV * K, [BT, K]),
            desc(v, HV * V, [BT, BV]), desc(tinv, HV * BT, [BT, BT]), desc(aqk, HV * BT, [BT, BT]),
            beta_eff, gcum, o, initial_state, final, plan.cu, plan.chunk_offsets, float(scale))
    kwargs = dict(HV=HV, K=K, V=V, BT=BT, BV=BV, STAGES_A=kda_fused_stages_a(BV), STAGES=STAGES, NWU=NWU, NPUB=NPUB,
                  USE_H0=initial_state is not None, STORE_HT=final is not None, OUTPUT_REGS=OUTPUT_REGS,
                  WU_REGS=WU_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return kda_fused_forward_kernel, (V // BV, plan.N * HV), args, kwargs


def kda_fused_forward(qdec, kdec, kg, v, tinv, aqk, beta_eff, gcum, o, initial_state, final, plan,
                      scale: float) -> None:
    """Stages 2b + 3 + 4 of the KDA forward on sm_90a into o (and final), through the Gluon host path."""
    from linattn.ops.gated_delta_rule.gluon.host import launches
    from linattn.runtime.device import device_facts
    BV, nwu = kda_fused_config(plan.N, v.shape[-2], v.shape[-1], device_facts(v.device).num_sms)
    kernel, grid, args, kwargs = kda_fused_forward_launch(qdec, kdec, kg, v, tinv, aqk, beta_eff, gcum, o,
                                                          initial_state, final, plan, scale, BV, nwu)
    launches(kernel, grid, args, kwargs)
