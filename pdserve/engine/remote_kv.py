"""The engine's side of PD disaggregation: KV held for a decode worker, hand-offs, and loads.

LLMEngine owns one RemoteKV when it has a KV connector (pdserve.disagg.base.KVConnector) and
calls it from its step; what RemoteKV does to a request that the engine must answer for (admit
it, output it, forget its id) comes back as RemoteEvents.

- prefill role (`Request.hold_kv`): after the first sampled token the request finishes; unless that
  token already stopped it, its blocks stay pinned and `connector.on_prefill_finished` gives the
  KVHandle returned in the final RequestOutput (hold). `poll_releases()` (decode read it, or the
  lease expired) and an abort (the router gave up on it) free them.
- the hand-off: a prefill request with `kv_to` (the decode engine the router paired it with, whose
  metadata the worker fetched) sends it a `Handoff` (handle + first token) through
  `connector.send_handoff` right after on_prefill_finished; RequestOutput.kv_handoff_sent says
  whether that worked. A decode request with `kv_from` instead of a handle waits (no blocks) for
  its Handoff: from `connector.poll_handoffs()` (only from the engine kv_from names) or
  `deliver()` (posted over HTTP by the router), then goes on as a request that came with its
  handle. One that waits longer than `handoff_timeout_s` fails (stage PENDING); a hand-off for a
  request not here yet is kept until it arrives or the prefill lease ends.
- decode role (`Request.kv_handle` + `first_token`): blocks for the prompt are allocated when free,
  `connector.start_load(handle, block_ids, peer)` reads the prompt KV, `poll_loads()` lets finished
  ones run (the first token is their first output and next input). The Sequence's transfer stage
  only moves forward (PENDING -> READING -> DONE, or FAILED). A failed load follows
  `kv_load_failure_policy` (vLLM's name): "fail" finishes the request with finish_reason "error"
  and the failure as data in RequestOutput.transfer_error; "recompute" drops the blocks and
  computes the prompt here (the first token stays prefill's), so the output is what a colocated
  engine gives, never tokens from partial KV.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from pdserve.disagg.base import KVConnector, KVHandle, TransferError, TransferStage
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import KVLoadFailurePolicy
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import FirstToken, Handoff, Request
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.mtp_handoff import hidden_bytes, mtp_problem
from pdserve.engine.stop import visible_text
from pdserve.outputs import to_entries

log = logging.getLogger("pdserve.engine")

DEFAULT_HANDOFF_TIMEOUT_S = 300.0  # a decode request waits this long for prefill's hand-off
MAX_EARLY_HANDOFFS = 4096  # hand-offs kept for requests not here yet (each ends with its lease)


def handoff_problem(
    req: Request, handle: KVHandle, first: FirstToken | None, vocab_size: int, mtp_bytes: int | None
) -> str | None:
    """Why a decode request cannot continue from this handle's KV and first token, or None.
    mtp_bytes: the MTP hidden state this engine drafts from (spec_decode/mtp_handoff.py), or None.
    n > 1 (forks.py): the KV of every prompt token but the last and no first token."""
    n = len(req.prompt_token_ids) + (len(req.resume.token_ids) if req.resume is not None else 0)
    if req.params.num_seqs > 1:
        if handle.num_tokens != n - 1:
            return (
                f"kv_handle holds {handle.num_tokens} tokens; with n > 1 it holds all but the prompt's last ({n - 1})"
            )
        return "with n > 1 the decode worker samples every first token: no first_token" if first is not None else None
    if first is None:
        return "a hand-off needs the first token prefill sampled"
    if handle.num_tokens != n:
        return f"kv_handle holds {handle.num_tokens} tokens but the prompt (and resumed output) has {n}"
    if not 0 <= first.token_id < vocab_size:
        return f"first_token must lie in [0, {vocab_size})"
    if req.params.logprobs is not None and first.logprobs is None:
        return "params.logprobs is set: pass the first token's logprobs from the prefill output"
    return mtp_problem(handle.mtp_hidden, mtp_bytes)


@dataclass
class RemoteEvents:
    """What the engine does after a RemoteKV call: admit `ready` (their hand-off gave them a KV
    handle and first token), output and forget `ended` (finished here, status set, holding no
    blocks), forget `freed` (prefill: held requests whose blocks are free now)."""

    ready: list[Sequence] = field(default_factory=list)
    ended: list[Sequence] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)


class RemoteKV:
    def __init__(
        self,
        connector: KVConnector,
        scheduler: Scheduler,
        block_manager: BlockManager,
        runner: ModelRunner,
        *,
        policy: KVLoadFailurePolicy,
        handoff_timeout_s: float,
    ) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.policy = policy
        self.handoff_timeout_s = handoff_timeout_s
        self.vocab_size = runner.model.config.vocab_size
        self.mtp_bytes = hidden_bytes(runner.config, runner.model, runner.dtype)  # None: no MTP drafts
        self.num_kv_load_recomputes = 0
        self._lock = threading.Lock()
        self._posted: list[Handoff] = []  # deliver() since the last take_handoffs (any thread)
        self._awaiting: dict[str, tuple[Sequence, float]] = {}  # decode: request id -> (seq, monotonic deadline)
        self._early: dict[str, Handoff] = {}  # hand-offs that came before their request

    # -- queries --
    @property
    def num_awaiting(self) -> int:
        """Decode requests waiting for their hand-off."""
        return len(self._awaiting)

    def has_pending(self) -> bool:
        """Hand-offs posted and not taken yet, or requests waiting for theirs."""
        with self._lock:
            posted = bool(self._posted)
        return posted or bool(self._awaiting)

    def busy(self) -> bool:
        """Hand-offs awaited or loads outstanding: worth polling while the device computes a step."""
        return bool(self._awaiting or self.scheduler.remote_pending or self.scheduler.loading)

    # -- prefill --
    def hold(self, seq: Sequence) -> None:
        """seq finished with its KV kept for a decode worker (the scheduler holds its blocks): lease
        them through the connector, then send the hand-off."""
        n = seq.num_computed_tokens
        try:
            nb = self.block_manager.blocks_for(n)
            seq.kv_handle = self.connector.on_prefill_finished(
                seq.request_id, seq.block_table[:nb], n, window_block_ids=seq.window_table[:nb],
                state_slot=seq.state_slot, kv_to=seq.peer if seq.request.kv_to is not None else None,
            )  # fmt: skip
            if seq.mtp_hidden is not None:  # MTP drafts: the decode side's first draft starts from it
                seq.kv_handle = seq.kv_handle.model_copy(update={"mtp_hidden": seq.mtp_hidden})
        except Exception as e:  # a connector failure fails this request, not the engine
            self.scheduler.release_held(seq.request_id)
            seq.status, seq.error, seq.kv_handle = SequenceStatus.FINISHED_ERROR, f"{type(e).__name__}: {e}", None
        else:
            seq.handoff_sent = self._send_handoff(seq)

    def _send_handoff(self, seq: Sequence) -> bool:
        """Tell the decode engine of Request.kv_to that the KV is ready (the worker fetched its
        metadata into seq.peer). False when it cannot: the router posts the hand-off instead."""
        peer = seq.peer
        if seq.request.kv_to is None or peer is None or peer.data is None:
            return False
        first = None  # n > 1: none, each sequence's is sampled by the decode worker (forks.py)
        if seq.output_token_ids:  # the token prefill sampled: its last output (a migrated request's come first)
            first = FirstToken(
                token_id=seq.output_token_ids[-1],
                logprobs=to_entries(seq.logprobs[-1]) if seq.logprobs else None,
                text_offset=len(visible_text(seq)),
            )
        handoff = Handoff(request_id=seq.request_id, kv_handle=seq.kv_handle, first_token=first)
        try:
            self.connector.send_handoff(peer, handoff.model_dump_json(exclude_none=True).encode())
        except Exception as e:  # the router posts it instead: slower, not lost
            self.connector.stats.record_control_failure("handoff")
            log.warning("hand-off of %s to %s failed (the router posts it): %s: %s",
                        seq.request_id, peer.engine_id, type(e).__name__, e)  # fmt: skip
            return False
        return True

    def _release(self, request_id: str, connector_too: bool) -> list[str]:
        """Free a held request's blocks: [its id] when the scheduler held it."""
        if connector_too:
            self.connector.release(request_id)
        return [request_id] if self.scheduler.release_held(request_id) else []

    # -- aborts --
    def abort(self, request_id: str) -> RemoteEvents | None:
        """Stop what goes on here for the request; None when the engine still has to finish it
        (unknown here, or its load was cancelled and its blocks are the scheduler's)."""
        self._early.pop(request_id, None)
        waiting = self._awaiting.pop(request_id, None)
        if waiting is not None:  # no blocks yet: nothing to free
            waiting[0].status = SequenceStatus.FINISHED_ABORTED
            return RemoteEvents(ended=[waiting[0]])
        if request_id in self.scheduler.held:
            return RemoteEvents(freed=self._release(request_id, connector_too=True))
        if request_id in self.scheduler.loading:
            self.connector.cancel_load(request_id)
        return None

    # -- the hand-off (decode) --
    def deliver(self, handoff: Handoff) -> None:
        """A hand-off posted over HTTP (any thread); taken at the next take_handoffs."""
        with self._lock:
            self._posted.append(handoff)

    def wait(self, seq: Sequence) -> RemoteEvents:
        """A decode request admitted before its hand-off: it waits for it (no blocks), or takes
        the one that came first."""
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        events = RemoteEvents()
        early = self._early.pop(seq.request_id, None)
        if early is not None:
            self._accept(seq, early, events)
        else:
            self._awaiting[seq.request_id] = (seq, time.monotonic() + self.handoff_timeout_s)
        return events

    def take_handoffs(self) -> RemoteEvents:
        """The hand-offs that arrived (notified or posted) for the requests waiting for them; the
        requests that waited too long fail; early hand-offs whose lease ended are dropped."""
        events = RemoteEvents()
        with self._lock:
            arrived: list[tuple[Handoff, str | None]] = [(h, None) for h in self._posted]
            self._posted = []
        for sender, payload in self.connector.poll_handoffs():
            try:
                arrived.append((Handoff.model_validate_json(payload), sender))
            except ValueError as e:
                log.warning("unreadable hand-off from %s dropped: %s", sender, e)
        for handoff, sender in arrived:
            waiting = self._awaiting.get(handoff.request_id)
            if waiting is None:
                self._keep_early(handoff)
                continue
            seq = waiting[0]
            expected = seq.request.kv_from.engine_id
            if sender is not None and sender != expected:  # not whose it waits for
                log.warning("hand-off of %s from engine %s ignored: it waits for %s", seq.request_id, sender, expected)
                continue
            del self._awaiting[handoff.request_id]
            self._accept(seq, handoff, events)
        now, wall = time.monotonic(), time.time()
        for rid, (seq, deadline) in list(self._awaiting.items()):
            if now >= deadline:
                del self._awaiting[rid]
                engine_id, limit = seq.request.kv_from.engine_id, self.handoff_timeout_s
                self._handoff_failed(seq, f"no hand-off from prefill engine {engine_id} within {limit:g} s", events)
        for rid in [rid for rid, h in self._early.items() if h.kv_handle.lease_expires_at < wall]:
            del self._early[rid]  # its prefill freed the KV already
        return events

    def _keep_early(self, handoff: Handoff) -> None:
        if len(self._early) >= MAX_EARLY_HANDOFFS:
            oldest = next(iter(self._early))
            log.warning("more than %d hand-offs for requests not here: dropped %s's", MAX_EARLY_HANDOFFS, oldest)
            del self._early[oldest]
        self._early[handoff.request_id] = handoff

    def _accept(self, seq: Sequence, handoff: Handoff, events: RemoteEvents) -> None:
        expected = seq.request.kv_from.engine_id
        problem = handoff_problem(seq.request, handoff.kv_handle, handoff.first_token, self.vocab_size, self.mtp_bytes)
        if handoff.kv_handle.engine_id != expected:
            problem = f"the hand-off's KV is on engine {handoff.kv_handle.engine_id}, not {expected}"
        if problem is not None:
            self._handoff_failed(seq, problem, events)
            return
        seq.kv_handle, seq.first_token = handoff.kv_handle, handoff.first_token
        self.connector.stats.record_handoff(seq.request_id, time.monotonic())
        events.ready.append(seq)

    def _handoff_failed(self, seq: Sequence, reason: str, events: RemoteEvents) -> None:
        err = TransferError(seq.request_id, TransferStage.PENDING, reason)
        self.connector.stats.record_failed(TransferStage.PENDING.name)
        seq.fail_transfer(err.failure)
        seq.error = str(err)
        seq.status = SequenceStatus.FINISHED_ERROR
        events.ended.append(seq)

    # -- releases and loads --
    def poll(self) -> RemoteEvents:
        """Prefill: the releases (decode read the KV, or the lease ended). Decode: loads started for
        the requests that got blocks, finished ones handed to the scheduler, failed ones to the
        failure policy."""
        events = RemoteEvents()
        for request_id in self.connector.poll_releases():
            events.freed += self._release(request_id, connector_too=False)
        for seq in self.scheduler.admit_remote():
            try:
                self.connector.start_load(
                    seq.kv_handle, list(seq.block_table), seq.peer, local_window_block_ids=list(seq.window_table),
                    local_state_slot=seq.state_slot, num_reused_blocks=seq.num_reused_blocks,
                )  # fmt: skip
                seq.advance_transfer(TransferStage.READING)
            except TransferError as e:  # hash mismatch, unknown or unreachable peer, bad block ids
                self._load_failed(seq, e, events)
            except Exception as e:  # a connector bug fails this request, not the engine
                err = TransferError(seq.request_id, TransferStage.PENDING, f"{type(e).__name__}: {e}")
                self._load_failed(seq, err, events)
        done, failed = self.connector.poll_loads()
        for request_id in done:
            seq = self.scheduler.loading.get(request_id)
            if seq is not None:  # tensor parallel: rank 0 received the KV (not its reused blocks), the ranks copy it
                loaded = seq.block_table[seq.num_reused_blocks :]
                self.runner.on_kv_loaded(loaded, list(seq.window_table), seq.state_slot)
                seq.advance_transfer(TransferStage.DONE)
            self.scheduler.on_loaded(request_id)
        for err in failed:
            seq = self.scheduler.loading.get(err.request_id)
            if seq is not None:
                self._load_failed(seq, err, events)
        return events

    def _load_failed(self, seq: Sequence, err: TransferError, events: RemoteEvents) -> None:
        seq.fail_transfer(err.failure)
        if self.policy == "recompute":
            self.scheduler.recompute(seq)
            self.num_kv_load_recomputes += 1
            return
        seq.error = str(err)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        events.ended.append(seq)
