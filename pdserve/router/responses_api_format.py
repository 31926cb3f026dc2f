"""Worker chunks -> OpenAI Responses API responses: one Response object, or its typed events.

The answer is read as the chat path reads it (the request's OutputParser: reasoning, text, tool
calls) and laid out as output items as it comes (`Items`): a reasoning item while the answer is in
its reasoning, a message item for its text, a function_call item per call. The same items make the
whole response and the stream, so a stream's events add up to the response.

    response.created, response.in_progress           the response with no output yet
    response.output_item.added                       per item, then
      reasoning: response.content_part.added, response.reasoning_text.delta ... .done,
                 response.content_part.done
      message:   response.content_part.added, response.output_text.delta ... .done,
                 response.content_part.done
      function_call: response.function_call_arguments.delta (its arguments as they are written,
                 as on the chat path) ... .done
    response.output_item.done
    response.completed, or response.incomplete       the whole response
    error                                            instead of the rest, when the request fails mid-stream

Each event carries `sequence_number` (0, 1, ...). status: incomplete (incomplete_details.reason
"max_output_tokens") when the length limit cut the answer, the item being written then marked
incomplete too (a function_call with the arguments given out so far); else completed. A call whose
rest does not parse is an incomplete function_call item too. Usage: input_tokens count every prompt token,
input_tokens_details.cached_tokens those the prefix cache served (cache_write_tokens is 0: the
prefix cache keeps every prompt's blocks unasked).
"""

from __future__ import annotations

import uuid
from typing import Any

from pdserve.chat.parsers import CallEnd, CallPiece, OutputSpec, Parsed
from pdserve.router.responses import NAMED_EVENT, ChatFormatter, sse_event
from pdserve.router.responses_api_protocol import ResponseObject
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import ERROR_RESPONSES, OpenAIError, error_type
from pdserve.wire.protocol import GenerateChunk

RESPONSES_API_RESPONSES: dict[int | str, dict] = {
    **ERROR_RESPONSES,
    200: {"model": ResponseObject, "content": {"text/event-stream": {"schema": NAMED_EVENT}}},
}
_TEXT = {"reasoning": "reasoning_text", "message": "output_text"}  # an item kind's part type


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(kind: str, text: str) -> dict[str, Any]:
    part = {"type": _TEXT[kind], "text": text}
    return {**part, "annotations": [], "logprobs": []} if kind == "message" else part


class Items:
    """The response's output items, built from the parser's output as it comes; `feed` returns the
    events of what it added (without sequence numbers). A reasoning or message item stays open
    while more of its kind follows; a function_call item from its call's head to its end."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open = False

    def feed(self, new: Parsed) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for e in new.events:
            if isinstance(e, tuple):
                events += self._write("reasoning" if e[0] == "reasoning" else "message", e[1])
            elif isinstance(e, CallPiece):
                events += self._call(e)
            elif isinstance(e, CallEnd):
                events += self.close("completed" if e.call.reason is None else "incomplete")
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The open item's last events, `status` its status."""
        if not self.open:
            return []
        self.open = False
        i, item = len(self.items) - 1, self.items[-1]
        item["status"] = status
        if item["type"] == "function_call":
            at = {"item_id": item["id"], "output_index": i}
            done = {"type": "response.function_call_arguments.done", **at, "name": item["name"]}
            return [
                {**done, "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": i, "item": dict(item)},
            ]
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": i, "content_index": 0}
        done = {"type": f"response.{part['type']}.done", **at, "text": part["text"]}
        if item["type"] == "message":
            done["logprobs"] = []
        return [
            done,
            {"type": "response.content_part.done", **at, "part": dict(part)},
            {"type": "response.output_item.done", "output_index": i, "item": _copy(item)},
        ]

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not (self.open and self.items[-1]["type"] == kind):
            events = self.close()
            item = {"id": item_id("rs" if kind == "reasoning" else "msg"), "type": kind, "status": "in_progress"}
            item.update({"summary": [], "content": []} if kind == "reasoning" else {"role": "assistant", "content": []})
            self.items.append(item)
            self.open = True
            i = len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": i, "item": _copy(item)})
            item["content"].append(_part(kind, ""))
            at = {"item_id": item["id"], "output_index": i, "content_index": 0}
            events.append({"type": "response.content_part.added", **at, "part": _part(kind, "")})
        item = self.items[-1]
        item["content"][0]["text"] += text
        at = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        delta = {"type": f"response.{_TEXT[kind]}.delta", **at, "delta": text}
        return [*events, {**delta, "logprobs": []} if kind == "message" else delta]

    def _call(self, piece: CallPiece) -> list[dict[str, Any]]:
        if piece.id is not None:  # the head: a function_call item, its arguments "" so far
            events = self.close()
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece.id}
            item.update(name=piece.name, arguments="")
            self.items.append(item)
            self.open = True
            return [
                *events,
                {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)},
            ]
        i, item = len(self.items) - 1, self.items[-1]
        item["arguments"] += piece.arguments
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": i,
                "delta": piece.arguments,
            }
        ]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]}


