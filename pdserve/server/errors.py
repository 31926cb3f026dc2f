"""OpenAI error objects and the exception handlers that produce them.

Every error any pdserve HTTP server returns has OpenAI's shape:
    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

Status codes (as OpenAI uses them): 400 malformed JSON or a request that cannot be served as asked
(context length, unsupported option); 401 missing/wrong API key (or cluster secret on a worker);
404 unknown model or route; 413 body too large; 422 a body that does not match the schema (wrong
types, missing fields, out-of-range values, unknown roles); 429 over capacity (with Retry-After);
502/503/504 an upstream worker failed, none is healthy, or it timed out. Never 500 for bad input.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pdserve.server")

_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


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
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def too_busy(what: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(429, f"{what} is at capacity; retry after {retry_after_s} s", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


# responses= for route decorators, so the OpenAPI schema documents the error shapes we return
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 422, 429, 502, 503, 504)
}


def _loc(loc: tuple[Any, ...] | list[Any]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError(400, "the request body is not valid JSON", code="invalid_json")
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc(first.get("loc", ()))
    if first.get("type") == "missing" and param is None:
        return OpenAIError(400, "the request needs a JSON object body", code="invalid_json")
    msg = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return OpenAIError(422, f"{where}{msg}{more}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return OpenAIError(exc.status_code, msg, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal error: {type(exc).__name__}").response()
