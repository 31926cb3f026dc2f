"""OpenAI error objects and the exception handlers that produce them.

Every error any pdserve HTTP server returns has OpenAI's shape:
    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

Status codes (as OpenAI uses them): 400 a body that is not JSON (malformed, empty, not UTF-8, nested
too deep, a non-JSON Content-Type) or a request that cannot be served as asked (context length,
unsupported option); 401 missing/wrong API key (or cluster secret on a worker); 404 unknown model
or route; 405 a method the route does not take (with Allow); 413 body too large; 400 too for a body
that does not match the schema (wrong types, missing fields, out-of-range values, unknown roles,
invalid Unicode), as OpenAI and vLLM answer it (the openai SDK raises BadRequestError); 429 over capacity (with Retry-After); 502/503/504 an upstream worker failed, none is
healthy, or it timed out. Never 500 for bad input. Error bodies are ASCII JSON (non-ASCII escaped).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pdserve.wire")

_TYPES = {401: "authentication_error", 429: "rate_limit_error"}
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's 400 detail for a body json.loads rejects


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIError(Exception):
    """Raise anywhere in a request: the handler turns it into the error object and status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=error_type(self.status), param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info()).model_dump()
        return _AsciiJSON(body, status_code=self.status, headers=self.headers)


class _AsciiJSON(JSONResponse):
    """Escapes non-ASCII: an error that quotes the client's input renders whatever that held."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def too_busy(what: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        429,
        f"{what} is at capacity; retry after {retry_after_s} s",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


# responses= for route decorators, so the OpenAPI schema documents the error shapes we return
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 502, 503, 504)
}


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """The parameter path, without "body" and without the names pydantic gives union members
    ("function-after[...]", "list[constrained-int]", ...)."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _is_member_tag(p))]
    return ".".join(parts) or None


def _is_member_tag(part: str) -> bool:
    return part in _TYPE_NAMES or any(c in part for c in "[]()-, ")


def _best(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a union's errors, the one that says most: a broken limit or rule beats "should be a string"."""
    said = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    return (said or errors)[0]


def _message(msg: str) -> str:
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError(400, "the request body is not valid JSON", code="invalid_json")
    first = _best(errors) if errors else {"loc": (), "msg": "invalid request"}
    param = _loc(first.get("loc", ()))
    if param is None and isinstance(first.get("input"), (bytes, bytearray)):  # FastAPI parses JSON content types only
        return OpenAIError(
            400, "the request body must be JSON, sent with Content-Type: application/json", code="invalid_content_type"
        )
    if param is None and first.get("type") == "missing":
        return OpenAIError(400, "the request body is empty: send a JSON object", code="invalid_json")
    if param is None and first.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return OpenAIError(400, "the request body must be a JSON object", code="invalid_value")
    if param and first.get("type") == "extra_forbidden":
        return OpenAIError(
            400,
            f"{param}: unrecognized request field (pdserve does not honour it)",
            param=param,
            code="unsupported_parameter",
        )
    others = {_top(e) for e in errors} - {_top(first)}
    more = f" (and problems with {', '.join(sorted(others))})" if others else ""
    where = f"{param}: " if param else ""
    return OpenAIError(
        400, f"{where}{_message(str(first.get('msg', 'invalid value')))}{more}", param=param, code="invalid_value"
    )


def _top(error: dict[str, Any]) -> str:
    param = _loc(error.get("loc", ()))
    return param.split(".", 1)[0] if param else "the body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = None
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and exc.detail == _FASTAPI_PARSE_ERROR:  # not UTF-8, nested too deep, a huge number
            msg, code = (
                "the request body cannot be parsed as JSON (invalid UTF-8, nesting too deep or a number too long)",
                "invalid_json",
            )
        else:
            msg = str(exc.detail)
        return OpenAIError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal error: {type(exc).__name__}").response()
