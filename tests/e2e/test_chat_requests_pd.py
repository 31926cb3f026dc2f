"""DeepSeek-V4's chat protocol through a real PD cluster (tiny V4, prefill + decode, NIXL): the
official openai client sends tools, a tool-call and tool-result history and thinking on, and gets a
200 whose prompt is exactly what /tokenize shows for the same messages."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                "required": ["city"],
            },
        },
    }
]
CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bergen", "days": 2}'}},
]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_2", "content": "Bergen: rain, 6°C"},
    {"role": "tool", "tool_call_id": "call_1", "content": "Oslo: snow, -3°C"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chat_v4") / "tiny", arch="deepseek_v4", seed=0)


def test_tools_history_and_thinking_through_pd(tiny, tmp_path):
    with Cluster(tiny, tmp_path / "logs", kv_blocks=128) as c:
        prefill = c.worker("prefill", "--kv-block-size", "16")
        decode = c.worker("decode", "--kv-block-size", "16", peers=[prefill])
        router = c.router(prefill=[prefill], decode=[decode])
        c.wait_healthy()
        client = openai.OpenAI(api_key="none", base_url=f"{router.url}/v1", max_retries=0)
        resp = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=8,
            temperature=0,
            extra_body={"thinking": {"type": "enabled"}, "ignore_eos": True},
        )
        assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")
        shown = httpx.post(
            f"{router.url}/tokenize",
            json={"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"thinking": True}},
            timeout=30,
        ).json()
        assert resp.usage.prompt_tokens == shown["count"]
        prompt = httpx.post(f"{router.url}/detokenize", json={"tokens": shown["tokens"]}, timeout=30).json()["prompt"]
        # the results in call order, the reasoning kept (tools are present), thinking mode at the end
        assert prompt.index("Oslo: snow") < prompt.index("Bergen: rain")
        assert "Two cities: two calls.</think>" in prompt and prompt.endswith("<｜Assistant｜><think>")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, extra_body={"thinking": {"type": "sometimes"}}
            )
        assert e.value.body["param"] == "thinking.type"
