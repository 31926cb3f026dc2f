"""The router's only real work: pick workers, forward, stream.

    generate(request)
      PD:        choose (prefill, decode) together (PairPolicy)
                 prefill /internal/generate(hold_kv, kv_to=decode) --> first token + KVHandle --> yielded at once
                   (n > 1: KVHandle alone, of all but the last prompt token: decode samples every
                   sequence's first token, engine/forks.py)
                 decode /internal/generate(kv_from=prefill), sent as soon as prefill has the request:
                   it waits there for its hand-off, which prefill's engine sends decode's directly
                   (a NIXL notification) --> deltas --> yielded as they come
      colocated: colocated /internal/generate --> deltas

So the hand-off crosses no HTTP request and neither event loop: under load a POST per hand-off
would queue behind every running request's token stream (docs/pd-gpu.md). When
prefill could not notify this decode worker itself (no peers configured there, a failed send, or
decode was retried on another worker), the router posts the Handoff to /internal/handoff.

The chunk with a worker's first new token carries its RequestTiming: the router splits its own TTFT
(and, in PD, first token -> decode's first token) by it into histograms (metrics.py).

Workers send deltas of new output with their offsets; the router checks that each chunk starts
where the output stands (a decode worker's first chunk starts after the first token) and passes it
on: nothing is joined or cut here.

Migration: when a worker fails a request it had taken (a WorkerFailed: its stream broke, stopped
or closed early, its connection dropped while it took the request, it ended the request with an
error of its own, or a decode worker did not take the hand-off the router posted), the request
goes on elsewhere under a new id for the workers (`<id>.<n>`), through the same choice of workers
(a failed worker is marked down or counted by its breaker), with Request.resume = the tokens and
text the client already has: the engine takes them as the request's first outputs (through
prefill again in PD: the prompt's blocks hit its prefix cache), and the new worker's chunks start
where the client's output stands. Greedy and seeded requests continue exactly (a seeded draw is
indexed by output position). A request with n > 1 is not migrated (its sequences would each
need their own continuation). At most `migration_limit` times a request; then the failure reaches
the client, naming the limit. While no worker of a role takes the migrated request (its only
worker restarting), or a request whose first token is out (in PD: each decode worker draining or
not yet taken back after a restart), the router asks again every MIGRATION_RETRY_S until the
request's `request_timeout`; the client's stream just pauses. A KV transfer failure is not
migrated (its own policy: kv_load_failure_policy).

Every HTTP call to a worker goes through Upstream (upstream.py): retries on another worker before
anything streamed, the circuit breakers' outcomes, fire-and-forget aborts.

Aborts (the client left, a timeout, an error): a worker whose request was sent but not finished is
told at once (/internal/abort), and if the decode side never streamed (so never read the KV) the
prefill worker is told too: abort on prefill frees the KV it holds, at once rather than at lease
expiry. (Decode's own release after a read travels as a NIXL notification, never through here.)
A failed KV load reaches the client as an OpenAI error with code kv_transfer_failed, its message
naming the stage (TransferFailure). The prefill phase (choose a worker, run the prompt, get the first token and the
KV handle) is bounded by `prefill_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import aiohttp

from pdserve.config import RouterConfig
from pdserve.disagg.base import KVPeerRef
from pdserve.engine.request import Request, Resume
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import PairPolicy, Policy, RoundRobin
from pdserve.router.pool import RETRY_AFTER_S, Worker, WorkerPool
from pdserve.router.upstream import Upstream, WorkerFailed
from pdserve.sampling_params import SamplingParams
from pdserve.wire.errors import OpenAIError
from pdserve.wire.protocol import GenerateChunk

log = logging.getLogger("pdserve.router")
MIGRATION_RETRY_S = 0.5  # a migrated request no worker takes yet asks again this often (a restart may be under way)


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        client: aiohttp.ClientSession,
        prefill_policy: Policy,
        decode_policy: Policy,
        headers: dict[str, str],
        metrics: RouterMetrics,
        settings: RouterConfig | None = None,
    ) -> None:
        self.pool = pool
        self.pair = PairPolicy(prefill_policy, decode_policy)
        self.metrics = metrics
        self.s = settings or RouterConfig()
        policies = {"prefill": prefill_policy, "decode": decode_policy, "colocated": RoundRobin()}
        headers = {**headers, "content-type": "application/json"}
        self.upstream = Upstream(pool, client, policies, headers, metrics, self.s)

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerateChunk]:
        """The request's output as chunks of new content only (offsets continue from 0 without
        overlap, per sequence: GenerateChunk.index), each sequence's last one with its
        finish_reason. Raises OpenAIError."""
        req = Request(request_id=request_id, prompt_token_ids=prompt, params=params)
        deadline = time.monotonic() + self.s.request_timeout
        source = self._source(req, prompt)
        offsets: dict[int, _Offsets] = {}
        sent, migrations, attempt = [], 0, 0
        failure: WorkerFailed | None = None  # the failure the request first met, when migrating
        while True:
            old = source
            try:
                async for chunk in source:
                    offsets.setdefault(chunk.index, _Offsets()).advance(chunk)
                    sent += chunk.token_ids
                    yield chunk
                return
            except OpenAIError as e:
                first = failure or e  # what the client is told if the request cannot go on
                if isinstance(e, WorkerFailed):
                    if params.num_seqs > 1:
                        raise _note(first, "not migrated: n > 1") from None
                    if migrations >= self.s.migration_limit:
                        raise _note(first, f"not migrated: migration_limit {self.s.migration_limit} reached") from None
                    migrations += 1
                    self.metrics.migrations.labels(e.role, e.cause).inc()
                    log.warning("%s: migrating after %d tokens (%s: %s)", request_id, len(sent), e.cause, e.message)
                    failure = first
                elif (
                    e.status != 503
                    or not (failure or sent)
                    or params.num_seqs > 1
                    or time.monotonic() + MIGRATION_RETRY_S > deadline
                ):
                    raise (e if failure is None else _note(first, f"migration failed: {e.message}")) from None
                else:  # under way (migrated, or its first token out), no worker takes it: one restarting or draining
                    log.info("%s: no worker takes it after %d tokens (%s); asking again", request_id, len(sent), e)
                    await asyncio.sleep(MIGRATION_RETRY_S)
                resume = Resume(token_ids=list(sent), text_offset=offsets[0].text) if sent else None
                attempt += (
                    1  # a new id for the workers: nothing of an earlier attempt (a late hand-off) is taken for it
                )
                req = req.model_copy(update={"resume": resume, "request_id": f"{request_id}.{attempt}"})
                source = await self._next_source(req, prompt, first, deadline)
            finally:
                await old.aclose()

    async def _next_source(
        self, req: Request, prompt: list[int], failure: OpenAIError, deadline: float
    ) -> AsyncIterator[GenerateChunk]:
        """A migrated request's next source; while no worker of a role is healthy (one restarting),
        asks again every MIGRATION_RETRY_S until the request's deadline, then fails with why."""
        while True:
            try:
                return self._source(req, prompt)
            except OpenAIError as none:
                if none.status != 503 or time.monotonic() + MIGRATION_RETRY_S > deadline:
                    raise _note(failure, f"not migrated: {none.message}") from None
                await asyncio.sleep(MIGRATION_RETRY_S)

    def _source(self, req: Request, prompt: list[int]) -> AsyncIterator[GenerateChunk]:
        """The request's chunks from the workers the pool and policies choose now (PD or colocated)."""
        if self.pool.can_pd():
            prefills, decodes = self.pool.candidates("prefill"), self.pool.candidates("decode")
            if not prefills or not decodes:  # a half-open breaker's one trial request is in flight
                role = "decode" if prefills else "prefill"
                raise OpenAIError(
                    503, f"no {role} worker takes requests now (one is on trial after failures); retry shortly",
                    code="no_healthy_workers", headers={"Retry-After": str(RETRY_AFTER_S)},
                )  # fmt: skip
            prefill, decode = self.pair.choose(prefills, decodes, prompt)
            return self._pd(req, prefill, decode)
        if self.pool.available("colocated"):
            return self._colocated(req)
        raise self.pool.unavailable()

    # -- the two paths --
    async def _pd(self, req: Request, prefill: Worker, decode: Worker) -> AsyncIterator[GenerateChunk]:
        rid = req.request_id
        t0 = time.monotonic()
        opening: asyncio.Future | None = None

        def open_decode(pw: Worker) -> None:  # prefill has the request: decode gets it now, to wait there
            nonlocal opening
            dreq = req.model_copy(update={"kv_from": _peer_ref(pw)})
            opening = asyncio.ensure_future(self.upstream.open("decode", dreq, first=decode))

        pw: Worker | None = None
        dw: Worker | None = None
        first: GenerateChunk | None = None
        decode_read = finished = False
        try:
            preq = req.model_copy(update={"hold_kv": True, "kv_to": _peer_ref(decode)})
            pw, first = await self._prefill(preq, prefill, on_accepted=open_decode)
            t1 = time.monotonic()
            if first is not None and first.finish_reason == "error" and first.transfer_error is None:
                raise WorkerFailed(
                    502,
                    f"the prefill worker failed: {first.error}",
                    code="upstream_error",
                    role="prefill",
                    cause="worker_error",
                )
            forks = req.params.num_seqs > 1  # prefill hands off before any token (engine/forks.py)
            if (
                first is None
                or (first.finish_reason is None and first.kv_handle is None)
                or not (first.token_ids or forks)
            ):
                log.warning("%s: prefill worker %s ended without a first token", rid, pw.url)
                raise WorkerFailed(
                    502,
                    "the prefill worker ended without a first token",
                    code="upstream_error",
                    role="prefill",
                    cause="truncated",
                )
            if req.resume is None and not forks:  # a migrated request's first token is not its TTFT
                self.metrics.observe_ttft(first.timing, t1 - t0)
            if not forks:
                yield first
            if first.finish_reason is not None:  # the first token already ended it: no KV is held
                return
            dw, dresp = await opening
            notified = first.kv_handoff_sent and dw.url == decode.url
            if not notified:  # prefill could not tell this decode worker itself
                await self.upstream.post_handoff(dw, dresp, first)
            self.metrics.handoffs.labels("prefill" if notified else "router").inc()
            dispatched = time.monotonic() - t1  # what the router still waited for after the first token
            async for chunk in self.upstream.read(dw, dresp, rid):
                decode_read = chunk.finish_reason != "error"  # decode streams tokens only once the KV has arrived
                _raise_if_failed(chunk, "decode")
                self.metrics.observe_handoff(chunk.timing, time.monotonic() - t1, dispatched)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if dw is None and opening is not None:  # decode's answer never read (client gone, prefill failed)
                dw = await self._drop_open(opening, rid)
            if pw is not None and first is not None and first.kv_handle is not None and not decode_read:
                self.upstream.abort(pw, rid)  # decode never read the KV: prefill frees it now
            if dw is not None and not finished:
                self.upstream.abort(dw, rid)

    async def _drop_open(self, opening: asyncio.Future, rid: str) -> Worker | None:
        """An `Upstream.open` whose answer no one will read: cancelled if still running (it aborts the request
        on the worker it asked itself), else its response closed; the worker that admitted it, if any."""
        if not opening.done():
            opening.cancel()
        try:
            w, resp = await opening
        except (
            asyncio.CancelledError,
            Exception,
        ):  # cancelled or failed (raised on the main path, if anywhere): nothing open
            return None
        resp.close()
        self.pool.release(w)
        return w

    async def _prefill(
        self, req: Request, chosen: Worker, on_accepted: Callable[[Worker], None] | None = None
    ) -> tuple[Worker, GenerateChunk | None]:
        """The prefill worker and its last chunk (first token + KV handle), within prefill_timeout_s;
        on_accepted(worker) is called once a worker has taken the request.
        Left early (client gone, timeout, error), the worker is told to abort, freeing any KV it holds."""
        rid = req.request_id
        pw: Worker | None = None
        tried: list[Worker] = []
        first: GenerateChunk | None = None
        done = False
        try:
            async with asyncio.timeout(self.s.prefill_timeout):
                pw, presp = await self.upstream.open("prefill", req, tried, first=chosen)
                if on_accepted is not None:
                    on_accepted(pw)
                async for chunk in self.upstream.read(pw, presp, rid):
                    first = chunk
            done = True
        except TimeoutError:
            self.upstream.count("prefill", "prefill_timeout")
            last = pw or (tried[-1] if tried else None)
            if last is not None:
                self.pool.report(last, ok=False)
            log.warning("%s: no first token from prefill worker %s in time", rid, last.url if last else None)
            where = "the prefill worker" if last is not None else "no prefill worker"
            raise OpenAIError(
                504,
                f"{where}: no first token within the prefill timeout ({self.s.prefill_timeout} s)",
                code="prefill_timeout",
            ) from None
        finally:
            if pw is not None and not done:
                self.upstream.abort(pw, rid)
        return pw, first

    async def _colocated(self, req: Request) -> AsyncIterator[GenerateChunk]:
        rid = req.request_id
        t0 = time.monotonic()
        w, resp = await self.upstream.open("colocated", req)
        finished = False
        try:
            async for chunk in self.upstream.read(w, resp, rid):
                _raise_if_failed(chunk, "colocated")
                if req.resume is None:
                    self.metrics.observe_ttft(chunk.timing, time.monotonic() - t0)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                self.upstream.abort(w, rid)


