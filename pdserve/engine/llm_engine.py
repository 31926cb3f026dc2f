"""The engine loop: add_request -> step (schedule -> run -> sample -> stop checks) -> RequestOutputs.

A step notes the sequences it advanced or ended and builds one output each at its end, as the
request's `output_kind` asks: the new tokens, text and logprobs since its last output (delta),
everything so far (cumulative), or everything once it finishes (final_only). Per token the engine
appends to the sequence and reads only the new end of its text (detokenizer, stop strings, a
delta), so a step's host work does not grow with the outputs' length, except for cumulative
outputs, which copy the whole output at every step.

add_request and abort_request may be called from any thread: a Request is validated at once (bad
input raises ValueError in the caller) and takes effect at the start of the next step(). step()
itself must be called from one thread at a time.

With a KV connector (PD) the engine owns a RemoteKV (remote_kv.py): held KV, hand-offs and loads,
polled at each step's start and, on a decode worker waiting for some, while the device computes
(ModelRunner.run's while_busy): a hand-off landing mid-step runs in the next step.
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
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.prefix_cache import engine_root
from pdserve.engine.remote_kv import DEFAULT_HANDOFF_TIMEOUT_S, RemoteEvents, RemoteKV, handoff_problem
from pdserve.engine.request import Handoff, Request
from pdserve.engine.sampler import SampledToken
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode.decoder import SpecDecoder
from pdserve.engine.stop import check_stop, visible_len
from pdserve.outputs import CompletionOutput, Logprob, RequestOutput, from_entries
from pdserve.sampling_params import RequestOutputKind, SamplingParams
from pdserve.structured.matcher import RequestMatcher

Touched = dict[str, Sequence]  # a step's sequences with an output to give, by request id


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
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
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
        self._arrival = itertools.count()

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
        grammar = self._grammar(request.params)
        seq = Sequence(request, arrival=next(self._arrival), peer=peer)
        seq.grammar = grammar
        if self.tokenizer is not None and request.params.detokenize:
            from pdserve.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=request.params.skip_special_tokens,
                prompt_token_ids=seq.prompt_token_ids,
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
            raise ValueError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len} (room for at least one output token is needed)"
            )
        vocab = self.runner.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t in req.params.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        if req.params.stop and not (self.tokenizer is not None and req.params.detokenize):
            raise ValueError("stop strings need detokenization (a tokenizer, and detokenize=True)")
        if req.role != "colocated" and self.connector is None:
            raise ValueError("hold_kv / kv_handle / kv_from need an engine with a KV connector")
        if req.kv_handle is not None:
            problem = handoff_problem(req, req.kv_handle, req.first_token, vocab, self.remote_kv.mtp_bytes)
            if problem is not None:
                raise ValueError(problem)

    def _grammar(self, params: SamplingParams) -> RequestMatcher | None:
        """The request's matcher (its spec compiled once per engine, then cached); ValueError when
        the grammar library rejects the spec."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (this engine has skip_tokenizer_init)")
        from pdserve.structured.compiler import compiler_for

        compiler = compiler_for(self.tokenizer, self.runner.model.config.vocab_size, sorted(self.eos_token_ids))
        return RequestMatcher(compiler.compile(spec), spec)

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
        self.last_schedule = sched
        if not sched.is_empty:
            self.runner.copy_records(self.block_manager.take_copies())
            if self.spec is not None:
                self.spec.begin(sched)
            sampled = self.runner.run(sched, self._while_step_runs(touched))
            self._postprocess(sched, sampled, touched)
            if self.spec is not None:
                self.spec.propose(sched)
            for s in sched.scheduled:  # after the drafts: V4's MTP pass reads the window the step read
                self.block_manager.trim_window(s.seq)
            self._hold(touched)
        return self._outputs(touched)

    def _while_step_runs(self, touched: Touched) -> Callable[[], None] | None:
        """Decode with hand-offs or loads outstanding: the connector's work, done while the device
        computes the step, so a hand-off that arrives mid-step has its KV read by the step's end
        and the request runs in the next step (seen only between steps, its read would span the
        next one: a whole step more of its TTFT). None when there is nothing to wait for."""
        if self.remote_kv is None or not self.remote_kv.busy():
            return None
        return lambda: self._poll_remote(touched)

    def _postprocess(self, sched: SchedulerOutput, sampled: list[SampledToken], touched: Touched) -> None:
        tokens = iter(sampled)
        for s in sched.scheduled:
            seq = s.seq
            tok = next(tokens) if s.samples else None
            # a verify chunk computed its drafts' KV too; only accepted ones (tok.more) count
            accepted = len(tok.more) if tok is not None else 0
            seq.num_computed_tokens += s.num_tokens - s.num_spec + accepted
            if self.spec is not None:
                self.spec.settle(s, accepted)
            if tok is None:
                self.block_manager.cache_computed(seq)
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
        self.scheduler.finish(seq, status)
        if status is SequenceStatus.FINISHED_REMOTE_DECODE:  # leased after the step's drafts pass (MTP's hidden state)
            self._holding.append(seq)
        elif seq.request_id not in self.scheduler.held:
            self._forget(seq.request_id)

    def _hold(self, touched: Touched) -> None:
        holding, self._holding = self._holding, []
        for seq in holding:
            self.remote_kv.hold(seq)
            if seq.request_id not in self.scheduler.held:
                self._forget(seq.request_id)
            touched[seq.request_id] = seq

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._ids.discard(request_id)

    def _outputs(self, touched: Touched) -> list[RequestOutput]:
        """The step's outputs, built once per sequence from its state at the step's end."""
        outputs = (self._output(seq) for seq in touched.values())
        return [out for out in outputs if out is not None]

    def _output(self, seq: Sequence) -> RequestOutput | None:
        kind = seq.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not seq.finished:
            return None
        sent = seq.num_sent_tokens if kind is RequestOutputKind.DELTA else 0
        shown = seq.num_sent_chars if kind is RequestOutputKind.DELTA else 0
        visible = max(visible_len(seq), shown)
        seq.num_sent_tokens, seq.num_sent_chars = seq.num_output_tokens, visible
        completion = CompletionOutput.model_construct(
            index=0,
            text=seq.output_text.slice(shown, visible),
            token_ids=seq.output_token_ids[sent:],
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs[sent:] if seq.logprobs is not None else None,
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
            num_cached_tokens=seq.num_cached_tokens,
        )

    # -- admission, aborts and PD --
    def _admit(self, seq: Sequence, touched: Touched) -> None:
        if seq.request.kv_from is not None and seq.first_token is None:  # decode, before its hand-off
            self._on_remote(self.remote_kv.wait(seq), touched)
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
            self._end(seq, touched)
            return
        self.scheduler.add_remote(seq)

    def _abort(self, request_id: str, touched: Touched) -> None:
        if self.remote_kv is not None:
            events = self.remote_kv.abort(request_id)
            if events is not None:
                self._on_remote(events, touched)
                return
        seq = self.scheduler.find(request_id)
        if seq is None:
            return
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        touched[request_id] = seq

    def _poll_remote(self, touched: Touched) -> None:
        """Hand-offs first: a request they make ready gets its load started by the poll."""
        self._on_remote(self.remote_kv.take_handoffs(), touched)
        self._on_remote(self.remote_kv.poll(), touched)

    def _on_remote(self, events: RemoteEvents, touched: Touched) -> None:
        for request_id in events.freed:
            self._forget(request_id)
        for seq in events.ended:
            self._end(seq, touched)
        for seq in events.ready:
            self._admit(seq, touched)

    def _end(self, seq: Sequence, touched: Touched) -> None:
        """Output a sequence finished outside the scheduler's queues (it holds no blocks)."""
        self._forget(seq.request_id)
        touched[seq.request_id] = seq

    # -- queries --
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._new or self._aborts)
        remote = self.remote_kv is not None and self.remote_kv.has_pending()
        return pending or remote or self.scheduler.num_unfinished > 0

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
