"""causal_conv1d and causal_conv1d_update against the fp64 reference: outputs, final states and every gradient,
fixed-length and varlen batches (uneven lengths, a 1-token and an empty sequence, sequences shorter than W),
W in {2, 3, 4}, D not a power of two, T not a multiple of the token block; the decode step equals the matching
slice of one full call, and pool slots it does not select stay untouched."""
import pytest
import torch

import linattn
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, random_cu_seqlens

D = 37
LENGTHS = [5, 1, 0, 70, 3]          # packed: 79 tokens, not a multiple of 64


def _inputs(device, dtype, W, varlen, bias=True, h0=True, residual=True):
    if varlen:
        cu = random_cu_seqlens(LENGTHS, device)
        B, T, N = 1, sum(LENGTHS), len(LENGTHS)
    else:
        cu, B, T, N = None, 2, 70, 2
    r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    return dict(x=r(B, T, D).to(dtype), weight=(r(D, W) * 0.5).to(dtype), bias=r(D).to(dtype) if bias else None,
                residual=r(B, T, D).to(dtype) if residual else None,
                initial_state=r(N, D, W).to(dtype) if h0 else None, cu_seqlens=cu)


def _run(inp, backend, activation, output_final_state=True, cast=None):
    leaves = {k: (v.detach().to(cast) if cast else v.detach()).requires_grad_(True)
              for k, v in inp.items() if k != "cu_seqlens" and v is not None}
    y, final = linattn.causal_conv1d(leaves["x"], leaves["weight"], leaves.get("bias"), leaves.get("residual"),
                                     leaves.get("initial_state"), output_final_state, activation, backend,
                                     inp["cu_seqlens"])
    g = torch.Generator().manual_seed(0)       # the same upstream gradients for both backends
    loss = (y * torch.randn(y.shape, generator=g).to(y)).sum()
    if final is not None:
        loss = loss + (final * torch.randn(final.shape, generator=g).to(final)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return y, final, dict(zip(leaves, grads))


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_matches_fp64(device, W, varlen, dtype):
    inp = _inputs(device, dtype, W, varlen)
    with poisoned_allocations():
        y, final, grads = _run(inp, "triton", "silu")
    y_ref, final_ref, grads_ref = _run(inp, "reference", "silu", cast=torch.float64)
    assert y.dtype == dtype and final.dtype == dtype
    tol = TOL[dtype]
    assert_close("y", y, y_ref, tol)
    assert_close("final_state", final, final_ref, tol)
    for name in grads_ref:
        assert grads[name].dtype == inp[name].dtype
        assert_close(f"d{name}", grads[name], grads_ref[name], tol)


# sequences across the backward's 128-token segments: a start on a segment's first token (128, 256), a 1-token and an
# empty sequence at a segment's second token, a sequence ending inside the next segment's first W - 1 tokens (389)
LONG_LENGTHS = [128, 1, 0, 127, 130, 3, 200]


@pytest.mark.parametrize("W,varlen", [(4, False), (4, True), (1, True), (6, True)])
def test_conv_backward_across_segments(device, W, varlen):
    """Gradients when sequences are longer than the backward's token segments and their boundaries fall on, just
    after and just before a segment's edge: dx of a segment's last tokens needs the next segment's first da, the
    window of inputs is refilled at each sequence start, dweight / dbias summed over the segments once."""
    g = torch.Generator(device="cpu").manual_seed(torch.seed() % 2**31)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    if varlen:
        cu, B, T, N = random_cu_seqlens(LONG_LENGTHS, device), 1, sum(LONG_LENGTHS), len(LONG_LENGTHS)
    else:
        cu, B, T, N = None, 2, 389, 2
    inp = dict(x=r(B, T, D), weight=r(D, W) * 0.5, bias=r(D), residual=None, initial_state=r(N, D, W),
               cu_seqlens=cu)
    with poisoned_allocations():
        y, final, grads = _run(inp, "triton", "silu")
    y_ref, final_ref, grads_ref = _run(inp, "reference", "silu", cast=torch.float64)
    assert_close("y", y, y_ref, TOL[torch.float32])
    assert_close("final_state", final, final_ref, TOL[torch.float32])
    for name in grads_ref:
        assert_close(f"d{name}", grads[name], grads_ref[name], TOL[torch.float32])


def test_forward_grid_fits_any_token_count():
    """The forward's segments along the grid's second dimension stay within CUDA's 65535 for any T (one program per
    segment), and no longer than needed."""
    from linattn.ops.conv1d.triton.conv1d import L_FWD, _fwd_segment
    for T in (1, 8192, L_FWD * 65535, L_FWD * 65535 + 1, 2**31 - 1):
        L = _fwd_segment(T)
        assert -(-T // L) <= 65535 and (L == L_FWD or -(-T // (L // 2)) > 65535), (T, L)


@pytest.mark.parametrize("varlen", [False, True])
def test_conv_without_options(device, varlen):
    """No bias, no initial state, no residual, no activation, no final state."""
    inp = _inputs(device, torch.float32, 4, varlen, bias=False, h0=False, residual=False)
    with poisoned_allocations():
        y, final, grads = _run(inp, "triton", None, output_final_state=False)
    y_ref, _, grads_ref = _run(inp, "reference", None, output_final_state=False, cast=torch.float64)
    assert final is None
    assert_close("y", y, y_ref, TOL[torch.float32])
    for name in grads_ref:
        assert_close(f"d{name}", grads[name], grads_ref[name], TOL[torch.float32])


def test_conv_strided_x(device):
    """x as a column slice of a wider projection (FLA's QKV views): read through its strides."""
    W = 3
    wide = torch.randn(2, 70, 2 * D + 5, device=device)
    x = wide[:, :, 3:3 + D]
    w, h0 = torch.randn(D, W, device=device), torch.randn(2, D, W, device=device)
    y, f = linattn.causal_conv1d(x, w, initial_state=h0, output_final_state=True, activation="silu")
    y_ref, f_ref = linattn.causal_conv1d(x.double(), w.double(), initial_state=h0.double(), output_final_state=True,
                                         activation="silu", backend="reference")
    assert_close("y", y, y_ref, TOL[torch.float32])
    assert_close("final_state", f, f_ref, TOL[torch.float32])


def test_repeat_calls_skip_checks_but_not_for_a_new_signature(device, monkeypatch):
    """causal_conv1d remembers a call signature whose checks passed and chose Triton: repeat calls on fresh inputs of
    that signature skip the checks and stay correct; another signature is checked (a bad one refused); cu_seqlens on
    the CPU is checked on every call (the checks read its values there)."""
    from linattn.ops.conv1d import api as conv_api
    calls = []
    orig = conv_api.check_conv_inputs
    monkeypatch.setattr(conv_api, "check_conv_inputs", lambda *a: calls.append(a[1].dtype) or orig(*a))
    conv_api._CHECKED.clear()
    for _ in range(3):
        inp = _inputs(device, torch.float32, 4, False)
        with torch.no_grad(), poisoned_allocations():
            y, final = linattn.causal_conv1d(**inp, output_final_state=True, activation="silu")
        ref = {k: None if v is None else v.double() for k, v in inp.items()}
        y_ref, final_ref = linattn.causal_conv1d(**ref, output_final_state=True, activation="silu",
                                                 backend="reference")
        assert_close("y", y, y_ref, TOL[torch.float32])
        assert_close("final_state", final, final_ref, TOL[torch.float32])
    assert calls.count(torch.float32) == 1      # the reference calls (fp64, backend="reference") are all checked
    with pytest.raises(ValueError, match="initial_state"):
        linattn.causal_conv1d(inp["x"], inp["weight"], initial_state=inp["initial_state"][:1])
    assert calls.count(torch.float32) == 2
    x, w = torch.randn(1, 8, D, device=device), torch.randn(D, 3, device=device)
    with torch.no_grad():
        linattn.causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 3, 8], device=device))
        if x.device.type == "cpu":
            with pytest.raises(ValueError, match="cu_seqlens"):
                linattn.causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 3, 7], device=device))


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_update_equals_full_call(device, W, dtype, state_dtype):
    """Prefill P tokens, then T - P decode steps (one token, then a 3-token step) through pool slots with a padded
    row: every output equals the full call's token, the selected slots end at its final state, the padded row's
    output is zero and the slots nobody selected (poisoned with NaN) are never touched."""
    N, T, P, slots = 3, 9, 5, 6
    x = torch.randn(N, T, D, device=device).to(dtype)
    w, b = torch.randn(D, W, device=device).to(dtype), torch.randn(D, device=device).to(dtype)
    h0 = torch.randn(N, D, W, device=device).to(dtype)
    y_full, f_full = linattn.causal_conv1d(x.double(), w.double(), b.double(), None, h0.double(), True, "silu",
                                           backend="reference")
    _, f_pre = linattn.causal_conv1d(x[:, :P], w, b, None, h0, True, "silu")
    pool = torch.full((slots, D, W), float("nan"), device=device, dtype=state_dtype)
    live = torch.tensor([4, 0, 2], device=device)
    pool[live] = f_pre.to(state_dtype)
    idx = torch.tensor([4, -1, 0, 2], device=device, dtype=torch.int32)      # row 1 is padding
    rows = torch.tensor([0, 0, 1, 2], device=device)                       # the sequence of each row
    tol = TOL[dtype]
    with torch.no_grad(), poisoned_allocations():
        for t in range(P, T - 3):
            y = linattn.causal_conv1d_update(x[rows, t], pool, w, b, "silu", idx)
            assert y.shape == (4, D) and y.dtype == dtype
            assert bool((y[1] == 0).all())
            assert_close(f"y[{t}]", y[[0, 2, 3]], y_full[:, t], tol)
        y = linattn.causal_conv1d_update(x[rows, T - 3:], pool, w, b, "silu", idx)
    assert y.shape == (4, 3, D) and bool((y[1] == 0).all())
    assert_close("y[T-3:]", y[[0, 2, 3]], y_full[:, T - 3:], tol)
    assert_close("pool", pool[live], f_full, tol)
    assert bool(torch.isnan(pool[[1, 3, 5]]).all()), "a slot nobody selected was written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_update3_equals_three_full_calls(device, dtype):
    """causal_conv1d_update3 (three updates in one launch, different widths D, shared slots with a padded row):
    each output and each selected slot against its own fp64 full call after a prefill; unselected slots untouched."""
    from linattn.ops.conv1d import causal_conv1d_update3
    W, N, P, slots = 4, 3, 5, 5
    Ds = (D, 16, 2 * D + 3)
    xs = [torch.randn(N, P + 1, d, device=device).to(dtype) for d in Ds]
    ws = [(torch.randn(d, W, device=device) * 0.5).to(dtype) for d in Ds]
    bs = [torch.randn(d, device=device).to(dtype) for d in Ds]
    live = torch.tensor([3, 0, 1], device=device)
    idx = torch.tensor([3, -1, 0, 1], device=device, dtype=torch.int32)        # row 1 is padding
    rows = torch.tensor([0, 0, 1, 2], device=device)
    pools, fulls = [], []
    for x, w, b, d in zip(xs, ws, bs, Ds):
        _, f_pre = linattn.causal_conv1d(x[:, :P], w, b, None, None, True, "silu")
        pool = torch.full((slots, d, W), float("nan"), device=device, dtype=torch.float32)
        pool[live] = f_pre.float()
        pools.append(pool)
        fulls.append(linattn.causal_conv1d(x.double(), w.double(), b.double(), None, None, True, "silu",
                                           backend="reference"))
    with torch.no_grad(), poisoned_allocations():
        ys = causal_conv1d_update3([x[rows, P] for x in xs], pools, ws, bs, activation="silu", state_indices=idx)
    for i, (y, pool, (y_full, f_full)) in enumerate(zip(ys, pools, fulls)):
        assert y.shape == (4, Ds[i]) and y.dtype == dtype and bool((y[1] == 0).all())
        assert_close(f"y{i}", y[[0, 2, 3]], y_full[:, P], TOL[dtype])
        assert_close(f"pool{i}", pool[live], f_full, TOL[dtype])
        assert bool(torch.isnan(pool[[2, 4]]).all()), "a slot nobody selected was written"


