"""HTTP plumbing shared by the router and the workers: two ASGI guards (a token on some paths, a
cap on body size).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.wire.errors import OpenAIError


async def _send_error(send: Send, err: OpenAIError) -> None:
    resp = err.response()
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


class TokenGuard:
    """ASGI middleware: requests whose path `protects` selects must carry the token, compared in
    constant time. `header` is read as given ("authorization" expects "Bearer <token>"); `also`
    names headers that may carry the bare token instead (the router's x-api-key, as Anthropic
    clients send it).

    Both sides are hashed first, so the comparison takes the same time whatever the given token's
    length and content (hmac.compare_digest alone returns early on a length mismatch)."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        header: str,
        protects: Callable[[str], bool],
        what: str,
        also: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.token = _digest(token.encode())
        self.header = header.lower().encode()
        self.names = {self.header, *(h.lower().encode() for h in also)}
        self.protects = protects
        self.what = what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope["path"]) or self._ok(scope):
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"} if self.header == b"authorization" else None
        await _send_error(
            send, OpenAIError(401, f"missing or wrong {self.what}", code="invalid_api_key", headers=headers)
        )

    def _ok(self, scope: Scope) -> bool:
        offered = [self._credential(n, v) for n, v in scope.get("headers", []) if n in self.names] or [b""]
        # every offered credential is compared (a list, not any() over a generator): no early exit
        return any([hmac.compare_digest(_digest(given.strip()), self.token) for given in offered])

    def _credential(self, name: bytes, value: bytes) -> bytes:
        """The token a header offers: authorization's after "Bearer ", any other's whole value."""
        if name != b"authorization":
            return value
        scheme, _, given = value.partition(b" ")
        return given if scheme.lower() == b"bearer" else b""


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class BodyLimit:
    """ASGI middleware: bodies over max_bytes get 413 before the app sees them. The body is read
    here (it is small by construction), then replayed; later receives (disconnects) pass through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, self._too_large())
                return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await _send_error(send, self._too_large())
                return
            more = msg.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"request body is larger than {self.max_bytes} bytes", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
