"""The Gluon decode step (gluon/decode.py, issue 6) on a CPU host: every registered config compiles for sm_90a
with the TMA ring's instructions (UTMALDG, UTMASTG, SYNCS), spills nothing, keeps both K reductions inside a warp
(warp shuffles, no shared-memory reduction) and fits the CTAs per SM the launcher uses in shared memory and
registers; the launcher's arguments mangle to exactly the compiled signature; the backend "gluon" refuses CPU
calls with a reason while backend="auto" still runs Triton; and a torch model of the kernel's tile walk and ring
protocol (same schedule, same 2-D pool coordinates, same padded-row rule) matches the fp64 reference.
Works with TRITON_INTERPRET=1 set (compiles run in a child process, linattn.runtime.aot). The kernel itself has
not run here: benchmarks/gpu/gate.py (section decode, through backend="auto") gates it on an H200."""
import math

import pytest
import torch

from linattn.runtime.aot import inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

SMEM_PER_SM = 233472          # 228 KB of shared memory per SM on sm_90 (the 1 KB per CTA reserve counted below)
REGS_PER_SM = 65536
_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()
DECODE = sorted(n for n in REGISTRY if n.startswith("gdn_decode_gluon_"))
needs_gluon = pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)


def _per_sm(name):
    """CTAs per SM the launcher uses for this config (the defaults; 2 for the GVA + fused-gate build)."""
    import linattn.ops.gated_delta_rule.gluon.decode as d
    for dt, cfg in d.DEFAULT_CONFIGS.items():
        tag = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dt]
        if name == f"gdn_decode_gluon_{tag}_bv{cfg[0]}_w{cfg[1]}_s{cfg[2]}":
            return cfg[3]
    return 2


@needs_gluon
def test_registered_configs_match_module():
    from linattn.ops.gated_delta_rule.aot import DECODE_CONFIGS
    from linattn.ops.gated_delta_rule.gluon.decode import DEFAULT_CONFIGS
    names = {c[0] for c in DECODE_CONFIGS}
    for dt, (bv, w, s, _) in DEFAULT_CONFIGS.items():
        tag = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dt]
        assert f"{tag}_bv{bv}_w{w}_s{s}" in names, "the launcher's default config has no AOT registration"


@needs_gluon
@pytest.mark.parametrize("name", DECODE)
def test_compiles_with_tma_ring_no_spills(name):
    rep = inspect_kernel(REGISTRY[name])
    assert not rep.missing, f"{name}: intended instructions missing: {rep.missing}; got {rep.sass}"
    assert rep.spill_bytes == 0, f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers)"
    assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    stages = int(name.split("_s")[-1].split("_")[0])
    # a load per prologue stage and one refill site in the loop; one TMA store site; waits on the ring
    assert rep.families["UTMALDG"] == stages, rep.sass
    assert rep.families["UTMASTG"] == 1, rep.sass
    assert rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 1
    assert rep.sass.get("SYNCS.ARRIVE.TRANS64.A1T0", 0) >= 1          # the padded-row arrive
    per_sm = _per_sm(name)
    assert per_sm * (rep.smem + 1024) <= SMEM_PER_SM, f"{name}: {per_sm} x {rep.smem} B of shared memory"
    assert per_sm * rep.regs * 32 * rep.num_warps <= REGS_PER_SM, \
        f"{name}: {per_sm} CTAs x {rep.regs} registers x {32 * rep.num_warps} threads do not fit an SM"


