"""tool_choice "required" and a named function as a grammar: the DSML tool-call block that
dsv4.dsml_tool_calls writes and parsers/calls.py reads (deepseek_v4's <DSML tool_calls>,
deepseek_v32's <DSML function_calls>), as an llguidance Lark grammar, so that constrained decoding
makes the answer one or more well-formed calls whose arguments validate against each tool's JSON
schema. tool_grammar_v3.py does the same for V3's and V3.1's format.

    [reasoning </think>] \\n\\n<DSML tool_calls>\\n
    <DSML invoke name="f">\\n
    <DSML parameter name="k" string="true">raw text</DSML parameter>\\n     a plain string parameter
    <DSML parameter name="n" string="false">JSON</DSML parameter>\\n        any other (JSON schema)
    </DSML invoke>  (\\n and more invokes)  \\n</DSML tool_calls>

A marker that the tokenizer holds as one token (DSML, </think>) is named by its id, else by its
text; free text (reasoning, raw values) never holds the token nor its text, and a JSON value holds
no string with DSML's text (markup_free.py), so nothing the model writes can close a value early. A tool's
parameters come in its schema's `properties` order; required ones always, optional ones at will.
A string parameter is raw text (string="true", as the model writes strings) when its schema has
only length bounds and enums there; one with a pattern or format is a JSON string (string="false"),
which the library checks against the schema. In thinking mode the reasoning is part of the
grammar: it cannot end the answer (EOS) or call tools before </think>.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.chat.dsv4 import DSML, END_THINK
from pdserve.chat.markup_free import MarkupSchemaError, schema_without

# schema keywords of a parameters object that the DSML form honours (anything else: 400)
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$defs"}
_OBJECT_KEYS |= {"definitions", "$schema", "$id", "strict", "examples", "default"}
# a string schema with only these is written as raw text
_RAW_KEYS = {"type", "description", "title", "minLength", "maxLength", "enum", "const", "default", "examples"}
_NO_DSML = f"~/(?s:.*)({DSML}|<\\/think>)(?s:.*)/"  # free text that holds no markup
Ids = dict[str, "int | None"]  # a marker's text -> its token id (None: not one token)


class ToolGrammarError(ValueError):
    """A tool whose parameters the call format cannot express; str(e) names the tool and why."""


def mark(text: str, ids: Ids) -> str:
    """A marker in a Lark rule: its token by id where the tokenizer has one, else its text."""
    return f"<[{ids[text]}]>" if ids.get(text) is not None else lark_literal(text)


def dsml_tool_grammar(
    tools: list[dict],
    *,
    ids: Ids,
    block: str = "tool_calls",
    name: str | None = None,
    single: bool = False,
    thinking: bool = False,
    json_layout: dict[str, Any] | None = None,
) -> str:
    """The Lark grammar of a DSML tool-call block for OpenAI-form `tools`.

    ids: the token ids of DSML and </think> (tool_grammar.Ids); block: the block's tag
    (deepseek_v32: function_calls). name: only that function (a named tool_choice; one call).
    single: exactly one call (parallel_tool_calls false). thinking: the prompt opens the
    reasoning; the grammar starts with it and </think>. json_layout: llguidance's JSON options
    ("x-guidance") for JSON values, so that they are laid out as the constraint's other JSON is."""
    fns = pick(tools, name)
    dsml = mark(DSML, ids)
    lines = ["%llguidance {}"]
    head, reason = reasoning(ids, DSML) if thinking else ("", [])
    lines.append(f'start: {head}"\\n\\n" "<" {dsml} "{block}>" "\\n" calls "\\n" "</" {dsml} "{block}>"')
    lines.append("calls: call" if single or name is not None else 'calls: call ("\\n" call)*')
    lines.append("call: " + " | ".join(f"f{i}" for i in range(len(fns))))
    lines += reason
    for i, fn in enumerate(fns):
        lines += _invoke(f"f{i}", fn, dsml, json_layout or {})
    return "\n".join(lines) + "\n"


def reasoning(ids: Ids, markup: str) -> tuple[str, list[str]]:
    """A thinking-mode answer's reasoning, up to and with </think>: (the start rule's head, the
    rule of its terminal). It holds neither </think> nor `markup` (a literal text) before its end."""
    no = f"{markup}|<\\/think>"
    if ids.get(END_THINK) is not None:
        return f"REASON <[{ids[END_THINK]}]> ", [f"REASON: /(?s:.*)/ & ~/(?s:.*)({no})(?s:.*)/"]
    # </think> as text: one terminal with it, else the reasoning's terminal would run over it
    return "REASON ", [f"REASON: /(?s:.*)<\\/think>/ & ~/(?s:.*)({no})(?s:.+)/"]


