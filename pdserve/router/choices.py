"""What one choice of a response has produced so far, from its workers' chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.chat.parsers import OutputParser, Parsed
from pdserve.wire.protocol import GenerateChunk, TokenLogprobs


@dataclass
class ChoiceState:
    """Everything one choice has produced so far; with a parser (chat), its text read as
    reasoning, content and tool calls as it comes (`parsed`: all of it, less its events; `last`: the
    last chunk's, events and all)."""

    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    parser: OutputParser | None = None
    parsed: Parsed = field(default_factory=Parsed)
    last: Parsed = field(default_factory=Parsed)
    reasoning_tokens: int = 0
    role_sent: bool = False  # streaming: the first delta sent carries the role
    cached_tokens: int = 0  # prompt tokens a worker served from its prefix cache (PD: the prefill's)

    def add(self, c: GenerateChunk) -> None:
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.cached_tokens = max(self.cached_tokens, c.num_cached_tokens)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        if self.parser is not None:
            self._parse(c)

    def _parse(self, c: GenerateChunk) -> None:
        p = self.parser
        reasoning = p.in_reasoning
        new = p.feed(c.text)
        if c.finish_reason is not None:
            new = new + p.finish(cut=c.finish_reason == "length")
        if reasoning or p.in_reasoning:
            self.reasoning_tokens += len(c.token_ids)
        self.last = new
        self.parsed.reasoning += new.reasoning
        self.parsed.content += new.content
        self.parsed.calls += new.calls
        self.parsed.incomplete += new.incomplete

    def reason(self, finish_reason: str | None) -> str | None:
        """A natural end after tool calls is OpenAI's "tool_calls"."""
        if finish_reason == "stop" and self.parser is not None and self.parser.n_calls:
            return "tool_calls"
        return finish_reason
