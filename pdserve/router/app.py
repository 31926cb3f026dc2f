"""The router's FastAPI app: pdserve's OpenAI-compatible front door (DESIGN.md, port 8000).

    POST /v1/completions, /v1/chat/completions    validate -> Router.serve (serving.py):
                                                  dispatch (dispatch.py) -> format (responses.py)
    POST /v1/messages                             Anthropic's Messages API: translated into the chat
                                                  path (messages.py) -> Router.serve -> messages_format.py
    POST /v1/messages/count_tokens                the prompt's token count (messages.py)
    POST /v1/responses                            OpenAI's Responses API, stateless: translated into the
                                                  chat path (responses_api.py) -> Router.serve ->
                                                  responses_api_format.py
    POST /tokenize, /detokenize                   a prompt or chat messages <-> token ids (tokenize.py)
    GET  /v1/models, /health, /workers, /metrics

Thin by design: it tokenizes (the chat template for chat), validates, mints a request id, and hands
the request to the Router (admission, deadlines, streaming). It never serves /internal/*. With
--api-key every route (/health and /metrics too) needs `Authorization: Bearer <key>` or
`x-api-key: <key>` (as Anthropic clients send it; constant-time compare). Errors on the Messages
routes take Anthropic's shape (messages_errors.py). The lifespan opens the HTTP clients, makes the
Dispatcher and runs the health prober.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from contextlib import asynccontextmanager

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.dispatch import Dispatcher
from pdserve.router.messages import count_tokens, prepare
from pdserve.router.messages_errors import AnthropicErrors
from pdserve.router.messages_format import COUNT_TOKENS_RESPONSES, MESSAGES_RESPONSES, MessagesFormatter
from pdserve.router.messages_protocol import CountTokensRequest, CountTokensResponse, MessagesRequest
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pdserve.router.policies import make_policy
from pdserve.router.pool import WorkerPool
from pdserve.router.responses import (
    CHAT_RESPONSES,
    COMPLETION_RESPONSES,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    ChatFormatter,
    CompletionFormatter,
)
from pdserve.router.responses_api import prepare as prepare_response
from pdserve.router.responses_api import settings as response_settings
from pdserve.router.responses_api_format import RESPONSES_API_RESPONSES, ResponsesFormatter
from pdserve.router.responses_api_protocol import ResponsesRequest
from pdserve.router.serving import Router
from pdserve.router.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from pdserve.serve_config import RouterServeConfig
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import ERROR_RESPONSES, install_error_handlers
from pdserve.wire.http import BodyLimit, TokenGuard
from pdserve.wire.metrics import CONTENT_TYPE

MAX_BODY_BYTES = 8 << 20
READ_BUFSIZE = 1 << 20  # a worker's chunk is one NDJSON line; aiohttp refuses a line over twice this
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/workers",
    "/metrics",
)


def build_router_app(config: RouterServeConfig) -> FastAPI:
    settings = config.router
    metrics = RouterMetrics()
    pool = WorkerPool(
        config.prefill,
        config.decode,
        config.colocated,
        metrics,
        breaker_failures=settings.breaker_failures,
        breaker_cooldown_s=settings.breaker_cooldown,
    )
    tokenizer = Tokenizer(config.model, settings.chat_encoder_revision)
    router = Router(config, _vocab_size(config.model), pool, tokenizer, metrics)
    router.validator.set_chat_defaults(settings.default_chat_template_kwargs)
    model_name = router.model_name

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Requests stream through aiohttp: it costs the router less CPU per streamed token than httpx
        # (docs/pd-gpu.md), and that cost is paid on every token. The prober keeps httpx, on a
        # client of its own, so a probe never waits behind the streams for a connection.
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=settings.request_timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)  # < the workers' 75 s keep-alive
        async with (
            aiohttp.ClientSession(
                connector=connector, timeout=timeout, read_bufsize=READ_BUFSIZE, auto_decompress=False
            ) as session,
            httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as probe_client,
        ):
            router.dispatcher = Dispatcher(
                pool,
                session,
                make_policy(
                    settings.prefill_policy, cache=settings.cache_aware, observe=metrics.cache_route("prefill")
                ),
                make_policy(settings.decode_policy, cache=settings.cache_aware, observe=metrics.cache_route("decode")),
                router.headers,
                metrics,
                settings,
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
        fmt = CompletionFormatter(
            f"cmpl-{uuid.uuid4().hex}",
            model_name,
            router.tokenizer,
            prep.prompts,
            prep.logprobs,
            body.return_token_ids,
            body.stream and body.include_usage(),
            n=prep.n,
        )
        return await router.serve(fmt, prep, body.stream, request.receive)

    @app.post("/v1/chat/completions", responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prep = router.validator.chat(body, router.max_model_len())
        fmt = ChatFormatter(
            f"chatcmpl-{uuid.uuid4().hex}",
            model_name,
            router.tokenizer,
            prep.prompts,
            prep.logprobs,
            body.return_token_ids,
            body.stream and body.include_usage(),
            n=prep.n,
            output=router.output_spec(body, prep),
        )
        return await router.serve(fmt, prep, body.stream, request.receive)

    @app.post("/v1/messages", responses=MESSAGES_RESPONSES)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        chat, prep = prepare(router.validator, body, router.max_model_len())
        omit = body.thinking is not None and body.thinking.display == "omitted"
        fmt = MessagesFormatter(
            f"msg_{uuid.uuid4().hex}", model_name, router.tokenizer, prep.prompts, router.output_spec(chat, prep), omit
        )
        return await router.serve(fmt, prep, body.stream, request.receive)

    @app.post("/v1/messages/count_tokens", responses=COUNT_TOKENS_RESPONSES)
    async def messages_count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return count_tokens(router.validator, body)

    @app.post("/v1/responses", responses=RESPONSES_API_RESPONSES)
    async def responses_api(body: ResponsesRequest, request: Request) -> Response:
        chat, prep = prepare_response(router.validator, body, router.max_model_len())
        output = router.output_spec(chat, prep)
        echo = response_settings(body, prep)
        fmt = ResponsesFormatter(f"resp_{uuid.uuid4().hex}", model_name, router.tokenizer, prep.prompts, output, echo)
        return await router.serve(fmt, prep, bool(body.stream), request.receive)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return tokenize(router.validator, body, router.max_model_len())

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(router.validator, body)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=model_name, root=config.model, max_model_len=pool.max_model_len() or settings.max_model_len
                )
            ]
        )

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
        app.add_middleware(
            TokenGuard,
            token=settings.api_key,
            header="authorization",
            protects=lambda _: True,
            what="API key",
            also=("x-api-key",),
        )
    app.add_middleware(AnthropicErrors)  # outside the guards: their 401 and 413 too
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
        status, counted = 0, False

        def count() -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.requests.labels(route, str(status or 499)).inc()

        async def send_status(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                count()  # before the last byte: a client that has its answer finds it counted
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            count()  # a response that never finished (the client went away: 499)


def _vocab_size(model_dir: str) -> int:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {model_dir!r} has no config.json")
    with open(path) as f:
        return int(json.load(f)["vocab_size"])
