"""Shared-memory, shuffle and global traffic per source line of a straight-line Triton kernel, from its PTX (CPU only):
`python3 benchmarks/ptx_shared_traffic.py AOT_NAME [AOT_NAME ...] [--ptx FILE ...]` (AOT names from
linattn.runtime.aot.kernels(), compiled for sm_90a here, without TRITON_INTERPRET).

For every ld/st.shared, ldmatrix/stmatrix, shfl.sync and ld/st.global the script evaluates the PTX's integer
arithmetic for the program's threads (%tid.x = 0 .. threads-1, other special registers, parameters and the shared base
0; floating-point values are not simulated, so it needs addresses that depend only on the thread index, true of
Triton's layout conversions) and reports per outermost `.loc` source line (with the innermost one where it is
inlined), summed over the program's warps:
  bytes stored / loaded in shared memory; shared-memory wavefronts, "ideal" (ceil(bytes per warp / 128)) and
  "simulated" (per warp access: max over the 32 four-byte banks of the distinct words it touches there, at least
  the ideal), so bank conflicts are the difference; warp shuffles (one wavefront each on the same unit); global
  bytes (every thread counted: masks depend on parameters, which are not simulated).
Not counted: WGMMA's shared-memory operand reads (descriptors), and anything in loops (the script refuses PTX with
backward branches). It was written for stage 2a's inverse (docs/architecture.md), whose layout conversions it
counts.
"""
import argparse
import collections
import os
import re
import sys

MASK = {8: 0xff, 16: 0xffff, 32: 0xffffffff, 64: (1 << 64) - 1}
KINDS = ("sts", "lds", "stmatrix", "ldmatrix")


def _bits(op):
    m = re.search(r"\.[usbf](\d+)$", op) or re.search(r"\.[usbf](\d+)", op)
    return int(m[1]) if m else 32


