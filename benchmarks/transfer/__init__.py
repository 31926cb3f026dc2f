"""KV transfer benchmarks (NIXL between processes / devices)."""
