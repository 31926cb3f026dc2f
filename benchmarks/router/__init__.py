"""Router benchmarks (the router against fake workers)."""
