"""Forward of chunk_gated_delta_rule (Triton path) against the fp64 step-by-step recurrence.

Every case draws fresh random inputs, runs the op with every buffer it allocates poisoned with NaN, and checks
o and the final state by relative RMS error with the per-dtype tolerance of linattn.testing.TOL.
"""
import pytest
import torch

import linattn
from linattn.ops.gated_delta_rule.reference import naive_recurrent
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, make_gdn_inputs, random_cu_seqlens


def _fp64(x):
    return {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


def _check(x, dtype, cu_seqlens=None, output_final_state=True, use_l2=False, scale=None):
    with torch.no_grad(), poisoned_allocations():
        o, ht = linattn.chunk_gated_delta_rule(**x, scale=scale, output_final_state=output_final_state,
                                               cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_l2,
                                               backend="triton")
    ref_o, ref_ht = naive_recurrent(**_fp64(x), scale=scale, output_final_state=True, cu_seqlens=cu_seqlens,
                                    use_qk_l2norm_in_kernel=use_l2)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert_close("o", o, ref_o, TOL[dtype])
    if output_final_state:
        assert ht.dtype == torch.float32
        assert_close("final_state", ht, ref_ht, TOL[dtype])
    else:
        assert ht is None


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_lengths(device, T):
    x = make_gdn_inputs(2, T, 1, 2, 16, 32, dtype=torch.float32, device=device)
    _check(x, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_gva(device, dtype):
    x = make_gdn_inputs(1, 130, 2, 4, 64, 64, dtype=dtype, device=device)
    _check(x, dtype)


@pytest.mark.parametrize("K,V", [(60, 100), (100, 60), (128, 64), (64, 128)])
def test_head_sizes(device, K, V):
    x = make_gdn_inputs(1, 70, 1, 2, K, V, dtype=torch.bfloat16, device=device)
    _check(x, torch.bfloat16)


def test_mixed_dtypes(device):
    # fp16 q/k/v with fp32 beta, bf16 g and an fp16 initial state: the state math stays fp32
    x = make_gdn_inputs(2, 65, 2, 2, 32, 32, dtype=torch.float16, gate_dtype=torch.bfloat16,
                        beta_dtype=torch.float32, state_dtype=torch.float16, device=device)
    _check(x, torch.float16)


@pytest.mark.parametrize("with_h0,with_ht", [(False, False), (False, True), (True, False)])
def test_states_optional(device, with_h0, with_ht):
    x = make_gdn_inputs(2, 80, 1, 2, 32, 16, dtype=torch.float32, initial_state=with_h0, device=device)
    _check(x, torch.float32, output_final_state=with_ht)


def test_varlen_gva_one_token_sequences(device):
    lengths = [1, 63, 1, 65, 130, 1]
    cu = random_cu_seqlens(lengths, device=device)
    x = make_gdn_inputs(1, sum(lengths), 2, 4, 32, 32, dtype=torch.bfloat16, num_states=len(lengths), device=device)
    _check(x, torch.bfloat16, cu_seqlens=cu)


def test_varlen_int64_offsets_no_initial_state(device):
    lengths = [64, 1, 100]
    cu = random_cu_seqlens(lengths, device=device).to(torch.int64)
    x = make_gdn_inputs(1, sum(lengths), 1, 1, 16, 16, dtype=torch.float32, initial_state=False, device=device)
    _check(x, torch.float32, cu_seqlens=cu)


def test_l2norm_and_scale(device):
    x = make_gdn_inputs(1, 66, 1, 2, 32, 32, dtype=torch.float32, normalize_k=False, device=device)
    _check(x, torch.float32, use_l2=True, scale=0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_steep_gates(device, dtype):
    # g x 30: a chunk's decay underflows exp; gam_i - gam_j overflows above the diagonal without the mask
    x = make_gdn_inputs(1, 200, 1, 2, 64, 32, dtype=dtype, device=device)
    x["g"] = x["g"] * 30.0
    _check(x, dtype)


def test_reference_backend_matches(device):
    x = make_gdn_inputs(1, 40, 1, 1, 16, 16, dtype=torch.float32, device=device)
    o1, h1 = linattn.chunk_gated_delta_rule(**x, output_final_state=True, backend="reference")
    ref_o, ref_h = naive_recurrent(**_fp64(x), output_final_state=True)
    assert_close("o", o1, ref_o, 1e-5)
    assert_close("final_state", h1, ref_h, 1e-5)
