"""The router: pdserve's OpenAI-compatible front door (DESIGN.md, port 8000).

    POST /v1/completions, /v1/chat/completions    validate -> dispatch (dispatch.py) -> format (responses.py)
    GET  /v1/models, /health, /workers, /metrics

Thin by design: it tokenizes (the chat template for chat), validates, mints a request id, lets
the dispatcher pick workers and stream, and formats. It never serves /internal/*. With --api-key
every route (/health and /metrics too) needs `Authorization: Bearer <key>` (constant-time compare). Over
--max-queued-requests concurrent requests it answers 429 with Retry-After; every request has a
deadline (--request-timeout) after which it ends with 504 (or an error event if streaming), and a
shorter one for its first token (--first-token-timeout). A client that disconnects, streaming or
not, cancels its request at once (disconnect.py), which aborts it on the workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.wire.disconnect import GuardedStreamingResponse, unless_disconnected
from pdserve.config import RouterServeConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.wire.errors import ERROR_RESPONSES, OpenAIError, install_error_handlers, too_busy
from pdserve.wire.http import BodyLimit, TokenGuard
from pdserve.router.pool import WorkerPool
from pdserve.router.metrics import RouterMetrics
from pdserve.wire.metrics import CONTENT_TYPE
from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pdserve.router.policies import make_policy
from pdserve.wire.protocol import SECRET_HEADER, GenerateChunk
from pdserve.router.responses import (
    CHAT_RESPONSES,
    COMPLETION_RESPONSES,
    DONE,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    sse_error,
)
from pdserve.router.validation import Prepared, RequestValidator
from pdserve.tokenizer import Tokenizer

MAX_BODY_BYTES = 8 << 20
READ_BUFSIZE = 1 << 20  # a worker's chunk is one NDJSON line; aiohttp refuses a line over twice this
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/workers", "/metrics")


class _Admission:
    """Requests in progress, bounded: the router's queue."""

    def __init__(self, limit: int, metrics: RouterMetrics) -> None:
        self.limit = limit
        self.active = 0
        self.metrics = metrics

    def enter(self) -> None:
        if self.active >= self.limit:
            raise too_busy("the router")
        self.active += 1
        self.metrics.in_flight.set(self.active)

    def exit(self) -> None:
        self.active -= 1
        self.metrics.in_flight.set(self.active)