def pick(tools: list[dict], name: str | None) -> list[dict]:
    """The functions a forced call may take: all, or the named one."""
    fns = [t["function"] for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ToolGrammarError(f"tool_choice names the function {name!r}, which is not among the tools")
    return fns


def json_value(schema: Any, markup: str, tool: str, key: str, layout: dict[str, Any]) -> str:
    """`%json` of a value: the parameter's schema with no string that holds `markup`."""
    try:
        schema = schema_without(schema, markup)
    except MarkupSchemaError as e:
        raise ToolGrammarError(f"tool {tool!r}: parameter {key!r}: {e}") from None
    return "%json " + json.dumps({**schema, "x-guidance": layout} if layout else schema, ensure_ascii=False)


def _invoke(rule: str, fn: dict, dsml: str, layout: dict[str, Any]) -> list[str]:
    """One function's invoke: its header, its parameters in order, the close."""
    tool = fn["name"]
    params = parameters(tool, fn.get("parameters"))
    lines, items = [], []
    for k, (key, schema, required) in enumerate(params):
        item = f"{rule}_p{k}"
        lines += _parameter(item, key, schema, dsml, tool, layout)
        items.append((item, required))
    body, some = _sequence(rule, items)
    lines += some
    lines.insert(0, f'{rule}: "<" {dsml} {lark_literal(f"invoke name={_q(tool)}>")} "\\n" {body} "</" {dsml} "invoke>"')
    return lines


def _sequence(rule: str, items: list[tuple[str, bool]]) -> tuple[str, list[str]]:
    """The parameters between the invoke's lines (and the rules they use): each item ends with a
    newline, and with none present the encoder writes one empty line. Items come in order,
    required ones always."""
    if any(req for _, req in items):
        return " ".join(item if req else f"{item}?" for item, req in items), []
    if not items:
        return '"\\n"', []
    # all optional: a non-empty in-order subset (`some_k`: one of items k.., then any of the later), or the empty line
    n, some = len(items), []
    for k in range(n):
        later = f" {rule}_some{k + 1}?" if k + 1 < n else ""
        skip = f" | {rule}_some{k + 1}" if k + 1 < n else ""
        some.append(f"{rule}_some{k}: {items[k][0]}{later}{skip}")
    return f'({rule}_some0 | "\\n")', some


def parameters(tool: str, schema: Any) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of a tool's parameters, in its `properties` order."""
    if schema is None:
        return []
    if not isinstance(schema, dict):
        raise ToolGrammarError(f"tool {tool!r}: parameters must be a JSON schema object")
    extra = sorted(set(schema) - _OBJECT_KEYS)
    if extra:
        raise ToolGrammarError(f"tool {tool!r}: parameters keywords {extra} cannot be enforced on tool calls")
    if schema.get("type", "object") != "object":
        raise ToolGrammarError(f"tool {tool!r}: parameters must be of type 'object'")
    props, required = schema.get("properties") or {}, schema.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list):
        raise ToolGrammarError(f"tool {tool!r}: parameters need 'properties' as an object, 'required' as a list")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    out = []
    for key in [*props, *(r for r in required if r not in props)]:
        if not isinstance(key, str) or '"' in key or DSML in key:
            raise ToolGrammarError(f"tool {tool!r}: parameter name {key!r} cannot be written in a tool call")
        sub = props.get(key, schema.get("additionalProperties", True))  # required, not in properties: an extra
        if sub is False:
            if key in required:
                raise ToolGrammarError(f"tool {tool!r}: parameter {key!r} is required and allows no value")
            continue
        sub = {} if sub is True else sub
        out.append((key, {**sub, **defs} if isinstance(sub, dict) and defs else sub, key in required))
    return out


def _parameter(item: str, key: str, schema: Any, dsml: str, tool: str, layout: dict[str, Any]) -> list[str]:
    """One parameter: raw text for a plain string schema, else JSON that the library checks."""
    if not isinstance(schema, dict):
        raise ToolGrammarError(f"tool {tool!r}: parameter {key!r} has a schema that is not an object")
    value = item.upper()
    head = f'"<" {dsml} {lark_literal(f"parameter name={_q(key)} string=")}'
    raw = _raw_value(schema)
    if raw is not None:
        return [f'{item}: {head} "\\"true\\">" {value} {dsml} "parameter>" "\\n"', f"{value}: {raw}"]
    value = json_value(schema, DSML, tool, key, layout)
    return [f'{item}: {head} "\\"false\\">" {value} "</" {dsml} "parameter>" "\\n"']


def _raw_value(schema: dict) -> str | None:
    """The terminal (the value, then the "</" that starts the close) of a string parameter
    written raw; None where the schema asks for more than raw text can show."""
    if not set(schema) <= _RAW_KEYS or schema.get("type", "string") != "string":
        return None
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)):
        return None
    options = [schema["const"]] if "const" in schema else schema.get("enum")
    if options is not None:
        if not all(isinstance(o, str) and DSML not in o for o in options):
            return None
        options = [o for o in dict.fromkeys(options) if lo <= len(o) <= (len(o) if hi is None else hi)]
        return " | ".join(lark_literal(o + "</") for o in options) or None
    if "type" not in schema:
        return None
    return f"/(?s:.{{{lo},{'' if hi is None else hi}}})<\\// & {_NO_DSML}"


def _q(text: str) -> str:
    return f'"{text}"'


def lark_literal(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)
