"""A JSON object's text as it streams -> the part of it that is sure to stand: `feed` returns the
text read so far that is the start of some JSON object (RFC 8259, as json.loads reads it: no NaN,
no control character inside a string) and that ends where no token is cut: a number, true / false /
null and a string's escape are held back until they are whole. Once the text cannot be the start
of a JSON object any more (`ok` false) nothing more is given out.

A client's partial-JSON reader (the anthropic SDK's, pydantic_core's from_json with allow_partial)
reads every prefix given out.
"""

from __future__ import annotations

import re

WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonPrefix:
    def __init__(self) -> None:
        self.ok = True
        self._stack: list[str] = []  # open containers: "{" or "["
        # what comes next: object (the top level), value, value_or_end ([), key_or_end ({), key, colon,
        # comma_or_end, done (after the top-level object: only whitespace)
        self._expect = "object"
        self._string: str | None = None  # inside a string: "key" or "value"
        self._escape = 0  # -1: after a backslash; n > 0: hex digits of \\u still to come
        self._token = ""  # a number or literal being read
        self._held = ""  # text read and not yet given out

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if not self.ok:
                break
            self._held += ch
            self._step(ch)
            if self.ok and not self._token and not self._escape:
                out.append(self._held)
                self._held = ""
        return "".join(out)

    def _step(self, ch: str) -> None:
        if self._string is not None:
            self._in_string(ch)
            return
        if self._token:
            literal = self._token[0] in "tfn"
            if (literal and ch.isalpha()) or (not literal and ch in "0123456789+-.eE"):
                self._token += ch
                self.ok = not literal or any(w.startswith(self._token) for w in _LITERALS)
                return
            self._end_token()
            if not self.ok:
                return
        if ch in WHITESPACE:
            return
        expect = self._expect
        if expect in ("object", "value", "value_or_end"):
            self._value_start(ch)
        elif expect in ("key_or_end", "key"):
            if ch == '"':
                self._string = "key"
            elif ch == "}" and expect == "key_or_end":
                self._close()
            else:
                self.ok = False
        elif expect == "colon":
            self.ok, self._expect = ch == ":", "value"
        elif expect == "comma_or_end":
            top = self._stack[-1]
            if ch == ",":
                self._expect = "key" if top == "{" else "value"
            elif (ch, top) in (("}", "{"), ("]", "[")):
                self._close()
            else:
                self.ok = False
        else:  # done: nothing but whitespace after the object
            self.ok = False

    def _value_start(self, ch: str) -> None:
        if self._expect == "value_or_end" and ch == "]":
            self._close()
        elif self._expect == "object" and ch != "{":
            self.ok = False
        elif ch in "{[":
            self._stack.append(ch)
            self._expect = "key_or_end" if ch == "{" else "value_or_end"
        elif ch == '"':
            self._string = "value"
        elif ch in "-0123456789tfn":
            self._token = ch
        else:
            self.ok = False

    def _in_string(self, ch: str) -> None:
        if self._escape == -1:
            self._escape = 4 if ch == "u" else 0
            self.ok = ch in 'u"\\/bfnrt'
        elif self._escape > 0:
            self._escape -= 1
            self.ok = ch in _HEX
        elif ch == "\\":
            self._escape = -1
        elif ch == '"':
            key, self._string = self._string == "key", None
            if key:
                self._expect = "colon"
            else:
                self._after_value()
        elif ord(ch) < 0x20:  # json.loads refuses control characters inside a string
            self.ok = False

    def _end_token(self) -> None:
        token, self._token = self._token, ""
        self.ok = token in _LITERALS or _NUMBER.fullmatch(token) is not None
        self._after_value()

    def _close(self) -> None:
        self._stack.pop()
        self._after_value()

    def _after_value(self) -> None:
        self._expect = "comma_or_end" if self._stack else "done"
