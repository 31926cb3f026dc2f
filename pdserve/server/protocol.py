"""The internal, token-level API between the router and the workers (versioned pydantic models).

Routes (workers only; the router serves none of them):

    POST /internal/generate   GenerateRequest -> NDJSON stream of GenerateChunk, one per line
    POST /internal/abort      RequestRef -> Ack      stop a running request, free its blocks
    POST /internal/release    RequestRef -> Ack      prefill: drop a held KV lease now
    GET  /internal/kv_metadata                       prefill: the NIXL peer info (bytes, JSON)
    GET  /internal/info       -> WorkerInfo

A PD request, as the router drives it:

    router --GenerateRequest(hold_kv=True)--------------------> prefill
    router <--GenerateChunk(token_ids=[t0], kv_handle=H)------- prefill   (first token: sent to the
                                                                           client at once)
    router --GenerateRequest(kv_handle=H, first_token=t0,
                             first_token_logprobs=...)--------> decode   (decode READs H's blocks,
    router <--GenerateChunk ... GenerateChunk(finish_reason)--- decode    tells prefill to release)

Chunks carry deltas with their offsets into the request's cumulative output (`token_offset`,
`text_offset`), so a reader can join streams that overlap: the decode worker's output starts with
the first token, which the router already has from prefill.

When /internal/* is bound beyond loopback, or a cluster secret is configured, requests must carry
SECRET_HEADER. Errors before a stream starts are OpenAI error objects (see errors.py); errors after
it started are a final chunk with finish_reason "error" and `error` set.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.disagg.base import KVHandle
from pdserve.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
SECRET_HEADER = "x-pdserve-cluster-secret"
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"

Role = Literal["prefill", "decode", "both"]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = PROTOCOL_VERSION

    @field_validator("version")
    @classmethod
    def _same_version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise ValueError(f"internal protocol version {v}; this pdserve speaks {PROTOCOL_VERSION}")
        return v


class LogprobEntry(BaseModel):
    token_id: int
    logprob: float
    rank: int  # 1-based
    token: str | None = None  # the token's text on its own


# One generated token's logprobs: the sampled token first, then its top-N alternatives by rank.
TokenLogprobs = list[LogprobEntry]


class GenerateRequest(_Message):
    request_id: str = Field(pattern=REQUEST_ID_PATTERN)
    prompt_token_ids: list[int] = Field(min_length=1)
    params: SamplingParams
    hold_kv: bool = False  # prefill role: keep the KV pinned for a decode worker
    kv_handle: KVHandle | None = None  # decode role: where the prompt's KV waits
    first_token: int | None = None  # decode role: the token prefill sampled
    first_token_logprobs: TokenLogprobs | None = None  # decode role, when params.logprobs is set


class GenerateChunk(_Message):
    request_id: str
    token_offset: int  # index of token_ids[0] in the request's output
    token_ids: list[int]
    text_offset: int  # index of text[0] in the request's output text
    text: str
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when requested
    finish_reason: str | None = None  # stop | length | abort | error; None while running or handing off
    stop_reason: int | str | None = None
    kv_handle: KVHandle | None = None  # prefill role: the request continues on a decode worker
    error: str | None = None  # finish_reason "error": why
    num_prompt_tokens: int = 0


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
    transfer_backend: str | None  # None: no connector (role both)
    pdserve_version: str


class WorkerHealth(BaseModel):
    """GET /health on a worker (200 when status is "ok", else 503)."""

    status: Literal["ok", "unhealthy"]
    role: Role
    engine_id: str
    reason: str | None = None
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


class RouterHealth(BaseModel):
    """GET /health on the router (200 when status is "ok": it can serve, else 503)."""

    status: Literal["ok", "unhealthy"]
    healthy_prefill: int
    healthy_decode: int
    healthy_colocated: int
