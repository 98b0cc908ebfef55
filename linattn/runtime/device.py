"""Device facts with a CPU answer.

Under TRITON_INTERPRET=1 on a CPU, asking Triton's driver for properties fails ("0 active drivers"), so every
device query of the package goes through here and answers for the CPU too.
"""
from dataclasses import dataclass
from functools import lru_cache

import torch


def _is_compiling():
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn


_IS_COMPILING = _is_compiling()


def under_torch_compile() -> bool:
    """Whether torch.compile is tracing this call (Dynamo answers True while tracing; False when run eagerly).
    Backend choices ask it before reading what a trace cannot know: a tensor's address (data_ptr) or whether a
    CUDA graph is being captured. Feature-detected once, at import: torch.compiler.is_compiling (torch >= 2.3), else
    torch._dynamo.is_compiling."""
    return bool(_IS_COMPILING()) if _IS_COMPILING is not None else False


def records_autograd(*tensors) -> bool:
    """Whether a call on these tensors (None allowed) records an autograd graph: grad mode on and one of them
    requiring grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def eager_without_autograd(*tensors) -> bool:
    """Whether a call may run its launcher directly instead of through its torch custom op: plain eager tensors (the
    first one not a fake, functional or other subclass tensor, no torch.func transform active, not traced by
    torch.compile) and no autograd graph to record (grad mode off, or no input requiring grad). The custom op's
    dispatch costs more host time than a small kernel; traced and differentiable calls keep it."""
    if type(tensors[0]) is not torch.Tensor or under_torch_compile():
        return False
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is None or active():
        return False
    return not records_autograd(*tensors)


@dataclass(frozen=True)
class DeviceFacts:
    kind: str                 # "cuda" or "cpu"
    name: str
    capability: tuple         # (major, minor); (0, 0) on the CPU
    num_sms: int
    smem_per_block: int       # bytes a block may use with the opt-in limit; 0 on the CPU
    total_memory: int

    @property
    def arch(self) -> str:
        major, minor = self.capability
        if self.kind != "cuda":
            return "cpu"
        return f"sm_{major}{minor}" + ("a" if major == 9 else "")


@lru_cache(maxsize=None)
def _cuda_facts(index: int) -> DeviceFacts:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "max_shared_memory_per_block_optin", 0)
    if not smem:
        smem = 232448 if p.major == 9 else 166912 if p.major == 8 else 49152
    return DeviceFacts("cuda", p.name, (p.major, p.minor), p.multi_processor_count, int(smem), int(p.total_memory))


_FACTS_BY_INDEX: dict = {}
_FACTS_BY_DEVICE: dict = {}


def device_facts(device=None) -> DeviceFacts:
    """Facts about `device` (a torch.device, a string, a tensor or None for the current CUDA device, else CPU). A
    tensor's are kept by its device index (-1: CPU), a torch.device's by the device when it names one (a CPU, or a
    GPU with its index; "cuda" alone means the current device, asked each time): the launchers' per-call question."""
    if isinstance(device, torch.Tensor):
        idx = device.get_device()
        facts = _FACTS_BY_INDEX.get(idx)
        if facts is None:
            facts = _FACTS_BY_INDEX[idx] = device_facts(device.device)
        return facts
    if isinstance(device, torch.device):
        facts = _FACTS_BY_DEVICE.get(device)
        if facts is None:
            facts = _facts(device)
            if device.index is not None or device.type == "cpu":
                _FACTS_BY_DEVICE[device] = facts
        return facts
    return _facts(device)


def _facts(device) -> DeviceFacts:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())
    return _cpu_facts()


@lru_cache(maxsize=None)
def _cpu_facts() -> DeviceFacts:
    import os
    return DeviceFacts("cpu", "cpu", (0, 0), os.cpu_count() or 1, 0, 0)


def triton_interprets() -> bool:
    """Whether @triton.jit functions in this process run in Triton's interpreter. Triton decides when a function
    is decorated (its own library at `import triton`, linattn's kernels at `import linattn`), not when it runs:
    TRITON_INTERPRET set later changes nothing, so this asks a library function what it became."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.cdiv, InterpretedFunction)


LATE_INTERPRETER = ("TRITON_INTERPRET=1 was set after triton was imported (by `import linattn` or earlier), so "
                    "Triton compiles for a GPU in this process: set TRITON_INTERPRET=1 before importing linattn "
                    "(or triton) to run the Triton kernels on the CPU")


def interpreter_mismatch() -> str:
    """LATE_INTERPRETER when TRITON_INTERPRET=1 is set now but Triton was imported without it, else ""."""
    from linattn.runtime.settings import settings
    return LATE_INTERPRETER if settings.interpret and not triton_interprets() else ""


def hopper_gluon_ready(t: torch.Tensor, what: str, needs: str = "TMA, WGMMA"):
    """(ok, reason): whether `what` (a Gluon Hopper kernel, e.g. "the Gluon decode") can run on t's device: not
    under the interpreter, a CUDA tensor, an sm_90 GPU, and a Triton that has the Gluon names we use. The one
    place backends ask this; each then adds its own shape and dtype checks."""
    from linattn.runtime.settings import settings
    if settings.interpret:
        return False, "TRITON_INTERPRET=1: the interpreter cannot run Gluon kernels"
    if t.device.type != "cuda":
        return False, f"tensors on {t.device}: {what} needs an sm_90 GPU"
    facts = device_facts(t.device)
    if facts.capability[0] != 9:
        return False, f"{facts.name} is {facts.arch}; {what} targets sm_90a ({needs})"
    from linattn.runtime.gluon_compat import gluon_status     # imports Gluon: only once a Hopper GPU is there
    ok, reason, _ = gluon_status()
    return ok, reason
