"""The GPU gate's sections (benchmarks/gpu/gate.py runs each in a child process): one module per op family, the
shared run mode and helpers in base.py."""
