"""tool_choice "required" and a named function through a real PD cluster (tiny DeepSeek-V4 with
random weights, prefill + decode over NIXL, the router) with the official openai client: 16 seeded
random tool sets with nested parameter schemas (tests/unit/test_tool_choice.py runs 50 through
the engine alone), and every answer is tool_calls whose arguments
validate (jsonschema); a named function is that function, once; thinking mode reasons first, then
calls; a stream assembles (the client's own stream state) into the non-streamed message."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, wait_blocks_free
from tests.helpers.tools import ask_all, assert_valid_call, random_tool_sets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_choice_e2e")
    model = make_tiny_model(root / "tiny", arch="deepseek_v4", seed=0)
    with Cluster(model, root / "logs", kv_blocks=4096, max_num_seqs=64) as c:
        prefill = c.worker("prefill", "--kv-block-size", "16")
        decode = c.worker("decode", "--kv-block-size", "16", peers=[prefill])
        c.pd_router = c.router(prefill=[prefill], decode=[decode])
        c.wait_healthy()
        c.workers = [prefill, decode]
        yield c


def _client(router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=600)


async def _ask(router, bodies: list[dict]) -> list:
    return await ask_all(router.url, bodies, MESSAGES, 32)


def test_required_always_yields_valid_calls(cluster):
    sets = random_tool_sets(16, seed=28)
    bodies = [dict(tools=t, tool_choice="required", temperature=1.0, seed=i) for i, t in enumerate(sets)]
    several = 0
    for choice, tools in zip(asyncio.run(_ask(cluster.pd_router, bodies)), sets):
        m = choice.message
        assert choice.finish_reason == "tool_calls" and m.tool_calls and not m.content
        assert len({c.id for c in m.tool_calls}) == len(m.tool_calls)
        for c in m.tool_calls:
            assert c.type == "function"
            assert_valid_call(c.function.name, c.function.arguments, tools)
        several += len(m.tool_calls) > 1
    assert several
    assert not any(wait_blocks_free(cluster.workers).values())


def test_named_function_single_call_and_thinking(cluster):
    sets = random_tool_sets(8, seed=9)
    named = [
        dict(tools=t, tool_choice={"type": "function", "function": {"name": t[0]["function"]["name"]}}, seed=i)
        for i, t in enumerate(sets[:4])
    ]
    single = [dict(tools=t, tool_choice="required", parallel_tool_calls=False, seed=i) for i, t in enumerate(sets[4:])]
    thinking = [
        dict(tools=t, tool_choice="required", seed=i, max_tokens=1100, extra_body={"thinking": {"type": "enabled"}})
        for i, t in enumerate(random_tool_sets(8, seed=5))
    ]  # random weights write </think> about once in a thousand tokens: about half of these call
    bodies = [{**b, "temperature": 1.0} for b in named + single + thinking]
    answers = asyncio.run(_ask(cluster.pd_router, bodies))
    for choice, body in zip(answers[:8], bodies[:8]):
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and len(calls) == 1 and not choice.message.content
        assert_valid_call(calls[0].function.name, calls[0].function.arguments, body["tools"])
        if isinstance(body["tool_choice"], dict):
            assert calls[0].function.name == body["tool_choice"]["function"]["name"]
    called = 0
    for choice, body in zip(answers[8:], bodies[8:]):
        m = choice.message
        assert not m.content and m.reasoning_content is not None
        for c in m.tool_calls or []:
            assert_valid_call(c.function.name, c.function.arguments, body["tools"])
        if choice.finish_reason == "tool_calls":
            called += 1
        else:  # out of tokens while reasoning or mid-call: never an answer without </think>
            assert choice.finish_reason == "length"
    assert called >= 2


def test_a_stream_assembles_into_the_message(cluster):
    tools = random_tool_sets(3, seed=11)
    bodies = [dict(tools=t, tool_choice="required", temperature=1.0, seed=i) for i, t in enumerate(tools)]
    whole = asyncio.run(_ask(cluster.pd_router, bodies))

    async def streamed(body):
        client = _client(cluster.pd_router)
        try:
            state = ChatCompletionStreamState()
            stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **body)
            async for chunk in stream:
                state.handle_chunk(chunk)
            return state.get_final_completion().choices[0]
        finally:
            await client.close()

    for body, want in zip(bodies, whole):
        got = asyncio.run(streamed(body))
        assert got.finish_reason == want.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in want.message.tool_calls
        ]


def test_a_call_cut_by_max_tokens_never_leaks_markup(cluster):
    """tool_choice "required" with random max_tokens, so the limit falls inside a call: the
    answer's content (whole, or assembled from the stream's deltas) never carries DSML, its calls
    are complete and valid, and finish_reason is "length" wherever the limit was hit."""
    tools = random_tool_sets(8, seed=45)
    bodies = [
        dict(tools=t, tool_choice="required", temperature=1.0, seed=i, max_tokens=3 + 5 * i)
        for i, t in enumerate(tools)
    ]
    whole = asyncio.run(_ask(cluster.pd_router, bodies))

    async def streamed(body) -> tuple[str, str | None]:
        client = _client(cluster.pd_router)
        try:
            content, reason = "", None
            stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **body)
            async for chunk in stream:
                for c in chunk.choices:
                    content += c.delta.content or ""
                    reason = c.finish_reason or reason
            return content, reason
        finally:
            await client.close()

    cut = 0
    for body, choice, t in zip(bodies, whole, tools):
        m = choice.message
        assert "DSML" not in (m.content or "") and "｜" not in (m.content or ""), m.content
        for c in m.tool_calls or []:
            assert_valid_call(c.function.name, c.function.arguments, t)
        cut += choice.finish_reason == "length"
        content, reason = asyncio.run(streamed(body))
        assert "DSML" not in content and "｜" not in content and reason == choice.finish_reason, (content, reason)
    assert cut  # some limits fell inside a call
    assert not any(wait_blocks_free(cluster.workers).values())
