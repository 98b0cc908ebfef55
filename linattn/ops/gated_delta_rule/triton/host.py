"""The host path of the Triton chunk stages' launches (linattn/runtime/host_path.py, as the Gluon launches' and the
matmul's): stage 2a's kkt_solve_kernel and wu_kernel, the state pass and the output stage, for GDN and for KDA's
per-key-channel form. `launches(kernel, grid, args, kwargs)` keeps the compiled kernel per launch signature and
makes later launches through its handle instead of the JIT's binding and specialisation (~10 us a launch on this
project's CPU); under the interpreter there is no handle and every launch goes through the JIT. The launches it
makes directly are what a launch list (runtime/launch_list.py) records.
`host_path.options(plan_cache=False, handle=False)` (a block, restored on exit) launches through the JIT: tests
compare the two paths' launches."""
from linattn.runtime.host_path import HostPath, LaunchCache

host_path = HostPath(plan_cache=True, handle=True)
launches = LaunchCache(host_path)
