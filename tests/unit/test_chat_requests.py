"""The request side of DeepSeek's chat protocol, in the router without workers: thinking controls,
tools and tool history, structured-output fields -> SamplingParams, /tokenize and /detokenize,
and schema errors as 400 (the official openai client raises BadRequestError)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve.chat import dsv4
from pdserve.router.app import build_router_app
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.validation import RequestValidator
from pdserve.serve_config import RouterServeConfig
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError

pytestmark = pytest.mark.timeout(120)
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("v4") / "m", arch="deepseek_v4"))


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("v3") / "m", arch="deepseek_v3"))


def _validator(model_dir: str, defaults: dict | None = None) -> RequestValidator:
    v = RequestValidator(Tokenizer(model_dir), "tiny", json.load(open(f"{model_dir}/config.json"))["vocab_size"])
    v.set_chat_defaults(defaults or {})
    return v


@pytest.fixture(scope="module")
def v4(v4_dir):
    return _validator(v4_dir)


def _prompt(validator: RequestValidator, **body) -> str:
    prep = validator.chat(ChatCompletionRequest.model_validate({"messages": USER, **body}), 4096)
    return validator.tokenizer.decode(prep.prompts[0], skip_special_tokens=False)


def _refusal(validator: RequestValidator, **body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        validator.chat(ChatCompletionRequest.model_validate({"messages": USER, **body}), 4096)
    assert e.value.status == 400, e.value.message
    return e.value


def test_the_tiny_v4_model_ships_like_the_release(v4):
    tok = v4.tokenizer
    assert tok.chat_template is None and tok.builtin_chat_encoder
    for token in (dsv4.THINK, dsv4.END_THINK, dsv4.DSML, dsv4.USER, dsv4.ASSISTANT):
        assert tok.token_to_id(token) is not None, token
        assert tok.encode(token, add_special_tokens=False) == [tok.token_to_id(token)]


@pytest.mark.parametrize(
    "body, thinking",
    [
        ({}, False),  # V4's default is chat mode, as vLLM's
        ({"thinking": {"type": "enabled"}}, True),
        ({"thinking": {"type": "disabled"}}, False),
        ({"chat_template_kwargs": {"thinking": True}}, True),
        ({"chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"chat_template_kwargs": {"thinking": False}}, False),
        ({"reasoning_effort": "high"}, True),  # an effort asks for reasoning
        ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": True}}, True),
    ],
)
def test_each_thinking_control(v4, body, thinking):
    prep = v4.chat(ChatCompletionRequest.model_validate({"messages": USER, **body}), 4096)
    expected = dsv4.encode(USER, thinking=thinking)
    assert v4.tokenizer.decode(prep.prompts[0], skip_special_tokens=False) == expected
    assert prep.thinking is thinking


@pytest.mark.parametrize(
    "effort, level",
    [("minimal", "high"), ("low", "high"), ("medium", "high"), ("high", "high"), ("xhigh", "max"), ("max", "max")],
)
def test_reasoning_effort_levels(v4, effort, level):
    got = _prompt(v4, reasoning_effort=effort, thinking={"type": "enabled"})
    assert got == dsv4.encode(USER, thinking=True, reasoning_effort=level)
    assert got.startswith(dsv4.BOS + dsv4.ABSOLUTE_MAX) is (level == "max")
    assert _prompt(v4, chat_template_kwargs={"reasoning_effort": effort, "thinking": True}) == got


@pytest.mark.parametrize(
    "body, param",
    [
        ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": False}}, "chat_template_kwargs.thinking"),
        ({"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
        ({"thinking": {"type": "on"}}, "thinking.type"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": "max", "thinking": {"type": "disabled"}}, "reasoning_effort"),
        ({"reasoning_effort": "max", "chat_template_kwargs": {"reasoning_effort": "high"}}, "chat_template_kwargs.reasoning_effort"),
        ({"chat_template_kwargs": {"temperature_of_mind": 3}}, "chat_template_kwargs.temperature_of_mind"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ],
)  # fmt: skip
def test_unknown_or_contradictory_controls_name_the_field(v4, body, param):
    e = _refusal(v4, **body)
    assert e.param == param and param in e.message


def test_thinking_options_carry_no_unknown_keys(v4):
    with pytest.raises(ValueError, match="budget_tokens"):
        ChatCompletionRequest.model_validate({"messages": USER, "thinking": {"type": "enabled", "budget_tokens": 9}})


def test_server_defaults_apply_unless_the_request_decides(v4_dir, v3_dir):
    v = _validator(v4_dir, {"thinking": True, "reasoning_effort": "max"})
    assert _prompt(v) == dsv4.encode(USER, thinking=True, reasoning_effort="max")
    assert _prompt(v, thinking={"type": "disabled"}) == dsv4.encode(USER, thinking=False)  # default effort dropped
    assert _prompt(v, reasoning_effort="high") == dsv4.encode(USER, thinking=True, reasoning_effort="high")
    with pytest.raises(ValueError, match="no thinking switch"):
        _validator(v3_dir, {"thinking": True})  # the tiny V3 template has no thinking mode: refused at startup
    with pytest.raises(ValueError, match="reads no 'colour'"):
        _validator(v4_dir, {"colour": "blue"})


def test_a_template_without_thinking_or_tools_refuses_them(v3_dir):
    v3 = _validator(v3_dir)
    assert _refusal(v3, thinking={"type": "enabled"}).param == "thinking.type"
    assert _refusal(v3, reasoning_effort="high").param == "reasoning_effort"
    assert _refusal(v3, tools=[WEATHER]).param == "tools"


def test_tools_and_tool_history_render_as_the_encoder_does(v4):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3°C"},
    ]
    body = {"messages": history, "tools": [WEATHER], "tool_choice": "auto", "thinking": {"type": "enabled"}}
    prep = v4.chat(ChatCompletionRequest.model_validate(body), 4096)
    reference_input = [
        {"role": "system", "content": "", "tools": [WEATHER]},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3°C"},
    ]
    text = v4.tokenizer.decode(prep.prompts[0], skip_special_tokens=False)
    assert text == dsv4.encode(reference_input, thinking=True)
    assert "<tool_result>-3°C</tool_result>" in text and "Use the tool.</think>" in text  # reasoning kept with tools
    assert (prep.thinking, prep.tool_choice, prep.tools) == (True, "auto", [WEATHER])
    # a system message of the request's own takes the tools; "developer" is a system message
    for role in ("system", "developer"):
        body = {"messages": [{"role": role, "content": "Be brief."}, *USER], "tools": [WEATHER], "tool_choice": "none"}
        text = v4.tokenizer.decode(v4.chat(ChatCompletionRequest.model_validate(body), 4096).prompts[0], False)
        assert text == dsv4.encode(
            [{"role": "system", "content": "Be brief.", "tools": [WEATHER]}, *USER], thinking=False
        )


def test_tool_choice_and_tool_message_rules(v4):
    assert _refusal(v4, tools=[WEATHER], tool_choice="required").param == "tool_choice"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _refusal(v4, tools=[WEATHER], tool_choice=named).param == "tool_choice"
    assert _refusal(v4, tool_choice="auto").param == "tool_choice"  # no tools
    assert _refusal(v4, tools=[WEATHER], parallel_tool_calls=False).param == "parallel_tool_calls"
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(ValueError, match="assistant"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]})


def test_response_format_maps_to_structured_outputs(v4):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": schema}}
    prep = v4.chat(ChatCompletionRequest.model_validate({"messages": USER, "response_format": fmt}), 4096)
    so = prep.params[0].structured_outputs
    assert (so.json_schema, so.start_after_token_id) == (schema, None)
    text = v4.tokenizer.decode(prep.prompts[0], skip_special_tokens=False)
    assert text == dsv4.encode([{"role": "system", "content": "", "response_format": fmt}, *USER], thinking=False)
    # thinking: the schema applies after </think>
    body = {"messages": USER, "response_format": {"type": "json_object"}, "thinking": {"type": "enabled"}}
    so = v4.chat(ChatCompletionRequest.model_validate(body), 4096).params[0].structured_outputs
    assert so.json_object and so.start_after_token_id == v4.tokenizer.token_to_id("</think>")


@pytest.mark.parametrize(
    "fields, kind, value",
    [
        ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema", {"type": "object"}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"guided_json": {"type": "array"}}, "json_schema", {"type": "array"}),
        ({"guided_regex": "\\d{3}"}, "regex", "\\d{3}"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar", 'root ::= "a" | "b"'),
    ],
)
def test_vllm_structured_output_fields(v4, fields, kind, value):
    so = v4.chat(ChatCompletionRequest.model_validate({"messages": USER, **fields}), 4096).params[0].structured_outputs
    assert so.kind == kind and getattr(so, kind) == value


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_regex": "("}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"guided_grammar": "nonsense ::="}, "guided_grammar"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_specs_the_library_rejects_are_400(v4, fields, param):
    assert _refusal(v4, **fields).param == param
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        ChatCompletionRequest.model_validate({"messages": USER, "structured_outputs": {"disable_any_whitespace": True}})


# -- the router app in-process: /tokenize, /detokenize, schema errors --


@pytest.fixture(scope="module")
def app(v4_dir):
    config = RouterServeConfig(
        role="router", model=v4_dir, served_model_name="tiny", router={"max_model_len": 64, "api_key": "sk-test", "health_interval": 60},
        prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
    )  # fmt: skip
    return build_router_app(config)


async def _post(app, path: str, body: dict, key: str | None = "sk-test") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        return await c.post(path, json=body, headers=headers)


async def test_tokenize_shows_the_exact_prompt_and_detokenize_inverts(app, v4):
    tok = v4.tokenizer
    resp = await _post(app, "/tokenize", {"prompt": "hello there"})
    assert resp.status_code == 200, resp.text
    ids = tok.encode("hello there")
    assert ids[0] == tok.bos_token_id  # add_special_tokens defaults to true for a prompt
    assert resp.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    body = {"messages": USER, "tools": [WEATHER], "chat_template_kwargs": {"thinking": True}, "return_token_strs": True}
    got = (await _post(app, "/tokenize", body)).json()
    prep = v4.chat(
        ChatCompletionRequest.model_validate({k: v for k, v in body.items() if k != "return_token_strs"}), 4096
    )
    assert got["tokens"] == prep.prompts[0] and got["count"] == len(got["tokens"])
    assert got["token_strs"] == [tok.id_to_token(i) for i in got["tokens"]]
    back = (await _post(app, "/detokenize", {"tokens": got["tokens"]})).json()
    assert back == {
        "prompt": dsv4.encode([{"role": "system", "content": "", "tools": [WEATHER]}, *USER], thinking=True)
    }
    no_prompt = (await _post(app, "/tokenize", {"messages": USER, "add_generation_prompt": False})).json()
    assert tok.decode(no_prompt["tokens"], skip_special_tokens=False) == dsv4.BOS + dsv4.USER + "hi"
    with_bos = (await _post(app, "/tokenize", {"messages": USER, "add_special_tokens": True})).json()
    assert with_bos["tokens"] == [tok.bos_token_id, *prep_tokens(v4)]


def prep_tokens(v4) -> list[int]:
    return v4.chat(ChatCompletionRequest.model_validate({"messages": USER}), 4096).prompts[0]


async def test_tokenize_errors(app):
    assert (await _post(app, "/tokenize", {"prompt": "x"}, key=None)).status_code == 401
    assert (await _post(app, "/detokenize", {"tokens": [1]}, key=None)).status_code == 401
    for path, body, param in [
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "colour": 1}, "colour"),
        ("/tokenize", {"messages": USER, "chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ]:
        resp = await _post(app, path, body)
        assert resp.status_code in (400, 404), resp.text
        assert resp.json()["error"]["param"] == param, resp.text


async def test_schema_errors_are_400_and_the_openai_client_raises_bad_request(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router/v1") as http:
        client = openai.AsyncOpenAI(api_key="sk-test", base_url="http://router/v1", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
        assert e.value.status_code == 400 and e.value.body["param"] == "messages.0.role"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="tiny", prompt="x", temperature=7)
        assert e.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=USER, reasoning_effort="extreme")
        assert e.value.body["param"] == "reasoning_effort"


def test_a_jinja_template_gets_the_thinking_switch_it_reads(tmp_path, v3_dir):
    import shutil

    folder = tmp_path / "v31"
    shutil.copytree(v3_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}"
        "<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}"
    )
    v = _validator(str(folder))
    assert _prompt(v).endswith("<｜Assistant｜></think>")
    prep = v.chat(ChatCompletionRequest.model_validate({"messages": USER, "thinking": {"type": "enabled"}}), 4096)
    assert v.tokenizer.decode(prep.prompts[0], skip_special_tokens=False).endswith("<｜Assistant｜><think>")
    assert prep.thinking
    assert _refusal(v, chat_template_kwargs={"enable_thinking": True}, thinking={"type": "disabled"}).param == (
        "chat_template_kwargs.enable_thinking"
    )
    assert _refusal(v, reasoning_effort="max").param == "reasoning_effort"  # the template reads no effort