@needs_gluon
def test_reductions_stay_in_warp():
    """Both K reductions and q.k by butterfly shuffles (3 per reduced value: 8 lanes along K), no shared-memory
    round trip: the only LDS/STS are the tile's read and write-back (bank-conflict free: static_assert in the
    kernel). Compiled in a child process without TRITON_INTERPRET, as inspect_kernel does."""
    import json
    import os
    import subprocess
    import sys
    code = ("import re,collections,json;from linattn.runtime.aot import compile_kernel,kernels;"
            "from triton.tools.disasm import get_sass;"
            "k=compile_kernel(kernels()['gdn_decode_gluon_fp32_bv64_w4_s3']);s=get_sass(k.asm['cubin']);"
            "c=collections.Counter(m[2] for m in re.finditer(r'^\\S+\\s+(@!?U?P\\w+\\s+)?([A-Z][\\w.]+)',s,re.M));"
            "print(json.dumps(dict(c)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    ops = json.loads(out.stdout.strip().splitlines()[-1])
    # fp32, BV = 64, 4 warps: 4 columns per thread -> kS and qS 4 values each, plus q.k: 9 x 3 shuffles
    assert ops.get("SHFL.BFLY", 0) == 27, ops
    # 64 fp32 per thread = 16 x 16-byte reads and 16 x 16-byte writes, nothing else through shared memory
    lds = {o: n for o, n in ops.items() if o.startswith("LDS")}
    sts = {o: n for o, n in ops.items() if o.startswith("STS")}
    assert lds == {"LDS.128": 16} and sts == {"STS.128": 16}, (lds, sts)


@needs_gluon
@pytest.mark.parametrize("state,A_log", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_launch_matches_aot_signature(state, A_log):
    from triton.runtime.jit import mangle_type

    from linattn.ops.gated_delta_rule.gluon.decode import DEFAULT_CONFIGS, aot_build, decode_launch
    from linattn.testing import make_gdn_inputs
    H = 16 if A_log else 32
    x = make_gdn_inputs(4, 1, H, 32, 128, 128, dtype=torch.bfloat16, device="cpu", initial_state=False)
    pool = torch.zeros(10, 32, 128, 128, dtype=state)
    idx = torch.tensor([3, -1, 0, 9], dtype=torch.int32)
    extra = dict(A_log=torch.zeros(32), dt_bias=torch.zeros(32), beta_sigmoid=True) if A_log else {}
    kernel, grid, args, kw, out, n_tiles = decode_launch(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.1, pool, idx,
                                                         num_sms=132, **extra)
    BV, w, s, per_sm = DEFAULT_CONFIGS[state]
    _, sig, const, opt = aot_build({torch.float32: "fp32", torch.bfloat16: "bf16"}[state], BV, w, s, H, A_log)
    runtime = [n for n, t in sig.items() if t != "constexpr" or const.get(n, 0) is None]
    assert len(args) == len(runtime)
    for name, arg in zip(runtime, args):
        assert mangle_type(arg) == sig[name], f"{name}: launcher passes {mangle_type(arg)}, AOT compiled {sig[name]}"
    for n in ("H", "HV", "K", "V", "BV", "STAGES", "FUSED_GATE", "INDEXED", "PAD_SLOT"):
        assert kw[n] == const[n], n
    assert kw["num_warps"] == opt["num_warps"]
    assert n_tiles == 4 * 32 * (128 // BV) and grid == (min(n_tiles, per_sm * 132),)


def test_gluon_backend_refuses_cpu_and_auto_runs_triton(device, monkeypatch):
    from linattn.backends import BackendError, op_backends
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule as decode
    from linattn.testing import make_gdn_inputs
    if device != "cpu":
        pytest.skip("CPU behaviour")
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    table = op_backends("fused_recurrent_gated_delta_rule")
    assert "gluon" in table.names() and table.backends["gluon"].auto_filter is not None
    x = make_gdn_inputs(2, 1, 2, 4, 128, 128, dtype=torch.float32, device="cpu", initial_state=False)
    del x["initial_state"]
    pool = torch.randn(5, 4, 128, 128)
    call = dict(x, initial_state=pool, state_indices=torch.tensor([3, -1]), inplace=True)
    ok, reason = table.backends["gluon"].supports(**call)
    assert not ok and reason
    with pytest.raises(BackendError, match="gluon"):
        decode(**call, backend="gluon")
    assert table.select("auto", **call).name == "triton"
    rows = {name: (ok, why) for name, ok, why in table.explain(**call)}
    assert rows["gluon"][0] is False and rows["gluon"][1]


def test_auto_hands_gluon_only_what_it_was_measured_faster_on(monkeypatch):
    """With the Gluon decode's supports() pretending a Hopper GPU (none here), `auto` picks it for a bf16 pool at
    batch >= 32 and keeps fp32 pools and small batches on Triton, with the reason; by name it takes them all."""
    import dataclasses

    from linattn.backends import op_backends
    from linattn.ops.gated_delta_rule.fused_recurrent import GLUON_AUTO_MIN_BATCH
    from linattn.testing import make_gdn_inputs
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    table = op_backends("fused_recurrent_gated_delta_rule")
    real = table.backends["gluon"]
    monkeypatch.setitem(table.backends, "gluon", dataclasses.replace(real, supports=lambda **_: (True, "")))
    picked = {}
    for B in (GLUON_AUTO_MIN_BATCH - 1, GLUON_AUTO_MIN_BATCH):
        for sd in (torch.float32, torch.bfloat16):
            x = make_gdn_inputs(B, 1, 2, 4, 128, 128, dtype=torch.bfloat16, device="cpu", initial_state=False)
            del x["initial_state"]
            call = dict(x, initial_state=torch.randn(B + 2, 4, 128, 128).to(sd), inplace=True,
                        state_indices=torch.arange(B, dtype=torch.int32))
            picked[(B, sd)] = table.select("auto", **call).name
            assert table.select("gluon", **call).name == "gluon"
            why = {n: r for n, ok, r in table.explain(**call)}["gluon"]
            assert (why == "") == (picked[(B, sd)] == "gluon")
    assert picked == {(GLUON_AUTO_MIN_BATCH - 1, torch.float32): "triton",
                      (GLUON_AUTO_MIN_BATCH - 1, torch.bfloat16): "triton",
                      (GLUON_AUTO_MIN_BATCH, torch.float32): "triton",
                      (GLUON_AUTO_MIN_BATCH, torch.bfloat16): "gluon"}


@needs_gluon
def test_supports_reasons_on_a_pretend_gpu(monkeypatch):
    """The refusals past the device check, with the device checks patched to pass (no GPU here)."""
    import linattn.ops.gated_delta_rule.gluon.decode as d
    from linattn.runtime import device as dev_mod
    from linattn.runtime.settings import settings

    class Facts:
        capability, name, arch, num_sms = (9, 0), "H200", "sm_90", 132

    class Meta:                         # a "cuda" tensor stand-in: only the attributes supports() reads
        def __init__(self, t, ptr=0):
            self._t, self._ptr = t, ptr
            self.device = torch.device("cuda")

        def __getattr__(self, n):
            return getattr(self._t, n)

        def data_ptr(self):
            return self._ptr

    monkeypatch.setattr(type(settings), "interpret", property(lambda self: False), raising=False)
    monkeypatch.setattr(dev_mod, "device_facts", lambda device: Facts())
    q = Meta(torch.zeros(2, 1, 4, 128))
    v = Meta(torch.zeros(2, 1, 4, 128))
    pool = Meta(torch.zeros(3, 4, 128, 128), ptr=256)
    base = dict(q=q, k=q, v=v, g=None, beta=torch.zeros(2, 1, 4), initial_state=pool, inplace=True,
                state_indices=torch.zeros(2, dtype=torch.int32))
    assert d.supports(**base) == (True, "")
    assert d.supports(**base, pad_slot_id=0) == (True, "")          # vLLM's padding slot: a constexpr of the kernel
    cases = [
        (dict(q=Meta(torch.zeros(2, 2, 4, 128))), "T=2"),
        (dict(cu_seqlens=torch.tensor([0, 1, 2])), "cu_seqlens"),
        (dict(q=Meta(torch.zeros(2, 1, 4, 64))), "K=64"),
        (dict(use_qk_l2norm_in_kernel=True), "l2norm"),
        (dict(inplace=False), "in place"),
        (dict(state_indices=torch.zeros(2, 2, dtype=torch.int32)), "2-D state_indices"),
        (dict(state_indices=torch.zeros(2, 2, dtype=torch.int32), num_accepted_tokens=torch.ones(2, dtype=torch.int32)),
         "state_indices"),
        (dict(state_v_first=True), "state_v_first"),
        (dict(allow_neg_eigval=True), "allow_neg_eigval"),
        (dict(k=Meta(torch.zeros(2, 1, 4, 128, dtype=torch.bfloat16))), "different dtypes"),
        (dict(initial_state=Meta(torch.zeros(3, 4, 128, 128, dtype=torch.float16), ptr=256)), "fp32 or bf16"),
        (dict(initial_state=Meta(torch.zeros(3, 4, 128, 128), ptr=8)), "16-byte"),
    ]
    for change, words in cases:
        ok, reason = d.supports(**{**base, **change})
        assert not ok and words in reason, (change, reason)


# ------------------------------------------------------------------------------ torch model of the schedule
def _model_decode(q, k, v, g, beta, scale, pool, idx, BV, stages, grid, A_log=None, dt_bias=None,
                  beta_sigmoid=False, pad_slot=-1):
    """The kernel's algorithm in torch (fp64 math): each CTA walks local tiles j (global t = pid + j * grid),
    with the ring protocol as bookkeeping: a slot's barrier completes exactly one phase per issued tile (TMA
    load for a live row, plain arrive for a padded one), every wait must find exactly its phase complete, a
    slot is refilled only after the tile in it was consumed and its store waited, and nothing is left in flight
    at the end. The state moves through the same 2-D view and coordinates as the TMA descriptor."""
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NV = V // BV
    n_tiles = B * HV * NV
    S = pool.shape[0]
    flat = pool.view(S * HV * K, V)
    o = torch.full(v.shape, float("nan"), dtype=torch.float64)
    visited = []
    for pid in range(grid):
        n_my = max(0, math.ceil((n_tiles - pid) / grid))
        phases = [0] * stages              # completed phases per slot
        holder = [None] * stages           # local tile held by each slot (issued, not yet refilled)
        consumed = set()

        def slot_of(t):
            s_ = int(idx[t // (HV * NV)])
            return s_, 0 <= s_ < S and s_ != pad_slot

        def issue(j):
            if j >= n_my:
                return
            s_ = j % stages
            assert holder[s_] is None or holder[s_] in consumed, "slot refilled before its tile was consumed"
            holder[s_] = j
            phases[s_] += 1                # TMA complete_tx or the padded-row arrive: one phase either way

        far = stages - 1
        for j in range(far):
            issue(j)
        for i in range(n_my):
            s_ = i % stages
            assert phases[s_] == i // stages + 1, "wait would not find exactly its phase"
            assert holder[s_] == i
            t = pid + i * grid
            visited.append(t)
            n, hv, vb = t // (HV * NV), (t // NV) % HV, t % NV
            h = hv // (HV // H)
            slot, live = slot_of(t)
            rows = slice((slot * HV + hv) * K, (slot * HV + hv + 1) * K)
            cols = slice(vb * BV, (vb + 1) * BV)
            Sb = flat[rows, cols].double() if live else torch.zeros(K, BV, dtype=torch.float64)
            bq = q[n, 0, h].double() * scale
            bk = k[n, 0, h].double()
            bb = beta[n, 0, hv].double()
            if beta_sigmoid:
                bb = torch.sigmoid(bb)
            if g is not None:
                bg = g[n, 0, hv].double()
                if A_log is not None:
                    bg = -torch.exp(A_log[hv].double()) * torch.nn.functional.softplus(
                        bg + (0 if dt_bias is None else dt_bias[hv].double()))
                Sb = Sb * torch.exp(bg)
            kS, qS = Sb.T @ bk, Sb.T @ bq
            u = bb * (v[n, 0, hv, cols].double() - kS)
            o[n, 0, hv, cols] = (qS + (bq @ bk) * u) if live else 0.0
            if live:
                flat[rows, cols] = (Sb + torch.outer(bk, u)).to(pool.dtype)
            consumed.add(i)                # stored (or nothing to store) and store-waited before the refill
            issue(i + far)
        assert all(p == (n_my - s_ + stages - 1) // stages for s_, p in enumerate(phases)), "load left in flight"
    assert sorted(visited) == list(range(n_tiles))
    return o.to(v.dtype)


@pytest.mark.parametrize("B,H,state,BV,stages,grid,fused,pad_slot", [
    (5, 4, torch.float32, 64, 3, 7, False, -1),
    (3, 2, torch.bfloat16, 64, 2, 4, True, -1),
    (4, 4, torch.float32, 32, 3, 64, False, -1),  # more CTAs than tiles for some: n_my 0 or 1
    (5, 4, torch.bfloat16, 64, 3, 7, False, 0),   # vLLM's padding slot 0 (pad_slot_id=0)
])
def test_torch_model_of_schedule_matches_reference(B, H, state, BV, stages, grid, fused, pad_slot):
    from linattn.ops.gated_delta_rule.fused_recurrent import fused_recurrent_reference
    from linattn.testing import make_gdn_inputs, rel_rms
    HV = 4
    x = make_gdn_inputs(B, 1, H, HV, 128, 128, dtype=torch.float32, device="cpu", initial_state=False)
    del x["initial_state"]
    extra = {}
    if fused:
        extra = dict(A_log=torch.rand(HV) - 0.5, dt_bias=torch.randn(HV), beta_sigmoid=True)
        x["g"] = torch.randn_like(x["g"])
    slots = 2 * B + 3
    pool = (torch.randn(slots, HV, 128, 128) * 0.5).to(state)
    idx = torch.randperm(slots - 1)[:B] + 1
    idx[1] = -1
    if B > 3:
        idx[3] = slots + 5                           # out of range: padded, nothing read or written
    if pad_slot == 0:
        idx[2] = 0                                   # the padding slot: padded, slot 0 neither read nor written
        pool[0] = float("nan")
    before = pool.clone()
    ref_pool = pool.double()
    x64 = {n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    e64 = {n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in extra.items()}
    ref_idx = idx.clone()
    ref_idx[ref_idx >= slots] = -1                    # the reference raises on out-of-range CPU indices
    ro, _ = fused_recurrent_reference(**x64, **e64, initial_state=ref_pool, state_indices=ref_idx, inplace=True,
                                      pad_slot_id=pad_slot)
    got = _model_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, pool, idx, BV, stages, grid,
                        **extra, pad_slot=pad_slot)
    is_pad = (idx < 0) | (idx >= slots) | (idx == pad_slot)
    live = idx[~is_pad]
    unused = torch.ones(slots, dtype=torch.bool)
    unused[live] = False
    assert rel_rms(got, ro) < 1e-6
    assert rel_rms(pool[live], ref_pool[live]) < (1e-6 if state == torch.float32 else 4e-3)
    assert torch.equal(pool[unused].view(torch.int16 if state == torch.bfloat16 else torch.int32),
                       before[unused].view(torch.int16 if state == torch.bfloat16 else torch.int32))
    pad = is_pad.nonzero().flatten()
    assert bool((got[pad] == 0).all())
