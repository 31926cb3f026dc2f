"""The parts of a chat request beyond messages: tools, tool calls an assistant turn made,
tool_choice, response_format, vLLM's structured_outputs, DeepSeek's thinking switch."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, model_validator

from pdserve.router.protocol_types import Name, Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Name
    arguments: Text  # a JSON object, as a string


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (multi-turn replay)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Annotated[Text, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Name


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: Name
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _sent: dict[str, Any] = PrivateAttr(default_factory=dict)  # as the client wrote it: the V4 encoder renders that

    @model_validator(mode="wrap")
    @classmethod
    def _keep_as_sent(cls, data: Any, handler: Any) -> ResponseFormat:
        fmt = handler(data)
        fmt._sent = data if isinstance(data, dict) else fmt.model_dump(by_alias=True, exclude_none=True)
        return fmt

    def as_sent(self) -> dict[str, Any]:
        return self._sent

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only with it")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request object: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None


class ThinkingOption(BaseModel):
    """DeepSeek's API: thinking: {"type": "enabled" | "disabled"}."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Text  # checked by pdserve.chat.controls, for an error that names the field
