"""A stand-in for a kernel module that a launcher reaches through a module attribute (backward.py's `wy_v2`,
`local_v2`): every attribute is the real module's, except one kernel whose launches `kernel[grid](*args, **kw)`
are recorded (the value of one keyword, K by default) before the real kernel runs. Shared by the backward v2 tests."""


class ModuleSpy:
    def __init__(self, module, kernel_name: str, calls: list, record: str = "K"):
        self._module, self._kernel_name, self._calls, self._record = module, kernel_name, calls, record

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if name != self._kernel_name:
            return attr
        calls, record = self._calls, self._record

        class _Launch:
            def __getitem__(self, grid):
                def run(*a, **kw):
                    calls.append(kw[record])
                    return attr[grid](*a, **kw)
                return run
        return _Launch()


def spy_kernel(monkeypatch, owner, module_attr: str, kernel_name: str, record: str = "K") -> list:
    """Replace owner.<module_attr> by a ModuleSpy recording launches of its kernel `kernel_name`; returns the list
    the recorded values go to."""
    calls = []
    monkeypatch.setattr(owner, module_attr, ModuleSpy(getattr(owner, module_attr), kernel_name, calls, record))
    return calls