class Router:
    def __init__(self, config: RouterServeConfig, vocab_size: int, pool: WorkerPool, tokenizer: Tokenizer, metrics: RouterMetrics) -> None:
        self.s = config.router
        self.model_name = config.served_model_name or config.model
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.validator = RequestValidator(tokenizer, self.model_name, vocab_size)
        self.admission = _Admission(config.router.max_queued_requests, metrics)
        self.dispatcher: Dispatcher | None = None  # made in the lifespan, with the HTTP client
        self.headers = {SECRET_HEADER: config.cluster_secret} if config.cluster_secret else {}
        self.draining: asyncio.Event | None = None  # set on SIGTERM/SIGINT: open streams end with an error event
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading: set[asyncio.Task] = set()  # tasks waiting for a request's next chunk
        self._drained: set[asyncio.Task] = set()  # those of them cancelled by draining

    def start_draining(self) -> None:
        """From the signal handler (any thread): end every open stream with an error event now,
        instead of leaving clients without one when the server's grace period runs out."""
        if self._loop is not None and self.draining is not None:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.draining.set()
        for task in list(self._reading):  # each turns the cancellation into a 503 error (_next_unless)
            self._drained.add(task)
            task.cancel()

    async def _next_unless(self, it: AsyncIterator, deadline: float):
        """_next, unless the server starts shutting down first: then OpenAIError 503. Draining
        cancels the tasks waiting here, so a chunk costs no task of its own (it did: a task and an
        asyncio.wait per chunk, two more event-loop turns of every token's latency)."""
        if self.draining is not None and self.draining.is_set():
            raise _shutting_down()
        task = asyncio.current_task()
        self._reading.add(task)
        try:
            return await _next(it, deadline)
        except asyncio.CancelledError:
            if task not in self._drained:
                raise
            self._drained.discard(task)
            task.uncancel()
            raise _shutting_down() from None
        finally:
            self._reading.discard(task)

    def max_model_len(self) -> int:
        known = self.pool.max_model_len()
        limits = [n for n in (known, self.s.max_model_len) if n is not None]
        if not limits:
            raise self.pool.unavailable()
        return min(limits)

    # -- serving one request --
    async def serve(self, fmt: Formatter, prep: Prepared, stream: bool, receive: Receive) -> Response:
        if self.dispatcher is None or not self.pool.can_serve():
            raise self.pool.unavailable()
        self.admission.enter()
        t0 = time.monotonic()
        deadline = t0 + self.s.request_timeout
        gens = [self.dispatcher.generate(f"{fmt.rid}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prep.prompts, prep.params))]
        merged = _merge(gens)

        async def close() -> None:
            self.admission.exit()
            await merged.aclose()

        try:  # wait for the first token before answering, so an upstream failure is an HTTP status
            first_deadline, code = deadline, "timeout"
            if self.s.first_token_timeout < self.s.request_timeout:
                first_deadline, code = t0 + self.s.first_token_timeout, "first_token_timeout"
            first = await unless_disconnected(_next(merged, first_deadline, code), receive)
            self.metrics.ttft.observe(time.monotonic() - t0)
            if stream:
                events = self._events(fmt, first, merged, t0, deadline)
                return GuardedStreamingResponse(events, close, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            await unless_disconnected(self._collect(fmt, first, merged, deadline), receive)
        except BaseException:
            await close()
            raise
        await close()
        self._done(fmt, t0)
        return JSONResponse(fmt.response())

    async def _collect(self, fmt: Formatter, first: tuple[int, GenerateChunk] | None, merged: AsyncIterator, deadline: float) -> None:
        item = first
        while item is not None:
            fmt.choices[item[0]].add(item[1])
            item = await self._next_unless(merged, deadline)

    async def _events(self, fmt: Formatter, first: tuple[int, GenerateChunk] | None, merged: AsyncIterator, t0: float, deadline: float) -> AsyncIterator[bytes]:
        try:
            item = first
            while item is not None:
                data = fmt.chunk(*item)
                if data is not None:
                    yield data
                item = await self._next_unless(merged, deadline)
            if fmt.include_usage:
                yield fmt.usage_chunk()
            self._done(fmt, t0)
            yield DONE
        except OpenAIError as e:
            yield sse_error(e)
            yield DONE

    def _done(self, fmt: Formatter, t0: float) -> None:
        self.metrics.e2e.observe(time.monotonic() - t0)
        usage = fmt.usage()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.generation_tokens.inc(usage.completion_tokens)


def build_router_app(config: RouterServeConfig) -> FastAPI:
    settings = config.router
    metrics = RouterMetrics()
    pool = WorkerPool(config.prefill, config.decode, config.colocated, metrics, breaker_failures=settings.breaker_failures, breaker_cooldown_s=settings.breaker_cooldown)
    router = Router(config, _vocab_size(config.model), pool, Tokenizer(config.model), metrics)
    model_name = router.model_name

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Requests stream through aiohttp: the router's CPU per streamed token is a third to a half
        # less than with httpx (README, "The router's streams through aiohttp"), paid on every token. The prober keeps httpx, on a
        # client of its own, so a probe never waits behind the streams for a connection.
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=settings.request_timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)  # < the workers' 75 s keep-alive
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=READ_BUFSIZE, auto_decompress=False) as session,
            httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as probe_client,
        ):
            router.dispatcher = Dispatcher(
                pool, session, make_policy(settings.prefill_policy), make_policy(settings.decode_policy), router.headers, metrics, settings
            )
            router.draining, router._loop = asyncio.Event(), asyncio.get_running_loop()
            # One round of probes before the first connection is accepted (bounded by PROBE_DEADLINE_S):
            # with several router processes on one port, one that had not looked yet would answer 503
            # for workers its siblings already serve.
            await pool.probe_all(probe_client, router.headers)
            prober = asyncio.create_task(pool.run(probe_client, settings.health_interval, router.headers))
            try:
                yield
            finally:
                prober.cancel()
                await asyncio.gather(prober, return_exceptions=True)

    app = FastAPI(title="pdserve router", version="1", lifespan=lifespan)
    install_error_handlers(app)
    app.state.router = router
    app.state.on_exit = router.start_draining  # serve.py calls it when a stop signal arrives

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prep = router.validator.completion(body, router.max_model_len())
        fmt = CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", model_name, router.tokenizer, prep.prompts, prep.logprobs, body.return_token_ids, body.stream and body.include_usage())
        return await router.serve(fmt, prep, body.stream, request.receive)

    @app.post("/v1/chat/completions", responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prep = router.validator.chat(body, router.max_model_len())
        fmt = ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", model_name, router.tokenizer, prep.prompts, prep.logprobs, body.return_token_ids, body.stream and body.include_usage())
        return await router.serve(fmt, prep, body.stream, request.receive)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=config.model, max_model_len=pool.max_model_len() or settings.max_model_len)])

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        ok = pool.can_serve()
        body = {
            "status": "ok" if ok else "unhealthy",
            "healthy_prefill": len(pool.healthy("prefill")),
            "healthy_decode": len(pool.healthy("decode")),
            "healthy_colocated": len(pool.healthy("colocated")),
            "reason": None if ok else pool.missing(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/workers", responses=ERROR_RESPONSES)
    async def workers() -> dict:
        return {"workers": [w.snapshot() for w in pool.workers]}

    @app.get("/metrics", responses=METRICS_RESPONSES)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if settings.api_key:
        app.add_middleware(TokenGuard, token=settings.api_key, header="authorization", protects=lambda _: True, what="API key")
    app.add_middleware(_CountRequests, metrics=metrics)
    return app


class _CountRequests:
    """pdserve_router_requests_total{route,status}; unknown paths count as route "other"."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 0

        async def send_status(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(route, str(status or 499)).inc()


async def _next(it: AsyncIterator, deadline: float, code: str = "timeout"):
    """The next item, or None at the end; OpenAIError 504 past the deadline."""
    try:  # not wait_for: on 3.11 it can swallow a cancellation (the client left) when the item is ready
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            return await _anext(it)
    except TimeoutError:
        what = "the request timed out" if code == "timeout" else "no first token before the first-token timeout"
        raise OpenAIError(504, what, code=code) from None


def _shutting_down() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down; this request was stopped", code="server_shutting_down")


async def _anext(it: AsyncIterator):
    return await anext(it, None)


async def _merge(gens: list[AsyncIterator[GenerateChunk]]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(choice index, chunk) from several generators as they come; the first error ends all."""
    if len(gens) == 1:
        try:
            async for c in gens[0]:
                yield 0, c
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: AsyncIterator[GenerateChunk]) -> None:
        try:
            async for c in g:
                await queue.put((i, c, None))
            await queue.put((i, None, None))
        except Exception as e:
            await queue.put((i, None, e))
        finally:
            await g.aclose()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, c, err = await queue.get()
            if err is not None:
                raise err
            if c is None:
                left -= 1
                continue
            yield i, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _vocab_size(model_dir: str) -> int:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {model_dir!r} has no config.json")
    with open(path) as f:
        return int(json.load(f)["vocab_size"])
