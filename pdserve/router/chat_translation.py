"""What the translated APIs share (Anthropic's Messages, messages.py; OpenAI's Responses,
responses_api.py): each builds the chat request the router already serves, checked here, and the
chat path's errors are renamed to the fields the client sent."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError

from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.wire.errors import OpenAIError

T = TypeVar("T")


def chat_request_of(body: dict[str, Any]) -> ChatCompletionRequest:
    """The ChatCompletionRequest of `body` (None values left out); 400 naming the chat field on
    what the chat path's models refuse that the client's models let by."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise OpenAIError(400, f"{where}: {first['msg']}", param=where) from None


def renamed(call: Callable[[], T], params: dict[str, str], words: dict[str, str] | None = None) -> T:
    """call(), its errors naming the client's fields rather than the chat path's: an error whose
    param starts with a key of `params` names that key's value instead, and in its message each
    key of `words` (default: just the param's own name) becomes its value."""
    try:
        return call()
    except OpenAIError as e:
        head = e.param.split(".")[0] if e.param else None
        if head not in params:
            raise
        message = e.message
        for chat_word, word in (words if words is not None else {head: params[head]}).items():
            message = re.sub(rf"\b{re.escape(chat_word)}\b", word, message)
        raise OpenAIError(e.status, message, param=params[head], code=e.code) from None
