"""AOT registrations of every GDN kernel, for `linattn inspect` (linattn/runtime/aot.py imports this module):
the Triton stages (triton/aot.py), the Gluon kernels (gluon/aot.py) and the decode kernels (decode_aot.py)."""
from linattn.ops.gated_delta_rule.triton.aot import *  # noqa: F401,F403
from linattn.ops.gated_delta_rule.gluon.aot import *  # noqa: F401,F403
from linattn.ops.gated_delta_rule.decode_aot import *  # noqa: F401,F403
