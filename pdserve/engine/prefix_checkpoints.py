"""Prefix caching for pools with a sliding window and per-sequence state (DeepSeek-V4): what a
hit must restore besides the token blocks, kept at cached block boundaries. No torch.

At a block boundary B (a multiple of every compressor rate: no group is pending) a sequence's
token blocks hold its compressed entries and indexer keys, but two things live elsewhere: the
window records of positions [B - K, B) (K = the window regions' last_tokens, W - 1; window
space, freed as the sequence moves on) and the compressors' state at B (state space; only the
CSA overlap part matters there, the pending part is empty). A checkpoint is a copy of both, in
window blocks and a state slot of its own, made when a sequence's computed tokens end exactly at
B (a decode step, or a prefill chunk: the scheduler ends one at the prompt's last full block,
`cut`), named by the hash of the block that ends at B. A hit stops at the deepest boundary with a
checkpoint; the sequence gets fresh window blocks and a state slot with the checkpoint's records
copied in. Records are never recomputed: a recomputed token's window would reach further back
than the pool keeps.

The copies are queued (`copies`, (space, src, dst) triples, oldest first) and the engine has the
runner do them before the next forward, while every source still holds what it held when the
copy was queued (freed blocks are only overwritten by a forward).

Checkpoints have their own capacity, reserved in the window and state spaces beside the
sequences' (`capacity` checkpoints), and are evicted least recently used among themselves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.model.kv_cache import STATE, WINDOW, KVRegionSpec

if TYPE_CHECKING:
    from pdserve.engine.block_pool import BlockPool
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sequence import Sequence


def blocks_reusable(config: EngineConfig, specs: list[KVRegionSpec]) -> bool:
    """Whether a token block's records can be reused whole: prefix caching is on and every
    token-space rate divides the block size (no compressor group spans two blocks)."""
    rates = {s.tokens_per_record for s in specs if s.space not in (WINDOW, STATE)}
    return config.enable_prefix_caching and not any(config.kv_block_size % m for m in rates)


def checkpoint_capacity(config: EngineConfig, specs: list[KVRegionSpec]) -> int:
    """Checkpoints a pool with window and state regions keeps: max_num_seqs when its blocks are
    reusable; 0 otherwise (no caching), and on a decode worker (kv_consumer: its loads bring the
    window and state, its own prefills are recomputes of failed loads). With tensor parallelism
    every rank does the copies in its own pool (ModelRunner.copy_records)."""
    if config.kv_role == "kv_consumer":
        return 0
    if not {WINDOW, STATE} <= {s.space for s in specs} or not blocks_reusable(config, specs):
        return 0
    return config.max_num_seqs


def window_blocks_per_checkpoint(window_tokens: int, block_size: int) -> int:
    return -(-window_tokens // block_size)


@dataclass
class Checkpoint:
    first: int  # window-table index of window_blocks[0]
    window_blocks: list[int]
    state_slot: int


class Checkpoints:
    def __init__(self, capacity: int, window_tokens: int, block_size: int, window: BlockPool, states: BlockPool):
        self.capacity = capacity
        self.window_tokens = window_tokens  # K: a boundary keeps the records of its last K positions
        self.block_size = block_size
        self._window = window
        self._states = states
        self._by_hash: OrderedDict[bytes, Checkpoint] = OrderedDict()  # least recently used first
        self.copies: list[tuple[str, int, int]] = []
        # what the checkpoints hold (counters: stats are read from other threads while steps run)
        self.num_window_blocks = 0
        self.num_state_slots = 0

    def _span(self, boundary: int) -> range:
        """Window-table indices holding positions [boundary - K, boundary)."""
        return range(max(0, boundary - self.window_tokens) // self.block_size, boundary // self.block_size)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def save(self, seq: Sequence) -> None:
        """Checkpoint seq at its computed tokens' end, if that is a block boundary with a
        registered hash, no checkpoint yet, and every window record in place."""
        boundary, bs = seq.num_computed_tokens, self.block_size
        if boundary == 0 or boundary % bs or seq.state_slot < 0 or len(seq.block_hashes) < boundary // bs:
            return
        h = seq.block_hashes[boundary // bs - 1]
        span = self._span(boundary)
        if h in self._by_hash or span.stop > len(seq.window_table) or any(seq.window_table[i] < 0 for i in span):
            return
        if len(self._by_hash) >= self.capacity:
            self._evict()
        ckpt = Checkpoint(span.start, [self._window.take() for _ in span], self._states.take())
        self.copies += [(WINDOW, seq.window_table[i], b) for i, b in zip(span, ckpt.window_blocks)]
        self.copies.append((STATE, seq.state_slot, ckpt.state_slot))
        self._by_hash[h] = ckpt
        self.num_window_blocks += len(ckpt.window_blocks)
        self.num_state_slots += 1

    def restore(self, seq: Sequence, block_hash: bytes, boundary: int) -> None:
        """seq, whose first boundary // bs blocks are a hit ending at this checkpoint and which
        holds its state slot: fresh window blocks for the checkpoint's span, both copied in."""
        ckpt = self._by_hash[block_hash]
        self._by_hash.move_to_end(block_hash)
        table = seq.window_table
        table.extend([-1] * (boundary // self.block_size - len(table)))
        for i, src in enumerate(ckpt.window_blocks, ckpt.first):
            table[i] = self._window.take()
            self.copies.append((WINDOW, src, table[i]))
        self.copies.append((STATE, ckpt.state_slot, seq.state_slot))

    def window_blocks_for(self, boundary: int) -> int:
        return len(self._span(boundary))

    def take_copies(self) -> list[tuple[str, int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def _evict(self) -> None:
        _, ckpt = self._by_hash.popitem(last=False)
        self.num_window_blocks -= len(ckpt.window_blocks)
        self.num_state_slots -= 1
        for b in ckpt.window_blocks:
            self._window.give_back(b, "prefix checkpoint")
        self._states.give_back(ckpt.state_slot, "prefix checkpoint")
