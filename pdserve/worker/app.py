"""A worker: one engine behind HTTP, in role prefill, decode or colocated.

Public: GET /health (200 only while the model is loaded and the engine loop alive and not stalled:
a step unfinished for longer than the stall timeout while requests are open is 503), GET /metrics.
Internal (pdserve.wire.protocol): /internal/generate, /internal/abort, /internal/kv_metadata,
/internal/info - guarded by the cluster secret when one is configured.

/internal/generate takes the engine's Request as its body and hands it to the engine as it is (a
PD request's peer - decode: the prefill engine; prefill: the decode engine of kv_to - has its
transfer metadata fetched first, on the event loop: peers.py). /internal/handoff (decode) gives a
waiting request (Request.kv_from) its Handoff when the router, not prefill, delivers it.
The engine's delta outputs go out as NDJSON chunks with their offsets into the request's output; a
decode worker's start after the first token and the text the client already has (FirstToken.text_offset), a
migrated request's after its Request.resume. The first
chunk with a new token carries the request's RequestTiming (queue, KV read, compute: timing.py).
If the reader goes away before the request finished (however the response ends, even before it
started), the request is aborted, which frees its blocks (and, on prefill, any KV it holds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdserve.engine.request import Handoff, Request
from pdserve.outputs import CompletionOutput, RequestOutput, to_entries
from pdserve.wire.disconnect import GuardedStreamingResponse
from pdserve.wire.errors import OpenAIError, install_error_handlers, too_busy
from pdserve.wire.http import BodyLimit, TokenGuard
from pdserve.wire.metrics import CONTENT_TYPE, render
from pdserve.wire.protocol import SECRET_HEADER, Ack, GenerateChunk, RequestRef, WorkerHealth, WorkerInfo
from pdserve.worker.async_engine import AsyncEngine, RequestStream
from pdserve.worker.drain import Drain
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.peers import PeerMetadataFetcher

PUBLIC_PATHS = ("/health", "/metrics")  # probes and scrapers; with a secret, every other path needs it
MAX_BODY_BYTES = 32 << 20  # token ids of a long prompt are a few MB of JSON at most


@dataclass
class WorkerState:
    engine: AsyncEngine
    info: WorkerInfo
    metrics: WorkerMetrics
    max_open_requests: int  # admitted and unfinished; beyond this /internal/generate answers 429
    kv_metadata: bytes | None  # the connector's peer_metadata() (prefill and decode roles)
    peers: PeerMetadataFetcher | None  # decode role
    drain: Drain | None = None  # a stop signal drains the worker first (drain.py)


def _draining(state: WorkerState) -> bool:
    return state.drain is not None and state.drain.draining


def build_worker_app(state: WorkerState, cluster_secret: str | None) -> FastAPI:
    app = FastAPI(title=f"pdserve {state.info.role} worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.state.worker = state

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = state.engine.stats()
        stalled = state.engine.stalled()
        draining = "draining: stopping once its open requests end" if _draining(state) else None
        ok = state.engine.alive and stalled is None and draining is None
        body = WorkerHealth(
            status="ok" if ok else "unhealthy",
            role=state.info.role,
            engine_id=state.info.engine_id,
            instance_id=state.info.instance_id,
            reason=None if ok else (state.engine.error or stalled or draining or "engine stopped"),
            engine_heartbeat_age_s=round(state.engine.heartbeat_age(), 3),
            num_requests_running=stats.num_running,
            num_requests_waiting=stats.num_waiting,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_cached=stats.kv_blocks_cached,
            kv_window_blocks_used=stats.kv_window_blocks_used,
            kv_window_blocks_total=stats.kv_window_blocks_total,
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

    @app.post("/internal/generate")
    async def generate(req: Request) -> GuardedStreamingResponse:
        _check_role(state.info.role, req)
        if _draining(state):
            raise OpenAIError(503, f"worker {state.info.engine_id} is draining", code="engine_unavailable")
        if state.engine.num_open >= state.max_open_requests:
            raise too_busy(f"worker {state.info.engine_id}")
        ref = req.kv_handle or req.kv_from or req.kv_to
        peer = await state.peers.fetch(ref) if ref is not None and state.peers is not None else None
        try:
            stream = state.engine.add(req, peer)
        except ValueError as e:
            raise OpenAIError(400, str(e), code="invalid_request") from None
        except RuntimeError as e:
            raise OpenAIError(503, str(e), code="engine_unavailable") from None
        chunks = _chunks(state, req, stream)

        async def abort_unless_finished() -> None:
            if not stream.finished:
                state.engine.abort(req.request_id)

        return GuardedStreamingResponse(_ndjson(chunks), abort_unless_finished, media_type="application/x-ndjson")

    @app.post("/internal/handoff")
    async def handoff(h: Handoff) -> Ack:
        if state.info.role != "decode":
            raise OpenAIError(400, f"a {state.info.role} worker takes no hand-offs")
        if not state.engine.is_open(h.request_id):
            raise OpenAIError(404, f"no request {h.request_id!r} is open on this worker")
        state.engine.deliver_handoff(h)
        return Ack()

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if cluster_secret:
        app.add_middleware(
            TokenGuard,
            token=cluster_secret,
            header=SECRET_HEADER,
            protects=lambda p: p not in PUBLIC_PATHS,
            what="cluster secret",
        )
    return app


def _check_role(role: str, req: Request) -> None:
    if req.role != role:
        raise OpenAIError(
            400,
            f"a {role} worker does not serve {req.role} requests (hold_kv: prefill; kv_handle + first_token or kv_from: decode; none: colocated)",
        )


async def _ndjson(chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk.model_dump_json(exclude_none=True).encode() + b"\n"
    finally:
        await chunks.aclose()


async def _chunks(state: WorkerState, req: Request, stream: RequestStream) -> AsyncIterator[GenerateChunk]:
    """The engine's deltas as chunks, from where the client's output stands (decode: the engine's
    output begins with prefill's first token and its text, whose length comes with the hand-off;
    n > 1: a chunk per sequence that advanced, by index, each from its start)."""
    decode = req.role == "decode"
    single = req.params.num_seqs == 1
    resumed = len(req.resume.token_ids) if req.resume is not None else 0  # a migrated request's output so far
    if decode and single:
        first = _Output(sent_tokens=resumed + 1, sent_text=None)
    else:
        first = _Output(sent_tokens=resumed, sent_text=req.resume.text_offset if resumed else 0)
    outputs: dict[int, _Output] = {}
    metrics = state.metrics
    counted, timed = decode, False  # prompt tokens count where they were computed
    async for out in stream:
        for comp in out.outputs:
            pos = outputs.setdefault(comp.index, first if comp.index == 0 else _Output())
            if pos.sent_text is None:
                pos.sent_text = out.prefill_text_offset or 0  # None: it ended before its hand-off came
            chunk = _chunk(out, comp, req, pos, single)
            if not timed and chunk.token_ids:  # this worker's first new token: its timing goes with it
                chunk.timing, timed = stream.timing, True
            if not counted and (chunk.token_ids or chunk.kv_handle is not None):
                metrics.prompt_tokens.inc(len(req.prompt_token_ids))
                counted = True
            metrics.generation_tokens.inc(len(chunk.token_ids))
            pos.sent_tokens = chunk.token_offset + len(chunk.token_ids)
            pos.sent_text = chunk.text_offset + len(chunk.text)
            if chunk.token_ids or chunk.text or chunk.finish_reason or out.finished:
                yield chunk


@dataclass
class _Output:
    """One sequence's output: how much of it the engine has made, and how much the client has."""

    made_tokens: int = 0
    made_text: int = 0
    sent_tokens: int = 0
    sent_text: int | None = 0  # None: decode, until the hand-off's text offset is known


def _chunk(out: RequestOutput, comp: CompletionOutput, req: Request, pos: _Output, single: bool) -> GenerateChunk:
    """The part of a delta output (which starts at what was made) past what was sent; advances `made`."""
    skip_tokens, skip_text = max(0, pos.sent_tokens - pos.made_tokens), max(0, pos.sent_text - pos.made_text)
    pos.made_tokens += len(comp.token_ids)
    pos.made_text += len(comp.text)
    logprobs = [to_entries(lp) for lp in comp.logprobs[skip_tokens:]] if comp.logprobs is not None else None
    return GenerateChunk(
        request_id=out.request_id,
        index=comp.index,
        token_offset=pos.sent_tokens,
        token_ids=comp.token_ids[skip_tokens:],
        text_offset=pos.sent_text,
        text=comp.text[skip_text:],
        logprobs=logprobs,
        finish_reason=comp.finish_reason if out.finished or not single else None,
        stop_reason=comp.stop_reason,
        kv_handle=out.kv_handle,
        kv_handoff_sent=out.kv_handoff_sent,
        error=out.error,
        transfer_error=out.transfer_error,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens or 0,
    )
