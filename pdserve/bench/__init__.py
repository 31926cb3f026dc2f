"""Benchmark client, plots and PD advisor: `pdserve bench` (see cli.py)."""

from pdserve.bench.advisor import Verdict, advise
from pdserve.bench.cli import main

__all__ = ["Verdict", "advise", "main"]
