"""Ahead-of-time compilation of registered kernels on a CPU host, and the SASS facts `linattn inspect` prints.

Each op may ship `linattn/ops/<op>/aot.py` that calls `register(AotKernel(...))`; `kernels()` imports every such
module, so a new op registers its kernels without touching this file. A spec builds its jit function and
signature lazily (`build`), because Gluon names exist only on a Triton that has them.

Compiling needs no GPU: triton.compile with a GPUTarget runs the whole pipeline down to a cubin with the
wheel's ptxas; registers and spills come from `ptxas -v` (k.n_regs needs a driver), SASS from cuobjdump.
"""
from __future__ import annotations

import collections
import importlib
import os
import pkgutil
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

# SASS opcode families `inspect` counts; a family counts every opcode that starts with it. "LDG.E" counts plain
# global loads with their width and L2 hint (LDG.E.128, LDG.E.EL.128: the decode's reg_prefetch walk), "ACQBULK"
# griddepcontrol.wait.
SASS_FAMILIES = ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "LDGSTS", "HMMA", "LDL", "STL", "WARPGROUP", "BAR", "LDSM",
                 "LDG.E", "ACQBULK")

ARCHS = {"sm_90a": 90, "sm_80": 80, "sm_100a": 100}


@dataclass
class AotKernel:
    """One kernel configuration to compile ahead of time.

    build() -> (jit_fn, signature, constexprs, options): signature maps every argument to a Triton type string
    ('*bf16', 'i32', a tensordesc string, or 'constexpr'); options holds num_warps etc.
    intended: SASS opcode prefixes the kernel must contain on its first arch (e.g. 'HGMMA', 'UTMALDG').
    div16: argument names the JIT would mark 16-divisible (aligned pointers, strides); AOT must say so.
    known_spill_bytes: the spill a kernel is registered with while it is a known defect (say why where it is
    registered); the CI test fails when a build spills more, so it can only go down. 0 for every sound kernel.
    default: the build is a configuration some call runs with no environment variable set (`inspect --list`
    marks it); False for a build kept for comparison or reached only by naming a backend or a config.
    """
    name: str
    build: Callable[[], Tuple[Callable, Dict[str, str], Dict[str, object], Dict[str, object]]]
    intended: Tuple[str, ...] = ()
    archs: Tuple[str, ...] = ("sm_90a",)
    language: str = "gluon"                       # "gluon" or "triton"
    div16: Tuple[str, ...] = ()
    description: str = ""
    known_spill_bytes: int = 0
    default: bool = True


@dataclass
class AotReport:
    name: str
    arch: str
    regs: int
    spill_bytes: int
    smem: int
    num_warps: int
    sass: Dict[str, int] = field(default_factory=dict)        # opcode -> count (families above only)
    families: Dict[str, int] = field(default_factory=dict)    # family -> total count
    missing: List[str] = field(default_factory=list)          # intended prefixes absent from the SASS
    instructions: int = 0                                     # SASS instructions in the cubin (every opcode)


_REGISTRY: Dict[str, AotKernel] = {}
_DISCOVERED = False


def register(spec: AotKernel) -> AotKernel:
    _REGISTRY[spec.name] = spec
    return spec


def kernels() -> Dict[str, AotKernel]:
    """Every registered kernel, after importing each linattn.ops.<op>.aot module. An op whose aot module fails
    to import (e.g. no Gluon in this Triton) contributes nothing; its error is kept in `discovery_errors`."""
    global _DISCOVERED
    if not _DISCOVERED:
        import linattn.ops as ops_pkg
        for info in pkgutil.iter_modules(ops_pkg.__path__):
            if not info.ispkg:
                continue
            modname = f"linattn.ops.{info.name}.aot"
            if importlib.util.find_spec(modname) is None:
                continue
            try:
                importlib.import_module(modname)
            except Exception as e:  # noqa: BLE001 - report, do not hide other ops' kernels
                discovery_errors[modname] = repr(e)
        _DISCOVERED = True
    return dict(_REGISTRY)


discovery_errors: Dict[str, str] = {}


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(spec: AotKernel, arch: str = "sm_90a"):
    """triton.compile the spec for `arch`; returns the CompiledKernel (asm: ttgir, ptx, cubin...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    fn, signature, constexprs, options = spec.build()
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.div16}
    if spec.language == "gluon":
        from linattn.runtime.gluon_compat import GluonASTSource
        src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    else:
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
        if not isinstance(fn, JITFunction):
            # Under TRITON_INTERPRET=1, @triton.jit returns an InterpretedFunction; the compiler needs the
            # JITFunction of the same Python function (our kernels call no other jit functions).
            fn = JITFunction(fn.fn)
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32), options=dict(options))


def _ptxas(arch: str) -> str:
    """The ptxas Triton's NVIDIA backend assembles `arch` with (Triton 3.9 takes its wheel's CUDA 13 ptxas, named
    ptxas-blackwell, from sm_90 on: the PTX version it emits is one the wheel's CUDA 12 ptxas rejects); the wheel's
    ptxas where the backend has no such chooser."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(ARCHS[arch]).path
    except (ImportError, AttributeError, TypeError):
        return _tool("ptxas")


