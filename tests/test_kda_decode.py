"""KDA decode (fused_recurrent_kda) against the fp64 reference: steps and short multi-token calls, GVA, in-kernel L2
norm and gate, varlen with one-token sequences, state pools in place with padding (both state layouts), speculative
decoding against the reference backend, the persistent walk, and named errors. Fresh random inputs every run, outputs
poisoned with NaN before the kernels write them."""
import pytest
import torch
import torch.nn.functional as F

from linattn.ops.kda.reference import kda_gate, naive_recurrent_kda
from linattn.runtime.alloc import poisoned_allocations
from linattn.testing import TOL, assert_close, random_cu_seqlens

from kda_cases import f64, kda_inputs   # tests/ is on sys.path
from launch_spy import spy_grids
from markers import needs_triton

F32 = TOL[torch.float32]


@pytest.fixture(autouse=True)
def _poisoned():
    """Every buffer a launcher allocates starts as NaN: an element a kernel does not write fails the check."""
    with poisoned_allocations():
        yield


# ------------------------------------------------------------------------------------------------------ decode
def _decode(**kw):
    from linattn.ops.kda.fused_recurrent import fused_recurrent_kda
    return fused_recurrent_kda(**kw)


@needs_triton
@pytest.mark.parametrize("B,T,H,HV,K,V,decay,l2", [
    (2, 1, 2, 2, 16, 16, "mixed", False),      # the decode step
    (2, 3, 1, 2, 32, 16, "strong", True),      # several tokens, GVA, in-kernel L2 norm
    (1, 4, 2, 4, 16, 32, "weak", False),
])
def test_decode_matches_reference(B, T, H, HV, K, V, decay, l2):
    x = kda_inputs(B, T, H, HV, K, V, decay=decay)
    o, s = _decode(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2, backend="triton")
    o_ref, s_ref = naive_recurrent_kda(**f64(x), output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref, F32)


@needs_triton
def test_decode_inputs_that_require_grad_run_forward_only():
    """As FLA's fused_recurrent_kda: inputs that require grad run the forward (equal to the no_grad call), and a
    backward through the outputs raises NotImplementedError naming the op."""
    x = kda_inputs(2, 2, 1, 2, 16, 16)
    with torch.no_grad():
        o_ref, s_ref = _decode(**x, output_final_state=True, backend="triton")
    x = {n: t.clone().requires_grad_(True) if n in ("q", "g", "initial_state") else t for n, t in x.items()}
    o, s = _decode(**x, output_final_state=True, backend="triton")
    assert_close("o", o.detach(), o_ref, F32)
    assert_close("final_state", s.detach(), s_ref, F32)
    with pytest.raises(NotImplementedError, match="fused_recurrent_kda has no backward"):
        (o.sum() + s.sum()).backward()


@needs_triton
def test_decode_varlen_with_one_token_sequence_no_initial_state():
    x = kda_inputs(1, 7, 1, 2, 16, 16, h0=False)
    cu = random_cu_seqlens([1, 4, 2])
    o, s = _decode(**x, output_final_state=True, cu_seqlens=cu, backend="triton")
    o_ref, s_ref = naive_recurrent_kda(**f64(x), output_final_state=True, cu_seqlens=cu)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref, F32)


