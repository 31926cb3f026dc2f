"""OpenAI API request and response models (the subset pdserve serves, plus vLLM's extras).

Requests are validated here (types, ranges, counts); what needs the model (prompt length against
max_model_len, token ids against the vocabulary) is checked by the router (validation.py).
Requests are strict, as OpenAI is: "5" is not a number and "yes" is not a boolean (400). Every
string must be valid Unicode (no lone surrogates: they cannot be encoded, tokenized or echoed).
The limits appear in the OpenAPI schema, which documents the API and drives the fuzz test.
Unknown fields are ignored as OpenAI-compatible servers commonly do; fields pdserve knows but does
not implement (n > 1, best_of, echo, suffix, parallel_tool_calls false with
tool_choice auto) are refused with 400 by the router.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.router.chat_fields import (
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ThinkingOption,
    Tool,
    ToolCall,
)
from pdserve.router.protocol_types import (
    INT64_MAX,
    Name,
    StopString,
    Text,
    TokenId,
)

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_MESSAGES = 1024
MAX_N = 128  # OpenAI's bound; the router serves n=1 only


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    # a field pdserve does not know is refused (400 naming it), never silently dropped
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: Name | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Text, float] | None = None
    user: Name | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_STRINGS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # structured outputs (both endpoints, as vLLM takes them); chat's V4 encoder also renders response_format
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        return [] if v is None else [v] if isinstance(v, str) else v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


class CompletionRequest(_Request):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, p: Any) -> Any:
        """One clear message for a prompt of no known form, rather than one error per union member."""
        if isinstance(p, str):
            return p
        if not isinstance(p, list) or not p:
            raise ValueError(f"prompt must be {PROMPT_FORMS} (not empty)")
        first = type(p[0])
        if first not in (str, int, list) or any(type(x) is not first for x in p):
            raise ValueError(f"prompt must be {PROMPT_FORMS}; this list mixes types or holds other values")
        if first is list and any(not ids or any(type(t) is not int for t in ids) for ids in p):
            raise ValueError("token-id prompts must be non-empty lists of integers")
        return p

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


# The content rule below, in the OpenAPI schema too, so that clients and schema-driven fuzzers see
# that only an assistant message may leave content out.
_CONTENT_RULE = {
    "oneOf": [
        {
            "properties": {
                "role": {"enum": ["system", "developer", "user", "tool"]},
                "content": {"not": {"type": "null"}},
            },
            "required": ["content"],
        },
        {"properties": {"role": {"const": "assistant"}}},
    ]
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_CONTENT_RULE)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: Name | None = None  # tool: the call this result answers
    reasoning_content: Text | None = None  # assistant: its reasoning, sent back by clients
    reasoning: Text | None = None  # vLLM's newer name for reasoning_content

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (only an assistant message may leave it out)")
        if self.role != "assistant":
            for field in ("tool_calls", "reasoning_content", "reasoning"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field} belongs to assistant messages, not {self.role} ones")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates and the V4 encoder read it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # thinking controls (pdserve.chat.controls)
    reasoning_effort: Text | None = None
    thinking: ThinkingOption | None = None
    chat_template_kwargs: dict[Text, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses --


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # tokens generated while the answer was in its reasoning


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # chat with a reasoning parser


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None  # return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class IncompleteToolCall(ResponseToolCall):
    reason: str  # cut_call (the length limit), or why the rest did not parse; arguments: as far as given out


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with a reasoning parser: the answer's reasoning, apart
    tool_calls: list[ResponseToolCall] | None = None  # complete calls only
    incomplete_tool_calls: list[IncompleteToolCall] | None = None  # calls a stream began, not complete


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaFunction(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # a piece; a call's pieces joined are its arguments


class DeltaToolCall(BaseModel):
    index: int  # the call's place among the choice's calls
    id: str | None = None  # in a call's first delta, with type
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
