"""tool_choice "required" and a named function in DeepSeek-V3's and V3.1's tool-call formats
(pdserve/chat/tool_grammar_v3.py): the grammar takes exactly the calls that the model's chat
template writes for an assistant turn (our V3 / V3.1 style templates, tests/helpers/v3_tools.py)
and refuses calls out of the schema or with markup in a value; the router picks the grammar by the
tool-call parser; and tiny V3 models with random weights (the LLM path) answer forced requests
with calls that the format's own parser reads and whose arguments validate (jsonschema)."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from pdserve.chat.parsers import OutputSpec, default_parsers, tool_names
from pdserve.chat.tool_grammar import ToolGrammarError
from pdserve.chat.tool_grammar_v3 import MARKERS, v3_tool_grammar
from pdserve.llm import LLM
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.validation import RequestValidator
from pdserve.structured import compiler_for
from pdserve.structured.compiler import JSON_OPTIONS
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError
from tests.helpers.tools import assert_valid_call, random_tool_sets
from tests.helpers.v3_tools import make_tiny_v3_tools
from tests.unit.test_tool_choice import TOOLS, USER

pytestmark = pytest.mark.timeout(900)
DIALECTS = ("deepseek_v3", "deepseek_v31")


def call(name: str, **arguments) -> dict:
    return {
        "id": "c",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


@pytest.fixture(scope="module", params=DIALECTS)
def v3(request, tmp_path_factory):
    """(dialect, model folder, tokenizer, validator) of a tiny V3 model in that call format."""
    folder = make_tiny_v3_tools(tmp_path_factory.mktemp(request.param) / "tiny", request.param)
    tok = Tokenizer(folder)
    assert default_parsers("deepseek_v3", tok.chat_template)[1] == request.param  # the template says the format
    validator = RequestValidator(tok, "tiny", json.loads((folder / "config.json").read_text())["vocab_size"])
    validator.tool_parser = request.param
    return request.param, folder, tok, validator


def written(tok: Tokenizer, calls: list[dict]) -> str:
    """The model's side of an assistant turn with these calls, as the chat template writes it."""
    chat = [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]
    text = tok.apply_chat_template(chat, add_generation_prompt=False, tools=TOOLS, tokenize=False)
    return text[text.rindex("<｜Assistant｜>") + len("<｜Assistant｜>") :].removesuffix("<｜end▁of▁sentence｜>")


def grammar(v3, tools=TOOLS, **kw) -> str:
    dialect, _, tok, _ = v3
    ids = {m: tok.token_to_id(m) for m in MARKERS}
    return v3_tool_grammar(tools, dialect=dialect, ids=ids, json_layout=JSON_OPTIONS, **kw)


