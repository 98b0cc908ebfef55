"""Where every wgmma of a Gluon kernel reads its shared-memory operands, and where its cp.async copies write, from the
kernel's PTX (CPU only): `python3 benchmarks/wgmma_operands.py AOT_NAME [--ptx FILE]` (AOT names from
linattn.runtime.aot.kernels(), compiled for sm_90a here, without TRITON_INTERPRET).

Prints, per wgmma.mma_async in PTX order: its source line (the nearest preceding `.loc`, at the outermost call site
where it is inlined), its shape, and the byte offsets in shared memory at which its A and B descriptors start (bits
0..13 of a descriptor, times 16) for the first thread of warpgroups 0 and 1 ("regs" for an A operand in registers);
then, per source line, the offsets at which cp.async copies (TMA loads too) land for those threads. Compare them with where each tile should be: a view whose descriptor does
not start where the copies or stores put the tile reads the wrong memory, which no CPU test of a compiled kernel
sees (the first build of the local/WY backward kernel read three tiles from the wrong places so).

Values are found by following each register's single definition through the PTX's integer arithmetic, with
%tid.x the thread and the shared base 0; a register defined more than once (a loop variable) stays unknown ("?"),
so a loop's offsets print only where they do not depend on its counter.
"""
import argparse
import collections
import re
import sys

M64 = (1 << 64) - 1
_OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "or": lambda a, b: a | b, "and": lambda a, b: a & b,
        "xor": lambda a, b: a ^ b, "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "mul": lambda a, b: a * b,
        "mad": lambda a, b, c: a * b + c, "div": lambda a, b: a // b, "rem": lambda a, b: a % b,
        "bfe": lambda a, b, c: (a >> b) & ((1 << c) - 1)}


class Ptx:
    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.defs = collections.defaultdict(list)
        for i, line in enumerate(self.lines):
            m = re.match(r"\s*(@!?%p\d+\s+)?([a-z][\w.]*)\s+(%[\w.]+),\s*(.*);", line)
            if m:
                self.defs[m[3]].append((m[2], [a.strip() for a in m[4].split(",")], bool(m[1])))

    def value(self, tok: str, tid: int, depth: int = 0):
        """The integer value of a PTX operand for thread tid, or None where it is not a single-definition chain."""
        if depth > 80:
            return None
        if tok == "global_smem":
            return 0
        if tok == "%tid.x":
            return tid
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        d = self.defs.get(tok)
        if not d or len(d) != 1 or d[0][2]:
            return None
        op, args, _ = d[0]
        base = op.split(".")[0]
        if base in ("mov", "cvt", "shfl"):
            return self.value(args[0], tid, depth + 1)
        fn = _OPS.get(base)
        if fn is None:
            return None
        vals = [self.value(a, tid, depth + 1) for a in args]
        if None in vals or len(vals) != fn.__code__.co_argcount:
            return None
        return fn(*vals) & M64

    def source_line(self, i: int) -> str:
        """The source line of PTX line i: the nearest preceding `.loc`'s, or where it is inlined, its outermost call
        site's (the comment Triton writes after it: `file:92:40 @[ file:171:75 ]`)."""
        for j in range(i, -1, -1):
            m = re.search(r"\.loc\s+\d+\s+(\d+)", self.lines[j])
            if m:
                outer = re.findall(r"@\[ [^:\]]+:(\d+)", self.lines[j])
                return outer[-1] if outer else m[1]
        return "?"


def report(ptx: str, tids=(0, 128)):
    """(wgmma rows: (source line, shape, [(A, B) per tid]), copies: {source line: [offsets per tid]})."""
    p = Ptx(ptx)
    rows, copies = [], collections.OrderedDict()

    def desc(tok, tid):
        if not tok.startswith("%rd"):
            return "regs"
        v = p.value(tok, tid)
        return "?" if v is None else (v & 0x3fff) * 16

    for i, line in enumerate(p.lines):
        if "wgmma.mma_async" in line:
            m = re.search(r"\}, (%\w+), (%\w+)", line)
            shape = re.search(r"m64n\d+k\d+\.\w+(\.\w+)*", line)
            if m:
                rows.append((p.source_line(i), shape[0] if shape else "?",
                             [(desc(m[1], t), desc(m[2], t)) for t in tids]))
        elif "cp.async" in line and "shared" in line:
            m = re.search(r"\[\s*(%r\w*)\s*(\+\s*(\d+))?\s*\]", line)
            if m:
                offs = []
                for t in tids:
                    v = p.value(m[1], t)
                    offs.append("?" if v is None else v + int(m[3] or 0))
                copies.setdefault(p.source_line(i), []).append(offs)
    return rows, copies


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="a registered AOT kernel")
    ap.add_argument("--ptx", help="a PTX file instead")
    a = ap.parse_args(argv)
    if a.ptx:
        ptx = open(a.ptx).read()
    elif a.name:
        from linattn.runtime.aot import kernel_asm
        ptx = kernel_asm(a.name, "ptx")
    else:
        ap.error("name or --ptx")
    rows, copies = report(ptx)
    print("wgmma (source line, shape, warpgroup 0 A / B, warpgroup 1 A / B: shared-memory byte offsets)")
    for line, shape, per in rows:
        print(f"  line {line:>4} {shape:28s} " + "   ".join(f"A {x} B {y}" for x, y in per))
    print("cp.async destinations (source line: offsets for warpgroup 0's / 1's first thread)")
    for line, offs in copies.items():
        print(f"  line {line:>4}: " + ", ".join(f"{x}/{y}" for x, y in offs[:8]) + (" ..." if len(offs) > 8 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