def _note(failure: OpenAIError, why: str) -> OpenAIError:
    """The failure a request met, with why it was not carried on elsewhere."""
    return OpenAIError(failure.status, f"{failure.message} ({why})", code=failure.code)


def _peer_ref(w: Worker) -> KVPeerRef:
    """How a PD worker is named to its pair: engine, instance, where its transfer metadata is."""
    info = w.info
    if info is None or info.kv_metadata_url is None:
        log.warning("%s worker %s has not said where its transfer metadata is", w.role, w.url)
        raise OpenAIError(
            502, f"the {w.role} worker has not said where its transfer metadata is", code="upstream_error"
        )
    return KVPeerRef(engine_id=info.engine_id, instance_id=info.instance_id, metadata_url=info.kv_metadata_url)


def _raise_if_failed(chunk: GenerateChunk, who: str) -> None:
    if chunk.finish_reason != "error":
        return
    f = chunk.transfer_error
    if f is not None:
        raise OpenAIError(502, f"KV transfer failed at stage {f.stage}: {f.reason}", code="kv_transfer_failed")
    raise WorkerFailed(
        502, f"the {who} worker failed: {chunk.error}", code="upstream_error", role=who, cause="worker_error"
    )


class _Offsets:
    """Where the request's output stands: each chunk must continue exactly there (no gap, no overlap)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = 0

    def advance(self, c: GenerateChunk) -> None:
        if c.token_offset != self.tokens or c.text_offset != self.text:
            raise OpenAIError(
                502,
                "a worker's stream does not continue where the output stands (protocol error)",
                code="upstream_error",
            )
        self.tokens += len(c.token_ids)
        self.text += len(c.text)
