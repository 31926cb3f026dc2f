"""OpenAI's Responses API: the request and response models pdserve serves (POST /v1/responses),
stateless.

Requests are strict and closed, as the chat models are: a field pdserve does not honour (a typo,
`prompt_cache_key`, `service_tier`, `reasoning.summary`, `text.verbosity`, an `input_image` part, a
built-in tool, an `item_reference`) is a 400 naming it, never dropped. Fields of state are taken
only with the value that means what pdserve does anyway (`store` false, `background` false,
`truncation` "disabled", `include` empty, no `previous_response_id`: responses_api.py refuses the
rest by name). Items a client replays from an earlier response (messages with their `id`,
`status` and `annotations`, reasoning, function calls) are taken back as they were sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag, field_validator

from pdserve.router.openai_protocol import MAX_MESSAGES
from pdserve.router.protocol_types import INT64_MAX, Name, Text

# the chat path's tool-name rule (chat_fields.FunctionDef), so that every name here is one there
ToolName = Annotated[Text, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
SchemaName = Annotated[Text, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
Status = Literal["in_progress", "completed", "incomplete"]
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
MetadataKey = Annotated[Text, StringConstraints(max_length=64)]
MetadataValue = Annotated[Text, StringConstraints(max_length=512)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class InputText(_Closed):
    type: Literal["input_text"]
    text: Text


class OutputText(_Closed):
    """An earlier answer's text, replayed (its annotations and logprobs are the answer's, not the prompt's)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] | None = None


def _of_type(suffix: str, default: str | None = None) -> Callable[[Any], str]:
    """A discriminator by `type` whose tags end in `-suffix`: error locations leave such tags out
    (wire/errors.py), naming just the field."""

    def kind(v: Any) -> str:
        return f"{(v.get('type') if isinstance(v, dict) else getattr(v, 'type', None)) or default}-{suffix}"

    return kind


Part = Annotated[
    Annotated[InputText, Tag("input_text-part")] | Annotated[OutputText, Tag("output_text-part")],
    Discriminator(
        _of_type("part"),
        custom_error_type="unknown_part",
        custom_error_message="a content part's type is input_text or output_text (pdserve serves text only)",
    ),
]


class MessageItem(_Closed):
    """A message of any role; the SDK's short form leaves `type` out."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[Part], Field(min_length=1)]
    id: Name | None = None
    status: Status | None = None
    phase: None = None  # the SDK's field, sent back as null

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Closed):
    """A call an earlier answer made (the chat path's tool_calls)."""

    type: Literal["function_call"]
    call_id: Name
    name: ToolName
    arguments: Text  # a JSON object's text
    id: Name | None = None
    status: Status | None = None


class FunctionCallOutputItem(_Closed):
    """A call's result (the chat path's tool message)."""

    type: Literal["function_call_output"]
    call_id: Name
    output: Text | list[InputText]
    id: Name | None = None
    status: Status | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryText(_Closed):
    type: Literal["summary_text"]
    text: Text


class ReasoningText(_Closed):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(_Closed):
    """An earlier answer's reasoning, replayed as the chat path's reasoning_content: its content
    (the reasoning itself, as pdserve gives it), else its summary."""

    type: Literal["reasoning"]
    id: Name | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: Text | None = None
    status: Status | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, v: str | None) -> None:
        if v is not None:
            raise ValueError("pdserve encrypts no reasoning and reads none: send the item's content or summary")
        return None

    def text(self) -> str:
        if self.content:
            return "".join(p.text for p in self.content)
        return "\n\n".join(s.text for s in self.summary)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message-item")]
    | Annotated[FunctionCallItem, Tag("function_call-item")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output-item")]
    | Annotated[ReasoningItem, Tag("reasoning-item")],
    Discriminator(
        _of_type("item", default="message"),  # the SDK's short form of a message has no type
        custom_error_type="unknown_item",
        custom_error_message="an input item's type is message, function_call, function_call_output or reasoning "
        "(pdserve stores nothing, so no item_reference, and runs no built-in tools)",
    ),
]


class FunctionTool(_Closed):
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        fn = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fn}


class FunctionChoice(_Closed):
    type: Literal["function"]
    name: ToolName


class FormatText(_Closed):
    type: Literal["text"]


class FormatJsonObject(_Closed):
    type: Literal["json_object"]


class FormatJsonSchema(_Closed):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    name: SchemaName
    schema_: dict[str, Any] = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


Format = Annotated[
    Annotated[FormatText, Tag("text-format")]
    | Annotated[FormatJsonObject, Tag("json_object-format")]
    | Annotated[FormatJsonSchema, Tag("json_schema-format")],
    Discriminator(
        _of_type("format"),
        custom_error_type="unknown_format",
        custom_error_message="a text format's type is text, json_object or json_schema",
    ),
]


class TextConfig(_Closed):
    format: Format | None = None

    def as_chat(self) -> dict[str, Any] | None:
        """The chat path's response_format."""
        f = self.format
        if f is None or f.type != "json_schema":
            return None if f is None else {"type": f.type}
        spec = f.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": spec}


class ReasoningConfig(_Closed):
    # none: chat mode (no reasoning); the others as the chat path's reasoning_effort (mapped onto
    # DeepSeek-V4's levels in pdserve/chat/controls.py)
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class ResponsesRequest(_Closed):
    model: Name | None = None  # None: the served model
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    user: Name | None = None  # taken and not kept, as on the chat path
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = None  # echoed
    # state: only the values that mean what pdserve does (responses_api.py refuses the others)
    store: bool | None = None
    previous_response_id: Name | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None


# -- the response (for the OpenAPI schema; the formatter writes the same shapes as dicts) --


class OutputItem(BaseModel):
    """A reasoning, message or function_call item (each kind's fields; the others absent)."""

    type: Literal["reasoning", "message", "function_call"]
    id: str
    status: Status
    summary: list[dict[str, Any]] | None = None  # reasoning: [] (pdserve writes no summaries)
    content: list[dict[str, Any]] | None = None  # reasoning: reasoning_text parts; message: output_text parts
    role: Literal["assistant"] | None = None  # message
    call_id: str | None = None  # function_call
    name: str | None = None
    arguments: str | None = None


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens: prompt tokens the prefix cache served
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None  # {"reason": "max_output_tokens"}
    error: None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: dict[str, str | None]
    store: Literal[False] = False
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    background: Literal[False] = False
    user: str | None = None
