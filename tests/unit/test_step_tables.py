"""The step's tables built incrementally (engine/step_tables.py) against each table converted
whole, on sequences a real BlockManager with a window space runs through random prefill chunks,
decode steps, frees and re-admissions (the block table replaced, the numpy cache then stale)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_tables import block_array, block_rows, window_rows
from tests.helpers.kernels import seed_of


def _whole(rows: list[list[int]], width: int, pad: int) -> np.ndarray:
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : min(len(r), width)] = r[:width]
    return out


@pytest.mark.parametrize("bs,window", [(4, 8), (16, 40), (8, None)])
def test_incremental_tables_equal_the_whole_conversion(bs, window):
    rng = random.Random(seed_of("step_tables", bs, window))
    bm = BlockManager(4000, bs, window_tokens=window, num_window_blocks=4000 if window else 0)
    seqs = [Sequence(Request(request_id=f"r{i}", prompt_token_ids=[1] * 300)) for i in range(6)]
    for _ in range(400):
        seq = rng.choice(seqs)
        op = rng.random()
        if op < 0.08 and seq.block_table:  # preempted or finished: a fresh list next time
            bm.free(seq)
            seq.num_computed_tokens = 0
            continue
        n = seq.num_computed_tokens
        end = n + (rng.randint(1, 3 * bs) if op < 0.4 else 1)  # a prefill chunk or a decode step
        bm.allocate(seq, end, step_end=end)
        step = rng.sample(seqs, rng.randint(1, len(seqs)))
        step = [s for s in step if s.block_table] or [seq]
        width = max(len(s.block_table) for s in step)
        starts = [s.num_computed_tokens for s in step]
        assert np.array_equal(block_rows(step, width), _whole([s.block_table for s in step], width, 0))
        assert np.array_equal(
            window_rows(step, starts, width, window, bs), _whole([s.window_table for s in step], width, -1)
        )
        seq.num_computed_tokens = end
        if window:
            bm.trim_window(seq)


def test_a_table_changed_behind_the_cache_is_converted_again():
    seq = Sequence(Request(request_id="r", prompt_token_ids=[1]))
    seq.block_table += [5, 6, 7]
    assert block_array(seq).tolist() == [5, 6, 7]
    seq.block_table.pop()
    seq.block_table.append(9)  # same length, last entry changed
    assert block_array(seq).tolist() == [5, 6, 9]
    seq.block_table = [1, 2]
    assert block_array(seq).tolist() == [1, 2]
    seq.block_table += list(range(40))  # past the buffer's first size
    assert block_array(seq).tolist() == [1, 2, *range(40)]
