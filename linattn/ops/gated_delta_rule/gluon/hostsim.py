"""The host path of the GDN Gluon state pass on a CPU, up to the launch (linattn/runtime/hostsim.py: a stand-in
Triton driver that says "sm_90, 132 SMs", compiles for real and records each launch instead of making it).

    python -m linattn.ops.gated_delta_rule.gluon.hostsim [--calls 1000] [--forward] [--check] [--check-fused]

Default: per-call host microseconds of chunk_state_gluon at B=1 T=8192 and B=8 T=4096 (H=16, HV=32, K=V=128,
bf16, initial and final state) with the host cache off (the JIT launch with four TensorDescriptor.from_tensor per
call, as before the cache), plans only, and plans + compiled-handle launch (the default); --forward also times the
whole gluon forward at B=1 T=8192 (its Triton stages, allocations and chunk plan on CPU tensors: those parts cost
differently on a GPU host; only the difference between the modes carries over). --check prints
check_launch_paths() as JSON (tests/test_gluon_state_host.py runs it in a child process); --check-fused
check_fused_launch_paths() (the fused forward's launches, tests/test_gluon_fused_gf.py). Not included: the C
launcher and its cuTensorMapEncodeTiled per descriptor, the same in every mode.
"""
from __future__ import annotations

import torch

# name: (B, T, H, HV, lens, initial state, final state, dtype): fixed and varlen, with and without initial/final
# state, GVA and not, bf16 and fp16; small, so that each compiles in about a second
CHECK_CASES = {
    "fixed_gva_h0_ht": (2, 200, 16, 32, None, True, True, torch.bfloat16),
    "varlen_gva_ht": (1, 300, 16, 32, [1, 63, 65, 171], False, True, torch.bfloat16),
    "fixed_h0_fp16": (1, 130, 4, 4, None, True, False, torch.float16),
}
MODES = {"jit": dict(plan_cache=False, handle=False),          # descriptors built afresh, the JIT's launch
         "plan": dict(plan_cache=True, handle=False),
         "plan+handle": dict(plan_cache=True, handle=True)}     # the default
TIMING_SHAPES = ((1, 8192), (8, 4096))


def state_buffers(B, T, H, HV, lens=None, h0=True, ht=True, dtype=torch.bfloat16):
    """(plan, (k, w, u, gcum, h, vnew, initial_state, final)) as the forward hands them to the state pass."""
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    K = V = 128
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    plan = make_chunk_plan(B, T, cu, 64, "cpu")
    T_tot, slots, N = plan.T_total, plan.num_slots, plan.N
    e = torch.empty                 # never read: the launch is recorded, not made (and big buffers stay unmapped)
    bufs = (e(B, T, H, K, dtype=dtype), e(T_tot, HV, K, dtype=dtype), e(T_tot, HV, V, dtype=dtype), e(T_tot, HV),
            e(slots, HV, K, V, dtype=dtype), e(T_tot, HV, V, dtype=dtype), e(N, HV, K, V) if h0 else None,
            e(N, HV, K, V) if ht else None)
    return plan, bufs


def _launches(drv):
    from linattn.runtime.hostsim import normalise
    return [(k, g, [normalise(x) for x in args]) for k, g, args in drv.launches]


def _record_modes(drv, fn, post=lambda launches: launches, calls: int = 0) -> dict:
    """Per host-path mode (MODES): fn once to compile and fill the plan and the handle, then the launches the driver
    receives from one more call (through post), its JIT runs and, with calls, its per-call host us."""
    from linattn.ops.gated_delta_rule.gluon import host as L
    from linattn.runtime.hostsim import count_jit_runs, per_call_us
    rec = {}
    for mode, opts in MODES.items():
        with L.host_path.options(**opts):
            fn()
            del drv.launches[:]
            with count_jit_runs() as jit_runs:
                fn()
            rec[mode] = dict(launches=post(_launches(drv)), jit_runs=jit_runs[0])
            if calls:
                rec[mode]["us"] = per_call_us(fn, calls)
    return rec


