"""`linattn inspect KERNEL [--arch sm_90a|sm_80|sm_100a]`: compile a registered kernel ahead of time on this
machine (no GPU needed) and print registers, spill bytes, shared memory and SASS instruction counts, next to the
instructions the kernel is meant to contain. `linattn inspect --list` lists the registered kernels."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from linattn.runtime.aot import ARCHS, SASS_FAMILIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kernel", nargs="?", help="registered kernel name (see --list); 'all' compiles every one")
    parser.add_argument("--arch", choices=sorted(ARCHS), default=None,
                        help="target architecture (default: the kernel's first declared arch, usually sm_90a)")
    parser.add_argument("--list", action="store_true", help="list the registered kernels and exit")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--sass", action="store_true", help="also print every counted opcode, not only families")


def run(args) -> int:
    from linattn.runtime.aot import discovery_errors, inspect_kernel, kernels
    registry = kernels()
    if args.list or not args.kernel:
        for name, spec in sorted(registry.items()):
            print(f"{name:48s} {spec.language:6s} {','.join(spec.archs):14s} intends {','.join(spec.intended) or '-'}"
                  f"   {spec.description}")
        for mod, err in discovery_errors.items():
            print(f"(not loaded: {mod}: {err})")
        return 0 if registry else 1
    names = sorted(registry) if args.kernel == "all" else [args.kernel]
    unknown = [n for n in names if n not in registry]
    if unknown:
        print(f"unknown kernel {unknown[0]!r}; registered: {', '.join(sorted(registry))}")
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
            print(f"    {fams}")
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
