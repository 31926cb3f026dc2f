"""One request, as it crosses every boundary: router -> worker (JSON body of /internal/generate),
worker -> AsyncEngine -> LLMEngine -> Sequence (the same object, never unpacked into arguments).

Three shapes of the same model, by role:

    colocated / offline   Request(request_id, prompt_token_ids, params)
    prefill               ... hold_kv=True: keep the KV pinned for a decode worker after the first token
    decode                ... kv_handle=H, first_token=FirstToken(...): load H's KV, continue from the token
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.disagg.base import KVHandle
from pdserve.outputs import LogprobEntry
from pdserve.sampling_params import SamplingParams

REQUEST_VERSION = 1
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class FirstToken(BaseModel):
    """The token prefill sampled, as the decode side continues from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int
    logprobs: list[LogprobEntry] | None = None  # when params.logprobs is set: sampled token first
    text_offset: int = Field(0, ge=0)  # characters of output text the client already has


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = REQUEST_VERSION
    request_id: str = Field(pattern=REQUEST_ID_PATTERN)
    prompt_token_ids: list[int]
    params: SamplingParams = Field(default_factory=SamplingParams)
    prompt: str | None = None  # the text, when the caller had one (offline LLM); echoed in outputs
    hold_kv: bool = False  # prefill role
    kv_handle: KVHandle | None = None  # decode role: where the prompt's KV waits
    first_token: FirstToken | None = None  # decode role: goes with kv_handle

    @field_validator("version")
    @classmethod
    def _same_version(cls, v: int) -> int:
        if v != REQUEST_VERSION:
            raise ValueError(f"request version {v}; this pdserve speaks {REQUEST_VERSION}")
        return v

    @model_validator(mode="after")
    def _one_role(self) -> "Request":
        if self.hold_kv and self.kv_handle is not None:
            raise ValueError("a request is either prefill (hold_kv) or decode (kv_handle), not both")
        if (self.kv_handle is None) != (self.first_token is None):
            raise ValueError("kv_handle and first_token go together (decode role)")
        return self

    @property
    def role(self) -> str:
        return "prefill" if self.hold_kv else "decode" if self.kv_handle is not None else "colocated"
