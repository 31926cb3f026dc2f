"""A free list of block ids: the token, window and state spaces' pool (block_manager.py), and the
prefix cache's and checkpoints' interface (prefix_cache.py, prefix_checkpoints.py). No torch."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list of block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        self.num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def take(self) -> int:
        block = self._free.popleft()
        self._used.add(block)
        return block

    def give_back(self, block: int, owner: str) -> None:
        if block not in self._used:
            raise RuntimeError(f"{owner}: block {block} freed twice")
        self._used.remove(block)
        self._free.appendleft(block)  # so a re-admitted sequence tends to get it back
