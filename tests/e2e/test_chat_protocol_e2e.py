"""DeepSeek-V4's chat responses through a real PD cluster (prefill + decode over NIXL) and the
official `openai` client: reasoning_content in thinking mode, none in chat mode, requests with
tools, streamed deltas that the client assembles into the non-streamed message, reasoning tokens,
and the parser flags.

Random weights write no DSML of their own, so the router's reading is checked against the parser
run here on the very tokens the workers generated (`return_token_ids`); the tool-call paths
themselves are driven with scripted worker chunks in tests/unit/test_chat_responses.py."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from pdserve.chat.parsers import OutputSpec, tool_names
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from tests.helpers.cluster import Cluster

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MSGS = [{"role": "user", "content": "What is the weather in Paris today?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
THINKING = {"thinking": {"type": "enabled"}}
CHAT = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chat_e2e") / "tiny", arch="deepseek_v4", seed=0)


@pytest.fixture(scope="module")
def cluster(tiny, tmp_path_factory):
    with Cluster(tiny, tmp_path_factory.mktemp("chat_e2e_logs"), kv_blocks=128) as c:
        prefill = c.worker("prefill", "--kv-block-size", "16")
        decode = c.worker("decode", "--kv-block-size", "16", peers=[prefill])
        c.auto = c.router(prefill=[prefill], decode=[decode])
        c.off = c.router("--reasoning-parser", "none", "--tool-call-parser", "none", prefill=[prefill], decode=[decode])
        c.wait_healthy()
        yield c


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(router, extra: dict, stream: bool = False, **kw):
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    return client(router).chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=12, temperature=0, stream=stream, extra_body=body, **kw
    )


def read_here(tokenizer: Tokenizer, token_ids: list[int], thinking: bool, tools=None) -> tuple:
    """What the parser makes of the generated tokens' text (special tokens kept, as the router asks)."""
    names = tool_names(tools)
    spec = OutputSpec("deepseek_v4", "deepseek_v4" if names else None, names, thinking)
    p = spec.parser()
    outs = [p.feed(tokenizer.decode(token_ids, skip_special_tokens=False)), p.finish()]
    calls = [(t.name, t.arguments) for o in outs for t in o.calls]
    return "".join(o.reasoning for o in outs), "".join(o.content for o in outs), calls


def message_tuple(m) -> tuple:
    return (
        m.content or "",
        getattr(m, "reasoning_content", None),
        [(t.function.name, t.function.arguments) for t in m.tool_calls or []],
    )


@pytest.mark.parametrize("mode", ["thinking", "chat", "tools", "tools_none"])
def test_response_is_the_parse_of_the_generated_tokens(cluster, tiny, mode):
    extra, kw = (THINKING, {}) if mode == "thinking" else (CHAT, {})
    if mode.startswith("tools"):
        extra, kw = THINKING, {"tools": TOOLS, "tool_choice": "none" if mode == "tools_none" else "auto"}
    resp = ask(cluster.auto, extra, **kw)
    choice = resp.choices[0]
    ids = choice.model_extra["token_ids"]
    thinking = mode != "chat"
    reasoning, content, calls = read_here(Tokenizer(tiny), ids, thinking, TOOLS if mode == "tools" else None)
    got_content, got_reasoning, got_calls = message_tuple(choice.message)
    assert (got_content, got_calls) == (content, calls)
    assert got_reasoning == (reasoning if thinking else None)
    assert "<think>" not in got_content and "</think>" not in got_content
    assert choice.finish_reason == ("tool_calls" if calls else "length")
    details = resp.usage.completion_tokens_details
    assert 0 <= details.reasoning_tokens <= resp.usage.completion_tokens == len(ids) == 12
    if thinking and "</think>" not in reasoning + content:
        assert details.reasoning_tokens == 12  # no end of reasoning written: every token reasoned

    # the same request streamed, as the client puts it together: the same message
    state = ChatCompletionStreamState(input_tools=kw.get("tools", []))
    for chunk in ask(cluster.auto, extra, stream=True, **kw):
        state.handle_chunk(chunk)
    final = state.current_completion_snapshot.choices[0]  # (the final-completion helper refuses "length")
    assert message_tuple(final.message) == (got_content, got_reasoning, got_calls)
    assert final.finish_reason == choice.finish_reason


def test_parsers_off_leave_the_text_whole(cluster, tiny):
    on = ask(cluster.auto, THINKING).choices[0]
    off = ask(cluster.off, THINKING).choices[0]
    assert off.model_extra["token_ids"] == on.model_extra["token_ids"]
    assert getattr(off.message, "reasoning_content", None) is None
    text = Tokenizer(tiny).decode(on.model_extra["token_ids"], skip_special_tokens=True)
    assert off.message.content == text


def test_streamed_chunks_are_openai_chunks(cluster):
    chunks = list(ask(cluster.auto, THINKING, stream=True, stream_options={"include_usage": True}))
    roles = [c.choices[0].delta.role for c in chunks if c.choices]
    assert roles[0] == "assistant" and roles.count("assistant") == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    assert json.loads(usage.model_dump_json())["completion_tokens_details"]["reasoning_tokens"] >= 0
