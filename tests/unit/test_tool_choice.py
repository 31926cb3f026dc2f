"""tool_choice "required" and a named function, enforced by constrained decoding: the DSML
tool-call grammar (pdserve/chat/tool_grammar.py) against what DeepSeek-V4's encoder writes, the
router's request rules, and the tiny V4 model with random weights through the LLM path: chat
prompts made by the V4 encoder, every answer parses (the deepseek_v4 parser) into calls whose
arguments validate against the tool's schema (jsonschema)."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from pdserve.chat import dsv4
from pdserve.chat.parsers import OutputSpec, tool_names
from pdserve.chat.tool_grammar import ToolGrammarError, dsml_tool_grammar
from pdserve.llm import LLM
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.validation import RequestValidator
from pdserve.structured import compiler_for
from pdserve.structured.compiler import JSON_OPTIONS
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError
from tests.helpers.tools import assert_valid_call, random_tool_sets

pytestmark = pytest.mark.timeout(600)

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1},
                "unit": {"enum": ["c", "f"]},
                "opts": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}},
            },
            "required": ["city"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
CODE = {
    "type": "function",
    "function": {
        "name": "code",
        "parameters": {"properties": {"x": {"type": "boolean"}, "y": {"type": "string", "pattern": "^[a-z]+$"}}},
    },
}
EXTRA = {
    "type": "function",
    "function": {
        "name": "extra",
        "parameters": {
            "properties": {"c": {"type": "string", "enum": ["ab", "abcdef"], "maxLength": 3}},
            "required": ["c", "n"],  # n: not among the properties, so additionalProperties says what it is
            "additionalProperties": {"type": "integer"},
        },
    },
}
TOOLS = [WEATHER, PING, CODE, EXTRA]


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tool_choice") / "tiny", arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def tok(tiny):
    return Tokenizer(tiny)


def matches(tok: Tokenizer, grammar: str, text: str) -> bool:
    """The grammar takes the text's tokens (as the tokenizer encodes it) and is then complete."""
    m = llg.LLMatcher(compiler_for(tok).tokenizer, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


def grammar(tok: Tokenizer, tools=TOOLS, **kw) -> str:
    ids = {t: tok.token_to_id(t) for t in (dsv4.DSML, dsv4.END_THINK)}
    return dsml_tool_grammar(tools, ids=ids, json_layout=JSON_OPTIONS, **kw)


def test_the_grammar_takes_what_the_encoder_writes(tok):
    calls = [
        call("get_weather", city="Pa</ris\n", days=3, unit="f", opts={"a": [1, 2]}),
        call("ping"),
        call("code", x=True),
        call("code"),
        call("get_weather", city="Oslo ünï"),
        call("extra", c="ab", n=3),
        call("get_weather", city="x", opts={"a": [1], "note": "a</b> ｜DSM", "more": {"k": ["｜"]}}),
    ]
    # llguidance reads the tokenizer as Tokenizer.backend has it, V4's added tokens included
    added = {t["content"] for t in json.loads(tok.backend.to_str())["added_tokens"]}
    assert {dsv4.DSML, dsv4.END_THINK} <= added
    g = grammar(tok)
    assert matches(tok, g, dsv4.dsml_tool_calls(calls))
    for c in calls:
        assert matches(tok, g, dsv4.dsml_tool_calls([c]))
    # a pattern-bound string is a JSON string (string="false"), which the parser decodes as one
    y = dsv4.dsml_tool_calls([call("code", y="abc")]).replace('string="true">abc<', 'string="false">"abc"<')
    assert matches(tok, g, y)
    thinking = grammar(tok, thinking=True)
    assert matches(tok, thinking, "First think.\n" + dsv4.END_THINK + dsv4.dsml_tool_calls(calls[:2]))
    assert not matches(tok, thinking, dsv4.dsml_tool_calls(calls[:2]))  # thinking mode: </think> first


@pytest.mark.parametrize(
    "calls, kw",
    [
        ([call("get_weather", days=3)], {}),  # a required parameter missing
        ([call("get_weather", city="x", dayz=3)], {}),  # an unknown parameter
        ([call("get_weather", city="x", days=0)], {}),  # out of the schema's range
        ([call("get_weather", city="x" * 21)], {}),  # longer than maxLength
        ([call("get_weather", city="x", unit="k")], {}),  # not in the enum
        ([call("get_weather", city="a｜DSML｜b")], {}),  # markup inside a raw value
        # markup inside a string="false" value's strings (values and keys, at any depth)
        ([call("get_weather", city="x", opts={"a": [1], "note": "</｜DSML｜parameter>"})], {}),
        ([call("get_weather", city="x", opts={"more": [{"k": "x</｜DSML｜invoke>"}]})], {}),
        ([call("get_weather", city="x", opts={"</｜DSML｜invoke>": 1})], {}),
        ([call("other")], {}),
        ([call("extra", c="abcdef", n=3)], {}),  # an enum value longer than maxLength
        ([call("extra", c="ab", n="3")], {}),  # an extra parameter against additionalProperties
        ([call("ping"), call("ping")], {"name": "ping"}),  # a named function: one call
        ([call("code")], {"name": "ping"}),
        ([call("ping"), call("ping")], {"single": True}),  # parallel_tool_calls false
    ],
)
def test_the_grammar_refuses_calls_out_of_the_schema(tok, calls, kw):
    assert not matches(tok, grammar(tok, **kw), dsv4.dsml_tool_calls(calls))


@pytest.mark.parametrize(
    "params, words",
    [
        ({"type": "array"}, "type 'object'"),
        ({"anyOf": [{"type": "object"}]}, "anyOf"),
        ({"properties": {'a"b': {}}}, "parameter name"),
        ({"properties": {"a": False}, "required": ["a"]}, "allows no value"),
        ({"properties": {}, "required": ["a"], "additionalProperties": False}, "allows no value"),
    ],
)
def test_parameters_the_dsml_form_cannot_express(tok, params, words):
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(ToolGrammarError, match=words):
        grammar(tok, [tool])


@pytest.fixture(scope="module")
def validator(tiny, tok):
    v = RequestValidator(tok, "tiny", json.load(open(tiny / "config.json"))["vocab_size"])
    v.tool_parser = "deepseek_v4"
    return v


def prepare(validator: RequestValidator, **body):
    return validator.chat(ChatCompletionRequest.model_validate({"messages": USER, **body}), 4096)


def refusal(validator: RequestValidator, **body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        prepare(validator, **body)
    assert e.value.status == 400
    return e.value


def test_request_rules(validator, tok):
    prep = prepare(validator, tools=TOOLS, tool_choice="required")
    assert prep.tool_choice == "required" and prep.params[0].structured_outputs.grammar == grammar(tok)
    named = {"type": "function", "function": {"name": "ping"}}
    prep = prepare(validator, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    assert prep.params[0].structured_outputs.grammar == grammar(tok, name="ping")
    prep = prepare(validator, tools=TOOLS, tool_choice="required", thinking={"type": "enabled"})
    assert prep.thinking and prep.params[0].structured_outputs.grammar == grammar(tok, thinking=True)
    assert prep.params[0].structured_outputs.start_after_token_id is None  # the reasoning is in the grammar
    assert prepare(validator, tools=TOOLS, tool_choice="none", parallel_tool_calls=False).tool_choice == "none"
    e = refusal(validator, tools=TOOLS, tool_choice={**named, "function": {"name": "x"}})
    assert e.param == "tool_choice" and "not among the tools" in e.message
    assert refusal(validator, tools=TOOLS, parallel_tool_calls=False).param == "parallel_tool_calls"
    fmt = {"type": "json_object"}
    assert refusal(validator, tools=TOOLS, tool_choice="required", response_format=fmt).param == "response_format"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "foo"}}}}}
    e = refusal(validator, tools=[bad], tool_choice="required")
    assert e.param == "tools" and "foo" in e.message
    e = refusal(validator, tools=[{"type": "function", "function": {"name": "f", "parameters": {"oneOf": []}}}],
                tool_choice="required")  # fmt: skip
    assert e.param == "tools" and "oneOf" in e.message


