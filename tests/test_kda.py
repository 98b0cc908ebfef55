"""Kimi Delta Attention: the fp64 reference (linattn/ops/kda/reference.py) against Gated DeltaNet's where the
per-channel decay is constant over K, and against an independent chunk form; the chunked op against the reference
(the decode's tests: test_kda_decode.py). Fresh random inputs every run, outputs poisoned with NaN before the kernels write them."""
import pytest
import torch
import torch.nn.functional as F

from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.ops.kda.reference import kda_gate, naive_recurrent_kda
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, random_cu_seqlens

from kda_cases import f64, kda_inputs   # tests/ is on sys.path
from markers import needs_triton

F32 = TOL[torch.float32]


@pytest.fixture(autouse=True)
def _poisoned():
    """Every buffer a launcher allocates starts as NaN: an element a kernel does not write fails the check."""
    with poisoned_allocations():
        yield


def chunk_form_kda(q, k, v, g, beta, scale, S, C=16):
    """An independent check of the reference: one sequence in the chunk form with per-channel decays (q, k
    [T, HV, K] already GVA-expanded, fp64), exp differences taken per pair of tokens."""
    T = q.shape[0]
    outs = []
    for s in range(0, T, C):
        qc, kc, vc = (x[s:s + C].transpose(0, 1) for x in (q, k, v))
        gc, bc = g[s:s + C].transpose(0, 1).cumsum(1), beta[s:s + C].transpose(0, 1)
        c = qc.shape[1]
        diff = gc[:, :, None, :] - gc[:, None, :, :]                       # [HV, i, j, K]
        incl = torch.ones(c, c, dtype=torch.bool).tril()[None, :, :, None]
        dec = torch.exp(torch.where(incl, diff, torch.zeros_like(diff)))
        akk = torch.einsum("hik,hjk,hijk->hij", kc, kc, dec) * bc[:, :, None]
        akk = akk * torch.ones(c, c, dtype=torch.bool).tril(-1)
        aqk = torch.einsum("hik,hjk,hijk->hij", qc * scale, kc, dec) * incl[..., 0]
        eye = torch.eye(c, dtype=q.dtype).expand_as(akk)
        tinv = torch.linalg.solve_triangular(eye + akk, eye, upper=False, unitriangular=True)
        w = tinv @ (bc[:, :, None] * kc * torch.exp(gc))
        u = tinv @ (bc[:, :, None] * vc)
        vnew = u - w @ S
        outs.append(((qc * scale * torch.exp(gc)) @ S + aqk @ vnew).transpose(0, 1))
        gl = gc[:, -1]
        S = torch.exp(gl)[:, :, None] * S + (kc * torch.exp(gl[:, None, :] - gc)).transpose(1, 2) @ vnew
    return torch.cat(outs), S


# --------------------------------------------------------------------------------------------------- reference
def test_reference_equals_gdn_for_channel_constant_decay():
    x = f64(kda_inputs(2, 37, 2, 4, 16, 16))
    g = x["g"][..., 0]
    o, s = naive_recurrent_kda(x["q"], x["k"], x["v"], g[..., None].expand_as(x["g"]), x["beta"], None,
                               x["initial_state"], True, use_qk_l2norm_in_kernel=True)
    o2, s2 = naive_recurrent(x["q"], x["k"], x["v"], g, x["beta"], None, x["initial_state"], True,
                             use_qk_l2norm_in_kernel=True)
    assert_close("o", o, o2, 1e-12)
    assert_close("final_state", s, s2, 1e-12)


@pytest.mark.parametrize("decay", ["weak", "strong", "mixed"])
def test_reference_matches_chunk_form(decay):
    x = f64(kda_inputs(1, 45, 1, 2, 16, 8, decay=decay))
    q, k = (t[0].repeat_interleave(2, dim=1) for t in (x["q"], x["k"]))
    o, s = naive_recurrent_kda(**x, output_final_state=True)
    o2, s2 = chunk_form_kda(q, k, x["v"][0], x["g"][0], x["beta"][0], 16 ** -0.5, x["initial_state"][0])
    assert_close("o", o[0], o2, 1e-10)
    assert_close("final_state", s[0], s2, 1e-10)


