"""OpenAI's Responses API against a real tiny PD cluster (DeepSeek-V4 with random weights, prefill +
decode over NIXL, a router with an API key), through the official `openai` client:
responses.create (text, instructions, max_output_tokens as incomplete) and responses.stream (every
event parsed by the client; the final response equals the non-streamed one, greedy), forced
function calls whose arguments validate, a follow-up turn with function_call and
function_call_output items (the prefix cache serving the first turn's prompt), text.format
json_schema, reasoning through reasoning.effort, and errors as the client's exceptions."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import openai
import pytest

from tests.helpers.cluster import wait_blocks_free
from tests.helpers.router_apis import v4_pd_cluster
from tests.helpers.schemas import random_schema
from tests.helpers.tools import random_tool_sets

pytestmark = pytest.mark.timeout(300)

KEY = "sk-pdserve-responses"
ASK = "Tell me about prefill and decode."
GREEDY = {"model": "tiny", "temperature": 0.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with v4_pd_cluster(tmp_path_factory.mktemp("responses_api"), KEY) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.main.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _tools(seed: int) -> list[dict]:
    """Random tool sets (tests/helpers/tools.py) in the Responses API's form."""
    return [{"type": "function", **t["function"]} for t in random_tool_sets(1, seed)[0]]


def _valid_calls(r, tools: list[dict]) -> list:
    schemas = {t["name"]: t["parameters"] for t in tools}
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    return calls


def _same(a, b) -> None:
    """Two responses alike but for their ids, times, what the prefix cache served, and the parsed
    text responses.stream adds."""
    drop = {
        "id": True,
        "created_at": True,
        "output": {"__all__": {"id": True, "content": {"__all__": {"parsed"}}}},
        "usage": {"input_tokens_details": {"cached_tokens"}},
    }
    assert a.model_dump(exclude=drop) == b.model_dump(exclude=drop)


def test_create_text_instructions_and_the_length_limit(client):
    r = client.responses.create(input=ASK, max_output_tokens=8, **GREEDY)
    assert r.id.startswith("resp_") and (r.object, r.model, r.store) == ("response", "tiny", False)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert [i.type for i in r.output] == ["message"] and r.output[0].status == "incomplete" and r.output_text
    assert (r.usage.output_tokens, r.usage.output_tokens_details.reasoning_tokens) == (8, 0)
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    told = client.responses.create(input=ASK, instructions="Answer in French. " * 8, max_output_tokens=8, **GREEDY)
    assert told.instructions.startswith("Answer in French.") and told.usage.input_tokens > r.usage.input_tokens + 40
    assert told.output_text != r.output_text


def test_stream_equals_create(client):
    """Greedy, the same request whole and streamed: a text cut by the limit (the stream ends with
    response.incomplete) and a json_schema answer that completes (responses.stream's final response)."""
    raw = list(client.responses.create(input=ASK, max_output_tokens=8, stream=True, **GREEDY))
    assert raw[0].type == "response.created" and raw[-1].type == "response.incomplete"
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    _same(raw[-1].response, client.responses.create(input=ASK, max_output_tokens=8, **GREEDY))

    schema = random_schema(random.Random(3))
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    kw = dict(input="Describe the cluster as JSON.", text=fmt, max_output_tokens=300, **GREEDY)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert {"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed"} <= kinds  # fmt: skip
    _same(final, whole)
    assert whole.status == "completed" and whole.text.format.type == "json_schema"
    jsonschema.validate(json.loads(whole.output_text), schema)


def test_forced_function_calls_and_a_follow_up_turn(cluster, client):
    """tool_choice required (whole and streamed) and a named function: function_call items whose
    arguments validate; then the calls and their outputs sent back as input items."""
    sets = [_tools(seed) for seed in (1, 6, 5)]
    ask = dict(model="tiny", input="What is the weather in Paris?", max_output_tokens=2000)

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{cluster.main.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def streamed():
            async with aclient.responses.stream(**ask, tools=sets[1], tool_choice="required") as stream:
                kinds = {e.type async for e in stream}
                return kinds, await stream.get_final_response()

        try:
            return await asyncio.gather(
                aclient.responses.create(**ask, tools=sets[0], tool_choice="required"),
                streamed(),
                aclient.responses.create(**ask, tools=sets[2], tool_choice={"type": "function", "name": "calc"}),
            )
        finally:
            await aclient.close()

    first, (kinds, streamed_response), named = asyncio.run(run())
    calls = _valid_calls(first, sets[0])
    _valid_calls(streamed_response, sets[1])
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= kinds
    assert [c.name for c in _valid_calls(named, sets[2])] == ["calc"]

    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": f"result {i}"} for i, c in enumerate(calls)]  # fmt: skip
    follow = [{"role": "user", "content": ask["input"]}, *first.output, *outputs]
    r = client.responses.create(input=follow, tools=sets[0], max_output_tokens=8, **GREEDY)
    assert r.status == "incomplete" and r.output and r.usage.output_tokens == 8
    assert r.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens // 2
    assert r.usage.input_tokens_details.cached_tokens >= 16  # the first turn's prompt, served by the prefix cache
    assert not any(wait_blocks_free(cluster.workers).values())


def test_reasoning_effort_gives_a_reasoning_item(client):
    """Thinking mode: random weights write no </think> in this many tokens, so the answer is all reasoning."""
    kw = dict(input=ASK, reasoning={"effort": "high"}, max_output_tokens=6, **GREEDY)
    r = client.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning"] and r.reasoning.effort == "high"
    item = r.output[0]
    assert item.summary == [] and item.content[0].type == "reasoning_text" and item.content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == 6 and r.status == "incomplete"
    kinds = [e.type for e in client.responses.create(**kw, stream=True)]
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= set(kinds)
    off = client.responses.create(**{**kw, "reasoning": {"effort": "none"}})
    assert [i.type for i in off.output] == ["message"] and off.usage.input_tokens == r.usage.input_tokens


def test_errors_are_the_clients_exceptions(cluster, client):
    for field, kw in (
        ("previous_response_id", {"previous_response_id": "resp_123"}),
        ("store", {"store": True}),
        ("foo", {"extra_body": {"foo": 1}}),
        ("prompt_cache_key", {"prompt_cache_key": "k"}),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model="tiny", input=ASK, max_output_tokens=4, **kw)
        err = bad.value.body
        assert bad.value.status_code == 400 and (err["param"], err["type"]) == (field, "invalid_request_error")
        assert err["message"].startswith(f"{field}: ")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input=ASK)
    stranger = openai.OpenAI(base_url=f"{cluster.main.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        stranger.responses.create(model="tiny", input=ASK)
