"""Router pieces without worker processes: policies, request validation, error objects, the
joining of prefill and decode streams, and the router app's refusals (in-process ASGI)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.stop import visible_text
from pdserve.router.app import build_router_app
from pdserve.router.dispatch import _Offsets
from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.policies import LeastLoad, PowerOfTwo, RoundRobin, make_policy
from pdserve.router.validation import RequestValidator
from pdserve.sampling_params import SamplingParams
from pdserve.serve_config import RouterServeConfig
from pdserve.tiny_model import make_tiny_model
from pdserve.tokenizer import Tokenizer
from pdserve.wire.errors import OpenAIError
from pdserve.wire.protocol import GenerateChunk, Request

pytestmark = pytest.mark.timeout(120)


@dataclass
class W:
    url: str
    in_flight: int = 0


# -- policies --


def test_round_robin_cycles_in_order():
    ws = [W("a"), W("b"), W("c")]
    p = RoundRobin()
    assert [p.choose(ws).url for _ in range(7)] == list("abcabca")


def test_least_load_picks_the_least_loaded_and_rotates_ties():
    ws = [W("a", 3), W("b", 1), W("c", 1)]
    p = LeastLoad()
    assert [p.choose(ws).url for _ in range(4)] == ["b", "c", "b", "c"]
    ws[0].in_flight = 0
    assert p.choose(ws).url == "a"


def test_power_of_two_never_picks_the_most_loaded_of_a_pair():
    ws = [W("a", 5), W("b", 0), W("c", 9)]
    p = PowerOfTwo(seed=1)
    picks = [p.choose(ws).url for _ in range(200)]
    assert "c" not in picks  # c is the heavier of every pair it can be drawn in
    assert {"a", "b"} == set(picks)
    assert PowerOfTwo(seed=0).choose([W("only")]).url == "only"


def test_make_policy_names_and_errors():
    assert isinstance(make_policy("least_load"), LeastLoad)
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")
    with pytest.raises(ValueError, match="no worker"):
        RoundRobin().choose([])


# -- validation --


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="module")
def validator(model_dir):
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    return RequestValidator(Tokenizer(model_dir), "tiny", vocab)


def _err(fn) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn()
    return e.value


def test_completion_prompt_forms(validator):
    tok = validator.tokenizer
    assert validator.completion(CompletionRequest(prompt="hi"), 100).prompts == [tok.encode("hi")]
    assert len(validator.completion(CompletionRequest(prompt=["a", "b"]), 100).prompts) == 2
    assert validator.completion(CompletionRequest(prompt=[5, 6, 7]), 100).prompts == [[5, 6, 7]]
    assert validator.completion(CompletionRequest(prompt=[[5], [6, 7]]), 100).prompts == [[5], [6, 7]]


def test_sampling_params_mapping(validator):
    req = CompletionRequest(
        prompt="x", max_tokens=5, temperature=0, top_k=3, min_p=0.1, seed=-1, stop="ab", logprobs=2, ignore_eos=True
    )
    p = validator.completion(req, 100).params[0]
    assert (p.max_tokens, p.temperature, p.top_k, p.min_p, p.stop, p.logprobs, p.ignore_eos) == (
        5,
        0,
        3,
        0.1,
        ["ab"],
        2,
        True,
    )
    assert p.seed == 2**63 - 1  # negative seeds fold into the engine's range
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3)
    prep = validator.chat(chat, 64)
    assert prep.params[0].max_tokens == 64 - len(prep.prompts[0])  # no max_tokens: the rest of the context
    assert prep.params[0].logprobs == 3
    assert (
        validator.chat(ChatCompletionRequest(messages=chat.messages, max_tokens=9, max_completion_tokens=4), 64)
        .params[0]
        .max_tokens
        == 4
    )


def test_context_length_and_limits(validator):
    e = _err(lambda: validator.completion(CompletionRequest(prompt=[1] * 10, max_tokens=8), 16))
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "max_tokens")
    assert "16 tokens" in e.message and "18 tokens" in e.message
    e = _err(lambda: validator.completion(CompletionRequest(prompt=[1] * 16), 16))
    assert (e.status, e.code) == (400, "context_length_exceeded")
    assert _err(lambda: validator.completion(CompletionRequest(prompt=[10**6]), 16)).param == "prompt"


def test_refusals(validator):
    msgs = [{"role": "user", "content": "hi"}]
    assert _err(lambda: validator.chat(ChatCompletionRequest(model="gpt-4", messages=msgs), 64)).status == 404
    e = _err(lambda: validator.completion(CompletionRequest(prompt="x", n=3, best_of=2), 64))
    assert (e.status, e.param) == (400, "best_of") and "at least n" in e.message
    e = _err(lambda: validator.completion(CompletionRequest(prompt="x", best_of=2, stream=True), 64))
    assert (e.status, e.param) == (400, "best_of")
    assert validator.chat(ChatCompletionRequest(messages=msgs, n=2), 64).n == 2
    assert (
        _err(lambda: validator.chat(ChatCompletionRequest(messages=msgs, top_logprobs=2), 64)).param == "top_logprobs"
    )
    assert _err(lambda: validator.completion(CompletionRequest(prompt="x", echo=True), 64)).param == "echo"
    assert (
        _err(
            lambda: validator.chat(
                ChatCompletionRequest(messages=msgs, tools=[{"type": "function", "function": {"name": "f"}}]), 64
            )
        ).param
        == "tools"
    )
    e = _err(lambda: validator.completion(CompletionRequest(prompt="x", min_tokens=9, max_tokens=2), 64))
    assert e.status == 400 and "min_tokens" in e.message
    for bias in ({"x": 1}, {"-1": 1}, {str(validator.vocab_size): 1}, {"3": 100.5}, {"3": -101}):
        e = _err(lambda: validator.completion(CompletionRequest(prompt="x", logit_bias=bias), 64))
        assert (e.status, e.param) == (400, "logit_bias"), bias


def test_logit_bias_reaches_the_sampling_params(validator):
    msgs = [{"role": "user", "content": "hi"}]
    p = validator.chat(ChatCompletionRequest(messages=msgs, logit_bias={"5": -100, " 7": 2.5}), 64).params[0]
    assert p.logit_bias == {5: -100.0, 7: 2.5}
    assert validator.completion(CompletionRequest(prompt="x", logit_bias={}), 64).params[0].logit_bias is None


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "temperature": 2.5},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "stop": ["s"] * 17},
        {"prompt": "x", "stop": [""]},
        {"prompt": "x", "logprobs": 21},
        {"prompt": "x", "repetition_penalty": float("inf")},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": 5},
    ],
)
def test_schema_rejects(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_chat_schema_rejects_unknown_roles_and_empty_messages():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})


# -- joining streams, handoff text --


def _chunk(tok_off, ids, text_off, text, finish=None):
    return GenerateChunk(
        request_id="r", token_offset=tok_off, token_ids=ids, text_offset=text_off, text=text, finish_reason=finish
    )


def test_chunks_must_continue_where_the_output_stands():
    o = _Offsets()
    o.advance(_chunk(0, [7], 0, "ab"))  # prefill: the first token
    o.advance(_chunk(1, [8, 9], 2, "cd"))  # decode starts after it (FirstToken.text_offset = 2)
    o.advance(_chunk(3, [], 4, "", finish="stop"))
    with pytest.raises(OpenAIError):
        o.advance(_chunk(0, [7, 8, 9, 10], 0, "abcde"))  # a repeat is a protocol error
    with pytest.raises(OpenAIError):
        _Offsets().advance(_chunk(1, [1], 0, "x"))  # so is a gap


def test_handoff_text_holds_back_a_possible_stop_string():
    req = Request(request_id="r", prompt_token_ids=[1], params=SamplingParams(stop=["xyz", "q"]), hold_kv=True)
    seq = Sequence(req)
    seq.text, seq.status = "hello", SequenceStatus.FINISHED_REMOTE_DECODE  # prefill's last word: decode goes on
    assert visible_text(seq) == "hel"
    seq.status = SequenceStatus.FINISHED_LENGTH
    assert visible_text(seq) == "hello"


def test_internal_protocol_refuses_other_versions():
    with pytest.raises(ValidationError, match="version"):
        Request(version=2, request_id="r", prompt_token_ids=[1], params=SamplingParams())
    with pytest.raises(ValidationError):
        Request(request_id="bad id with spaces", prompt_token_ids=[1], params=SamplingParams())


# -- the router app in-process, no workers behind it --


@pytest.fixture(scope="module")
def router_app(model_dir):
    config = RouterServeConfig(
        role="router", model=model_dir, served_model_name="tiny", router={"max_model_len": 64, "api_key": "sk-test", "health_interval": 60},
        prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
    )  # fmt: skip
    return build_router_app(config)


async def _call(app, method, path, key="sk-test", headers=None, **kw) -> httpx.Response:
    headers = {**(headers or {}), **({"authorization": f"Bearer {key}"} if key else {})}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        return await c.request(method, path, headers=headers, **kw)


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


async def test_router_error_objects(router_app):
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    cases = [
        (("POST", "/v1/completions"), {"json": ok, "key": None}, 401),
        (("POST", "/v1/completions"), {"json": ok, "key": "sk-wrong"}, 401),
        (("POST", "/v1/completions"), {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400),
        (("POST", "/v1/completions"), {"json": {**ok, "max_tokens": "many"}}, 400),
        (("POST", "/v1/completions"), {"json": {**ok, "model": "nope"}}, 404),
        (("POST", "/v1/completions"), {"json": {**ok, "max_tokens": 100}}, 400),
        (("POST", "/v1/chat/completions"), {"json": {"messages": [{"role": "x", "content": "y"}]}}, 400),
        (("POST", "/v1/completions"), {"content": b"x" * (9 << 20)}, 413),
        (("POST", "/internal/generate"), {"json": {}}, 404),
        (("GET", "/v1/nothing"), {}, 404),
        (("GET", "/v1/completions"), {}, 405),
        (("POST", "/v1/completions"), {"json": ok}, 503),  # valid, but no worker is healthy
    ]
    for (method, path), kw, status in cases:
        resp = await _call(router_app, method, path, **kw)
        assert resp.status_code == status, (path, kw.get("json"), resp.text)
        err = _error(resp)
        assert err["message"]
    assert (
        _error(await _call(router_app, "POST", "/v1/completions", json={**ok, "max_tokens": "many"}))["param"]
        == "max_tokens"
    )


async def test_unknown_request_fields_are_refused_by_name(router_app):
    """A field pdserve does not know (or a typo of one it does) is a 400 naming it, never dropped."""
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "frequency_penalty_x": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "service_tier": "flex"}),
        ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}}),
    ):
        resp = await _call(router_app, "POST", path, json=body)
        assert resp.status_code == 400, resp.text
        err = _error(resp)
        assert err["code"] == "unsupported_parameter" and err["param"].split(".")[-1] in str(body), err


async def test_router_health_metrics_and_openapi(router_app):
    assert (await _call(router_app, "GET", "/health", key=None)).status_code == 401  # --api-key covers every route
    health = await _call(router_app, "GET", "/health")
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    metrics = await _call(router_app, "GET", "/metrics")
    names = {f.name for f in text_string_to_metric_families(metrics.text)}
    assert {"pdserve_router_requests", "pdserve_time_to_first_token_seconds", "pdserve_router_worker_healthy"} <= names
    assert 'pdserve_router_requests_total{route="/v1/completions",status="401"}' in metrics.text
    assert 'status="500"' not in metrics.text
    schema = (await _call(router_app, "GET", "/openapi.json")).json()
    assert "/internal/generate" not in schema["paths"]
    assert "429" in schema["paths"]["/v1/completions"]["post"]["responses"]


def _serve_args(*argv: str):
    import argparse

    from pdserve.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_serve_refuses_unsafe_or_incomplete_setups(model_dir, capsys):
    from pdserve.serve import config_from_args, run_serve

    assert (
        config_from_args(
            _serve_args("--role", "decode", "--model", model_dir, "--peer", "http://127.0.0.1:1")
        ).worker.host
        == "127.0.0.1"
    )  # loopback by default
    assert run_serve(_serve_args("--role", "decode", "--model", model_dir, "--host", "0.0.0.0")) == 2
    assert "--cluster-secret" in capsys.readouterr().err
    assert run_serve(_serve_args("--role", "router", "--model", model_dir, "--prefill", "http://127.0.0.1:1")) == 2
    assert "--decode" in capsys.readouterr().err
    assert run_serve(_serve_args("--role", "router", "--model", model_dir)) == 2


# -- the worker prober --


def _pool_client(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _info(role: str) -> dict:
    return {"role": role, "engine_id": f"{role}-1", "model": "m", "max_model_len": 128, "kv_block_size": 16, "num_kv_blocks": 8,
            "max_num_seqs": 4, "device": "cpu", "dtype": "float32", "transfer_backend": "nixl", "pdserve_version": "0"}  # fmt: skip


async def test_prober_marks_workers_up_down_and_checks_roles():
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.pool import WorkerPool

    state = {"decode_role": "decode", "prefill": "ok"}

    def handler(req: httpx.Request) -> httpx.Response:
        role = "prefill" if req.url.port == 1 else state["decode_role"]
        if req.url.port == 1 and state["prefill"] == "down":
            raise httpx.ConnectError("refused")
        if req.url.port == 1 and state["prefill"] == "slow":
            raise httpx.ReadTimeout("slow")
        if req.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "role": role, "engine_id": f"{role}-1"})
        assert req.headers["x-pdserve-cluster-secret"] == "s"
        return httpx.Response(200, json=_info(role))

    metrics = RouterMetrics()
    pool = WorkerPool(["http://w:1"], ["http://w:2"], [], metrics)
    async with _pool_client(handler) as client:
        assert not pool.can_serve()
        await pool.probe_all(client, {"x-pdserve-cluster-secret": "s"})
        assert pool.can_pd() and pool.max_model_len() == 128
        state["prefill"] = "slow"
        await pool.probe_all(client, {})
        assert pool.can_pd()  # one late answer is tolerated
        await pool.probe_all(client, {})
        assert not pool.can_pd() and "ReadTimeout" in pool.workers[0].reason
        state["prefill"] = "down"
        await pool.probe_all(client, {})
        assert pool.workers[0].failures == 3
        state["prefill"], state["decode_role"] = "ok", "prefill"
        pool.workers[1].info = None
        await pool.probe_all(client, {"x-pdserve-cluster-secret": "s"})
        assert pool.workers[0].healthy and not pool.workers[1].healthy
        assert "configured as decode" in pool.workers[1].reason
    text = render_metrics(metrics)
    assert 'pdserve_router_worker_healthy{role="prefill",worker="w:1"} 1.0' in text
    assert 'pdserve_router_worker_healthy{role="decode",worker="w:2"} 0.0' in text


async def test_prober_survives_surprises_and_bounds_each_probe(monkeypatch):
    """An exception the HTTP stack is not supposed to raise (uvloop's RuntimeError on a closed
    transport) or a probe that never finishes marks that worker down; the prober goes on, takes the
    worker back when it answers, and a prober that stops anyway takes the router out of service."""
    import asyncio

    from pdserve.router import pool as pool_mod
    from pdserve.router.metrics import RouterMetrics

    monkeypatch.setattr(pool_mod, "PROBE_DEADLINE_S", 0.2)
    state = {"decode": "ok"}

    async def handler(req: httpx.Request) -> httpx.Response:
        role = "prefill" if req.url.port == 1 else "decode"
        if role == "decode" and state["decode"] == "closed":
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")
        if role == "decode" and state["decode"] == "hangs":
            await asyncio.sleep(3600)
        if req.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "role": role, "engine_id": f"{role}-1"})
        return httpx.Response(200, json=_info(role))

    pool = pool_mod.WorkerPool(["http://w:1"], ["http://w:2"], [], RouterMetrics())
    async with _pool_client(handler) as client:
        state["decode"] = "closed"
        await pool.probe_all(client, {})
        assert pool.workers[0].healthy and not pool.workers[1].healthy
        assert pool.workers[1].reason.startswith("probe failed: RuntimeError: unable to perform operation")
        state["decode"] = "ok"
        await pool.probe_all(client, {})
        assert pool.can_serve()
        state["decode"] = "hangs"
        for _ in range(2):  # one late probe is tolerated, as a late answer is
            await asyncio.wait_for(pool.probe_all(client, {}), 5)
        assert not pool.workers[1].healthy and "did not finish within 0.2 s" in pool.workers[1].reason

        async def broken(*args):
            raise KeyError("a bug")

        monkeypatch.setattr(pool, "probe_all", broken)
        with pytest.raises(KeyError):
            await pool.run(client, 0.01, {})
    assert not pool.can_serve() and "the worker prober stopped (KeyError" in pool.missing()


def render_metrics(metrics) -> str:
    from pdserve.wire.metrics import render

    return render(metrics.registry).decode()


def test_draining_ends_a_wait_for_the_next_chunk_with_a_503_and_nothing_else():
    """Router._next_unless: start_draining turns the wait of every open request into the
    server_shutting_down error; a cancellation from anywhere else stays a cancellation."""
    import asyncio
    import time

    from pdserve.router.app import Router

    async def never():
        await asyncio.Event().wait()
        yield None

    async def one():
        yield "chunk"

    async def go() -> None:
        router = Router.__new__(Router)  # only the draining state: no config, pool or tokenizer
        router.draining, router._loop, router._reading, router._drained = (
            asyncio.Event(),
            asyncio.get_running_loop(),
            set(),
            set(),
        )
        deadline = time.monotonic() + 30
        assert await router._next_unless(one(), deadline) == "chunk"
        waiting = [asyncio.create_task(router._next_unless(never(), deadline)) for _ in range(3)]
        other = asyncio.create_task(router._next_unless(never(), deadline))
        await asyncio.sleep(0.01)
        other.cancel()  # a client gone, say: not draining
        with pytest.raises(asyncio.CancelledError):
            await other
        router.start_draining()
        for task in waiting:
            with pytest.raises(OpenAIError) as e:
                await task
            assert e.value.status == 503 and e.value.code == "server_shutting_down"
        assert router._reading == set() and router._drained == set()
        with pytest.raises(OpenAIError, match="shutting down"):  # a request that asks after it started
            await router._next_unless(one(), deadline)

    asyncio.run(go())
