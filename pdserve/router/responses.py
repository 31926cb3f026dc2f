"""Worker chunks -> OpenAI responses: whole (non-stream) or server-sent events, for
/v1/completions and /v1/chat/completions, with usage, logprobs in each endpoint's format and
vLLM's return_token_ids fields.

SSE is exactly OpenAI's framing: `data: <json>\\n\\n` per chunk, then `data: [DONE]\\n\\n`; with
stream_options.include_usage every chunk has "usage": null and a last chunk carries the usage with
empty choices. An error after the stream started is one `data: {"error": {...}}` event, then [DONE].
Typed streams (Anthropic's Messages, OpenAI's Responses) name each event: `sse_event`.
"""

from __future__ import annotations

import json
import time

from pdserve.chat.parsers import CallPiece, OutputSpec, Parsed
from pdserve.router.choices import ChoiceState
from pdserve.router.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    IncompleteToolCall,
    PromptTokensDetails,
    ResponseFunction,
    ResponseToolCall,
    TopLogprob,
    UsageInfo,
)
from pdserve.router.token_bytes import TokenBytes
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import ERROR_RESPONSES, ErrorResponse, OpenAIError
from pdserve.wire.protocol import GenerateChunk, RouterHealth, TokenLogprobs

DONE = b"data: [DONE]\n\n"

