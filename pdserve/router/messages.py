"""Anthropic's Messages API on the chat path: a MessagesRequest becomes the chat request the router
already serves (ChatCompletionRequest), which RequestValidator.chat turns into token ids and
SamplingParams; the answer is read by the same OutputParser and written by MessagesFormatter
(messages_format.py).

    system                       a system message (text blocks as content parts)
    user: text, tool_result      user messages and `tool` messages, in block order (the V4 encoder
                                 joins them into one user turn of <tool_result> blocks); is_error:
                                 the result's text after "Error: "
    assistant: text, thinking,   content, reasoning_content, tool_calls (input as JSON arguments)
      tool_use
    tools, tool_choice           function tools; auto, none, any -> "required", tool -> a named
                                 function; disable_parallel_tool_use -> parallel_tool_calls false
    thinking, output_config      thinking {"type"}; effort -> reasoning_effort
    max_tokens, stop_sequences,  max_tokens, stop, temperature, top_p, top_k
      temperature, top_p, top_k

thinking.budget_tokens is enforced by a grammar (llguidance): after that many tokens of reasoning
the only token left is </think> (or EOS). Such a request is decoded under the grammar throughout
(structured outputs' cost per token); a budget at or past max_tokens never binds and needs none. A forced tool choice is a grammar too, and a request
carries one grammar at most: both together are a 400 (Anthropic refuses forced tools with thinking
as well).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve import structured
from pdserve.chat.dsv4 import END_THINK
from pdserve.router.chat_translation import chat_request_of, renamed
from pdserve.router.messages_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesRequest,
    TextBlock,
    ToolUseBlock,
)
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.validation import Prepared, RequestValidator
from pdserve.sampling_params import StructuredOutputsParams
from pdserve.wire.errors import OpenAIError

# the chat path's names for fields a Messages request calls otherwise (its errors name those)
RENAMED = {
    "reasoning_effort": "output_config.effort",
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}


def prepare(
    validator: RequestValidator, req: MessagesRequest, max_model_len: int
) -> tuple[ChatCompletionRequest, Prepared]:
    """The chat request a Messages request is, and what the workers run for it (400 if it cannot be served)."""
    budget = req.thinking.budget_tokens if req.thinking is not None else None
    if budget is not None and req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        raise OpenAIError(
            400,
            f"tool_choice: {{type: {req.tool_choice.type}}} cannot be combined with thinking.budget_tokens "
            "(each is enforced by a grammar; use tool_choice auto with thinking)",
            param="tool_choice",
        )
    chat = chat_request(req)
    prep = renamed(lambda: validator.chat(chat, max_model_len), RENAMED)
    if budget is not None and budget < prep.params[0].max_tokens:  # one at or past max_tokens never binds
        prep.params[0].structured_outputs = _budget(validator, prep, budget)
    return chat, prep


def count_tokens(validator: RequestValidator, req: CountTokensRequest) -> CountTokensResponse:
    """The number of prompt tokens these messages render to, as a Messages request would get them."""
    chat = chat_request(req)
    validator.check_model(chat.model)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
    ids = renamed(
        lambda: validator.chat_prompt(
            [m.for_template() for m in chat.messages],
            tools=tools,
            thinking=chat.thinking.type if chat.thinking is not None else None,
            reasoning_effort=chat.reasoning_effort,
        ),
        RENAMED,
    )
    return CountTokensResponse(input_tokens=len(ids))


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The ChatCompletionRequest with this request's messages, tools and controls (and, for a
    MessagesRequest, its limits and sampling)."""
    tool_choice, parallel = _tool_choice(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "tools": [t.as_chat() for t in req.tools] if req.tools else None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "thinking": {"type": req.thinking.type} if req.thinking is not None else None,
        "reasoning_effort": req.output_config.effort if req.output_config is not None else None,
    }
    if isinstance(req, MessagesRequest):
        body.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
        )
    return chat_request_of(body)


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _parts(req.system)})
    for m in req.messages:
        out += _user(m) if m.role == "user" else [_assistant(m)]
    return out


def _parts(content: str | list[TextBlock]) -> str | list[dict[str, str]]:
    return content if isinstance(content, str) else [{"type": "text", "text": b.text} for b in content]


def _user(m: Message) -> list[dict[str, Any]]:
    """A user turn's blocks in order: runs of text as user messages, each tool_result a tool message."""
    out: list[dict[str, Any]] = []
    for b in m.blocks():
        if b.type == "tool_result":
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"].append({"type": "text", "text": b.text})
        else:
            out.append({"role": "user", "content": [{"type": "text", "text": b.text}]})
    return out


def _assistant(m: Message) -> dict[str, Any]:
    blocks = m.blocks()
    calls = [_call(b) for b in blocks if b.type == "tool_use"]
    thinking = [b.thinking for b in blocks if b.type == "thinking"]
    out: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.type == "text")}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    return out


def _call(b: ToolUseBlock) -> dict[str, Any]:
    arguments = json.dumps(b.input, ensure_ascii=False)
    return {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}}


def _tool_choice(req: CountTokensRequest) -> tuple[Any, bool | None]:
    """(the chat path's tool_choice, its parallel_tool_calls)."""
    tc = req.tool_choice
    if tc is None:
        return None, None
    if tc.type == "auto" and tc.disable_parallel_tool_use:
        raise OpenAIError(
            400,
            "tool_choice.disable_parallel_tool_use: honoured with tool_choice any or tool (one call), "
            "not with auto, where nothing makes the model stop at one call",
            param="tool_choice.disable_parallel_tool_use",
        )
    if tc.type in ("auto", "none"):
        return (tc.type if req.tools else None), None  # without tools both mean what no tool_choice does
    parallel = False if tc.disable_parallel_tool_use else None
    if tc.type == "any":
        return "required", parallel
    return {"type": "function", "function": {"name": tc.name}}, parallel


def _budget(validator: RequestValidator, prep: Prepared, budget: int) -> StructuredOutputsParams:
    end = validator.tokenizer.token_to_id(END_THINK)
    if not prep.thinking or end is None:
        raise OpenAIError(
            400,
            f"thinking.budget_tokens: a budget is enforced on a prompt that opens the model's reasoning, "
            f"with a {END_THINK} token to end it; this model's has not both",
            param="thinking.budget_tokens",
        )
    params = StructuredOutputsParams(grammar=budget_grammar(end, budget))
    try:
        structured.check(params, validator.tokenizer)
    except ValueError as e:
        raise OpenAIError(400, f"thinking.budget_tokens: {e}", param="thinking.budget_tokens") from None
    return params


def budget_grammar(end_think: int, budget: int) -> str:
    """Reasoning of at most `budget` tokens that holds no </think>, then </think> (the token, by id)
    and a free answer; EOS may end the output anywhere, as it may without a budget."""
    return (
        "%llguidance {}\n"
        f"start: reasoning (<[{end_think}]> ANSWER)?\n"
        f"reasoning[max_tokens={budget}]: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/\n"
        "ANSWER: /(?s:.*)/\n"
    )
