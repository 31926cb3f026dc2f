"""Worker chunks -> Anthropic Messages responses: one message, or its server-sent events.

The answer is read as the chat path reads it (the request's OutputParser: reasoning, text, tool
calls) and laid out as content blocks as it comes (`Blocks`): a thinking block while the answer is
in its reasoning, a text block for its text, a tool_use block per call. The same blocks make the
whole response and the stream, so a stream's events add up to the response.

    event: message_start         the message with no content, its usage so far
    event: ping
    event: content_block_start   per block, then its deltas: thinking_delta, text_delta, or a
    event: content_block_delta     call's input_json_delta pieces (its arguments as they are written,
    event: content_block_stop      as on the chat path: each piece leaves the JSON a valid start)
    event: message_delta         stop_reason, stop_sequence, usage (output_tokens)
    event: message_stop
    event: error                 instead of the rest, when the request fails mid-stream

Thinking blocks carry `signature: ""`: pdserve signs nothing (and checks nothing sent back).
stop_reason: max_tokens (the length limit), stop_sequence (one of stop_sequences matched, named in
`stop_sequence`), tool_use (the answer called tools), else end_turn. A call that ends incomplete (cut
by the length limit, or the rest of it not parsing) keeps its block, its `input` what the arguments
given out read as partial JSON (as the anthropic client reads the deltas). Usage: input_tokens are the
prompt tokens the prefix cache did not serve, cache_read_input_tokens those it did.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json

from pdserve.chat.parsers import CallEnd, CallPiece, OutputSpec, Parsed, ToolCall
from pdserve.router.messages_errors import STATUS, error_of
from pdserve.router.messages_protocol import AnthropicError, CountTokensResponse, MessageResponse
from pdserve.router.responses import NAMED_EVENT, ChatFormatter, sse_event
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError
from pdserve.wire.protocol import GenerateChunk

SIGNATURE = ""  # pdserve has no key to sign reasoning with
_ERRORS = {s: {"model": AnthropicError} for s in (400, 401, 404, 413, 429, 500, *(s for s, _ in STATUS.values()))}
MESSAGES_RESPONSES: dict[int | str, dict] = {
    **_ERRORS,
    200: {"model": MessageResponse, "content": {"text/event-stream": {"schema": NAMED_EVENT}}},
}
COUNT_TOKENS_RESPONSES: dict[int | str, dict] = {**_ERRORS, 200: {"model": CountTokensResponse}}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class Blocks:
    """The answer's content blocks, built from the parser's output as it comes; `feed` returns the
    stream events of what it added. A text or thinking block stays open while more of its kind
    follows; a tool_use block from its call's head to its end."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open = False
        self.omit_thinking = omit_thinking  # thinking.display "omitted": the blocks, without their text

    def feed(self, new: Parsed) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for e in new.events:
            if isinstance(e, tuple):
                events += self._write("thinking" if e[0] == "reasoning" else "text", e[1])
            elif isinstance(e, CallPiece):
                events += self._call(e)
            elif isinstance(e, CallEnd):
                self.blocks[-1]["input"] = _input(e.call)
                events += self.close()
        return events

    def close(self) -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not (self.open and self.blocks[-1]["type"] == kind):
            events = self.close()
            block = {"type": "text", "text": ""} if kind == "text" else {"type": kind, kind: "", "signature": SIGNATURE}
            self.blocks.append(block)
            self.open = True
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        if kind == "thinking" and self.omit_thinking:
            return events
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return [*events, {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _call(self, piece: CallPiece) -> list[dict[str, Any]]:
        if piece.id is not None:  # the head: a tool_use block, its input {} until the call ends
            events = self.close()
            block = {"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name, "input": {}}
            self.blocks.append(block)
            self.open = True
            return [
                *events,
                {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)},
            ]
        delta = {"type": "input_json_delta", "partial_json": piece.arguments}
        return [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]


def _input(call: ToolCall) -> dict[str, Any]:
    """A tool_use block's input: its arguments, or those given out of an incomplete call read as
    the client reads the deltas (partial JSON, an unfinished string left out)."""
    if call.reason is None:
        return json.loads(call.arguments)
    return from_json(call.arguments, allow_partial=True) if call.arguments else {}


class MessagesFormatter(ChatFormatter):
    """One Messages request's answer (one choice), through the chat path's parser."""

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Tokenizer,
        prompts: list[list[int]],
        output: OutputSpec | None,
        omit_thinking: bool = False,
    ) -> None:
        super().__init__(rid, model, tokenizer, prompts, None, False, False, output=output)
        self.blocks = Blocks(omit_thinking)
        self._events: list[dict[str, Any]] = []
        self._started = False

    def add(self, i: int, c: GenerateChunk) -> None:
        state = self.choices[i]
        state.add(c)
        self._events += self.blocks.feed(state.last if state.parser is not None else Parsed.of_text(c.text))

    def chunk(self, i: int, c: GenerateChunk) -> bytes | None:
        self.add(i, c)
        events, self._events = self._events, []
        return b"".join(sse_event(e) for e in [*self._opening(), *events]) or None

    def stream_end(self) -> bytes:
        reason, sequence = self.stop()
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        events = [*self._opening(), *self.blocks.close(), {**delta, "usage": self.anthropic_usage()}]
        return b"".join(sse_event(e) for e in [*events, {"type": "message_stop"}])

    def stream_error(self, e: OpenAIError) -> bytes:
        return sse_event(error_of(e))

    def response(self) -> dict[str, Any]:
        reason, sequence = self.stop()
        return {**self._message(), "content": self.blocks.blocks, "stop_reason": reason, "stop_sequence": sequence}

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        c = self.choices[0]
        if c.finish_reason == "length":
            return "max_tokens", None
        if isinstance(c.stop_reason, str):
            return "stop_sequence", c.stop_reason
        if c.parser is not None and c.parser.n_calls:
            return "tool_use", None
        return "end_turn", None

    def anthropic_usage(self) -> dict[str, int]:
        u = self.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
        return {
            "input_tokens": u.prompt_tokens - cached,
            "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }

    def _message(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.anthropic_usage(),
        }

    def _opening(self) -> list[dict[str, Any]]:
        """message_start and a ping, before the stream's first event (once)."""
        if self._started:
            return []
        self._started = True
        return [{"type": "message_start", "message": self._message()}, {"type": "ping"}]
