"""Programmatic dependent launch (PDL) of the Triton decode kernels (round 30): on a CUDA sm_90+ device with a Triton
that has gdc_wait and launch_pdl, the launcher sets the kernel's PDL constexpr (griddepcontrol.wait and
launch_dependents before the first global access) and the launch_pdl option (the launch attribute) together. On the
CPU: refused with a reason, and the interpreter path runs without it; ahead of time for sm_90a: the PDL builds carry
the attribute in their metadata and wait (ACQBULK) before every global memory instruction, the builds without PDL
have neither instruction. Opt-in (LINATTN_GDN_DECODE_PDL=1): round 30 on an H200 measured it flat at batch 1 and 32
and 0.3-0.8% slower at batch 256 (decode_inplace_round.py's pdl section, bit-equal results)."""
import re

import pytest
import torch

from decode_aot import tile_loop_lines                                   # tests/ is on sys.path
from linattn.ops.gated_delta_rule.triton import fused_recurrent as fr
from linattn.runtime.aot import kernel_asm, kernels
from linattn.runtime.settings import settings

MEM = re.compile(r"\b(LDG|STG|LDGSTS|ATOMG|RED)\b")


def test_pdl_refused_on_cpu_with_a_reason():
    q = torch.zeros(1, 1, 1, 8)
    why = fr.pdl_refusal(q)
    assert why is not None and ("interpreter" in why or "CUDA" in why)
    assert fr.decode_pdl(q) is False


def test_pdl_switch(monkeypatch):
    """Opt-in: round 30 measured it flat at batch 1 and 32 and slower at batch 256 on an H200."""
    monkeypatch.delenv("LINATTN_GDN_DECODE_PDL", raising=False)
    assert settings.gdn_decode_pdl is False
    for off in ("0", "off", "false"):
        monkeypatch.setenv("LINATTN_GDN_DECODE_PDL", off)
        assert settings.gdn_decode_pdl is False
    monkeypatch.setenv("LINATTN_GDN_DECODE_PDL", "1")
    assert settings.gdn_decode_pdl is True


def test_this_triton_has_pdl():
    """The pinned Triton (3.6.0) has both halves; a newer one without them would make pdl_refusal say so."""
    assert fr._gdc_wait is not None and fr._gdc_launch_dependents is not None
    assert fr._triton_has_launch_pdl()


@pytest.mark.parametrize("pdl,plain", [("gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk_pdl",
                                        "gdn_decode_persistent_fp32_bv64_w4_s3_prefetch_qk"),
                                       ("gdn_decode_bf16_bv32_w4_pdl", "gdn_decode_bf16_bv32_w4")])
def test_aot_pdl_waits_before_every_memory_access(pdl, plain):
    specs = kernels()
    assert specs[pdl].build()[3].get("launch_pdl") is True
    assert "launch_pdl" not in specs[plain].build()[3]
    sass = kernel_asm(pdl, "sass").splitlines()
    wait = [i for i, l in enumerate(sass) if "ACQBULK" in l]
    trigger = [i for i, l in enumerate(sass) if "PREEXIT" in l]
    mem = [i for i, l in enumerate(sass) if MEM.search(l)]
    assert len(wait) == 1 and len(trigger) == 1 and mem, (wait, trigger, len(mem))
    assert wait[0] < mem[0], "griddepcontrol.wait must come before the first global load or store"
    ptx = kernel_asm(pdl, "ptx")
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    base = kernel_asm(plain, "sass")
    assert "ACQBULK" not in base and "PREEXIT" not in base
    if "persistent" in pdl:
        # the tile loop itself is unchanged: same instruction count with and without PDL
        assert len(tile_loop_lines("\n".join(sass))) == len(tile_loop_lines(base))
