"""A stand-in for a Triton kernel that a launcher reaches through a module attribute: `spy_grids` replaces it by one
that records the grid of each launch `kernel[grid](...)` and launches the real kernel (tests prove which kernel ran)."""


class _GridSpy:
    """`spy[grid]` records the grid and returns the real kernel's launcher; every other attribute is the real
    kernel's."""
    def __init__(self, real, grids: list):
        self._real, self._grids = real, grids

    def __getitem__(self, grid):
        self._grids.append(grid)
        return self._real[grid]

    def __getattr__(self, name):
        return getattr(self._real, name)


def spy_grids(monkeypatch, module, kernel_name: str) -> list:
    """Replace module.<kernel_name> by a stand-in recording the grid of each launch; returns the list of grids."""
    grids = []
    monkeypatch.setattr(module, kernel_name, _GridSpy(getattr(module, kernel_name), grids))
    return grids
