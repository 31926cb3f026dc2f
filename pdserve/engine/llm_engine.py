"""The engine loop: add_request -> step (schedule -> run -> sample -> stop checks) -> RequestOutputs.

add_request, abort_request and release_kv may be called from any thread: they are validated at
once (bad input raises ValueError in the caller) and take effect at the start of the next step().
step() itself must be called from one thread at a time.

PD hooks (pdserve.disagg.base.KVConnector), called from step():
- prefill role (`hold_kv=True`): after the first sampled token the request finishes; unless that
  token already stopped it, its blocks stay pinned and `connector.on_prefill_finished` gives the
  KVHandle returned in the final RequestOutput. `poll_releases()` (decode read it, or the lease
  expired) and `release_kv()` free them.
- decode role (`kv_handle=..., first_token=...`): blocks for the prompt are allocated when free,
  `connector.start_load(handle, block_ids)` reads the prompt KV, `poll_loads()` lets finished
  ones run (the first token is their first output and next input). A failed load (TransferError)
  follows `kv_load_failure_policy` (vLLM's name): "fail" finishes the request with finish_reason
  "error" and the TransferError text in RequestOutput.error; "recompute" drops the blocks and
  computes the prompt here (the first token stays prefill's), so the output is what a colocated
  engine gives, never tokens from partial KV.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Literal

from pdserve.disagg.base import KVConnector, KVHandle
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import SampledToken
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.stop import check_stop, visible_text
from pdserve.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.sampling_params import SamplingParams

KVLoadFailurePolicy = Literal["fail", "recompute"]
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


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


class LLMEngine:
    last_schedule: SchedulerOutput | None = None  # what the latest step() ran (step-time metrics)

    def __init__(
        self, config: EngineConfig, connector: KVConnector | None = None, *, model=None, kv_load_failure_policy: KVLoadFailurePolicy = "fail"
    ) -> None:
        """model: an already-built model (tests); by default config.model is loaded."""
        if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, got {kv_load_failure_policy!r}")
        self.kv_load_failure_policy = kv_load_failure_policy
        self.num_kv_load_recomputes = 0
        self.config = config
        self.runner = ModelRunner(config, model)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = self.runner.eos_token_ids
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            from pdserve.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(config.model)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.kv_block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.connector = connector
        if connector is not None:
            connector.register_kv_cache(self.runner.kv_cache)
        self._lock = threading.Lock()
        self._inbox: list[Callable[[dict[str, RequestOutput]], None]] = []
        self._ids: set[str] = set()  # every request not yet fully gone (finished ones leave)
        self._arrival = itertools.count()

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    # -- requests in --
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        kv_handle: KVHandle | None = None,
        first_token: int | None = None,
        first_token_logprobs: dict[int, Logprob] | None = None,
        hold_kv: bool = False,
    ) -> None:
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params, kv_handle, first_token, first_token_logprobs, hold_kv)
        seq = Sequence(request_id, prompt_token_ids, params, prompt=prompt, hold_kv=hold_kv, kv_handle=kv_handle, arrival=next(self._arrival))
        if self._detokenizes(params):
            from pdserve.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_token_ids=prompt_token_ids
            )
        with self._lock:
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._ids.add(request_id)
            if kv_handle is None:
                self._inbox.append(lambda outs: self.scheduler.add(seq))
            else:
                self._inbox.append(lambda outs: self._add_remote(seq, first_token, first_token_logprobs, outs))

    def _validate(self, prompt_token_ids, params, kv_handle, first_token, first_token_logprobs, hold_kv) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len} (room for at least one output token is needed)")
        vocab = self.runner.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if params.stop and not self._detokenizes(params):
            raise ValueError("stop strings need detokenization (a tokenizer, and detokenize=True)")
        if (hold_kv or kv_handle is not None) and self.connector is None:
            raise ValueError("hold_kv / kv_handle need an engine with a KV connector")
        if hold_kv and kv_handle is not None:
            raise ValueError("a request is either prefill (hold_kv) or decode (kv_handle), not both")
        if (kv_handle is None) != (first_token is None):
            raise ValueError("kv_handle and first_token go together (decode role)")
        if kv_handle is not None:
            if kv_handle.num_tokens != n:
                raise ValueError(f"kv_handle holds {kv_handle.num_tokens} tokens but the prompt has {n}")
            if not 0 <= first_token < vocab:
                raise ValueError(f"first_token must lie in [0, {vocab})")
            if params.logprobs is not None and first_token_logprobs is None:
                raise ValueError("params.logprobs is set: pass first_token_logprobs from the prefill output")

    def _detokenizes(self, params: SamplingParams) -> bool:
        return self.tokenizer is not None and params.detokenize

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(lambda outs: self._abort(request_id, outs))

    def release_kv(self, request_id: str) -> None:
        """Prefill role: free a held request's blocks now (e.g. aborted before decode read them)."""
        with self._lock:
            self._inbox.append(lambda outs: self._release(request_id, connector_too=True))

    # -- the step --
    def step(self) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for command in inbox:
            command(outputs)
        if self.connector is not None:
            self._poll_connector(outputs)
        sched = self.scheduler.schedule()
        self.last_schedule = sched
        if not sched.is_empty:
            sampled = self.runner.run(sched)
            self._postprocess(sched, sampled, outputs)
        return list(outputs.values())

    def _postprocess(self, sched: SchedulerOutput, sampled: list[SampledToken], outputs: dict[str, RequestOutput]) -> None:
        tokens = iter(sampled)
        for s in sched.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
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
                seq.kv_handle = self.connector.on_prefill_finished(seq.request_id, seq.block_table[: self.block_manager.blocks_for(n)], n)
            except Exception as e:  # a connector failure fails this request, not the engine
                self.scheduler.release_held(seq.request_id)
                seq.status, seq.error, seq.kv_handle = SequenceStatus.FINISHED_ERROR, f"{type(e).__name__}: {e}", None
        if seq.request_id not in self.scheduler.held:
            self._forget(seq.request_id)

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
            error=seq.error,
        )

    # -- aborts and PD --
    def _find(self, request_id: str) -> Sequence | None:
        s = self.scheduler
        for seq in itertools.chain(s.running, s.waiting, s.remote_pending):
            if seq.request_id == request_id:
                return seq
        return s.loading.get(request_id)

    def _abort(self, request_id: str, outputs: dict[str, RequestOutput]) -> None:
        if request_id in self.scheduler.held:
            self._release(request_id, connector_too=True)
            return
        seq = self._find(request_id)
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

    def _add_remote(self, seq: Sequence, first_token: int, first_logprobs, outputs: dict[str, RequestOutput]) -> None:
        if first_logprobs is not None and seq.logprobs is not None:
            seq.logprobs.append(dict(first_logprobs))
            seq.cumulative_logprob += first_logprobs[first_token].logprob if first_token in first_logprobs else 0.0
        status = self._push_token(seq, first_token)
        if status is not None:  # the first token already ends it: nothing to load (the lease frees prefill)
            seq.status = status
            self._forget(seq.request_id)
            outputs[seq.request_id] = self._output(seq)
            return
        self.scheduler.add_remote(seq)

    def _poll_connector(self, outputs: dict[str, RequestOutput]) -> None:
        for request_id in self.connector.poll_releases():
            self._release(request_id, connector_too=False)
        for seq in self.scheduler.admit_remote():
            try:
                self.connector.start_load(seq.kv_handle, list(seq.block_table))
            except Exception as e:  # TransferError (hash mismatch, unknown peer) or worse
                self._load_failed(seq, str(e), outputs)
        done, failed = self.connector.poll_loads()
        for request_id in done:
            seq = self.scheduler.loading.get(request_id)
            if seq is not None:  # tensor parallel: rank 0 received the KV, the other ranks copy it
                self.runner.on_kv_loaded(list(seq.block_table))
            self.scheduler.on_loaded(request_id)
        for err in failed:
            seq = self.scheduler.loading.get(err.request_id)
            if seq is not None:
                self._load_failed(seq, str(err), outputs)

    def _load_failed(self, seq: Sequence, error: str, outputs: dict[str, RequestOutput]) -> None:
        if self.kv_load_failure_policy == "recompute":
            self.scheduler.recompute(seq)
            self.num_kv_load_recomputes += 1
            return
        self._finish(seq, SequenceStatus.FINISHED_ERROR, error)
        outputs[seq.request_id] = self._output(seq)

    # -- queries --
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._inbox)
        return pending or self.scheduler.num_unfinished > 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes, if any (after the step loop has stopped)."""
        self.runner.shutdown()

    def has_held_kv(self) -> bool:
        """Prefill role: blocks still pinned for decode workers (keep stepping to poll releases)."""
        return bool(self.scheduler.held)

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        remote = len(s.remote_pending) + len(s.loading)
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + remote,
            num_waiting_for_remote_kv=remote,
            num_held=len(s.held),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_total_blocks,
            num_preemptions=s.num_preemptions,
            num_kv_load_recomputes=self.num_kv_load_recomputes,
        )
