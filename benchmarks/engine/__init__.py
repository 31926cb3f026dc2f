"""Engine benchmarks below `pdserve bench-engine` (single kernels inside one step)."""