def matches(tok: Tokenizer, grammar_text: str, text: str) -> bool:
    m = llg.LLMatcher(compiler_for(tok).tokenizer, grammar_text, log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


GOOD = [
    call("get_weather", city="Pa</ris\n", days=3, unit="f", opts={"a": [1, 2]}),
    call("ping"),
    call("code", x=True),
    call("code"),
    call("code", y="abc"),
    call("get_weather", city="Oslo ünï ｜"),
    call("extra", c="ab", n=3),
    call("get_weather", city="x", opts={"a": [1], "note": "<｜tool", "more": {"k": ["```"]}}),
]


def test_the_grammar_takes_what_the_template_writes(v3):
    dialect, _, tok, _ = v3
    markers = {tok.token_to_id(m) for m in MARKERS[:-1]}
    assert None not in markers  # one token each, as in DeepSeek's tokenizer
    g = grammar(v3)
    assert matches(tok, g, written(tok, GOOD))
    for c in GOOD:
        text = written(tok, [c])
        assert matches(tok, g, text) and matches(tok, grammar(v3, name=c["function"]["name"]), text)
        # the format's parser reads it back: the same name and arguments
        parser = OutputSpec("deepseek_r1", dialect, tool_names(TOOLS)).parser()
        parts = [parser.feed(text), parser.finish()]
        got = [(p.name, p.arguments) for part in parts for p in part.calls]
        assert got == [(c["function"]["name"], c["function"]["arguments"])] and not parser.failures
    end = tok.token_to_id("</think>")
    assert (end is not None) == (dialect == "deepseek_v31")  # V3's tokenizer: </think> is text
    thinking = grammar(v3, thinking=True)
    assert matches(tok, thinking, "Let me think.\n</think>" + written(tok, GOOD[:2]))
    assert not matches(tok, thinking, written(tok, GOOD[:2]))  # thinking mode: </think> first


@pytest.mark.parametrize(
    "calls, kw",
    [
        ([call("get_weather", days=3)], {}),  # a required parameter missing
        ([call("get_weather", city="x", dayz=3)], {}),  # an unknown parameter
        ([call("get_weather", city="x", days=0)], {}),  # out of the schema's range
        ([call("get_weather", city="x" * 21)], {}),  # longer than maxLength
        ([call("get_weather", city="x", unit="k")], {}),  # not in the enum
        ([call("get_weather", days=3, city="x")], {}),  # out of the properties' order
        ([call("code", y="ABC")], {}),  # against the pattern
        ([call("other")], {}),
        ([call("extra", c="ab", n="3")], {}),  # an extra parameter against additionalProperties
        ([call("get_weather", city="a<｜tool▁call▁end｜>")], {}),  # markup inside a string
        ([call("get_weather", city="x", opts={"<｜tool▁sep｜>": 1})], {}),  # ... or a key
        ([call("get_weather", city="x", opts={"b": ["<｜tool▁calls▁end｜>"]})], {}),  # ... at any depth
        ([call("ping"), call("ping")], {"name": "ping"}),  # a named function: one call
        ([call("code")], {"name": "ping"}),
        ([call("ping"), call("ping")], {"single": True}),  # parallel_tool_calls false
    ],
)
def test_the_grammar_refuses_calls_out_of_the_schema(v3, calls, kw):
    assert not matches(v3[2], grammar(v3, **kw), written(v3[2], calls))


def test_the_formats_differ(v3):
    """Each dialect's grammar refuses the other's layout of the same calls."""
    dialect, _, tok, _ = v3
    calls = [call("ping"), call("code", x=True)]
    text = written(tok, calls)
    other = text.replace("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "<｜tool▁call▁begin｜>")
    other = other.replace("\n```json\n", "<｜tool▁sep｜>").replace("\n```", "").replace("\n<｜tool", "<｜tool")
    if dialect == "deepseek_v31":
        other = text.replace("<｜tool▁call▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>")
    assert other != text and not matches(tok, grammar(v3), other)


def test_request_rules(v3):
    dialect, _, tok, validator = v3

    def prepare(**body):
        return validator.chat(ChatCompletionRequest.model_validate({"messages": USER, **body}), 4096)

    prep = prepare(tools=TOOLS, tool_choice="required")
    assert prep.params[0].structured_outputs.grammar == grammar(v3)
    named = {"type": "function", "function": {"name": "ping"}}
    prep = prepare(tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    assert prep.params[0].structured_outputs.grammar == grammar(v3, name="ping")
    if dialect == "deepseek_v31":  # V3.1's template opens <think> with thinking on
        prep = prepare(tools=TOOLS, tool_choice="required", chat_template_kwargs={"thinking": True})
        assert prep.thinking and prep.params[0].structured_outputs.grammar == grammar(v3, thinking=True)
    validator.tool_parser = "deepseek_v32"  # DSML calls need the DSML token, which V3's tokenizer lacks
    try:
        with pytest.raises(OpenAIError, match="DSML") as e:
            prepare(tools=TOOLS, tool_choice="required")
        assert e.value.status == 400 and e.value.param == "tool_choice"
    finally:
        validator.tool_parser = dialect
    bad = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "foo"}}}}}
    with pytest.raises(OpenAIError) as e:
        prepare(tools=[bad], tool_choice="required")
    assert e.value.status == 400 and e.value.param == "tools" and "foo" in e.value.message
    with pytest.raises(ToolGrammarError, match="patternProperties"):
        grammar(v3, tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "properties": {"a": {"type": "object", "patternProperties": {"^x": {}}}}}}}])  # fmt: skip


def test_required_and_named_calls_with_random_weights(v3):
    """Random weights, every answer forced: calls the format's parser reads, arguments valid."""
    dialect, folder, tok, validator = v3
    llm = LLM(str(folder), dtype="float32", kv_block_size=16, num_kv_blocks=4096, max_num_seqs=32)
    sets = random_tool_sets(12, seed=31)
    bodies = [dict(tools=t, tool_choice="required", seed=i) for i, t in enumerate(sets[:8])]
    bodies += [dict(tools=t, tool_choice={"type": "function", "function": {"name": t[-1]["function"]["name"]}}, seed=i)
               for i, t in enumerate(sets[8:])]  # fmt: skip
    preps = [validator.chat(ChatCompletionRequest.model_validate({"messages": USER, **b}), 4096) for b in bodies]
    params = [p.params[0].model_copy(update={"skip_special_tokens": False, "temperature": 1.0}) for p in preps]
    outs = llm.generate([{"prompt_token_ids": p.prompts[0]} for p in preps], params)
    several = 0
    for prep, body, out in zip(preps, bodies, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop"
        parser = OutputSpec("deepseek_r1", dialect, tool_names(prep.tools), prep.thinking).parser()
        parts = [parser.feed(tok.decode(o.token_ids[:-1], skip_special_tokens=False)), parser.finish()]
        calls = [c for p in parts for c in p.calls]
        assert calls and not parser.failures and "".join(p.content for p in parts) == ""
        for c in calls:
            assert_valid_call(c.name, c.arguments, body["tools"])
        if isinstance(body["tool_choice"], dict):
            assert [c.name for c in calls] == [body["tool_choice"]["function"]["name"]]
        several += len(calls) > 1
    assert several  # parallel calls happen
