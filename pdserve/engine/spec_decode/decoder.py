"""The engine's side of speculative decoding: after each step, drafts for the sequences that
will decode next; the counters of what was verified.

A sequence with a structured-outputs grammar drafts too: its drafts are cut at the first token the
grammar refuses (the matcher's state unchanged), and the verify step masks each position with
the grammar's state after the drafts before it (verify.py's `Ahead`). Drafts never reach past
max_tokens or max_model_len.

A PD decode worker's request drafts from its first step here: once its KV has arrived it waits to
be scheduled with its prompt and the prefill worker's first token, all a proposer that drafts
from tokens alone (n-gram: `drafts_from_tokens`) needs (`propose_waiting`, before the schedule).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seq: Sequence, limit: int) -> list[int]: ...


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        """proposer: tests pass their own; by default the config's method's."""
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats(self.k)

    def observe(self, s: ScheduledSeq, num_accepted: int) -> None:
        if s.num_spec:
            self.stats.observe(s.num_spec, num_accepted)

    def propose(self, sched: SchedulerOutput) -> None:
        """Drafts for the step's sequences that decode next (stale ones dropped everywhere else)."""
        for seq in sched.preempted:
            seq.spec_token_ids = []
        for s in sched.scheduled:
            seq = s.seq
            seq.spec_token_ids = []
            if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1:
                self._draft(seq)

    def propose_waiting(self, waiting: Iterable[Sequence]) -> None:
        """Drafts for waiting sequences that will decode at once: a PD decode worker's requests
        whose KV arrived (one token, the first, left to compute); only from tokens alone."""
        if not getattr(self.proposer, "drafts_from_tokens", False):
            return
        for seq in waiting:
            if seq.num_uncomputed_tokens == 1 and seq.kv_handle is not None and not seq.spec_token_ids:
                self._draft(seq)

    def _draft(self, seq: Sequence) -> None:
        limit = self._limit(seq)
        if limit <= 0:
            return
        drafts = list(self.proposer.propose(seq, limit))[:limit]
        if seq.grammar is not None:  # verified only as far as the grammar allows them
            drafts = drafts[: seq.grammar.num_allowed(drafts)]
        seq.spec_token_ids = drafts

    def _limit(self, seq: Sequence) -> int:
        """Drafts that could all be emitted: one token more than the drafts ends the step."""
        left = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return min(self.k, left - 1)


def refuse_unsupported(runner) -> None:
    """ValueError naming what speculation does not run on yet: models with a sliding window or
    per-sequence state (DeepSeek-V4: rejected drafts would have to leave its window, compressed
    entries and compressor state untouched)."""
    if runner.window_tokens is not None or runner.num_state_slots:
        raise ValueError(
            "speculative_config is not yet supported for DeepSeek-V4 (sliding window and compressor state); "
            "it runs on DeepSeek-V3 / V3.2"
        )
