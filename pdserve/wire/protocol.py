"""The internal, token-level API between the router and the workers (versioned pydantic models).

Routes (workers only; the router serves none of them):

    POST /internal/generate   Request -> NDJSON stream of GenerateChunk, one per line
    POST /internal/abort      RequestRef -> Ack      stop a request, free its blocks (on prefill,
                                                     also KV it holds for a decode worker)
    GET  /internal/kv_metadata                       prefill: the connector's peer_metadata()
    GET  /internal/info       -> WorkerInfo

The body of /internal/generate is the engine's own Request (pdserve.engine.request): the worker
hands it to its engine as it is. A PD request, as the router drives it:

    router --Request(hold_kv=True)--------------------------> prefill
    router <--GenerateChunk(token_ids=[t0], kv_handle=H)----- prefill   (first token: sent to the
                                                                         client at once)
    router --Request(kv_handle=H, first_token=FirstToken(t0,
                     logprobs, text_offset))----------------> decode   (decode READs H's blocks,
    router <--GenerateChunk ... GenerateChunk(finish_reason)- decode    notifies prefill over NIXL)

The chunk that carries a worker's first new token also carries its `RequestTiming`: how long the
request queued there, the KV read (decode) and the compute up to that token. The router adds them
to its TTFT and hand-off histograms (router/metrics.py).

Chunks carry deltas of new output only, each with its offsets into the request's output
(`token_offset`, `text_offset`): a decode worker starts after the first token and after the text
the client already has (FirstToken.text_offset), so the router only checks that the offsets
continue where the last chunk ended.

When /internal/* is bound beyond loopback, or a cluster secret is configured, requests must carry
SECRET_HEADER. Errors before a stream starts are OpenAI error objects (see errors.py); errors after
it started are a final chunk with finish_reason "error" and `error` set (and `transfer_error`, as
data, when a KV load failed).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.disagg.base import KVHandle, TransferFailure
from pdserve.engine.request import REQUEST_ID_PATTERN, FirstToken, Request
from pdserve.outputs import TokenLogprobs

PROTOCOL_VERSION = 6  # 6: GenerateChunk.index (n > 1)
SECRET_HEADER = "x-pdserve-cluster-secret"

Role = Literal["prefill", "decode", "colocated"]

__all__ = [
    "FirstToken",
    "RequestTiming",
    "GenerateChunk",
    "Request",
    "RequestRef",
    "Ack",
    "WorkerInfo",
    "WorkerHealth",
    "RouterHealth",
]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = PROTOCOL_VERSION

    @field_validator("version")
    @classmethod
    def _same_version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise ValueError(f"internal protocol version {v}; this pdserve speaks {PROTOCOL_VERSION}")
        return v


class RequestTiming(BaseModel):
    """A worker's account of one request, from its arrival there to the first token it produced,
    in seconds on the worker's monotonic clock; the parts add up to that whole span.

    prefill, colocated (and decode when it recomputes): queue_s = arrival -> the step that first
    ran it, compute_s = that step's start -> the end of the step that sampled the token.
    decode with a KV read: queue_s = arrival -> read posted (waiting for blocks), transfer_s = the
    read, compute_s = read done -> end of the first decode step (scheduling included)."""

    model_config = ConfigDict(extra="forbid")

    queue_s: float = Field(ge=0)
    compute_s: float = Field(ge=0)
    transfer_s: float | None = Field(None, ge=0)
    transfer_bytes: int | None = Field(None, ge=0)
    transfer_bytes_saved: int | None = Field(None, ge=0)  # not read: blocks decode's prefix cache held


class GenerateChunk(_Message):
    request_id: str
    index: int = 0  # the sequence it continues (n > 1: 0 .. n - 1; chunks of several interleave)
    token_offset: int  # index of token_ids[0] in the request's output
    token_ids: list[int]
    text_offset: int  # index of text[0] in the request's output text
    text: str
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when requested
    finish_reason: str | None = None  # stop | length | abort | error; None while running or handing off
    stop_reason: int | str | None = None
    kv_handle: KVHandle | None = None  # prefill role: the request continues on a decode worker
    kv_handoff_sent: bool = False  # prefill role: the decode engine named in kv_to was notified itself
    error: str | None = None  # finish_reason "error": why
    transfer_error: TransferFailure | None = None  # finish_reason "error" from a failed KV load
    num_prompt_tokens: int = 0
    # prompt tokens this worker served from its prefix cache (usage.prompt_tokens_details.cached_tokens;
    # under PD the prefill worker's number: a decode worker that loaded the prompt's KV sends 0)
    num_cached_tokens: int = 0
    timing: RequestTiming | None = None  # on the chunk with this worker's first new token


class RequestRef(_Message):
    request_id: str = Field(pattern=REQUEST_ID_PATTERN)


class Ack(_Message):
    ok: bool = True


class WorkerInfo(_Message):
    role: Role
    engine_id: str
    model: str  # the checkpoint folder's name
    max_model_len: int
    kv_block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    device: str
    dtype: str
    transfer_backend: str | None  # None: no connector (role colocated)
    instance_id: str | None = None  # this start of its engine (None: no connector)
    kv_metadata_url: str | None = None  # where it serves its transfer metadata (None: no connector)
    gpus: list[str] = Field(default_factory=list)  # UUIDs of the GPUs its ranks use (none on cpu)
    prefix_caching: bool = False  # it keeps a prefix cache (the router's auto prefill policy reads it)
    pdserve_version: str


class WorkerHealth(BaseModel):
    """GET /health on a worker (200 when status is "ok", else 503)."""

    status: Literal["ok", "unhealthy"]
    role: Role
    engine_id: str
    instance_id: str | None = None  # changes when the worker restarts: the router re-reads /internal/info
    reason: str | None = None
    engine_heartbeat_age_s: float = 0.0  # seconds since the engine loop last turned (grows during a step)
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # prefix cache: blocks no request holds, kept for a hit (not in kv_blocks_used)
    kv_window_blocks_used: int = 0  # sliding-window block space (0 of 0 for models without one)
    kv_window_blocks_total: int = 0


class RouterHealth(BaseModel):
    """GET /health on the router (200 when status is "ok": it can serve, else 503)."""

    status: Literal["ok", "unhealthy"]
    healthy_prefill: int
    healthy_decode: int
    healthy_colocated: int
    reason: str | None = None  # when unhealthy: which role has no available worker
