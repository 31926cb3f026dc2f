"""Errors of the Messages routes (/v1/messages, /v1/messages/count_tokens) in Anthropic's shape:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}

Every error is first made as the rest of the router makes it (an OpenAIError from the validator,
the schema's 400 naming the field, the API key's 401, the body cap's 413, a worker's failure), so
they are all the same errors with the same messages; `AnthropicErrors` rewrites those responses
on these paths, with Anthropic's status and type for each:

    400 -> 400 invalid_request_error    413 -> 413 request_too_large    503 -> 529 overloaded_error
    401 -> 401 authentication_error     429 -> 429 rate_limit_error     504 -> 504 timeout_error
    404 -> 404 not_found_error          other 5xx -> 500 api_error      other 4xx: invalid_request_error

An error once a stream has started is an `error` event (messages_format.py) of the same shape.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.wire.errors import OpenAIError

PATH = "/v1/messages"
STATUS = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),  # no healthy worker, or shutting down: Anthropic's "overloaded"
    504: (504, "timeout_error"),
}
_DROPPED = (b"content-length", b"content-type")


def anthropic_status(status: int) -> tuple[int, str]:
    """(Anthropic's status, its error type) for the router's status."""
    if status in STATUS:
        return STATUS[status]
    return (500, "api_error") if status >= 500 else (status, "invalid_request_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": anthropic_status(status)[1], "message": message}}


def error_of(e: OpenAIError) -> dict:
    return error_body(e.status, e.message)


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


class AnthropicErrors:
    """ASGI middleware: an error response (status >= 400) on a Messages path, rewritten in
    Anthropic's shape and status (its headers, Retry-After or WWW-Authenticate, kept). Anything
    else passes through untouched, streams included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewrite(msg: Message) -> None:
            nonlocal start, body
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                start = msg  # held until the body is in
                return
            if start is None or msg["type"] != "http.response.body":
                await send(msg)
                return
            body += msg.get("body", b"")
            if msg.get("more_body", False):
                return
            status, payload = _rewritten(start["status"], body)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in _DROPPED]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})

        await self.app(scope, receive, rewrite)


def _rewritten(status: int, body: bytes) -> tuple[int, bytes]:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):  # not the router's error object: its text, whatever it is
        message = body[:500].decode(errors="replace") or f"HTTP {status}"
    out = error_body(status, str(message))
    return anthropic_status(status)[0], json.dumps(out, ensure_ascii=True, separators=(",", ":")).encode("ascii")
