"""How one request is sampled and when it stops. Names and meanings follow vLLM's SamplingParams.

A pydantic model: it crosses processes as JSON (router -> worker), `to_dict`/`from_dict` round-trip
(all but `output_kind`, which each process sets for its own engine). Out-of-range values raise
ValueError (pydantic's ValidationError is one) naming the field.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily, as vLLM does
MAX_N = 128  # n and best_of: OpenAI's bound


class RequestOutputKind(enum.Enum):
    """What the engine's RequestOutputs for a request carry (vLLM's names)."""

    CUMULATIVE = "cumulative"  # every output: all tokens, text and logprobs so far (O(output) a step)
    DELTA = "delta"  # every output: only what is new since the request's last output (a stream)
    FINAL_ONLY = "final_only"  # one output, when the request finishes, with everything (LLM.generate)


class StructuredOutputsParams(BaseModel):
    """A constraint on the generated text, vLLM's StructuredOutputsParams: exactly one of json_schema
    (vLLM's `json`: a JSON schema, as a dict or its JSON text), json_object (any JSON object), regex, choice (one of
    these strings) or grammar (an EBNF grammar). The sampler masks every token that would leave the
    constraint. With start_after_token_id set (a reasoning model's end-of-thinking token) the
    constraint applies only to what follows the first such token."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | None = Field(None, validation_alias=AliasChoices("json", "json_schema"))
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    start_after_token_id: int | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        kinds = [
            k
            for k in ("json_schema", "json_object", "regex", "choice", "grammar")
            if getattr(self, k) not in (None, False)
        ]
        if len(kinds) != 1:
            raise ValueError(
                f"structured outputs take exactly one of json (a schema), json_object, regex, choice, grammar; got {kinds or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured outputs: choice must list at least one string")
        return self

    @property
    def kind(self) -> str:
        return next(
            k
            for k in ("json_schema", "json_object", "regex", "choice", "grammar")
            if getattr(self, k) not in (None, False)
        )


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    n: int = Field(1, ge=1, le=MAX_N)  # sequences returned for the prompt (engine/forks.py)
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # sequences run, the n best returned (None: n)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1  # -1 or 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_tokens: int | None = Field(16, ge=1)  # None: until max_model_len
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    # token id -> added to its logit before anything else (OpenAI's logit_bias: -100 bans, +100 forces)
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0)  # top-N alternatives besides the sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # how this process's engine returns the request's outputs; not sent (a worker streams deltas)
    output_kind: RequestOutputKind = Field(RequestOutputKind.CUMULATIVE, exclude=True)

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias and any(not -100.0 <= b <= 100.0 for b in bias.values()):
            raise ValueError("logit_bias values must lie in [-100, 100]")
        return bias or None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, k: int) -> int:
        if k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {k}")
        return k

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        return self

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs: best_of, or n."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls.model_validate(d)
