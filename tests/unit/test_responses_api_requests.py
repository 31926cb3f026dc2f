"""The request side of OpenAI's Responses API in the router, without workers: a Responses request
renders the prompt its chat-path equivalent renders and samples as it says (responses_api.py),
input items replayed from an earlier response, forced tools and structured outputs as the chat
path's grammars, and every refusal as OpenAI's error object naming the field (in-process app)."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.chat import dsv4
from pdserve.router.app import build_router_app
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.responses_api import prepare, settings
from pdserve.router.responses_api_protocol import ResponsesRequest
from pdserve.serve_config import RouterServeConfig
from pdserve.tiny_model import make_tiny_model
from tests.helpers.router_apis import CHAT_TOOL, SCHEMA, v4_validator

pytestmark = pytest.mark.timeout(120)
KEY = "sk-test"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("v4") / "m", arch="deepseek_v4"))


@pytest.fixture(scope="module")
def validator(model_dir):
    return v4_validator(model_dir)


def responses(validator, **body):
    req = ResponsesRequest.model_validate({"model": "tiny", "max_output_tokens": 16, "input": "hi", **body})
    return prepare(validator, req, 4096)[1]


def chat(validator, **body):
    return validator.chat(ChatCompletionRequest.model_validate({"model": "tiny", "max_tokens": 16, **body}), 4096)


def text_of(validator, prep) -> str:
    return validator.tokenizer.decode(prep.prompts[0], skip_special_tokens=False)


def _call(i: int, city: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}  # fmt: skip


def test_a_conversation_renders_as_its_chat_equivalent(validator):
    """instructions, parts, a replayed answer (reasoning, text and calls as the SDK sends output
    items back: one assistant turn), function_call_output items, a developer message."""
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo"}, {"type": "input_text", "text": " and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}], "status": "completed"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3°C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "no data"}]},
        {"type": "message", "role": "developer", "content": "Answer in one line."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    got = responses(validator, instructions="Be brief.", input=history, tools=[TOOL], reasoning={"effort": "high"})
    want = chat(
        validator,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [_call(1, "Oslo"), _call(2, "Rome")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3°C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "no data"},
            {"role": "developer", "content": "Answer in one line."},
            {"role": "user", "content": "Thanks"},
        ],
        tools=[CHAT_TOOL],
        reasoning_effort="high",
    )  # fmt: skip
    assert got.prompts == want.prompts and got.thinking and got.tools == want.tools
    text = text_of(validator, got)
    assert "<tool_result>no data</tool_result>" in text and "Use the tool." in text
    assert text.endswith(dsv4.ASSISTANT + dsv4.THINK)


def test_reasoning_summary_is_replayed_when_there_is_no_content(validator):
    item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Plan A."}, {"type": "summary_text", "text": "Plan B."}]}  # fmt: skip
    history = [*USER, item, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "More?"}]
    want = [*USER, {"role": "assistant", "content": "Done.", "reasoning_content": "Plan A.\n\nPlan B."}, history[-1]]
    tools = {"tools": [CHAT_TOOL]}  # with tools V4 keeps earlier turns' reasoning: the replay shows
    got = responses(validator, input=history, tools=[TOOL], reasoning={"effort": "high"})
    assert got.prompts == chat(validator, messages=want, reasoning_effort="high", **tools).prompts
    assert "Plan A.\n\nPlan B." in text_of(validator, got)


def test_a_string_input_is_one_user_message(validator):
    assert responses(validator).prompts == chat(validator, messages=USER).prompts
    assert responses(validator, input=USER).prompts == chat(validator, messages=USER).prompts


def test_sampling_and_limits(validator):
    p = responses(validator, temperature=0.5, top_p=0.9, max_output_tokens=7, user="u-1", metadata={"k": "v"})
    assert (p.params[0].temperature, p.params[0].top_p, p.params[0].max_tokens) == (0.5, 0.9, 7)
    defaults = responses(validator).params[0]
    assert (defaults.temperature, defaults.top_p, defaults.structured_outputs) == (1.0, 1.0, None)
    neutral = {
        "store": False,
        "background": False,
        "truncation": "disabled",
        "include": [],
        "previous_response_id": None,
    }
    assert responses(validator, **neutral).prompts == responses(validator).prompts


@pytest.mark.parametrize(
    "choice, parallel, forced, single",
    [
        ("auto", None, False, False),
        ("none", None, False, False),
        ("required", None, True, False),
        ("required", False, True, True),
        ({"type": "function", "name": "get_weather"}, None, True, True),  # a named function: one call of it
    ],
)
def test_tool_choice(validator, choice, parallel, forced, single):
    p = responses(validator, tools=[TOOL], tool_choice=choice, parallel_tool_calls=parallel)
    grammar = p.params[0].structured_outputs.grammar if p.params[0].structured_outputs else None
    assert (grammar is not None) is forced
    if forced:
        assert ('calls: call ("\\n" call)*' not in grammar) is single
    assert p.tool_choice == (choice if choice in ("auto", "none") else "required")
    assert responses(validator, tools=[TOOL]).prompts == p.prompts  # tool_choice changes no prompt
    if choice in ("auto", "none"):  # without tools, what no tool_choice means
        assert responses(validator, tool_choice=choice).prompts == responses(validator).prompts


def test_text_format_is_the_chat_response_format(validator):
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    got = responses(validator, text={"format": fmt})
    want = chat(validator, messages=USER, response_format={"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}})  # fmt: skip
    assert got.prompts == want.prompts and got.params[0].structured_outputs.json_schema == SCHEMA
    assert responses(validator, text={"format": {"type": "json_object"}}).params[0].structured_outputs.json_object
    assert responses(validator, text={"format": {"type": "text"}}).params[0].structured_outputs is None


def test_reasoning_effort(validator):
    off, on = responses(validator, reasoning={"effort": "none"}), responses(validator, reasoning={"effort": "low"})
    assert text_of(validator, off) == dsv4.encode(USER, thinking=False) and not off.thinking
    assert text_of(validator, on) == dsv4.encode(USER, thinking=True) and on.thinking
    assert text_of(validator, responses(validator, reasoning={"effort": "minimal"})) == text_of(validator, on)
    top = responses(validator, reasoning={"effort": "max"})
    assert text_of(validator, top) == dsv4.encode(USER, thinking=True, reasoning_effort="max")
    assert text_of(validator, responses(validator)) == dsv4.encode(USER, thinking=False)  # the server default


def test_the_settings_echoed(validator):
    body = {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_object"}}, "temperature": 0.0, "metadata": {"a": "b"}}  # fmt: skip
    req = ResponsesRequest.model_validate(body)
    echo = settings(req, prepare(validator, ResponsesRequest.model_validate({**body, "text": None}), 4096)[1])
    assert echo["tool_choice"] == {"type": "function", "name": "get_weather"} and echo["tools"] == [TOOL]
    assert echo["text"] == {"format": {"type": "json_object"}} and echo["metadata"] == {"a": "b"}
    assert (echo["temperature"], echo["top_p"], echo["parallel_tool_calls"], echo["store"]) == (0.0, 1.0, True, False)


# -- the in-process app: OpenAI's error objects naming the field --


@pytest.fixture(scope="module")
def app(model_dir):
    config = RouterServeConfig(
        role="router", model=model_dir, served_model_name="tiny", router={"max_model_len": 1024, "api_key": KEY, "health_interval": 60},
        prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
    )  # fmt: skip
    return build_router_app(config)


async def post(app, body, headers=None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}"} if headers is None else headers
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        return await c.post("/v1/responses", headers=headers, json=body, **kw)


def openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


OK = {"model": "tiny", "max_output_tokens": 4, "input": "hi"}
WEATHER = {"tools": [TOOL]}
ANSWER = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}]
REFUSED = [
    # (what, body change, the param named)
    ("previous_response_id", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("store: true", {"store": True}, "store"),
    ("background: true", {"background": True}, "background"),
    ("truncation auto", {"truncation": "auto"}, "truncation"),
    ("include", {"include": ["reasoning.encrypted_content"]}, "include"),
    ("an unknown field", {"prompt_cache_key": "k"}, "prompt_cache_key"),
    ("service_tier", {"service_tier": "auto"}, "service_tier"),
    ("a typo", {"max_tokens": 3}, "max_tokens"),
    ("no input", {"input": None}, "input"),
    ("empty input", {"input": []}, "input"),
    ("reasoning.summary", {"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ("effort extreme", {"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("text.verbosity", {"text": {"verbosity": "low"}}, "text.verbosity"),
    ("a json_schema without a schema", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ("an image part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ("an item_reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ("encrypted reasoning", {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, *USER]}, "input.0.encrypted_content"),
    ("an output without its call", {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input.0.call_id"),
    ("a final answer item", {"input": [*USER, *ANSWER]}, "input"),
    ("a final assistant message", {"input": [*USER, {"role": "assistant", "content": "The answer is"}]}, "input"),
    ("a web_search tool", {"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("a tool name with a space", {"tools": [{**TOOL, "name": "get weather"}]}, "tools.0.name"),
    ("allowed_tools", {**WEATHER, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ("a forced tool without tools", {"tool_choice": "required"}, "tool_choice"),
    ("a named tool that is not there", {**WEATHER, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("one call with auto", {**WEATHER, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ("a forced tool with a format", {**WEATHER, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ("temperature 3", {"temperature": 3}, "temperature"),
    ("17 metadata pairs", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("past the context", {"max_output_tokens": 2000}, "max_output_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("what, change, param", REFUSED, ids=[r[0] for r in REFUSED])
async def test_refusals_are_openai_errors_naming_the_field(app, what, change, param):
    body = {k: v for k, v in {**OK, **change}.items() if v is not None}
    err = openai_error(await post(app, body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "messages" not in err["message"] and ("max_tokens" not in err["message"]) == (param != "max_tokens"), err


async def test_statuses(app):
    assert openai_error(await post(app, OK, headers={}), 401)["type"] == "authentication_error"
    assert openai_error(await post(app, {**OK, "model": "gpt-5"}), 404)["code"] == "model_not_found"
    resp = await post(app, OK)  # valid, but no worker is healthy: OpenAI's 503, not Anthropic's 529
    assert openai_error(resp, 503)["code"] == "no_healthy_workers" and resp.headers["retry-after"]


async def test_the_schema_documents_the_route(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        paths = (await c.get("/openapi.json", headers={"authorization": f"Bearer {KEY}"})).json()["paths"]
    responses_ = paths["/v1/responses"]["post"]["responses"]
    assert {"200", "400", "401", "404", "503"} <= set(responses_)
    assert "text/event-stream" in responses_["200"]["content"]
