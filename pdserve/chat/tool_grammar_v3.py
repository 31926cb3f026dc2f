"""tool_choice "required" and a named function as a grammar of DeepSeek-V3's and V3.1's tool-call
blocks (what their chat templates write and parsers/calls.py reads), so that constrained decoding
makes the answer one or more calls whose arguments (one JSON object) validate against the tool's
JSON schema.

    deepseek_v3   [reasoning </think>] <calls▁begin><call▁begin>function<sep>NAME\\n```json\\n{...}\\n```<call▁end>
                  (\\n and more calls) <calls▁end>
    deepseek_v31  [reasoning </think>] <calls▁begin><call▁begin>NAME<sep>{...}<call▁end> (more calls) <calls▁end>

The arguments object lists the tool's parameters in its schema's `properties` order, required
ones always, optional ones at will, laid out as json.dumps writes it (", " and ": "); each value
is JSON the library checks against the parameter's schema, with no string that holds the markers'
text "<｜tool▁" (markup_free.py), so no value can end a call early. The markers are tokens by id
where the tokenizer has them (tool_grammar.mark).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.chat.dsv4 import END_THINK
from pdserve.chat.tool_grammar import Ids, ToolGrammarError, json_value, lark_literal, mark, parameters, pick, reasoning

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, END_THINK)
MARKUP = "<｜tool▁"  # what every marker of the block starts with


def v3_tool_grammar(
    tools: list[dict],
    *,
    dialect: str,
    ids: Ids,
    name: str | None = None,
    single: bool = False,
    thinking: bool = False,
    json_layout: dict[str, Any] | None = None,
) -> str:
    """The Lark grammar of a deepseek_v3 / deepseek_v31 tool-call block for OpenAI-form `tools`
    (the arguments as tool_grammar.dsml_tool_grammar takes them)."""
    if dialect not in ("deepseek_v3", "deepseek_v31"):
        raise ValueError(f"no V3 tool-call format {dialect!r}")
    fns, layout = pick(tools, name), json_layout or {}
    m = {text: mark(text, ids) for text in MARKERS}
    lines = ["%llguidance {}"]
    head, reason = reasoning(ids, MARKUP) if thinking else ("", [])
    lines.append(f"start: {head}{m[CALLS_BEGIN]} calls {m[CALLS_END]}")
    between = '"\\n" ' if dialect == "deepseek_v3" else ""
    lines.append("calls: call" if single or name is not None else f"calls: call ({between}call)*")
    lines.append("call: " + " | ".join(f"f{i}" for i in range(len(fns))))
    lines += reason
    for i, fn in enumerate(fns):
        rule, tool = f"f{i}", fn["name"]
        args, more = _arguments(rule, fn, layout)
        if dialect == "deepseek_v3":
            call = f'"function" {m[SEP]} {lark_literal(tool)} "\\n```json\\n" {args} "\\n```"'
        else:
            call = f"{lark_literal(tool)} {m[SEP]} {args}"
        lines.append(f"{rule}: {m[CALL_BEGIN]} {call} {m[CALL_END]}")
        lines += more
    return "\n".join(lines) + "\n"


def _arguments(rule: str, fn: dict, layout: dict[str, Any]) -> tuple[str, list[str]]:
    """The arguments object (an expression) and the rules it uses: `{rule}_a{k}` is member k
    (key and value), `{rule}_more{k}` the members from k on after one is written (each then
    starts with ", "); the object holds the first present member, then more."""
    tool, rules, members = fn["name"], [], []
    for k, (key, schema, required) in enumerate(parameters(tool, fn.get("parameters"))):
        if not isinstance(schema, dict):
            raise ToolGrammarError(f"tool {tool!r}: parameter {key!r} has a schema that is not an object")
        key_text = lark_literal(json.dumps(key, ensure_ascii=False) + ": ")
        rules.append(f"{rule}_a{k}: {key_text} {json_value(schema, MARKUP, tool, key, layout)}")
        members.append((f"{rule}_a{k}", required))
    n, body = len(members), ""
    for k in range(n - 1, -1, -1):
        member, required = members[k]
        rest = f" {rule}_more{k + 1}" if k + 1 < n else ""
        rules.append(f'{rule}_more{k}: ", " {member}{rest}' if required else f'{rule}_more{k}: (", " {member})?{rest}')
        if required:  # first_k: member k and the rest, or (k optional) first_{k+1}
            body = f"{member}{rest}"
        else:
            body = f"({member}{rest} | {body})" if body else f"({member}{rest})?"
    return f'"{{" {body} "}}"' if body else '"{}"', rules
