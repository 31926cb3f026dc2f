"""Timing and checking helpers shared by the kernel benchmarks (bench*.py) and the kernel tests
(tests/helpers/kernels.py re-exports `poisoned_empty`)."""

from __future__ import annotations

import contextlib

import torch


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


@contextlib.contextmanager
def poisoned_empty():
    """Every torch.empty inside is filled with NaN (ints: a large sentinel; bytes 0xFF, NaN as
    e4m3 or ue8m0; bools: True), so an element a kernel fails to write shows up in the comparison."""
    orig = torch.empty

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.dtype == torch.bool:
            return t.fill_(True)
        return t.fill_(float("nan") if t.is_floating_point() else min(2**30 - 1, torch.iinfo(t.dtype).max))

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = orig


@contextlib.contextmanager
def compiled_kernels():
    """{kernel name: the CompiledKernel of its last launch} for every Triton launch inside, for
    a resource report (`n_regs`, `n_spills`, `metadata.shared`); empty under the interpreter."""
    from triton.runtime.jit import JITFunction

    seen: dict = {}
    orig = JITFunction.run

    def run(self, *args, **kwargs):
        kernel = orig(self, *args, **kwargs)
        seen[self.__name__] = kernel
        return kernel

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = orig


def ms(fn, rep: int = 60) -> float:
    """Median of `triton.testing.do_bench` (includes the Python + launch overhead)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=15, rep=rep, return_mode="median")


def graph_ms(calls, replays: int = 20) -> float:
    """Median time of one call, from CUDA-graph replays of `calls` (one per input set, so
    repeated runs do not hit a warm L2); no CPU launch overhead, as a decode step under graphs."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def kernel_profile(fn, label: str, top: int = 8) -> list[str]:
    """Per-kernel GPU time of fn (torch profiler, 5 calls), to see where a shape's time goes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    return [f"profile {label}: {e.key[:60]} {e.device_time_total / 5:.1f} us/call x{e.count // 5}" for e in evs]
