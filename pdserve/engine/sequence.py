"""One request's state, end to end: tokens, block table, counts, stop state, and its PD part (the
KV handle, the first token, the transfer stage and a typed transfer failure). No torch.

Token accounting (as vLLM V1): a sequence's tokens are prompt + output. `num_computed_tokens`
of them have their KV in the cache. Each step computes the next chunk of uncomputed tokens; when
that reaches the last token, its logits give the next output token. So a fresh prompt prefills in
chunks, a running sequence decodes one token a step, and a preempted one recomputes everything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.disagg.base import TransferFailure, TransferStage

if TYPE_CHECKING:
    from pdserve.disagg.base import KVHandle, PeerMetadata
    from pdserve.engine.request import FirstToken, Request
    from pdserve.outputs import Logprob
    from pdserve.structured.matcher import RequestMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    FINISHED_REMOTE_DECODE = "finished_remote_decode"  # prefill role: continues on a decode worker

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
    SequenceStatus.FINISHED_REMOTE_DECODE: None,
}


class Sequence:
    def __init__(self, request: Request, *, arrival: int = 0, peer: PeerMetadata | None = None) -> None:
        """request: as it arrived (kept, never unpacked). peer: the other PD engine's transfer
        metadata the worker fetched before admitting the request (decode: the prefill engine;
        prefill with kv_to: the decode engine to hand off to)."""
        self.request = request
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = request.params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.window_table: list[int] = []  # window-space blocks (block_manager.py), -1 where freed
        self.state_slot = -1  # state-space slot (block_manager.py), -1: none
        self.table_cache: Any = None  # block_table as numpy, extended as it grows (step_tables.py)
        self.window_trimmed: Any = None  # (window_table, n): its first n blocks are freed (block_manager.py)
        self.num_computed_tokens = 0
        # the overlapped loop (llm_engine.py): tokens sampled by launched steps that the host has
        # not read yet; they count in num_tokens (the scheduler's view), not in output_token_ids
        self.num_inflight = 0
        self.token_limit = self.num_prompt_tokens + (
            request.params.max_tokens or 1 << 62
        )  # the engine caps it at max_model_len
        # prefix caching (prefix_cache.py): hashes of its full blocks, how many of its blocks are
        # findable, the prompt tokens its first admission found cached (None: not admitted yet), and
        # where its cached blocks ended past the hit (a prefill chunk ends there: prefix_checkpoints.py)
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None
        self.prefix_junction = 0
        self.num_reused_blocks = 0  # decode: its first blocks that the prefix cache held, not loaded
        self.spec_token_ids: list[int] = []  # drafts to verify after the last token (spec_decode/)
        # n > 1 (forks.py): its request's sequences, its index among them, and where its prompt
        # stops to fork (or, on a prefill worker, to hand off): the last prompt token; None after
        self.group: SeqGroup | None = None
        self.index = 0
        self.fork_at: int | None = None
        self.arrival = arrival  # admission order key: larger = younger
        # output state
        self.output_text = OutputText()
        self.detokenizer: Any = None  # IncrementalDetokenizer, or None when not detokenizing
        # what the request's outputs have carried so far (delta outputs start after it)
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.grammar: RequestMatcher | None = None  # structured outputs: advanced by each output token
        # PD
        self.hold_kv = request.hold_kv  # prefill role: keep blocks pinned after the first token
        self.kv_handle: KVHandle | None = request.kv_handle  # decode: the KV to load; prefill: what we hand out
        self.first_token: FirstToken | None = request.first_token  # decode role (kv_from: set at the hand-off)
        self.peer = peer  # decode: the prefill engine's metadata; prefill with kv_to: the decode engine's
        self.handoff_sent = False  # prefill role: the decode engine was notified directly
        self.mtp_hidden: str | None = None  # prefill with MTP drafts: KVHandle.mtp_hidden, set before the hold
        self.transfer_stage = TransferStage.PENDING
        self.transfer_error: TransferFailure | None = None

    def advance_transfer(self, stage: TransferStage) -> None:
        """Move the decode-side transfer forward (never back: a stage once left is not re-entered)."""
        if stage < self.transfer_stage:
            raise ValueError(
                f"transfer of {self.request_id} cannot go back from {self.transfer_stage.name} to {stage.name}"
            )
        self.transfer_stage = stage

    def fail_transfer(self, failure: TransferFailure) -> None:
        self.transfer_error = failure
        self.advance_transfer(TransferStage.FAILED)

    # -- counts --
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and in-flight tokens: the positions steps have computed or will compute."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens: those whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def next_output_index(self) -> int:
        """The output index of the token the next step samples (its seeded draw and min_tokens)."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def ends_in_flight(self) -> bool:
        """An in-flight token will end it by length: no step after it may be scheduled."""
        return self.num_inflight > 0 and self.num_tokens >= self.token_limit

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_draft_tokens(self) -> int:
        """Drafts the next step verifies: only while the sequence decodes (one token uncomputed)."""
        return len(self.spec_token_ids) if self.num_uncomputed_tokens == 1 else 0

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    # -- state --
    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def text(self) -> str:
        """The whole output text: joins it, O(text); per token, read `output_text`'s end instead."""
        return str(self.output_text)

    @text.setter
    def text(self, value: str) -> None:
        self.output_text = OutputText(value)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
            f"window_blocks={sum(b >= 0 for b in self.window_table)})"
        )


