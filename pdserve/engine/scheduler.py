r"""Continuous batching: which sequences run this step and how many tokens each. No torch.

Queues (a request is in exactly one):

    add() ----------> waiting ---- admit (blocks for all its tokens) ----> running ---> finish()
                         ^  preempt: free blocks, back to the front (recompute)   |
                         +--------------------------------------------------------+
    add_remote() ---> remote_pending -- blocks --> loading -- loaded -----> front of waiting
                                                     |-- failed (policy fail) -> finish()
                                                     \-- failed (policy recompute) -> recompute():
                                                         free blocks, front of waiting
                                    finish(FINISHED_REMOTE_DECODE) -> held (blocks pinned) -> release_held()

Each step: running sequences first, decodes before chunked prefills, oldest first; then waiting
ones are admitted while the token budget, max_num_seqs and free blocks allow. When a running
sequence needs a block and none is free, the youngest running sequence is preempted.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus


def _fork_cut(seq: Sequence, start: int, n: int) -> int:
    """A chunk of n tokens from start, ended where seq forks (n > 1: before its last prompt
    token, engine/forks.py) when it crosses that point."""
    if seq.fork_at is not None and start < seq.fork_at < start + n:
        return seq.fork_at - start
    return n


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # seq.num_computed_tokens when scheduled: this step computes tokens [start, start + num_tokens)
    num_tokens: int
    samples: bool = False  # the chunk reaches the sequence's last token: its logits give the next token
    num_spec: int = 0  # draft tokens after the last token, verified in this chunk (spec_decode/)
    state_dst: int = -1  # a verify chunk's spare state slot for its new state (-1: its own; spare_states.py)

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_tokens
        return cls(seq, start, num_tokens, end >= seq.num_tokens, max(0, end - seq.num_tokens))

    @property
    def is_prefill(self) -> bool:
        return not (self.num_tokens - self.num_spec == 1 and self.start > 0 and self.samples)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival (oldest first)
        self.remote_pending: deque[Sequence] = deque()
        self.loading: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # -- intake --
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_front(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a fork's child with no room this step): first in line."""
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def join_step(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A sequence holding its blocks (a fork's child) joins `out` for its uncomputed tokens
        where max_num_seqs, the token budget and the pool allow; False if it does not."""
        room = len(self.running) < self.max_num_seqs and out.num_batched_tokens < self.max_num_batched_tokens
        if not room or not self.block_manager.can_allocate(seq, seq.num_tokens):
            return False
        self.block_manager.allocate(seq, seq.num_tokens)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        out.scheduled.append(ScheduledSeq.of(seq, seq.num_uncomputed_tokens))
        return True

    def add_remote(self, seq: Sequence) -> None:
        """A decode-role sequence whose prompt KV comes from a prefill worker."""
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.remote_pending.append(seq)

    def admit_remote(self) -> list[Sequence]:
        """Give pending remote sequences blocks for their prompt KV, oldest first, while blocks last
        (with prefix caching its cached first blocks, which the load skips). Returns those whose
        load may now start."""
        started = []
        while self.remote_pending:
            seq = self.remote_pending[0]
            num_remote = seq.kv_handle.num_tokens
            hit = self.block_manager.remote_hit(seq, num_remote)
            if not self.block_manager.can_allocate(seq, num_remote, hit=hit):
                break
            self.block_manager.allocate_remote(seq, num_remote, hit)
            self.remote_pending.popleft()
            self.loading[seq.request_id] = seq
            started.append(seq)
        return started

    def on_loaded(self, request_id: str) -> Sequence | None:
        """Remote KV arrived: the sequence joins the front of waiting (it already holds its blocks)."""
        seq = self.loading.pop(request_id, None)
        if seq is not None:
            seq.num_computed_tokens = seq.kv_handle.num_tokens
            self.block_manager.cache_computed(seq)  # its full blocks, for a later turn's load
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        return seq

    def recompute(self, seq: Sequence) -> None:
        """A failed remote load, to be computed here instead: its blocks (partly or wrongly filled)
        are dropped and it waits at the front, like a preempted sequence."""
        self.loading.pop(seq.request_id, None)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # -- the step --
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        live = [s for s in self.running if not s.ends_in_flight]  # not those a step in flight ends by length
        decodes = [s for s in live if s.num_uncomputed_tokens == 1]
        prefills = [s for s in live if s.num_uncomputed_tokens > 1]
        used = 0  # tokens scheduled so far (kept as a count: summing them each time was O(B^2) a step)
        for seq in decodes + prefills:
            budget = self.max_num_batched_tokens - used
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            n = min(seq.num_uncomputed_tokens + seq.num_draft_tokens, budget)  # + its drafts: a verify chunk
            n = self.block_manager.cut(seq, seq.num_computed_tokens, n)  # a prefix checkpoint ends a chunk
            n = _fork_cut(seq, seq.num_computed_tokens, n)
            preempted = len(out.preempted)
            if self._make_room(seq, seq.num_computed_tokens + n, out):
                self.block_manager.allocate(seq, seq.num_computed_tokens + n)
                out.scheduled.append(ScheduledSeq.of(seq, n))
                used += n
            if len(out.preempted) != preempted:  # a preemption takes its scheduled tokens back
                used = out.num_batched_tokens
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        if not out.preempted:  # after a preemption blocks are short: let running ones catch up first
            self._admit_waiting(out, budget)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt younger sequences until seq's table can cover num_tokens; False if seq itself
        had to be preempted (it is the youngest)."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            if victim is seq or victim.arrival < seq.arrival:
                self._preempt(seq, out)
                return False
            self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        for i, s in enumerate(out.scheduled):
            if s.seq is seq:
                del out.scheduled[i]
                break
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self.block_manager.lookup(seq)  # prefix caching: cached blocks it starts from
            start = seq.num_computed_tokens + hit.num_tokens
            # + drafts of a PD decode request whose KV arrived: its first step here verifies them,
            # where there is room for their KV (else it decodes one token, as without drafts)
            if seq.num_draft_tokens and not self.block_manager.can_allocate(seq, seq.num_tokens + seq.num_draft_tokens):
                seq.spec_token_ids = []
            n = min(seq.num_uncomputed_tokens - hit.num_tokens + seq.num_draft_tokens, budget)
            n = _fork_cut(seq, start, self.block_manager.cut(seq, start, n, hit.num_matched_tokens))
            # blocks for all its tokens up front, so a long prompt is not preempted between chunks
            # (window blocks only for this chunk: earlier chunks' fall out of the window)
            step_end = start + n
            end = max(seq.num_tokens, step_end)
            if not self.block_manager.can_allocate(seq, end, step_end, hit):
                break
            self.block_manager.allocate(seq, end, step_end, hit)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            out.scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n

    # -- endings --
    def finish(self, seq: Sequence, status: SequenceStatus, free: bool = True) -> None:
        """Take seq out of its queue; free its blocks unless it hands its KV to a decode worker (its
        window trimmed by the engine after the step's MTP pass, which reads the whole window) or
        the caller frees them later (free=False: a launched step still writes them)."""
        self._remove(seq)
        seq.status = status
        if status is SequenceStatus.FINISHED_REMOTE_DECODE:
            self.held[seq.request_id] = seq
        elif free:
            self.block_manager.free(seq)

    def release_held(self, request_id: str) -> bool:
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.remote_pending:
            self.remote_pending.remove(seq)
        else:
            self.loading.pop(seq.request_id, None)

    # -- queries --
    def find(self, request_id: str) -> Sequence | None:
        """The unfinished sequence with this id, in whichever queue it is."""
        for seq in itertools.chain(self.running, self.waiting, self.remote_pending):
            if seq.request_id == request_id:
                return seq
        return self.loading.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote_pending) + len(self.loading)

    def counts(self) -> SchedulerCounts:
        remote = len(self.remote_pending) + len(self.loading)
        return SchedulerCounts(
            running=len(self.running),
            waiting=len(self.waiting) + remote,
            waiting_for_remote_kv=remote,
            held=len(self.held),
            preemptions=self.num_preemptions,
        )


@dataclass
class SchedulerCounts:
    running: int
    waiting: int  # includes sequences waiting for remote KV
    waiting_for_remote_kv: int
    held: int  # prefill role: finished, blocks pinned for a decode worker
    preemptions: int
