"""pdserve's DeepSeek-V4 encoder against a public Jinja chat template for V4, on the reference
encoder's test cases (tests/fixtures/dsv4_encoding.json, whose expected prompts DeepSeek's
reference encoder wrote; pdserve equals them, test_chat_dsv4.py).

DeepSeek's own bundled chat_template.jinja (Hugging Face commit 83adbd0 of deepseek-ai/DeepSeek-V4-Pro,
pull request 16 of DeepSeek-V4-Flash) is not reachable from here; the template checked is SGLang's
`examples/chat_template/tool_chat_template_deepseekv4.jinja` (github.com/sgl-project/sglang at
commit f4d42afb6702d2acb08886aaa4f4d2906cfd85ea, Apache-2.0), stored unchanged as
tests/fixtures/sglang_tool_chat_template_deepseekv4.jinja. It says it mirrors encoding_dsv4.py; it
renders the same prompt as the reference (and pdserve) for chats without tool calls in the history,
and departs from it elsewhere (DEPARTS; also, in thinking mode, the last turn's reasoning lacks the
reference's opening <think>). It appends to a list, which transformers' immutable
sandbox (and pdserve's, chat/jinja.py) refuses: with `tools` it renders only in a mutable sandbox.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from pdserve.chat import dsv4
from pdserve.chat.jinja import _tojson, compile_template

FIXTURES = Path(__file__).parent.parent / "fixtures"
TEMPLATE = (FIXTURES / "sglang_tool_chat_template_deepseekv4.jinja").read_text(encoding="utf-8")
CASES = json.loads((FIXTURES / "dsv4_encoding.json").read_text(encoding="utf-8"))["cases"]
EQUAL = {"plain_chat", "system_and_user", "multi_turn_reasoning_no_tools", "non_ascii", "consecutive_users"}
EQUAL |= {"tools_nested_no_system"}
# where the template departs from the reference: a text only one of the two prompts holds
DEPARTS = {
    "response_format": ("## Response Format:", "reference"),  # the template ignores response_format
    "tool_calls_as_one_blob": ('<｜DSML｜parameter name="arguments" string="false">', "template"),
    "generation_prompt_after_assistant": ("<｜end▁of▁sentence｜><｜Assistant｜>", "template"),
    "task_tokens": ("<｜action｜>", "reference"),
}


def render(case: dict, mutable: bool = True) -> str:
    if mutable:
        env = jinja2.sandbox.SandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        template = env.from_string(TEMPLATE)
    else:
        template = compile_template(TEMPLATE)
    tools, messages = None, []
    for m in case["messages"]:  # the reference takes tools on the system message; the template as a kwarg
        m = dict(m)
        tools = (tools or []) + m.pop("tools") if m.get("tools") else tools
        messages.append(m)
    kw = {"reasoning_effort": case["reasoning_effort"]} if case["reasoning_effort"] else {}
    return template.render(
        messages=messages, tools=tools, add_generation_prompt=True, bos_token=dsv4.BOS, thinking=case["thinking"], **kw
    )


def ids(cases):
    return [f"{c['name']}-{c['thinking']}-{c['reasoning_effort']}" for c in cases]


SAME = [c for c in CASES if c["name"] in EQUAL]
OTHER = [c for c in CASES if c["name"] not in EQUAL]


@pytest.mark.parametrize("case", SAME, ids=ids(SAME))
def test_the_template_and_the_encoder_agree(case):
    got = dsv4.encode(case["messages"], thinking=case["thinking"], reasoning_effort=case["reasoning_effort"])
    assert render(case) == got == case["expected"]


@pytest.mark.parametrize("case", OTHER, ids=ids(OTHER))
def test_where_the_template_departs_from_the_reference(case):
    """Each other case differs, showing at least one departure DEPARTS names (the encoder follows the reference)."""
    text, expected = render(case), case["expected"]
    assert text != expected
    reasons = {r for r, (mark, side) in DEPARTS.items() if (mark in expected) != (mark in text)}
    assert reasons, "a difference DEPARTS does not name"
    for reason in reasons:
        mark, side = DEPARTS[reason]
        assert mark in (expected if side == "reference" else text) and mark not in (
            text if side == "reference" else expected
        )


def test_with_tools_it_needs_a_mutable_sandbox():
    case = next(c for c in CASES if c["name"] == "tools_nested_no_system")
    with pytest.raises(jinja2.exceptions.SecurityError, match="append"):
        render(case, mutable=False)
    plain = next(c for c in CASES if c["name"] == "plain_chat")
    assert render(plain, mutable=False) == plain["expected"]
