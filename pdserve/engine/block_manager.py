"""Paged-KV block accounting: free lists of block ids and each sequence's block tables. No torch.

A sequence with n tokens in the cache holds ceil(n / block_size) blocks, in order; token at
position p lives in slot block_table[p // block_size] * block_size + p % block_size.

Models with a sliding window (DeepSeek-V4) have a second block space, the window space, for the
regions of the pool that a later step reads only over the last `window_tokens` positions
(kv_cache.KVRegionSpec.last_tokens). A sequence's `window_table` is indexed like its block table
(entry i covers positions [i * bs, (i + 1) * bs)) but holds blocks only where a step writes or
will read: entries below the window are freed as the sequence advances (-1), so a sequence holds
at most ceil(window_tokens / bs) + 1 window blocks between steps, however long it gets.

Models with per-sequence state (DeepSeek-V4's compressors) have a third, the state space: one
slot per sequence (`state_slot`), taken with its first blocks and returned with them.

With prefix caching (prefix_root given) the token space is a PrefixCache (prefix_cache.py): a
sequence's first blocks may come from the cache (`lookup`, then `allocate(..., hit)`), and its
computed full blocks are kept by hash after it frees them (`cache_computed`). With a window or
state space too (DeepSeek-V4), a hit also needs a checkpoint of both at its end
(prefix_checkpoints.py): num_checkpoints of them, in window blocks and state slots reserved for them.
A decode worker's cache keeps none: a prompt whose KV is loaded reuses its cached full blocks
(`remote_hit`, `allocate_remote`: the load skips them) and gets its window and state by the load.

`fork` starts a sequence from another's computed tokens (n > 1, engine/forks.py): the blocks no
later step writes are shared (a holder more each), the rest copied, as are its window blocks and
state slot; the copies are done before the next forward, with the checkpoints' (`take_copies`).
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.prefix_cache import NO_HIT, CacheHit, PrefixCache
from pdserve.engine.prefix_checkpoints import Checkpoints
from pdserve.engine.sequence import Sequence
from pdserve.model.kv_cache import STATE, TOKENS, WINDOW

FREED = -1  # a window-table entry with no block (out of the window, or not yet written)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        window_tokens: int | None = None,
        num_window_blocks: int = 0,
        num_state_slots: int = 0,
        prefix_root: bytes | None = None,
        num_checkpoints: int = 0,
        record_span: int = 1,
    ) -> None:
        """window_tokens: the window regions' last_tokens (None: the pool has no window space).
        num_state_slots: slots of the state space (0: none). prefix_root: the prefix cache's
        hash root (prefix_cache.root_hash; None: no prefix caching). record_span: the most tokens
        one record of the token space pools (a compressor's rate; kv_cache.py)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        if window_tokens is not None and num_window_blocks < self.window_blocks_per_seq(window_tokens, block_size):
            raise ValueError(
                f"a window of {window_tokens} tokens needs at least {self.window_blocks_per_seq(window_tokens, block_size)} "
                f"window blocks of {block_size} tokens, got {num_window_blocks}"
            )
        self.block_size = block_size
        self.record_span = record_span
        self.num_total_blocks = num_blocks
        self._fork_copies: list[tuple[str, int, int]] = []
        self.prefix_cache = PrefixCache(num_blocks, block_size, prefix_root) if prefix_root is not None else None
        self._pool = self.prefix_cache or BlockPool(num_blocks)
        self.window_tokens = window_tokens
        self._window = BlockPool(num_window_blocks) if window_tokens is not None else None
        self._states = BlockPool(num_state_slots) if num_state_slots else None
        self.checkpoints: Checkpoints | None = None
        if self.prefix_cache is not None and num_checkpoints:
            self.checkpoints = Checkpoints(num_checkpoints, window_tokens or 0, block_size, self._window, self._states)

    @staticmethod
    def window_blocks_per_seq(window_tokens: int, block_size: int) -> int:
        """Window blocks one sequence may hold during a step: those it reads (the last
        window_tokens positions before the step) and those the step writes (its last
        window_tokens new positions), each a span of at most ceil(window_tokens / bs) + 1 blocks."""
        return 2 * (-(-window_tokens // block_size) + 1)

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks no sequence holds (in num_free_blocks, apart from num_used_blocks)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_cached

    @property
    def num_total_window_blocks(self) -> int:
        return 0 if self._window is None else self._window.num_total_blocks

    @property
    def num_used_window_blocks(self) -> int:
        """Window blocks sequences hold (not prefix checkpoints')."""
        held = self.checkpoints.num_window_blocks if self.checkpoints is not None else 0
        return 0 if self._window is None else self._window.num_used - held

    @property
    def num_total_state_slots(self) -> int:
        return 0 if self._states is None else self._states.num_total_blocks

    @property
    def num_used_state_slots(self) -> int:
        held = self.checkpoints.num_state_slots if self.checkpoints is not None else 0
        return 0 if self._states is None else self._states.num_used - held

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so its table covers num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def lookup(self, seq: Sequence) -> CacheHit:
        """The cached blocks a sequence with no blocks yet may start from (NO_HIT: none, or no cache;
        a pool with a window or state space only with checkpoints, which restore them)."""
        if self.prefix_cache is None or seq.block_table or seq.num_computed_tokens:
            return NO_HIT
        ckpts = self.checkpoints
        if ckpts is None:
            side = self._window is not None or self._states is not None
            return NO_HIT if side else self.prefix_cache.lookup(seq)
        hit = self.prefix_cache.lookup(seq, ckpts.has)
        return CacheHit(**{**vars(hit), "num_window_blocks": ckpts.window_blocks_for(hit.num_tokens)})

    def remote_hit(self, seq: Sequence, num_tokens: int) -> CacheHit:
        """Decode: the cached full blocks at the start of a prompt of num_tokens whose KV a prefill
        worker sends (any of them: the window and state come with the load)."""
        if self.prefix_cache is None or seq.block_table:
            return NO_HIT
        return self.prefix_cache.lookup(seq, num_loaded=num_tokens)

    def allocate_remote(self, seq: Sequence, num_tokens: int, hit: CacheHit) -> None:
        """Decode: blocks for a loaded prompt of num_tokens (callers check can_allocate(seq,
        num_tokens, hit=hit) first): the hit's blocks first (seq.num_reused_blocks: the load skips
        them), fresh ones after, window blocks for its last window_tokens positions and a state
        slot. Computed tokens stay 0 until the load lands (Scheduler.on_loaded)."""
        if hit.num_queried:
            self.prefix_cache.share(seq, hit)
            self.prefix_cache.count(seq, hit, report=False)
        seq.num_reused_blocks = len(hit.blocks)
        seq.num_computed_tokens = 0  # the window blocks: all of the prompt's last window_tokens
        self.allocate(seq, num_tokens)

    def cache_computed(self, seq: Sequence) -> None:
        """Make seq's computed full blocks findable by later sequences (after each step)."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(seq)
        if self.checkpoints is not None:
            self.checkpoints.save(seq)

    def cut(self, seq: Sequence, start: int, n: int, junction: int = 0) -> int:
        """A chunk of n tokens from start, ended where a checkpoint is wanted when it crosses one:
        the junction (where its cached blocks end; default seq.prefix_junction) or the prompt's
        last full block."""
        if self.checkpoints is None:
            return n
        last = (seq.num_prompt_tokens - 1) // self.block_size * self.block_size
        for boundary in (junction or seq.prefix_junction, last):
            if start < boundary < start + n:
                return boundary - start
        return n

    def take_copies(self) -> list[tuple[str, int, int]]:
        """Record copies (space, src, dst) to do before the next forward (forks, prefix checkpoints)."""
        copies, self._fork_copies = self._fork_copies, []
        return copies + (self.checkpoints.take_copies() if self.checkpoints is not None else [])

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """child (no blocks yet) continues from parent's computed tokens: shares the blocks whose
        records are all written (every compressor group in them complete: a later step writes
        an entry into the block holding its group's first position) and gets copies of the
        rest, of parent's window blocks and of its state slot. False, taking nothing, when the
        pool is short of them."""
        computed = parent.num_computed_tokens
        span = max(self.block_size, self.record_span)
        num_shared = computed // span * span // self.block_size
        num_copied = self.blocks_for(computed) - num_shared
        window = [i for i, b in enumerate(parent.window_table) if b != FREED]
        if num_copied > self._pool.num_free:
            return False
        if window and len(window) > self._window.num_free:
            return False
        if parent.state_slot >= 0 and self._states.num_free == 0:
            return False
        for block in parent.block_table[:num_shared]:
            self._pool.share_block(block)
        child.block_table = parent.block_table[:num_shared]
        for src in parent.block_table[num_shared : num_shared + num_copied]:
            child.block_table.append(self._pool.take())
            self._fork_copies.append((TOKENS, src, child.block_table[-1]))
        child.window_table = [FREED] * len(parent.window_table)
        for i in window:
            child.window_table[i] = self._window.take()
            self._fork_copies.append((WINDOW, parent.window_table[i], child.window_table[i]))
        child.window_trimmed = (child.window_table, self._trimmed(parent))
        if parent.state_slot >= 0:
            child.state_slot = self._states.take()
            self._fork_copies.append((STATE, parent.state_slot, child.state_slot))
        child.num_computed_tokens = computed
        child.block_hashes = parent.block_hashes[: computed // self.block_size]
        child.num_registered_blocks = min(parent.num_registered_blocks, num_shared)
        child.num_cached_tokens = parent.num_cached_tokens
        return True

    def can_allocate(self, seq: Sequence, num_tokens: int, step_end: int | None = None, hit: CacheHit = NO_HIT) -> bool:
        """Blocks for num_tokens tokens, and window blocks for a step that computes the tokens
        from seq.num_computed_tokens to step_end (default num_tokens); hit: the cached blocks
        seq starts from (they are no longer free once it holds them)."""
        if self.blocks_needed(seq, num_tokens) - len(hit.blocks) > self._pool.num_free - hit.num_cached_free:
            return False
        if self._needs_state(seq) and self._states.num_free == 0:
            return False
        if self._window is None:
            return True
        free_now = len(self._out_of_window(seq))
        need = len(self._window_gaps(seq, step_end or num_tokens)) + hit.num_window_blocks
        return need <= self._window.num_free + free_now

    def allocate(self, seq: Sequence, num_tokens: int, step_end: int | None = None, hit: CacheHit = NO_HIT) -> None:
        """Grow seq's block table to cover num_tokens tokens and give it the window blocks the
        step up to step_end writes (callers check can_allocate first). hit: from lookup(seq),
        its blocks become seq's first ones, computed."""
        if self.prefix_cache is not None and hit.num_queried:
            self.prefix_cache.share(seq, hit)
            self.prefix_cache.count(seq, hit)
        need = self.blocks_needed(seq, num_tokens)
        if need > self._pool.num_free:
            raise RuntimeError(f"{seq.request_id}: needs {need} blocks, {self._pool.num_free} free")
        if self._window is not None:
            self.trim_window(seq)
            gaps = self._window_gaps(seq, step_end or num_tokens)
            if len(gaps) > self._window.num_free:
                raise RuntimeError(f"{seq.request_id}: needs {len(gaps)} window blocks, {self._window.num_free} free")
        if self._needs_state(seq):
            if self._states.num_free == 0:
                raise RuntimeError(f"{seq.request_id}: needs a state slot, none free")
            seq.state_slot = self._states.take()
        for _ in range(need):
            seq.block_table.append(self._pool.take())
        if self._window is not None:
            table = seq.window_table
            table.extend([FREED] * (self.blocks_for(step_end or num_tokens) - len(table)))
            for i in gaps:
                table[i] = self._window.take()
        if hit.num_tokens and self.checkpoints is not None:
            self.checkpoints.restore(seq, seq.block_hashes[len(hit.blocks) - 1], hit.num_tokens)

    def trim_window(self, seq: Sequence) -> None:
        """Free the window blocks that no later step of seq reads (all their positions are
        before the last window_tokens of seq.num_computed_tokens)."""
        for i in self._out_of_window(seq):
            self._window.give_back(seq.window_table[i], seq.request_id)
            seq.window_table[i] = FREED
        if self.window_tokens is not None:  # every block below the window's first is freed now
            seq.window_trimmed = (seq.window_table, max(self._trimmed(seq), self._first_read_block(seq)))

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks (in reverse, so a re-admitted sequence tends to get them back)."""
        for block in reversed(seq.block_table):
            self._pool.give_back(block, seq.request_id)
        seq.block_table = []
        seq.num_registered_blocks = seq.num_reused_blocks = 0
        for block in reversed(seq.window_table):
            if block != FREED:
                self._window.give_back(block, seq.request_id)
        seq.window_table = []
        if seq.state_slot >= 0:
            self._states.give_back(seq.state_slot, seq.request_id)
            seq.state_slot = FREED

    def take_spare_state(self) -> int | None:
        """A state slot for one step, outside any sequence (None: none free): speculative
        decoding's verify chunk writes its sequence's new state there (spec_decode/spare_states.py)."""
        return self._states.take() if self._states is not None and self._states.num_free else None

    def give_back_state(self, slot: int, owner: str) -> None:
        self._states.give_back(slot, owner)

    def _needs_state(self, seq: Sequence) -> bool:
        return self._states is not None and seq.state_slot < 0

    def _out_of_window(self, seq: Sequence) -> list[int]:
        """Window-table indices holding blocks whose every position is below the window."""
        if self.window_tokens is None:
            return []
        table = seq.window_table
        return [i for i in range(self._trimmed(seq), self._first_read_block(seq)) if table[i] != FREED]

    def _first_read_block(self, seq: Sequence) -> int:
        """The window-table index of the oldest position a step of seq reads (at most its length)."""
        first_read = max(0, seq.num_computed_tokens - self.window_tokens)
        return min(first_read // self.block_size, len(seq.window_table))

    @staticmethod
    def _trimmed(seq: Sequence) -> int:
        """seq's window blocks below this index are freed already (trim_window's mark: a 128K
        context's table has 2K entries to scan otherwise); a new table (freed, re-admitted): 0."""
        mark = seq.window_trimmed
        return mark[1] if mark is not None and mark[0] is seq.window_table else 0

    def _window_gaps(self, seq: Sequence, step_end: int) -> list[int]:
        """Window-table indices the step writes (its new positions among the last window_tokens
        of step_end) that hold no block yet."""
        first = max(seq.num_computed_tokens, step_end - self.window_tokens)
        table = seq.window_table
        return [
            i
            for i in range(first // self.block_size, self.blocks_for(step_end))
            if i >= len(table) or table[i] == FREED
        ]