@dataclass
class SeqGroup:
    """A request's sequences when it asks for several answers (n > 1, best_of: forks.py)."""

    request_id: str
    n: int  # sequences the request returns
    size: int  # sequences it runs (best_of, or n)
    seqs: list[Sequence]  # index order; the children join at the fork
    hide_logprobs: bool = False  # computed only to rank best_of's sequences

    @property
    def ranked(self) -> bool:
        return self.size > self.n

    @property
    def finished(self) -> bool:
        """Every sequence finished (a parent that ends before its fork never gets children)."""
        return all(s.finished for s in self.seqs)

    def best(self) -> list[Sequence]:
        """The n sequences returned: by cumulative logprob, highest first, when ranked."""
        if not self.ranked:
            return list(self.seqs)
        return sorted(self.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: self.n]


class OutputText:
    """A sequence's output text in pieces: `str +=` would copy the whole text at every token.
    Appending costs the piece (every JOIN pieces are joined into one, so a long text is a few
    pieces per JOIN tokens); reading the end (stop strings, a delta output's new text) walks back
    only over what it reads and at most one joined piece."""

    JOIN = 256

    def __init__(self, text: str = "") -> None:
        self._pieces: list[str] = [text] if text else []
        self._len = len(text)
        self._loose = 0  # pieces appended since the last join

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        whole = "".join(self._pieces)
        self._pieces, self._loose = ([whole] if whole else []), 0  # asked again, it is not joined again
        return whole

    def append(self, piece: str) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self._len += len(piece)
        self._loose += 1
        if self._loose == self.JOIN:
            self._pieces[-self.JOIN :] = ["".join(self._pieces[-self.JOIN :])]
            self._loose = 0

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end] for 0 <= start <= end <= len; costs len - start, however long the text."""
        end = self._len if end is None else end
        if start >= end:
            return ""
        pos, i = self._len, len(self._pieces)
        while pos > start:  # back to the piece that holds `start`
            i -= 1
            pos -= len(self._pieces[i])
        tail = self._pieces[i][start - pos :] + "".join(self._pieces[i + 1 :])
        return tail[: end - start]

    def truncate(self, length: int) -> None:
        """Keep text[:length] (a stop string cut it)."""
        piece = ""
        while self._len > length:
            piece = self._pieces.pop()
            self._len -= len(piece)
        if self._len < length:
            self.append(piece[: length - self._len])
        self._loose = 0
