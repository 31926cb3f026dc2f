"""One choice's generated text -> reasoning_content, content and tool calls, as it streams.

    start ──<think>──> reasoning ──</think>──> content ──block open──> block ──call open──> call
      │ (thinking mode starts in reasoning)        ^  <──block close──  │  <──call close──  │
      └────────────────── other text ─────────────┘                    (parsed: a Call, or text)
    (a block opened in the reasoning ends it: V4 may call tools without writing </think>)

`feed(text)` and `finish()` return what became certain (`Parsed`), in order (`events`): text is
held back only while it may still be the start of a marker. A tool call is given out from its head
(its name whole and a tool's: a CallPiece with its index, id and name), then its arguments as they
are written (CallPieces of the text partial.py certifies), and ends with a CallEnd: complete once its
close marker is in and its body parses, the rest of its arguments given then. A call once given out
is never taken back, nor does its markup ever become text: if what follows does not parse, or the
output ends inside it, it ends incomplete (`reason`: the failure, "cut_call" at the length limit)
with the arguments given so far. Markup that does not parse before a call is given out (an unknown
tool's name, stray or repeated markup, a block with no call) stays text in content, exactly as the
model wrote it. Every failure's reason is kept in `failures` (the router logs and counts them). An
output cut by the length limit (`finish(cut=True)`) drops what it was still writing of a block or of
a call not given out yet, and a marker's start, so that cut markup never reaches content or
reasoning. Think tags never reach content; the special tokens in `drop` are removed (the worker's
text keeps them so that the markup can be seen at all).

Feeding the text in any pieces gives the same reasoning, content and calls (complete or not, with
the same arguments) as feeding it whole; only where the pieces break differs
(tests/unit/test_chat_parsers.py splits at random).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from pdserve.chat.parsers.calls import CallError
from pdserve.chat.parsers.dialects import ArgsReader, Dialect
from pdserve.chat.parsers.scan import MarkerScanner

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCall:
    """A call given out: its place among the choice's calls, id, name, the arguments given so far
    (all of them once complete); `reason`: why it ended incomplete (None: complete, or going on)."""

    index: int
    id: str
    name: str
    arguments: str = ""
    reason: str | None = None


@dataclass(frozen=True)
class CallPiece:
    """A call's stream: first its head (id and name, arguments ""), then pieces of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class CallEnd:
    call: ToolCall  # complete (reason None) or incomplete


Event = tuple[str, str] | CallPiece | CallEnd  # ("reasoning" | "content", text), or a call's


