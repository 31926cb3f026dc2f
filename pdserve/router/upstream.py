"""The router's HTTP calls to its workers (`Upstream`): open /internal/generate, read its chunks,
post a hand-off, tell a worker to abort. Dispatcher (dispatch.py) decides what to call when.

    open(role, req)     POST /internal/generate on a worker of the role --> an open 200 response
    read(w, resp)       its NDJSON lines --> GenerateChunks; the outcome feeds w's circuit breaker
    post_handoff(...)   POST /internal/handoff {Handoff} (prefill could not notify decode itself)
    abort(w, rid)       POST /internal/abort, fire-and-forget

A worker that cannot be reached, answers 503, or is full (429) before anything streamed is retried
on another worker of the role (at most `max_attempts` workers, with exponential backoff between
tries); one that cannot be reached is marked down at once. When none takes it, a 503 (draining,
restarting) or 429 stays one, with Retry-After: the request may be sent again. Once a worker has
taken the request, a failure is a WorkerFailed (502/504) raised into the stream; the Dispatcher
may migrate the request (continue it on another worker after the output the client has), never
replay what was sent.
Each request's outcome feeds its worker's circuit breaker (breaker.py). What the client reads names
the worker's role ("the decode worker failed mid-request"); the log keeps the worker's URL and the
cause (an aiohttp exception's name) with the request id (`_failure`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from pdserve.config import RouterConfig
from pdserve.engine.request import FirstToken, Handoff, Request
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import Policy
from pdserve.router.pool import RETRY_AFTER_S, PoolRole, Worker, WorkerPool
from pdserve.wire.errors import ErrorResponse, OpenAIError
from pdserve.wire.protocol import GenerateChunk, RequestRef

log = logging.getLogger("pdserve.router")


class WorkerFailed(OpenAIError):
    """A worker failed a request it had taken: its stream broke, stopped or closed early, or it
    ended the request with an error of its own. The router may continue the request on another
    worker (dispatch.py's migration); cause labels the metric."""

    def __init__(self, status: int, message: str, *, code: str, role: str, cause: str) -> None:
        super().__init__(status, message, code=code)
        self.role, self.cause = role, cause

    @classmethod
    def of(cls, e: OpenAIError, w: Worker, cause: str) -> WorkerFailed:
        return cls(e.status, e.message, code=e.code, role=w.role, cause=cause)


CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=5.0)  # abort and hand-off calls
MAX_BACKOFF_S = 1.0


