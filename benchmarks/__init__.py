"""Benchmarks of pdserve, beside the packages: run from the repository root as modules
(`python -m benchmarks.kernels.bench`); benchmarks/README.md lists them."""
