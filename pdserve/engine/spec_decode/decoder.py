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
from typing import Protocol, runtime_checkable

from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.config import MTP_UNDER_PD, SpeculativeConfig
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seq: Sequence, limit: int) -> list[int]: ...


@runtime_checkable
class StepProposer(Protocol):
    """A proposer that sees the whole step (MTP: mtp.py), setting the drafts of `wanted`
    (sequence, limit) itself."""

    def propose_step(self, sched: SchedulerOutput, wanted: list[tuple[Sequence, int]]) -> None: ...


class SpecDecoder:
    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | StepProposer | None = None
    ) -> None:
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
        wanted = []
        for s in sched.scheduled:
            seq = s.seq
            seq.spec_token_ids = []
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            limit = self._limit(seq)
            if limit > 0:
                wanted.append((seq, limit))
        if isinstance(self.proposer, StepProposer):
            self.proposer.propose_step(sched, wanted)
            for seq, _ in wanted:
                self._cut(seq)
            return
        for seq, limit in wanted:
            self._draft(seq, limit)

    def propose_waiting(self, waiting: Iterable[Sequence]) -> None:
        """Drafts for waiting sequences that will decode at once: a PD decode worker's requests
        whose KV arrived (one token, the first, left to compute); only from tokens alone."""
        if not getattr(self.proposer, "drafts_from_tokens", False):
            return
        for seq in waiting:
            if seq.num_uncomputed_tokens == 1 and seq.kv_handle is not None and not seq.spec_token_ids:
                limit = self._limit(seq)
                if limit > 0:
                    self._draft(seq, limit)

    def _draft(self, seq: Sequence, limit: int) -> None:
        seq.spec_token_ids = list(self.proposer.propose(seq, limit))[:limit]
        self._cut(seq)

    @staticmethod
    def _cut(seq: Sequence) -> None:
        """A grammar's sequence verifies its drafts only as far as the grammar allows them."""
        if seq.grammar is not None and seq.spec_token_ids:
            seq.spec_token_ids = seq.spec_token_ids[: seq.grammar.num_allowed(seq.spec_token_ids)]

    def _limit(self, seq: Sequence) -> int:
        """Drafts that could all be emitted: one token more than the drafts ends the step."""
        left = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return min(self.k, left - 1)


def make_spec_decoder(config, runner, block_manager, connector=None) -> SpecDecoder | None:
    """The engine's SpecDecoder for EngineConfig `config` (None without speculative_config);
    connector: the engine's KV connector (PD), where MTP is refused."""
    spec = config.speculative_config
    if spec is None:
        return None
    refuse_unsupported(runner)
    proposer = None
    if spec.method == "mtp":
        if connector is not None:
            raise ValueError(MTP_UNDER_PD)
        from pdserve.engine.spec_decode.mtp import MTPDrafter

        proposer = MTPDrafter(runner, block_manager)
    return SpecDecoder(spec, runner.max_model_len, proposer)


def refuse_unsupported(runner) -> None:
    """ValueError naming what speculation does not run on yet: models with a sliding window or
    per-sequence state (DeepSeek-V4: rejected drafts would have to leave its window, compressed
    entries and compressor state untouched)."""
    if runner.window_tokens is not None or runner.num_state_slots:
        raise ValueError(
            "speculative_config is not yet supported for DeepSeek-V4 (sliding window and compressor state); "
            "it runs on DeepSeek-V3 / V3.2"
        )
