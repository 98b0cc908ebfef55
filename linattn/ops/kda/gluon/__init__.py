"""Hopper (sm_90a) Gluon kernels of KDA. Importing this package needs nothing from Gluon: the kernel modules define
their kernels only when linattn.runtime.gluon_compat.GLUON_OK."""
