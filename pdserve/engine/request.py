"""One request, as it crosses every boundary: router -> worker (JSON body of /internal/generate),
worker -> AsyncEngine -> LLMEngine -> Sequence (the same object, never unpacked into arguments).

Three shapes of the same model, by role:

    colocated / offline   Request(request_id, prompt_token_ids, params)
    prefill               ... hold_kv=True: keep the KV pinned for a decode worker after the first token
                              (+ kv_to=decode engine: send it the Handoff when the KV is ready)
    decode                ... kv_handle=H, first_token=FirstToken(...): load H's KV, continue from the token
                              (n > 1: H holds all but the last prompt token and no first token
                              comes: the decode worker forks, engine/forks.py)
                          ... or kv_from=prefill engine: wait for its Handoff (H and the first token),
                              sent over the transfer backend or posted by the router

Any of them may carry resume=Resume(token_ids, text_offset): a request the router migrated from a
failed worker continues after the output its client already has.
The router sends a PD request to both workers at once (kv_to / kv_from), so decode has it before
prefill is done and the hand-off is one notification between the engines (see router/dispatch.py).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.disagg.base import KVHandle, KVPeerRef
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


class Resume(BaseModel):
    """The output a client already has of a request continued on another worker (the router's
    migration, router/dispatch.py): the engine takes these tokens as the request's first outputs
    (its KV computed with the prompt's; a seeded draw, min_tokens and penalties count them) and
    sends only what follows them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    token_ids: list[int] = Field(min_length=1)
    text_offset: int = Field(0, ge=0)  # characters of output text the client already has


class Handoff(BaseModel):
    """A prefilled request's KV and first token, prefill -> decode: a notification between the
    engines (the connector's send_handoff), or the body of a decode worker's /internal/handoff."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = REQUEST_VERSION
    request_id: str = Field(pattern=REQUEST_ID_PATTERN)
    kv_handle: KVHandle
    first_token: FirstToken | None = None  # None: n > 1, the decode worker samples each first token

    @model_validator(mode="after")
    def _same_request(self) -> Handoff:
        if self.kv_handle.request_id != self.request_id:
            raise ValueError(f"the KV handle is request {self.kv_handle.request_id!r}'s, not {self.request_id!r}'s")
        return self


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
    kv_to: KVPeerRef | None = None  # prefill role: the decode engine to send the Handoff to
    kv_from: KVPeerRef | None = None  # decode role without a handle yet: whose Handoff to wait for
    resume: Resume | None = None  # a migrated request: the output the client already has

    @field_validator("version")
    @classmethod
    def _same_version(cls, v: int) -> int:
        if v != REQUEST_VERSION:
            raise ValueError(f"request version {v}; this pdserve speaks {REQUEST_VERSION}")
        return v

    @model_validator(mode="after")
    def _one_role(self) -> Request:
        if self.hold_kv and self.kv_handle is not None:
            raise ValueError("a request is either prefill (hold_kv) or decode (kv_handle), not both")
        if self.first_token is not None and self.kv_handle is None:
            raise ValueError("first_token goes with kv_handle (decode role)")
        if self.kv_handle is not None and (self.first_token is None) != (self.params.num_seqs > 1):
            raise ValueError("a decode request's kv_handle comes with first_token, except with n > 1 (none)")
        if self.resume is not None and self.params.num_seqs > 1:
            raise ValueError("resume continues one sequence: not with n > 1")
        if self.kv_to is not None and not self.hold_kv:
            raise ValueError("kv_to names where a prefill request's KV goes: it needs hold_kv")
        if self.kv_from is not None and (self.hold_kv or self.kv_handle is not None):
            raise ValueError("kv_from is a decode request waiting for its hand-off: no hold_kv, no kv_handle")
        return self

    @property
    def role(self) -> str:
        if self.hold_kv:
            return "prefill"
        return "decode" if self.kv_handle is not None or self.kv_from is not None else "colocated"
