"""Hopper Gluon GEMM. Importing this package needs a Triton with Gluon; api.py imports it lazily."""
