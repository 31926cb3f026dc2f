"""The router's Messages response path driven with scripted worker chunks (MessagesFormatter,
messages_format.py): the event stream, decoded and accumulated as the official `anthropic` client
does (its SSE decoder, its event models, its `accumulate_event`), is the non-streamed message;
block kinds and order, signatures, stop reasons, usage, and the error event."""

from __future__ import annotations

import json
import random

import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from pdserve.chat.parsers import OutputSpec
from pdserve.router.messages_format import MessagesFormatter
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError
from pdserve.wire.protocol import GenerateChunk
from tests.helpers.router_apis import worker_chunks
from tests.unit.test_chat_parsers import DEEPSEEK_EXAMPLE, TOOLS, completion, random_pieces, random_turn

pytestmark = pytest.mark.timeout(120)
EVENT = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def v4(thinking: bool = True, tools=TOOLS) -> OutputSpec:
    return OutputSpec("deepseek_v4", "deepseek_v4" if tools else None, frozenset(tools), thinking)


def formatter(tokenizer, output: OutputSpec | None, omit: bool = False) -> MessagesFormatter:
    return MessagesFormatter("msg_1", "tiny", tokenizer, [[0, 5, 6]], output, omit)


def whole(fmt: MessagesFormatter, cs: list[GenerateChunk]) -> Message:
    for c in cs:
        fmt.add(0, c)
    body = fmt.response()
    json.dumps(body)  # plain JSON
    return Message.model_validate(body)


def events(fmt: MessagesFormatter, cs: list[GenerateChunk]) -> list:
    """The stream's frames as the client's SSE decoder reads them (event name and JSON data)."""
    raw = b"".join(e for c in cs if (e := fmt.chunk(0, c)) is not None) + fmt.stream_end()
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    frames = list(SSEDecoder().iter_bytes(iter([raw])))
    assert all(f.event == f.json()["type"] for f in frames)
    return frames


def assembled(frames: list) -> Message:
    """The stream as the anthropic client puts it together (messages.stream's snapshot)."""
    snapshot, bufs = None, {}
    for f in frames:
        if f.event != "ping":
            event = EVENT.validate_python(f.json())
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def blocks(m: Message) -> list[tuple]:
    out = []
    for b in m.content:
        if b.type == "tool_use":
            assert b.id.startswith("toolu_")
            out.append((b.type, b.name, b.input))
        else:
            out.append((b.type, b.text if b.type == "text" else (b.thinking, b.signature)))
    return out


