"""Hopper (sm_90a) Gluon kernels of the GDN "gluon" backend (the fused forward, stage 2a, the state passes of the
backward) and of the Gluon decode.

Importing this package needs nothing from Gluon: the kernel modules import Gluon names through
linattn.runtime.gluon_compat and define their kernels only when GLUON_OK; backend.py imports them lazily.
"""
