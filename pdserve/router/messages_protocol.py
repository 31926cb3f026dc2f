"""Anthropic's Messages API: the request and response models pdserve serves (POST /v1/messages,
/v1/messages/count_tokens).

Requests are strict and closed, as the OpenAI models are (openai_protocol.py): a field pdserve
does not honour (a typo, `service_tier`, `container`, `output_config.format`, an image block, a
server tool, `cache_control` with a `ttl`) is a 400 naming it, never dropped. Two fields are taken
without an effect of their own, because theirs is pdserve's anyway: `metadata.user_id` (Anthropic's
is for abuse tracking) and `cache_control: {"type": "ephemeral"}` (the prefix cache keeps every
prompt's blocks; `usage.cache_read_input_tokens` reports what it served). A thinking block's
`signature` is taken and not checked: pdserve signs nothing (its own are "").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    field_validator,
    model_validator,
)

from pdserve.router.openai_protocol import MAX_MESSAGES, MAX_STOP_STRINGS
from pdserve.router.protocol_types import INT64_MAX, Name, StopString, Text

# Anthropic's tool-name rule, within the 64 characters the chat path's tools allow
ToolName = Annotated[Text, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
EFFORTS = Literal["low", "medium", "high", "xhigh", "max"]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CacheControl(_Closed):
    type: Literal["ephemeral"]


class TextBlock(_Closed):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ToolUseBlock(_Closed):
    """A call an earlier assistant turn made (replayed as the chat path's tool_calls)."""

    type: Literal["tool_use"]
    id: Name
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Closed):
    """A tool's answer, in a user turn (the chat path's tool message)."""

    type: Literal["tool_result"]
    tool_use_id: Name
    content: Text | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body  # the chat formats have no error flag


class ThinkingBlock(_Closed):
    """An assistant turn's reasoning, replayed as the chat path's reasoning_content."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text = ""


def _block_kind(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return f"{kind}-block" if kind in ("text", "tool_use", "tool_result", "thinking") else None


# Tags with a dash: error locations leave them out (wire/errors.py), naming just the block.
Block = Annotated[
    Annotated[TextBlock, Tag("text-block")]
    | Annotated[ToolUseBlock, Tag("tool_use-block")]
    | Annotated[ToolResultBlock, Tag("tool_result-block")]
    | Annotated[ThinkingBlock, Tag("thinking-block")],
    Discriminator(
        _block_kind,
        custom_error_type="unknown_block",
        custom_error_message="a block's type is text, tool_use, tool_result or thinking "
        "(pdserve serves no image, document, redacted_thinking or server tool blocks)",
    ),
]
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}


class Message(_Closed):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> Message:
        for i, b in enumerate(self.content if isinstance(self.content, list) else []):
            if b.type not in _ROLE_BLOCKS[self.role]:
                raise ValueError(f"content.{i}: a {b.type} block belongs in {_other(self.role)} message")
        return self

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


def _other(role: str) -> str:
    return "a user" if role == "assistant" else "an assistant"


class ToolDef(_Closed):
    """A client tool. Server tools (`web_search_...`, `bash_...`) are not served."""

    type: Text | None = None
    name: ToolName
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    @field_validator("type")
    @classmethod
    def _custom(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(f"only custom tools (name, description, input_schema) are served, not {kind!r}")
        return kind

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError("must be a JSON schema with type 'object'")
        return schema

    def as_chat(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class ToolChoice(_Closed):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given with type 'tool', and only with it")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("disable_parallel_tool_use is not given with type 'none'")
        return self


class Thinking(_Closed):
    """On: DeepSeek's thinking mode, the reasoning cut at budget_tokens (a grammar forces
    </think> there, messages.py); off: chat mode. 'adaptive' is not served."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _settings_when_enabled(self) -> Thinking:
        if self.type == "disabled" and (self.budget_tokens is not None or self.display is not None):
            raise ValueError("budget_tokens and display are given with type 'enabled' only")
        return self


class OutputConfig(_Closed):
    effort: EFFORTS | None = None  # the chat path's reasoning_effort


class Metadata(_Closed):
    user_id: Name | None = None  # Anthropic's is for abuse tracking; pdserve keeps none


class CountTokensRequest(_Closed):
    """POST /v1/messages/count_tokens: what the prompt of these messages holds."""

    model: Name | None = None  # None: the served model (as on the OpenAI routes; Anthropic's clients send it)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_a_user_turn(cls, messages: list[Message]) -> list[Message]:
        if messages[-1].role != "user":
            raise ValueError("the last message must be a user message (pdserve does not continue an assistant turn)")
        return messages


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=INT64_MAX)
    metadata: Metadata | None = None


# -- responses (for the OpenAPI schema; the formatter writes the same shapes as dicts) --


class Usage(BaseModel):
    input_tokens: int  # prompt tokens the prefix cache did not serve
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens the prefix cache served
    cache_creation_input_tokens: int = 0


class ResponseBlock(BaseModel):
    type: Literal["text", "thinking", "tool_use"]
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
