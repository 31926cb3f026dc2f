"""One tool call's body as it streams -> its name once its head is whole, and its arguments as
far as they are certain: every text a reader gives out is the start of what calls.py makes of the
whole body, should the call close and parse (the parser gives out the rest then). A reader never
decides that a call fails: past what it cannot read it gives out nothing more, and the whole parse
at the close says why.

    DsmlArgs  name="f">, then per <｜DSML｜parameter name="k" string="...">: `{"k": ` or `, "k": `;
              a string="true" value JSON-escaped as it comes (its quotes around it), a string="false"
              value once it is whole and parses (as written); `}` comes with the close
    V31Args   f<｜tool▁sep｜>{json}: the JSON as written, as far as it is the start of an object
    V3Args    function<｜tool▁sep｜>f\\n```json\\n{json}\\n```: the same, less a tail that may be the
              closing fence
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod

from pdserve.chat.parsers.calls import DSML_HEAD, DSML_PARAM, PARAM_CLOSE, TOOL_SEP, V3_FENCE, CallError, json_value
from pdserve.chat.parsers.json_prefix import JsonPrefix

# A head or a parameter's tag not whole within this many characters will not be read (a tool's
# name is short): the reader stops there rather than search a growing text on every piece.
HEAD_MAX = 1024


def _escaped(text: str) -> str:
    """`text` inside a JSON string as json.dumps(ensure_ascii=False) writes it (character by
    character, so the pieces' escapes join into the whole's)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _partial_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class DsmlArgs:
    def __init__(self) -> None:
        self.name: str | None = None
        self._buf = ""  # the body not read yet
        self._state = "head"  # head, params, string, json, stuck
        self._keys: set[str] = set()
        self._seen = 0  # json: how far _buf was searched for the parameter's close

    def feed(self, text: str) -> str:
        self._buf += text
        out: list[str] = []
        while self._step(out):
            pass
        return "".join(out)

    def _step(self, out: list[str]) -> bool:
        """Read what can be read; False once it waits for more text."""
        if self._state == "head":
            head = DSML_HEAD.match(self._buf)
            if head is None:
                self._state = "stuck" if len(self._buf) > HEAD_MAX else "head"
                return False
            self.name, self._buf, self._state = head.group(1), self._buf[head.end() :], "params"
            return True
        if self._state == "params":
            self._buf = self._buf.lstrip()
            param = DSML_PARAM.match(self._buf)
            if param is None:  # more to come, or markup the whole parse will refuse
                self._state = "stuck" if len(self._buf) > HEAD_MAX else "params"
                return False
            key, is_string = param.group(1), param.group(2) == "true"
            if key in self._keys:
                self._state = "stuck"  # duplicate_parameter
                return False
            out.append(("{" if not self._keys else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
            out.append('"' if is_string else "")
            self._keys.add(key)
            self._buf, self._state, self._seen = self._buf[param.end() :], "string" if is_string else "json", 0
            return True
        if self._state == "string":
            end = self._buf.find(PARAM_CLOSE)
            if end < 0:
                keep = len(self._buf) - _partial_tail(self._buf, PARAM_CLOSE)
                out.append(_escaped(self._buf[:keep]))
                self._buf = self._buf[keep:]
                return False
            out.append(_escaped(self._buf[:end]) + '"')
            self._buf, self._state = self._buf[end + len(PARAM_CLOSE) :], "params"
            return True
        if self._state == "json":
            end = self._buf.find(PARAM_CLOSE, self._seen)
            if end < 0:
                self._seen = max(0, len(self._buf) - len(PARAM_CLOSE) + 1)
                return False
            value = self._buf[:end]
            try:
                json_value(value)
            except CallError:
                self._state = "stuck"  # bad_json
                return False
            out.append(value)
            self._buf, self._state = self._buf[end + len(PARAM_CLOSE) :], "params"
            return True
        return False


class _V3Head(ABC):
    """The V3 formats' head: the text before the JSON, read until `_head_of` finds it whole."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._head = ""
        self._stuck = False
        self._json = JsonPrefix()

    def feed(self, text: str) -> str:
        if self._stuck:
            return ""
        if self.name is None:
            self._head += text
            found = self._head_of(self._head)
            if found is None:
                self._stuck = len(self._head) > HEAD_MAX
                return ""
            self.name, text = found
            if self.name is None:  # a head the whole parse will refuse
                self._stuck = True
                return ""
        return self._args(text)

    @abstractmethod
    def _head_of(self, head: str) -> tuple[str | None, str] | None:
        """(name, the arguments' text after the head) once the head is whole; (None, _): a head
        the whole parse refuses; None: not whole yet."""

    def _args(self, text: str) -> str:
        return self._json.feed(text)


class V31Args(_V3Head):
    def _head_of(self, head: str) -> tuple[str | None, str] | None:
        name, sep, rest = head.partition(TOOL_SEP)
        return (name, rest) if sep else None


class V3Args(_V3Head):
    def __init__(self) -> None:
        super().__init__()
        self._tail = ""  # the arguments' text that may yet be the closing fence

    def _head_of(self, head: str) -> tuple[str | None, str] | None:
        kind, sep, rest = head.partition(TOOL_SEP)
        name, fence, rest = rest.partition(V3_FENCE)
        if not (sep and fence):
            return None
        return (name if kind == "function" else None), rest  # not "function": call_format

    def _args(self, text: str) -> str:
        self._tail += text
        keep = _fence_start(self._tail)
        sure, self._tail = self._tail[:keep], self._tail[keep:]
        return self._json.feed(sure)


def _fence_start(text: str) -> int:
    """Where a closing fence (\\n``` and only whitespace after it) may begin at the end of `text`
    (len(text) if nowhere): the whole parse ends the arguments at the last one."""
    at = text.rfind("\n```")
    if at >= 0 and not text[at + 4 :].strip():
        return at
    at = text.rfind("\n")
    if at >= 0 and "```".startswith(text[at + 1 :]):
        return at
    return len(text)
