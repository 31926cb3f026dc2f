"""The request side of Anthropic's Messages API in the router, without workers: a Messages request
renders the prompt its chat-path equivalent renders and samples as it says (messages.py), a
thinking budget is a grammar that ends the reasoning, count_tokens, and every refusal as an
Anthropic error object naming the field, with Anthropic's status (in-process app)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from pdserve.chat import dsv4
from pdserve.router.app import build_router_app
from pdserve.router.messages import budget_grammar, count_tokens, prepare
from pdserve.router.messages_protocol import CountTokensRequest, MessagesRequest
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.sampling_params import StructuredOutputsParams
from pdserve.serve_config import RouterServeConfig
from pdserve.structured.compiler import compiler_for
from pdserve.tiny_model import make_tiny_model
from tests.helpers.router_apis import CHAT_TOOL, SCHEMA, v4_validator

pytestmark = pytest.mark.timeout(120)
KEY = "sk-test"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_weather", "description": "Weather for a city", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("v4") / "m", arch="deepseek_v4"))


@pytest.fixture(scope="module")
def validator(model_dir):
    return v4_validator(model_dir)


def messages(validator, **body):
    req = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 16, "messages": USER, **body})
    return prepare(validator, req, 4096)[1]


def chat(validator, **body):
    return validator.chat(ChatCompletionRequest.model_validate({"model": "tiny", "max_tokens": 16, **body}), 4096)


def text_of(validator, prep) -> str:
    return validator.tokenizer.decode(prep.prompts[0], skip_special_tokens=False)


def _call(i: int, city: str) -> dict:
    arguments = json.dumps({"city": city})
    return {"id": f"toolu_{i}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


CALLS = [_call(1, "Oslo"), _call(2, "Rome")]


def test_a_conversation_renders_as_its_chat_equivalent(validator):
    """System blocks, text blocks, thinking / text / tool_use replayed, tool results (one an error)."""
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo"}, {"type": "text", "text": " and Rome?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3°C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no data"}], "is_error": True},
            {"type": "text", "text": "Thanks"},
        ]},
    ]  # fmt: skip
    system = [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}]
    got = messages(validator, system=system, messages=history, tools=[TOOL], thinking={"type": "enabled"})
    want = chat(
        validator,
        messages=[
            {"role": "system", "content": "Be brief. Use tools."},
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "-3°C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
            {"role": "user", "content": "Thanks"},
        ],
        tools=[CHAT_TOOL],
        thinking={"type": "enabled"},
    )
    assert got.prompts == want.prompts and got.thinking and got.tools == want.tools
    text = text_of(validator, got)
    assert "<tool_result>Error: no data</tool_result>" in text and "Use the tool." in text
    assert text.endswith(dsv4.ASSISTANT + dsv4.THINK)


def test_sampling_and_limits(validator):
    p = messages(validator, stop_sequences=["END", "\n\n"], temperature=0.5, top_p=0.9, top_k=20, max_tokens=7)
    params = p.params[0]
    assert (params.stop, params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        ["END", "\n\n"], 0.5, 0.9, 20, 7,
    )  # fmt: skip
    defaults = messages(validator).params[0]
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.structured_outputs) == (1.0, 1.0, -1, None)
    assert messages(validator, metadata={"user_id": "u-1"}).prompts == messages(validator).prompts


@pytest.mark.parametrize(
    "choice, forced, single",
    [
        ({"type": "auto"}, False, False),
        ({"type": "none"}, False, False),
        ({"type": "any"}, True, False),
        ({"type": "any", "disable_parallel_tool_use": True}, True, True),
        ({"type": "tool", "name": "get_weather"}, True, True),  # a named tool: one call of it
    ],
)
def test_tool_choice(validator, choice, forced, single):
    p = messages(validator, tools=[TOOL], tool_choice=choice)
    grammar = p.params[0].structured_outputs.grammar if p.params[0].structured_outputs else None
    assert (grammar is not None) is forced
    if forced:
        assert ('calls: call ("\\n" call)*' not in grammar) is single
    assert p.tool_choice == {"auto": "auto", "none": "none"}.get(choice["type"], "required")
    assert messages(validator, tools=[TOOL]).prompts == p.prompts  # tool_choice changes no prompt


def test_thinking_controls(validator):
    on, off = messages(validator, thinking={"type": "enabled"}), messages(validator, thinking={"type": "disabled"})
    assert text_of(validator, on) == dsv4.encode(USER, thinking=True) and on.thinking
    assert text_of(validator, off) == dsv4.encode(USER, thinking=False) and not off.thinking
    assert on.params[0].structured_outputs is None  # no budget: nothing constrains the reasoning
    effort = messages(validator, thinking={"type": "enabled"}, output_config={"effort": "max"})
    assert text_of(validator, effort) == dsv4.encode(USER, thinking=True, reasoning_effort="max")
    budget = messages(validator, thinking={"type": "enabled", "budget_tokens": 9})
    end = validator.tokenizer.token_to_id(dsv4.END_THINK)
    assert budget.params[0].structured_outputs.grammar == budget_grammar(end, 9)
    unbound = messages(validator, thinking={"type": "enabled", "budget_tokens": 16}, max_tokens=16)
    assert unbound.params[0].structured_outputs is None  # a budget at max_tokens never binds


def test_the_budget_ends_the_reasoning(validator):
    """After `budget` tokens of reasoning only </think> (or EOS) is allowed, in the token mask the
    sampler applies; then the answer is free."""
    tok = validator.tokenizer
    end, eos = tok.token_to_id(dsv4.END_THINK), tok.eos_token_id
    words = tok.encode("the reasoning goes on and on and on and on", add_special_tokens=False)
    assert len(words) > 6
    m = compiler_for(tok).compile(StructuredOutputsParams(grammar=budget_grammar(end, 5))).matcher()

    def allowed() -> set[int]:
        mask = np.zeros((len(tok) + 31) // 32, dtype=np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    for t in words[:5]:
        assert {t, eos, end} <= allowed() and m.consume_token(t)  # EOS may end the reasoning early
    assert allowed() == {end, eos}
    assert m.consume_token(end)
    assert set(words) | {eos} <= allowed()
    assert all(m.consume_token(t) for t in words)


def test_count_tokens_is_the_prompt_length(validator):
    body = {"model": "tiny", "messages": USER, "tools": [TOOL], "system": "Be brief.", "thinking": {"type": "enabled"}}
    counted = count_tokens(validator, CountTokensRequest.model_validate(body)).input_tokens
    assert counted == len(messages(validator, **{k: v for k, v in body.items() if k != "model"}).prompts[0])


# -- the in-process app: Anthropic's error objects --


@pytest.fixture(scope="module")
def app(model_dir):
    config = RouterServeConfig(
        role="router", model=model_dir, served_model_name="tiny", router={"max_model_len": 256, "api_key": KEY, "health_interval": 60},
        prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
    )  # fmt: skip
    return build_router_app(config)


async def post(app, body, headers=None, path="/v1/messages", **kw) -> httpx.Response:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"} if headers is None else headers
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        if body is not None:
            kw["json"] = body
        return await c.post(path, headers=headers, **kw)


def anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}, body
    return body["error"]["message"]


OK = {"model": "tiny", "max_tokens": 4, "messages": USER}
WEATHER = {"tools": [TOOL]}
REFUSED = [
    # (what, body, the message names)
    ("an unknown field", {"service_tier": "auto"}, "service_tier"),
    ("container", {"container": "c"}, "container"),
    ("a typo", {"max_token": 3}, "max_token"),
    ("missing max_tokens", {"max_tokens": None}, "max_tokens"),
    ("max_tokens 0 (cache pre-warming)", {"max_tokens": 0}, "max_tokens"),
    ("temperature past 1", {"temperature": 1.5}, "temperature"),
    ("top_k 0", {"top_k": 0}, "top_k"),
    ("a string for a number", {"max_tokens": "4"}, "max_tokens"),
    ("metadata beyond user_id", {"metadata": {"user_id": "u", "tier": "x"}}, "metadata.tier"),
    ("output_config.format", {"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ("adaptive thinking", {"thinking": {"type": "adaptive"}}, "thinking.type"),
    ("a budget with thinking off", {"thinking": {"type": "disabled", "budget_tokens": 2000}}, "budget_tokens"),
    ("an image block", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ("redacted thinking", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}, {"role": "user", "content": "b"}]}, "messages.1.content.0"),
    ("citations on a text block", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": []}]}]}, "citations"),
    ("a cache ttl", {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}, "ttl"),
    ("a tool_use block from the user", {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "assistant message"),
    ("a final assistant turn (prefill)", {"messages": [*USER, {"role": "assistant", "content": "The answer is"}]}, "messages"),
    ("a system role in messages", {"messages": [{"role": "system", "content": "s"}]}, "messages.0.role"),
    ("a server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ("a tool's strict flag", {"tools": [{**TOOL, "strict": True}]}, "tools.0.strict"),
    ("a schema that is not an object", {"tools": [{**TOOL, "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ("a tool name with a dot", {"tools": [{**TOOL, "name": "get.weather"}]}, "tools.0.name"),
    ("one call with auto", {**WEATHER, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "disable_parallel_tool_use"),
    ("a named tool that is not there", {**WEATHER, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ("a forced tool without tools", {"tool_choice": {"type": "any"}}, "tool_choice"),
    ("a forced tool with a budget", {**WEATHER, "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 50}}, "budget_tokens"),
    ("effort with thinking off", {"thinking": {"type": "disabled"}, "output_config": {"effort": "max"}}, "output_config.effort"),
    ("an unknown effort", {"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ("past the context", {"max_tokens": 1000}, "maximum context length"),
]  # fmt: skip


@pytest.mark.parametrize("what, change, named", REFUSED, ids=[r[0] for r in REFUSED])
async def test_refusals_are_anthropic_errors_naming_the_field(app, what, change, named):
    body = {k: v for k, v in {**OK, **change}.items() if v is not None}
    assert named in anthropic_error(await post(app, body), 400, "invalid_request_error")


async def test_statuses_as_anthropic_uses_them(app):
    assert "API key" in anthropic_error(await post(app, OK, headers={}), 401, "authentication_error")
    assert "API key" in anthropic_error(await post(app, OK, {"x-api-key": "sk-wrong"}), 401, "authentication_error")
    anthropic_error(await post(app, OK, {"authorization": f"Bearer {KEY}x"}), 401, "authentication_error")
    assert "nope" in anthropic_error(await post(app, {**OK, "model": "nope"}), 404, "not_found_error")
    not_json = await post(app, None, {"x-api-key": KEY, "content-type": "application/json"}, content=b"{not json")
    anthropic_error(not_json, 400, "invalid_request_error")
    anthropic_error(await post(app, None, content=b"x" * (9 << 20)), 413, "request_too_large")
    anthropic_error(await post(app, OK, path="/v1/messages/batches"), 404, "not_found_error")
    # valid, with either header, but no worker is healthy: Anthropic's "overloaded", with Retry-After
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        resp = await post(app, OK, headers)
        assert "worker" in anthropic_error(resp, 529, "overloaded_error") and resp.headers["retry-after"]


async def test_the_key_in_x_api_key_opens_every_route(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        assert (await c.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200
        wrong = await c.get("/v1/models", headers={"x-api-key": "sk-wrong"})
        assert wrong.status_code == 401 and set(wrong.json()) == {"error"}  # OpenAI's shape off the Messages routes


async def test_count_tokens_route(app, validator):
    body = {"model": "tiny", "messages": USER, "system": "Be brief."}
    path = "/v1/messages/count_tokens"
    resp = await post(app, body, path=path)
    want = len(messages(validator, system="Be brief.").prompts[0])
    assert resp.status_code == 200 and resp.json() == {"input_tokens": want}
    refused = await post(app, {**body, "max_tokens": 3}, path=path)
    assert "max_tokens" in anthropic_error(refused, 400, "invalid_request_error")


async def test_the_schema_documents_the_routes(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        paths = (await c.get("/openapi.json", headers={"x-api-key": KEY})).json()["paths"]
    responses = paths["/v1/messages"]["post"]["responses"]
    assert {"200", "400", "401", "404", "529"} <= set(responses)
    assert "text/event-stream" in responses["200"]["content"]
    assert "/v1/messages/count_tokens" in paths