def simulate(ptx: str):
    """{source line: Counter} for the PTX's first kernel, and the number of threads simulated."""
    ntid = re.search(r"\.reqntid\s+(\d+)", ptx) or re.search(r"\.maxntid\s+(\d+)", ptx)
    nt = int(ntid[1]) if ntid else 128
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    labels = {m[1]: i for i, m in enumerate(re.finditer(r"^(\$\w+):", body, re.M))}
    R = {}
    stats = collections.OrderedDict()
    loc = "?"
    lanes = [t % 32 for t in range(nt)]
    seen_labels = set()

    def get(tok):
        tok = tok.strip()
        if tok.startswith("%tid.x"):
            return list(range(nt))
        if tok.startswith("%"):
            return list(R.get(tok, [0] * nt))
        if re.fullmatch(r"-?0[xX][0-9a-fA-F]+", tok):
            return [int(tok, 16)] * nt
        if re.fullmatch(r"-?\d+", tok):
            return [int(tok)] * nt
        return [0] * nt                                # floats, symbols (the shared base), parameters

    def addr(tok):
        m = re.match(r"\[\s*([^\]+]+?)\s*(?:\+\s*(-?\d+))?\s*\]", tok.strip())
        return [a + (int(m[2]) if m[2] else 0) for a in get(m[1])]

    def signed(v, b):
        v &= MASK[b]
        return v - (1 << b) if v >> (b - 1) else v

    def record(kind, a, nbytes, act):
        st = stats.setdefault(loc, collections.Counter())
        for w in range(nt // 32):
            ts = [t for t in range(32 * w, 32 * w + 32) if act[t]]
            if not ts:
                continue
            words = collections.defaultdict(set)
            for t in ts:
                for k in range(0, nbytes, 4):
                    wd = (a[t] + k) // 4
                    words[wd % 32].add(wd)
            tot = nbytes * len(ts)
            ideal = -(-tot // 128)
            st[kind + "_B"] += tot
            st[kind + "_ideal"] += ideal
            st[kind + "_wf"] += max(ideal, max(len(s) for s in words.values()))

    for raw in body.splitlines():
        s = raw.strip()
        if re.match(r"^\$\w+:", s):
            seen_labels.add(s[:-1])
            continue
        if s.startswith(".loc"):
            m = re.search(r"//\s*(.*)$", s)
            ms = re.findall(r"(\w+\.py:\d+)", m[1] if m else s)
            loc = (ms[-1] + (" <- " + ms[0] if len(ms) > 1 else "")) if ms else s
            continue
        if not s or s.startswith((".", "//", "}", "{")):
            continue
        s = s.rstrip(";")
        act = [True] * nt
        m = re.match(r"@(!?)(%p\d+)\s+(.*)", s)
        if m:
            p = R.get(m[2], [0] * nt)
            act = [(not v) if m[1] else bool(v) for v in p]
            s = m[3]
        op, _, args = s.partition(" ")
        ops = [a.strip() for a in re.split(r",(?![^{\[]*[}\]])", args)] if args.strip() else []
        base = op.split(".")[0]

        def put(name, vals):
            old = R.get(name, [0] * nt)
            R[name] = [v if a else o for v, a, o in zip(vals, act, old)]

        def clobber(tok):
            for d in re.findall(r"%\w+", tok):
                put(d, [0] * nt)
        if base == "bra":
            target = ops[0] if ops else ""
            if target in seen_labels and target in labels:
                raise ValueError("backward branch (a loop): per-line counts would be per iteration")
            continue
        if base in ("ld", "st") and ".global" in op:
            vec = re.search(r"\.v(\d)", op)
            nb = (int(vec[1]) if vec else 1) * _bits(op) // 8
            stats.setdefault(loc, collections.Counter())[("ldg" if base == "ld" else "stg") + "_B"] += nb * nt
            if base == "ld":
                clobber(ops[0])
            continue
        if base in ("ld", "st") and ".shared" in op:
            vec = re.search(r"\.v(\d)", op)
            nb = (int(vec[1]) if vec else 1) * _bits(op) // 8
            record("lds" if base == "ld" else "sts", addr(ops[1] if base == "ld" else ops[0]), nb, act)
            if base == "ld":
                clobber(ops[0])
            continue
        if base in ("ldmatrix", "stmatrix"):
            x = int(re.search(r"\.x(\d)", op)[1])       # lanes 0 .. 8x-1 give the 16-byte row addresses
            record(base, addr(ops[1] if base == "ldmatrix" else ops[0]), 16,
                   [a and lanes[t] < 8 * x for t, a in enumerate(act)])
            if base == "ldmatrix":
                clobber(ops[0])
            continue
        if base == "shfl":
            stats.setdefault(loc, collections.Counter())["shfl"] += nt // 32
            a, b = get(ops[1]), get(ops[2])
            mode = op.split(".")[2]
            src = []
            for t in range(nt):
                ln, k = lanes[t], b[t]
                j = {"idx": k & 31, "bfly": ln ^ k, "up": ln - k if ln - k >= 0 else ln,
                     "down": ln + k if ln + k < 32 else ln}[mode]
                src.append(a[t - ln + j])
            put(ops[0].split("|")[0], src)
            continue
        if not ops:
            continue
        dst, b = ops[0], _bits(op)
        if base == "mov":
            put(dst, get(ops[1]))
        elif base == "setp":
            cmp = op.split(".")[1][:2]
            x, y = get(ops[1]), get(ops[2])
            if ".s" in op:
                x, y = [signed(v, b) for v in x], [signed(v, b) for v in y]
            f = {"eq": lambda p, q: p == q, "ne": lambda p, q: p != q, "lt": lambda p, q: p < q,
                 "le": lambda p, q: p <= q, "gt": lambda p, q: p > q, "ge": lambda p, q: p >= q}.get(cmp)
            put(dst.split("|")[0], [int(f(p, q)) if f else 0 for p, q in zip(x, y)])
        elif base == "selp":
            p = R.get(ops[3], [0] * nt)
            put(dst, [x if c else y for x, y, c in zip(get(ops[1]), get(ops[2]), p)])
        elif op.endswith(".pred") and base in ("and", "or", "xor", "not"):
            x = get(ops[1])
            y = get(ops[2]) if len(ops) > 2 else x
            f = {"and": lambda p, q: p and q, "or": lambda p, q: p or q, "xor": lambda p, q: p != q,
                 "not": lambda p, q: not p}[base]
            put(dst, [int(bool(f(bool(p), bool(q)))) for p, q in zip(x, y)])
        elif base in ("add", "sub", "mul", "mad", "and", "or", "xor", "shl", "shr", "max", "min", "not", "neg") \
                and not re.search(r"\.f(16|32|64)|\.bf16", op):
            x = get(ops[1])
            y = get(ops[2]) if len(ops) > 2 else x
            if ".s" in op and base in ("shr", "max", "min"):
                x, y = [signed(v, b) for v in x], [signed(v, b) for v in y]
            z = get(ops[3]) if base == "mad" else [0] * nt
            f = {"add": lambda p, q, r: p + q, "sub": lambda p, q, r: p - q, "mul": lambda p, q, r: p * q,
                 "mad": lambda p, q, r: p * q + r, "and": lambda p, q, r: p & q, "or": lambda p, q, r: p | q,
                 "xor": lambda p, q, r: p ^ q, "shl": lambda p, q, r: p << q, "shr": lambda p, q, r: p >> q,
                 "max": lambda p, q, r: max(p, q), "min": lambda p, q, r: min(p, q), "not": lambda p, q, r: ~p,
                 "neg": lambda p, q, r: -p}[base]
            ob = 64 if ".wide" in op else b
            put(dst, [f(p, q, r) & MASK.get(ob, MASK[64]) for p, q, r in zip(x, y, z)])
        elif base == "bfe":
            put(dst, [(v >> q) & ((1 << n) - 1) for v, q, n in zip(get(ops[1]), get(ops[2]), get(ops[3]))])
        elif base == "cvt" and not re.search(r"\.f(16|32|64)|\.bf16|\.tf32", op):
            put(dst, [v & MASK.get(b, MASK[64]) for v in get(ops[1])])
        else:                                           # floating point, mma, wgmma, barriers...: values not tracked
            clobber(dst)
    return stats, nt


def table(stats, nt, title):
    """Markdown rows per source line, and the totals."""
    cols = ("shared stored B", "shared loaded B", "wavefronts ideal", "wavefronts simulated", "shfl",
            "ld.global B", "st.global B")
    out = [f"{title} ({nt // 32} warps; per program)", "", "| source line | " + " | ".join(cols) + " |",
           "|---" * (len(cols) + 1) + "|"]
    tot = collections.Counter()
    for loc, c in stats.items():
        row = (c["sts_B"] + c["stmatrix_B"], c["lds_B"] + c["ldmatrix_B"], sum(c[k + "_ideal"] for k in KINDS),
               sum(c[k + "_wf"] for k in KINDS), c["shfl"], c["ldg_B"], c["stg_B"])
        if any(row):
            out.append(f"| {loc} | " + " | ".join(str(v) for v in row) + " |")
            tot.update(dict(zip(cols, row)))
    out.append("| total | " + " | ".join(str(tot[c]) for c in cols) + " |")
    out.append(f"\nL1/shared wavefronts (simulated shared + shuffles): "
               f"{tot['wavefronts simulated'] + tot['shfl']}")
    return "\n".join(out), tot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*", help="AOT registrations (linattn.runtime.aot.kernels())")
    ap.add_argument("--ptx", nargs="*", default=[], help="PTX files instead")
    a = ap.parse_args()
    sources = [(p, open(p).read()) for p in a.ptx]
    if a.names:
        if os.environ.get("TRITON_INTERPRET"):
            sys.exit("unset TRITON_INTERPRET: the AOT builds compile with the real Triton")
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from linattn.runtime import aot
        for n in a.names:
            sources.append((n, aot.compile_kernel(aot.kernels()[n], "sm_90a").asm["ptx"]))
    for name, ptx in sources:
        stats, nt = simulate(ptx)
        print(table(stats, nt, name)[0], end="\n\n")


if __name__ == "__main__":
    main()
