"""The host path of the Gluon GDN launches (linattn/runtime/host_path.py, as the matmul's): one HostPath for the
state pass (launcher.py) and the fused forward's launches (stage 2a, the fused kernels, the segment window kernel).

`launches(kernel, grid, args, kwargs)` keeps the compiled kernel per launch signature and launches later calls
through its handle; `fused_desc` builds per-call TensorDescriptors from a validated template per (shape, strides,
box, dtype): the layout, validation and dataclass construction were ~1/3 of an eager fused forward's host time.
`host_path.options(plan_cache=False, handle=False)` (a block, restored on exit) launches through the JIT with
descriptors built afresh: tests and gluon/hostsim.py compare the two paths' launches.
"""
from __future__ import annotations

import torch

from linattn.runtime.host_path import DescriptorFactory, HostPath, LaunchCache, PlanCache

host_path = HostPath(plan_cache=True, handle=True)
launches = LaunchCache(host_path)
_DESC_TEMPLATES = PlanCache(host_path)   # DescriptorFactory per (2-D view shape, strides, box, dtype)


_GL_DTYPES: dict = {}      # torch dtype -> Gluon dtype, filled at the first call (Gluon is imported at first use)


def gl_dtype(dtype: torch.dtype):
    gdt = _GL_DTYPES.get(dtype)
    if gdt is None:
        from linattn.runtime.gluon_compat import gl
        _GL_DTYPES.update({torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32})
        gdt = _GL_DTYPES[dtype]
    return gdt


def aligned(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a 16-byte aligned base; a view at an odd offset is copied (read-only operands only)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def fused_desc(cls, t2d: torch.Tensor, block, gdt):
    """TensorDescriptor.from_tensor(t2d, block, NVMMASharedLayout.get_default_for(block, gdt)) through the descriptor
    templates: the first descriptor of a (shape, strides, box, dtype) is built and validated by the constructor,
    later ones copy its fields and take this call's base. With the plan cache off, built afresh every call."""
    if host_path.plan_cache:
        factory = _DESC_TEMPLATES.peek((cls, tuple(t2d.shape), t2d.stride(), tuple(block), gdt))
        if factory is not None:
            return factory(t2d)
    from linattn.runtime.gluon_compat import gl
    if not host_path.plan_cache:
        return cls.from_tensor(t2d, block, gl.NVMMASharedLayout.get_default_for(block, gdt))
    shape, strides = t2d.shape, t2d.stride()      # as from_tensor passes them (a torch.Size, a tuple)
    factory = _DESC_TEMPLATES.get((cls, tuple(shape), strides, tuple(block), gdt), lambda: DescriptorFactory(
        cls, shape, strides, list(block), gl.NVMMASharedLayout.get_default_for(block, gdt), host_path))
    return factory(t2d)


def clear_desc_templates() -> None:
    """Forget the fused launches' descriptor templates."""
    _DESC_TEMPLATES.clear()
