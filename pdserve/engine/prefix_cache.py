"""Automatic prefix caching (vLLM's name): full KV blocks found again by a hash chain of their
tokens, shared by reference count, kept after their requests end and evicted least recently used
only when the pool needs the room. No torch.

A block's hash names everything its records depend on: the tokens before it (its parent's hash),
its own tokens, and what else changes the records (the root: model, dtype, KV record format,
block size). hash_0 = sha256(root || tokens[0:bs]), hash_i = sha256(hash_{i-1} || tokens[i*bs:
(i+1)*bs]), token ids as int64 little-endian. Only full blocks are hashed: a partly filled block
is still being written.

A block of the pool is in one of three states:

    free       no hash, no owner                 -> take()
    used       ref >= 1 (sequences, PD leases)   -> give_back(): ref - 1; at 0 it is free, or
                                                    cached when it has a hash
    cached     a hash, ref 0, kept for a hit     -> share() on a hit (used again), or evicted by
                                                    take() (oldest first) when no block is free

A block held for a decode peer under a PD lease stays referenced by its sequence until the lease
ends, so it is never evicted. A hit is the longest run of cached blocks at the start of the
sequence, and always leaves its last token to compute (its logits give the next token): at most
(num_tokens - 1) // bs blocks. The step then computes from the hit's end with the hit blocks as
context, as a later chunk of a chunked prefill does.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.prefix_checkpoints import blocks_reusable

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sequence import Sequence

HASH_VERSION = "pdserve-prefix-v1"


def root_hash(*identity: object) -> bytes:
    """The chain's root: what besides the tokens fixes a block's records (model_identity)."""
    return hashlib.sha256("|".join(map(str, (HASH_VERSION, *identity))).encode()).digest()


def model_identity(config: EngineConfig) -> tuple:
    """What an engine's records depend on besides the tokens: the weights (checkpoint, their
    format, dummy weights' seed), the compute dtype, the KV record format and the block size."""
    seed = config.seed if config.load_format == "dummy" else None
    return (
        os.path.realpath(config.model), config.load_format, seed, config.quantization,
        config.resolved_dtype(), config.kv_cache_dtype, config.kv_block_size,
    )  # fmt: skip


def engine_root(config: EngineConfig, runner) -> bytes | None:
    """An engine's hash root; None when caching is off or blocks are not reusable whole, and for
    pools with a window or state space that keep no checkpoints (prefix_checkpoints.py), except
    on a decode worker (kv_consumer), whose loads bring the window and state."""
    side = runner.window_tokens is not None or runner.num_state_slots
    if not blocks_reusable(config, list(runner.kv_cache.specs.values())):
        return None
    if side and not runner.num_checkpoints and config.kv_role != "kv_consumer":
        return None
    return root_hash(*model_identity(config))


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a block holding `tokens` after the block hashed `parent` (or the root)."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256(parent + ids.tobytes()).digest()


def block_hashes(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """The hashes of every full block of token_ids, in order."""
    out: list[bytes] = []
    parent = root
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class CacheHit:
    blocks: list[int] = field(default_factory=list)  # cached block ids for the sequence's first blocks
    num_tokens: int = 0  # tokens they hold (len(blocks) * bs)
    num_cached_free: int = 0  # of them, blocks no sequence holds now (counted as free until shared)
    num_queried: int = 0  # tokens looked up (0: no lookup was made)
    num_window_blocks: int = 0  # window blocks its checkpoint needs (prefix_checkpoints.py)
    num_matched_tokens: int = 0  # tokens of the cached blocks found, before cut back to a usable one


NO_HIT = CacheHit()


class PrefixCache:
    """A block pool (BlockPool's interface: take, give_back, num_free, num_used) whose full blocks
    are kept by hash after they are freed."""

    def __init__(self, num_blocks: int, block_size: int, root: bytes) -> None:
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.root = root
        self._free: deque[int] = deque(range(num_blocks))
        self._ref: dict[int, int] = {}  # used blocks -> references
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref-0 blocks with a hash, oldest first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them, found cached (prefix_cache_hits)

    # -- the pool --
    @property
    def num_free(self) -> int:
        """Blocks a take() can return: free ones and cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._ref)

    @property
    def num_cached(self) -> int:
        """Cached blocks no sequence holds (kept for a hit, evictable): counted in num_free."""
        return len(self._cached)

    def take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently used cached block
            block, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._ref[block] = 1
        return block

    def give_back(self, block: int, owner: str) -> None:
        ref = self._ref.get(block)
        if ref is None:
            raise RuntimeError(f"{owner}: block {block} freed twice")
        if ref > 1:
            self._ref[block] = ref - 1
            return
        del self._ref[block]
        if block in self._hash_of:
            self._cached[block] = None  # the most recently used end
        else:
            self._free.appendleft(block)

    def share_block(self, block: int) -> None:
        """One more holder of a used block (BlockPool.share_block: a forked sequence's shared prompt)."""
        self._ref[block] += 1

    # -- hits --
    def lookup(
        self, seq: Sequence, usable: Callable[[bytes], bool] | None = None, num_loaded: int | None = None
    ) -> CacheHit:
        """The longest run of cached blocks at the start of seq's tokens, leaving its last token
        to compute, cut back to the deepest block whose hash is `usable` (None: any). num_loaded:
        a decode worker's prompt of that many tokens, whose KV is loaded: any of its full blocks.
        Changes nothing (commit with share())."""
        limit = (seq.num_tokens - 1) // self.block_size if num_loaded is None else num_loaded // self.block_size
        hashes = self.hashes(seq, limit)
        blocks = []
        for h in hashes[:limit]:
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        matched = len(blocks) * self.block_size
        while usable is not None and blocks and not usable(hashes[len(blocks) - 1]):
            blocks.pop()
        cached_free = sum(1 for b in blocks if b not in self._ref)
        queried = seq.num_tokens if num_loaded is None else num_loaded
        return CacheHit(blocks, len(blocks) * self.block_size, cached_free, queried, 0, matched)

    def share(self, seq: Sequence, hit: CacheHit) -> None:
        """seq takes the hit's blocks (a reference each) as its first blocks, computed."""
        for block in hit.blocks:
            if block in self._ref:
                self._ref[block] += 1
            else:
                del self._cached[block]
                self._ref[block] = 1
        seq.block_table.extend(hit.blocks)
        seq.num_computed_tokens = hit.num_tokens
        seq.num_registered_blocks = len(hit.blocks)
        seq.prefix_junction = hit.num_matched_tokens

    def count(self, seq: Sequence, hit: CacheHit, report: bool = True) -> None:
        """Count a committed lookup; the request's first one is what it reports (report: a decode
        worker's does not: usage's cached tokens are the prefill's)."""
        if not hit.num_queried:
            return
        self.queries += hit.num_queried
        self.hits += hit.num_tokens
        if report and seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit.num_tokens

    # -- filling --
    def register(self, seq: Sequence) -> None:
        """Make seq's computed full blocks findable. A block whose hash another block already has
        stays unnamed (freed as a plain block): two requests that prefilled the same prefix at
        once keep the first one's."""
        n = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if seq.num_registered_blocks >= n:
            return
        hashes = self.hashes(seq, n)
        for i in range(seq.num_registered_blocks, n):
            block, h = seq.block_table[i], hashes[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h
        seq.num_registered_blocks = n

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq.block_hashes, extended to cover its first num_blocks blocks (all full)."""
        hashes, bs = seq.block_hashes, self.block_size
        parent = hashes[-1] if hashes else self.root
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, seq.tokens_between(i * bs, (i + 1) * bs))
            hashes.append(parent)
        return hashes
