"""Per-signature launch lists: one call of a multi-launch host path recorded (its buffer allocations, its kernel
launches through the host path's direct `run`, its event steps between streams) and replayed by later calls of the
same signature with their own tensors.

Why: an eager call of a host path that launches several kernels pays, per call, for the Python that builds each
launch (chunk plans, configs, TensorDescriptors, launch keys, argument tuples), ~100 us on this project's CPU for the
segmented Gluon forward against ~10 us for its four `run` calls. What a launch takes depends on the call's
signature (shapes, strides, dtypes, options) except for the data pointers; a replay allocates the same buffers and
makes the same launches with each pointer moved to the new tensor at the same offset.

Recording (`recording()`): while a Recorder is active on this thread, runtime/alloc.py reports each buffer it
allocates, runtime/host_path.py each direct launch (and fails the record for a launch through the JIT or the
compiled kernel's own launcher), and `record_event` / `wait_event` the stream steps. `LaunchList.build` then
attributes every pointer argument (a tensor or a TensorDescriptor's base) to exactly one source: an input of the
call or a recorded buffer (by address range: the base lies inside one source's extent), or a tensor the caller
declared long-lived (`keep`: cached chunk plans). A pointer it cannot attribute (a copy made on the way, a
temporary), an address inside two sources, or an output that is neither a buffer nor an input: no list (None), and
the caller keeps its host path. So a call whose host path copied an input never gets a list. A torch op that
launches device work other than the recorded allocations has no place in a recorded path (its work would not be
replayed): the paths that record are written without them. Nor has a Triton launch made outside the host path
(`kernel[grid](...)` directly): a recording does not see it, so a replay would skip it. The tests of each list
compare its replay's launches with its host path's under the stand-in driver (runtime/hostsim.py), which catches both.

A replay allocates the outputs as the call did and carves the other buffers from one workspace allocation (only
their pointers are passed on), the zero-filled ones from its start, zeroed in one step. Where the compiled kernel's
launcher is Triton's CudaLauncher (runtime/c_launch.py), a launch step calls the C launch under it directly, with
each descriptor's expanded arguments (its encoded tensor map, shape and strides) kept from the previous replay while
its base pointer is the same: a repeat call of a signature encodes only the descriptors whose buffers moved. Other
launchers: `run`.
Event steps of torch.cuda.Event call its C base's record / wait directly (_event_fn). The replay itself is one
straight-line function generated from the steps when the list is built (LaunchList._compile; LaunchList.source shows
it): no per-step loops or argument-list copies per call.

Replay (`LaunchList.__call__`) returns None, and the caller takes its host path, where the launch would not be the
recorded one: another current device, a Triton launch hook registered (a profiler sees every launch), the host
path's plan cache or handle off, an input pointer not 16-byte aligned (the recorded kernels are specialised on it).
Poisoned allocations (runtime/alloc.py) are honoured per call.
"""
from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, List, Optional, Sequence

import torch

_local = threading.local()
WORKSPACE_ALIGN = 512        # bytes between a replay's workspace buffers (the caching allocator's block alignment)


def active():
    """The Recorder recording on this thread, or None."""
    return getattr(_local, "rec", None)


class Recorder:
    """What one recorded call did: buffers (tensor, zero-filled), steps in host order, long-lived tensors, and the
    first reason the record cannot become a list (None while it can)."""
    __slots__ = ("allocs", "steps", "kept", "broken", "current")

    def __init__(self, current_stream=None):
        self.allocs: List[tuple] = []
        self.steps: List[tuple] = []
        self.kept: List[torch.Tensor] = []
        self.broken: Optional[str] = None
        self.current = current_stream     # the torch stream that was current (None: a call without streams)

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why


@contextlib.contextmanager
def recording(current_stream=None):
    """Within: this thread's host path reports to a new Recorder (yielded)."""
    rec, prev = Recorder(current_stream), active()
    _local.rec = rec
    try:
        yield rec
    finally:
        _local.rec = prev