class ResponsesFormatter(ChatFormatter):
    """One Responses request's answer (one choice), through the chat path's parser; `settings`:
    what the Response echoes of its request (responses_api.settings)."""

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Tokenizer,
        prompts: list[list[int]],
        output: OutputSpec | None,
        settings: dict[str, Any],
    ) -> None:
        super().__init__(rid, model, tokenizer, prompts, None, False, False, output=output)
        self.settings = settings
        self.items = Items()
        self.seq = 0
        self._started = False

    def add(self, i: int, c: GenerateChunk) -> None:
        self._feed(i, c)

    def chunk(self, i: int, c: GenerateChunk) -> bytes | None:
        return self._frames([*self._opening(), *self._feed(i, c)]) or None

    def stream_end(self) -> bytes:
        events = [*self._opening(), *self._close()]
        kind = "response.completed" if self._status() == "completed" else "response.incomplete"
        return self._frames([*events, {"type": kind, "response": self.response()}])

    def stream_error(self, e: OpenAIError) -> bytes:
        code = e.code if e.code is not None else error_type(e.status)
        return self._frames([{"type": "error", "code": str(code), "message": e.message, "param": e.param}])

    def response(self) -> dict[str, Any]:
        self._close()
        status = self._status()
        return {
            **self._response(status),
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": self.items.items,
            "usage": self.responses_usage(),
        }

    def responses_usage(self) -> dict[str, Any]:
        u = self.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
        reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details is not None else 0
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},  # as Messages' cache_creation
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": u.total_tokens,
        }

    def _feed(self, i: int, c: GenerateChunk) -> list[dict[str, Any]]:
        state = self.choices[i]
        state.add(c)
        return self.items.feed(state.last if state.parser is not None else Parsed.of_text(c.text))

    def _close(self) -> list[dict[str, Any]]:
        return self.items.close("completed" if self._status() == "completed" else "incomplete")

    def _status(self) -> str:
        return "incomplete" if self.choices[0].finish_reason == "length" else "completed"

    def _response(self, status: str) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": None,
            "error": None,
            "model": self.model,
            "output": [],
            "usage": None,
            **self.settings,
        }

    def _opening(self) -> list[dict[str, Any]]:
        """response.created and response.in_progress, before the stream's first item (once)."""
        if self._started:
            return []
        self._started = True
        snapshot = self._response("in_progress")
        return [
            {"type": "response.created", "response": snapshot},
            {"type": "response.in_progress", "response": snapshot},
        ]

    def _frames(self, events: list[dict[str, Any]]) -> bytes:
        out = []
        for e in events:
            out.append(sse_event({"type": e["type"], "sequence_number": self.seq, **e}))
            self.seq += 1
        return b"".join(out)