# What each router route answers, for the OpenAPI schema (responses= on the route): the schema is
# the API's documentation, and the fuzz test holds the router to it.
_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last event is [DONE]"}},
    "required": ["data"],
}
_SSE = {"text/event-stream": {"schema": _EVENT}}
# a typed stream's event: an `event:` line (its type) and a `data:` line
NAMED_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string", "description": "the event as JSON"}},
    "required": ["event", "data"],
}
_AUTH = {401: {"model": ErrorResponse}}
COMPLETION_RESPONSES: dict[int | str, dict] = {**ERROR_RESPONSES, 200: {"model": CompletionResponse, "content": _SSE}}
CHAT_RESPONSES: dict[int | str, dict] = {**ERROR_RESPONSES, 200: {"model": ChatCompletionResponse, "content": _SSE}}
HEALTH_RESPONSES: dict[int | str, dict] = {**_AUTH, 200: {"model": RouterHealth}, 503: {"model": RouterHealth}}
METRICS_RESPONSES: dict[int | str, dict] = {**_AUTH, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_event(payload: dict) -> bytes:
    """`event: <its type>` and `data: <it>`, as Anthropic's and the Responses API's streams send them."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return b"event: " + payload["type"].encode() + b"\ndata: " + data + b"\n\n"


def sse_error(err: OpenAIError) -> bytes:
    return sse({"error": err.info().model_dump()})


class Formatter:
    """Shared by both endpoints: ids, usage, token texts."""

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Tokenizer,
        prompts: list[list[int]],
        logprobs: int | None,
        return_token_ids: bool,
        include_usage: bool,
        n: int = 1,
    ) -> None:
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.n = n  # choices a prompt: choice prompt * n + i (OpenAI's order)
        self.choices = [ChoiceState(p) for p in prompts for _ in range(n)]
        self.top_n = logprobs
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        self._token_bytes: TokenBytes | None = None  # made on first use: logprobs only

    def usage(self) -> UsageInfo:
        """Each prompt counted once, however many choices it had (n > 1: one prefill)."""
        per_prompt = self.choices[:: self.n]
        p = sum(len(c.prompt_token_ids) for c in per_prompt)
        n = sum(len(c.token_ids) for c in self.choices)
        cached = PromptTokensDetails(
            cached_tokens=sum(max(c.cached_tokens for c in self._of_prompt(i)) for i in range(len(per_prompt)))
        )
        return UsageInfo(prompt_tokens=p, completion_tokens=n, total_tokens=p + n, prompt_tokens_details=cached)

    def _of_prompt(self, i: int) -> list[ChoiceState]:
        return self.choices[i * self.n : (i + 1) * self.n]

    def token_text(self, token_id: int, text: str | None) -> str:
        return text if text is not None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's own bytes (part of a UTF-8 character, it has no text of its own): token_bytes.py."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes.of(token_id)

    def _ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.return_token_ids else None

    def worker_params(self, params: SamplingParams) -> SamplingParams:
        return params

    def failures(self) -> list[str]:
        return []

    def add(self, i: int, c: GenerateChunk) -> None:
        """A chunk of choice i, for a whole (not streamed) response."""
        self.choices[i].add(c)

    def stream_end(self) -> bytes:
        """What a stream ends with once every choice finished: the usage chunk if asked for, [DONE]."""
        return (self.usage_chunk() if self.include_usage else b"") + DONE

    def stream_error(self, err: OpenAIError) -> bytes:
        """What a stream ends with when the request fails after it started."""
        return sse_error(err) + DONE


class CompletionFormatter(Formatter):
    def response(self) -> dict:
        choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=self._logprobs(c.logprobs, 0) if self.top_n is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=self._ids(c.prompt_token_ids),
                token_ids=self._ids(c.token_ids),
            )
            for i, c in enumerate(self.choices)
        ]
        return CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=self.usage()
        ).model_dump(exclude_none=True)

    def chunk(self, i: int, c: GenerateChunk) -> bytes | None:
        state = self.choices[i]
        first = not state.token_ids and not state.text
        text_before = len(state.text)
        state.add(c)
        if not c.text and not c.finish_reason and not (self.return_token_ids and c.token_ids) and self.top_n is None:
            return None
        choice = CompletionChoice(
            index=i,
            text=c.text,
            logprobs=self._logprobs(c.logprobs or [], text_before) if self.top_n is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_token_ids=self._ids(state.prompt_token_ids) if first else None,
            token_ids=self._ids(c.token_ids),
        )
        body = {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice.model_dump(exclude_none=True)],
        }
        _keep_nulls(body["choices"][0], ("logprobs", "finish_reason"))
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self) -> bytes:
        return sse(
            {
                "id": self.rid,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.usage().model_dump(),
            }
        )

    def _logprobs(self, steps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for step in steps:
            sampled = step[0]
            tok = self.token_text(sampled.token_id, sampled.token)
            out.tokens.append(tok)
            out.token_logprobs.append(sampled.logprob)
            out.top_logprobs.append({self.token_text(e.token_id, e.token): e.logprob for e in step})
            out.text_offset.append(offset)
            offset += len(tok)
        return out


class ChatFormatter(Formatter):
    """With an OutputSpec (a reasoning or tool-call parser): reasoning_content, content and
    tool_calls apart; a stream sends each tool call as it is written: a delta with its index, id and
    name (arguments ""), then its arguments' pieces (chat/parsers/output.py)."""

    def __init__(self, *args, output: OutputSpec | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.output = output if output is not None and output.active else None
        for c in self.choices:
            c.parser = self.output.parser() if self.output is not None else None

    def worker_params(self, params: SamplingParams) -> SamplingParams:
        """The workers keep special tokens' text when a parser reads it (they may be the markup)."""
        return params if self.output is None else params.model_copy(update={"skip_special_tokens": False})

    def failures(self) -> list[str]:
        """Why markup the model wrote stayed text, for every choice (empty: all parsed)."""
        return [f for c in self.choices if c.parser is not None for f in c.parser.failures]

    def usage(self) -> UsageInfo:
        usage = super().usage()
        if self.output is not None and self.output.reasoning_parser is not None:
            n = sum(c.reasoning_tokens for c in self.choices)
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=n)
        return usage

    def response(self) -> dict:
        choices = [
            ChatChoice(
                index=i,
                message=_message(c),
                logprobs=self._logprobs(c.logprobs) if self.top_n is not None else None,
                finish_reason=c.reason(c.finish_reason),
                stop_reason=c.stop_reason,
                token_ids=self._ids(c.token_ids),
            )
            for i, c in enumerate(self.choices)
        ]
        prompt_ids = self._ids(self.choices[0].prompt_token_ids)
        resp = ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(),
            prompt_token_ids=prompt_ids,
        )
        body = resp.model_dump(exclude_none=True)
        for ch in body["choices"]:
            _keep_nulls(ch, ("logprobs",))
            _keep_nulls(ch["message"], ("content",))
        return body

    def chunk(self, i: int, c: GenerateChunk) -> bytes | None:
        state = self.choices[i]
        state.add(c)
        deltas = _deltas(state.last) if state.parser is not None else [DeltaMessage(content=c.text)] if c.text else []
        if not deltas and not c.finish_reason and not (self.return_token_ids and c.token_ids) and self.top_n is None:
            return None
        deltas = deltas or [DeltaMessage()]
        events = []
        for k, delta in enumerate(deltas):
            head, tail = k == 0, k == len(deltas) - 1
            if not state.role_sent:
                delta.role, state.role_sent = "assistant", True
            choice = ChatStreamChoice(
                index=i,
                delta=delta,
                logprobs=self._logprobs(c.logprobs or []) if self.top_n is not None and head else None,
                finish_reason=state.reason(c.finish_reason) if tail else None,
                stop_reason=c.stop_reason if tail else None,
                token_ids=self._ids(c.token_ids) if head else None,
            )
            events.append(self._event(choice, first=head and len(state.token_ids) == len(c.token_ids)))
        return b"".join(events)

    def _event(self, choice: ChatStreamChoice, first: bool) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[choice],
            prompt_token_ids=self._ids(self.choices[choice.index].prompt_token_ids) if first else None,
        )
        body = chunk.model_dump(exclude_none=True)
        _keep_nulls(body["choices"][0], ("logprobs", "finish_reason"))
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self) -> bytes:
        return sse(
            {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.usage().model_dump(exclude_none=True),
            }
        )

    def _logprobs(self, steps: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for step in steps:
            sampled = step[0]
            tok = self.token_text(sampled.token_id, sampled.token)
            top = sorted(step, key=lambda e: e.rank)[: self.top_n or 0]
            content.append(
                ChatTokenLogprob(
                    token=tok,
                    logprob=sampled.logprob,
                    bytes=self.bytes_of(sampled.token_id),
                    top_logprobs=[
                        TopLogprob(
                            token=self.token_text(e.token_id, e.token),
                            logprob=e.logprob,
                            bytes=self.bytes_of(e.token_id),
                        )
                        for e in top
                    ],
                )
            )
        return ChatLogprobs(content=content)


def _message(c: ChoiceState) -> AssistantMessage:
    if c.parser is None:
        return AssistantMessage(content=c.text)
    p = c.parsed
    calls = [ResponseToolCall(id=t.id, function=ResponseFunction(name=t.name, arguments=t.arguments)) for t in p.calls]
    incomplete = [
        IncompleteToolCall(id=t.id, function=ResponseFunction(name=t.name, arguments=t.arguments), reason=t.reason)
        for t in p.incomplete
    ]
    return AssistantMessage(
        content=p.content if p.content or not calls else None,
        reasoning_content=p.reasoning if c.parser.reasoning_seen else None,
        tool_calls=calls or None,
        incomplete_tool_calls=incomplete or None,
    )


def _deltas(new: Parsed) -> list[DeltaMessage]:
    """A chunk's parsed output as deltas, in order: text (reasoning and content in one delta), a
    call's head (index, id, name, arguments ""), then its arguments' pieces (those in a row in one)."""
    out: list[DeltaMessage] = []
    for e in new.events:
        last = out[-1] if out else None
        if isinstance(e, tuple):
            kind, text = e
            name = "reasoning_content" if kind == "reasoning" else "content"
            if last is not None and last.tool_calls is None and (name == "content" or last.content is None):
                setattr(last, name, (getattr(last, name) or "") + text)
            else:
                out.append(DeltaMessage(**{name: text}))
        elif isinstance(e, CallPiece) and e.id is not None:
            head = DeltaToolCall(
                index=e.index, id=e.id, type="function", function=DeltaFunction(name=e.name, arguments="")
            )
            out.append(DeltaMessage(tool_calls=[head]))
        elif isinstance(e, CallPiece):
            call = last.tool_calls[0] if last is not None and last.tool_calls else None
            if call is not None and call.id is None and call.index == e.index:
                call.function.arguments += e.arguments
            else:
                piece = DeltaToolCall(index=e.index, function=DeltaFunction(arguments=e.arguments))
                out.append(DeltaMessage(tool_calls=[piece]))
    return out


def _keep_nulls(d: dict, keys: tuple[str, ...]) -> None:
    """OpenAI sends these keys as null rather than leaving them out."""
    for k in keys:
        d.setdefault(k, None)