def note_alloc(t: torch.Tensor, zero: bool = False) -> None:
    rec = active()
    if rec is not None:
        rec.allocs.append((t, zero))


def note_launch(raw, grid, stream, args) -> None:
    """A direct launch: raw = (run, function, packed metadata, stream query), grid a 3-tuple, stream a torch stream
    or None (the current one), args every kernel argument in order (constexprs included)."""
    rec = active()
    if rec is not None:
        rec.steps.append(("launch", raw, tuple(grid), stream, tuple(args)))


def note_other_launch(why: str) -> None:
    rec = active()
    if rec is not None:
        rec.fail(why)


def keep(*objs) -> None:
    """Declare long-lived tensors (or objects whose tensor attributes are, such as a cached ChunkPlan) that launches
    of the recorded call may read: a list keeps them and passes their pointers unchanged."""
    rec = active()
    if rec is None:
        return
    for o in objs:
        if isinstance(o, torch.Tensor):
            rec.kept.append(o)
        elif o is not None:
            names = getattr(o, "__dataclass_fields__", None) or getattr(o, "__dict__", {})
            rec.kept.extend(t for t in (getattr(o, n, None) for n in names) if isinstance(t, torch.Tensor))


def record_event(event, stream) -> None:
    """event.record(stream), recorded."""
    event.record(stream)
    rec = active()
    if rec is not None:
        rec.steps.append(("record", event, stream))


def wait_event(stream, event) -> None:
    """stream.wait_event(event), recorded."""
    stream.wait_event(event)
    rec = active()
    if rec is not None:
        rec.steps.append(("wait", event, stream))


