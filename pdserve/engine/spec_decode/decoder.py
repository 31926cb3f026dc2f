"""The engine's side of speculative decoding: after each step, drafts for the sequences that
will decode next; the counters of what was verified; on a pool with per-sequence state
(DeepSeek-V4), the spare state slots of the step's verify chunks (spare_states.py).

A sequence with a structured-outputs grammar drafts too: its drafts are cut at the first token the
grammar refuses (the matcher's state unchanged), and the verify step masks each position with
the grammar's state after the drafts before it (verify.py's `Ahead`). Drafts never reach past
max_tokens or max_model_len.

A PD decode worker's request drafts from its first step here: once its KV has arrived it waits to
be scheduled with its prompt and the prefill worker's first token, all a proposer that drafts
from tokens alone (n-gram: `drafts_from_tokens`) needs (`propose_waiting`, before the schedule);
MTP drafts from the MTP layer's hidden state the hand-off carries (`propose_loaded`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.spare_states import SpareStates


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
        self.spare: SpareStates | None = None  # a pool with per-sequence state (for_engine)

    @classmethod
    def for_engine(cls, config, runner, blocks: BlockManager) -> SpecDecoder | None:
        """The engine's decoder (None without speculative_config). ValueError where a verify
        chunk could outgrow the sliding window (its first positions would keep no window record)."""
        spec = config.speculative_config
        if spec is None:
            return None
        window = runner.window_tokens
        if window is not None and spec.num_speculative_tokens + 1 > window:
            raise ValueError(
                f"speculative_config: num_speculative_tokens {spec.num_speculative_tokens} needs verify chunks of "
                f"{spec.num_speculative_tokens + 1} tokens, more than the model's sliding window keeps ({window}); "
                f"use at most {window - 1}"
            )
        proposer = None
        if spec.method == "mtp":
            from pdserve.engine.spec_decode.mtp import MTPDrafter

            proposer = MTPDrafter(runner, blocks)
        out = cls(spec, runner.max_model_len, proposer)
        if runner.num_state_slots:
            rates = {s.tokens_per_record for s in runner.kv_cache.specs.values() if s.tokens_per_record > 1}
            out.spare = SpareStates(blocks, rates)
        return out

    def begin(self, sched: SchedulerOutput) -> None:
        """Before the step's forward (a pool with state: spare slots for its verify chunks)."""
        if self.spare is not None:
            self.spare.begin(sched)

    def settle(self, s: ScheduledSeq, num_accepted: int) -> None:
        """After the acceptance, before the blocks are trimmed or cached: counters, and which
        state a verify chunk's sequence keeps (its computed tokens may go back: spare_states.py)."""
        if s.num_spec:
            self.stats.observe(s.num_spec, num_accepted)
        if self.spare is not None:
            self.spare.settle(s)

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
        whose KV arrived (one token, the first, left to compute): from tokens alone, or (MTP) from
        the hidden state the hand-off carried (mtp_handoff.py)."""
        loaded = getattr(self.proposer, "propose_loaded", None)
        if loaded is None and not getattr(self.proposer, "drafts_from_tokens", False):
            return
        wanted = []
        for seq in waiting:
            if seq.num_uncomputed_tokens == 1 and seq.first_token is not None and not seq.spec_token_ids:
                limit = self._limit(seq)
                if limit > 0:
                    wanted.append((seq, limit))
        if loaded is not None:
            loaded(wanted)
            for seq, _ in wanted:
                self._cut(seq)
            return
        for seq, limit in wanted:
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
