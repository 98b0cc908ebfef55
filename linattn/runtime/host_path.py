"""The per-call host path of a kernel launch, shared by the matmul launchers (ops/matmul/launch.py) and the GDN
Gluon launches (ops/gated_delta_rule/gluon/host.py): launch plans cached per call signature, per-call
TensorDescriptors cloned from a validated template, and a launch through the compiled-kernel handle.

Why: everything in front of a kernel is host Python. A *plan* holds what
depends only on the call's signature (launch config, grid, constexprs, descriptor shapes, strides, blocks and
layouts); computing it once per signature leaves, per call, the tensors, the descriptors (they hold the data
pointers) and the launch. `jit_fn[grid](...)` re-binds and re-specialises every argument and hashes a cache key
on every call; the first call of a plan goes through it and keeps the CompiledKernel it returns, and with
`HostPath.handle` on later calls use `compiled[grid](*args)` (the CompiledKernel launcher the JIT ends in, with
the same argument list, constexprs included). A plan key must fix everything the JIT specialises on (dtypes,
integer values, 16-byte alignment of pointers, constexprs, num_warps), so the kernel is the one the JIT would
pick. Feature-detected: a Triton whose JIT returns no usable handle (the interpreter) keeps using the JIT.

Each user owns a HostPath (its options: on by default, switched off for a block by tests and host-time tools) and
passes it to PlanCache, launch and DescriptorFactory. Nothing here allocates on the device or synchronises, so a launch through it is
as valid inside CUDA-graph capture as the JIT's.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Optional

from triton.runtime.driver import driver as _triton_driver

from linattn.runtime import launch_list

MAX_PLANS = 4096


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: triton.cdiv is a ConstexprFunction, a few microseconds per host call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code (triton.next_power_of_2 is a ConstexprFunction,
    a few microseconds per host call)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass
class HostPath:
    plan_cache: bool = True      # reuse launch plans per call signature
    handle: bool = True          # launch through the cached CompiledKernel

    @contextlib.contextmanager
    def options(self, plan_cache: Optional[bool] = None, handle: Optional[bool] = None):
        """Temporarily switch the options (restored on exit)."""
        saved = (self.plan_cache, self.handle)
        if plan_cache is not None:
            self.plan_cache = plan_cache
        if handle is not None:
            self.handle = handle
        try:
            yield self
        finally:
            self.plan_cache, self.handle = saved


class PlanCache:
    """key -> plan, bounded (cleared when full: shapes seen by a real workload are few). With the host path's
    plan_cache off, every get builds afresh and stores nothing."""

    def __init__(self, host_path: HostPath):
        self.host_path = host_path
        self._plans: Dict[Hashable, Any] = {}

    def get(self, key, build):
        if not self.host_path.plan_cache:
            return build()
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = build()
        return plan

    def peek(self, key):
        """The plan kept for key, or None (never builds; None too while the plan cache is off)."""
        return self._plans.get(key) if self.host_path.plan_cache else None

    def clear(self):
        self._plans.clear()

    def __len__(self):
        return len(self._plans)


def usable_handle(k) -> bool:
    # A CompiledKernel launches as k[grid](*args); an async-compile future (k.result) or anything else does not.
    return k is not None and not hasattr(k, "result") and hasattr(type(k), "__getitem__") and hasattr(k, "run")


def takes_stream(k) -> bool:
    """Whether a CompiledKernel's launcher takes the stream as a keyword (triton 3.6: k[grid](*args, stream=s)),
    asked once per handle: a launch on a stream other than the current one then needs no stream switch."""
    import inspect
    try:
        return "stream" in inspect.signature(k[(1, 1, 1)]).parameters
    except (TypeError, ValueError):
        return False


def _launch_hooks():
    """Triton's launch-hook chains (triton.knobs.runtime, feature-detected), or None where this Triton has none: the
    direct launch below is taken only while no hook is registered (a profiler's hooks see every launch)."""
    try:
        from triton import knobs
        rt = knobs.runtime
        rt.launch_enter_hook.calls, rt.launch_exit_hook.calls      # noqa: B018 - the attributes this path reads
        return rt
    except Exception:  # noqa: BLE001 - any other Triton: the CompiledKernel's own launcher
        return None


_HOOKS = _launch_hooks()


def direct_launch(k):
    """(run, function, packed_metadata, stream query) of a CompiledKernel: what its launcher (`k[grid](*args)`) ends
    in, kept so that a launch calls `run` itself (or the C launch under it: plain_c_launch), skipping the launcher's
    per-call device and stream queries, launch metadata and hook reads (~4 of its ~10 us on the H200's host). None
    where the attributes are not there."""
    try:
        from triton.runtime.driver import driver
        return k.run, k.function, k.packed_metadata, driver.active.get_current_stream
    except Exception:  # noqa: BLE001 - another Triton: the CompiledKernel's own launcher
        return None


def plain_c_launch(run):
    """The C launch under `run` (runtime/c_launch.py) where the kernel has no descriptor parameter (its arguments
    then pass unchanged), else None (a launch calls `run`, which expands the descriptors)."""
    from linattn.runtime.c_launch import c_launch_of
    c = c_launch_of(run)
    return c if c is not None and not c.descs else None


def hooks_active() -> bool:
    """Whether a Triton launch hook is registered (or this Triton's hooks cannot be read): a direct launch is then
    not taken, so that a profiler's hooks see every launch."""
    return _HOOKS is None or bool(_HOOKS.launch_enter_hook.calls or _HOOKS.launch_exit_hook.calls)


def kept_direct(handles: Dict[Hashable, Any], slot: Hashable, device):
    """(run, function, packed_metadata, stream query) of the compiled kernel `launch` kept for slot on device (the
    pieces of a direct launch: run(gridX, gridY, gridZ, stream, function, packed, None, None, None, *args)), or None
    where none is kept or this Triton has no direct launch."""
    kept = handles.get((slot, device))
    return None if kept is None else kept[2]


def current_device():
    # asked on every eager decode call: the driver config is imported with this module, not per call (its .active is
    # read each time: a stand-in driver may replace it)
    return _triton_driver.active.get_current_device()


def launch(host_path: HostPath, jit_fn, handles: Dict[Hashable, Any], slot: Hashable, grid, args, options: dict,
           device_of: Callable[[], Any] = current_device, stream=None) -> None:
    """Launch `jit_fn` on a 3-tuple grid with all its arguments positional (constexprs included), on `stream` (a
    torch.cuda.Stream; None: the current stream). `handles` (a plan's dict) keeps the CompiledKernel per `slot` and
    device for the handle path, with whether its launcher takes the stream (else the launch switches streams)."""
    # Per current device, as the JIT's own caches: a handle holds a function loaded in one context. The device is
    # asked only once a handle exists: the interpreter returns none, and there may be no GPU driver to ask.
    if host_path.handle and handles:
        dev = device_of()
        kept = handles.get((slot, dev))
        if kept is not None:
            k, with_stream, raw, c = kept
            if raw is not None and not (_HOOKS.launch_enter_hook.calls or _HOOKS.launch_exit_hook.calls):
                run, function, packed, get_stream = raw
                s = get_stream(dev) if stream is None else stream.cuda_stream
                if c is None:
                    run(grid[0], grid[1], grid[2], s, function, packed, None, None, None, *args)
                else:
                    c.c(grid[0], grid[1], grid[2], s, function, c.coop, c.pdl, None, None, packed, None, None, None,
                        *args)
                launch_list.note_launch(raw, grid, stream, args)
                return
            launch_list.note_other_launch("a launch through the compiled kernel's launcher")
            if stream is None:
                k[grid](*args)
            elif with_stream:
                k[grid](*args, stream=stream.cuda_stream)
            else:
                import torch
                with torch.cuda.stream(stream):
                    k[grid](*args)
            return
    launch_list.note_other_launch("a launch through the JIT")
    if stream is None:
        k = jit_fn[grid](*args, **options)
    else:
        import torch
        with torch.cuda.stream(stream):
            k = jit_fn[grid](*args, **options)
    if host_path.handle and usable_handle(k):
        raw = direct_launch(k) if _HOOKS is not None else None
        handles[(slot, device_of())] = (k, takes_stream(k), raw, None if raw is None else plain_c_launch(raw[0]))


# The fields of triton 3.6's Gluon TensorDescriptor, none derived from the base. A descriptor class with any
# other field set (a later Triton may derive one from the base) is always built by its constructor.
KNOWN_DESCRIPTOR_FIELDS = {"base", "shape", "strides", "block_shape", "layout", "padding"}


class DescriptorFactory:
    """Per-call TensorDescriptors for one plan. The first is built by the constructor (which validates shape,
    strides, block and layout); later ones copy its fields and swap the base tensor, skipping a re-validation
    of what the plan key has fixed (the caller checks the 16-byte alignment of each base). A descriptor class
    with other fields than 3.6's (a future Triton) is always built by its constructor, and so is every
    descriptor while `host_path.plan_cache` is off."""
    __slots__ = ("cls", "spec", "fields", "host_path", "view")

    def __init__(self, cls, shape, strides, block_shape, layout, host_path: Optional[HostPath] = None):
        self.cls, self.spec, self.fields, self.host_path = cls, (shape, strides, block_shape, layout), None, host_path
        self.view = (tuple(shape), tuple(strides))

    def __call__(self, base):
        if self.fields is not None and (self.host_path is None or self.host_path.plan_cache):
            d = object.__new__(self.cls)
            d.__dict__.update(self.fields)
            d.base = base
            return d
        d = self.cls(base, *self.spec)
        if self.fields is None and set(getattr(d, "__dict__", ())) == KNOWN_DESCRIPTOR_FIELDS:
            self.fields = {k: v for k, v in d.__dict__.items() if k != "base"}   # no tensor kept alive
        return d

    def over(self, t):
        """A descriptor over the whole of t (as TensorDescriptor.from_tensor(t, block, layout)): the template's
        copy when t's shape and strides are the template's, else one built by the constructor from t's own."""
        if (t.shape, t.stride()) == self.view:
            return self(t)
        return self.cls(t, t.shape, t.stride(), self.spec[2], self.spec[3])


# Options of a JIT launch that are not kernel parameters (the rest of a launch's keyword arguments are).
LAUNCH_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"))


def arg_key(a):
    """What a launch plan keys one runtime argument on: at least everything the JIT specialises it on (a tensor's
    dtype and 16-byte alignment; an integer's value, finer than the JIT's == 1 / % 16; a float's type; None; a
    TensorDescriptor's type, dtype, block and layout), so the compiled kernel kept for a key is the one the JIT
    would pick. Raises TypeError for anything else (the caller then launches through the JIT)."""
    if a is None:
        return None
    kind = type(a)                      # the common exact types first: this runs for every argument of a launch
    if kind is int:
        return ("i", a)
    if kind is bool:
        return ("b", a)
    if kind is float:
        return ("f",)
    import torch
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return ("i", a)
    if isinstance(a, float):
        return ("f",)
    if hasattr(a, "block_shape") and hasattr(a, "base") and hasattr(a, "layout"):
        return (type(a), a.base.dtype, tuple(a.block_shape), a.layout, getattr(a, "padding", None))
    raise TypeError(f"no launch key for an argument of type {type(a).__name__}")


def _default(param):
    """A parameter's default (the JIT applies it to a parameter not given); KeyError where it has none."""
    if not getattr(param, "has_default", False):
        raise KeyError(param.name)
    return param.default


class LaunchCache:
    """`kernel[grid](*args, **kwargs)` through the host path: per (kernel, argument keys, constexprs, options) the
    compiled kernel of the first launch is kept and later launches go through its handle (runtime/host_path.py's
    `launch`), skipping the JIT's binding and specialisation. kwargs are the kernel's remaining parameters (one not
    given takes its default, as the JIT's binder does) and the launch options (LAUNCH_OPTIONS), keyed by value;
    `tensors` the runtime arguments the caller passes by keyword (pointer parameters after constexprs, such as an
    optional input), keyed as positional ones. A parameter without a default left out, an unknown keyword, a tensor
    among kwargs (it would key a plan per tensor), an argument without a key (arg_key), a kernel without `params` (a
    Triton without them) or the host path's plan cache or handle off: launched through the JIT, as given."""

    def __init__(self, host_path: HostPath):
        self.plans = PlanCache(host_path)
        self.jit_launches = 0            # launches that went through the JIT (tests count them)
        # (id(kernel), number of positional arguments, the keyword arguments) -> (kernel, (the constexprs in
        # parameter order, the launch options, their key) or None where the call cannot be planned): what a launch
        # derives from its keywords, computed once per keyword set instead of walking the kernel's parameters
        self._derived: Dict[Hashable, Any] = {}
        self._layouts: Dict[int, tuple] = {}     # id(layout) -> (layout, token): see _arg_key
        self._tokens = itertools.count()         # never reused, also across clear()

    @staticmethod
    def _derive(kernel, nargs: int, kwargs: dict, tensors: tuple):
        """(the remaining parameters' values in order, None where a runtime tensor goes; the launch options; their
        key; (position, name) of each runtime tensor), or None where the launch cannot be planned (False: a tensor
        among kwargs, which would key an entry per tensor, so none is kept)."""
        import torch
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return False
        try:
            params = kernel.params[nargs:]
            consts = tuple(None if p.name in tensors else kwargs[p.name] if p.name in kwargs else _default(p)
                           for p in params)
        except (AttributeError, KeyError, TypeError):
            return None
        options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        if len(options) + sum(p.name in kwargs for p in params) != len(kwargs):
            return None                  # a keyword that is neither a parameter nor a launch option
        places = tuple((i, p.name) for i, p in enumerate(params) if p.name in tensors)
        if len(places) != len(tensors) or any(p.name in kwargs for p in params if p.name in tensors):
            return None                  # a runtime tensor that is not a parameter, or given twice
        return consts, options, tuple(sorted(options.items())), places

    def __call__(self, kernel, grid, args, kwargs, stream=None, tensors=None) -> None:
        hp = self.plans.host_path
        derived = None
        if hp.plan_cache and hp.handle:
            try:
                # the kernel by id (a JITFunction's hash is computed in Python on every call); the entry keeps the
                # kernel alive, so no other object takes its id while plans keyed by it exist (cleared together)
                names = () if tensors is None else tuple(tensors)
                dkey = (id(kernel), len(args), tuple(kwargs.items()), names)
                entry = self._derived.get(dkey)
                if entry is None or entry[0] is not kernel:
                    made = self._derive(kernel, len(args), kwargs, names)
                    if made is not False:
                        if len(self._derived) >= MAX_PLANS:
                            self.clear()
                        self._derived[dkey] = (kernel, made)
                    entry = (kernel, made or None)
                derived = entry[1]
                if derived is not None:
                    consts = derived[0]
                    key = (dkey[0], tuple([self._arg_key(a) for a in args]), consts, derived[2])
                    if names:
                        consts = list(consts)
                        for pos, name in derived[3]:
                            consts[pos] = tensors[name]
                        consts = tuple(consts)
                        key += (tuple([arg_key(tensors[n]) for n in names]),)
            except TypeError:            # an unhashable keyword value, an argument without a key
                derived = None
        if derived is None:
            self.jit_launches += 1
            launch_list.note_other_launch("a launch through the JIT")
            kw = kwargs if not tensors else dict(kwargs, **tensors)
            if stream is None:
                kernel[grid](*args, **kw)
            else:
                import torch
                with torch.cuda.stream(stream):
                    kernel[grid](*args, **kw)
            return
        handles = self.plans.get(key, dict)
        if not handles:
            self.jit_launches += 1
        launch(hp, kernel, handles, "launch", tuple(grid) + (1,) * (3 - len(grid)), tuple(args) + consts,
               derived[1], device_of=current_device, stream=stream)

    def _arg_key(self, a):
        """arg_key, with a TensorDescriptor's layout replaced by a token per layout object (a Gluon layout's hash is
        computed in Python from its fields on every lookup; the descriptors of one template share one layout
        object). The token table keeps each layout alive, so its id stays its own until the cache is cleared."""
        if hasattr(a, "block_shape") and hasattr(a, "base") and hasattr(a, "layout"):
            layout = a.layout
            tok = self._layouts.get(id(layout))
            if tok is None or tok[0] is not layout:
                if len(self._layouts) >= MAX_PLANS:
                    return arg_key(a)        # the layout itself (hashed by its fields), as without tokens
                tok = self._layouts[id(layout)] = (layout, next(self._tokens))
            return (type(a), a.base.dtype, tuple(a.block_shape), tok[1], getattr(a, "padding", None))
        return arg_key(a)

    def clear(self):
        self.plans.clear()
        self._derived.clear()
        self._layouts.clear()

    def __len__(self):
        return len(self.plans)