@needs_triton
@pytest.mark.parametrize("state_v_first", [False, True])
def test_decode_pool_in_place_with_padding(state_v_first):
    N, slots, HV, K, V = 4, 7, 2, 16, 16
    x = kda_inputs(N, 1, 1, HV, K, V, h0=False)
    del x["initial_state"]
    pool = torch.randn(slots, HV, K, V)
    idx = torch.tensor([5, -1, 0, 2])                 # row 1 padded; with pad_slot_id=0 row 2 too
    stored = pool.transpose(-1, -2).contiguous() if state_v_first else pool.clone()
    o, out = _decode(**x, initial_state=stored, state_indices=idx, inplace=True, pad_slot_id=0,
                     state_v_first=state_v_first, backend="triton")
    assert out is stored
    live = [0, 3]
    o_ref, s_ref = naive_recurrent_kda(**{n: t[live] for n, t in f64(x).items() if t is not None},
                                       initial_state=pool[[5, 2]].double(), output_final_state=True)
    assert_close("o (live rows)", o[live], o_ref, F32)
    assert torch.equal(o[[1, 2]], torch.zeros_like(o[[1, 2]])), "padded rows must get zero outputs"
    got = out.transpose(-1, -2) if state_v_first else out
    assert_close("pool slots written", got[[5, 2]], s_ref, F32)
    untouched = [0, 1, 3, 4, 6]
    assert torch.equal(got[untouched], pool[untouched]), "padded rows and unused slots must stay untouched"


@needs_triton
def test_decode_speculative_matches_reference_backend():
    N, T, slots, HV, K, V = 2, 3, 8, 2, 16, 16
    x = kda_inputs(N, T, 1, HV, K, V, h0=False)
    del x["initial_state"]
    pool = torch.randn(slots, HV, K, V)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    nat = torch.tensor([2, 1])
    p1, p2 = pool.clone(), pool.clone()
    o1, _ = _decode(**x, initial_state=p1, state_indices=idx, num_accepted_tokens=nat, inplace=True,
                    backend="triton")
    o2, _ = _decode(**x, initial_state=p2, state_indices=idx, num_accepted_tokens=nat, inplace=True,
                    backend="reference")
    assert_close("o", o1, o2, F32)
    assert_close("pool", p1, p2, F32)
    # the reference backend's slots against the recurrence: sequence 0 starts from slot 2, its states go to 1, 2, 3
    _, _, states = naive_recurrent_kda(**{n: t[:1] for n, t in f64(x).items() if t is not None},
                                       initial_state=pool[2:3].double(), output_token_states=True)
    assert_close("slot states", p2[[1, 2, 3]], states[0], F32)


@needs_triton
@pytest.mark.parametrize("form", ["softplus", "lower_bound", "lower_bound_no_a"])
def test_decode_gate_in_kernel(form):
    B, T, HV, K, V = 2, 2, 2, 16, 16
    x = kda_inputs(B, T, 1, HV, K, V)
    x["g"] = torch.randn(B, T, HV, K) * 2                   # the raw gate input
    x["beta"] = torch.randn(B, T, HV)                       # a logit: sigmoid in the kernel
    A_log = None if form == "lower_bound_no_a" else torch.randn(HV)
    dt_bias = torch.randn(HV * K)
    lb = None if form == "softplus" else -5.0
    o, s = _decode(**x, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=lb,
                   use_beta_sigmoid_in_kernel=True, output_final_state=True, backend="triton")
    ref = f64(x)
    ref["g"] = kda_gate(ref["g"], None if A_log is None else A_log.double(), dt_bias.double(), lb)
    ref["beta"] = torch.sigmoid(ref["beta"])
    o_ref, s_ref = naive_recurrent_kda(**ref, output_final_state=True)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref, F32)


