"""The ahead-of-time report of decode kernel builds for the decode variant tests (test_decode_kwarp.py,
test_decode_split_tail.py): compiles the named builds of fused_recurrent.aot_specs() for sm_90a in a child process
(outside the interpreter) and returns, per label, registers, spills, shared memory, the opcode counts of the tile
loop, the global/local memory opcodes of the whole kernel and the blocked layouts of the TTGIR."""
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


def tile_loop_lines(sass: str) -> list:
    """The SASS lines of a kernel's tile loop: from the label of its longest backward branch to that branch."""
    lines = sass.splitlines()
    labels = {l.strip().rstrip(":"): i for i, l in enumerate(lines) if re.match(r"^\.?L\w+:$", l.strip())}
    back = [(labels[m[1]], i) for i, l in enumerate(lines) for m in [re.search(r"BRA (\.?L\w+)", l)]
            if m and m[1] in labels and labels[m[1]] < i]
    s, e = max(back, key=lambda b: b[1] - b[0])
    return lines[s:e + 1]

_SCRIPT = r"""
import collections, json, re, sys
from triton.tools.disasm import get_sass
from linattn.runtime.aot import compile_kernel, ptxas_usage
from linattn.ops.gated_delta_rule.triton.fused_recurrent import aot_specs

sys.path.insert(0, sys.argv[2])             # tests/: the loop finder is this module's
from decode_aot import tile_loop_lines

def loop_ops(sass):
    # opcodes between the tile loop's label and its backward branch (the longest backward branch)
    ops = collections.Counter()
    for l in tile_loop_lines(sass):
        m = re.match(r"^\S+\s+(@!?U?P\w+\s+)?([A-Z][\w.]+)", l)
        if m and "@!PT" not in l:
            ops[m[2]] += 1
    return dict(ops)

want = json.loads(sys.argv[1])
out = {}
for s in aot_specs() + aot_specs(variants=True):
    if s.name not in want:
        continue
    k = compile_kernel(s, "sm_90a")
    regs, spills = ptxas_usage(k.asm["ptx"], "sm_90a")
    sass = get_sass(k.asm["cubin"])
    allops = collections.Counter(m[2] for m in re.finditer(r"^\S+\s+(@!?U?P\w+\s+)?([A-Z][\w.]+)", sass, re.M))
    blocked = re.findall(r"^#blocked\d* = (.*)$", k.asm["ttgir"], re.M)
    out[want[s.name]] = dict(regs=regs, spills=spills, smem=int(k.metadata.shared), loop=loop_ops(sass),
                             all={o: n for o, n in allops.items() if o.startswith(("LDG", "STG", "LDL", "STL"))},
                             blocked=blocked)
print(json.dumps(out))
"""


def decode_aot_report(want: dict) -> dict:
    """want: {AOT build name: label} -> {label: report}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(want), TESTS], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