def test_no_tool_parser_keeps_its_400(validator):
    validator.tool_parser = None
    try:
        e = refusal(validator, tools=TOOLS, tool_choice="required")
        assert e.param == "tool_choice" and "deepseek_v4" in e.message and "none" in e.message
    finally:
        validator.tool_parser = "deepseek_v4"


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), dtype="float32", kv_block_size=16, num_kv_blocks=16384, max_num_seqs=64)


def answers(llm, validator, bodies: list[dict]) -> list[tuple]:
    """(finish_reason, reasoning, content, calls, failures) of each chat request's answer, read by
    the deepseek_v4 parsers from the generated tokens' text (special tokens kept, as the router asks)."""
    preps = [prepare(validator, **b) for b in bodies]
    params = [p.params[0].model_copy(update={"skip_special_tokens": False}) for p in preps]
    outs = llm.generate([{"prompt_token_ids": p.prompts[0]} for p in preps], params)
    got = []
    for prep, out in zip(preps, outs):
        o = out.outputs[0]
        ids = o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids  # the EOS
        parser = OutputSpec("deepseek_v4", "deepseek_v4", tool_names(prep.tools), prep.thinking).parser()
        parts = [parser.feed(llm.get_tokenizer().decode(ids, skip_special_tokens=False)), parser.finish()]
        calls = [(c.name, c.arguments) for p in parts for c in p.calls]
        reasoning, content = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
        got.append((o.finish_reason, reasoning, content, calls, parser.failures))
    return got


