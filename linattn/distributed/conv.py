"""Context-parallel causal_conv1d (FLA 0.6's `cp_context` on fla.modules.causal_conv1d): one packed stream split
over W ranks (context.py), exact results.

The convolution at a rank's first token reads the W - 1 inputs before it; where the rank's first sequence started
on an earlier rank, those inputs live there. Forward: every rank contributes its last min(W - 1, T / W) inputs to
one all-gather; rank r takes the last W - 1 inputs of the stream before it (from rank r - 1, and from ranks before
that when a rank holds fewer than W - 1 tokens), keeps the ones that belong to its first sequence
(pre_num_conv_tokens of them at most) and runs the one-process kernels on its tokens with them as that sequence's
initial state. Backward: that initial state's gradient goes back in one all-gather, and each rank adds what the
later ranks' states read of its inputs to the gradient of its last tokens. weight's and bias's gradients on a rank
are from its tokens (sum them over ranks as for any parameter). As FLA, no initial or final states under CP; every
rank must make the same call and run the backward.
"""
from __future__ import annotations

import torch

from linattn.distributed.comm import comm_of


def _halo_rows(W: int, P: int) -> int:
    """Inputs each rank contributes to the halo: its last min(W - 1, T / W)."""
    return min(W - 1, P)


class _Halo(torch.autograd.Function):
    """x [P, D] (this rank's inputs) -> the local initial states [N_loc, D, W]: zeros but for the first sequence's
    W - 1 newest columns where it started on an earlier rank."""

    @staticmethod
    def forward(fctx, x, W, cp, n_loc):
        comm = comm_of(cp)
        P, D = x.shape
        m = _halo_rows(W, P)
        tail = x.new_zeros(W - 1, D)
        if m:
            tail[W - 1 - m:] = x[P - m:]
        g = comm.all_gather(tail)                                       # [world, W - 1, D]
        h0 = x.new_zeros(n_loc, D, W)
        valid = min(W - 1, cp.pre_num_conv_tokens)
        if valid > 0 and m:
            rows = [g[j, W - 1 - m:] for j in range(cp.rank)]           # the stream before this rank, m per rank
            prev = torch.cat([x.new_zeros(W - 1, D)] + rows)[-(W - 1):]
            h0[0, :, W - valid:] = prev[W - 1 - valid:].transpose(0, 1)
        fctx.W, fctx.cp, fctx.m, fctx.shape = W, cp, m, (P, D)
        return h0

    @staticmethod
    def backward(fctx, dh0):
        W, cp, m, (P, D) = fctx.W, fctx.cp, fctx.m, fctx.shape
        comm = comm_of(cp)
        d_prev = dh0.new_zeros(W - 1, D)
        valid = min(W - 1, cp.pre_num_conv_tokens)
        if valid > 0 and m:
            d_prev[W - 1 - valid:] = dh0[0, :, W - valid:].transpose(0, 1)
        gd = comm.all_gather(d_prev)                                    # [world, W - 1, D]
        dx = dh0.new_zeros(P, D)
        j = cp.rank
        if m:
            # rank r's halo is the last W - 1 rows of [zeros(W - 1); m rows of each rank before r]: this rank's row
            # i sits at (W - 1) + j m + i of that stream, which holds index (W - 1) + (j - r) m + i of r's halo
            r = j + 1
            while r < cp.world_size and (r - j - 1) * m < W - 1:
                base = (W - 1) + (j - r) * m
                lo, hi = max(0, -base), min(m, W - 1 - base)
                if lo < hi:
                    dx[P - m + lo:P - m + hi] += gd[r, base + lo:base + hi]
                r += 1
        return dx, None, None, None


def cp_causal_conv1d(conv, x, weight, bias, residual, activation, backend, cp):
    """The cp_context call on checked inputs: x [1, T / W, D] (this rank's tokens); conv: the one-process op
    (linattn.causal_conv1d, passed in by its caller: this layer does not import the ops). Returns (y, None)."""
    h0 = _Halo.apply(x[0], weight.shape[-1], cp, cp.num_seqs)
    y, _ = conv(x, weight, bias, residual, h0, False, activation, backend, cu_seqlens=cp.cu_seqlens)
    return y, None
