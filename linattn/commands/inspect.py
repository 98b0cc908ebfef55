"""`linattn inspect KERNEL [--arch sm_90a|sm_80|sm_100a]`: compile a registered kernel ahead of time on this
machine (no GPU needed) and print registers, spill bytes, shared memory and SASS instruction counts, next to the
instructions the kernel is meant to contain. `linattn inspect --list` lists the registered kernels."""
from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import asdict

from linattn.runtime.aot import ARCHS, SASS_FAMILIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kernel", nargs="?", help="registered kernel name (see --list); 'all' compiles every one")
    parser.add_argument("--arch", choices=sorted(ARCHS), default=None,
                        help="target architecture (default: the kernel's first declared arch, usually sm_90a)")
    parser.add_argument("--list", action="store_true", help="list the registered kernels and exit")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--sass", action="store_true", help="also print every counted opcode, not only families")


WIDTH = 120          # every line `inspect --list` prints fits a 120-column terminal


def fit(line: str, width: int = WIDTH) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."


def list_lines(registry) -> list:
    """The `--list` table: name, language, whether a default path runs it, archs, intended SASS; each kernel's
    description wrapped below it, indented, to WIDTH columns."""
    w = max([len(n) for n in registry] + [6])
    rows = [f"{'kernel':<{w}} {'lang':<6} {'default':<7} {'archs':<14} intends"]
    for name, spec in sorted(registry.items()):
        rows.append(fit(f"{name:<{w}} {spec.language:<6} {'yes' if spec.default else 'no':<7} "
                        f"{','.join(spec.archs):<14} {','.join(spec.intended) or '-'}"))
        if spec.description:
            rows += textwrap.wrap(spec.description, WIDTH, initial_indent="    ", subsequent_indent="    ")
    return rows


def run(args) -> int:
    from linattn.runtime.aot import discovery_errors, inspect_kernel, kernels
    registry = kernels()
    if args.list or not args.kernel:
        for line in list_lines(registry):
            print(line)
        for mod, err in discovery_errors.items():
            print(fit(f"(not loaded: {mod}: {err})"))
        return 0 if registry else 1
    names = sorted(registry) if args.kernel == "all" else [args.kernel]
    unknown = [n for n in names if n not in registry]
    if unknown:
        print(f"unknown kernel {unknown[0]!r}; `linattn inspect --list` lists the {len(registry)} registered kernels")
        return 2
    status = 0
    for name in names:
        spec = registry[name]
        arch = args.arch or spec.archs[0]
        try:
            rep = inspect_kernel(spec, arch)
        except Exception as e:  # noqa: BLE001 - a compile error is the answer the user asked for
            print(f"{name} [{arch}]: compile failed: {e}")
            status = 1
            continue
        if args.json:
            print(json.dumps(asdict(rep)))
        else:
            fams = "  ".join(f"{f}={rep.families.get(f, 0)}" for f in SASS_FAMILIES)
            print(f"{name} [{arch}]  warps={rep.num_warps}  regs={rep.regs}  spill_bytes={rep.spill_bytes}  "
                  f"smem={rep.smem} B")
            print("\n".join(textwrap.wrap(fams, WIDTH, initial_indent="    ", subsequent_indent="    ")))
            if args.sass:
                for op, n in rep.sass.items():
                    print(f"    {op:40s} {n}")
        problems = []
        if rep.missing:
            problems.append(f"intended instructions missing: {', '.join(rep.missing)}")
        if rep.spill_bytes:
            problems.append(f"{rep.spill_bytes} bytes spilled")
        for p in problems:
            print(f"    WARNING: {p}")
        status = status or (1 if problems else 0)
    return status