def test_reference_varlen_is_per_sequence():
    x = f64(kda_inputs(1, 20, 2, 2, 16, 16, num_states=3))
    cu = torch.tensor([0, 7, 8, 20])
    o, s = naive_recurrent_kda(**x, output_final_state=True, cu_seqlens=cu)
    for n in range(3):
        a, b = int(cu[n]), int(cu[n + 1])
        part = {name: t[:, a:b] for name, t in x.items() if name != "initial_state"}
        o_n, s_n = naive_recurrent_kda(**part, initial_state=x["initial_state"][n:n + 1], output_final_state=True)
        assert_close(f"o[{n}]", o[:, a:b], o_n, 1e-14)
        assert_close(f"final_state[{n}]", s[n], s_n[0], 1e-14)


def test_kda_gate_forms():
    g = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    A_log, dt_bias = torch.randn(4, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    x = g + dt_bias.view(4, 8)
    assert_close("softplus gate", kda_gate(g, A_log, dt_bias), -A_log.exp()[:, None] * F.softplus(x), 1e-15)
    assert_close("lower-bound gate", kda_gate(g, A_log, dt_bias, -5.0),
                 -5.0 * torch.sigmoid(A_log.exp()[:, None] * x), 1e-15)
    assert_close("lower-bound gate without A_log", kda_gate(g, None, dt_bias, -5.0), -5.0 * torch.sigmoid(x), 1e-15)


# ------------------------------------------------------------------------------------------------------- chunk
def _chunk(**kw):
    from linattn.ops.kda.chunk import chunk_kda
    return chunk_kda(**kw)


@needs_triton
@pytest.mark.parametrize("B,T,H,HV,K,V,decay,dtype", [
    (2, 130, 1, 2, 32, 16, "strong", torch.float32),   # T not a multiple of 64, GVA, decays down to e^-8 per step
    (1, 70, 2, 2, 16, 32, "weak", torch.float32),
    (1, 100, 1, 1, 32, 32, "mixed", torch.bfloat16),
    (1, 80, 1, 2, 48, 16, "mixed", torch.float32),     # K over two key blocks of the stage 2a walk, the second ragged
])
def test_chunk_matches_reference(B, T, H, HV, K, V, decay, dtype):
    x = kda_inputs(B, T, H, HV, K, V, decay=decay, dtype=dtype)
    o, s = _chunk(**x, output_final_state=True, backend="triton")
    o_ref, s_ref = naive_recurrent_kda(**f64(x), output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", o, o_ref, TOL[dtype])
    assert_close("final_state", s, s_ref, TOL[dtype])


@needs_triton
def test_chunk_varlen_uneven_with_one_token_sequence():
    lengths = [1, 67, 30, 2]
    x = kda_inputs(1, sum(lengths), 2, 4, 16, 16, num_states=len(lengths))
    cu = random_cu_seqlens(lengths)
    o, s = _chunk(**x, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend="triton")
    o_ref, s_ref = naive_recurrent_kda(**f64(x), output_final_state=True, cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref, F32)


@needs_triton
@pytest.mark.parametrize("form", ["softplus", "lower_bound"])
def test_chunk_gate_and_beta_sigmoid_in_kernel(form):
    B, T, HV, K, V = 1, 66, 2, 16, 16
    x = kda_inputs(B, T, 1, HV, K, V, h0=False)
    del x["initial_state"]
    x["g"] = torch.randn(B, T, HV, K) * 2
    x["beta"] = torch.randn(B, T, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    lb = -5.0 if form == "lower_bound" else None
    o, s = _chunk(**x, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lb, safe_gate=lb is not None,
                  use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, output_final_state=True, backend="triton")
    ref = f64(x)
    ref["g"] = kda_gate(ref["g"], A_log.double(), dt_bias.double(), lb)
    ref["beta"] = 2 * torch.sigmoid(ref["beta"])
    o_ref, s_ref = naive_recurrent_kda(**ref, output_final_state=True)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref, F32)


class _ArgSpy:
    """Stands in for a Triton kernel of a launcher module: records each launch's positional arguments, then
    launches the real kernel."""
    def __init__(self, real):
        self.real, self.calls = real, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(args)
            return self.real[grid](*args, **kwargs)
        return launch


@needs_triton
def test_chunk_inblock_products_and_pairwise_chunks(monkeypatch):
    """Stage 2a takes a chunk's in-block pairs in products through each block's first row unless a decay is too
    steep for that (kda_cumsum_kernel flags the chunk, kda_diag_kernel forms its pairs one by one): weak decays
    everywhere except one channel at e^-8 per token in chunk 1 of head 1 and in the last block of chunk 2 of head 3,
    so one call (one kda_diag program group of 4 heads) mixes both ways. The backward makes the same choice from
    the same test (kda_recompute_wu_kernel's flags: kda_pair_bwd_kernel's products or kda_pair_diag_bwd_kernel's token
    pairs). The flags are exactly those two in both, and o, the state and every gradient match fp64."""
    from linattn.ops.kda.triton import backward as bw
    from linattn.ops.kda.triton import forward as fw
    spy = _ArgSpy(fw.kda_inter_solve_kernel)
    monkeypatch.setattr(fw, "kda_inter_solve_kernel", spy)
    spy_bwd = _ArgSpy(bw.kda_pair_bwd_kernel)
    monkeypatch.setattr(bw, "kda_pair_bwd_kernel", spy_bwd)
    x = kda_inputs(1, 192, 1, 4, 32, 16, decay="weak")
    g = x["g"].clone()
    g[0, 64:128, 1, 3] = -8.0
    g[0, 176:192, 3, 5] = -8.0
    x["g"] = g
    _check_grads(x, _plain, F32)
    pairwise = [c[4] for c in spy.calls]           # kda_inter_solve_kernel's pairwise_ptr: the forward, the backward's
    assert len(pairwise) >= 1
    expected = torch.zeros(3, 4, dtype=torch.int8)
    expected[1, 1] = expected[2, 3] = 1
    for p in pairwise:
        assert torch.equal(p.cpu(), expected), p
    assert len(spy_bwd.calls) == 1
    assert torch.equal(spy_bwd.calls[0][8].cpu(), expected), spy_bwd.calls[0][8]


def _check_grads(x, extra_ref, tol, **kw):
    """Every gradient of chunk_kda (Triton) against autograd through the fp64 reference; o and the final state get
    fresh random upstream gradients. extra_ref(inputs) maps the inputs to the reference's g and beta."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items() if t is not None}
    o, s = _chunk(**leaves, output_final_state=True, backend="triton", **kw)
    do, dht = torch.randn_like(o, dtype=torch.float32), torch.randn_like(s)
    ((o.float() * do).sum() + (s * dht).sum()).backward()
    ref = {n: t.detach().double().requires_grad_(True) for n, t in leaves.items()}
    o_ref, s_ref = naive_recurrent_kda(**extra_ref(ref), output_final_state=True, cu_seqlens=kw.get("cu_seqlens"),
                                       use_qk_l2norm_in_kernel=kw.get("use_qk_l2norm_in_kernel", False))
    ((o_ref * do.double()).sum() + (s_ref * dht.double()).sum()).backward()
    assert_close("o", o, o_ref, tol)
    assert_close("final_state", s, s_ref, tol)
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype, n
        assert_close(f"d{n}", t.grad, ref[n].grad, tol)


def _plain(r):
    return {n: r[n] for n in ("q", "k", "v", "g", "beta", "initial_state") if n in r}


@needs_triton
@pytest.mark.parametrize("decay", ["strong", "weak"])
def test_chunk_gradients(decay):
    x = kda_inputs(1, 130, 1, 2, 16, 16, decay=decay)     # T not a multiple of 64, GVA, initial state
    _check_grads(x, _plain, F32)


@needs_triton
def test_chunk_gradients_extreme_decays():
    """Decays that no exp(+gam) could survive: a quarter of the channels at e^-40 per token (gam reaches -2560 in a
    chunk), a quarter exactly 0 (no decay), the rest mixed; every factor the kernels form must stay <= 1, so o, the
    state and every gradient match fp64 with no overflow, Inf or NaN."""
    x = kda_inputs(1, 100, 1, 2, 32, 16, decay="mixed")
    K = 32
    sel = torch.arange(K) % 4
    g = x["g"].clone()
    g[..., sel == 0] = -40.0
    g[..., sel == 1] = 0.0
    x["g"] = g
    _check_grads(x, _plain, F32)


@needs_triton
def test_chunk_gradients_key_row_in_blocks():
    x = kda_inputs(1, 100, 1, 2, 48, 16, decay="mixed")  # K over two key blocks of the local kernels, one ragged
    _check_grads(x, _plain, F32)


@needs_triton
def test_chunk_gradients_varlen_l2norm():
    lengths = [1, 66, 20]
    x = kda_inputs(1, sum(lengths), 2, 2, 16, 16, num_states=len(lengths))
    x["k"] = torch.randn_like(x["k"])                     # unnormalised: the in-kernel norm matters
    _check_grads(x, _plain, F32, cu_seqlens=random_cu_seqlens(lengths), use_qk_l2norm_in_kernel=True)


@needs_triton
@pytest.mark.parametrize("form", ["softplus", "lower_bound", "lower_bound_no_a"])
def test_chunk_gradients_gate_in_kernel(form):
    B, T, HV, K = 1, 70, 2, 16
    x = kda_inputs(B, T, 1, HV, K, 16)
    x["g"] = torch.randn(B, T, HV, K) * 2
    x["beta"] = torch.randn(B, T, HV)
    x["A_log"] = None if form == "lower_bound_no_a" else torch.randn(HV) * 0.5
    x["dt_bias"] = torch.randn(HV * K)
    lb = None if form == "softplus" else -5.0

    def ref_gates(r):
        out = _plain(r)
        out["g"] = kda_gate(r["g"], r.get("A_log"), r["dt_bias"], lb)
        out["beta"] = 2 * torch.sigmoid(r["beta"])
        return out
    _check_grads(x, ref_gates, F32, use_gate_in_kernel=True, lower_bound=lb, use_beta_sigmoid_in_kernel=True,
                 allow_neg_eigval=True)


@needs_triton
def test_chunk_gradients_disable_recompute():
    """disable_recompute=True keeps every intermediate instead of rebuilding W, h, Vnew and the decayed keys and
    queries from stage 2a's kept outputs: the same kernels on the same values, so o, the final state and every
    gradient equal the default's bit for bit (varlen with a one-token sequence, gate in the kernel, GVA); the
    default's gradients are checked against fp64 in the tests above, and here too."""
    lengths = [1, 70, 9]
    B, T, HV, K = 1, sum(lengths), 2, 16
    x = kda_inputs(B, T, 1, HV, K, 16, num_states=len(lengths))
    x["g"] = torch.randn(B, T, HV, K) * 2
    x["A_log"] = torch.randn(HV) * 0.5
    x["dt_bias"] = torch.randn(HV * K)
    kw = dict(cu_seqlens=random_cu_seqlens(lengths), use_gate_in_kernel=True)

    def run(**extra):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        o, s = _chunk(**leaves, output_final_state=True, **kw, **extra)
        torch.manual_seed(7)
        ((o * torch.randn_like(o)).sum() + (s * torch.randn_like(s)).sum()).backward()
        return [o, s] + [leaves[n].grad for n in sorted(leaves)]
    default, kept = run(), run(disable_recompute=True)
    for a, b in zip(default, kept):
        assert torch.equal(a, b)

    def ref_gates(r):
        out = _plain(r)
        out["g"] = kda_gate(r["g"], r["A_log"], r["dt_bias"], None)
        return out
    _check_grads(x, ref_gates, F32, disable_recompute=True, **kw)


@needs_triton
def test_chunk_backward_gets_no_zero_filled_gradients(monkeypatch):
    """The kept intermediates and an output no loss reaches come to the backward as None, not as zero-filled
    tensors (set_materialize_grads(False)): a loss on o alone passes no final-state gradient to the backward op; a
    loss on the final state alone runs with a zero do, and its gradients match fp64."""
    from linattn.ops.kda import chunk as kda_chunk
    seen = []
    real = kda_chunk._chunk_kda_bwd

    def spy(*args):
        seen.append(args[16])                                # dht
        return real(*args)
    monkeypatch.setattr(kda_chunk, "_chunk_kda_bwd", spy)
    x = kda_inputs(1, 70, 1, 2, 16, 16)
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, s = _chunk(**leaves, output_final_state=True, backend="triton")
    (o * torch.randn_like(o)).sum().backward()
    assert seen == [None]
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, s = _chunk(**leaves, output_final_state=True, backend="triton")
    dht = torch.randn_like(s)
    (s * dht).sum().backward()
    assert len(seen) == 2 and seen[1] is not None
    ref = {n: t.detach().double().requires_grad_(True) for n, t in leaves.items()}
    _, s_ref = naive_recurrent_kda(**ref, output_final_state=True)
    (s_ref * dht.double()).sum().backward()
    assert ref["q"].grad is None and torch.equal(leaves["q"].grad, torch.zeros_like(leaves["q"]))   # no path to s
    for n, t in leaves.items():
        if n != "q":
            assert_close(f"d{n}", t.grad, ref[n].grad, F32)


@needs_triton
def test_chunk_state_v_first_forward_and_gradients():
    """state_v_first: initial and final states [N, HV, V, K]; o, the final state and every gradient (d initial_state
    in that layout) against the reference on the transposed states."""
    x = kda_inputs(1, 70, 1, 2, 16, 32)
    h0_vk = x["initial_state"].transpose(-1, -2).contiguous().requires_grad_(True)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if n != "initial_state"}
    o, s = _chunk(**leaves, initial_state=h0_vk, output_final_state=True, state_v_first=True, backend="triton")
    assert s.shape == (1, 2, 32, 16)
    do, dht = torch.randn_like(o), torch.randn_like(s)
    ((o * do).sum() + (s * dht).sum()).backward()
    ref = {n: t.detach().double().requires_grad_(True) for n, t in leaves.items()}
    h0_ref = h0_vk.detach().double().requires_grad_(True)
    o_ref, s_ref = naive_recurrent_kda(**ref, initial_state=h0_ref.transpose(-1, -2), output_final_state=True)
    ((o_ref * do.double()).sum() + (s_ref.transpose(-1, -2) * dht.double()).sum()).backward()
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref.transpose(-1, -2), F32)
    assert_close("dinitial_state", h0_vk.grad, h0_ref.grad, F32)
    for n, t in leaves.items():
        assert_close(f"d{n}", t.grad, ref[n].grad, F32)


