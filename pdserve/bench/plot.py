"""Plots of one or more result files against concurrency: output throughput,
median TTFT and median TPOT, one line per run (labelled by file name)."""

from __future__ import annotations

import os
from typing import Any

PANELS = (
    ("output_throughput", "output throughput (tok/s)"),
    ("median_ttft_ms", "median TTFT (ms)"),
    ("median_tpot_ms", "median TPOT (ms)"),
)


def plot_runs(runs: list[tuple[str, dict[str, Any]]], out: str, title: str | None = None) -> None:
    """Write a PNG with one panel per metric; `runs` is [(label, results document)]."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    concurrencies = sorted({r["max_concurrency"] for _, doc in runs for r in doc["results"]})
    for ax, (key, label) in zip(axes, PANELS):
        top = 0.0
        for name, doc in runs:
            levels = sorted(doc["results"], key=lambda r: r["max_concurrency"])
            xs = [r["max_concurrency"] for r in levels if r.get(key) is not None]
            ys = [r[key] for r in levels if r.get(key) is not None]
            ax.plot(xs, ys, marker="o", label=name)
            top = max([top, *ys])
        ax.set_xlabel("concurrency")
        ax.set_xticks(concurrencies)
        ax.set_ylabel(label)
        ax.set_ylim(0, top * 1.1 or 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_label(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]