def _pointers(launch, positions=(0, 1, 2, 4)):
    """The data pointers of the k, w, u and h arguments of a recorded launch (descriptor bases or tensors)."""
    args = launch[2]
    return [args[i][1][1] if args[i][0] == "desc" else args[i][1] for i in positions]


def check_launch_paths(calls: int = 200) -> dict:
    """Per case: the launch the stand-in driver receives (kernel, grid, every argument; descriptors by base
    pointer, shape, strides, block, layout, padding) is the same with the cache off, plans only and plans +
    handle; with the handle the JIT's run is skipped; a second call on new tensors of the same signature hits
    the plan and passes the new base pointers; a longer T misses it. Also per-call host us of each mode."""
    from linattn.ops.gated_delta_rule.gluon import launcher as L
    from linattn.runtime.hostsim import count_jit_runs, fake_hopper
    res = {}
    with fake_hopper() as drv:
        for name, (B, T, H, HV, lens, h0, ht, dtype) in CHECK_CASES.items():
            plan, bufs = state_buffers(B, T, H, HV, lens, h0, ht, dtype)

            def fn():
                L.chunk_state_gluon(*bufs, plan)
            rec = _record_modes(drv, fn, calls=calls)
            ref = rec["jit"]["launches"]
            # same signature, new tensors: a plan hit, the new base pointers in the descriptors
            n_plans = len(L._PLANS)
            plan2, bufs2 = state_buffers(B, T, H, HV, lens, h0, ht, dtype)
            del drv.launches[:]
            with count_jit_runs() as jit_runs:
                L.chunk_state_gluon(*bufs2, plan2)
            new = _launches(drv)
            want = [bufs2[i].data_ptr() for i in (0, 1, 2, 4)]
            hit = dict(plans_added=len(L._PLANS) - n_plans, jit_runs=jit_runs[0],
                       new_pointers=_pointers(new[0]) == want, first_pointers=_pointers(ref[0]) == want,
                       same_as_uncached=new == _uncached(L, drv, bufs2, plan2))
            # a changed shape: a new plan
            plan3, bufs3 = state_buffers(B, T + 64, H, HV, None if lens is None else lens[:-1] + [lens[-1] + 64],
                                         h0, ht, dtype)
            L.chunk_state_gluon(*bufs3, plan3)
            res[name] = dict(same=all(r["launches"] == ref for r in rec.values()), n_launches=len(ref),
                             kernels=[k for k, _, _ in ref], grid=list(ref[0][1]),
                             jit_runs={m: r["jit_runs"] for m, r in rec.items()},
                             us={m: round(r["us"], 1) for m, r in rec.items()},
                             hit=hit, miss_plans_added=len(L._PLANS) - n_plans - hit["plans_added"])
    return res


def _uncached(L, drv, bufs, plan):
    del drv.launches[:]
    with L.host_path.options(**MODES["jit"]):
        L.chunk_state_gluon(*bufs, plan)
    return _launches(drv)


