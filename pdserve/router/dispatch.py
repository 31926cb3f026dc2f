"""The router's only real work: pick workers, forward, stream.

    generate(request)
      PD:        choose (prefill, decode) together (PairPolicy)
                 prefill /internal/generate(hold_kv, kv_to=decode) --> first token + KVHandle --> yielded at once
                 decode /internal/generate(kv_from=prefill), sent as soon as prefill has the request:
                   it waits there for its hand-off, which prefill's engine sends decode's directly
                   (a NIXL notification) --> deltas --> yielded as they come
      colocated: colocated /internal/generate --> deltas

So the hand-off crosses no HTTP request and neither event loop: under load a per-hand-off POST
queued behind every running request's token stream (H200, c=32: 47 ms of a 70 ms hand-off). When
prefill could not notify this decode worker itself (no peers configured there, a failed send, or
decode was retried on another worker), the router posts the Handoff to /internal/handoff.

The chunk with a worker's first new token carries its RequestTiming: the router splits its own TTFT
(and, in PD, first token -> decode's first token) by it into histograms (metrics.py).

Workers send deltas of new output with their offsets; the router checks that each chunk starts
where the output stands (a decode worker's first chunk starts after the first token) and passes it
on: nothing is joined or cut here.

A worker that cannot be reached, answers 503, or is full (429) before anything streamed is retried
on another worker of the role (at most `max_attempts` workers, with exponential backoff between
tries); one that cannot be reached is marked down at once. Once output has started, a failure is
final: an OpenAIError (502/504) raised into the stream, never tokens from a second attempt.
Each request's outcome feeds its worker's circuit breaker (breaker.py).

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
import random
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from pdserve.config import RouterConfig
from pdserve.disagg.base import KVPeerRef
from pdserve.engine.request import FirstToken, Handoff, Request
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import PairPolicy, Policy, RoundRobin
from pdserve.router.pool import PoolRole, Worker, WorkerPool
from pdserve.sampling_params import SamplingParams
from pdserve.wire.errors import ErrorResponse, OpenAIError
from pdserve.wire.protocol import GenerateChunk, RequestRef

log = logging.getLogger("pdserve.router")

CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=5.0)  # abort and hand-off calls
MAX_BACKOFF_S = 1.0


def backoff(retry_backoff_s: float, attempt: int) -> float:
    """Seconds to wait before try number attempt + 1 (attempt >= 1): doubling, capped, jittered."""
    return min(MAX_BACKOFF_S, retry_backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


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
        self.client = client
        self.policies = {"prefill": prefill_policy, "decode": decode_policy, "colocated": RoundRobin()}
        self.pair = PairPolicy(prefill_policy, decode_policy)
        self.headers = {**headers, "content-type": "application/json"}
        self.metrics = metrics
        self.s = settings or RouterConfig()
        self._background: set[asyncio.Task] = set()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[GenerateChunk]:
        """The request's output as chunks of new content only (offsets continue from 0 without
        overlap), the last one with finish_reason. Raises OpenAIError."""
        req = Request(request_id=request_id, prompt_token_ids=prompt, params=params)
        if self.pool.can_pd():
            prefill, decode = self.pair.choose(self.pool.candidates("prefill"), self.pool.candidates("decode"))
            source = self._pd(req, prefill, decode)
        elif self.pool.available("colocated"):
            source = self._colocated(req)
        else:
            raise self.pool.unavailable()
        offsets = _Offsets()
        try:
            async for chunk in source:
                offsets.advance(chunk)
                yield chunk
        finally:
            await source.aclose()

    # -- the two paths --
    async def _pd(self, req: Request, prefill: Worker, decode: Worker) -> AsyncIterator[GenerateChunk]:
        rid = req.request_id
        t0 = time.monotonic()
        opening: asyncio.Future | None = None

        def open_decode(pw: Worker) -> None:  # prefill has the request: decode gets it now, to wait there
            nonlocal opening
            dreq = req.model_copy(update={"kv_from": _peer_ref(pw)})
            opening = asyncio.ensure_future(self._open("decode", dreq, first=decode))

        pw: Worker | None = None
        dw: Worker | None = None
        first: GenerateChunk | None = None
        decode_read = finished = False
        try:
            preq = req.model_copy(update={"hold_kv": True, "kv_to": _peer_ref(decode)})
            pw, first = await self._prefill(preq, prefill, on_accepted=open_decode)
            t1 = time.monotonic()
            if first is None or (first.finish_reason is None and first.kv_handle is None) or not first.token_ids:
                raise OpenAIError(502, f"prefill worker {pw.url} ended without a first token", code="upstream_error")
            if first.finish_reason == "error":
                raise OpenAIError(502, f"prefill failed: {first.error}", code="upstream_error")
            self.metrics.observe_ttft(first.timing, t1 - t0)
            yield first
            if first.finish_reason is not None:  # the first token already ended it: no KV is held
                return
            dw, dresp = await opening
            notified = first.kv_handoff_sent and dw.url == decode.url
            if not notified:  # prefill could not tell this decode worker itself
                await self._post_handoff(dw, dresp, first)
            self.metrics.handoffs.labels("prefill" if notified else "router").inc()
            dispatched = time.monotonic() - t1  # what the router still waited for after the first token
            async for chunk in self._read(dw, dresp):
                decode_read = chunk.finish_reason != "error"  # decode streams tokens only once the KV has arrived
                _raise_if_failed(chunk, "decode")
                self.metrics.observe_handoff(chunk.timing, time.monotonic() - t1, dispatched)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if dw is None and opening is not None:  # decode's answer never read (client gone, prefill failed)
                dw = await self._drop_open(opening, rid)
            if pw is not None and first is not None and first.kv_handle is not None and not decode_read:
                self._later(pw, "/internal/abort", rid)  # decode never read the KV: prefill frees it now
            if dw is not None and not finished:
                self._later(dw, "/internal/abort", rid)

    async def _post_handoff(self, dw: Worker, dresp: aiohttp.ClientResponse, first: GenerateChunk) -> None:
        """Give decode's waiting request its hand-off over HTTP (prefill did not notify dw itself)."""
        first_token = FirstToken(token_id=first.token_ids[0], logprobs=first.logprobs[0] if first.logprobs else None, text_offset=len(first.text))
        handoff = Handoff(request_id=first.request_id, kv_handle=first.kv_handle, first_token=first_token)
        failure: OpenAIError | None = None
        try:
            async with self.client.post(
                f"{dw.url}/internal/handoff", data=handoff.model_dump_json(exclude_none=True), headers=self.headers, timeout=CONTROL_TIMEOUT
            ) as resp:
                if resp.status != 200:
                    text = (await resp.read())[:200].decode(errors="replace")
                    failure = OpenAIError(502, f"decode worker {dw.url} refused the hand-off ({resp.status}): {text}", code="upstream_error")
        except (aiohttp.ClientError, TimeoutError) as e:
            failure = OpenAIError(502, f"decode worker {dw.url}: posting the hand-off failed ({type(e).__name__})", code="upstream_error")
        if failure is not None:  # decode's stream is ours to close and its slot ours to give back
            self._count("decode", "handoff")
            dresp.close()
            self.pool.release(dw)
            raise failure

    async def _drop_open(self, opening: asyncio.Future, rid: str) -> Worker | None:
        """An `_open` whose answer no one will read: cancelled if still running (it aborts the request
        on the worker it asked itself), else its response closed; the worker that admitted it, if any."""
        if not opening.done():
            opening.cancel()
        try:
            w, resp = await opening
        except (asyncio.CancelledError, Exception):  # cancelled or failed (raised on the main path, if anywhere): nothing open
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
                pw, presp = await self._open("prefill", req, tried, first=chosen)
                if on_accepted is not None:
                    on_accepted(pw)
                async for chunk in self._read(pw, presp):
                    first = chunk
            done = True
        except TimeoutError:
            self._count("prefill", "prefill_timeout")
            last = pw or (tried[-1] if tried else None)
            if last is not None:
                self.pool.report(last, ok=False)
            where = f"prefill worker {last.url}" if last is not None else "no prefill worker"
            raise OpenAIError(504, f"{where}: no first token within the prefill timeout ({self.s.prefill_timeout} s)", code="prefill_timeout") from None
        finally:
            if pw is not None and not done:
                self._later(pw, "/internal/abort", rid)
        return pw, first

    async def _colocated(self, req: Request) -> AsyncIterator[GenerateChunk]:
        rid = req.request_id
        t0 = time.monotonic()
        w, resp = await self._open("colocated", req)
        finished = False
        try:
            async for chunk in self._read(w, resp):
                _raise_if_failed(chunk, "worker")
                self.metrics.observe_ttft(chunk.timing, time.monotonic() - t0)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                self._later(w, "/internal/abort", rid)

    # -- talking to workers --
    async def _open(
        self, role: PoolRole, req: Request, attempts: list[Worker] | None = None, first: Worker | None = None
    ) -> tuple[Worker, aiohttp.ClientResponse]:
        """Start /internal/generate on a worker of `role`; the response is open and 200.
        first: the worker chosen up front (tried first while it is still a candidate); retries
        go to the role's policy. attempts: if given, each worker tried is appended (the caller's
        timeout names the last)."""
        tried: set[str] = set()
        last: OpenAIError | None = None
        body = req.model_dump_json(exclude_none=True)
        for attempt in range(self.s.max_attempts):
            candidates = [w for w in self.pool.candidates(role) if w.url not in tried]
            if not candidates:
                break
            if attempt:
                self.metrics.retries.labels(role).inc()
                await asyncio.sleep(backoff(self.s.retry_backoff, attempt))
            w = first if attempt == 0 and first in candidates else self.policies[role].choose(candidates)
            tried.add(w.url)
            if attempts is not None:
                attempts.append(w)
            self.pool.acquire(w)
            try:
                resp = await self.client.post(f"{w.url}/internal/generate", data=body, headers=self.headers)
            except TimeoutError as e:  # aiohttp's connect and read timeouts are TimeoutErrors
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self._count(role, "timeout")
                last = OpenAIError(504, f"{role} worker {w.url} did not answer: {type(e).__name__}", code="upstream_timeout")
                continue
            except aiohttp.ClientConnectorError as e:  # nothing listens: down until a health probe says otherwise
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self._count(role, "unreachable")
                self.pool.mark_down(w, f"unreachable: {type(e).__name__}")
                last = OpenAIError(503, f"{role} worker {w.url} is unreachable", code="upstream_unavailable")
                continue
            except aiohttp.ClientError as e:
                # The connection broke after it was made (e.g. a keep-alive race): one failure for the
                # breaker, not a verdict on the worker. It may have admitted the request: abort it there.
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self._count(role, "transport_error")
                self._later(w, "/internal/abort", req.request_id)
                last = OpenAIError(502, f"{role} worker {w.url} dropped the connection ({type(e).__name__})", code="upstream_error")
                continue
            except asyncio.CancelledError:  # the client left or a timeout fired: the worker may have admitted it
                self.pool.release(w)
                self._later(w, "/internal/abort", req.request_id)
                raise
            if resp.status == 200:
                return w, resp
            err = await self._refusal(w, resp, role)
            if resp.status not in (429, 503):
                raise err  # the request itself was refused: another worker would refuse it too
            last = err
        raise last or OpenAIError(503, f"no healthy {role} worker", code="no_healthy_workers")

    async def _refusal(self, w: Worker, resp: aiohttp.ClientResponse, role: str) -> OpenAIError:
        try:
            body = await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            body = b""
        finally:
            resp.close()
            self.pool.release(w)
        status = resp.status
        self._count(role, str(status))
        if status >= 500:
            self.pool.report(w, ok=False)
        try:
            info = ErrorResponse.model_validate_json(body).error
            msg, code = info.message, info.code
        except ValueError:
            msg, code = body[:200].decode(errors="replace"), None
        if status == 503:
            self.pool.mark_down(w, f"answered 503: {msg}")
        headers = {"Retry-After": resp.headers["retry-after"]} if "retry-after" in resp.headers else None
        status = status if status in (400, 413, 422, 429) else 502
        return OpenAIError(status, f"{role} worker: {msg}", code="upstream_refused" if status == 502 else code, headers=headers)

    async def _read(self, w: Worker, resp: aiohttp.ClientResponse) -> AsyncIterator[GenerateChunk]:
        role = w.role
        finished = False
        try:
            async for line in resp.content:  # NDJSON: one chunk a line
                if line.strip():
                    chunk = GenerateChunk.model_validate_json(line)
                    if not finished and (chunk.finish_reason is not None or chunk.kv_handle is not None):
                        finished = True
                        self.pool.report(w, ok=chunk.finish_reason != "error")
                    yield chunk
        except TimeoutError:  # the read timeout (request_timeout) between two lines
            self._count(role, "timeout")
            self.pool.report(w, ok=False)
            raise OpenAIError(504, f"{role} worker {w.url} stopped sending", code="upstream_timeout") from None
        except (aiohttp.ClientError, HttpProcessingError, ValueError) as e:  # not a chunk, a line over the read buffer
            self._count(role, "broken_stream")
            self.pool.report(w, ok=False)
            self.pool.mark_down(w, f"stream broke: {type(e).__name__}")
            raise OpenAIError(502, f"{role} worker {w.url} failed mid-request ({type(e).__name__})", code="upstream_error") from None
        finally:
            resp.close()  # a stream read to its end has nothing left to drop; one left early drops its connection
            self.pool.release(w)
        if not finished:
            self._count(role, "truncated")
            self.pool.report(w, ok=False)
            raise OpenAIError(502, f"{role} worker {w.url} closed the stream before the request finished", code="upstream_error")

    def _later(self, w: Worker, path: str, rid: str) -> None:
        """Fire-and-forget control call (abort / release); failures only cost a lease's time."""
        task = asyncio.get_running_loop().create_task(self._control(w, path, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _control(self, w: Worker, path: str, rid: str) -> None:
        try:
            async with self.client.post(f"{w.url}{path}", data=RequestRef(request_id=rid).model_dump_json(), headers=self.headers, timeout=CONTROL_TIMEOUT):
                pass
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("%s %s for %s failed: %s: %s", w.url, path, rid, type(e).__name__, e)

    def _count(self, role: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(role, kind).inc()


def _peer_ref(w: Worker) -> KVPeerRef:
    """How a PD worker is named to its pair: engine, instance, where its transfer metadata is."""
    info = w.info
    if info is None or info.kv_metadata_url is None:
        raise OpenAIError(502, f"{w.role} worker {w.url} has not said where its transfer metadata is", code="upstream_error")
    return KVPeerRef(engine_id=info.engine_id, instance_id=info.instance_id, metadata_url=info.kv_metadata_url)


def _raise_if_failed(chunk: GenerateChunk, who: str) -> None:
    if chunk.finish_reason != "error":
        return
    f = chunk.transfer_error
    if f is not None:
        raise OpenAIError(502, f"KV transfer failed at stage {f.stage}: {f.reason}", code="kv_transfer_failed")
    raise OpenAIError(502, f"{who} failed: {chunk.error}", code="upstream_error")


class _Offsets:
    """Where the request's output stands: each chunk must continue exactly there (no gap, no overlap)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = 0

    def advance(self, c: GenerateChunk) -> None:
        if c.token_offset != self.tokens or c.text_offset != self.text:
            raise OpenAIError(502, "a worker's stream does not continue where the output stands (protocol error)", code="upstream_error")
        self.tokens += len(c.token_ids)
        self.text += len(c.text)
