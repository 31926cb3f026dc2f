"""Paged-KV block accounting: a free list of block ids and each sequence's block table. No torch.

A sequence with n tokens in the cache holds ceil(n / block_size) blocks, in order; token at
position p lives in slot block_table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so its table covers num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover num_tokens tokens (callers check can_allocate first)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"{seq.request_id}: needs {need} blocks, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            self._used.add(block)
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks (in reverse, so a re-admitted sequence tends to get them back)."""
        for block in reversed(seq.block_table):
            if block not in self._used:
                raise RuntimeError(f"{seq.request_id}: block {block} freed twice")
            self._used.remove(block)
            self._free.appendleft(block)
        seq.block_table = []
