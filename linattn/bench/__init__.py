"""Benchmarking and gating: op registry (inputs, FLOPs, bytes, peers), shape presets, timing (each backend in
fresh child processes, alternated), roofline ceilings, environment line, tables and plots, and the per-op
correctness gates that `verify` runs first.

Used by `linattn bench`, `linattn verify` and `linattn doctor`; nothing here is imported by the ops."""