N_SETS = 30


@pytest.mark.slow  # thirty prompts of ~2,600 tokens: ~25 s on CPU
def test_required_always_yields_valid_calls(llm, validator):
    sets = random_tool_sets(N_SETS, seed=28)
    bodies = [dict(tools=t, tool_choice="required", temperature=1.0, seed=i) for i, t in enumerate(sets)]
    several = 0
    for (finish, reasoning, content, calls, failures), tools in zip(answers(llm, validator, bodies), sets):
        assert finish == "stop" and calls and not failures and content == "" and reasoning == ""
        for name, arguments in calls:
            assert_valid_call(name, arguments, tools)
        several += len(calls) > 1
    assert several  # parallel calls happen


def test_a_named_function_and_a_single_call(llm, validator):
    sets = random_tool_sets(16, seed=7)
    bodies = [
        dict(tools=t, tool_choice={"type": "function", "function": {"name": t[-1]["function"]["name"]}}, seed=i)
        for i, t in enumerate(sets[:8])
    ] + [dict(tools=t, tool_choice="required", parallel_tool_calls=False, seed=i) for i, t in enumerate(sets[8:])]
    for body in bodies:
        body.update(temperature=1.0)
    for (finish, _, content, calls, failures), body in zip(answers(llm, validator, bodies), bodies):
        assert finish == "stop" and len(calls) == 1 and not failures and content == ""
        assert_valid_call(*calls[0], body["tools"])
        if isinstance(body["tool_choice"], dict):
            assert calls[0][0] == body["tool_choice"]["function"]["name"]


@pytest.mark.slow  # a thousand decode steps: random weights reason long
def test_thinking_mode_reasons_first_then_calls(llm, validator):
    """Random weights write </think> rarely (about one token in a thousand), so some answers run
    out of tokens while reasoning or calling: those hold reasoning (and the calls that closed)
    only; every other one is reasoning, then valid calls: never an answer that ends (EOS) or calls
    before </think>."""
    sets = random_tool_sets(8, seed=5)
    bodies = [
        dict(tools=t, tool_choice="required", thinking={"type": "enabled"}, temperature=1.0, seed=i, max_tokens=1100)
        for i, t in enumerate(sets)
    ]
    called = []
    for (finish, reasoning, content, calls, failures), tools in zip(answers(llm, validator, bodies), sets):
        assert content == "" and dsv4.END_THINK not in reasoning
        for name, arguments in calls:
            assert_valid_call(name, arguments, tools)
        if finish == "length":
            assert set(failures) <= {"unclosed_call", "unclosed_block"}
            continue
        assert finish == "stop" and calls and not failures
        called.append(reasoning)
    assert len(called) >= 2 and any(called)


def test_v32_function_calls_block(tok, validator):
    """deepseek_v32's calls: the same invokes in a <DSML function_calls> block."""
    calls = [call("get_weather", city="x", days=2), call("ping")]
    text = dsv4.dsml_tool_calls(calls).replace("tool_calls>", "function_calls>")
    g = grammar(tok, block="function_calls")
    assert matches(tok, g, text) and not matches(tok, grammar(tok), text)
    parser = OutputSpec(None, "deepseek_v32", tool_names(TOOLS)).parser()
    parts = [parser.feed(text), parser.finish()]
    assert [c.name for p in parts for c in p.calls] == ["get_weather", "ping"] and not parser.failures
    validator.tool_parser = "deepseek_v32"
    try:
        assert prepare(validator, tools=TOOLS, tool_choice="required").params[0].structured_outputs.grammar == g
    finally:
        validator.tool_parser = "deepseek_v4"