@dataclass
class Parsed:
    """What one feed or finish made certain: `events` in order; the text and the calls that ended
    (complete in `calls`, incomplete in `incomplete`) also gathered."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    incomplete: list[ToolCall] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @classmethod
    def of_text(cls, text: str) -> Parsed:
        """Text read as it is (no parser): all content."""
        return cls(content=text, events=[("content", text)] if text else [])

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(
            self.reasoning + other.reasoning,
            self.content + other.content,
            self.calls + other.calls,
            self.incomplete + other.incomplete,
            self.events + other.events,
        )


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    def __init__(
        self,
        reasoning: bool,
        thinking: bool,
        dialect: Dialect | None,
        tool_names: Collection[str] = (),
        drop: Collection[str] = (),
    ) -> None:
        self.think = {THINK_OPEN, THINK_CLOSE} if reasoning else set()
        self.dialect = dialect
        self.tool_names = frozenset(tool_names)
        structural = self.think | (dialect.markers() if dialect else set())
        self.drop = set(drop) - structural
        self.scanner = MarkerScanner(structural | self.drop)
        self._unwanted = MarkerScanner(self.think | self.drop)  # removed from markup kept as content
        self.state = "reasoning" if reasoning and thinking else "start" if reasoning else "content"
        self.failures: list[str] = []
        self.n_calls = 0  # complete calls
        self.n_given = 0  # calls given out
        self.reasoning_seen = self.state == "reasoning"
        self._pending = ""  # start: leading whitespace; block: its markup and whitespace so far
        self._call = ""  # call: the markup since its open marker
        self._reader: ArgsReader | None = None  # call: its body as it streams
        self._open: ToolCall | None = None  # call: given out and not ended
        self._run = ""  # block: text since the last marker
        self._block_calls = self._block_tried = 0  # calls given out, calls begun in the current block
        self._out = Parsed()

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str) -> Parsed:
        for is_marker, piece in self.scanner.feed(text):
            self._event(is_marker, piece)
        return self._take()

    def finish(self, cut: bool = False) -> Parsed:
        """The rest, as the output ends here; cut: it was cut off by the length limit."""
        for is_marker, piece in self.scanner.finish(cut):
            self._event(is_marker, piece)
        if cut and self.state in ("block", "call"):  # the calls before it stand; its markup is not text
            if self._open is not None:
                self._end_short("cut_call")
            else:
                self.failures.append("cut_call")
            self._pending = self._call = self._run = ""
            self.state = "done"
            return self._take()
        if self.state == "block":
            self._settle_run()
        if self.state == "start":
            self._text(self._pending)
        elif self.state == "block" and not self._block_calls and self._pending:
            self._fail("" if self._block_tried else "unclosed_block", self._pending)
        elif self.state == "call":
            self._unclosed()
        self._pending = self._call = ""
        self.state = "done"
        return self._take()

    # -- events by state --
    def _event(self, is_marker: bool, piece: str) -> None:
        getattr(self, f"_on_{self.state}")(is_marker, piece)

    def _on_start(self, is_marker: bool, piece: str) -> None:
        if not is_marker and not piece.strip():
            self._pending += piece  # whitespace before a possible <think>
            return
        if is_marker and piece in self.drop:
            return
        if is_marker and piece == THINK_OPEN:
            self.state, self._pending, self.reasoning_seen = "reasoning", "", True
            return
        self.state, pending, self._pending = "content", self._pending, ""
        self._text(pending)
        self._on_content(is_marker, piece)

    def _on_reasoning(self, is_marker: bool, piece: str) -> None:
        if piece == THINK_CLOSE and is_marker:
            self.state = "content"
        elif is_marker and self.dialect is not None and piece in self.dialect.block_open:
            self.state = "content"  # calls straight after the reasoning, without </think> (V4 does)
            self._on_content(is_marker, piece)
        elif not is_marker or (piece not in self.drop and piece not in self.think):
            self._say("reasoning", piece)  # a call's markup outside a block is reasoning text here

    def _on_content(self, is_marker: bool, piece: str) -> None:
        if not is_marker:
            self._text(piece)
        elif self.dialect is not None and piece in self.dialect.block_open:
            self.state, self._pending, self._block_calls, self._block_tried = "block", piece, 0, 0
        elif piece in self.think:
            self.failures.append("think_tag")  # a think tag in the answer: dropped
        elif piece not in self.drop:
            self._fail("stray_markup", piece)  # a call's or block's markup outside a block

    def _on_block(self, is_marker: bool, piece: str) -> None:
        d = self.dialect
        if not is_marker:
            self._run += piece  # text between markers is judged whole (its pieces depend on the split)
            return
        self._settle_run()
        if piece == d.call_open:
            self.state, self._call, self._reader = "call", piece, d.reader()
            self._block_tried += 1
        elif piece == d.block_close:
            if not self._block_calls:  # nothing parsed here: the block's markup stays text
                self._fail("" if self._block_tried else "empty_block", self._pending + piece)
            self.state, self._pending = "content", ""
        elif piece not in self.drop:  # markup that has no place between calls
            self._fail("text_in_block", self._pending + piece)
            self._pending = ""

    def _settle_run(self) -> None:
        """Whitespace between calls is the block's; other text has no place there."""
        run, self._run = self._run, ""
        if run.strip():
            self._fail("text_in_block", self._pending + run)
            self._pending = ""
        else:
            self._pending += run

    def _on_call(self, is_marker: bool, piece: str) -> None:
        d = self.dialect
        if is_marker and piece == d.call_close:
            self._close_call(piece)
        elif is_marker and piece in (d.call_open, d.block_close, *d.block_open):
            self._unclosed()
            self.state, self._pending, self._call = "block", "", ""
            self._on_block(is_marker, piece)
        else:
            self._call += piece  # markup inside a body (DSML parameters, V3's separator) is its text
            self._stream(piece)

    def _stream(self, piece: str) -> None:
        """A call's body text, as far as its reader certifies it."""
        args = self._reader.feed(piece)
        if self._open is None:
            if self._reader.name is None:
                return
            if self._reader.name not in self.tool_names:  # unknown_tool: the whole parse says so
                self._reader = _Silent()
                return
            self._give(self._reader.name)
        self._add_arguments(args)

    def _close_call(self, close: str) -> None:
        body = self._call[len(self.dialect.call_open) :]
        try:
            call = self.dialect.parse(body, self.tool_names)
        except CallError as e:
            if self._open is None:
                self._fail(str(e), self._pending + self._call + close)
            else:
                self._end_short(str(e))
        else:
            if self._open is None:
                self._give(call.name)
            t = self._open
            if call.arguments.startswith(t.arguments):
                self._add_arguments(call.arguments[len(t.arguments) :])
                self._out.calls.append(t)
                self._out.events.append(CallEnd(t))
                self.n_calls += 1
                self._open = None
            else:  # a reader gave out what the whole parse does not begin with (a bug: never seen)
                self._end_short("stream_mismatch")
        self.state, self._pending, self._call = "block", "", ""

    def _unclosed(self) -> None:
        """The call's markup ends without its close marker."""
        if self._open is None:
            self._fail("unclosed_call", self._pending + self._call)
        else:
            self._end_short("unclosed_call")

    # -- calls given out --
    def _give(self, name: str) -> None:
        """The call's head: from here it is a call, and its block's markup never text."""
        t = self._open = ToolCall(self.n_given, new_call_id(), name)
        self.n_given += 1
        self._block_calls += 1
        self._pending = ""
        self._out.events.append(CallPiece(t.index, "", t.id, name))

    def _add_arguments(self, text: str) -> None:
        if text:
            self._open.arguments += text
            self._out.events.append(CallPiece(self._open.index, text))

    def _end_short(self, reason: str) -> None:
        t, self._open = self._open, None
        t.reason = reason
        self.failures.append(reason)
        self._out.incomplete.append(t)
        self._out.events.append(CallEnd(t))

    # -- output --
    def _text(self, text: str) -> None:
        self._say("content", text)

    def _say(self, kind: str, text: str) -> None:
        if not text:
            return
        setattr(self._out, kind, getattr(self._out, kind) + text)
        events = self._out.events
        if events and isinstance(events[-1], tuple) and events[-1][0] == kind:
            events[-1] = (kind, events[-1][1] + text)
        else:
            events.append((kind, text))

    def _fail(self, reason: str, raw: str) -> None:
        """Markup that does not parse: its text goes to content (without think tags or dropped tokens)."""
        if reason:
            self.failures.append(reason)
        self._text(self._unwanted.strip(raw))

    def _take(self) -> Parsed:
        out, self._out = self._out, Parsed()
        return out


class _Silent:
    """The reader of a call that will not be given out before its close (an unknown tool's name)."""

    name = None

    def feed(self, text: str) -> str:
        return ""
