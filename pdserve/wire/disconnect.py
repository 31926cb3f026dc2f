"""Noticing a client that went away, so that the work done for it upstream stops at once.

- `unless_disconnected(work, receive)`: the router races a non-streaming request (and a stream's
  wait for its first token) against the client closing its connection; if the client goes first,
  the work is cancelled (which aborts the workers' side) and ClientDisconnected is raised.
- `GuardedStreamingResponse`: a streaming response whose `on_close` runs exactly once however the
  response ends: finished, client gone, send failed, or cancelled before the body was ever
  iterated (an async generator that never started skips its `finally` on aclose()).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.wire.errors import OpenAIError

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the metrics count it


class ClientDisconnected(OpenAIError):
    def __init__(self) -> None:
        super().__init__(CLIENT_CLOSED, "the client closed the connection", code="client_closed")


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (call after the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """work's result; if the client disconnects first, work is cancelled and ClientDisconnected raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when we are cancelled ourselves
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task not in done:
        raise ClientDisconnected()
    return task.result()


class GuardedStreamingResponse(StreamingResponse):
    """StreamingResponse that always closes its body and then runs on_close (once)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close: Callable[[], Awaitable[None]] | None = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                on_close, self._on_close = self._on_close, None
                if on_close is not None:
                    await on_close()
