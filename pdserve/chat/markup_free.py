"""JSON values that cannot hold a tool-call format's markup: a JSON schema rewritten so that no
string in the value (a string value or an object key, at any depth) contains a given text.

A forced tool call's JSON (a DSML string="false" parameter, V3's arguments object) sits between
markers that the output parser finds by their text, so a string holding `</｜DSML｜parameter>`
or `<｜tool▁call▁end｜>` would end the value early and the call would not parse. The library
checks the rewritten schema: every string schema gains a pattern that excludes the text (JSON
escapes do not help: a pattern applies to the decoded string), an unconstrained value becomes
`$defs/ANY` (any JSON whose strings exclude it), and an object's free keys are held to the same
pattern through patternProperties (llguidance has no propertyNames).

    avoiding("｜DSML｜")   a regex of the strings without that text (the library's regexes have
                           no lookaround, so it is spelt out as an automaton's loops)
"""

from __future__ import annotations

import json
from typing import Any

ANY = "pdserve_markup_free_any"  # the $defs entry of an unconstrained value
_SUBSCHEMA = ("items", "additionalItems", "contains", "then", "else")  # not `not` / `if`: narrowing them widens
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf", "allOf")
_NOTES = {"description", "title", "default", "examples", "$schema", "$id", "$comment"}
_META = set("\\.+*?()|[]{}^$#&-~")


class MarkupSchemaError(ValueError):
    """A schema whose values cannot be kept free of the markup; str(e) says which keyword."""


def _lit(text: str) -> str:
    return "".join("\\" + ch if ch in _META else ch for ch in text)


def _not(*chars: str) -> str:
    return "[^" + "".join("\\" + ch if ch in _META else ch for ch in dict.fromkeys(chars)) + "]"


class _Avoid:
    """Regexes of the strings without `text`, read from a state of its matcher (k characters
    of it matched). For a text whose first character c appears nowhere inside it but perhaps at
    its end (every DeepSeek marker: "｜DSML｜", "<｜tool▁"), a mismatch restarts at state 0, or
    at 1 on c; state 1 loops through (a partial match, c) and leaves to 0 on a mismatch."""

    def __init__(self, text: str) -> None:
        c, rest = text[0], text[1:]
        if len(text) < 2 or c in rest[:-1]:
            raise ValueError(f"needs a text whose first character is not inside it, not {text!r}")
        self.text, n = text, len(text)
        back = [_lit(rest[:j] + c) for j in range(n - 1) if not (j == n - 2 and rest[-1] == c)]
        loop1 = f"(?:{'|'.join(back)})*"
        self.leave = "|".join(_lit(rest[:j]) + _not(c, rest[j]) for j in range(n - 1))
        tail = "|".join(_lit(rest[:j]) for j in range(n - 1))
        self.a = f"(?:{_not(c)}|{_lit(c)}{loop1}(?:{self.leave}))*(?:{_lit(c)}{loop1}(?:{tail}))?"
        self.e1 = f"{loop1}(?:{tail}|(?:{self.leave}){self.a})"

    def step(self, k: int, ch: str) -> int | None:
        """The state after reading `ch` in state k (None: the text is complete)."""
        if ch == self.text[k]:
            return None if k + 1 == len(self.text) else k + 1
        return 1 if ch == self.text[0] else 0

    def after(self, k: int) -> str:
        """The strings readable from state k without completing the text."""
        if k == 0:
            return self.a
        if k == 1:
            return self.e1
        c, t, out = self.text[0], self.text, []
        for j in range(k, len(t)):  # match t[k:j], then stop, go to state 1 on c, or to 0
            head, nxt = _lit(t[k:j]), t[j]
            via_c = f"|{_lit(c)}{self.e1}" if self.step(j, c) == 1 else ""
            out.append(f"{head}(?:{_not(c, nxt)}{self.a}{via_c})?")
        return "(?:" + "|".join(out) + ")"

    def except_words(self, words: list[str]) -> str:
        """The strings without the text that are none of `words` (each without the text): at each
        node of the words' trie, the node itself if it is no word, or a character off the trie
        and then any string that the state it leads to allows."""
        c, out = self.text[0], []
        nodes = {w[:i] for w in words for i in range(len(w) + 1)}
        for prefix in sorted(nodes):
            k = 0
            for ch in prefix:
                k = self.step(k, ch)
            if prefix not in words:
                out.append(_lit(prefix))
            nexts = {w[len(prefix)] for w in words if len(w) > len(prefix) and w.startswith(prefix)}
            out.append(_lit(prefix) + _not(*nexts, self.text[k], c) + self.a)
            for ch in dict.fromkeys((self.text[k], c)):
                to = self.step(k, ch)
                if ch not in nexts and to is not None:
                    out.append(_lit(prefix + ch) + self.after(to))
        return "(?:" + "|".join(out) + ")"


