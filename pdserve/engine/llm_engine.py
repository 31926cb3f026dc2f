"""The engine loop: add_request -> step (schedule -> launch -> read the step before -> stop checks) -> RequestOutputs.

A step notes the sequences it advanced or ended and builds one output each at its end, as the
request's `output_kind` asks (step_outputs.py). Per token the engine appends to the sequence and
reads only the new end of its text, so a step's host work does not grow with the outputs' length
(except cumulative outputs', which copy the whole output at every step).

add_request and abort_request may be called from any thread: a Request is validated at once (bad
input raises ValueError in the caller) and takes effect at the start of the next step(). step()
itself must be called from one thread at a time.

The overlapped loop (async_scheduling; docs/architecture.md): step() launches step n + 1, then
reads step n, whose bookkeeping runs while n + 1 computes; a row whose input is a token in flight
gets it on the device. A step with a row that needs its token on the host first
(launched_step.needs_host) or drafts is read at once, as in the serial loop.

With a KV connector (PD) the engine owns a RemoteKV (remote_kv.py): held KV, hand-offs and loads,
polled at each step's start and, in the serial loop on a decode worker waiting for some, while
the device computes (LaunchedStep.read's while_busy).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import get_args

from pdserve.disagg.base import KVConnector, PeerMetadata
from pdserve.disagg.stats import TransferStats
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, KVLoadFailurePolicy
from pdserve.engine.engine_stats import EngineStats, collect_stats
from pdserve.engine.forks import Forker, hands_off_at_fork
from pdserve.engine.launched_step import LaunchedStep, needs_host, wait_for_device
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.new_sequence import SequenceMaker
from pdserve.engine.prefix_cache import engine_root
from pdserve.engine.remote_kv import DEFAULT_HANDOFF_TIMEOUT_S, RemoteEvents, RemoteKV
from pdserve.engine.request import Handoff, Request
from pdserve.engine.request_checks import check_request
from pdserve.engine.sampler import SampledToken
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import SeqGroup, Sequence, SequenceStatus
from pdserve.engine.spec_decode.decoder import SpecDecoder
from pdserve.engine.step_outputs import step_outputs
from pdserve.engine.stop import check_stop
from pdserve.model.kv_cache import TOKENS
from pdserve.outputs import Logprob, RequestOutput, from_entries

Touched = dict[str, Sequence]  # a step's sequences with an output to give, by request id
_Launched = tuple[SchedulerOutput, LaunchedStep]  # a step on the device, its tokens not read yet


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
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(get_args(KVLoadFailurePolicy))}, got {kv_load_failure_policy!r}"
            )
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
            prefix_root=engine_root(self.config, self.runner),
            num_checkpoints=self.runner.num_checkpoints,
            record_span=max(
                (s.tokens_per_record for s in self.kv_cache.specs.values() if s.space == TOKENS), default=1
            ),
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        vocab_size = self.runner.model.config.vocab_size
        self.maker = SequenceMaker(self.tokenizer, vocab_size, self.eos_token_ids, self.max_model_len)
        new_child = lambda parent, index: self.maker.child(parent, index, next(self._arrival))  # noqa: E731
        self.forker = Forker(self.scheduler, self.block_manager, new_child)
        self.spec = SpecDecoder.for_engine(config, self.runner, self.block_manager)  # None: none
        self.connector = connector
        self.remote_kv: RemoteKV | None = None
        if connector is not None:
            connector.register_kv_cache(self.runner.kv_cache)
            self.remote_kv = RemoteKV(
                connector, self.scheduler, self.block_manager, self.runner,
                policy=kv_load_failure_policy, handoff_timeout_s=handoff_timeout_s,
            )  # fmt: skip
        self._lock = threading.Lock()
        self._new: list[Sequence] = []  # added since the last step
        self._holding: list[Sequence] = []  # prefill: finished this step, their KV leased at its end
        self._aborts: list[str] = []  # abort requests since the last step (taken after the new ones)
        self._ids: set[str] = set()  # every request not yet fully gone (finished ones leave)
        self._groups: dict[str, SeqGroup] = {}  # n > 1: the requests' sequences, until all finish
        self._arrival = itertools.count()
        self._inflight: _Launched | None = None  # the overlapped loop's step on the device
        self._unfreed: list[Sequence] = []  # finished, blocks kept until the steps writing them are read
        overlap = config.async_scheduling  # the overlapped loop (vLLM's async scheduling): on CUDA by default
        self.async_scheduling = self.runner.device.type == "cuda" if overlap is None else overlap

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
        check_request(
            request, self.max_model_len, self.runner.model.config.vocab_size, self.tokenizer is not None, self.remote_kv
        )
        seq = self.maker.make(request, next(self._arrival), peer)
        with self._lock:
            if request.request_id in self._ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._ids.add(request.request_id)
            self._new.append(seq)
            if seq.group is not None:
                self._groups[request.request_id] = seq.group

    def deliver_handoff(self, handoff: Handoff) -> None:
        """A decode request's hand-off posted over HTTP (any thread); taken at the next step."""
        if self.remote_kv is None:
            raise ValueError("a hand-off needs an engine with a KV connector")
        self.remote_kv.deliver(handoff)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (any thread). On a prefill worker this also frees KV it holds for decode."""
        with self._lock:
            self._aborts.append(request_id)

    # -- the step --
    def step(self) -> list[RequestOutput]:
        touched: Touched = {}
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        for seq in new:
            self._admit(seq, touched)
        for request_id in aborts:
            self._abort(request_id, touched)
        if self.remote_kv is not None:
            self._poll_remote(touched)
        if self.spec is not None:  # drafts for requests whose KV arrived: they verify at their first step
            self.spec.propose_waiting(self.scheduler.waiting)
        sched = self.scheduler.schedule()
        self.forker.fork_scheduled(sched)  # n > 1: the step computes their last prompt token
        self.last_schedule = sched
        launched = self._launch(sched) if not sched.is_empty else None
        previous, self._inflight = self._inflight, None
        if previous is not None:  # the step before, read while this one runs (no KV loads meanwhile:
            self._resolve(previous, touched, poll=False)  # blocks this schedule preempted are still written)
        if launched is not None and self._overlaps(sched):
            self._inflight = launched
        elif launched is not None:
            self._resolve(launched, touched, poll=True)
        self._hold(touched)
        return self._outputs(touched)

    def _launch(self, sched: SchedulerOutput) -> _Launched:
        """Queue the step on the device and count its tokens computed. A chunk that does not sample
        registers its blocks now: a prefix checkpoint at its end is copied before the next forward."""
        self.runner.copy_records(self.block_manager.take_copies())
        if self.spec is not None:
            self.spec.begin(sched)
        step = self.runner.launch(sched, self._inflight[1] if self._inflight is not None else None)
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_tokens - s.num_spec  # + accepted drafts, when read
            s.seq.num_inflight += s.samples
            if not s.samples:
                self.block_manager.cache_computed(s.seq)
            if hands_off_at_fork(s.seq):  # n > 1 on a prefill worker: decode forks (forks.py)
                self._finish(s.seq, SequenceStatus.FINISHED_REMOTE_DECODE)
        return sched, step

    def _overlaps(self, sched: SchedulerOutput) -> bool:
        """Whether the next step may launch before this one's tokens are read: not where a row needs
        its token on the host first (docs/architecture.md, the overlapped loop)."""
        if not self.async_scheduling or self.spec is not None:
            return False
        return not any(s.samples and needs_host(s.seq) for s in sched.scheduled)

    def _while_step_runs(self, touched: Touched) -> Callable[[], None] | None:
        """Decode with hand-offs or loads outstanding: the connector's work while the device computes
        the step, so a hand-off arriving mid-step runs in the next step (seen only between steps, its
        read would span the next one: a step more of TTFT). None: nothing to wait for."""
        if self.remote_kv is None or not self.remote_kv.busy():
            return None
        return lambda: self._poll_remote(touched)

    def _resolve(self, launched: _Launched, touched: Touched, poll: bool) -> None:
        """Read a launched step's tokens and do its bookkeeping: outputs, stop checks, blocks. A
        sequence that ended while the step ran (a stop read one step late, an abort) drops its token."""
        sched, step = launched
        tokens = iter(step.read(self._while_step_runs(touched) if poll else None))
        for s in sched.scheduled:
            seq = s.seq
            tok = next(tokens) if s.samples else None
            # a verify chunk computed its drafts' KV too; only accepted ones (tok.more) count
            accepted = len(tok.more) if tok is not None else 0
            seq.num_computed_tokens += accepted
            if self.spec is not None:
                self.spec.settle(s, accepted)
            if tok is None:
                continue
            seq.num_inflight -= 1
            if seq.finished:
                continue
            status = self._append(seq, tok)
            for extra in tok.more:
                if status is not None:
                    break
                status = self._append(seq, extra)
            self.block_manager.cache_computed(seq)  # after accepted drafts joined token_ids: a block hashes its own
            if status is None and seq.hold_kv:
                status = SequenceStatus.FINISHED_REMOTE_DECODE
            if status is not None:
                self._finish(seq, status)
            touched[seq.request_id] = seq
        if self.spec is not None:
            self.spec.propose(sched)
        for s in sched.scheduled:  # after the drafts: V4's MTP pass reads the window the step read
            self.block_manager.trim_window(s.seq)
        for seq in [q for q in self._unfreed if q.num_inflight == 0]:
            self._unfreed.remove(seq)
            self.block_manager.free(seq)

    def _append(self, seq: Sequence, tok: SampledToken) -> SequenceStatus | None:
        if tok.logprobs is not None:
            entry = {t: Logprob(logprob=lp, rank=r, decoded_token=self._decode_one(t)) for t, lp, r in tok.logprobs}
            seq.logprobs.append(entry)
            seq.cumulative_logprob += tok.logprobs[0][1]
        return self._push_token(seq, tok.token_id)

    def _push_token(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        seq.append_token(token_id)
        if seq.grammar is not None and not seq.grammar.advance(token_id):
            seq.error = f"structured outputs: {seq.grammar.error}"  # a masked token was sampled
            return SequenceStatus.FINISHED_ERROR
        delta = seq.detokenizer.push(token_id) if seq.detokenizer is not None else ""
        status = check_stop(seq, token_id, delta, self.eos_token_ids, self.max_model_len)
        if status is SequenceStatus.FINISHED_LENGTH and seq.detokenizer is not None:
            seq.output_text.append(seq.detokenizer.flush())  # a cut-off multi-byte character ends as U+FFFD
        return status

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else None

    def _finish(self, seq: Sequence, status: SequenceStatus, error: str | None = None) -> None:
        seq.error = error or seq.error
        # a launched step still writes its blocks (a stop or abort read while its next row runs):
        # freed once that step is read, so no KV load lands in them meanwhile
        self.scheduler.finish(seq, status, free=seq.num_inflight == 0)
        if seq.num_inflight and status is not SequenceStatus.FINISHED_REMOTE_DECODE:
            self._unfreed.append(seq)
        if status is SequenceStatus.FINISHED_REMOTE_DECODE:  # leased after the step's drafts pass (MTP's hidden state)
            self._holding.append(seq)
        elif seq.request_id not in self.scheduler.held:
            self._forget(seq)

    def _hold(self, touched: Touched) -> None:
        holding, self._holding = self._holding, []
        if any(seq.fork_at is not None for seq in holding):  # KV of a step no token was read from
            wait_for_device(self.runner.device)
        for seq in holding:
            self.remote_kv.hold(seq)
            if seq.request_id not in self.scheduler.held:
                self._forget(seq)
            touched[seq.request_id] = seq

    def _forget(self, seq: Sequence) -> None:
        """seq's request id is free again once every sequence of its request has finished."""
        if seq.group is not None and not seq.group.finished:
            return
        with self._lock:
            self._ids.discard(seq.request.request_id)
            self._groups.pop(seq.request.request_id, None)

    def _outputs(self, touched: Touched) -> list[RequestOutput]:
        """The step's outputs, built once per sequence from its state at the step's end."""
        outputs = step_outputs(touched.values())
        return [out for out in outputs if out is not None]

    # -- admission, aborts and PD --
    def _admit(self, seq: Sequence, touched: Touched) -> None:
        if seq.request.kv_from is not None and seq.kv_handle is None:  # decode, before its hand-off
            self._on_remote(self.remote_kv.wait(seq), touched)
            return
        status = self._resume(seq)
        first = seq.first_token
        if status is None and first is not None:
            if first.logprobs is not None and seq.logprobs is not None:
                entry = from_entries(first.logprobs)
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[first.token_id].logprob if first.token_id in entry else 0.0
            status = self._push_token(seq, first.token_id)
        if status is not None:  # its first token (or resumed output) ends it: nothing to run (a lease frees prefill)
            seq.status = status
            self._end(seq, touched)
        elif first is None and seq.kv_handle is None:
            self.scheduler.add(seq)
        else:
            self.scheduler.add_remote(seq)

    def _resume(self, seq: Sequence) -> SequenceStatus | None:
        """A migrated request's output so far (Request.resume) becomes its first outputs, once (a
        decode request is admitted again after its hand-off); their logprobs were sent already."""
        resume = seq.request.resume
        if resume is None or seq.output_token_ids:
            return None
        status = None
        for token_id in resume.token_ids:
            if seq.logprobs is not None:
                seq.logprobs.append({})
            status = status or self._push_token(seq, token_id)
        return status

    def _abort(self, request_id: str, touched: Touched) -> None:
        if self.remote_kv is not None:
            events = self.remote_kv.abort(request_id)
            if events is not None:
                self._on_remote(events, touched)
                return
        group = self._groups.get(request_id)  # n > 1: all of its sequences
        seq = self.scheduler.find(request_id)
        for s in group.seqs if group is not None else [seq] if seq is not None else []:
            if not s.finished:
                self._finish(s, SequenceStatus.FINISHED_ABORTED)
                touched[s.request_id] = s

    def _poll_remote(self, touched: Touched) -> None:
        """Hand-offs first: a request they make ready gets its load started by the poll."""
        self._on_remote(self.remote_kv.take_handoffs(), touched)
        self._on_remote(self.remote_kv.poll(), touched)

    def _on_remote(self, events: RemoteEvents, touched: Touched) -> None:
        for request_id in events.freed:
            with self._lock:
                self._ids.discard(request_id)
        for seq in events.ended:
            self._end(seq, touched)
        for seq in events.ready:
            self._admit(seq, touched)

    def _end(self, seq: Sequence, touched: Touched) -> None:
        """Output a sequence finished outside the scheduler's queues (it holds no blocks)."""
        self._forget(seq)
        touched[seq.request_id] = seq

    # -- queries --
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._new or self._aborts)
        remote = self.remote_kv is not None and self.remote_kv.has_pending()
        return pending or remote or self.scheduler.num_unfinished > 0 or self._inflight is not None

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
        return collect_stats(self.scheduler, self.block_manager, self.remote_kv)
