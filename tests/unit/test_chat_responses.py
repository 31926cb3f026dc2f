"""The router's chat response path driven with scripted worker chunks (ChatFormatter, responses.py):
what a stream's deltas add up to, as the official `openai` client assembles them, is the
non-streamed message; reasoning_content, tool_calls, finish_reason "tool_calls" and reasoning
tokens; malformed markup ends in a finish with the text in content."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve.chat.parsers import OutputSpec
from pdserve.router.app import build_router_app
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.responses import DONE, ChatFormatter
from pdserve.sampling_params import SamplingParams
from pdserve.serve_config import RouterServeConfig
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.protocol import GenerateChunk
from tests.helpers.router_apis import worker_chunks
from tests.unit.test_chat_parsers import (
    BROKEN,
    DEEPSEEK_EXAMPLE,
    MALFORMED,
    TOOLS,
    completion,
    random_pieces,
    random_turn,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def formatter(tokenizer, output: OutputSpec | None, usage: bool = True) -> ChatFormatter:
    return ChatFormatter("chatcmpl-1", "m", tokenizer, [[0, 5]], None, False, usage, output=output)


def whole(fmt: ChatFormatter, cs: list[GenerateChunk]) -> dict:
    for c in cs:
        fmt.choices[0].add(c)
    return fmt.response()


def streamed(fmt: ChatFormatter, cs: list[GenerateChunk]) -> list[dict]:
    events = b"".join(e for c in cs if (e := fmt.chunk(0, c)) is not None) + fmt.usage_chunk() + DONE
    frames = events.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    return [json.loads(f.removeprefix(b"data: ")) for f in frames[:-2]]


def assembled(events: list[dict], tools: list[str]) -> ChatCompletion:
    """The stream as the openai client puts it together."""
    state = ChatCompletionStreamState(
        input_tools=[{"type": "function", "function": {"name": n, "parameters": {}}} for n in tools]
    )
    for e in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(e))
    return state.get_final_completion()


def v4(tools=TOOLS, thinking=True) -> OutputSpec:
    return OutputSpec("deepseek_v4", "deepseek_v4" if tools else None, frozenset(tools), thinking)


def message_of(m) -> tuple:
    calls = [(t.function.name, json.loads(t.function.arguments), t.id) for t in m.tool_calls or []]
    return m.content, getattr(m, "reasoning_content", None), calls


def test_deepseek_example_whole_and_streamed(tokenizer):
    body = whole(formatter(tokenizer, v4()), worker_chunks([DEEPSEEK_EXAMPLE]))
    resp = ChatCompletion.model_validate(body)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content.startswith("The user wants")
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"location": "Beijing", "unit": "celsius"},
    )
    assert resp.usage.completion_tokens_details.reasoning_tokens == 1

    events = streamed(formatter(tokenizer, v4()), worker_chunks(list(DEEPSEEK_EXAMPLE)))  # one character per chunk
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant" and sum("role" in d for d in deltas) == 1
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {
        "index": 0,
        "id": calls[0]["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all(c.keys() == {"index", "function"} and c["function"].keys() == {"arguments"} for c in calls[1:])
    assert len(calls) > 4 and "".join(c["function"]["arguments"] for c in calls) == call.function.arguments
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"
    usage = events[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == DEEPSEEK_EXAMPLE.index("</think>") + len(
        "</think>"
    )


@pytest.mark.parametrize("thinking", [True, False])
def test_stream_reassembles_to_the_whole_message(tokenizer, thinking):
    rng = random.Random(280 + thinking)
    for _ in range(40):
        text = completion(random_turn(rng), thinking)
        cs = worker_chunks([text])
        want = ChatCompletion.model_validate(whole(formatter(tokenizer, v4(thinking=thinking)), cs)).choices[0]
        for _ in range(3):
            pieces = random_pieces(rng, text)
            got = assembled(
                streamed(formatter(tokenizer, v4(thinking=thinking)), worker_chunks(pieces)), TOOLS
            ).choices[0]
            (wc, wr, wcalls), (gc, gr, gcalls) = message_of(want.message), message_of(got.message)
            assert (gc or None, gr or None) == (wc or None, wr or None)  # the client joins text pieces
            assert [c[:2] for c in gcalls] == [c[:2] for c in wcalls]
            assert got.finish_reason == want.finish_reason


@pytest.mark.parametrize("reason", list(MALFORMED))
def test_malformed_output_finishes_with_the_text_in_content(tokenizer, reason):
    text = "r</think>" + MALFORMED[reason]
    fmt = formatter(tokenizer, v4())
    events = streamed(fmt, worker_chunks(random_pieces(random.Random(1), text)))
    assert fmt.failures() == [reason]
    got = assembled(events, TOOLS).choices[0]
    assert (got.message.content, got.message.tool_calls, got.finish_reason) == (MALFORMED[reason], None, "stop")
    body = whole(formatter(tokenizer, v4()), worker_chunks([text]))
    assert body["choices"][0]["message"]["content"] == MALFORMED[reason]


def test_without_parsers_nothing_changes(tokenizer):
    fmt = formatter(tokenizer, OutputSpec(None, None))
    assert fmt.output is None
    params = SamplingParams(max_tokens=4)
    assert fmt.worker_params(params) is params
    body = whole(fmt, worker_chunks(["<think>a</think>b"]))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<think>a</think>b"}
    assert "completion_tokens_details" not in body["usage"]
    fmt = formatter(tokenizer, v4())
    assert fmt.worker_params(params).skip_special_tokens is False  # the markup may be special tokens


def test_length_cut_keeps_length_and_parsed_calls(tokenizer):
    cut = DEEPSEEK_EXAMPLE[: -len(f"</{'｜DSML｜'}tool_calls>")]
    body = whole(formatter(tokenizer, v4()), worker_chunks([cut], finish="length"))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1
    assert "incomplete_tool_calls" not in choice["message"]


def _streamed_calls(events: list[dict]) -> dict[int, list]:
    """index -> [id, name, the arguments' pieces joined], from a stream's tool_calls deltas."""
    calls: dict[int, list] = {}
    for e in events:
        for c in (e["choices"][0]["delta"].get("tool_calls") or []) if e["choices"] else []:
            if "id" in c:
                calls[c["index"]] = [c["id"], c["function"]["name"], c["function"]["arguments"]]
            else:
                calls[c["index"]][2] += c["function"]["arguments"]
    return calls


@pytest.mark.parametrize("end", ["cut", "broken"])
def test_an_incomplete_call_streams_its_arguments_and_the_whole_message_names_it(tokenizer, end):
    """Cut by the length limit, or its rest not parsing: the stream keeps the arguments given out
    (finish_reason length, or stop); the whole message keeps tool_calls complete and lists the call
    in incomplete_tool_calls with the same id, name and arguments. No DSML in content either way."""
    if end == "cut":
        text, finish, reason = DEEPSEEK_EXAMPLE[: DEEPSEEK_EXAMPLE.index("celsius") + 3], "length", "cut_call"
    else:
        text, finish, reason = "r</think>" + BROKEN["bad_json"][0], "stop", "bad_json"
    events = streamed(formatter(tokenizer, v4()), worker_chunks(random_pieces(random.Random(5), text), finish))
    assert "DSML" not in json.dumps([e["choices"][0]["delta"].get("content") for e in events if e["choices"]])
    [(call_id, name, arguments)] = _streamed_calls(events).values()
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == finish
    body = whole(formatter(tokenizer, v4()), worker_chunks([text], finish))
    message = body["choices"][0]["message"]
    assert "tool_calls" not in message and body["choices"][0]["finish_reason"] == finish
    [incomplete] = message["incomplete_tool_calls"]
    assert (incomplete["type"], incomplete["function"]["name"], incomplete["reason"]) == ("function", name, reason)
    want = '{"location": "Beijing", "unit": "cel' if end == "cut" else '{"n": '
    assert arguments == incomplete["function"]["arguments"] == want and incomplete["id"].startswith("call_")
    if finish != "length":  # (its stream helper refuses a length finish)
        got = assembled(events, TOOLS).choices[0]
        assert got.message.tool_calls[0].function.arguments == want  # the openai client keeps what was streamed


def test_router_picks_parsers_and_counts_failures(tmp_path, caplog):
    """The router's own pieces: defaults by model, the spec of a validated request, and a parse
    failure's log line (with the request id) and counter."""
    v4_dir = make_tiny_model(tmp_path / "v4", arch="deepseek_v4")
    cfg = lambda **r: RouterServeConfig(role="router", model=str(v4_dir), colocated=["http://x:1"], router=r)
    router = build_router_app(cfg()).state.router
    assert (router.reasoning_parser, router.tool_call_parser) == ("deepseek_v4", "deepseek_v4")
    off = build_router_app(cfg(reasoning_parser="none", tool_call_parser="deepseek_v31")).state.router
    assert (off.reasoning_parser, off.tool_call_parser) == (None, "deepseek_v31")

    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        thinking={"type": "enabled"},
    )
    prep = router.validator.chat(req, 4096)
    spec = router.output_spec(req, prep)
    assert spec.thinking and spec.tool_parser == "deepseek_v4" and spec.tool_names == {"get_weather"}
    assert "<｜end▁of▁sentence｜>" in spec.drop
    none = req.model_copy(update={"tool_choice": "none"})
    assert router.output_spec(none, router.validator.chat(none, 4096)).tool_parser is None

    fmt = formatter(router.tokenizer, spec)
    for c in worker_chunks(["r</think>" + MALFORMED["unknown_tool"]]):
        fmt.choices[0].add(c)
    with caplog.at_level("WARNING", logger="pdserve.router.serving"):
        router._done(fmt, 0.0)
    assert "chatcmpl-1" in caplog.text and "unknown_tool" in caplog.text
    assert router.metrics.tool_parse_failures.labels("unknown_tool")._value.get() == 1
