"""Serving one request (`Router`; OpenAI's endpoints and Anthropic's Messages alike): admission,
deadlines, draining, the choices' chunks merged and turned into server-sent events or one JSON
response by the request's Formatter.

    Router.serve(fmt, prep, stream)
      admission (over --max-queued-requests: 429 with Retry-After)
      -> one Dispatcher.generate a prompt (dispatch.py; n > 1: its n choices), merged as they come (_merge)
      -> the first token awaited before answering, so an upstream failure is an HTTP status
      -> _events (SSE, an error event on failure) or _collect (JSON) with a Formatter (responses.py,
         messages_format.py)

Every request has a deadline (--request-timeout) after which it ends with 504 (or an error event if
streaming), and a shorter one for its first token (--first-token-timeout). A client that
disconnects, streaming or not, cancels its request at once (disconnect.py), which aborts it on the
workers. On a stop signal (start_draining) every open stream ends with a server_shutting_down error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from pdserve.chat.parsers import OutputSpec, default_parsers, resolve, tool_names
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.pool import WorkerPool
from pdserve.router.responses import Formatter
from pdserve.router.validation import Prepared, RequestValidator
from pdserve.serve_config import RouterServeConfig
from pdserve.tokenizer import Tokenizer
from pdserve.wire.disconnect import GuardedStreamingResponse, unless_disconnected
from pdserve.wire.errors import OpenAIError, too_busy
from pdserve.wire.protocol import SECRET_HEADER, GenerateChunk

log = logging.getLogger(__name__)


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
    def __init__(
        self, config: RouterServeConfig, vocab_size: int, pool: WorkerPool, tokenizer: Tokenizer, metrics: RouterMetrics
    ) -> None:
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
        model_type, template = _model_type(config.model), tokenizer.chat_template
        reasoning, tools = default_parsers(model_type, template if isinstance(template, str) else None)
        self.reasoning_parser = resolve(config.router.reasoning_parser, reasoning)
        self.tool_call_parser = resolve(config.router.tool_call_parser, tools)
        self.validator.tool_parser = self.tool_call_parser  # forced tool calls take its format
        self._special = frozenset(tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.all_special_ids)

    def output_spec(self, req: ChatCompletionRequest, prep: Prepared) -> OutputSpec:
        """How this chat request's output is read: the parsers, the tools it may call (none with
        tool_choice "none"), whether its prompt ends in thinking mode (the validator's `thinking`)."""
        names = tool_names(prep.tools) if prep.tool_choice != "none" else frozenset()
        return OutputSpec(
            reasoning_parser=self.reasoning_parser,
            tool_parser=self.tool_call_parser if names else None,
            tool_names=names,
            thinking=prep.thinking,
            drop=self._special if req.skip_special_tokens else frozenset(),
        )

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
        cancels the tasks waiting here, so a chunk costs no task of its own (a task and an
        asyncio.wait per chunk would add two event-loop turns to every token's latency)."""
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
        gens = [
            self.dispatcher.generate(f"{fmt.rid}-{i}", ids, fmt.worker_params(p))
            for i, (ids, p) in enumerate(zip(prep.prompts, prep.params))
        ]
        merged = _merge(gens, prep.n)

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
                return GuardedStreamingResponse(
                    events, close, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            await unless_disconnected(self._collect(fmt, first, merged, deadline), receive)
        except BaseException:
            await close()
            raise
        await close()
        self._done(fmt, t0)
        return JSONResponse(fmt.response())

    async def _collect(
        self, fmt: Formatter, first: tuple[int, GenerateChunk] | None, merged: AsyncIterator, deadline: float
    ) -> None:
        item = first
        while item is not None:
            fmt.add(*item)
            item = await self._next_unless(merged, deadline)

    async def _events(
        self, fmt: Formatter, first: tuple[int, GenerateChunk] | None, merged: AsyncIterator, t0: float, deadline: float
    ) -> AsyncIterator[bytes]:
        try:
            item = first
            while item is not None:
                data = fmt.chunk(*item)
                if data is not None:
                    yield data
                item = await self._next_unless(merged, deadline)
            tail = fmt.stream_end()
            self._done(fmt, t0)
            yield tail
        except OpenAIError as e:
            yield fmt.stream_error(e)

    def _done(self, fmt: Formatter, t0: float) -> None:
        self.metrics.e2e.observe(time.monotonic() - t0)
        usage = fmt.usage()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.generation_tokens.inc(usage.completion_tokens)
        failures = fmt.failures()
        for reason in failures:
            self.metrics.tool_parse_failures.labels(reason).inc()
        if failures:
            log.warning("request %s: model markup kept as text in content (%s)", fmt.rid, ", ".join(failures))


async def _next(it: AsyncIterator, deadline: float, code: str = "timeout"):
    """The next item, or None at the end; OpenAIError 504 past the deadline."""
    try:  # not wait_for: on 3.11 it can swallow a cancellation (the client left) when the item is ready
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            return await _anext(it)
    except TimeoutError:
        what = "the request timed out" if code == "timeout" else "no first token before the first-token timeout"
        raise OpenAIError(504, what, code=code) from None


def _model_type(model_dir: str) -> str | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("model_type")


def _shutting_down() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down; this request was stopped", code="server_shutting_down")


async def _anext(it: AsyncIterator):
    return await anext(it, None)


async def _merge(gens: list[AsyncIterator[GenerateChunk]], n: int = 1) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(choice index, chunk) from several generators (one a prompt, of n choices each: OpenAI's
    index prompt * n + i) as they come; the first error ends all."""
    if len(gens) == 1:
        try:
            async for c in gens[0]:
                yield c.index, c
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
            yield i * n + c.index, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
