"""A free list of block ids: the token, window and state spaces' pool (block_manager.py), and the
prefix cache's and checkpoints' interface (prefix_cache.py, prefix_checkpoints.py). No torch."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list of block ids 0..num_blocks-1; a used block may have several holders (`share_block`:
    sequences forked from one prompt, engine/forks.py) and is free again when the last gives it back."""

    def __init__(self, num_blocks: int) -> None:
        self.num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: dict[int, int] = {}  # used block -> holders

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def take(self) -> int:
        block = self._free.popleft()
        self._used[block] = 1
        return block

    def share_block(self, block: int) -> None:
        """One more holder of a used block."""
        self._used[block] += 1

    def give_back(self, block: int, owner: str) -> None:
        holders = self._used.get(block)
        if holders is None:
            raise RuntimeError(f"{owner}: block {block} freed twice")
        if holders > 1:
            self._used[block] = holders - 1
            return
        del self._used[block]
        self._free.appendleft(block)  # so a re-admitted sequence tends to get it back
