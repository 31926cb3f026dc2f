"""One tool call's body (the text between its open and close markers, dialects.py) -> its name and
OpenAI `function.arguments` (a JSON string), for each of the DeepSeek families' call formats:

    deepseek_v4   <｜DSML｜tool_calls> <｜DSML｜invoke name="f"> <｜DSML｜parameter name="k"
                  string="true|false">v</｜DSML｜parameter> </｜DSML｜invoke> </｜DSML｜tool_calls>
                  (DeepSeek's encoding_dsv4.py; the block follows the content after "\\n\\n")
    deepseek_v32  the same calls in a <｜DSML｜function_calls> block
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...
    deepseek_v3   ...<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{json}\\n```<｜tool▁call▁end｜>...

A body that does not parse raises CallError with a short reason (the failure counter's label).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass

DSML = "｜DSML｜"
PARAM_CLOSE = f"</{DSML}parameter>"
DSML_HEAD = re.compile(r'\s*name="([^"]*)"\s*>')
DSML_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')
TOOL_SEP = "<｜tool▁sep｜>"
V3_FENCE = "\n```json\n"
_V3_BODY = re.compile(rf"(.*?){re.escape(TOOL_SEP)}(.*?){re.escape(V3_FENCE)}(.*)\n```\s*", re.DOTALL)


class CallError(ValueError):
    """A call's markup that does not parse; str(e) is the reason."""


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object's text


def _known(name: str, names: Collection[str]) -> str:
    if name not in names:
        raise CallError("unknown_tool")
    return name


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def json_value(text: str) -> object:
    try:
        return json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
        raise CallError("bad_json") from None


def parse_dsml(body: str, names: Collection[str]) -> Call:
    """` name="f">\\n<｜DSML｜parameter ...>v</｜DSML｜parameter>\\n...`: string="true" values are
    taken as they are, the others must be JSON (kept as written, as DeepSeek's decoder does)."""
    head = DSML_HEAD.match(body)
    if head is None:
        raise CallError("invoke_format")
    name = _known(head.group(1), names)
    pos, seen, parts = head.end(), set(), []
    while body[pos:].strip():
        pos += len(body[pos:]) - len(body[pos:].lstrip())
        param = DSML_PARAM.match(body, pos)
        if param is None:
            raise CallError("parameter_format")
        end = body.find(PARAM_CLOSE, param.end())
        if end < 0:
            raise CallError("parameter_format")
        key, is_string, value = param.group(1), param.group(2) == "true", body[param.end() : end]
        if key in seen:
            raise CallError("duplicate_parameter")
        seen.add(key)
        if not is_string:
            json_value(value)
        text = json.dumps(value, ensure_ascii=False) if is_string else value
        parts.append(f"{json.dumps(key, ensure_ascii=False)}: {text}")
        pos = end + len(PARAM_CLOSE)
    return Call(name, "{" + ", ".join(parts) + "}")


def _object(text: str) -> str:
    if not isinstance(json_value(text), dict):
        raise CallError("arguments_not_object")
    return text


def parse_v31(body: str, names: Collection[str]) -> Call:
    """`f<｜tool▁sep｜>{json}`"""
    name, sep, args = body.partition(TOOL_SEP)
    if not sep:
        raise CallError("call_format")
    return Call(_known(name, names), _object(args))


def parse_v3(body: str, names: Collection[str]) -> Call:
    """`function<｜tool▁sep｜>f\\n```json\\n{json}\\n```"""
    m = _V3_BODY.fullmatch(body)
    if m is None or m.group(1) != "function":
        raise CallError("call_format")
    return Call(_known(m.group(2), names), _object(m.group(3)))
