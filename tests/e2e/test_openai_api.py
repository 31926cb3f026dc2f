"""The router's OpenAI API against a real tiny PD cluster (prefill + decode over NIXL), through the
official openai client: completions and chat, streamed and not, usage, stop, logprobs, seed,
return_token_ids, /v1/models, and error objects for bad input (400/401/404/413) - never a 5xx.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster

pytestmark = pytest.mark.timeout(600)

API_KEY = "sk-pdserve-test"
MSGS = [{"role": "user", "content": "Tell me about prefill and decode."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai_api")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        prefill = c.worker("prefill")
        decode = c.worker("decode", peers=[prefill])
        c.open_router = c.router(prefill=[prefill], decode=[decode])
        c.key_router = c.router("--api-key", API_KEY, prefill=[prefill], decode=[decode])
        c.tight_router = c.router(
            "--max-queued-requests", "1", "--request-timeout", "2", prefill=[prefill], decode=[decode]
        )
        c.wait_healthy()
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.open_router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_prompt_forms_and_usage(client):
    one = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0)
    assert one.object == "text_completion" and len(one.choices) == 1
    assert one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == 5 and one.usage.total_tokens == one.usage.prompt_tokens + 5
    batch = client.completions.create(model="tiny", prompt=["hello world", "second"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert (
        batch.choices[0].text
        == client.completions.create(model="tiny", prompt="hello world", max_tokens=4, temperature=0).choices[0].text
    )
    assert batch.usage.completion_tokens == 8
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4
    lists = client.completions.create(model="tiny", prompt=[[5, 6], [7, 8, 9]], max_tokens=3, temperature=0)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == 5


def test_return_token_ids(client):
    r = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    c = r.choices[0]
    assert c.prompt_token_ids == [5, 6, 7] and len(c.token_ids) == 4
    chat = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert (
        len(chat.choices[0].token_ids) == 4
        and chat.prompt_token_ids
        and chat.usage.prompt_tokens == len(chat.prompt_token_ids)
    )


def test_completion_stream_with_usage(client):
    whole = client.completions.create(model="tiny", prompt="stream me", max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="stream me",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1])
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_whole_and_streamed(client):
    whole = client.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=8, temperature=0)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant" and whole.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_string(client):
    base = client.completions.create(model="tiny", prompt="a stop test", max_tokens=16, temperature=0).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop.strip(), f"need a visible stop string, greedy text was {base!r}"
    cut = base[: base.index(stop)]
    r = client.completions.create(model="tiny", prompt="a stop test", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="a stop test", max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed) == cut


def test_logprobs_both_formats(client):
    r = client.completions.create(model="tiny", prompt="logprobs", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) >= 2 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    # greedy: the sampled token is the most likely one (the first token comes from prefill, the rest from decode)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_seed_makes_sampling_repeatable(client):
    body = {
        "model": "tiny",
        "prompt": "random words",
        "max_tokens": 8,
        "temperature": 1.0,
        "extra_body": {"top_k": 50, "return_token_ids": True},
    }
    runs = [client.completions.create(seed=seed, **body).choices[0].token_ids for seed in (1234, 1234, 99, 7)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1:]}) > 1  # other seeds sample something else


def test_logit_bias_through_pd(client):
    """OpenAI's logit_bias through the prefill worker (first token) and the decode worker (the rest):
    +100 forces a token, -100 bans the greedy one; out-of-vocabulary ids are a 400 naming the field."""
    ids = {"return_token_ids": True}
    forced = client.completions.create(
        model="tiny", prompt="hello", max_tokens=4, temperature=0, logit_bias={"42": 100}, extra_body=ids
    )
    assert forced.choices[0].token_ids == [42] * 4
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0, extra_body=ids)
    first = plain.choices[0].token_ids[0]
    banned = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=3,
        temperature=0,
        logit_bias={str(first): -100},
        extra_body=ids,
    )
    assert banned.choices[0].token_ids[0] != first and first not in banned.choices[0].token_ids
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logit_bias={"99999999": 1})
    assert e.value.param == "logit_bias"


def test_error_objects(cluster, client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, n=2, best_of=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=100000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", temperature=7)
    url = cluster.open_router.url
    hostile = [
        ("/v1/completions", b"{", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b"null", 400),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "x" * (9 << 20)}).encode(), 413),
        ("/internal/generate", b"{}", 404),
    ]
    for path, body, status in hostile:
        resp = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert resp.status_code == status, (path, body[:40], resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/health").status_code == 200  # still serving


def test_api_key(cluster):
    url = cluster.key_router.url
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 401  # every route, /health too
    assert httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    keyed = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert keyed.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_internal_routes_need_the_cluster_secret(cluster):
    worker = next(p for p in cluster.procs if p.role == "decode")
    assert httpx.get(f"{worker.url}/internal/info").status_code == 401
    assert (
        httpx.get(f"{worker.url}/internal/info", headers={"x-pdserve-cluster-secret": "test-cluster-secret"}).json()[
            "role"
        ]
        == "decode"
    )
    assert httpx.get(f"{worker.url}/health").status_code == 200


def test_backpressure_429_and_request_timeout(cluster):
    url = f"{cluster.tight_router.url}/v1/completions"
    long = {"model": "tiny", "prompt": "a", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=long) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        busy = httpx.post(url, json={"model": "tiny", "prompt": "b", "max_tokens": 2}, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        events = [line for line in lines if line.startswith("data: ")]  # ends by itself: the 2 s deadline
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "timeout" and "timed out" in error["message"]
    ok = httpx.post(url, json={"model": "tiny", "prompt": "b", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # the slot is free again
    deadline = time.monotonic() + 15  # the timed-out request was aborted on the workers
    while any(_blocks_used(p) for p in cluster.procs if p.role != "router") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_blocks_used(p) for p in cluster.procs if p.role != "router"] == [0, 0]


def _blocks_used(worker) -> float:
    text = httpx.get(f"{worker.url}/metrics").text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("pdserve_kv_blocks_used "))


def test_no_server_errors(cluster):
    for router in (cluster.open_router, cluster.tight_router):
        text = httpx.get(f"{router.url}/metrics").text
        five = [
            line
            for line in text.splitlines()
            if line.startswith("pdserve_router_requests_total") and 'status="5' in line and "/health" not in line
        ]
        assert five == []