def test_update_without_indices(device):
    """state_indices=None: row n uses slot n; no bias, no activation."""
    W = 3
    x = torch.randn(2, 4, D, device=device)
    w, h0 = torch.randn(D, W, device=device), torch.randn(2, D, W, device=device)
    y_ref, f_ref = linattn.causal_conv1d(x.double(), w.double(), initial_state=h0.double(),
                                         output_final_state=True, backend="reference")
    state = h0.clone()
    with poisoned_allocations():
        y = linattn.causal_conv1d_update(x, state, w)
    assert_close("y", y, y_ref, TOL[torch.float32])
    assert_close("state", state, f_ref, TOL[torch.float32])


def test_custom_ops_opcheck(device):
    """Schemas, fake implementations and the registered autograd of the custom ops."""
    W = 3
    x, w, b = torch.randn(1, 10, 6, device=device), torch.randn(6, W, device=device), torch.randn(6, device=device)
    h0, cu = torch.randn(2, 6, W, device=device), random_cu_seqlens([4, 6], device)
    torch.library.opcheck(torch.ops.linattn.causal_conv1d_fwd, (x.requires_grad_(), w, b, None, h0, True, "silu", cu),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    pool = torch.randn(3, 6, W, device=device)
    torch.library.opcheck(torch.ops.linattn.causal_conv1d_update,
                          (x[0, :2].detach(), pool, w, b, "silu", torch.tensor([2, -1], device=device)),
                          test_utils=("test_schema", "test_faketensor"))
    w2, pool2 = torch.randn(4, W, device=device), torch.randn(3, 4, W, device=device)
    torch.library.opcheck(torch.ops.linattn.causal_conv1d_update3,
                          (x[0, :2].detach(), x[0, 2:4].detach(), torch.randn(2, 4, device=device), pool.clone(),
                           pool.clone(), pool2, w, w, w2, b, b, torch.randn(4, device=device), "silu",
                           torch.tensor([2, -1], device=device)),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs_are_named(device):
    x, w = torch.randn(1, 8, 6, device=device), torch.randn(6, 3, device=device)
    cases = [
        (dict(x=x[0], weight=w), ValueError, "x must be"),
        (dict(x=x, weight=w[:, None]), ValueError, "weight must be"),
        (dict(x=x, weight=w, bias=torch.randn(5, device=device)), ValueError, "bias must be"),
        (dict(x=x, weight=w, activation="relu"), ValueError, "activation"),
        (dict(x=x, weight=w, initial_state=torch.randn(2, 6, 3, device=device)), ValueError, "initial_state"),
        (dict(x=x, weight=w, cu_seqlens=torch.tensor([0, 3, 7])), ValueError, "cu_seqlens"),
        (dict(x=x, weight=w, cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens"),
        (dict(x=x, weight=w, cp_context=object()), TypeError, "cp_context"),
    ]
    for kw, exc, word in cases:
        with pytest.raises(exc, match=word):
            linattn.causal_conv1d(**kw)
    pool = torch.randn(4, 6, 3, device=device)
    ucases = [
        (dict(x=x[0, :2], conv_state=pool[:, :, :2], weight=w), "conv_state"),
        (dict(x=x[0, :2], conv_state=pool, weight=w), "without state_indices"),
        (dict(x=x[0, :2], conv_state=pool, weight=w, state_indices=torch.tensor([4, 0])), "out of range"),
        (dict(x=x[0, :2], conv_state=pool, weight=w, state_indices=torch.tensor([1, 1])), "twice"),
        (dict(x=x[0, :2].requires_grad_(), conv_state=pool[:2], weight=w), "requires grad"),
    ]
    for kw, word in ucases:
        with pytest.raises(ValueError, match=word):
            linattn.causal_conv1d_update(**kw)
