"""Context-parallel chunk_gated_delta_rule and chunk_kda: one packed stream split over W ranks (context.py), exact
results. Both ops run the same pass (CPOp says what differs: their forward and backward, and the decay kind of the
state pass the summaries run).

Forward on rank r (docs/context-parallel.md has the derivation):
  1. stage 2 of the local forward (gam, Tinv, W, U) as in the one-process call;
  2. if the rank's last local sequence continues on the next rank: its summary [C | M] (triton/cp_summary.py),
     C from the state it starts with here (its initial state where it starts on r, else zero), M only where it also
     started before r (a rank it spans entirely). GDN: each head runs only the tail of the range over which its
     decay reaches e^-20 (at most 16 chunks, every token's transition a contraction; cp_summary.tail_window): what
     comes before reaches the end damped below that bound, so C and M are the whole range's to 2e-9 of the state,
     and a head with slower decay runs the whole range;
  3. one all-gather of the [HV, K, V + K] summaries; if the rank's first sequence started on rank s < r, its
     incoming state is S = C_s, then S = M_j S + C_j for the ranks j strictly between s and r;
  4. the local state pass and output with the true incoming state (the one-process kernels on the local stream);
  5. with output_final_state: one all-reduce (sum) of [N, HV, K, V] holding each sequence's final state on the rank
     where it ends, zero elsewhere, so every rank returns all N final states.
Backward on rank r, symmetric (the gradient of a rank's incoming state flows back to the ranks before it):
  0. with output_final_state: one all-reduce of d final_state (every rank's loss may read the replicated states);
  1. if the rank's first sequence started before r: D, the gradient of its incoming state given the local dO with
     zero gradient into its final state where it continues on the next rank (the reverse state pass over the first
     sequence, writing nothing else; GDN without a final-state gradient into that sequence: only over its head
     window, cp_summary.head_window_range, the same bound from the other end);
  2. one all-gather of D; if the rank's last sequence ends on rank e > r, the gradient into its final state is
     G = D_e, then G = M_j^T G + D_j for j from e - 1 down to r + 1 (the M_j kept from the forward's gather);
  3. the local backward with the saved incoming state and G as the last sequence's final-state gradient.
Since every rank then runs the exact local backward with the exact boundary state and boundary gradient, q, k, v,
g, beta get their exact gradients locally; nothing differentiates through the summaries. initial_state's gradient
on rank r holds the rows of the sequences that start on r (zero elsewhere): summed over ranks, the one-process
gradient.

Every rank must make the same call (the same output_final_state, initial_state given or not) and run the backward.
The pass runs the Triton kernels, with backend "auto" the gluon backend's kernels where it supports the call
(gdn_cp_op: its fused forward once the incoming state is known, stage 2 first for the summary alone; its state
passes in the backward), eagerly: the autograd function is excluded from torch.compile tracing (a graph break
there), and no step reads device data on the host.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional, Tuple

import torch

from linattn.distributed.comm import comm_of
from linattn.distributed.context import CPContext
from linattn.ops.gated_delta_rule.triton.backward import chunk_gated_delta_rule_bwd, launch_state_bwd
from linattn.ops.gated_delta_rule.triton.cp_summary import head_window_range, launch_state_summary
from linattn.ops.gated_delta_rule.triton.forward import chunk_gated_delta_rule_fwd, launch_state_pass


@dataclasses.dataclass(frozen=True)
class CPOp:
    """What the pass needs of an op: fwd(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, state_pass,
    A_log, dt_bias, opts) -> (o, final states); bwd(q, k, v, g, beta, scale, h0, cu_seqlens, do, dht, state_bwd,
    A_log, dt_bias, opts) -> (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias); the state-pass and reverse-state-pass
    launchers the hooks call (GDN's hook signatures); the summaries' decay kind; the reverse pass of the boundary
    gradient (the state_bwd launcher with store_dh=False). opts: the op's FLA options other than tensors (GDN:
    beta_scale; KDA: gate, lower_bound, beta_sigmoid, neg_eigval)."""
    fwd: object
    bwd: object
    state_pass: object
    state_bwd: object
    decay: str
    boundary_bwd: object
    # local_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, A_log, dt_bias, opts, n_loc) -> (o,
    # final states): the rank's whole forward once its incoming state is known (the fused Gluon forward), where the
    # pass then runs stage 2 first for the summary alone; None: the summary and the exchange run inside fwd's state
    # pass hook
    local_fwd: object = None


def _gdn_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, state_pass, A_log, dt_bias, opts):
    res = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, state_pass=state_pass,
                                     A_log=A_log, dt_bias=dt_bias, **opts)
    return res.o, res.final_state


def _gdn_bwd(q, k, v, g, beta, scale, h0, cu, do, dht, state_bwd, A_log, dt_bias, opts):
    return chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, h0, cu, do, dht, state_bwd=state_bwd, A_log=A_log,
                                      dt_bias=dt_bias, **opts)


def _kda_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, state_pass, A_log, dt_bias, opts):
    from linattn.ops.kda.triton.forward import chunk_kda_fwd
    return chunk_kda_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, A_log, dt_bias, state_pass=state_pass,
                         **opts)


def _kda_bwd(q, k, v, g, beta, scale, h0, cu, do, dht, state_bwd, A_log, dt_bias, opts):
    from linattn.ops.kda.triton.backward import chunk_kda_bwd
    return chunk_kda_bwd(q, k, v, g, beta, scale, h0, cu, A_log, dt_bias, do=do, dht=dht, state_bwd=state_bwd, **opts)


def _kda_state_pass(k, w, u, gcum, h, vnew, h0, final, plan):
    launch_state_pass(k, w, u, gcum, h, vnew, h0, final, plan, decay="channel")


def _kda_state_bwd(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, store_dh=True):
    from linattn.ops.kda.triton.backward import launch_kda_state_bwd
    launch_kda_state_bwd(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale, store_dh=store_dh)


def _gluon_state_pass(k, w, u, gcum, h, vnew, h0, final, plan):
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_state_gluon
    chunk_state_gluon(k, w, u, gcum, h, vnew, h0, final, plan)


def _gluon_state_bwd(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale):
    from linattn.ops.gated_delta_rule.gluon.chunk_state_bwd import chunk_state_bwd_gluon
    chunk_state_bwd_gluon(q, k, w, gcum, do, dh, dvnew, dht, dh0, plan, scale)


def _gdn_bwd_gluon(q, k, v, g, beta, scale, h0, cu, do, dht, state_bwd, A_log, dt_bias, opts):
    return chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, h0, cu, do, dht, state_pass=_gluon_state_pass,
                                      state_bwd=state_bwd, A_log=A_log, dt_bias=dt_bias, **opts)


def _gdn_fwd_fused(q, k, v, g, beta, scale, h0, output_final_state, cu, A_log, dt_bias, opts, n_loc):
    from linattn.ops.gated_delta_rule.gluon.launcher import chunk_gated_delta_rule_fwd_gluon
    if A_log is not None or opts.get("beta_scale"):
        from linattn.ops.gated_delta_rule.triton.gate_prologue import activate
        g, beta = activate(g, beta, A_log, dt_bias, opts.get("beta_scale", 0))
    # one local sequence spanning the rank's tokens: the fixed-length B = 1 call, which the fused forward cuts into
    # segments across the SMs (a varlen call is not segmented)
    res = chunk_gated_delta_rule_fwd_gluon(q, k, v, g, beta, scale, h0, output_final_state, None if n_loc == 1 else cu)
    return res.o, res.final_state


GDN = CPOp(_gdn_fwd, _gdn_bwd, launch_state_pass, launch_state_bwd, "scalar", launch_state_bwd)
# the same pass with the gluon backend's kernels on sm_90a: its fused forward once the incoming state is known, its
# state passes in the backward (the recompute and the reverse pass); the boundary gradient's reverse pass stays
# Triton's (its dh0-only form)
GDN_GLUON = CPOp(_gdn_fwd, _gdn_bwd_gluon, _gluon_state_pass, _gluon_state_bwd, "scalar", launch_state_bwd,
                 _gdn_fwd_fused)
KDA = CPOp(_kda_fwd, _kda_bwd, _kda_state_pass, _kda_state_bwd, "channel", _kda_state_bwd)


def gdn_cp_op(q: torch.Tensor, v: torch.Tensor, cp: CPContext, backend: str) -> Tuple[CPOp, str]:
    """(the pass's kernels, why): with backend "auto" (LINATTN_BACKEND applies as to the one-process call), the
    gluon backend's state passes where it supports this rank's call and would take its backward's recompute there
    too (few sequence-heads: recompute_state_in_gluon); the Triton kernels otherwise and with "triton". LINATTN_LOG=1
    prints the choice (once per reason)."""
    from linattn.runtime.settings import settings
    op, why = GDN, "backend 'triton': the Triton kernels"
    if (settings.default_backend if backend == "auto" else backend) != "triton":
        from linattn.ops.gated_delta_rule.gluon import backend as gluon
        ok, reason = gluon.supports(q=q, v=v, cu_seqlens=cp.cu_seqlens)
        if not ok:
            why = f"the Triton kernels: {reason}"
        elif not gluon.recompute_state_in_gluon(q, v, cp.cu_seqlens):
            why = "the Triton kernels: more sequence-heads than the Gluon state pass is faster at"
        else:
            op, why = GDN_GLUON, "the Gluon fused forward and state passes (sm_90a)"
    if settings.log_choices and why not in _LOGGED:
        _LOGGED.add(why)
        print(f"[linattn] chunk_gated_delta_rule cp_context: {why}", file=sys.stderr, flush=True)
    return op, why


_LOGGED: set = set()


def compose_incoming(ag: torch.Tensor, rank: int, pre: int, V: int) -> torch.Tensor:
    """The incoming state of rank `rank`'s first sequence, started `pre` ranks before, from the gathered [C | M]
    summaries ag [W, HV, K, V + K]: C of the starting rank, then M S + C through every rank in between."""
    s = ag[rank - pre, :, :, :V]
    for j in range(rank - pre + 1, rank):
        s = torch.baddbmm(ag[j, :, :, :V], ag[j, :, :, V:], s)
    return s


def compose_outgoing(ag_d: torch.Tensor, m_next: Optional[torch.Tensor], rank: int, post: int) -> torch.Tensor:
    """The gradient into rank `rank`'s last-sequence final state, the sequence ending `post` ranks later, from the
    gathered incoming-state gradients ag_d [W, HV, K, V] and the transitions m_next [post - 1, HV, K, K] of the
    ranks in between (rank + 1 ...): D of the ending rank, then M^T G + D back through every rank in between."""
    gr = ag_d[rank + post]
    for i in range(post - 2, -1, -1):
        gr = torch.baddbmm(ag_d[rank + 1 + i], m_next[i].transpose(-1, -2), gr)
    return gr


def _layout(cp: CPContext):
    """(local sequences, global index of local 0, pre, post, local sequences that end here, first that starts here)"""
    n_loc, pre, post = cp.num_seqs, cp.pre_num_ranks, cp.post_num_ranks
    return n_loc, cp.seq_offset, pre, post, n_loc - (1 if post > 0 else 0), 1 if pre > 0 else 0


def cp_forward(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
               cp: CPContext, op: CPOp = GDN, A_log=None, dt_bias=None, opts=None):
    """(o, final states [N, HV, K, V] or None, the local initial states with the incoming state in row 0 (or None),
    the transitions of the ranks the last sequence spans after this one (or None)) of rank cp.rank."""
    comm = comm_of(cp)
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    n_loc, lo, pre, post, n_end, _ = _layout(cp)
    dev = q.device
    beta_scale = (opts or {}).get("beta_scale", 0)
    if initial_state is not None:
        h0_loc = initial_state[lo:lo + n_loc].clone()
    elif pre > 0:
        h0_loc = torch.zeros(n_loc, HV, K, V, dtype=torch.float32, device=dev)
    else:
        h0_loc = None
    kept = {}

    def exchange(k_, w, u, gcum, h0, plan):
        """The summary (where the last sequence continues), the all-gather, the incoming state into h0[0]."""
        # zeros: the parts not computed here (C and M of a rank whose last sequence ends on it, M of one that starts
        # on it) are never read, but go over the wire as zeros rather than stale memory
        hm = torch.zeros(HV, K, V + K, dtype=torch.float32, device=dev)
        if post > 0:
            starts_here = pre == 0 or n_loc > 1
            launch_state_summary(k_, w, u, gcum, h0[n_loc - 1] if (h0 is not None and starts_here) else None,
                                 hm, plan.cu[n_loc - 1:], with_transition=not starts_here, decay=op.decay,
                                 beta=beta, beta_scale=beta_scale)
        ag = comm.all_gather(hm)
        if pre > 0:
            h0[0].copy_(compose_incoming(ag, cp.rank, pre, V))
        if post > 1:
            kept["m_next"] = ag[cp.rank + 1:cp.rank + post, :, :, V:].clone()

    def state_pass(k_, w, u, gcum, h, vnew, h0, final, plan):
        if cp.any_crossing:
            exchange(k_, w, u, gcum, h0, plan)
        op.state_pass(k_, w, u, gcum, h, vnew, h0, final, plan)

    if op.local_fwd is None:
        o, fin_loc = op.fwd(q, k, v, g, beta, scale, h0_loc, output_final_state, cp.cu_seqlens, state_pass, A_log,
                            dt_bias, opts or {})
    else:
        if cp.any_crossing:
            if post > 0:        # stage 2 for the summary alone (no state pass, no output), then the exchange
                chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, h0_loc, False, cp.cu_seqlens,
                                           compute_output=False, state_buffers=False, A_log=A_log, dt_bias=dt_bias,
                                           state_pass=lambda k_, w, u, gcum, h, vnew, h0, final, plan:
                                           exchange(k_, w, u, gcum, h0, plan), **(opts or {}))
            else:
                exchange(None, None, None, None, h0_loc, None)
        o, fin_loc = op.local_fwd(q, k, v, g, beta, scale, h0_loc, output_final_state, cp.cu_seqlens, A_log,
                                  dt_bias, opts or {}, n_loc)
    final = None
    if output_final_state:
        final = torch.zeros(cp.num_seqs_global, HV, K, V, dtype=torch.float32, device=dev)
        final[lo:lo + n_end] = fin_loc[:n_end]
        comm.all_reduce_(final)
    return o, final, h0_loc, kept.get("m_next")


def cp_backward(q, k, v, g, beta, scale: float, h0_loc: Optional[torch.Tensor], m_next: Optional[torch.Tensor],
                has_initial_state: bool, do: torch.Tensor, dfinal: Optional[torch.Tensor], cp: CPContext,
                op: CPOp = GDN, A_log=None, dt_bias=None, opts=None):
    """(dq, dk, dv, dg, dbeta, d initial_state [N, HV, K, V] or None, dA_log, ddt_bias) of rank cp.rank (the gate
    parameters' gradients from this rank's tokens, None without them); dfinal: this rank's gradient of the returned
    final states (None where they were not returned)."""
    comm = comm_of(cp)
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    n_loc, lo, pre, post, n_end, s0 = _layout(cp)
    dev = q.device
    beta_scale = (opts or {}).get("beta_scale", 0)
    dht = None
    if dfinal is not None:
        dsum = comm.all_reduce_(dfinal.to(torch.float32).contiguous().clone())
        dht = torch.zeros(n_loc, HV, K, V, dtype=torch.float32, device=dev)
        dht[:n_end] = dsum[lo:lo + n_end]
    elif post > 0:
        dht = torch.zeros(n_loc, HV, K, V, dtype=torch.float32, device=dev)

    def state_bwd(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0, plan, scale_):
        if cp.any_crossing:
            d_in = torch.zeros(1, HV, K, V, dtype=torch.float32, device=dev)
            if pre > 0:
                first_ends_here = n_loc > 1 or post == 0
                dht_first = dht_[:1] if first_ends_here and dht_ is not None else None
                cu_first = plan.cu[:2]
                if dht_first is None and op.decay == "scalar":
                    # only the head window of the first sequence reaches its incoming state's gradient (to e^-20)
                    cu_first = head_window_range(gcum, k_, beta, cu_first, beta_scale)
                first = dataclasses.replace(plan, cu=cu_first, chunk_offsets=plan.chunk_offsets[:2], N=1)
                op.boundary_bwd(q_, k_, w, gcum, do_, dh, dvnew, dht_first, d_in, first, scale_, store_dh=False)
            ag_d = comm.all_gather(d_in[0])
            if post > 0:
                dht_[n_loc - 1].copy_(compose_outgoing(ag_d, m_next, cp.rank, post))
        op.state_bwd(q_, k_, w, gcum, do_, dh, dvnew, dht_, dh0, plan, scale_)

    dq, dk, dv, dg, dbeta, dh0_loc, dA_log, ddt_bias = op.bwd(q, k, v, g, beta, scale, h0_loc, cp.cu_seqlens,
                                                              do.contiguous(), dht, state_bwd, A_log, dt_bias,
                                                              opts or {})
    dh0 = None
    if has_initial_state:
        dh0 = torch.zeros(cp.num_seqs_global, HV, K, V, dtype=torch.float32, device=dev)
        dh0[lo + s0:lo + n_loc] = dh0_loc[s0:]
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


class _CPChunk(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, A_log, dt_bias, scale, output_final_state, cp, op, opts):
        o, final, h0_loc, m_next = cp_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cp, op,
                                              A_log, dt_bias, opts)
        fctx.save_for_backward(q, k, v, g, beta, h0_loc, m_next, A_log, dt_bias)
        fctx.scale, fctx.cp, fctx.output_final_state, fctx.op, fctx.opts = scale, cp, output_final_state, op, opts
        fctx.has_initial_state = initial_state is not None
        return o, (final if final is not None else q.new_empty(0, dtype=torch.float32))

    @staticmethod
    def backward(fctx, do, dfinal):
        q, k, v, g, beta, h0_loc, m_next, A_log, dt_bias = fctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        grads = cp_backward(q, k, v, g, beta, fctx.scale, h0_loc, m_next, fctx.has_initial_state, do,
                            dfinal if fctx.output_final_state else None, fctx.cp, fctx.op, A_log, dt_bias, fctx.opts)
        return (*grads, None, None, None, None, None)


def _cp_call(op: CPOp, q, k, v, g, beta, scale, initial_state, output_final_state, cp, A_log, dt_bias,
             state_v_first, opts):
    if state_v_first and initial_state is not None:              # [N, HV, V, K] -> the pass's [N, HV, K, V]
        initial_state = initial_state.transpose(-1, -2).contiguous()
    o, final = _CPChunk.apply(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, output_final_state, cp, op,
                              opts)
    if not output_final_state:
        return o, None
    return o, (final.transpose(-1, -2).contiguous() if state_v_first else final)


@torch.compiler.disable
def cp_chunk_gated_delta_rule(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                              output_final_state: bool, cp: CPContext, A_log=None, dt_bias=None, beta_scale: int = 0,
                              state_v_first: bool = False,
                              backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The context-parallel call on validated, contiguous inputs (api.py checks them): q, k [1, T/W, H, K], v
    [1, T/W, HV, V], g, beta [1, T/W, HV], initial_state [N, HV, K, V] fp32 ([N, HV, V, K] with state_v_first) or
    None; FLA's in-kernel gate (A_log, dt_bias [HV]) and beta sigmoid (beta_scale 1 or 2) as the one-process call
    takes them; backend "auto" or "triton" (gdn_cp_op). Returns the local o and, with output_final_state, the N final
    states (the same on every rank)."""
    return _cp_call(gdn_cp_op(q, v, cp, backend)[0], q, k, v, g, beta, scale, initial_state, output_final_state, cp,
                    A_log, dt_bias, state_v_first, dict(beta_scale=beta_scale))


@torch.compiler.disable
def cp_chunk_kda(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
                 cp: CPContext, A_log=None, dt_bias=None, gate: str = "", lower_bound: float = 0.0,
                 beta_sigmoid: bool = False, neg_eigval: bool = False,
                 state_v_first: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """cp_chunk_gated_delta_rule for chunk_kda: g [1, T/W, HV, K] the log decay per key channel, or with gate the
    raw input of FLA's KDA gate (chunk_kda_fwd's gate, lower_bound, beta_sigmoid, neg_eigval)."""
    return _cp_call(KDA, q, k, v, g, beta, scale, initial_state, output_final_state, cp, A_log, dt_bias,
                    state_v_first, dict(gate=gate, lower_bound=lower_bound, beta_sigmoid=beta_sigmoid,
                                        neg_eigval=neg_eigval))
