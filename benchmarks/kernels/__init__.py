"""Kernel benchmarks (pdserve_kernels on a GPU): timing helpers, the per-head baseline, one module per kernel family."""
