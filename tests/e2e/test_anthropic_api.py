"""Anthropic's Messages API against a real tiny PD cluster (DeepSeek-V4 with random weights,
prefill + decode over NIXL, a router with an API key), through the official `anthropic` client:
messages.create and messages.stream (every event type, parsed by the client), max_tokens and
stop_sequences as stop reasons, the prefix cache as cache_read_input_tokens, count_tokens, forced
tool use whose input validates against its input_schema, a thinking block cut by its budget, the
key in x-api-key, and errors as the client's typed exceptions."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers.cluster import wait_blocks_free
from tests.helpers.router_apis import v4_pd_cluster
from tests.helpers.tools import random_tool_sets

pytestmark = pytest.mark.timeout(300)

KEY = "sk-pdserve-anthropic"
SYSTEM = "You are a terse assistant for a prefill-decode disaggregated serving system. " * 6  # > 4 KV blocks
ASK = [{"role": "user", "content": "Tell me about prefill and decode."}]
GREEDY = {"temperature": 0.0}  # not among this client's arguments: the router takes Anthropic's field


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with v4_pd_cluster(tmp_path_factory.mktemp("anthropic_api"), KEY) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return anthropic.Anthropic(base_url=cluster.main.url, api_key=KEY, max_retries=0, timeout=120)


def test_create_and_stream(cluster, client):
    """The same greedy request whole and streamed; the stream's second pass finds the prompt cached."""
    kw = dict(model="tiny", max_tokens=8, system=SYSTEM, messages=ASK, thinking={"type": "disabled"})
    m = client.messages.create(**kw, extra_body=GREEDY)
    assert m.id.startswith("msg_") and (m.type, m.role, m.model) == ("message", "assistant", "tiny")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert (m.stop_reason, m.stop_sequence, m.usage.output_tokens) == ("max_tokens", None, 8)
    prompt = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=ASK, thinking={"type": "disabled"})
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt.input_tokens
    assert m.usage.cache_creation_input_tokens == 0

    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_message()
    assert {"message_start", "content_block_start", "content_block_delta", "content_block_stop"} <= kinds
    assert {"message_delta", "message_stop", "text"} <= kinds  # "text": the client's own, from text_delta
    assert final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens >= 4 * 16  # the system prompt's blocks, from the first pass
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt.input_tokens


def test_stop_sequences(client):
    kw = dict(model="tiny", max_tokens=16, messages=ASK, thinking={"type": "disabled"}, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    with client.messages.stream(**kw, stop_sequences=[stop]) as stream:
        m = stream.get_final_message()
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in m.content) == text[: text.index(stop)]


def _tools(seed: int) -> list[dict]:
    """Random tool sets (tests/helpers/tools.py) in Anthropic's form (its names have no dots)."""
    return [
        {"name": t["function"]["name"].replace(".", "_"), "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in random_tool_sets(1, seed)[0]
    ]  # fmt: skip


def _valid(block, tools: list[dict]) -> None:
    schemas = {t["name"]: t["input_schema"] for t in tools}
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in schemas
    jsonschema.validate(block.input, schemas[block.name])


def test_forced_tool_use(cluster):
    """tool_choice any (whole and streamed) and a named tool: tool_use blocks whose input validates."""
    sets = [_tools(seed) for seed in (1, 6, 5)]  # each tool with required parameters but one of seed 5's
    named = "calc"  # of seed 5's: two required parameters
    ask = dict(model="tiny", max_tokens=2000, messages=[{"role": "user", "content": "What is the weather in Paris?"}])

    async def run():
        client = anthropic.AsyncAnthropic(base_url=cluster.main.url, api_key=KEY, max_retries=0, timeout=120)

        async def streamed():
            async with client.messages.stream(**ask, tools=sets[1], tool_choice={"type": "any"}) as stream:
                kinds = {e.type async for e in stream}
                return kinds, await stream.get_final_message()

        try:
            return await asyncio.gather(
                client.messages.create(**ask, tools=sets[0], tool_choice={"type": "any"}),
                streamed(),
                client.messages.create(**ask, tools=sets[2], tool_choice={"type": "tool", "name": named}),
            )
        finally:
            await client.close()

    whole, (kinds, streamed_message), one = asyncio.run(run())
    for m, tools in ((whole, sets[0]), (streamed_message, sets[1]), (one, sets[2])):
        assert m.stop_reason == "tool_use" and m.content
        for block in m.content:
            _valid(block, tools)
    assert "input_json" in kinds  # the client's event for input_json_delta
    assert [b.name for b in one.content] == [named] and set(one.content[0].input) >= {"items", "level"}
    assert not any(wait_blocks_free(cluster.workers).values())


def test_thinking_within_its_budget(client):
    """Thinking mode: a thinking block, its reasoning ended by budget_tokens (random weights would
    not write </think> of themselves in this many tokens), then the answer."""
    with client.messages.stream(
        model="tiny", max_tokens=20, messages=ASK, thinking={"type": "enabled", "budget_tokens": 6}, extra_body=GREEDY
    ) as stream:
        kinds = {e.type for e in stream}
        m = stream.get_final_message()
    assert "thinking" in kinds  # the client's event for thinking_delta
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking and m.content[0].signature == ""
    assert (m.stop_reason, m.usage.output_tokens) == ("max_tokens", 20)


def test_errors_are_the_clients_exceptions(cluster, client):
    for field, kw in (("service_tier", {"service_tier": "auto"}), ("foo", {"extra_body": {"foo": 1}})):
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(model="tiny", max_tokens=4, messages=ASK, **kw)
        assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"
        assert bad.value.body["error"]["message"].startswith(f"{field}: ")
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    stranger = anthropic.Anthropic(base_url=cluster.main.url, api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        stranger.messages.create(model="tiny", max_tokens=4, messages=ASK)
    assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"


def test_the_key_in_x_api_key(cluster):
    body = {"model": "tiny", "max_tokens": 3, "messages": ASK}
    headers = {"anthropic-version": "2023-06-01", "content-type": "application/json"}
    ok = httpx.post(f"{cluster.main.url}/v1/messages", json=body, headers={**headers, "x-api-key": KEY}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 3
    keyed = anthropic.Anthropic(base_url=cluster.main.url, default_headers={"X-Api-Key": KEY}, max_retries=0)
    assert keyed.messages.create(**body).usage.output_tokens == 3
    wrong = httpx.post(f"{cluster.main.url}/v1/messages", json=body, headers={**headers, "x-api-key": "no"}, timeout=60)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
