"""tool_choice "required" and a named function in DeepSeek-V3's and V3.1's tool-call formats
through a served tiny V3 model (random weights; tests/helpers/v3_tools.py's chat templates and
tokenizer markers; a colocated worker behind the router) and the official openai client: every
answer is tool_calls (finish_reason "tool_calls") whose arguments validate against the tool's
schema (jsonschema), a named function is that function once, and a stream assembles (the
client's own stream state) into the non-streamed message."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.helpers.cluster import Cluster, wait_blocks_free
from tests.helpers.tools import ask_all, assert_valid_call, random_tool_sets
from tests.helpers.v3_tools import make_tiny_v3_tools

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v31"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny_v3_tools(root / "tiny", request.param)
    with Cluster(model, root / "logs", kv_blocks=2048, max_num_seqs=32) as c:
        c.both = c.worker("colocated", "--kv-block-size", "16")
        c.front = c.router(colocated=[c.both])
        c.wait_healthy()
        yield c


async def _ask(router, bodies: list[dict]) -> list:
    return await ask_all(router.url, bodies, MESSAGES, 16)


def test_forced_calls_parse_and_validate(served):
    sets = random_tool_sets(12, seed=33)
    required = [dict(tools=t, tool_choice="required", seed=i) for i, t in enumerate(sets[:8])]
    named = [
        dict(tools=t, tool_choice={"type": "function", "function": {"name": t[0]["function"]["name"]}}, seed=i)
        for i, t in enumerate(sets[8:])
    ]
    bodies = [{**b, "temperature": 1.0} for b in required + named]
    for choice, body in zip(asyncio.run(_ask(served.front, bodies)), bodies):
        m = choice.message
        assert choice.finish_reason == "tool_calls" and m.tool_calls and not m.content
        assert len({c.id for c in m.tool_calls}) == len(m.tool_calls)
        for c in m.tool_calls:
            assert c.type == "function"
            assert_valid_call(c.function.name, c.function.arguments, body["tools"])
        if isinstance(body["tool_choice"], dict):
            assert [c.function.name for c in m.tool_calls] == [body["tool_choice"]["function"]["name"]]
    assert not any(wait_blocks_free([served.both]).values())


def test_a_stream_assembles_into_the_message(served):
    sets = random_tool_sets(2, seed=12)
    bodies = [dict(tools=t, tool_choice="required", temperature=1.0, seed=i) for i, t in enumerate(sets)]
    whole = asyncio.run(_ask(served.front, bodies))

    async def streamed(body):
        client = openai.AsyncOpenAI(base_url=f"{served.front.url}/v1", api_key="unused", max_retries=0, timeout=600)
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
