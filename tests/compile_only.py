"""A stand-in Triton driver for the CPU tests that drive a Gluon launcher's real JIT path (binder, specialisation,
compile) for sm_90a: it reports an sm_90a target and device 0 and is never asked to launch (the tests call
kernel.warmup). Used by the `jit` child processes of the Gluon test files."""
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


class CompileOnlyDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def use_compile_only_sm90_driver():
    driver.set_active(CompileOnlyDriver())