def avoiding(text: str) -> str:
    """The regex (unanchored; wrap in ^...$) of every string that does not contain `text`."""
    return _Avoid(text).a


def schema_without(schema: Any, text: str) -> Any:
    """`schema` whose every string (values and keys, at any depth) excludes `text`; `$defs`
    gains the ANY entry where an unconstrained value needs it. MarkupSchemaError for a keyword
    that would let the text through and cannot be rewritten."""
    rw = _Rewriter(text)
    out = rw.schema(schema)
    if rw.used_any:
        out = out if isinstance(out, dict) else {"allOf": [out]}
        out = {**out, "$defs": {**out.get("$defs", {}), ANY: rw.any_value()}}
    return out


class _Rewriter:
    def __init__(self, text: str) -> None:
        self.avoid, self.text = _Avoid(text), text
        self.pattern = "^" + self.avoid.a + "$"
        self.used_any = False

    def ref_any(self) -> dict:
        self.used_any = True
        return {"$ref": f"#/$defs/{ANY}"}

    def any_value(self) -> dict:
        ref = {"$ref": f"#/$defs/{ANY}"}
        return {
            "anyOf": [
                {"type": ["null", "boolean", "number"]},
                {"type": "string", "pattern": self.pattern},
                {"type": "array", "items": ref},
                {"type": "object", "patternProperties": {self.pattern: ref}, "additionalProperties": False},
            ]
        }

    def schema(self, s: Any) -> Any:
        if s is True:
            return self.ref_any()
        if not isinstance(s, dict):
            return s  # False, or not a schema (the library names the problem)
        out = dict(s)
        for key in ("properties", "$defs", "definitions"):
            if isinstance(s.get(key), dict):
                out[key] = {k: self.schema(v) for k, v in s[key].items()}
        for name in s.get("properties") or {}:
            if self.text in name:
                raise MarkupSchemaError(f"a property name holds {self.text!r}")
        for key in _SUBSCHEMA:
            if key in s:
                out[key] = self.schema(s[key])
        for key in _SUBSCHEMAS:
            if isinstance(s.get(key), list):
                out[key] = [self.schema(v) for v in s[key]]
        if "patternProperties" in s or "propertyNames" in s:
            raise MarkupSchemaError("patternProperties / propertyNames cannot be combined with the markup's exclusion")
        for key in ("enum", "const"):
            if key in s and self.text in json.dumps(s[key], ensure_ascii=False):
                raise MarkupSchemaError(f"{key} holds {self.text!r}")
        if "$ref" in s or "enum" in s or "const" in s:
            return out  # the target is rewritten; fixed values were checked
        kinds = s.get("type")
        kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else None
        shape = set(s) - _NOTES - {"$defs", "definitions"}
        if kinds is None and not shape:
            return {**out, **self.ref_any()}  # any value
        if kinds is None and shape <= set(_SUBSCHEMAS):
            return out  # only anyOf / oneOf / allOf: their parts are rewritten
        if kinds is None or "string" in kinds:
            if "pattern" in s:
                out["allOf"] = [*out.get("allOf", []), {"pattern": self.pattern}]
            else:
                out["pattern"] = self.pattern
        if (kinds is None or "array" in kinds) and "items" not in s:
            out["items"] = self.ref_any()
        if kinds is None or "object" in kinds:
            extra = s.get("additionalProperties", True)
            if extra is not False:  # free keys: none of the named ones (they would take both schemas)
                names = [k for k in s.get("properties") or {} if isinstance(k, str)]
                keys = "^" + self.avoid.except_words(names) + "$" if names else self.pattern
                out["patternProperties"] = {keys: self.schema(extra)}
                out["additionalProperties"] = False
        return out
