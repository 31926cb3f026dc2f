"""The engine loop: add_request -> step (schedule -> run -> sample -> stop checks) -> RequestOutputs.

add_request and abort_request may be called from any thread: a Request is validated at once (bad
input raises ValueError in the caller) and takes effect at the start of the next step(). step()
itself must be called from one thread at a time.

PD hooks (pdserve.disagg.base.KVConnector), called from step():
- prefill role (`Request.hold_kv`): after the first sampled token the request finishes; unless that
  token already stopped it, its blocks stay pinned and `connector.on_prefill_finished` gives the
  KVHandle returned in the final RequestOutput. `poll_releases()` (decode read it, or the lease
  expired) and `abort_request()` (the router gave up on it) free them.
- decode role (`Request.kv_handle` + `first_token`): blocks for the prompt are allocated when free,
  `connector.start_load(handle, block_ids, peer)` reads the prompt KV, `poll_loads()` lets finished
  ones run (the first token is their first output and next input). The Sequence's transfer stage
  only moves forward (PENDING -> READING -> DONE, or FAILED). A failed load follows
  `kv_load_failure_policy` (vLLM's name): "fail" finishes the request with finish_reason "error"
  and the failure as data in RequestOutput.transfer_error; "recompute" drops the blocks and
  computes the prompt here (the first token stays prefill's), so the output is what a colocated
  engine gives, never tokens from partial KV.
- the hand-off: a prefill request with `kv_to` (the decode engine the router paired it with, whose
  metadata the worker fetched) sends it a `Handoff` (handle + first token) through
  `connector.send_handoff` right after on_prefill_finished; RequestOutput.kv_handoff_sent says
  whether that worked. A decode request with `kv_from` instead of a handle waits (no blocks) for
  its Handoff: from `connector.poll_handoffs()` (only from the engine kv_from names) or
  `deliver_handoff()` (posted over HTTP by the router), then goes on as a request that came with
  its handle. One that waits longer than `handoff_timeout_s` fails (stage PENDING); a hand-off for
  a request not here yet is kept until it arrives or the prefill lease ends.
- while the device computes a step (decode, with hand-offs awaited or loads outstanding), the
  engine takes hand-offs, starts loads and polls them again (ModelRunner.run's while_busy), so a
  hand-off that lands mid-step has its KV read by the step's end and runs in the next step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

from pdserve.disagg.base import KVConnector, PeerMetadata, TransferError, TransferStage
from pdserve.disagg.stats import TransferStats
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, KVLoadFailurePolicy
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import FirstToken, Handoff, Request
from pdserve.engine.sampler import SampledToken
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.stop import check_stop, visible_text
from pdserve.outputs import CompletionOutput, Logprob, RequestOutput, from_entries, to_entries
from pdserve.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine")

DEFAULT_HANDOFF_TIMEOUT_S = 300.0  # a decode request waits this long for prefill's hand-off
MAX_EARLY_HANDOFFS = 4096  # hand-offs kept for requests not here yet (each ends with its lease)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int  # includes requests waiting for remote KV
    num_waiting_for_remote_kv: int
    num_held: int  # prefill role: finished requests whose blocks wait for the decode side
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_kv_load_recomputes: int = 0  # decode role: failed loads recomputed locally
    num_awaiting_handoff: int = 0  # decode role: waiting for prefill's hand-off (in num_waiting too)
    kv_window_blocks_used: int = 0  # sliding-window block space (DeepSeek-V4), block_manager.py
    kv_window_blocks_total: int = 0
    kv_state_slots_used: int = 0  # per-sequence state space (DeepSeek-V4's compressors)
    kv_state_slots_total: int = 0


class LLMEngine:
    last_schedule: SchedulerOutput | None = None  # what the latest step() ran (step-time metrics)

    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        *,
        model=None,
        kv_load_failure_policy: KVLoadFailurePolicy = "fail",
        handoff_timeout_s: float = DEFAULT_HANDOFF_TIMEOUT_S,
    ) -> None:
        """model: an already-built model (tests); by default config.model is loaded."""
        if kv_load_failure_policy not in get_args(KVLoadFailurePolicy):
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(get_args(KVLoadFailurePolicy))}, got {kv_load_failure_policy!r}")
        self.kv_load_failure_policy = kv_load_failure_policy
        self.handoff_timeout_s = handoff_timeout_s
        self.num_kv_load_recomputes = 0
        self.config = config
        self.runner = ModelRunner(config, model)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = self.runner.eos_token_ids
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from pdserve.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(config.model)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks,
            config.kv_block_size,
            window_tokens=self.runner.window_tokens,
            num_window_blocks=self.runner.num_window_blocks,
            num_state_slots=self.runner.num_state_slots,
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.connector = connector
        if connector is not None:
            connector.register_kv_cache(self.runner.kv_cache)
        self._lock = threading.Lock()
        self._new: list[Sequence] = []  # added since the last step
        self._aborts: list[str] = []  # abort requests since the last step (taken after the new ones)
        self._ids: set[str] = set()  # every request not yet fully gone (finished ones leave)
        self._arrival = itertools.count()
        self._awaiting: dict[str, tuple[Sequence, float]] = {}  # decode: request id -> (seq, monotonic deadline)
        self._posted: list[Handoff] = []  # deliver_handoff() since the last step
        self._early: dict[str, Handoff] = {}  # hand-offs that came before their request

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    # -- requests in --
    def add_request(self, request: Request, peer: PeerMetadata | None = None) -> None:
        """Admit a request (any thread); invalid ones raise ValueError and leave nothing behind.
        peer: decode role, the prefill engine's metadata the worker fetched (see KVConnector)."""
        self._validate(request)
        seq = Sequence(request, arrival=next(self._arrival), peer=peer)
        if self._detokenizes(request.params):
            from pdserve.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=request.params.skip_special_tokens, prompt_token_ids=seq.prompt_token_ids
            )
        with self._lock:
            if request.request_id in self._ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._ids.add(request.request_id)
            self._new.append(seq)

    def _validate(self, req: Request) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len} (room for at least one output token is needed)")
        vocab = self.runner.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if req.params.stop and not self._detokenizes(req.params):
            raise ValueError("stop strings need detokenization (a tokenizer, and detokenize=True)")
        if req.role != "colocated" and self.connector is None:
            raise ValueError("hold_kv / kv_handle / kv_from need an engine with a KV connector")
        if req.kv_handle is not None:
            problem = self._handoff_problem(req, req.kv_handle.num_tokens, req.first_token)
            if problem is not None:
                raise ValueError(problem)

    def _handoff_problem(self, req: Request, num_tokens: int, first: FirstToken) -> str | None:
        """Why a decode request cannot continue from this handle's KV and first token, or None."""
        n, vocab = len(req.prompt_token_ids), self.runner.model.config.vocab_size
        if num_tokens != n:
            return f"kv_handle holds {num_tokens} tokens but the prompt has {n}"
        if not 0 <= first.token_id < vocab:
            return f"first_token must lie in [0, {vocab})"
        if req.params.logprobs is not None and first.logprobs is None:
            return "params.logprobs is set: pass the first token's logprobs from the prefill output"
        return None

    def _detokenizes(self, params: SamplingParams) -> bool:
        return self.tokenizer is not None and params.detokenize

    def deliver_handoff(self, handoff: Handoff) -> None:
        """A decode request's hand-off posted over HTTP (any thread); taken at the next step."""
        with self._lock:
            self._posted.append(handoff)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (any thread). On a prefill worker this also frees KV it holds for decode."""
        with self._lock:
            self._aborts.append(request_id)

    # -- the step --
    def step(self) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        for seq in new:
            self._admit(seq, outputs)
        for request_id in aborts:
            self._abort(request_id, outputs)
        if self.connector is not None:
            self._take_handoffs(outputs)
            self._poll_connector(outputs)
        sched = self.scheduler.schedule()
        self.last_schedule = sched
        if not sched.is_empty:
            sampled = self.runner.run(sched, self._while_step_runs(outputs))
            self._postprocess(sched, sampled, outputs)
        return list(outputs.values())

    def _while_step_runs(self, outputs: dict[str, RequestOutput]) -> Callable[[], None] | None:
        """Decode with hand-offs or loads outstanding: the connector's work, done while the device
        computes the step, so a hand-off that arrives mid-step has its KV read by the step's end
        and the request runs in the next step (seen only between steps, its read would span the
        next one: a whole step more of its TTFT). None when there is nothing to wait for."""
        if self.connector is None or not (self._awaiting or self.scheduler.remote_pending or self.scheduler.loading):
            return None

        def work() -> None:
            self._take_handoffs(outputs)
            self._poll_connector(outputs)

        return work

    def _postprocess(self, sched: SchedulerOutput, sampled: list[SampledToken], outputs: dict[str, RequestOutput]) -> None:
        tokens = iter(sampled)
        for s in sched.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            self.block_manager.trim_window(seq)
            if not s.samples:
                continue
            status = self._append(seq, next(tokens))
            if status is None and seq.hold_kv:
                status = SequenceStatus.FINISHED_REMOTE_DECODE
            if status is not None:
                self._finish(seq, status)
            outputs[seq.request_id] = self._output(seq)

    def _append(self, seq: Sequence, tok: SampledToken) -> SequenceStatus | None:
        if tok.logprobs is not None:
            entry = {t: Logprob(logprob=lp, rank=r, decoded_token=self._decode_one(t)) for t, lp, r in tok.logprobs}
            seq.logprobs.append(entry)
            seq.cumulative_logprob += tok.logprobs[0][1]
        return self._push_token(seq, tok.token_id)

    def _push_token(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        seq.append_token(token_id)
        delta = seq.detokenizer.push(token_id) if seq.detokenizer is not None else ""
        status = check_stop(seq, token_id, delta, self.eos_token_ids, self.max_model_len)
        if status is SequenceStatus.FINISHED_LENGTH and seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()  # a cut-off multi-byte character ends as U+FFFD
        return status

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else None

    def _finish(self, seq: Sequence, status: SequenceStatus, error: str | None = None) -> None:
        seq.error = error
        self.scheduler.finish(seq, status)
        if status is SequenceStatus.FINISHED_REMOTE_DECODE:
            n = seq.num_computed_tokens
            try:
                nb = self.block_manager.blocks_for(n)
                seq.kv_handle = self.connector.on_prefill_finished(
                    seq.request_id, seq.block_table[:nb], n, window_block_ids=seq.window_table[:nb], state_slot=seq.state_slot,
                    kv_to=seq.peer if seq.request.kv_to is not None else None,
                )  # fmt: skip
            except Exception as e:  # a connector failure fails this request, not the engine
                self.scheduler.release_held(seq.request_id)
                seq.status, seq.error, seq.kv_handle = SequenceStatus.FINISHED_ERROR, f"{type(e).__name__}: {e}", None
            else:
                seq.handoff_sent = self._send_handoff(seq)
        if seq.request_id not in self.scheduler.held:
            self._forget(seq.request_id)

    def _send_handoff(self, seq: Sequence) -> bool:
        """Prefill: tell the decode engine of Request.kv_to that the KV is ready (the worker fetched
        its metadata into seq.peer). False when it cannot: the router posts the hand-off instead."""
        peer = seq.peer
        if seq.request.kv_to is None or peer is None or peer.data is None:
            return False
        first = FirstToken(
            token_id=seq.output_token_ids[0],
            logprobs=to_entries(seq.logprobs[0]) if seq.logprobs else None,
            text_offset=len(visible_text(seq)),
        )
        handoff = Handoff(request_id=seq.request_id, kv_handle=seq.kv_handle, first_token=first)
        try:
            self.connector.send_handoff(peer, handoff.model_dump_json(exclude_none=True).encode())
        except Exception as e:  # the router posts it instead: slower, not lost
            self.connector.stats.record_control_failure("handoff")
            log.warning("hand-off of %s to %s failed (the router posts it): %s: %s", seq.request_id, peer.engine_id, type(e).__name__, e)
            return False
        return True

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._ids.discard(request_id)

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput.model_construct(
            index=0,
            text=visible_text(seq),
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput.model_construct(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.finished,
            kv_handle=seq.kv_handle if seq.status is SequenceStatus.FINISHED_REMOTE_DECODE else None,
            kv_handoff_sent=seq.handoff_sent,
            prefill_text_offset=seq.first_token.text_offset if seq.first_token is not None else None,
            error=seq.error,
            transfer_error=seq.transfer_error,
        )

    # -- admission, aborts and PD --
    def _admit(self, seq: Sequence, outputs: dict[str, RequestOutput]) -> None:
        if seq.request.kv_from is not None and seq.first_token is None:  # decode, before its hand-off
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
            early = self._early.pop(seq.request_id, None)
            if early is not None:
                self._accept_handoff(seq, early, outputs)
            else:
                self._awaiting[seq.request_id] = (seq, time.monotonic() + self.handoff_timeout_s)
            return
        if seq.first_token is None:
            self.scheduler.add(seq)
            return
        first = seq.first_token
        if first.logprobs is not None and seq.logprobs is not None:
            entry = from_entries(first.logprobs)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[first.token_id].logprob if first.token_id in entry else 0.0
        status = self._push_token(seq, first.token_id)
        if status is not None:  # the first token already ends it: nothing to load (the lease frees prefill)
            seq.status = status
            self._forget(seq.request_id)
            outputs[seq.request_id] = self._output(seq)
            return
        self.scheduler.add_remote(seq)

    def _abort(self, request_id: str, outputs: dict[str, RequestOutput]) -> None:
        self._early.pop(request_id, None)
        waiting = self._awaiting.pop(request_id, None)
        if waiting is not None:  # no blocks yet: nothing to free
            self._end_unscheduled(waiting[0], SequenceStatus.FINISHED_ABORTED, outputs)
            return
        if request_id in self.scheduler.held:
            self._release(request_id, connector_too=True)
            return
        seq = self.scheduler.find(request_id)
        if seq is None:
            return
        if request_id in self.scheduler.loading:
            self.connector.cancel_load(request_id)
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        outputs[request_id] = self._output(seq)

    def _release(self, request_id: str, connector_too: bool) -> None:
        if connector_too and self.connector is not None:
            self.connector.release(request_id)
        if self.scheduler.release_held(request_id):
            self._forget(request_id)

    # -- the hand-off (decode) --
    def _take_handoffs(self, outputs: dict[str, RequestOutput]) -> None:
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
            if sender is not None and sender != seq.request.kv_from.engine_id:  # not whose it waits for
                log.warning("hand-off of %s from engine %s ignored: it waits for %s", seq.request_id, sender, seq.request.kv_from.engine_id)
                continue
            del self._awaiting[handoff.request_id]
            self._accept_handoff(seq, handoff, outputs)
        now, wall = time.monotonic(), time.time()
        for rid, (seq, deadline) in list(self._awaiting.items()):
            if now >= deadline:
                del self._awaiting[rid]
                why = f"no hand-off from prefill engine {seq.request.kv_from.engine_id} within {self.handoff_timeout_s:g} s"
                self._handoff_failed(seq, why, outputs)
        for rid in [rid for rid, h in self._early.items() if h.kv_handle.lease_expires_at < wall]:
            del self._early[rid]  # its prefill freed the KV already

    def _keep_early(self, handoff: Handoff) -> None:
        if len(self._early) >= MAX_EARLY_HANDOFFS:
            oldest = next(iter(self._early))
            log.warning("more than %d hand-offs for requests not here: dropped %s's", MAX_EARLY_HANDOFFS, oldest)
            del self._early[oldest]
        self._early[handoff.request_id] = handoff

    def _accept_handoff(self, seq: Sequence, handoff: Handoff, outputs: dict[str, RequestOutput]) -> None:
        expected = seq.request.kv_from.engine_id
        problem = self._handoff_problem(seq.request, handoff.kv_handle.num_tokens, handoff.first_token)
        if handoff.kv_handle.engine_id != expected:
            problem = f"the hand-off's KV is on engine {handoff.kv_handle.engine_id}, not {expected}"
        if problem is not None:
            self._handoff_failed(seq, problem, outputs)
            return
        seq.kv_handle, seq.first_token = handoff.kv_handle, handoff.first_token
        self.connector.stats.record_handoff(seq.request_id, time.monotonic())
        self._admit(seq, outputs)

    def _handoff_failed(self, seq: Sequence, reason: str, outputs: dict[str, RequestOutput]) -> None:
        err = TransferError(seq.request_id, TransferStage.PENDING, reason)
        self.connector.stats.record_failed(TransferStage.PENDING.name)
        seq.fail_transfer(err.failure)
        seq.error = str(err)
        self._end_unscheduled(seq, SequenceStatus.FINISHED_ERROR, outputs)

    def _end_unscheduled(self, seq: Sequence, status: SequenceStatus, outputs: dict[str, RequestOutput]) -> None:
        """Finish a sequence that holds no blocks and is in no scheduler queue."""
        seq.status = status
        self._forget(seq.request_id)
        outputs[seq.request_id] = self._output(seq)

    def _poll_connector(self, outputs: dict[str, RequestOutput]) -> None:
        for request_id in self.connector.poll_releases():
            self._release(request_id, connector_too=False)
        for seq in self.scheduler.admit_remote():
            try:
                self.connector.start_load(
                    seq.kv_handle, list(seq.block_table), seq.peer, local_window_block_ids=list(seq.window_table), local_state_slot=seq.state_slot
                )
                seq.advance_transfer(TransferStage.READING)
            except TransferError as e:  # hash mismatch, unknown or unreachable peer, bad block ids
                self._load_failed(seq, e, outputs)
            except Exception as e:  # a connector bug fails this request, not the engine
                self._load_failed(seq, TransferError(seq.request_id, TransferStage.PENDING, f"{type(e).__name__}: {e}"), outputs)
        done, failed = self.connector.poll_loads()
        for request_id in done:
            seq = self.scheduler.loading.get(request_id)
            if seq is not None:  # tensor parallel: rank 0 received the KV, the other ranks copy it
                self.runner.on_kv_loaded(list(seq.block_table), list(seq.window_table), seq.state_slot)
                seq.advance_transfer(TransferStage.DONE)
            self.scheduler.on_loaded(request_id)
        for err in failed:
            seq = self.scheduler.loading.get(err.request_id)
            if seq is not None:
                self._load_failed(seq, err, outputs)

    def _load_failed(self, seq: Sequence, err: TransferError, outputs: dict[str, RequestOutput]) -> None:
        seq.fail_transfer(err.failure)
        if self.kv_load_failure_policy == "recompute":
            self.scheduler.recompute(seq)
            self.num_kv_load_recomputes += 1
            return
        self._finish(seq, SequenceStatus.FINISHED_ERROR, str(err))
        outputs[seq.request_id] = self._output(seq)

    # -- queries --
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._new or self._aborts or self._posted)
        return pending or bool(self._awaiting) or self.scheduler.num_unfinished > 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes, if any (after the step loop has stopped)."""
        self.runner.shutdown()

    def has_held_kv(self) -> bool:
        """Prefill role: blocks still pinned for decode workers (keep stepping to poll releases)."""
        return bool(self.scheduler.held)

    def transfer_stats(self) -> TransferStats | None:
        """The connector's counters (read on the step loop's thread), None without a connector."""
        return self.connector.stats if self.connector is not None else None

    def get_stats(self) -> EngineStats:
        c = self.scheduler.counts()
        awaiting = len(self._awaiting)
        return EngineStats(
            num_running=c.running,
            num_waiting=c.waiting + awaiting,
            num_waiting_for_remote_kv=c.waiting_for_remote_kv + awaiting,
            num_held=c.held,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_total_blocks,
            num_preemptions=c.preemptions,
            num_kv_load_recomputes=self.num_kv_load_recomputes,
            num_awaiting_handoff=awaiting,
            kv_window_blocks_used=self.block_manager.num_used_window_blocks,
            kv_window_blocks_total=self.block_manager.num_total_window_blocks,
            kv_state_slots_used=self.block_manager.num_used_state_slots,
            kv_state_slots_total=self.block_manager.num_total_state_slots,
        )
