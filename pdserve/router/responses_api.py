"""OpenAI's Responses API on the chat path, stateless: a ResponsesRequest becomes the chat request
the router already serves (ChatCompletionRequest), which RequestValidator.chat turns into token ids
and SamplingParams; the answer is read by the same OutputParser and written by ResponsesFormatter
(responses_api_format.py).

    instructions                  a system message, first
    input: a string               one user message
    input: message items          messages of their role (user, system, developer, assistant);
                                  input_text / output_text parts joined
    input: reasoning, assistant   one assistant message per run of these items: reasoning_content
      message, function_call        (a reasoning item's content, else its summary), content,
                                    tool_calls (call_id, name, arguments)
    input: function_call_output   a tool message answering call_id (a call earlier in input)
    tools, tool_choice            function tools; auto, none, required, {type: function, name}
    parallel_tool_calls           the same
    text.format                   response_format (text, json_object, json_schema -> structured outputs)
    reasoning.effort              none -> thinking disabled; low ... max -> reasoning_effort
    max_output_tokens,            max_tokens, temperature, top_p
      temperature, top_p

Nothing is stored: `previous_response_id` is refused, and so are `store: true`, `background: true`,
`truncation: "auto"` and `include` values (`STATELESS`), each by name.
"""

from __future__ import annotations

from typing import Any

from pdserve.router.chat_translation import chat_request_of, renamed
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.responses_api_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from pdserve.router.validation import Prepared, RequestValidator
from pdserve.wire.errors import OpenAIError

# the chat path's names for fields a Responses request calls otherwise: in the error's param ...
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "thinking": "reasoning.effort",  # effort "none" is thinking disabled
}
# ... and in its message
WORDS = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "thinking.type": "reasoning.effort",
}
# field -> (the value that means what a stateless pdserve does anyway, why another is refused)
STATELESS: dict[str, tuple[Any, str]] = {
    "previous_response_id": (None, "pdserve stores no responses: send the whole conversation in input"),
    "store": (False, "pdserve stores no responses (store: false or leave it out)"),
    "background": (False, "pdserve runs no background responses (there is nothing to poll: it stores none)"),
    "truncation": ("disabled", "pdserve never drops input to fit the context: a prompt that does not fit is a 400"),
    "include": ([], "pdserve adds nothing to the output on request (no encrypted reasoning: it is given as text)"),
}


def prepare(
    validator: RequestValidator, req: ResponsesRequest, max_model_len: int
) -> tuple[ChatCompletionRequest, Prepared]:
    """The chat request a Responses request is, and what the workers run for it (400 if it cannot be served)."""
    for field, (fine, why) in STATELESS.items():
        value = getattr(req, field)
        if value is not None and value != fine:
            raise OpenAIError(400, f"{field}: {why}", param=field, code="unsupported_parameter")
    chat = chat_request(req)
    return chat, renamed(lambda: validator.chat(chat, max_model_len), PARAMS, WORDS)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The ChatCompletionRequest with this request's input, tools, controls, limits and sampling."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "tools": [t.as_chat() for t in req.tools] if req.tools else None,
        "tool_choice": _tool_choice(req),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": req.text.as_chat() if req.text is not None else None,
        "thinking": {"type": "disabled"} if effort == "none" else None,
        "reasoning_effort": effort if effort != "none" else None,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
    }
    return renamed(lambda: chat_request_of(body), PARAMS, WORDS)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    turn: dict[str, Any] | None = None  # the assistant message a run of answer items builds
    calls: set[str] = set()
    for i, item in enumerate(req.input):
        if item.type == "function_call_output":
            out.append(_result(item, i, calls))
            turn = None
        elif item.type in ("reasoning", "function_call") or item.role == "assistant":
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            _answer(turn, item, calls)
        else:
            out.append({"role": item.role, "content": item.text()})
            turn = None
    if turn is not None:
        raise OpenAIError(
            400,
            "input: the last item must be a message of the user, system or developer, or a function_call_output "
            "(pdserve does not continue an answer)",
            param="input",
        )
    return out


def _answer(turn: dict[str, Any], item: MessageItem | FunctionCallItem | ReasoningItem, calls: set[str]) -> None:
    """Adds a reasoning, assistant message or function_call item to its assistant message."""
    if isinstance(item, ReasoningItem):
        turn["reasoning_content"] = turn.get("reasoning_content", "") + item.text()
    elif isinstance(item, FunctionCallItem):
        calls.add(item.call_id)
        fn = {"name": item.name, "arguments": item.arguments}
        turn.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": fn})
    else:
        turn["content"] += item.text()


def _result(item: FunctionCallOutputItem, i: int, calls: set[str]) -> dict[str, Any]:
    if item.call_id not in calls:  # the encoder orders results by their calls: one without is not rendered right
        raise OpenAIError(
            400,
            f"input.{i}.call_id: no function_call before it has call_id {item.call_id!r}",
            param=f"input.{i}.call_id",
        )
    return {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}


def _tool_choice(req: ResponsesRequest) -> Any:
    tc = req.tool_choice
    if tc is None or (tc in ("auto", "none") and not req.tools):  # without tools both mean what no tool_choice does
        return None
    if isinstance(tc, str):
        return tc
    return {"type": "function", "function": {"name": tc.name}}


def settings(req: ResponsesRequest, prep: Prepared) -> dict[str, Any]:
    """What a Response echoes of its request (the SDK's Response type requires most of them)."""
    params = prep.params[0]
    tc = req.tool_choice
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": dict(req.metadata or {}),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
        "store": False,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text is not None and req.text.format is not None
        else {"format": {"type": "text"}},
        "tool_choice": tc if isinstance(tc, str) else tc.model_dump() if tc is not None else "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "truncation": "disabled",
        "background": False,
        "user": req.user,
    }