class _Ptr(int):
    """A device address standing in for a TensorDescriptor's base: the C launcher takes it as the pointer, Triton's
    descriptor wrapper asks its data_ptr()."""
    __slots__ = ()

    def data_ptr(self) -> int:
        return int(self)


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _whole_view(o: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether o is a contiguous view of all of the contiguous buffer buf (a launcher's `y.view(x.shape)`): a replay
    then returns its own buffer viewed as o's shape."""
    return (o.data_ptr() == buf.data_ptr() and o.dtype == buf.dtype and o.numel() == buf.numel()
            and o.is_contiguous() and buf.is_contiguous() and o.device == buf.device)


def _contiguous_strides(shape) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def _is_desc(a) -> bool:
    return hasattr(a, "block_shape") and hasattr(a, "base") and hasattr(a, "layout")


class LaunchList:
    """A recorded call, replayable on the tensors of a later call of the same signature (see the module doc)."""
    __slots__ = ("device", "get_device", "allocs", "steps", "outputs", "kept", "hp", "hooks_active", "current_query",
                 "stream_handle", "stream", "poisoning", "layout", "ws_bytes", "ws_zero_bytes", "ws_device",
                 "current_events", "replay", "source")

    @classmethod
    def build(cls, rec: Recorder, inputs: Sequence[Optional[torch.Tensor]], outputs: Sequence[Any], device,
              host_path, get_device, hooks_active, poisoning) -> Optional["LaunchList"]:
        """The list of rec's call, whose tensors were `inputs` (None where absent) and which returned `outputs`
        (tensors, each an input, a recorded buffer or a contiguous view of the whole of one; or None); None where the record cannot be replayed (the module doc says when). get_device,
        hooks_active and poisoning (runtime/alloc.py's) are asked per replay."""
        if rec.broken is not None or not any(s[0] == "launch" for s in rec.steps):
            return None
        srcs = list(inputs) + [t for t, _ in rec.allocs]
        ranges = [(i, t.data_ptr(), t.data_ptr() + _extent(t)) for i, t in enumerate(srcs)
                  if t is not None and _extent(t) > 0]
        kept = {t.data_ptr(): t for t in rec.kept}

        def place(t: torch.Tensor):
            """('src', index, offset) or ('kept', pointer) of a tensor argument (or a descriptor's base), else None."""
            p, n = t.data_ptr(), _extent(t)
            hits = [(i, p - lo) for i, lo, hi in ranges if lo <= p and p + n <= hi]
            if len(hits) == 1:
                return ("src",) + hits[0]
            if not hits and p in kept and n <= _extent(kept[p]):
                return ("kept", p)
            return None

        self = cls()
        self.steps = []
        current = rec.current
        for step in rec.steps:
            if step[0] != "launch":
                _, event, stream = step
                self.steps.append((step[0], event, None if current is not None and stream == current else stream,
                                   _event_fn(event, step[0])))
                continue
            _, raw, grid, stream, args = step
            template, ptrs, descs = list(args), [], []
            for pos, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    where = place(a)
                    if where is None:
                        return None
                    if where[0] == "kept":
                        template[pos] = where[1]
                    else:                       # patched per replay; the list keeps no tensor of this call
                        template[pos] = None
                        ptrs.append((pos, where[1], where[2]))
                elif _is_desc(a):
                    where = place(a.base)
                    if where is None:
                        return None
                    shell = object.__new__(type(a))
                    shell.__dict__.update(a.__dict__)
                    if where[0] == "kept":
                        shell.base = _Ptr(where[1])
                        template[pos] = shell
                    else:
                        shell.base = template[pos] = None
                        descs.append((pos, shell, where[1], where[2]))
                elif a is not None and type(a) not in (int, float, bool, str):
                    return None
            run, function, packed, _ = raw
            step_stream = None if stream is current else stream
            step = _c_step(run, function, packed, grid, step_stream, args, template, ptrs, descs)
            self.steps.append(step or ("launch", run, function, packed, grid, step_stream, template, tuple(ptrs),
                                       tuple(descs)))
        outs = []
        for o in outputs:
            if o is None:
                outs.append(None)
                continue
            idx = next((i for i, t in enumerate(srcs) if t is o), None)
            if idx is not None:
                outs.append((idx, None))
                continue
            idx = next((i for i, t in enumerate(rec.allocs) if _whole_view(o, t[0])), None)
            if idx is None:
                return None
            outs.append((len(srcs) - len(rec.allocs) + idx, tuple(o.shape)))
        self.outputs = tuple(outs)
        self.allocs = tuple((tuple(t.shape), t.stride(), t.dtype, t.device, zero, t.is_floating_point())
                            for t, zero in rec.allocs)
        if any(a[1] != _contiguous_strides(a[0]) for a in self.allocs):
            return None                     # only contiguous buffers (what torch.empty gives) are re-made
        # buffers that are not outputs: carved from one workspace allocation per replay (only their pointers are
        # needed), WORKSPACE_ALIGN bytes apart, the zero-filled ones first (one zeroing of that region per replay)
        outs_at = {o[0] - len(inputs) for o in outs if o is not None and o[0] >= len(inputs)}
        ws_device = next((a[3] for j, a in enumerate(self.allocs) if j not in outs_at), None)
        layout, size = [None] * len(self.allocs), 0
        for zeroed in (True, False):
            for j, (shape, _, dtype, dev, zero, _) in enumerate(self.allocs):
                if zero != zeroed or j in outs_at or dev != ws_device:
                    continue
                layout[j] = size
                n = dtype.itemsize
                for d in shape:
                    n *= d
                size += -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
            if zeroed:
                self.ws_zero_bytes = size
        self.layout, self.ws_bytes, self.ws_device = tuple(layout), size, ws_device
        self.kept = tuple(rec.kept)
        self.device = device
        self.get_device = get_device
        self.hp = host_path
        self.hooks_active = hooks_active
        self.poisoning = poisoning
        self.stream = None                  # the current stream as a torch object, made at the first event step
        self.current_query = next(s[1][3] for s in rec.steps if s[0] == "launch")
        # the stream the call ran on: a replay on another stream takes the host path (the kept plans' tensors were
        # made on this one, runtime's chunk-plan cache keys plans by stream for the same reason)
        self.stream_handle = self.current_query(device)
        self.current_events = any(s[0] not in ("launch", "c") and s[2] is None for s in self.steps)
        self._compile(len(inputs))
        return self

    def __call__(self, *inputs) -> Optional[tuple]:
        """The recorded call on these inputs (same order and signature as the recorded ones): its outputs, or None
        (nothing launched) where the replay would not make the recorded launches."""
        dev = self.get_device()
        if dev != self.device or self.hooks_active() or not (self.hp.plan_cache and self.hp.handle):
            return None
        handle = self.current_query(dev)
        if handle != self.stream_handle:
            return None
        cur = None
        if self.current_events:
            if self.stream is None:              # kept: torch.cuda.current_stream costs more than the launches
                self.stream = torch.cuda.ExternalStream(handle, device=self.device)
            cur = self.stream
        return self.replay(handle, self.poisoning(), cur, *inputs)

    def _compile(self, n_inputs: int) -> None:
        """self.replay(handle, nan, current stream, *inputs): the replay as straight-line Python made from the steps
        (self.source holds it): the input pointers and their alignment check (None where one is not 16-byte
        aligned), the buffers, each launch with its arguments written out (constants, pointer sums, descriptor
        expansions), each event step, the outputs. What it reads besides its arguments it takes by name from its
        namespace: the C launches, functions, packed metadata, descriptor slots, events, streams."""
        ns = {"empty": torch.empty, "zeros": torch.zeros, "u8": torch.uint8, "Ptr": _Ptr, "refresh": _refresh}
        names = {}

        def name(obj) -> str:
            """A namespace name for obj (one per object)."""
            key = id(obj)
            if key not in names:
                names[key] = f"o{len(names)}"
                ns[names[key]] = obj
            return names[key]

        def literal(v) -> str:
            if v is None or type(v) in (bool, int) or (type(v) is float and v == v and abs(v) != float("inf")):
                return repr(v)
            return name(v)

        def ptr(i: int, off: int) -> str:
            return f"p{i}" if not off else f"(p{i} + {off})"

        ins = [f"t{i}" for i in range(n_inputs)]
        body = [f"def replay(handle, nan, cur{''.join(', ' + t for t in ins)}):"]
        add = body.append
        for i, t in enumerate(ins):
            add(f"    p{i} = 0 if {t} is None else {t}.data_ptr()")
        if ins:
            add(f"    if ({' | '.join(f'p{i}' for i in range(n_inputs))}) & 15:")
            add("        return None")
        if self.ws_bytes:
            add(f"    ws = empty({self.ws_bytes}, dtype=u8, device={name(self.ws_device)})")
            add("    if nan:")
            add("        ws.fill_(255)                    # all ones: a NaN in every float type")
            if self.ws_zero_bytes:
                add(f"    ws.narrow(0, 0, {self.ws_zero_bytes}).zero_()    # the zero-filled buffers")
            add("    w = ws.data_ptr()")
        for j, ((shape, _, dtype, device, zero, floating), off) in enumerate(zip(self.allocs, self.layout)):
            i = n_inputs + j
            if off is not None:
                add(f"    p{i} = w + {off}")
                continue
            make = "zeros" if zero else "empty"
            add(f"    t{i} = {make}({tuple(shape)!r}, dtype={name(dtype)}, device={name(device)})")
            if not zero and floating:
                add("    if nan:")
                add(f"        t{i}.fill_(float('nan'))")
            add(f"    p{i} = t{i}.data_ptr()")
        for k, step in enumerate(self.steps):
            if step[0] in ("launch", "c"):
                _, launcher, function, packed, grid, stream, template, pp, dd = step
                args = [literal(a) for a in template]
                for pos, i, off in pp:
                    args[pos] = ptr(i, off)
                skip = set()
                if step[0] == "launch":
                    for pos, shell, i, off in dd:
                        add(f"    {name(shell)}.base = Ptr({ptr(i, off)})")
                        args[pos] = name(shell)
                    head = f"{name(launcher)}({grid[0]}, {grid[1]}, {grid[2]}, STREAM, {name(function)}, " \
                           f"{name(packed)}, None, None, None"
                else:
                    for d, (pos, n, shell, meta, slot, i, off) in enumerate(dd):
                        m = f"m{k}_{d}"
                        add(f"    {m} = {name(slot)}[0]")
                        add(f"    if {m}[0] != {ptr(i, off)}:")
                        add(f"        {m} = refresh({name(slot)}, {name(shell)}, {name(meta)}, "
                            f"{name(launcher.expand)}, {ptr(i, off)})")
                        args[pos] = f"*{m}[1]"
                        skip.update(range(pos + 1, pos + n))
                    head = f"{name(launcher.c)}({grid[0]}, {grid[1]}, {grid[2]}, STREAM, {name(function)}, " \
                           f"{launcher.coop!r}, {launcher.pdl!r}, None, None, {name(packed)}, None, None, None"
                head = head.replace("STREAM", "handle" if stream is None else f"{name(stream)}.cuda_stream")
                add(f"    {head}, {', '.join(a for pos, a in enumerate(args) if pos not in skip)})")
            else:
                _, event, stream, fn = step
                add(f"    {name(fn)}({name(event)}, {'cur' if stream is None else name(stream)})")
        outs = [("None" if o is None else f"t{o[0]}" if o[1] is None else f"t{o[0]}.view({o[1]!r})")
                for o in self.outputs]
        add(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        self.source = "\n".join(body) + "\n"
        exec(compile(self.source, f"<launch list {id(self):x}>", "exec"), ns)
        self.replay = ns["replay"]


def _refresh(slot: list, shell, meta, expand, base: int) -> tuple:
    """(base, expansion) of a descriptor whose base moved: Triton's own expansion of a copy of the shell at `base`,
    kept in the slot for the next replay."""
    d = object.__new__(type(shell))
    d.__dict__.update(shell.__dict__)
    d.base = _Ptr(base)
    kept = slot[0] = (base, expand(d, meta))
    return kept


def _event_fn(event, kind: str):
    """fn(event, stream) making a step: event.record(stream) ("record") or stream.wait_event(event) ("wait"). For
    torch.cuda.Event itself, its C base's method (the Python layers in front of it only fill in a stream that is
    None, and a replay always passes one); for any other event class, its own methods."""
    name = "record" if kind == "record" else "wait"
    cls = type(event)
    if getattr(torch.cuda, "Event", None) is cls and cls.__dict__.get(name) is not None:
        for base in cls.__mro__[1:]:
            fn = base.__dict__.get(name)
            if fn is not None:
                if not isinstance(fn, types.FunctionType):        # a C method
                    return fn
                break
    if kind == "record":
        return lambda e, stream: e.record(stream)
    return lambda e, stream: stream.wait_event(e)


def _c_step(run, function, packed, grid, stream, args, template, ptrs, descs) -> Optional[tuple]:
    """A launch step through the C launch under `run` (runtime/c_launch.py), or None where there is none: ("c", the
    CLaunch, function, packed, grid, stream, the expanded argument template, pointer patches (position in the
    expanded arguments, source, offset), descriptor patches (position, length of its expansion, a shell with its
    fields, its metadata, a one-slot list holding (base, expansion) of the last call, source, offset)). args: the
    recorded call's arguments, whose descriptors give each expansion's length and the slots' first entries."""
    from linattn.runtime.c_launch import c_launch_of
    cl = c_launch_of(run)
    if cl is None or {pos for pos, a in enumerate(args) if _is_desc(a)} != set(cl.descs):
        return None
    patches = dict((pos, (i, off)) for pos, i, off in ptrs)
    shells = dict((pos, (shell, i, off)) for pos, shell, i, off in descs)
    expanded, pp, dd = [], [], []
    for pos, a in enumerate(template):
        if pos in cl.descs:
            e = cl.expand(args[pos], cl.descs[pos])
            if pos in shells:
                shell, i, off = shells[pos]
                dd.append((len(expanded), len(e), shell, cl.descs[pos], [(args[pos].base.data_ptr(), e)], i, off))
            expanded.extend(e)               # (kept: a descriptor over a long-lived tensor, expanded once)
        else:
            if pos in patches:
                pp.append((len(expanded),) + patches[pos])
            expanded.append(a)
    return ("c", cl, function, packed, grid, stream, expanded, tuple(pp), tuple(dd))


def signature(t: Optional[torch.Tensor]):
    """What a launch list's signature holds of one tensor argument: its shape, strides and dtype (None for None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype)


class SignatureLists:
    """Per call signature of an eager host path, the LaunchList of one recorded call, or the number of recordings
    that gave none: a first call compiles through the JIT (so its record never gives a list), and a call whose host
    path copies an input never gives one, so a signature is recorded at most MAX_RECORDINGS times. At most
    MAX_SIGNATURES signatures are kept (then all are forgotten). host_path, get_device, hooks_active and poisoning
    are the host path's (runtime/host_path.py) and runtime/alloc.py's, passed by the caller."""
    MAX_RECORDINGS = 3
    MAX_SIGNATURES = 256

    def __init__(self, host_path, get_device, hooks_active, poisoning):
        self.lists: dict = {}
        self.generation = 0                 # bumped whenever lists are forgotten (a holder of one list can tell)
        self.host_path, self.get_device, self.hooks_active, self.poisoning = \
            host_path, get_device, hooks_active, poisoning

    def __call__(self, key, inputs: Sequence[Optional[torch.Tensor]], run, outputs_of) -> tuple:
        """The outputs of a call whose signature is `key` and whose tensors are `inputs` (None where absent): a replay
        of key's list where it has one that applies, else `run()` (the host path), recorded while key may still get a
        list. outputs_of maps run()'s result to the tuple of outputs (tensors or None)."""
        entry = self.lists.get(key)
        if entry is not None and type(entry) is not int:
            out = entry(*inputs)
            if out is not None:
                return out
        if entry is not None and (type(entry) is not int or entry >= self.MAX_RECORDINGS):
            return outputs_of(run())
        q = inputs[0]
        with recording(torch.cuda.current_stream(q.device) if q.is_cuda else None) as rec:
            outs = outputs_of(run())
        launched = rec.broken is None and any(s[0] == "launch" for s in rec.steps)
        made = None if not launched else LaunchList.build(     # (nothing launched directly: no device to ask)
            rec, inputs, outs, self.get_device(), self.host_path, self.get_device, self.hooks_active, self.poisoning)
        if len(self.lists) >= self.MAX_SIGNATURES:
            self.clear()
        self.lists[key] = made if made is not None else (entry or 0) + 1
        return outs

    def get(self, key) -> Optional[LaunchList]:
        """key's LaunchList, or None (no list, or only recordings that gave none)."""
        entry = self.lists.get(key)
        return entry if isinstance(entry, LaunchList) else None

    def direct(self, key, pad: int = 0):
        """For a caller that remembers calls by a signature of its own: a function of a repeat call's inputs (the
        recorded ones but the last `pad`, which were None) replaying key's list, or None where key has none. The
        function declines (None) once the lists were forgotten or a torch.func transform is active (what else the
        list's choice read is the caller's signature to vouch for), and where the list itself declines."""
        lst = self.get(key)
        transforms = getattr(torch._C, "_are_functorch_transforms_active", None)
        if lst is None or transforms is None:
            return None
        generation, nones = self.generation, (None,) * pad

        def call(*inputs):
            if self.generation != generation or transforms():
                return None
            return lst(*inputs, *nones)
        return call

    def clear(self) -> None:
        self.lists.clear()
        self.generation += 1
