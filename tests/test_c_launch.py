"""Launch lists through the C launch under Triton's CudaLauncher (runtime/c_launch.py, runtime/launch_list.py's "c"
steps), under the stand-in sm_90 driver with Triton's own CudaLauncher structure (hostsim.fake_hopper(c_launcher=
True): the C launch records its arguments, descriptors expanded by Triton's make_tensordesc_arg into a stand-in
tensor map that holds the base pointer and every field), in a child process without TRITON_INTERPRET:
- every step of the gluon forward's lists (segmented and not) is a C-launch step, and a replay passes the C launch
  what Triton's own launcher passes it on the same tensors (each pointer and each tensor map's base the same input or
  output at the same offset, or a buffer of the call in the same pattern; every other field equal), on fresh inputs
  and on repeated ones; a tensor map is encoded exactly where its base moved since the previous replay (on repeated
  inputs, fewer encodings than tensor maps);
- the buffers that are not outputs come from one workspace allocation per replay;
- c_launch_of declines what it does not know: the default stand-in launcher, a CudaLauncher subclass with its own
  __call__, a kernel that needs global scratch."""
from children import run_json_child   # tests/ is on sys.path
from test_fwd_launch_list import COMMON

CHILD = COMMON + r"""
from linattn.runtime import hostsim
from linattn.runtime.c_launch import c_launch_of

PREV = []                                          # the tensor maps' bases of the previous replay, in order

def replay_vs_host(drv, ins, final=True):
    f0 = hostsim._Utils.fills
    o, ht = L.fwd_eager(*ins[:5], 128 ** -0.5, ins[5], final)
    fills = hostsim._Utils.fills - f0
    bases = [a[0] for _, _, args in drv.launches for a in args if isinstance(a, TensorMap)]
    moved = sum(b != p for b, p in zip(bases, PREV)) if len(PREV) == len(bases) else None
    PREV[:] = bases
    a = canon(drv, ins, (o, ht))
    res = L.chunk_gated_delta_rule_fwd_gluon(*ins[:5], 128 ** -0.5, ins[5], final, None)
    b = canon(drv, ins, (res.o, res.final_state if final else None))
    maps = sum(x.startswith("('map'") for launch in a for x in launch[2])
    return dict(same=a == b, launches=[x[0] for x in a], fills=fills, maps=maps, moved=moved,
                diff=[(x, y) for x, y in zip(a, b) if x != y][:1])

out = {}
gfm.GF_SEG_MIN_EAGER_TOKENS = 0                    # the segment path for every call
with fake_hopper(c_launcher=True) as drv, torch.no_grad():
    for name, (B, T, h0, final) in {"segmented": (1, 4096, True, True), "unsegmented": (3, 200, True, True)}.items():
        L.EAGER_LISTS.clear()
        for _ in range(2):                             # compile, then record
            L.fwd_eager(*inputs(B, T, h0=h0)[:5], 128 ** -0.5, inputs(B, T, h0=h0)[5], final)
        del drv.launches[:]
        (lst,) = L.EAGER_LISTS.lists.values()
        x = inputs(B, T, h0=h0)
        replay_vs_host(drv, inputs(B, T, h0=h0))       # a first replay: the bases the next one compares with
        out[name] = dict(steps=sorted({s[0] for s in lst.steps}), carved=sum(o is not None for o in lst.layout),
                         ws_bytes=lst.ws_bytes, fresh=replay_vs_host(drv, x),
                         repeat=replay_vs_host(drv, x))
    # what c_launch_of declines
    (lst,) = L.EAGER_LISTS.lists.values()
    run = next(s[1] for s in lst.steps if s[0] == "c" and s[1].descs).c.__self__
    class OwnCall(type(run)):
        def __call__(self, *a):
            return super().__call__(*a)
    own = object.__new__(OwnCall)
    own.__dict__.update(run.__dict__)
    scratch = object.__new__(type(run))
    scratch.__dict__.update(run.__dict__, global_scratch_size=64)
    out["declined"] = [c_launch_of(x) is None for x in (own, scratch)]
    out["accepted"] = c_launch_of(run) is not None
    # the default stand-in's launcher (no CudaLauncher)
    out["plain_declined"] = c_launch_of(object.__new__(hostsim._Launcher)) is None
print(json.dumps(out))
"""


def test_c_launch_steps():
    r = run_json_child(CHILD)
    for name in ("segmented", "unsegmented"):
        case = r[name]
        assert case["steps"] == ["c"], (name, case)
        for kind in ("fresh", "repeat"):
            c = case[kind]
            assert c["same"], (name, kind, c["diff"])
            assert c["maps"] > 0, (name, kind, c)
            # a tensor map is encoded anew exactly where its base moved since the previous replay (a buffer, or an
            # input, may land where the previous call's was)
            assert c["moved"] is not None and c["fills"] == c["moved"], (name, kind, c)
        # the same inputs again: their maps are kept
        assert case["repeat"]["fills"] < case["repeat"]["maps"], (name, case)
    # the segmented call's buffers that are not outputs (gcum, tinv, the segment flags and words, the zeroed slow
    # flags) come from one workspace allocation
    assert r["segmented"]["carved"] == 5 and r["segmented"]["ws_bytes"] >= 4096 * 32 * (4 + 64 * 2), r["segmented"]
    assert r["segmented"]["fresh"]["launches"] == ["segment_window_kernel", "kkt_solve_kernel",
                                                   "chunk_fused_wu_ws_kernel", "chunk_fused_gf_kernel"], r
    assert r["declined"] == [True, True] and r["accepted"], r
    assert r["plain_declined"], r


def test_event_steps(monkeypatch):
    """A replay's event steps: for torch.cuda.Event itself the C base's record / wait (the Python layers only fill in
    a missing stream), for any other event class its own record and the stream's wait_event. A stand-in for
    torch.cuda.Event whose base's methods are C methods (list.append) shows which one a step calls."""
    import torch
    from linattn.runtime.launch_list import _event_fn

    class Base(list):
        record = list.append          # C methods: a step through them appends the stream to the event
        wait = list.append

    class Event(Base):
        def record(self, stream=None):
            raise AssertionError("the Python layer was called")

        def wait(self, stream=None):
            raise AssertionError("the Python layer was called")

    class Stream:
        def wait_event(self, event):
            event.waited_on = self

    class Own(Event):
        def record(self, stream=None):
            self.recorded_on = stream

    monkeypatch.setattr(torch.cuda, "Event", Event)
    e, s = Event(), Stream()
    _event_fn(e, "record")(e, s)
    _event_fn(e, "wait")(e, s)
    assert list(e) == [s, s]
    o = Own()
    _event_fn(o, "record")(o, s)
    _event_fn(o, "wait")(o, s)
    assert o.recorded_on is s and o.waited_on is s and list(o) == []