def backoff(retry_backoff_s: float, attempt: int) -> float:
    """Seconds to wait before try number attempt + 1 (attempt >= 1): doubling, capped, jittered."""
    return min(MAX_BACKOFF_S, retry_backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


class Upstream:
    def __init__(
        self,
        pool: WorkerPool,
        client: aiohttp.ClientSession,
        policies: dict[PoolRole, Policy],
        headers: dict[str, str],
        metrics: RouterMetrics,
        settings: RouterConfig,
    ) -> None:
        self.pool = pool
        self.client = client
        self.policies = policies
        self.headers = headers
        self.metrics = metrics
        self.s = settings
        self._background: set[asyncio.Task] = set()

    async def open(
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
            w = (
                first
                if attempt == 0 and first in candidates
                else self.policies[role].choose(candidates, req.prompt_token_ids)
            )
            tried.add(w.url)
            if attempts is not None:
                attempts.append(w)
            self.pool.acquire(w)
            try:
                resp = await self.client.post(f"{w.url}/internal/generate", data=body, headers=self.headers)
            except TimeoutError as e:  # aiohttp's connect and read timeouts are TimeoutErrors
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self.count(role, "timeout")
                last = _failure(504, w, req.request_id, "did not answer", type(e).__name__, "upstream_timeout")
                continue
            except aiohttp.ClientConnectorError as e:  # nothing listens: down until a health probe says otherwise
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self.count(role, "unreachable")
                self.pool.mark_down(w, f"unreachable: {type(e).__name__}")
                last = _failure(503, w, req.request_id, "is unreachable", type(e).__name__, "upstream_unavailable")
                continue
            except aiohttp.ClientError as e:
                # The connection broke after it was made (e.g. a keep-alive race): one failure for the
                # breaker, not a verdict on the worker. It may have admitted the request: abort it there.
                self.pool.report(w, ok=False)
                self.pool.release(w)
                self.count(role, "transport_error")
                self.abort(w, req.request_id)
                failure = _failure(502, w, req.request_id, "dropped the connection", type(e).__name__, "upstream_error")
                last = WorkerFailed.of(
                    failure, w, "dropped"
                )  # it may have taken the request: the router may migrate it
                continue
            except asyncio.CancelledError:  # the client left or a timeout fired: the worker may have admitted it
                self.pool.release(w)
                self.abort(w, req.request_id)
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
        self.count(role, str(status))
        if status >= 500:
            self.pool.report(w, ok=False)
        try:
            info = ErrorResponse.model_validate_json(body).error
            msg, code = info.message, info.code
        except ValueError:
            msg, code = body[:200].decode(errors="replace"), None
        headers = {"Retry-After": resp.headers["retry-after"]} if "retry-after" in resp.headers else None
        if status == 503:  # draining or restarting: another worker, or the same later, takes the request
            self.pool.mark_down(w, f"answered 503: {msg}")
            headers = headers or {"Retry-After": str(RETRY_AFTER_S)}
        status = status if status in (400, 413, 422, 429, 503) else 502
        return OpenAIError(
            status,
            f"the {role} worker refused the request: {msg}",
            code="upstream_refused" if status == 502 else code,
            headers=headers,
        )

    async def read(self, w: Worker, resp: aiohttp.ClientResponse, rid: str) -> AsyncIterator[GenerateChunk]:
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
            self.count(role, "timeout")
            self.pool.report(w, ok=False)
            failure = _failure(504, w, rid, "stopped sending", "read timeout", "upstream_timeout")
            raise WorkerFailed.of(failure, w, "timeout") from None
        except (aiohttp.ClientError, HttpProcessingError, ValueError) as e:  # not a chunk, a line over the read buffer
            self.count(role, "broken_stream")
            self.pool.report(w, ok=False)
            self.pool.mark_down(w, f"stream broke: {type(e).__name__}")
            failure = _failure(502, w, rid, "failed mid-request", f"{type(e).__name__}: {e}", "upstream_error")
            raise WorkerFailed.of(failure, w, "broken_stream") from None
        finally:
            resp.close()  # a stream read to its end has nothing left to drop; one left early drops its connection
            self.pool.release(w)
        if not finished:
            self.count(role, "truncated")
            self.pool.report(w, ok=False)
            failure = _failure(
                502, w, rid, "failed mid-request", "stream closed before the request finished", "upstream_error"
            )
            raise WorkerFailed.of(failure, w, "truncated")

    async def post_handoff(self, dw: Worker, dresp: aiohttp.ClientResponse, first: GenerateChunk) -> None:
        """Give decode's waiting request its hand-off over HTTP (prefill did not notify dw itself).
        dw had taken the request: if it does not take the hand-off (it died, or restarted and has
        no such request), that is a WorkerFailed, for the request to be migrated."""
        first_token = None  # n > 1: prefill sampled none, decode samples each sequence's (engine/forks.py)
        if first.token_ids:
            first_token = FirstToken(
                token_id=first.token_ids[-1],
                logprobs=first.logprobs[-1] if first.logprobs else None,
                text_offset=first.text_offset + len(first.text),  # a migrated request's first chunk starts past 0
            )
        handoff = Handoff(request_id=first.request_id, kv_handle=first.kv_handle, first_token=first_token)
        failure: OpenAIError | None = None
        cause = "worker_error"
        try:
            async with self.client.post(
                f"{dw.url}/internal/handoff",
                data=handoff.model_dump_json(exclude_none=True),
                headers=self.headers,
                timeout=CONTROL_TIMEOUT,
            ) as resp:
                if resp.status != 200:
                    text = (await resp.read())[:200].decode(errors="replace")
                    failure = _failure(
                        502, dw, first.request_id, "refused the KV hand-off", f"{resp.status}: {text}", "upstream_error"
                    )
        except (aiohttp.ClientError, TimeoutError) as e:
            cause = "dropped"
            failure = _failure(
                502, dw, first.request_id, "did not take the KV hand-off", type(e).__name__, "upstream_error"
            )
        if failure is not None:  # decode's stream is ours to close and its slot ours to give back
            self.count("decode", "handoff")
            dresp.close()
            self.pool.release(dw)
            raise WorkerFailed.of(failure, dw, cause)

    def abort(self, w: Worker, rid: str) -> None:
        """Tell w to abort rid, fire-and-forget: a failure only costs a lease's time."""
        task = asyncio.get_running_loop().create_task(self._control(w, "/internal/abort", rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _control(self, w: Worker, path: str, rid: str) -> None:
        try:
            async with self.client.post(
                f"{w.url}{path}",
                data=RequestRef(request_id=rid).model_dump_json(),
                headers=self.headers,
                timeout=CONTROL_TIMEOUT,
            ):
                pass
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("%s %s for %s failed: %s: %s", w.url, path, rid, type(e).__name__, e)

    def count(self, role: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(role, kind).inc()


def _failure(status: int, w: Worker, rid: str, what: str, detail: str, code: str) -> OpenAIError:
    """The client's error names the role ("the decode worker failed mid-request"); the worker's URL
    and the cause go to the log with the request id."""
    log.warning("%s: %s worker %s %s (%s)", rid, w.role, w.url, what, detail)
    return OpenAIError(status, f"the {w.role} worker {what}", code=code)