@needs_triton
def test_chunk_state_v_first_without_autograd():
    """The eager no-grad path (inference, a layer's prefill) with state_v_first: [N, HV, V, K] states in and out."""
    x = kda_inputs(1, 70, 1, 2, 16, 32)
    h0_vk = x.pop("initial_state").transpose(-1, -2).contiguous()
    with torch.no_grad():
        o, s = _chunk(**x, initial_state=h0_vk, output_final_state=True, state_v_first=True, backend="triton")
    o_ref, s_ref = naive_recurrent_kda(**f64(x), initial_state=h0_vk.double().transpose(-1, -2),
                                       output_final_state=True)
    assert s.shape == (1, 2, 32, 16)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref.transpose(-1, -2), F32)


def _chunk_start_states(token_states, h0, lengths, C=64):
    """Per sequence, the state before each C-token chunk: h0 for the first, then the state after token c C - 1."""
    out = []
    for n, (st, L) in enumerate(zip(token_states, lengths)):
        for c in range(-(-L // C)):
            out.append(h0[n] if c == 0 else st[c * C - 1])
    return torch.stack(out)


@needs_triton
@pytest.mark.parametrize("varlen,v_first", [(False, False), (True, True)])
def test_chunk_return_intermediate_states(varlen, v_first):
    """FLA's return_intermediate_states (inference): h, the state at the start of every chunk, [B, NT, HV, K, V]
    (varlen: [1, every sequence's chunks, ...]; [.., V, K] with state_v_first), against the reference's token
    states; o and the final state unchanged; refused with autograd on."""
    lengths = [1, 130, 0, 64, 65] if varlen else [100, 100]
    B, T = (1, sum(lengths)) if varlen else (2, 100)
    x = kda_inputs(B, T, 1, 2, 16, 32, num_states=len(lengths))
    cu = random_cu_seqlens(lengths) if varlen else None
    h0 = x.pop("initial_state")
    h0_arg = h0.transpose(-1, -2).contiguous() if v_first else h0
    with torch.inference_mode():
        o, s, h = _chunk(**x, initial_state=h0_arg, output_final_state=True, cu_seqlens=cu, state_v_first=v_first,
                         return_intermediate_states=True, backend="triton")
    o_ref, s_ref, states = naive_recurrent_kda(**f64(x), initial_state=h0.double(), output_final_state=True,
                                               cu_seqlens=cu, output_token_states=True)
    want = _chunk_start_states(states, h0.double(), lengths)
    nt = sum(-(-L // 64) for L in lengths)
    assert h.dtype == x["q"].dtype
    if varlen:
        assert h.shape == ((1, nt, 2, 32, 16) if v_first else (1, nt, 2, 16, 32))
        got = h[0]
    else:
        assert h.shape == (B, 2, 2, 16, 32)
        got = h.flatten(0, 1)
    assert_close("h", got.transpose(-1, -2) if v_first else got, want, F32)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s.transpose(-1, -2) if v_first else s, s_ref, F32)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    with pytest.raises(ValueError, match="return_intermediate_states"):
        _chunk(**leaves, return_intermediate_states=True, backend="triton")


@needs_triton
def test_chunk_gradients_bf16():
    x = kda_inputs(1, 64, 1, 1, 32, 32, dtype=torch.bfloat16)
    _check_grads(x, _plain, TOL[torch.bfloat16])


@needs_triton
def test_chunk_use_graph_padded_varlen():
    """FLA's use_graph form: cu_seqlens padded with zero-length tail sequences to max_num_seqs + 1, states
    [max_num_seqs, ...]: the padded call equals the unpadded one on the real sequences; a wrong padding is named."""
    lengths = [20, 1, 50]
    x = kda_inputs(1, sum(lengths), 1, 2, 16, 16, num_states=5)
    cu = random_cu_seqlens(lengths)
    cu_pad = torch.cat([cu, cu[-1:].repeat(2)])
    o, s = _chunk(**x, output_final_state=True, cu_seqlens=cu_pad, use_graph=True, max_num_seqs=5,
                  backend="triton")
    o1, s1 = _chunk(**dict(x, initial_state=x["initial_state"][:3]), output_final_state=True, cu_seqlens=cu,
                    backend="triton")
    assert torch.equal(o, o1) and torch.equal(s[:3], s1)
    assert torch.equal(s[3:], x["initial_state"][3:])               # an empty sequence keeps its state
    with pytest.raises(ValueError, match="max_num_seqs"):
        _chunk(**x, cu_seqlens=cu_pad, use_graph=True, max_num_seqs=4)


def test_chunk_options_not_run_yet_are_refused_by_name():
    x = kda_inputs(1, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64.*got 16"):
        _chunk(**x, chunk_size=16)
    with pytest.raises(ValueError, match="lower_bound must be a negative float"):
        _chunk(**x, lower_bound=2.0)
    with pytest.raises(ValueError, match="return_intermediate_states.*chunk_size=32"):
        with torch.inference_mode():
            _chunk(**x, chunk_size=32, return_intermediate_states=True)
    with pytest.raises(ValueError, match="g must be"):
        _chunk(**dict(x, g=x["g"][..., :8]))
    with pytest.raises(ValueError, match="safe_gate"):
        _chunk(**x, use_gate_in_kernel=True, A_log=torch.zeros(1), safe_gate=True)


@needs_triton
def test_chunk_fla_promises_change_nothing():
    """FLA's chunk_size=32 runs the 64-token chunks, and lower_bound without the gate in the kernel (with safe_gate,
    FLA's promise that g >= lower_bound) needs no bound here: the same output and final state, bit for bit, for the
    chunked op and the decode."""
    x = kda_inputs(1, 100, 1, 2, 16, 16)
    x["g"] = x["g"].clamp(min=-5.0)
    o0, h0 = _chunk(**x, output_final_state=True)
    o1, h1 = _chunk(**x, output_final_state=True, chunk_size=32, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)
    y = kda_inputs(2, 1, 1, 2, 16, 16)
    y["g"] = y["g"].clamp(min=-5.0)
    from linattn.ops.kda.fused_recurrent import fused_recurrent_kda
    o0, h0 = fused_recurrent_kda(**y, output_final_state=True)
    o1, h1 = fused_recurrent_kda(**y, output_final_state=True, lower_bound=-5.0)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)


def test_chunk_reference_backend_is_differentiable():
    x = kda_inputs(1, 9, 1, 2, 16, 16)
    for t in x.values():
        t.requires_grad_(True)
    o, s = _chunk(**x, output_final_state=True, backend="reference")
    (o.sum() + s.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in x.values())


def test_kda_backward_feeds_no_transposed_dot_result_to_a_dot():
    """The Triton 3.4-3.7 Hopper miscompile that GDN's backward avoids (tests/test_chunk_backward.py): the same
    static check on KDA's backward kernels."""
    import ast
    import pathlib
    import linattn
    from test_chunk_backward import _dot_tainted_trans
    path = pathlib.Path(linattn.__file__).parent / "ops" / "kda" / "triton" / "backward.py"
    kernels = [f for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef)
               and any(isinstance(d, ast.Attribute) and d.attr == "jit" for d in f.decorator_list)]
    assert len(kernels) == 6     # wy, pair diag, pair, dg, the GVA sum, _gam_row: every jit function (the column sum
    # is linattn/ops/col_sum.py, no dot)
    for fn in kernels:
        _, bad = _dot_tainted_trans(fn)
        assert not bad, f"{fn.name}: {bad}"


@needs_triton
def test_torch_compile_fullgraph_chunk_forward_backward_and_decode():
    """chunk_kda (forward and backward) and fused_recurrent_kda traced by torch.compile(fullgraph=True): a graph
    break raises; results against the fp64 reference."""
    import linattn
    x = {n: t.requires_grad_(True) for n, t in kda_inputs(1, 70, 1, 2, 16, 16).items()}

    def model(q, k, v, g, beta, initial_state):
        o, s = linattn.chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
        return o.square().sum() + s.square().sum()

    loss = torch.compile(model, fullgraph=True)(**x)
    loss.backward()
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    o, s = naive_recurrent_kda(**ref, output_final_state=True)
    (o.square().sum() + s.square().sum()).backward()
    assert_close("loss", loss, o.square().sum() + s.square().sum(), F32)
    for n, t in x.items():
        assert_close(f"d{n}", t.grad, ref[n].grad, F32)

    y = kda_inputs(2, 1, 1, 2, 16, 16)
    pool = torch.randn(3, 2, 16, 16)
    idx = torch.tensor([2, 0])

    def step(q, k, v, g, beta, pool, idx):
        return linattn.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, state_indices=idx, inplace=True)[0]

    with torch.no_grad():
        expect, s_ref = naive_recurrent_kda(**dict(f64(y), initial_state=pool[[2, 0]].double()),
                                            output_final_state=True)
        got = torch.compile(step, fullgraph=True)(*(y[n] for n in ("q", "k", "v", "g", "beta")), pool, idx)
    assert_close("decode o", got, expect, F32)
    assert_close("decode pool", pool[[2, 0]], s_ref, F32)
