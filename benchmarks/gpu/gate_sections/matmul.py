"""Gate sections matmul_triton and matmul_gluon: linattn's matmul against an fp32 product on ragged shapes, four
operand layouts, every Gluon config and the heuristic."""
from __future__ import annotations

import torch
from common import case_runner

from gate_sections import base


MATMUL_LAYOUTS = [("row", "row"), ("col", "col"), ("row", "col"), ("col", "row")]


def matmul_shapes(backend):
    """Ragged: no dimension a multiple of the 128/256/64 tiles. Gluon needs K and N (and M for a transposed A) to be
    multiples of 8 (16-byte TMA strides); Triton also gets odd sizes. (264, 136, 8200): 6 tiles and a long K, where
    the heuristic picks split-K; K = 72 and 8 leave split-K slices empty."""
    shapes = [(2000, 3000, 1000), (520, 776, 136), (8, 8, 8), (1, 256, 4096), (4096, 264, 72), (264, 136, 8200)]
    if backend == "triton":
        shapes += [(67, 45, 33), (1, 1, 1), (257, 131, 1029)]
    return shapes


def matmul_configs(backend):
    """(name, config) pairs every case runs: Triton its heuristic; Gluon every config of its table explicitly (the
    heuristic picks 128x128 on these small shapes and 128x256 on large ones), then the heuristic itself."""
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import CONFIGS
        return list(CONFIGS.items()) + [("heuristic", None)]
    return [("heuristic", None)]


def case_names(backend):
    n = sum(len(MATMUL_LAYOUTS) if dt == "bfloat16" else 2 for dt in ("bfloat16", "float16")) * len(
        matmul_shapes(backend))
    return [f"{n} (shape, dtype, layout) cases x {len(matmul_configs(backend))} configs", "matmul(backend=...)"]


def _operand(rows, cols, layout, dtype, gen):
    """A [rows, cols] operand, row-major ('row') or a transposed view of a [cols, rows] tensor ('col')."""
    if layout == "row":
        return torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    return torch.randn(cols, rows, generator=gen, device="cuda", dtype=torch.float32).to(dtype).T


def section(backend, save):
    """Each case into a NaN-filled out= twice: the plan's first call (through the JIT) and a second one (through the
    compiled handle the first kept), both against the fp32 product."""
    from linattn.backends import op_backends
    from linattn.ops.matmul import matmul
    from linattn.ops.matmul.api import check_inputs
    from linattn.testing import TOL
    if backend == "gluon":
        from linattn.ops.matmul.gluon.matmul import matmul_gluon as launch
    else:
        from linattn.ops.matmul.triton.matmul import matmul_triton as launch
    configs = matmul_configs(backend)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for (M, N, K) in matmul_shapes(backend):
            for la, lb in (MATMUL_LAYOUTS if dtype == torch.bfloat16 else MATMUL_LAYOUTS[:2]):
                a, b = _operand(M, K, la, dtype, gen), _operand(K, N, lb, dtype, gen)
                ref = a.float() @ b.float()
                fields = dict(M=M, N=N, K=K, dtype=str(dtype)[6:], layout=f"{la}/{lb}")
                check_inputs(a, b)
                ok, reason = op_backends("matmul").backends[backend].supports(a=a, b=b)
                if not ok:
                    cases.append(dict(fields, case=f"{M}x{N}x{K} {fields['dtype']} {la}/{lb}", passed=True,
                                      unsupported=reason))
                    continue
                for name, cfg in configs:
                    case = dict(fields, case=f"{M}x{N}x{K} {fields['dtype']} {la}/{lb} {name}", config=name)
                    try:
                        errs = []
                        for _ in range(2):
                            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
                            launch(a, b, out=out, config=cfg)
                            errs.append(base.rel(out, ref))
                        case.update(rel_rms=errs, cublas_rel_rms=base.rel(torch.matmul(a, b), ref), tol=TOL[dtype],
                                    passed=all(e <= TOL[dtype] for e in errs))
                    except Exception as e:  # noqa: BLE001
                        case.update(passed=False, error=f"{e!r}"[:600])
                    cases.append(case)
                save(dict(backend=backend, cases=cases, incomplete=True))
    run = case_runner(cases)

    def public():
        """matmul(backend=...) on an aligned problem, and the backend `auto` picks (Gluon on an sm_90 GPU)."""
        a = _operand(512, 512, "row", torch.bfloat16, gen)
        err = base.rel(matmul(a, a, backend=backend), a.float() @ a.float())
        return dict(rel_rms=err, auto_backend=op_backends("matmul").select("auto", a=a, b=a).name,
                    passed=err <= TOL[torch.bfloat16])
    run("matmul(backend=...)", public)
    return dict(backend=backend, cases=cases)
