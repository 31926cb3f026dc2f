"""A step's block and window tables as [B, width] int64 numpy, without converting every table's
Python ints every step (at B = 128 and a 4K context that conversion was ~0.5 ms of host time
before each replay; the tables' ints barely change from one step to the next).

- Block tables only grow while a sequence holds its blocks (`BlockManager.allocate` appends,
  `PrefixCache` extends) and `BlockManager.free` replaces the list: each sequence keeps its table
  as numpy in `seq.table_cache` and converts only what was appended since its last step.
- Window tables change in place (`trim_window` frees the blocks below the window), but a step
  reads window blocks of its chunk's last `window_tokens` positions only, and every block below
  those is already freed (-1) when the step runs (`allocate` trims first): only that tail is
  converted, the rest of the row is -1 as the table says.
"""

from __future__ import annotations

import numpy as np

from pdserve.engine.sequence import Sequence


def block_array(seq: Sequence) -> np.ndarray:
    """seq.block_table as int64 numpy (a view of seq.table_cache, valid until the next call)."""
    table, n = seq.block_table, len(seq.block_table)
    kept, buf, done = seq.table_cache or (None, None, 0)
    # the cache holds the first `done` entries of this very list, if the list only grew since
    if kept is not table or done > n or (done and buf[done - 1] != table[done - 1]):
        buf, done = np.empty(max(n, 16), dtype=np.int64), 0  # a new list (freed, re-admitted): all of it
    if n > buf.size:
        buf = np.concatenate([buf[:done], np.empty(max(n, 2 * buf.size) - done, dtype=np.int64)])
    if n > done:
        buf[done:n] = table[done:n]
    seq.table_cache = (table, buf, n)
    return buf[:n]


def block_rows(seqs: list[Sequence], width: int) -> np.ndarray:
    """[B, width] int64: each sequence's block table, 0 past its end (cut to width)."""
    out = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):  # a row at a time beats one masked scatter at every B (~1 us a row)
        row = block_array(s)[:width]
        out[i, : row.size] = row
    return out


def window_rows(
    seqs: list[Sequence], starts: list[int], width: int, window_tokens: int | None, block_size: int
) -> np.ndarray:
    """[B, width] int64: each sequence's window table from the block of position start -
    window_tokens on (-1 before it, where the table holds -1 too, and past its end)."""
    out = np.full((len(seqs), width), -1, dtype=np.int64)
    if window_tokens is None:
        return out
    for i, (s, start) in enumerate(zip(seqs, starts)):
        first = max(0, start - window_tokens) // block_size
        tail = s.window_table[first:width]
        out[i, first : first + len(tail)] = tail
    return out