def time_modes(calls: int, forward: bool = False) -> dict:
    """us per call of each mode at TIMING_SHAPES (best of 3 means), the state pass alone and optionally the
    whole gluon forward."""
    from linattn.ops.gated_delta_rule.gluon import launcher as L
    from linattn.runtime.hostsim import fake_hopper, per_call_us
    out = {}
    with fake_hopper() as drv:
        for B, T in TIMING_SHAPES:
            plan, bufs = state_buffers(B, T, 16, 32)
            fns = {"state": lambda: L.chunk_state_gluon(*bufs, plan)}
            if forward and B * T <= 8192:         # larger: the CPU's allocation of the forward's buffers dominates
                from linattn.testing import make_gdn_inputs
                x = make_gdn_inputs(B, T, 16, 32, 128, 128, dtype=torch.bfloat16, device="cpu")
                fns["forward"] = lambda: L.chunk_gated_delta_rule_fwd_gluon(
                    x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True, None)
            for what, fn in fns.items():
                for mode, opts in MODES.items():
                    with L.host_path.options(**opts):
                        n = calls if what == "state" else max(20, calls // 10)
                        us = min(per_call_us(fn, n) for _ in range(3))
                        del drv.launches[:]
                    out[f"B{B} T{T} {what} {mode}"] = round(us, 1)
    return out


# The fused forward's launches through host.launches: name -> (B, T, H, HV, what)
FUSED_CASES = {
    "gf_plain_h0_ht": (8, 300, 16, 32, "gf"),              # the gate-free kernel's plain launch (two state partitions)
    "gf_segments": (1, 4096, 16, 32, "gf_seg"),             # its segment launch (segment words, per-sequence selection)
    "wu_selection": (1, 300, 16, 32, "wu_sel"),             # the W/U kernel with a selection (the unsegmented pairs)
    "kkt_solve": (1, 300, 16, 32, "kkt"),                   # stage 2a (a Triton kernel)
    "segment_windows": (1, 4096, 16, 32, "win"),            # the segment window kernel (Triton)
}


def _fused_call(what, B, T, H, HV):
    """(fn, the caller's tensors: every pointer a launch passes that is not allocated inside the call) for one
    FUSED_CASES entry on fresh (never read) buffers."""
    from linattn.ops.gated_delta_rule.gluon.chunk_fused_gf import chunk_fused_gf_gluon
    from linattn.ops.gated_delta_rule.gluon.fused_forward import chunk_fused_wu_ws_gluon, kkt_solve
    from linattn.ops.gated_delta_rule.triton.chunk_indices import make_chunk_plan
    from linattn.ops.gated_delta_rule.triton.segment_start import segment_plan
    K = V = 128
    e = torch.empty
    plan = make_chunk_plan(B, T, None, 64, "cpu")
    T_tot, N = plan.T_total, plan.N
    if what in ("kkt", "win"):
        k, g, beta = e(B, T, H, K, dtype=torch.bfloat16), e(B, T, HV), e(B, T, HV)
        if what == "kkt":
            return (lambda: kkt_solve(k, g, beta, plan, HV)), (k, g, beta, plan.cu, plan.chunk_indices)
        from linattn.ops.gated_delta_rule.gluon.host import launches
        from linattn.ops.gated_delta_rule.triton.segment_start import segment_windows
        L = -(-T // 64) // 4
        return (lambda: segment_windows(k, beta, g, plan, 4, L, launch=launches)), (k, g, beta, plan.cu,
                                                                                    plan.chunk_offsets)
    bf = torch.bfloat16
    q, k, v = e(B, T, H, K, dtype=bf), e(B, T, H, K, dtype=bf), e(B, T, HV, V, dtype=bf)
    beta, gcum, tinv = e(B, T, HV), e(T_tot, HV), e(T_tot, HV, 64, dtype=bf)
    o, h0, ht = e(B, T, HV, V, dtype=bf), e(N, HV, K, V), e(N, HV, K, V)
    bufs = (q, k, v, beta, gcum, tinv, o, h0, ht)
    if what == "gf":
        return (lambda: chunk_fused_gf_gluon(*bufs, plan, 128 ** -0.5)), bufs + (plan.cu, plan.chunk_offsets)
    if what == "gf_seg":
        splan = segment_plan(B, T, 4, -(-T // 64) // 4, "cpu")
        sel, seg = torch.zeros(B, HV, dtype=torch.int32), torch.zeros(splan.N, HV, dtype=torch.int32)
        return ((lambda: chunk_fused_gf_gluon(*bufs, splan, 128 ** -0.5, select=sel, seg=seg)),
                bufs + (splan.cu, splan.chunk_offsets, sel, seg))
    sel = torch.zeros(N, HV, dtype=torch.int32)
    return (lambda: chunk_fused_wu_ws_gluon(*bufs, plan, 128 ** -0.5, select=sel)), bufs + (plan.cu,
                                                                                       plan.chunk_offsets, sel)


def _outside(launches, callers) -> list:
    """The recorded launches with the pointer of every tensor the call allocated itself (stage 2a's gcum and Tinv)
    replaced by "alloc": those differ from call to call whatever the host path."""
    mine = {t.data_ptr() for t in callers}

    def one(a):
        if isinstance(a, tuple) and a and a[0] == "tensor" and a[1] not in mine:
            return ("tensor", "alloc") + a[2:]
        return a
    return [(k, g, [one(a) for a in args]) for k, g, args in launches]


def _pointer_set(launches) -> set:
    """Every data pointer a recorded launch passes (tensors and descriptor bases)."""
    out = set()
    for _, _, args in launches:
        for a in args:
            if isinstance(a, tuple) and a and a[0] == "tensor" and a[1] != "alloc":
                out.add(a[1])
            elif isinstance(a, tuple) and a and a[0] == "desc":
                out.add(a[1][1])
    return out


def check_fused_launch_paths() -> dict:
    """Per FUSED_CASES entry: the launch the stand-in driver receives (kernel, grid, every argument) is the same with
    the host cache off, plans only (descriptor templates, the JIT's launch) and plans + handle (the default); with the
    handle the JIT's run is skipped; new tensors of the same signature hit the kept kernel (no JIT run, no launch plan
    added) and reach the launcher with their own pointers, the same launch as the uncached path's on them."""
    from linattn.ops.gated_delta_rule.gluon import host as L
    from linattn.ops.gated_delta_rule.gluon import host as fw
    from linattn.runtime.hostsim import count_jit_runs, fake_hopper
    res = {}
    with fake_hopper() as drv:
        for name, (B, T, H, HV, what) in FUSED_CASES.items():
            fn, callers = _fused_call(what, B, T, H, HV)
            rec = _record_modes(drv, fn, lambda launches: _outside(launches, callers))
            ref = rec["jit"]["launches"]
            n_plans, n_descs = len(L.launches), len(fw._DESC_TEMPLATES)
            fn2, fresh = _fused_call(what, B, T, H, HV)
            del drv.launches[:]
            with count_jit_runs() as jit_runs:
                fn2()
            new = _outside(_launches(drv), fresh)
            del drv.launches[:]
            with L.host_path.options(**MODES["jit"]):
                fn2()
            uncached = _outside(_launches(drv), fresh)
            res[name] = dict(same=all(r["launches"] == ref for r in rec.values()), n_launches=len(ref),
                             jit_runs={m: r["jit_runs"] for m, r in rec.items()},
                             hit=dict(plans_added=len(L.launches) - n_plans,
                                      templates_added=len(fw._DESC_TEMPLATES) - n_descs, jit_runs=jit_runs[0],
                                      new_pointers=_pointer_set(new) <= {t.data_ptr() for t in fresh}
                                      and len(_pointer_set(new)) > 0,
                                      same_as_uncached=new == uncached))
    return res


def main(argv=None) -> int:
    import argparse
    import json
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--forward", action="store_true", help="also time the whole gluon forward")
    ap.add_argument("--check", action="store_true", help="print check_launch_paths() as JSON and exit")
    ap.add_argument("--check-fused", action="store_true", help="print check_fused_launch_paths() as JSON and exit")
    args = ap.parse_args(argv)
    if args.check:
        print(json.dumps(check_launch_paths()))
        return 0
    if args.check_fused:
        print(json.dumps(check_fused_launch_paths()))
        return 0
    for key, us in time_modes(args.calls, args.forward).items():
        print(f"{key:34s} {us:8.1f} us/call (Python host path to the launcher)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
