"""Where a decode step's time outside kernels goes: `pdserve bench-engine`'s rows with
`ModelRunner.run`'s phases timed on the host clock - `prepare` (the step's inputs from the
scheduler's lists), the CUDA-graph runner's `fits` and `fill` (host work and the copies it
enqueues), the replay (the device synchronized before and after: the graph's own time, its launch
gaps included), the sampling (`Sampler.draw`, synchronized), the tokens' read
(`LaunchedStep.read`), and the whole `run`. The phases'
sum against `run` and the replay against the row's profiled kernel time split the bench's
"launch gaps" column into host work and gaps inside the graph.

    python -m benchmarks.engine.host_phases --model v4-flash --num-layers 4 --dtype fp4 \
        --batch-sizes 1,16,128 --long-context 0 --profile-steps 1

Takes every `bench-engine` flag. The synchronizations it adds make the timed steps slightly
slower than the bench's own; compare phases with each other, not with the bench's step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from pdserve.bench.engine import cli
from pdserve.engine import cuda_graphs, launched_step, model_runner, sampler

PHASES: dict[str, list[float]] = defaultdict(list)


def _timed(owner: type, name: str, sync: bool = False) -> tuple[type, str, object]:
    """Replace owner.name by a wrapper that adds its milliseconds to PHASES[name]; returns what
    to put back."""
    fn = getattr(owner, name)

    def wrapped(*a, **kw):
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        PHASES[name].append(1e3 * (time.perf_counter() - t0))
        return out

    setattr(owner, name, wrapped)
    return owner, name, fn


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_args(p)
    args = p.parse_args(argv)
    runner, graphs = model_runner.ModelRunner, cuda_graphs.CudaGraphRunner
    originals = [
        _timed(runner, "prepare"),
        _timed(sampler.Sampler, "draw", sync=True),
        _timed(launched_step.LaunchedStep, "read", sync=True),
        _timed(runner, "run", sync=True),
        _timed(graphs, "fits"),
        _timed(graphs, "fill"),
        _timed(graphs, "replay", sync=True),
    ]
    row, phases = cli._row, {}

    def row_with_phases(bench, a, batch: int, context: int, roof: dict) -> dict:
        PHASES.clear()
        out = row(bench, a, batch, context, roof)
        phases[batch, context] = {k: statistics.median(v) for k, v in PHASES.items()}
        kernels = out.get("profile", {}).get("kernel_ms")
        shown = ", ".join(f"{k} {v:.3f}" for k, v in phases[batch, context].items())
        print(f"B={batch} context={context}: phases (median ms) {shown}; profiled kernels {kernels}", flush=True)
        return out

    cli._row = row_with_phases
    try:
        report = cli.run(args)
    finally:
        cli._row = row
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return {"report": report, "phases": {f"{b}x{c}": v for (b, c), v in phases.items()}}


if __name__ == "__main__":
    main()
