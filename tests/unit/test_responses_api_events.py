"""The router's Responses API output driven with scripted worker chunks (ResponsesFormatter,
responses_api_format.py): the event stream, decoded and accumulated as the official `openai` client
does (its SSE decoder, its event types, the state machine behind `responses.stream`), is the
non-streamed Response; item kinds and order, statuses, sequence numbers, usage, the error event."""

from __future__ import annotations

import json
import random

import pytest
from openai._streaming import SSEDecoder
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdserve.chat.parsers import OutputSpec
from pdserve.router.responses_api_format import ResponsesFormatter
from pdserve.router.responses_api_protocol import ResponseObject
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError
from pdserve.wire.protocol import GenerateChunk
from tests.helpers.router_apis import worker_chunks
from tests.unit.test_chat_parsers import DEEPSEEK_EXAMPLE, TOOLS, completion, random_pieces, random_turn

pytestmark = pytest.mark.timeout(120)
EVENT = TypeAdapter(ResponseStreamEvent)
ECHO = {
    "instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
    "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
    "temperature": 1.0, "top_p": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
    "truncation": "disabled", "background": False, "user": None,
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def v4(thinking: bool = True, tools=TOOLS) -> OutputSpec:
    return OutputSpec("deepseek_v4", "deepseek_v4" if tools else None, frozenset(tools), thinking)


def formatter(tokenizer, output: OutputSpec | None) -> ResponsesFormatter:
    return ResponsesFormatter("resp_1", "tiny", tokenizer, [[0, 5, 6]], output, ECHO)


def whole(fmt: ResponsesFormatter, cs: list[GenerateChunk]) -> Response:
    for c in cs:
        fmt.add(0, c)
    body = json.loads(json.dumps(fmt.response()))  # plain JSON
    ResponseObject.model_validate(body)  # what the OpenAPI schema says
    return Response.model_validate(body)  # what the SDK's type requires


def frames(fmt: ResponsesFormatter, cs: list[GenerateChunk]) -> list:
    """The stream's frames as the client's SSE decoder reads them; each event's name is its type."""
    raw = b"".join(e for c in cs if (e := fmt.chunk(0, c)) is not None) + fmt.stream_end()
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    out = list(SSEDecoder().iter_bytes(iter([raw])))
    assert all(f.event == f.json()["type"] for f in out)
    assert [f.json()["sequence_number"] for f in out] == list(range(len(out)))
    return out


def streamed(fs: list) -> Response:
    """The stream as `client.responses.stream` puts it together: each event validated by the SDK's
    types, then its state machine; get_final_response() is what it returns."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for f in fs:
        state.handle_event(EVENT.validate_python(f.json()))
    assert state._completed_response is not None, "no response.completed"
    return state._completed_response


def items(r: Response) -> list[tuple]:
    out = []
    for item in r.output:
        if item.type == "function_call":
            assert item.id.startswith("fc_") and item.call_id.startswith("call_")
            out.append((item.type, item.name, json.loads(item.arguments), item.status))
        elif item.type == "reasoning":
            assert item.id.startswith("rs_") and item.summary == []
            out.append((item.type, "".join(c.text for c in item.content), item.status))
        else:
            assert item.id.startswith("msg_") and item.role == "assistant"
            assert [(c.type, c.annotations) for c in item.content] == [("output_text", [])]
            out.append((item.type, item.content[0].text, item.status))
    return out


def test_deepseek_example_whole_and_streamed(tokenizer):
    r = whole(formatter(tokenizer, v4()), worker_chunks([DEEPSEEK_EXAMPLE], cached=2))
    assert items(r) == [
        ("reasoning", "The user wants to know the weather in Beijing. I should use the get_weather tool.", "completed"),
        ("function_call", "get_weather", {"location": "Beijing", "unit": "celsius"}, "completed"),
    ]
    assert (r.id, r.object, r.model, r.status, r.incomplete_details, r.error) == (
        "resp_1", "response", "tiny", "completed", None, None,
    )  # fmt: skip
    u = r.usage
    assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens, u.total_tokens) == (3, 2, 1, 4)
    assert u.output_tokens_details.reasoning_tokens == 1
    assert (r.tool_choice, r.parallel_tool_calls, r.store, r.text.format.type) == ("auto", True, False, "text")

    fs = frames(formatter(tokenizer, v4()), worker_chunks(list(DEEPSEEK_EXAMPLE), cached=2))  # a character a chunk
    kinds = [f.event for f in fs]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    created = fs[0].json()["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    pieces = [f.json()["delta"] for f in fs if f.event == "response.function_call_arguments.delta"]
    assert len(pieces) > 3 and "".join(pieces) == '{"location": "Beijing", "unit": "celsius"}'  # as written
    assert {"response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done"} <= set(kinds)
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    call_added = [f.json()["item"] for f in fs if f.event == "response.output_item.added"][1]
    assert (call_added["arguments"], call_added["status"]) == ("", "in_progress")
    got = streamed(fs)
    assert items(got) == items(r) and got.usage.input_tokens_details == r.usage.input_tokens_details
    assert got.usage.output_tokens == len(DEEPSEEK_EXAMPLE)  # a token a chunk


def test_every_item_opens_before_its_events_and_closes_once(tokenizer):
    text = completion({"role": "assistant", "reasoning_content": "plan", "content": "Hello", "tool_calls": None}, True)
    open_at: int | None = None
    for f in frames(formatter(tokenizer, v4()), worker_chunks(list(text))):
        e = f.json()
        if f.event == "response.output_item.added":
            assert open_at is None
            open_at = e["output_index"]
        elif f.event == "response.output_item.done":
            assert e["output_index"] == open_at
            open_at = None
        elif "output_index" in e:
            assert e["output_index"] == open_at, f.event
    assert open_at is None


@pytest.mark.parametrize("thinking", [True, False])
def test_stream_reassembles_to_the_whole_response(tokenizer, thinking):
    rng = random.Random(7 + thinking)
    for _ in range(40):
        text = completion(random_turn(rng), thinking)
        want = whole(formatter(tokenizer, v4(thinking)), worker_chunks([text]))
        for _ in range(3):
            got = streamed(frames(formatter(tokenizer, v4(thinking)), worker_chunks(random_pieces(rng, text))))
            assert items(got) == items(want) and got.status == want.status == "completed"


def test_the_length_limit_is_incomplete(tokenizer):
    cs = worker_chunks(["</think>", "Hel", "lo"], "length")
    r = whole(formatter(tokenizer, v4()), cs)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert items(r) == [("message", "Hello", "incomplete")]
    fs = frames(formatter(tokenizer, v4()), cs)
    assert fs[-1].event == "response.incomplete" and fs[-1].json()["response"]["status"] == "incomplete"
    done = [f.json() for f in fs if f.event == "response.output_text.done"]
    assert [d["text"] for d in done] == ["Hello"]
    for f in fs:
        EVENT.validate_python(f.json())  # response.incomplete too


def test_a_length_cut_inside_a_call_is_an_incomplete_function_call(tokenizer):
    """The call being written stays, status incomplete, with the arguments given out so far; no markup."""
    cut = DEEPSEEK_EXAMPLE[: DEEPSEEK_EXAMPLE.index("celsius") + 3]
    cs = worker_chunks(list(cut), "length")
    r = whole(formatter(tokenizer, v4()), cs)
    assert r.status == "incomplete" and [(i.type, i.status) for i in r.output] == [
        ("reasoning", "completed"),
        ("function_call", "incomplete"),
    ]
    call = r.output[1]
    assert (call.name, call.arguments) == ("get_weather", '{"location": "Beijing", "unit": "cel')
    fs = frames(formatter(tokenizer, v4()), cs)
    assert fs[-1].event == "response.incomplete" and "DSML" not in "".join(f.data for f in fs)
    pieces = [f.json()["delta"] for f in fs if f.event == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments
    done = [f.json()["item"] for f in fs if f.event == "response.output_item.done"][-1]
    assert (done["arguments"], done["status"]) == (call.arguments, "incomplete")


def test_without_parsers_the_text_is_one_message(tokenizer):
    r = whole(formatter(tokenizer, OutputSpec(None, None)), worker_chunks(["<think>a", "</think>b"]))
    assert items(r) == [("message", "<think>a</think>b", "completed")] and r.output_text == "<think>a</think>b"


def test_an_empty_answer_has_no_items(tokenizer):
    cs = worker_chunks([""])
    assert whole(formatter(tokenizer, v4(False)), cs).output == []
    fs = frames(formatter(tokenizer, v4(False)), cs)
    assert [f.event for f in fs] == ["response.created", "response.in_progress", "response.completed"]


@pytest.mark.parametrize(
    "status, code, want",
    [(502, "upstream_error", "upstream_error"), (503, None, "server_error"), (504, "timeout", "timeout")],
)
def test_a_failure_mid_stream_is_an_error_event(tokenizer, status, code, want):
    fmt = formatter(tokenizer, v4())
    opening = fmt.chunk(0, worker_chunks(["a"])[0])
    fs = list(SSEDecoder().iter_bytes(iter([opening + fmt.stream_error(OpenAIError(status, "the decode worker failed", code=code))])))  # fmt: skip
    error = fs[-1].json()
    assert fs[-1].event == "error" and error["sequence_number"] == len(fs) - 1
    assert (error["code"], error["message"], error["param"]) == (want, "the decode worker failed", None)
    assert EVENT.validate_python(error).type == "error"
