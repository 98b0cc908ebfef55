"""Every kernel in the AOT registry compiles for its first arch (sm_90a for Gluon) on this CPU host, contains the
instructions it is meant to (HGMMA, UTMALDG, SYNCS, ...), spills nothing and fits in shared memory.
Works with TRITON_INTERPRET=1 set: @gluon.jit ignores the interpreter, and plain Triton kernels are compiled in
a child process without it (linattn.runtime.aot)."""
import pytest

from linattn.runtime.aot import discovery_errors, inspect_kernel, kernels
from linattn.runtime.gluon_compat import gluon_status

SMEM_LIMIT_SM90 = 232448

_GLUON_OK, _GLUON_REASON, _ = gluon_status()
REGISTRY = kernels()


def test_registry_loaded():
    assert not discovery_errors, discovery_errors
    assert any(s.language == "gluon" for s in REGISTRY.values()) or not _GLUON_OK


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_kernel_compiles_with_intended_instructions(name):
    spec = REGISTRY[name]
    if spec.language == "gluon" and not _GLUON_OK:
        pytest.skip(_GLUON_REASON)
    rep = inspect_kernel(spec)
    assert spec.intended, f"{name} declares no intended instructions"
    assert not rep.missing, f"{name}: intended instructions missing from SASS: {rep.missing}; got {rep.sass}"
    # a known spill (the Triton backward's local and WY stages, benchmarks/BWD_PROFILE.md) may only shrink
    assert rep.spill_bytes <= spec.known_spill_bytes, \
        f"{name}: {rep.spill_bytes} bytes spilled ({rep.regs} registers), registered with {spec.known_spill_bytes}"
    if not spec.known_spill_bytes:
        assert rep.families["LDL"] == 0 and rep.families["STL"] == 0, f"{name}: local memory traffic {rep.sass}"
    if rep.arch == "sm_90a":
        assert rep.smem <= SMEM_LIMIT_SM90, f"{name}: {rep.smem} B of shared memory"
        # a tensor-core or TMA kernel stages its tiles in shared memory: 0 there means the report was not read
        if any(i in ("HGMMA", "UTMALDG", "HMMA") for i in spec.intended):
            assert rep.smem > 0, f"{name}: no shared memory reported"


def test_gluon_matmul_persistent_ws_shape():
    """The Gluon GEMM is warp-specialised (a 1-warp producer rounds the launch up a warpgroup) and issues
    TMA loads, WGMMA, a TMA store and mbarrier traffic."""
    if not _GLUON_OK:
        pytest.skip(_GLUON_REASON)
    rep = inspect_kernel(REGISTRY["matmul_gluon_128x256x64_s3_w8"])
    assert rep.num_warps == 12                       # 8 consumer warps + 1 producer warp, rounded to warpgroups
    assert rep.sass.get("HGMMA.64x256x16.F32.BF16", 0) > 0
    assert rep.families["UTMASTG"] >= 1 and rep.families["UTMALDG"] >= 2
    assert rep.sass.get("SYNCS.PHASECHK.TRANS64.TRYWAIT", 0) >= 2   # ready and empty waits


def test_inspect_command_runs(capsys):
    from linattn.cli import main
    assert main(["inspect", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in REGISTRY)
    assert "default" in listed.splitlines()[0]                        # the column marking default-path builds
    assert max(len(line) for line in listed.splitlines()) <= 120
    if _GLUON_OK:
        assert main(["inspect", "matmul_gluon_128x128x64_s5_w8"]) == 0
        out = capsys.readouterr().out
        assert "spill_bytes=0" in out and "HGMMA=" in out and "UTMALDG=" in out


@pytest.mark.parametrize("name", ["matmul_gluon_128x128x64_s5_w8_k2", "matmul_gluon_128x128x64_s5_w8_k4",
                                  "matmul_gluon_128x128x64_s5_w8_k4_tt_fp16"])
def test_gluon_matmul_split_k_writes_fp32_partials(name):
    """Split-K: the same mainloop (64x128 WGMMA per warpgroup), an fp32 [128,128] C buffer (64 KB) with 5 stages
    inside the budget, one TMA store per work unit, nothing spilled."""
    if not _GLUON_OK:
        pytest.skip(_GLUON_REASON)
    rep = inspect_kernel(REGISTRY[name])
    base = inspect_kernel(REGISTRY["matmul_gluon_128x128x64_s5_w8"])
    assert 0 <= rep.smem - base.smem - 128 * 128 * 2 <= 64, (base.smem, rep.smem)    # C buffer bf16 -> fp32
    assert rep.smem <= SMEM_LIMIT_SM90 and rep.spill_bytes == 0 and rep.num_warps == 12
    assert any(op.startswith("HGMMA.64x128x16.F32") for op in rep.sass), rep.sass
    assert rep.families["UTMASTG"] == 1 and rep.families["UTMALDG"] >= 2


def test_gluon_status_traces_under_torch_compile():
    """Backends ask gluon_status() (through runtime.device.hopper_gluon_ready) while `auto` picks a backend, which
    happens inside a model compiled with torch.compile(fullgraph=True). A decode gate on the H200 once failed
    both torch.compile cases: Dynamo traced through the lru_cache'd probe into globals(). Here the same call,
    compiled on the CPU."""
    import torch

    torch._dynamo.reset()

    def f(x):
        ok, reason, _ = gluon_status()
        return x + 1 if ok else x - 1

    out = torch.compile(f, fullgraph=True)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0 if _GLUON_OK else 0.0))


@pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
def test_sass_text_lists_the_whole_function():
    """sass_text (what inspect counts and prints) is triton's get_sass format, every instruction: for a kernel under
    64 KB of code the two agree line for line, and the listing ends with the function's trailing self-branch (get_sass
    cuts a listing at address 0x10000)."""
    from triton.tools.disasm import get_sass

    from linattn.runtime.aot import compile_kernel, sass_text
    k = compile_kernel(REGISTRY["gdn_bwd_dh_gluon_bf16_bv64_w4_s2"])
    text = sass_text(k.asm["cubin"])
    assert text.rstrip("\n") == get_sass(k.asm["cubin"]).rstrip("\n")
    insns = [ln.split("\t", 1)[1] for ln in text.splitlines() if "\t" in ln]
    assert sum(i.startswith("EXIT") for i in insns) >= 1 and any(i.startswith("HGMMA.64x64x16") for i in insns)
    last = [i for i in insns if not i.startswith("NOP")][-1]
    labels = [ln for ln in text.splitlines() if ln.startswith("LBB")]
    assert last.startswith("BRA LBB") and labels[-1] == last[4:-1] + ":"


@pytest.mark.skipif(not _GLUON_OK, reason=_GLUON_REASON)
def test_wgmma_operands_reads_the_descriptors_of_a_registered_kernel():
    """benchmarks/wgmma_operands.py on the forward state pass (BV 64): its 16 wgmma (W S over 128 and K^T (d Vnew)
    over 64, 8 k-steps each), every B operand's start resolved to a shared-memory offset inside the kernel's shared
    memory, the k-steps of W S 2048 bytes apart (16 rows of S's 64 bf16 columns), and both warpgroups on the same B
    (one warpgroup: the second's first thread is past the CTA, so the same offsets)."""
    import os
    import sys
    from linattn.runtime.aot import kernel_asm
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import wgmma_operands
    name = "gdn_state_gluon_wgmma_bf16_bv64_w4_s2"
    rows, _ = wgmma_operands.report(kernel_asm(name, "ptx"))
    assert len(rows) == 16 and all(shape.startswith("m64n64k16") for _, shape, _ in rows), rows
    smem = inspect_kernel(REGISTRY[name]).smem
    bs = [per[0][1] for _, _, per in rows]
    assert all(isinstance(b, int) and 0 <= b < smem for b in bs), bs
    assert [b - bs[0] for b in bs[:8]] == [2048 * s for s in range(8)], bs
    assert all(per[0][1] == per[1][1] for _, _, per in rows)


def test_compile_child_reports_a_failure_and_serves_on():
    """Under the interpreter, compiles go to one kept child process (runtime/aot.py _Child): a request that fails
    there raises here with the kernel's name and the child's traceback, and the same child answers the next one."""
    from linattn.runtime import aot
    if not aot._interpreting():
        pytest.skip("compiles run in this process when not interpreting")
    with pytest.raises(RuntimeError, match="(?s)AOT compile of no_such_kernel for sm_90a failed:.*KeyError"):
        aot._child_request("no_such_kernel", "sm_90a", None)
    child = aot._CHILD[0].proc
    name = "gdn_fwd_triton_state_bv16_w4"
    assert ".entry" in aot.kernel_asm(name, "ptx") and aot._CHILD[0].proc is child and child.poll() is None
