"""Hopper (sm_90a) Gluon kernels of the GDN forward's state pass, behind the "gluon" backend.

Importing this package needs nothing from Gluon: the kernel modules import Gluon names through
linattn.runtime.gluon_compat and define their kernels only when GLUON_OK; backend.py imports them lazily.
"""
