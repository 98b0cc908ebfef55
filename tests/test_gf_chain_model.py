"""The gate-free chain's models (linattn/testing/gf_chain.py): the present order and the lookahead order (a candidate
reformulation) are the chunk form of gdn-math.md exactly (float64, no rounding), and with the
kernel's bf16 roundings the lookahead order's error against float64 stays within 10% of the present order's. Fresh
random inputs each run."""
import time

import pytest
import torch

from linattn.ops.gated_delta_rule.reference import chunk_reference
from linattn.testing.gf_chain import bf16_round, chain_lookahead, chain_today, make_head, rel_rms


def _ident(x):
    return x


def _seed():
    return int(time.time() * 1e6) % 2 ** 31


@pytest.mark.parametrize("T,decay,h0", [(1000, 1.0, True), (640, 0.01, False), (130, 3.0, True), (1, 1.0, True)])
def test_both_orders_are_the_chunk_form(T, decay, h0):
    """Without rounding, either order's o and final state equal the frozen float64 chunk reference (to float64
    rounding): the lookahead's K_{c+1} S_{c+1} = e^gC (K_{c+1} S_c) + (K_{c+1} K_c^T)(d vnew_c) is an identity."""
    q, k, v, g, beta, S0 = make_head(T, decay=decay, seed=_seed(), h0=h0)
    scale = 128 ** -0.5
    o_ref, S_ref = chunk_reference(q[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None],
                                   beta[None, :, None], scale=scale, initial_state=S0[None, None],
                                   output_final_state=True)
    o_ref, S_ref = o_ref[0, :, 0], S_ref[0, 0]
    assert o_ref.dtype == torch.float64 and torch.isfinite(o_ref).all() and o_ref.abs().max() > 0
    for chain in (chain_today, chain_lookahead):
        o, S = chain(q, k, v, g, beta, S0, scale, _ident)
        assert rel_rms(o, o_ref) < 1e-12 and rel_rms(S, S_ref) < 1e-12, (chain.__name__, rel_rms(o, o_ref),
                                                                           rel_rms(S, S_ref))


@pytest.mark.parametrize("T,decay", [(4096, 1.0), (4096, 0.01), (2000, 3.0)])
def test_lookahead_rounding_error_matches_present_order(T, decay):
    """With bf16 operands where the kernel stores them, the lookahead order is no more than 10% less accurate than
    the present order against float64 (o and final state), and both stay well inside the Gluon gate's tolerance."""
    q, k, v, g, beta, S0 = make_head(T, decay=decay, seed=_seed())
    scale = 128 ** -0.5
    o_ref, S_ref = chain_today(q, k, v, g, beta, S0, scale, _ident)
    o_t, S_t = chain_today(q, k, v, g, beta, S0, scale, bf16_round)
    o_l, S_l = chain_lookahead(q, k, v, g, beta, S0, scale, bf16_round)
    err = {name: (rel_rms(o, o_ref), rel_rms(S, S_ref)) for name, (o, S) in
           (("today", (o_t, S_t)), ("lookahead", (o_l, S_l)))}
    # the roundings are there: a model that rounded nothing would hide the question
    assert err["today"][0] > 1e-4 and err["today"][1] > 1e-4, err
    for i in range(2):
        assert err["lookahead"][i] <= 1.1 * err["today"][i], err
        assert err["lookahead"][i] < 1e-2, err