def test_deepseek_example_whole_and_streamed(tokenizer):
    m = whole(formatter(tokenizer, v4()), worker_chunks([DEEPSEEK_EXAMPLE], cached=2))
    assert blocks(m) == [
        ("thinking", ("The user wants to know the weather in Beijing. I should use the get_weather tool.", "")),
        ("tool_use", "get_weather", {"location": "Beijing", "unit": "celsius"}),
    ]
    assert (m.id, m.type, m.role, m.model, m.stop_reason, m.stop_sequence) == (
        "msg_1", "message", "assistant", "tiny", "tool_use", None,
    )  # fmt: skip
    usage = m.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (1, 2, 0)
    assert usage.output_tokens == 1

    frames = events(formatter(tokenizer, v4()), worker_chunks(list(DEEPSEEK_EXAMPLE), cached=2))  # a character a chunk
    kinds = [f.event for f in frames]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start = frames[0].json()["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["cache_read_input_tokens"] == 2
    deltas = [f.json()["delta"]["type"] for f in frames if f.event == "content_block_delta"]
    assert set(deltas) == {"thinking_delta", "input_json_delta"}
    pieces = [f.json()["delta"].get("partial_json", "") for f in frames if f.event == "content_block_delta"]
    assert "".join(pieces) == '{"location": "Beijing", "unit": "celsius"}'  # the call's arguments as written
    assert [f.json()["index"] for f in frames if f.event == "content_block_start"] == [0, 1]
    assert [f.json()["index"] for f in frames if f.event == "content_block_stop"] == [0, 1]
    tool_start = [f.json() for f in frames if f.event == "content_block_start"][1]["content_block"]
    assert tool_start["input"] == {} and tool_start["name"] == "get_weather"
    final = frames[-2].json()
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == len(DEEPSEEK_EXAMPLE)
    got = assembled(frames)
    assert blocks(got) == blocks(m) and got.stop_reason == "tool_use"


def test_every_block_opens_before_its_deltas_and_closes_once(tokenizer):
    text = completion({"role": "assistant", "reasoning_content": "plan", "content": "Hello", "tool_calls": None}, True)
    frames = events(formatter(tokenizer, v4()), worker_chunks(list(text)))
    open_at: int | None = None
    for f in frames:
        e = f.json()
        if f.event == "content_block_start":
            assert open_at is None
            open_at = e["index"]
        elif f.event == "content_block_delta":
            assert e["index"] == open_at
        elif f.event == "content_block_stop":
            assert e["index"] == open_at
            open_at = None
    assert open_at is None
    assert [b[0] for b in blocks(assembled(frames))] == ["thinking", "text"]


@pytest.mark.parametrize("thinking", [True, False])
def test_stream_reassembles_to_the_whole_message(tokenizer, thinking):
    rng = random.Random(42 + thinking)
    for _ in range(40):
        text = completion(random_turn(rng), thinking)
        want = whole(formatter(tokenizer, v4(thinking)), worker_chunks([text]))
        for _ in range(3):
            got = assembled(events(formatter(tokenizer, v4(thinking)), worker_chunks(random_pieces(rng, text))))
            assert blocks(got) == blocks(want)
            assert got.stop_reason == want.stop_reason


@pytest.mark.parametrize(
    "finish, stop_reason, want",
    [
        ("stop", None, ("end_turn", None)),
        ("stop", 1, ("end_turn", None)),  # a stop token (EOS or stop_token_ids)
        ("stop", "END", ("stop_sequence", "END")),
        ("length", None, ("max_tokens", None)),
    ],
)
def test_stop_reasons(tokenizer, finish, stop_reason, want):
    cs = worker_chunks(["</think>", "Hi"], finish, stop_reason)
    m = whole(formatter(tokenizer, v4()), cs)
    assert (m.stop_reason, m.stop_sequence) == want and blocks(m) == [("text", "Hi")]
    assert (assembled(events(formatter(tokenizer, v4()), cs)).stop_reason) == want[0]


def test_a_length_cut_inside_a_call_is_max_tokens_with_no_markup(tokenizer):
    """The call being written keeps its block, its input what the client makes of the pieces given
    out (partial JSON: the unfinished string left out)."""
    cut = DEEPSEEK_EXAMPLE[: DEEPSEEK_EXAMPLE.index("celsius") + 3]
    m = whole(formatter(tokenizer, v4()), worker_chunks([cut], "length"))
    assert m.stop_reason == "max_tokens" and blocks(m)[1:] == [("tool_use", "get_weather", {"location": "Beijing"})]
    frames = events(formatter(tokenizer, v4()), worker_chunks(list(cut), "length"))
    assert "DSML" not in "".join(f.data for f in frames)
    got = assembled(frames)
    assert blocks(got) == blocks(m) and got.stop_reason == "max_tokens"


def test_thinking_display_omitted_keeps_the_blocks_without_their_text(tokenizer):
    cs = worker_chunks(["secret plan", "</think>", "Hi"])
    m = whole(formatter(tokenizer, v4(), omit=True), cs)
    assert blocks(m) == [("thinking", ("", "")), ("text", "Hi")]
    frames = events(formatter(tokenizer, v4(), omit=True), cs)
    assert "secret" not in "".join(f.data for f in frames)
    assert blocks(assembled(frames)) == blocks(m)


def test_without_parsers_the_text_is_one_text_block(tokenizer):
    fmt = formatter(tokenizer, OutputSpec(None, None))
    m = whole(fmt, worker_chunks(["<think>a", "</think>b"]))
    assert blocks(m) == [("text", "<think>a</think>b")] and m.stop_reason == "end_turn"


def test_an_empty_answer_has_no_blocks(tokenizer):
    cs = worker_chunks([""])
    assert whole(formatter(tokenizer, v4(False)), cs).content == []
    frames = events(formatter(tokenizer, v4(False)), cs)
    assert [f.event for f in frames] == ["message_start", "ping", "message_delta", "message_stop"]


@pytest.mark.parametrize(
    "status, kind",
    [(400, "invalid_request_error"), (502, "api_error"), (503, "overloaded_error"), (504, "timeout_error")],
)
def test_a_failure_mid_stream_is_an_error_event(tokenizer, status, kind):
    fmt = formatter(tokenizer, v4())
    fmt.chunk(0, worker_chunks(["a"])[0])
    frames = list(SSEDecoder().iter_bytes(iter([fmt.stream_error(OpenAIError(status, "the decode worker failed"))])))
    assert [(f.event, f.json()) for f in frames] == [
        ("error", {"type": "error", "error": {"type": kind, "message": "the decode worker failed"}})
    ]