@needs_triton
@pytest.mark.parametrize("form", ["log", "softplus", "lower_bound", "lower_bound_no_a"])
def test_decode_persistent_walk(monkeypatch, form):
    """KDA's decode on the persistent kernel (the large-batch serving walk): a pool in place with a padded row,
    each gate form, against the fp64 recurrence; the public call at a batch the heuristic gives the walk (on a
    stand-in of 1 SM) launches it."""
    from linattn.ops.gated_delta_rule.triton import fused_recurrent as fr
    N, slots, HV, K, V = 16, 19, 2, 16, 16
    x = kda_inputs(N, 1, 1, HV, K, V, h0=False)
    del x["initial_state"]
    opts = {}
    ref = f64(x)
    if form != "log":
        x["g"] = torch.randn(N, 1, HV, K) * 2                        # the raw gate input
        A_log = None if form == "lower_bound_no_a" else torch.randn(HV)
        dt_bias = torch.randn(HV * K)
        lb = None if form == "softplus" else -5.0
        opts = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=lb)
        ref["g"] = kda_gate(x["g"].double(), None if A_log is None else A_log.double(), dt_bias.double(), lb)
    pool = torch.randn(slots, HV, K, V)
    idx = torch.randperm(slots)[:N]
    idx[3] = -1                                                      # a padded row
    launched = spy_grids(monkeypatch, fr, "fused_recurrent_gdn_fwd_persistent_kernel")
    monkeypatch.setattr(fr, "device_facts", lambda device=None: type("Facts", (), {"num_sms": 1})())
    monkeypatch.setattr(fr.host_path, "handle", False)               # through the JIT, so the spy sees the launch
    fr._CONFIGS.clear()
    assert fr.decode_persistent_config(N, HV, K, V, 1, False, torch.float32, 1) is not None
    stored = pool.clone()
    o, _ = _decode(**x, **opts, initial_state=stored, state_indices=idx, inplace=True, backend="triton")
    fr._CONFIGS.clear()
    assert len(launched) == 1, "the persistent kernel must have run"
    live = [n for n in range(N) if n != 3]
    o_ref, s_ref = naive_recurrent_kda(**{n: t[live] for n, t in ref.items() if t is not None},
                                       initial_state=pool[idx[live]].double(), output_final_state=True)
    assert_close("o (live rows)", o[live], o_ref, F32)
    assert torch.equal(o[3], torch.zeros_like(o[3])), "the padded row must get zero outputs"
    assert_close("pool slots written", stored[idx[live]], s_ref, F32)
    others = sorted(set(range(slots)) - set(idx[live].tolist()))
    assert torch.equal(stored[others], pool[others]), "unused slots must stay untouched"


@needs_triton
def test_gdn_decode_gk_matches_reference():
    """GDN's decode with FLA's gk: the scalar decay g and the per-key-channel gk both apply (and the fused
    scalar gate on g with a raw gk)."""
    import linattn
    x = kda_inputs(3, 2, 1, 2, 16, 16)
    gk, g = x.pop("g"), -torch.rand(3, 2, 2)
    o, s = linattn.fused_recurrent_gated_delta_rule(**x, g=g, gk=gk, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**f64(x), g=(g[..., None] + gk).double(), output_final_state=True)
    assert_close("o", o, o_ref, F32)
    assert_close("final_state", s, s_ref, F32)
    A_log, raw = torch.randn(2), torch.randn(3, 2, 2)
    o, s = linattn.fused_recurrent_gated_delta_rule(**x, g=raw, gk=gk, A_log=A_log, use_gate_in_kernel=True,
                                                    output_final_state=True)
    g_eff = -A_log.double().exp() * F.softplus(raw.double())
    o_ref, s_ref = naive_recurrent_kda(**f64(x), g=g_eff[..., None] + gk.double(), output_final_state=True)
    assert_close("o (fused gate)", o, o_ref, F32)
    assert_close("final_state (fused gate)", s, s_ref, F32)


def test_decode_bad_arguments_are_named():
    x = kda_inputs(2, 1, 1, 2, 16, 16)
    with pytest.raises(ValueError, match="g must be"):
        _decode(**dict(x, g=x["g"][..., 0]))
    with pytest.raises(ValueError, match="g must be finite and <= 0"):
        _decode(**dict(x, g=-x["g"] + 1.0))
    with pytest.raises(ValueError, match="A_log is used only with use_gate_in_kernel"):
        _decode(**x, A_log=torch.zeros(2))
    with pytest.raises(ValueError, match="needs A_log"):
        _decode(**x, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="dt_bias must be"):
        _decode(**x, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2))
    import linattn
    with pytest.raises(ValueError, match="gk must be"):
        linattn.fused_recurrent_gated_delta_rule(**dict(x, g=None), gk=x["g"][:, :, :1])
