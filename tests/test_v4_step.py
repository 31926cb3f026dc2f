"""V4Step's indices (pdserve/model/v4_step.py) against a key buffer built by hand: every row
labelled with what it holds, each query's indices must name exactly the keys it may read."""

from __future__ import annotations

import random

import torch

from pdserve.model.v4_step import visible_entries, window_rows


def _buffer(starts: list[int], lens: list[int], window: int, rate: int) -> list[tuple]:
    """Row labels of the step's key buffer: ("pos", b, p) window records and new kv, ("entry", b, e)."""
    rows = [("pos", b, p) for b, n in enumerate(starts) for p in range(n - min(n, window - 1), n)]
    rows += [("pos", b, n + i) for b, (n, ln) in enumerate(zip(starts, lens)) for i in range(ln)]
    return rows + [("entry", b, e) for b, (n, ln) in enumerate(zip(starts, lens)) for e in range((n + ln) // rate)]


def test_indices_name_exactly_the_keys_each_query_may_read():
    rng = random.Random(0)
    for _ in range(30):
        B, window, rate = rng.randint(1, 4), rng.randint(1, 9), rng.choice([1, 2, 4, 16])
        starts = [rng.choice([0, 1, 3, window, 4 * window + 1, rng.randint(0, 70)]) for _ in range(B)]
        lens = [rng.randint(1, 12) for _ in range(B)]
        labels = _buffer(starts, lens, window, rate)
        base = sum(min(n, window - 1) for n in starts) + sum(lens)
        queries = [(b, n + i) for b, (n, ln) in enumerate(zip(starts, lens)) for i in range(ln)]
        positions = torch.tensor([p for _, p in queries])
        s, ln = torch.tensor(starts), torch.tensor(lens)
        win, vis = window_rows(positions, s, ln, window), visible_entries(positions, s, ln, rate)
        assert win.dtype == vis.dtype == torch.int32 and win.shape == (len(queries), window)
        for t, (b, p) in enumerate(queries):
            got = [labels[r] for r in win[t].tolist() if r >= 0]
            assert got == [("pos", b, q) for q in range(max(0, p - window + 1), p + 1)]  # ascending
            got = sorted(labels[base + r] for r in vis[t].tolist() if r >= 0)
            assert got == [("entry", b, e) for e in range((p + 1) // rate)]
