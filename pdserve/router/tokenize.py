"""POST /tokenize and /detokenize, as vLLM has them: a prompt, or chat messages rendered as a
chat request would be, to token ids (and back), so a user can see the exact prompt."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pdserve.router.chat_fields import Tool
from pdserve.router.openai_protocol import MAX_MESSAGES, ChatMessage
from pdserve.router.protocol_types import Name, Text, TokenId
from pdserve.router.validation import RequestValidator
from pdserve.wire.errors import OpenAIError


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Name | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with messages (vLLM's): the prompt a chat request would get."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Name | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    return_token_strs: bool = False


def _tokenize_form(body: Any) -> str:
    # tags with a dash: error locations leave them out (wire/errors.py), naming just the field
    return "with-messages" if isinstance(body, dict) and "messages" in body else "with-prompt"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("with-prompt")] | Annotated[TokenizeChatRequest, Tag("with-messages")],
    Discriminator(_tokenize_form),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Name | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(
    validator: RequestValidator, body: TokenizeCompletionRequest | TokenizeChatRequest, max_model_len: int
) -> TokenizeResponse:
    """The ids of a prompt, or of the prompt a chat request with these messages would get."""
    validator.check_model(body.model)
    tok = validator.tokenizer
    if isinstance(body, TokenizeCompletionRequest):
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        if body.continue_final_message and body.add_generation_prompt:
            raise OpenAIError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true",
                param="add_generation_prompt",
            )
        ids = validator.chat_prompt(
            [m.for_template() for m in body.messages],
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
        )
        if body.add_special_tokens:  # vLLM's meaning: what the tokenizer adds (DeepSeek's: a BOS) on top
            ids = tok.encode("", add_special_tokens=True) + list(ids)
    strs = [tok.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=list(ids), token_strs=strs)


def detokenize(validator: RequestValidator, body: DetokenizeRequest) -> DetokenizeResponse:
    validator.check_model(body.model)
    if any(t >= validator.vocab_size for t in body.tokens):
        raise OpenAIError(400, f"token ids must lie in [0, {validator.vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=validator.tokenizer.decode(body.tokens, skip_special_tokens=False))
