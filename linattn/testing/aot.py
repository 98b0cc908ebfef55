"""Ahead-of-time compile checks of Triton kernels, shared by the tests that bound registers and spills.

`print_reports(specs, K, V)` runs in a child process without TRITON_INTERPRET (see the callers): each spec is
(name, jit_fn, signature without constexprs, constexprs, options); pointer arguments are declared 16-byte aligned
as the JIT would for torch allocations. Prints one JSON line per kernel: name, K, V, regs, spill_bytes, smem."""
import json


def print_reports(specs, K: int, V: int) -> None:
    from linattn.runtime.aot import AotKernel, compile_kernel, ptxas_usage
    for name, fn, sig, const, opts in specs:
        ptrs = tuple(n for n, t in sig.items() if t.startswith("*"))
        spec = AotKernel(name, lambda fn=fn, sig=sig, const=const, opts=opts: (
            fn, {**sig, **{c: "constexpr" for c in const}}, const, opts), language="triton", div16=ptrs)
        k = compile_kernel(spec, "sm_90a")
        regs, spills = ptxas_usage(k.asm["ptx"], "sm_90a")
        print(json.dumps(dict(name=name, K=K, V=V, regs=regs, spill_bytes=spills, smem=int(k.metadata.shared))))
