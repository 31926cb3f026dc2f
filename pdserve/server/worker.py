"""A worker: one engine behind HTTP, in role prefill, decode or both (colocated).

Public: GET /health (200 only while the model is loaded and the engine loop alive), GET /metrics.
Internal (protocol.py): /internal/generate, /internal/abort, /internal/release,
/internal/kv_metadata, /internal/info - guarded by the cluster secret when one is configured.

/internal/generate turns the engine's cumulative outputs into NDJSON deltas; if the reader goes
away before the request finished (however the response ends, even before it started), the
request is aborted, which frees its blocks (and, on prefill, any KV it already holds). A prefill (hold_kv)
request ends with one chunk: the first token and the KV handle. Its text is cut back as a stream's
would be while stop strings might still match: the decode side may yet cut there, and the router
must never have sent what it cuts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdserve.outputs import Logprob, RequestOutput
from pdserve.server.async_engine import AsyncEngine
from pdserve.server.errors import OpenAIError, install_error_handlers, too_busy
from pdserve.server.disconnect import GuardedStreamingResponse
from pdserve.server.http import BodyLimit, TokenGuard
from pdserve.server.metrics import CONTENT_TYPE, WorkerMetrics, render
from pdserve.server.protocol import (
    SECRET_HEADER,
    Ack,
    GenerateChunk,
    GenerateRequest,
    LogprobEntry,
    RequestRef,
    TokenLogprobs,
    WorkerHealth,
    WorkerInfo,
)

PUBLIC_PATHS = ("/health", "/metrics")  # probes and scrapers; with a secret, every other path needs it
MAX_BODY_BYTES = 32 << 20  # token ids of a long prompt are a few MB of JSON at most


@dataclass
class WorkerState:
    engine: AsyncEngine
    info: WorkerInfo
    metrics: WorkerMetrics
    max_open_requests: int  # admitted and unfinished; beyond this /internal/generate answers 429
    kv_metadata: bytes | None  # the connector's peer info (prefill, both with a connector)


def build_worker_app(state: WorkerState, cluster_secret: str | None) -> FastAPI:
    app = FastAPI(title=f"pdserve {state.info.role} worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.worker = state

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = state.engine.engine.get_stats()
        ok = state.engine.alive
        body = WorkerHealth(
            status="ok" if ok else "unhealthy",
            role=state.info.role,
            engine_id=state.info.engine_id,
            reason=None if ok else (state.engine.error or "engine stopped"),
            num_requests_running=stats.num_running,
            num_requests_waiting=stats.num_waiting,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
        )
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(state.metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/internal/info")
    async def info() -> WorkerInfo:
        return state.info

    @app.get("/internal/kv_metadata")
    async def kv_metadata() -> Response:
        if state.kv_metadata is None:
            raise OpenAIError(404, f"this {state.info.role} worker has no KV connector")
        return Response(state.kv_metadata, media_type="application/json")

    @app.post("/internal/abort")
    async def abort(ref: RequestRef) -> Ack:
        state.engine.abort(ref.request_id)
        return Ack()

    @app.post("/internal/release")
    async def release(ref: RequestRef) -> Ack:
        state.engine.release(ref.request_id)
        return Ack()

    @app.post("/internal/generate")
    async def generate(req: GenerateRequest) -> GuardedStreamingResponse:
        _check_role(state.info.role, req)
        if state.engine.num_open >= state.max_open_requests:
            raise too_busy(f"worker {state.info.engine_id}")
        try:
            stream = state.engine.add(
                req.request_id,
                req.prompt_token_ids,
                req.params,
                hold_kv=req.hold_kv,
                kv_handle=req.kv_handle,
                first_token=req.first_token,
                first_token_logprobs=_to_engine_logprobs(req.first_token_logprobs),
            )
        except ValueError as e:
            raise OpenAIError(400, str(e), code="invalid_request") from None
        except RuntimeError as e:
            raise OpenAIError(503, str(e), code="engine_unavailable") from None
        chunks = _chunks(state, req, stream)

        async def abort_unless_finished() -> None:
            if not stream.finished:
                state.engine.abort(req.request_id)

        return GuardedStreamingResponse(_ndjson(chunks), abort_unless_finished, media_type="application/x-ndjson")

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if cluster_secret:
        app.add_middleware(
            TokenGuard, token=cluster_secret, header=SECRET_HEADER, protects=lambda p: p not in PUBLIC_PATHS, what="cluster secret"
        )
    return app


def _check_role(role: str, req: GenerateRequest) -> None:
    if role == "prefill" and (not req.hold_kv or req.kv_handle is not None):
        raise OpenAIError(400, "a prefill worker serves hold_kv requests only (the decode side continues them)")
    if role == "decode" and (req.kv_handle is None or req.first_token is None):
        raise OpenAIError(400, "a decode worker serves requests with a kv_handle and first_token only")
    if role == "both" and (req.hold_kv or req.kv_handle is not None):
        raise OpenAIError(400, "a colocated (both) worker serves whole requests: no hold_kv, no kv_handle")


async def _ndjson(chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk.model_dump_json(exclude_none=True).encode() + b"\n"
    finally:
        await chunks.aclose()


async def _chunks(state: WorkerState, req: GenerateRequest, stream) -> AsyncIterator[GenerateChunk]:
    """Deltas of the engine's cumulative outputs."""
    sent_tokens = sent_text = 0
    metrics, role = state.metrics, state.info.role
    async for out in stream:
        chunk = _delta(out, req, sent_tokens, sent_text)
        if role != "decode" and sent_tokens == 0 and chunk.token_ids:
            metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        new = len(chunk.token_ids) - (1 if role == "decode" and sent_tokens == 0 and chunk.token_ids else 0)
        metrics.generation_tokens.inc(max(0, new))
        sent_tokens = chunk.token_offset + len(chunk.token_ids)
        sent_text = chunk.text_offset + len(chunk.text)
        if chunk.token_ids or chunk.text or out.finished:
            yield chunk


def _delta(out: RequestOutput, req: GenerateRequest, sent_tokens: int, sent_text: int) -> GenerateChunk:
    comp = out.outputs[0]
    text = comp.text
    if out.kv_handle is not None:
        text = _safe_handoff_text(text, req)
    ids = comp.token_ids[sent_tokens:]
    logprobs = [_entries(lp) for lp in comp.logprobs[sent_tokens:]] if comp.logprobs is not None else None
    return GenerateChunk(
        request_id=out.request_id,
        token_offset=sent_tokens,
        token_ids=ids,
        text_offset=sent_text,
        text=text[sent_text:],
        logprobs=logprobs,
        finish_reason=comp.finish_reason if out.finished else None,
        stop_reason=comp.stop_reason,
        kv_handle=out.kv_handle,
        error=out.error,
        num_prompt_tokens=len(req.prompt_token_ids),
    )


def _safe_handoff_text(text: str, req: GenerateRequest) -> str:
    """Hold back what a stop string completed on the decode side could still remove."""
    p = req.params
    if not p.stop or p.include_stop_str_in_output:
        return text
    hold = max(len(s) for s in p.stop) - 1
    return text[: max(0, len(text) - hold)]


def _entries(step: dict[int, Logprob]) -> TokenLogprobs:
    return [LogprobEntry(token_id=t, logprob=lp.logprob, rank=lp.rank, token=lp.decoded_token) for t, lp in step.items()]


def _to_engine_logprobs(entries: TokenLogprobs | None) -> dict[int, Logprob] | None:
    if entries is None:
        return None
    return {e.token_id: Logprob(logprob=e.logprob, rank=e.rank, decoded_token=e.token) for e in entries}

