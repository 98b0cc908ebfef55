"""Argument checks shared by the Gated DeltaNet ops: every bad input gets a clear ValueError, never a crash or
silent garbage.

Shapes, dtypes and devices are always checked. Values are checked only where that costs no host
synchronisation: for CPU tensors, the gates (`check_gate_values`: g finite and <= 0, beta not NaN) and cu_seqlens
(`check_cu_seqlens_values`). On a GPU the values are the caller's contract (documented on the ops), unless
LINATTN_CHECK_INPUTS=1 (read at import) asks for the gate checks there too, at one host synchronisation per call.
No value is read while torch.compile traces."""
import warnings
from typing import Optional

import torch

from linattn.runtime.settings import settings

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
QKV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# LINATTN_CHECK_INPUTS=1: check the gate values of GPU tensors too (a host synchronisation per call)
CHECK_GPU_VALUES = settings.check_inputs


def _fail(msg: str):
    raise ValueError(f"gated_delta_rule: {msg}")


def check_gdn_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None, *, op: str = "chunk_gated_delta_rule",
                     num_states: Optional[int] = None, gate_optional: bool = False,
                     mixed_qkv: bool = False, raw_gate: bool = False, state_v_first: bool = False) -> dict:
    """Validate the shared arguments and return the problem's sizes:
    dict(B, T, H, HV, K, V, N) where N is the number of sequences (states). mixed_qkv: q, k and v may differ in
    dtype (the decode op, as FLA's: each read and computed in fp32). raw_gate: g is a raw gate input (FLA's
    use_gate_in_kernel), any real value; state_v_first: initial_state is [N, HV, V, K]."""
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)) + (() if gate_optional and g is None else (("g", g),)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        _fail(f"{op}: q, k must be [B, T, H, K] and v [B, T, HV, V]; got ranks {q.dim()}, {k.dim()}, {v.dim()}")
    if q.shape != k.shape:
        _fail(f"{op}: q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        _fail(f"{op}: v must be [B, T, HV, V] with B={B}, T={T}; got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        _fail(f"{op}: the value heads HV={HV} must be a multiple of the query/key heads H={H}")
    for name, n in (("K", K), ("V", V)):
        if n < 1 or n > MAX_HEAD_DIM:
            _fail(f"{op}: head size {name}={n} is not supported (1..{MAX_HEAD_DIM})")
    gates = (("beta", beta),) if (gate_optional and g is None) else (("g", g), ("beta", beta))
    for name, t in gates:
        if tuple(t.shape) != (B, T, HV):
            _fail(f"{op}: {name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(t.shape)}")
        if t.dtype not in FLOATS:
            _fail(f"{op}: {name} must be a float tensor, got {t.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in QKV_DTYPES:
            _fail(f"{op}: {name} must be bf16, fp16 or fp32, got {t.dtype}")
    if not mixed_qkv and not (q.dtype == k.dtype == v.dtype):
        _fail(f"{op}: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    dev = q.device
    named = [("k", k), ("v", v), ("beta", beta), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)]
    if g is not None:
        named.append(("g", g))
    for name, t in named:
        if t is not None and t.device != dev:
            _fail(f"{op}: {name} is on {t.device} but q is on {dev}")
    if (dev.type == "cpu" or CHECK_GPU_VALUES) and not torch.compiler.is_compiling():
        check_gate_values(g, beta, op, log_decay=not (gate_optional or raw_gate))
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            _fail(f"{op}: cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            _fail(f"{op}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            _fail(f"{op}: with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
        N = cu_seqlens.numel() - 1
        # a host-side read of the values breaks torch.compile(fullgraph=True): skip it while tracing
        if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
            check_cu_seqlens_values(cu_seqlens, T, op)
    else:
        N = B
    if num_states is not None:
        N = num_states
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.dtype not in FLOATS:
            _fail(f"{op}: initial_state must be a float tensor")
        want, names = ((N, HV, V, K), "[N, HV, V, K] (state_v_first)") if state_v_first \
            else ((N, HV, K, V), "[N, HV, K, V]")
        if tuple(initial_state.shape) != want:
            _fail(f"{op}: initial_state must be {names} = {want}, got {tuple(initial_state.shape)}")
    return dict(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N)


def check_gate_values(g, beta, op: str = "chunk_gated_delta_rule", log_decay: bool = True):
    """Values check of the gates (reads them: a host sync on a GPU). g is a log decay: finite and <= 0 (a positive
    g grows the state without bound, -inf or NaN turns the chunk form's exp differences into NaN). With
    log_decay=False (the decode op, whose g may be a raw gate input for A_log) only NaN is refused. beta: no NaN."""
    if g is not None:
        bad = ~(g <= 0) | torch.isneginf(g) if log_decay else torch.isnan(g)
        if bool(bad.any()):
            n_nan, n_pos = int(torch.isnan(g).sum()), int((g > 0).sum())
            n_ninf = int(torch.isneginf(g).sum())
            what = ", ".join(f"{n} {w}" for n, w in ((n_nan, "NaN"), (n_pos, "> 0"), (n_ninf, "-inf")) if n)
            need = "finite and <= 0 (a log decay)" if log_decay else "free of NaN"
            _fail(f"{op}: g must be {need}; it has {what} of {g.numel()} values")
    if bool(torch.isnan(beta).any()):
        _fail(f"{op}: beta has {int(torch.isnan(beta).sum())} NaN of {beta.numel()} values")


def fla_state_v_first(op: str, state_v_first: bool, transpose_state_layout) -> bool:
    """FLA 0.6 still reads `transpose_state_layout`, the deprecated name of `state_v_first`, from its **kwargs: the
    same here (a DeprecationWarning, and both at once refused, as FLA does)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError(f"{op}: pass either state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("transpose_state_layout is deprecated (as in FLA): it is state_v_first", DeprecationWarning,
                  stacklevel=3)
    return bool(transpose_state_layout)


def _not_yet(op: str, name: str, kernels: str):
    raise NotImplementedError(f"{op}: {name} is not supported yet by linattn's {kernels} (only its default)")


def check_fla_options(op: str, *, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                      use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64):
    """FLA 0.6's options of the chunked op: FLA's own argument errors as FLA raises them (ValueError). chunk_size:
    FLA's 16, 32 or 64 (check_chunk_size). The gate and beta options and state_v_first run in the kernels; their
    tensors are checked by check_fla_gate_params once the head count is known. cp_context is the op's own path
    (api.py)."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{op}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA)")
    if use_gate_in_kernel and A_log is None:
        raise ValueError(f"{op}: use_gate_in_kernel=True needs A_log [HV] (as in FLA)")
    if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
        raise ValueError(f"{op}: A_log / dt_bias are used only with use_gate_in_kernel=True")
    check_chunk_size(op, chunk_size, (16, 32, 64))


def check_chunk_size(op: str, chunk_size, fla_values) -> None:
    """FLA's chunk sizes of the op are accepted and computed in linattn's 64-token chunks: the chunk length decides
    how the sums are split, not what they are, so the result is FLA's up to rounding. Any other value raises
    ValueError, with FLA's wording."""
    if isinstance(chunk_size, bool) or chunk_size not in fla_values:
        *head, last = (str(c) for c in fla_values)
        allowed = f"either {head[0]} or {last}" if len(head) == 1 else f"one of {', '.join(head)} or {last}"
        raise ValueError(f"{op}: `chunk_size` must be {allowed} (FLA's values; linattn runs every one in 64-token "
                         f"chunks), got {chunk_size!r}")


def check_fla_gate_params(op: str, A_log, dt_bias, HV: int, device):
    """A_log and dt_bias of FLA's use_gate_in_kernel: float tensors of HV elements (FLA reads them flat, as [HV])
    on the inputs' device."""
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            _fail(f"{op}: {name} must be a torch.Tensor of HV={HV} elements, got {type(t).__name__}")
        if t.numel() != HV:
            _fail(f"{op}: {name} must have HV={HV} elements ([HV]), got shape {tuple(t.shape)}")
        if t.dtype not in FLOATS:
            _fail(f"{op}: {name} must be a float tensor, got {t.dtype}")
        if t.device != device:
            _fail(f"{op}: {name} is on {t.device} but q is on {device}")


def check_fla_decode_options(op: str, *, g=None, gk=None, gv=None, beta=None, use_gate_in_kernel=False, A_log=None,
                             beta_sigmoid=False, allow_neg_eigval=False):
    """FLA 0.6's options of the decode op: FLA's argument errors as FLA raises them (ValueError); gk and gv need
    kernel work, so a tensor raises NotImplementedError naming the argument. beta_sigmoid:
    use_beta_sigmoid_in_kernel or linattn's beta_sigmoid. allow_neg_eigval and state_v_first run."""
    if isinstance(gk, torch.Tensor) and gk.dim() == 3 and beta is None:
        raise ValueError(f"{op}: gk must be [B, T, HV, K], got a 3-D tensor {tuple(gk.shape)}: a beta passed "
                         f"fifth? FLA's order (kept here) is q, k, v, g, gk, gv, beta, ...: pass beta=... by keyword")
    if use_gate_in_kernel and A_log is None:
        raise ValueError(f"{op}: use_gate_in_kernel=True needs A_log [HV] (as in FLA)")
    if use_gate_in_kernel and g is None:
        raise ValueError(f"{op}: use_gate_in_kernel=True needs g, the raw gate input (as in FLA)")
    if allow_neg_eigval and not beta_sigmoid:
        raise ValueError(f"{op}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in FLA)")
    if gv is not None:
        _not_yet(op, "gv", "decode kernels")


def check_channel_decay(name: str, t, dims: dict, q, *, op: str, log_decay: bool):
    """A per-key-channel decay [B, T, HV, K] (GDN's gk, KDA's g): a float tensor on q's device. Values (CPU tensors,
    or LINATTN_CHECK_INPUTS=1): a log decay finite and <= 0; a raw gate input (log_decay=False) free of NaN."""
    shape = (dims["B"], dims["T"], dims["HV"], dims["K"])
    if not isinstance(t, torch.Tensor):
        _fail(f"{op}: {name} must be a torch.Tensor [B, T, HV, K], got {type(t).__name__}")
    if tuple(t.shape) != shape:
        _fail(f"{op}: {name} must be [B, T, HV, K] = {shape} (one decay per key channel), got {tuple(t.shape)}")
    if t.dtype not in FLOATS:
        _fail(f"{op}: {name} must be a float tensor, got {t.dtype}")
    if t.device != q.device:
        _fail(f"{op}: {name} is on {t.device} but q is on {q.device}")
    check_channel_decay_values(name, t, op, log_decay)


def check_channel_decay_values(name: str, t: torch.Tensor, op: str, log_decay: bool):
    """check_channel_decay's value check: CPU tensors, or every tensor with LINATTN_CHECK_INPUTS=1 (it reads the
    values on the host, a sync on a GPU)."""
    if (t.device.type == "cpu" or CHECK_GPU_VALUES) and not torch.compiler.is_compiling():
        bad = ~(t <= 0) | torch.isneginf(t) if log_decay else torch.isnan(t)
        if bool(bad.any()):
            need = "finite and <= 0 (a log decay)" if log_decay else "free of NaN"
            _fail(f"{op}: {name} must be {need}; {int(bad.sum())} of {t.numel()} values are not")


# CUDA limits a launch grid's y and z dimensions to 65535 (x: 2^31 - 1). The Triton kernels of the chunked op number
# sequence x value head and the chunk slots on axis 0, so they have no such bound; the Gluon state passes (forward
# and backward) and fused forward kernels put sequence x value head on axis 1, so the gluon backend declines calls
# past GLUON_GRID_Y_MAX sequence-heads (gluon_grid_problem) and `auto` takes the Triton path for them.
GRID_YZ_MAX = 65535
GLUON_GRID_Y_MAX = GRID_YZ_MAX


def gluon_grid_problem(N: int, HV: int) -> str:
    """Why the Gluon kernels' grid cannot take N sequences x HV value heads ("" when it can): host arithmetic on
    shapes only, no sync."""
    if N * HV > GLUON_GRID_Y_MAX:
        return (f"{N} sequences x {HV} value heads = {N * HV} sequence-heads > {GLUON_GRID_Y_MAX}, the CUDA grid-y "
                f"limit of the Gluon state passes (the Triton path has no such bound)")
    return ""


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int, op: str = "chunk_gated_delta_rule"):
    """Values check: starts at 0, non-decreasing, ends at T. Reads the tensor (a host sync on a GPU)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        _fail(f"{op}: cu_seqlens must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        _fail(f"{op}: cu_seqlens must be sorted (non-decreasing), got {cu.tolist()[:16]}")
    if int(cu[-1]) != T:
        _fail(f"{op}: cu_seqlens must end at T={T} (the packed length), got {int(cu[-1])}")
