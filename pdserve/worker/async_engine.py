"""Runs an LLMEngine's step loop on its own thread and hands each request's outputs to asyncio.

    HTTP handler --add()--> engine inbox        engine thread: step() -> RequestOutputs (deltas)
    HTTP handler <--RequestStream (the deltas not yet read, as one; an asyncio.Event)--+

Requests are added with output_kind DELTA: each output holds only what is new, so a step's work
does not grow with the outputs' length. A stream folds the deltas its reader has not taken into
one (`RequestOutput.add`): a slow reader never makes a queue grow, it just reads a bigger delta.
The thread sleeps while there is nothing to do, polls often
while KV loads are in flight, and now and then while prefill holds KV (to see releases and lease
expiries). If step() raises, the engine is dead (`fail`): every open stream gets an error output
naming the exception's type (the traceback goes to the log), `alive` turns False, /health says why,
and the worker exits for its supervisor to restart it (failure.py); a TP rank that has exited
(`dead_rank`) fails the engine the same way. The thread beats (`last_beat`) at every turn of its
loop, so a step that hangs (a stopped rank, a stuck collective) shows as a beat that grows old while
requests are open: `stalled()` says so once it is older than the stall timeout, and /health is 503.
Around each step a RequestTimer (timing.py) notes when a request first ran and, with the first
output that holds a new token, gives the stream its RequestTiming.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from pdserve.disagg.base import PeerMetadata
from pdserve.engine.llm_engine import EngineStats, LLMEngine
from pdserve.engine.request import Handoff, Request
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import RequestOutputKind
from pdserve.wire.protocol import RequestTiming
from pdserve.worker.fault_hook import FaultHook
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.timing import RequestTimer

log = logging.getLogger("pdserve.worker")

IDLE_WAIT_S = 0.5  # nothing to do: wake at least this often (liveness)
HELD_POLL_S = 0.02  # prefill holds KV: look for release notifications this often
LOAD_POLL_S = 0.001  # decode waits for KV reads only: poll the transfers this often
DEFAULT_STALL_S = 60.0


class RequestStream:
    """One request's outputs, readable from the event loop the request was added on."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._unread: RequestOutput | None = None  # the deltas put and not yet read, folded
        self._lock = threading.Lock()  # put (engine thread) against the read (event loop)
        self._event = asyncio.Event()
        self.finished = False
        self.timing: RequestTiming | None = None  # set with the first output holding a new token

    def put(self, out: RequestOutput, timing: RequestTiming | None = None) -> None:
        """Engine thread; `out` is the request's next delta."""
        if timing is not None:
            self.timing = timing
        with self._lock:
            if self._unread is None:
                self._unread = out
            else:
                self._unread.add(out)
        self._loop.call_soon_threadsafe(self._event.set)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            await self._event.wait()
            self._event.clear()
            with self._lock:
                out, self._unread = self._unread, None
            if out is None:
                continue
            self.finished = out.finished
            yield out


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, metrics: WorkerMetrics | None = None, stall_s: float = DEFAULT_STALL_S
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stall_s = stall_s
        self._streams: dict[str, RequestStream] = {}
        self.timer = RequestTimer()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self.error: str | None = None
        self._failing = threading.Lock()
        self.last_beat = time.monotonic()
        self._fault = FaultHook.from_env()  # tests only: None unless PDSERVE_TEST_FAULT is set

    # -- lifecycle --
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    def heartbeat_age(self) -> float:
        """Seconds since the engine thread last went round its loop (idle, it does every IDLE_WAIT_S)."""
        return time.monotonic() - self.last_beat

    def stalled(self) -> str | None:
        """Why this engine cannot serve although its thread lives: a step that does not finish."""
        age = self.heartbeat_age()
        if age <= self.stall_s or not self._streams:
            return None
        return f"engine step not finished for {age:.1f} s with {len(self._streams)} requests open (stall_timeout {self.stall_s:g} s)"

    @property
    def num_open(self) -> int:
        """Requests this worker is serving (admitted, not finished)."""
        return len(self._streams)

    def dead_rank(self) -> str | None:
        """Which tensor-parallel rank process has exited, if one has (None at TP1). Any thread."""
        ranks = self.engine.runner.ranks
        return ranks.exited() if ranks is not None else None

    def fail(self, reason: str) -> None:
        """The engine cannot serve any more: end every open request with `reason` (its client sees
        it), refuse new ones. Any thread; the first reason stays."""
        with self._failing:
            if self.error is None:
                self.error = reason
            self._fail_all(self.error)

    def stats(self) -> EngineStats:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """After stop(): end the engine's tensor-parallel rank processes, if any."""
        self.engine.shutdown()

    # -- requests --
    def add(self, request: Request, peer: PeerMetadata | None = None) -> RequestStream:
        """Admit a request (call on the event loop). Bad input raises ValueError, nothing is kept."""
        if not self.alive:
            raise RuntimeError(f"the engine is not running: {self.error or 'stopped'}")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use on this worker")
        delta = request.params.model_copy(update={"output_kind": RequestOutputKind.DELTA})
        request = request.model_copy(update={"params": delta})
        stream = RequestStream(rid, asyncio.get_running_loop())
        self._streams[rid] = stream
        if self._fault is not None:
            self._fault.see(request.role, request.prompt_token_ids)
        prefilled = request.role == "decode" and request.params.num_seqs == 1  # prefill's token first
        self.timer.add(rid, time.monotonic(), 1 if prefilled else 0)
        try:
            self.engine.add_request(request, peer)
        except BaseException:
            self._streams.pop(rid, None)
            self.timer.forget(rid)
            raise
        self._wake.set()
        return stream

    def is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    def deliver_handoff(self, handoff: Handoff) -> None:
        """A decode request's hand-off, posted by the router (call on the event loop)."""
        self.engine.deliver_handoff(handoff)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.timer.forget(request_id)
        self.engine.abort_request(request_id)
        self._wake.set()

    # -- the engine thread --
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_beat = time.monotonic()
                if self.engine.has_unfinished_requests():
                    self._step()
                    self.last_beat = time.monotonic()
                    self._pause_if_only_loading()
                elif self.engine.has_held_kv():
                    self._wait(HELD_POLL_S)
                    self._step()
                else:
                    self._wait(IDLE_WAIT_S)
        except Exception as e:  # the engine is broken: fail every request, report unhealthy, exit
            log.exception("engine loop died with %d requests open: %s", len(self._streams), ", ".join(self._streams))
            self.fail(f"engine step raised {type(e).__name__}")

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _step(self) -> None:
        t0 = time.monotonic()
        if self._fault is not None:
            self._fault.fire()
        outputs = self.engine.step()
        t1 = time.monotonic()
        sched = self.engine.last_schedule
        self.timer.on_step(sched, t0)
        if self.metrics is not None:
            if sched is not None and not sched.is_empty:
                is_prefill = any(s.is_prefill for s in sched.scheduled)
                self.metrics.observe_step(t1 - t0, is_prefill, len(sched.scheduled))
            self._sync_metrics()
        transfers = self.engine.transfer_stats()
        for out in outputs:
            timing = self.timer.first_token(out, t1, transfers)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)  # gone already if fail() ran meanwhile
                if self.metrics is not None:  # None: a prefill handing its KV to a decode worker
                    self.metrics.finished.labels(out.outputs[0].finish_reason or "kv_handoff").inc()
            stream.put(out, timing)

    def _pause_if_only_loading(self) -> None:
        stats = self.engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == stats.num_waiting_for_remote_kv:
            self._wait(LOAD_POLL_S)

    def _sync_metrics(self) -> None:
        stats = self.engine.get_stats()
        m = self.metrics
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting)
        m.held.set(stats.num_held)
        m.blocks_used.set(stats.kv_blocks_used)
        m.blocks_total.set(stats.kv_blocks_total)
        m.window_blocks_used.set(stats.kv_window_blocks_used)
        m.window_blocks_total.set(stats.kv_window_blocks_total)
        m.sync_recomputes(stats.num_kv_load_recomputes)
        m.sync_prefix_cache(stats.kv_blocks_cached, stats.prefix_cache_queries, stats.prefix_cache_hits)
        if self.engine.spec is not None:
            m.sync_spec_decode(self.engine.spec.stats)
        transfer = self.engine.transfer_stats()
        if transfer is not None:
            m.sync_transfer(transfer)

    def _fail_all(self, reason: str) -> None:
        streams = list(self._streams.items())
        self._streams.clear()  # first: a reader woken by its error sees no request open
        for rid, stream in streams:
            stream.put(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=[],
                    outputs=[CompletionOutput(token_ids=[], finish_reason="error")],
                    finished=True,
                    error=reason,
                )
            )