def ptxas_usage(ptx: str, arch: str) -> Tuple[int, int]:
    """(registers, spill-store bytes) from `ptxas -v`, run with the ptxas Triton uses for `arch`."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        log = subprocess.run([_ptxas(arch), f"-arch={arch}", "-v", p, "-o", p + ".cubin"],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spills is None:
        raise RuntimeError(f"could not parse ptxas -v output:\n{log}")
    return int(regs[1]), int(spills[1])


def _cuobjdump() -> str:
    """Triton's cuobjdump (its own locator where the Triton has one, else the wheel's bin folder)."""
    try:
        from triton.tools.disasm import path_to_cuobjdump
        return path_to_cuobjdump()
    except Exception:  # noqa: BLE001 - a Triton without the locator (or with another signature)
        return _tool("cuobjdump")


_SASS_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s*([^;]*;)\s*/\* 0x([0-9a-f]{16}) \*/")
_SASS_ENC2 = re.compile(r"\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
_SASS_BRA = re.compile(r"(.*BRA(?:\.U)? )(0x[0-9a-f]+);")


def _sass_ctrl(enc: int) -> str:
    """The scheduling word of an instruction's second encoding half, as triton.tools.disasm prints it:
    wait-mask:read-barrier:write-barrier:yield:stall."""
    stall, yld = (enc >> 41) & 0xF, (enc >> 45) & 0x1
    wr, rd, wait = (enc >> 46) & 0x7, (enc >> 49) & 0x7, (enc >> 52) & 0x3F
    return (f"{'--' if wait == 0 else f'{wait:02d}'}:{'-' if rd == 7 else rd}:{'-' if wr == 7 else wr}:"
            f"{'Y' if yld == 0 else '-'}:{stall:x}")


def sass_text(cubin: bytes) -> str:
    """The cubin's SASS in triton.tools.disasm.get_sass's format ("Function:<name>", "<ctrl>\t<instruction>;" lines,
    branch targets as LBB<i> labels), every instruction of every function, read from `cuobjdump -sass` here:
    get_sass expects 4-digit addresses and drops everything from 0x10000 on (the tail of a long kernel: 8 of the 100
    HGMMA of the Gluon local/WY backward)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        raw = subprocess.run([_cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    out, body, lines = [], [], raw.splitlines()

    def flush():
        labels = {}
        for _, asm, _ in body:
            m = _SASS_BRA.match(asm)
            if m:
                labels.setdefault(int(m[2], 16), len(labels))
        for addr, asm, ctrl in body:
            if addr in labels:
                out.append(f"LBB{labels[addr]}:")
            m = _SASS_BRA.match(asm)
            if m:
                asm = f"{m[1]}LBB{labels[int(m[2], 16)]};"
            out.append(f"{ctrl}\t{asm}")
        body.clear()

    for i, line in enumerate(lines):
        fn = re.match(r"\s*Function : (\w+)", line)
        if fn:
            flush()
            out.append(f"Function:{fn[1]}")
            continue
        m = _SASS_INSN.match(line)
        if m and i + 1 < len(lines):
            second = _SASS_ENC2.match(lines[i + 1])
            asm = m[2][:-2] + ";" if m[2].endswith(" ;") else m[2]
            body.append((int(m[1], 16), asm, _sass_ctrl(int(second[1], 16)) if second else "--:-:-:-:0"))
    flush()
    return "\n".join(out) + "\n"


def sass_opcodes(cubin: bytes) -> Dict[str, int]:
    """Opcode -> count over the cubin's SASS (predicates stripped), every opcode."""
    sass = sass_text(cubin)
    return dict(collections.Counter(m[2] for m in re.finditer(r"^\S+\s+(@!?U?P\w+\s+)?([A-Z][\w.]+)", sass, re.M)))


def inspect_kernel(spec: AotKernel, arch: Optional[str] = None) -> AotReport:
    arch = arch or spec.archs[0]
    key = (spec.name, arch)
    if key not in _REPORTS:
        _REPORTS[key] = _inspect_in_subprocess(spec.name, arch) if _interpreting() else _inspect_here(spec, arch)
    return _REPORTS[key]


_REPORTS: Dict[Tuple[str, str], AotReport] = {}


def _inspect_here(spec: AotKernel, arch: str) -> AotReport:
    k = compile_kernel(spec, arch)
    regs, spills = ptxas_usage(k.asm["ptx"], arch)
    opcodes = sass_opcodes(k.asm["cubin"])
    sass = {op: n for op, n in sorted(opcodes.items()) if op.startswith(SASS_FAMILIES)}
    families = {f: sum(n for op, n in sass.items() if op.startswith(f)) for f in SASS_FAMILIES}
    missing = [p for p in spec.intended if not any(op.startswith(p) for op in sass)] if arch == spec.archs[0] else []
    return AotReport(spec.name, arch, regs, spills, int(k.metadata.shared), int(k.metadata.num_warps), sass,
                     families, missing, sum(opcodes.values()))


def _interpreting() -> bool:
    from linattn.runtime.settings import settings
    return settings.interpret


def _inspect_in_subprocess(name: str, arch: str) -> AotReport:
    """Compile in a child process without TRITON_INTERPRET. In a process that imported triton with it set, every
    @triton.jit (tl.cdiv included) is an InterpretedFunction, so plain Triton kernels do not compile; and once the
    interpreter has run a kernel, the language builtins Gluon shares are left patched, so Gluon kernels then fail
    too ("'block_argument' object has no attribute 'dtype'"). A child process avoids both."""
    return AotReport(**_child_request(name, arch, None))


class _Child:
    """One compile child per process, started on the first request and kept: a request is a JSON line on its
    stdin, the answer a JSON line on its stdout, so each compile pays no interpreter start and no imports (about
    2 s of the 3-5 s a CI compile took as a process of its own). Its stderr goes to a file, read back on a failure."""

    def __init__(self):
        import sys
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "linattn.runtime.aot"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)

    def request(self, msg: dict) -> dict:
        import json
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.err.seek(0)
                raise RuntimeError(f"the AOT compile child exited ({self.proc.wait()}):\n{self.err.read()[-4000:]}")
            if line.startswith(_ANSWER):
                return json.loads(line[len(_ANSWER):])

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


_ANSWER = "linattn-aot-answer "
_CHILD: List[_Child] = []


def _child_request(name: str, arch: str, what: Optional[str]):
    """The child's inspect report (what None) or asm text of a registered kernel; a failed compile raises here."""
    if not _CHILD or _CHILD[0].proc.poll() is not None:
        import atexit
        _CHILD[:] = [_Child()]
        atexit.register(_CHILD[0].close)
    ans = _CHILD[0].request(dict(name=name, arch=arch, what=what))
    if "error" in ans:
        raise RuntimeError(f"AOT compile of {name} for {arch} failed:\n{ans['error'][-4000:]}")
    return ans["result"]


def _serve():
    """The compile child's loop (_Child): one JSON answer line per request line until stdin closes."""
    import json
    import sys
    import traceback
    from dataclasses import asdict
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            spec = kernels()[msg["name"]]
            if msg["what"] is None:
                res = asdict(_inspect_here(spec, msg["arch"]))
            else:
                res = _asm_here(spec, msg["what"], msg["arch"])
            ans = dict(result=res)
        except Exception:  # noqa: BLE001 - sent to the parent, which raises it
            ans = dict(error=traceback.format_exc())
        sys.stdout.write(_ANSWER + json.dumps(ans) + "\n")
        sys.stdout.flush()


def kernel_asm(name: str, what: str = "ptx", arch: Optional[str] = None) -> str:
    """The PTX ("ptx"), the SASS text ("sass") or the TTGIR ("ttgir") of a registered kernel. Under TRITON_INTERPRET
    compiled in the compile child, as inspect_kernel: an interpreted Triton function leaves the language builtins
    that Gluon shares patched in this process (seen in CI: "'block_argument' object has no attribute
    'get_element_ty'" from a Gluon kernel's pointer arithmetic), so no test compiles in the process that runs
    interpreted kernels."""
    if what not in ("ptx", "sass", "ttgir"):
        raise ValueError(f"what must be 'ptx', 'sass' or 'ttgir', not {what!r}")
    spec = kernels()[name]
    arch = arch or spec.archs[0]
    if not _interpreting():
        return _asm_here(spec, what, arch)
    return _child_request(name, arch, what)


def _asm_here(spec: AotKernel, what: str, arch: str) -> str:
    k = compile_kernel(spec, arch)
    if what in ("ptx", "ttgir"):
        return k.asm[what]
    return sass_text(k.asm["cubin"])


if __name__ == "__main__":
    # The compile child (_Child). Run as a script this file is __main__; the registry lives in the imported module.
    from linattn.runtime import aot as _aot
    _aot._serve()
