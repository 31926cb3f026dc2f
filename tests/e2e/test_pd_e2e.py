"""PD end to end on CPU: real prefill, decode and colocated workers, real NIXL (UCX) transfer, two
routers (one PD, one colocated), the official openai client.

- greedy output through PD equals the colocated worker's, token for token
- 20 concurrent requests (streamed and not) all equal their colocated outputs
- KV bytes were transferred; afterwards no KV block is in use on any worker
- a client that leaves mid-stream frees the decode's blocks (and prefill's)
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, free_port

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "The quick brown fox",
    "Prefill and decode run on different workers, and",
    "a",
    "DeepSeek models use multi-head latent attention " * 6,
]
CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}],
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd_e2e")
    model = make_tiny_model(root / "tiny")
    with Cluster(model, root / "logs") as c:
        dport = free_port()  # prefill names its decode peer, as `pdserve launch` does: it hands off directly
        prefill = c.worker("prefill", "--peer", f"http://127.0.0.1:{dport}")
        decode = c.worker("decode", peers=[prefill], port=dport)
        both = c.worker("colocated")
        c.pd_router = c.router(prefill=[prefill], decode=[decode])
        c.colo_router = c.router(colocated=[both])
        c.wait_healthy()
        c.prefill, c.decode, c.both = prefill, decode, both
        yield c


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(router, prompt, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return (
        _client(router)
        .completions.create(model="tiny", prompt=prompt, extra_body={"return_token_ids": True}, **kw)
        .choices[0]
    )


def _chat(router, messages, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return _client(router).chat.completions.create(
        model="tiny", messages=messages, extra_body={"return_token_ids": True}, **kw
    )


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):  # parses: the exposition format is valid
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _wait_blocks_free(c: Cluster, timeout_s: float = 15.0) -> dict[str, float]:
    """KV blocks in use per worker, once all are 0 (release notifications arrive asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {p.name: _scrape(p.url)["pdserve_kv_blocks_used"] for p in (c.prefill, c.decode, c.both)}
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def test_all_healthy(cluster):
    for r in (cluster.pd_router, cluster.colo_router):
        assert httpx.get(f"{r.url}/health").status_code == 200
    workers = httpx.get(f"{cluster.pd_router.url}/workers").json()["workers"]
    assert [(w["role"], w["healthy"]) for w in workers] == [("prefill", True), ("decode", True)]


def test_pd_greedy_equals_colocated(cluster):
    for prompt in PROMPTS:
        pd, colo = _complete(cluster.pd_router, prompt), _complete(cluster.colo_router, prompt)
        assert pd.token_ids == colo.token_ids and len(pd.token_ids) == 12, prompt
        assert pd.text == colo.text and pd.finish_reason == colo.finish_reason == "length"
        assert pd.prompt_token_ids == colo.prompt_token_ids
    for messages in CHATS:
        pd, colo = _chat(cluster.pd_router, messages), _chat(cluster.colo_router, messages)
        assert pd.choices[0].token_ids == colo.choices[0].token_ids
        assert pd.choices[0].message.content == colo.choices[0].message.content
        assert pd.usage == colo.usage


def test_pd_streamed_equals_whole(cluster):
    whole = _complete(cluster.pd_router, PROMPTS[1], max_tokens=12)
    stream = _client(cluster.pd_router).completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    ids = [t for ch in chunks for t in (ch.choices[0].token_ids or [])]
    assert ids == whole.token_ids
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text
    assert chunks[0].choices[0].token_ids == whole.token_ids[:1]  # the first token comes alone, from prefill
    assert chunks[-1].choices[0].finish_reason == "length"


def test_first_token_stop_ends_at_prefill(cluster):
    pd, colo = (
        _complete(cluster.pd_router, PROMPTS[0], max_tokens=1),
        _complete(cluster.colo_router, PROMPTS[0], max_tokens=1),
    )
    assert pd.token_ids == colo.token_ids and len(pd.token_ids) == 1 and pd.finish_reason == "length"


async def test_concurrent_requests_all_correct(cluster):
    prompts = [f"request number {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(20)]
    expected = [_complete(cluster.colo_router, p, max_tokens=10).token_ids for p in prompts]
    before = _scrape(cluster.decode.url)
    client = openai.AsyncOpenAI(base_url=f"{cluster.pd_router.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> list[int]:
        body = {
            "model": "tiny",
            "prompt": prompts[i],
            "max_tokens": 10,
            "temperature": 0,
            "extra_body": {"return_token_ids": True},
        }
        if i % 2:
            return (await client.completions.create(**body)).choices[0].token_ids
        ids: list[int] = []
        async for ch in await client.completions.create(stream=True, **body):
            ids += ch.choices[0].token_ids or []
        return ids

    got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    await client.close()
    assert got == expected
    after = _scrape(cluster.decode.url)
    assert after["pdserve_kv_transfer_bytes_total"] > before["pdserve_kv_transfer_bytes_total"]
    assert after["pdserve_kv_transfer_seconds_count"] - before["pdserve_kv_transfer_seconds_count"] == len(prompts)
    assert after["pdserve_decode_batch_size_count"] > 0


def test_kv_transfer_bytes_and_no_blocks_left(cluster):
    _complete(cluster.pd_router, PROMPTS[3])
    assert _scrape(cluster.decode.url)["pdserve_kv_transfer_bytes_total"] > 0
    assert _wait_blocks_free(cluster) == {cluster.prefill.name: 0, cluster.decode.name: 0, cluster.both.name: 0}
    prefill = _scrape(cluster.prefill.url)
    assert prefill["pdserve_kv_blocks_total"] > 0 and prefill["pdserve_prompt_tokens_total"] > 0
    assert prefill["pdserve_kv_lease_expirations_total"] == 0  # every lease ended by decode's release
    assert prefill["pdserve_prefill_step_seconds_count"] > 0
    decode = _scrape(cluster.decode.url)
    assert decode["pdserve_decode_step_seconds_count"] > 0 and decode["pdserve_decode_batch_size_count"] > 0


def test_client_leaving_mid_stream_frees_blocks(cluster):
    aborted_before = _scrape(cluster.decode.url).get("pdserve_request_success_total", 0)
    body = {
        "model": "tiny",
        "prompt": PROMPTS[2],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{cluster.pd_router.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens (SSE events and blank lines), then leave
        assert any(line.startswith("data: {") for line in got)
    assert _wait_blocks_free(cluster) == {cluster.prefill.name: 0, cluster.decode.name: 0, cluster.both.name: 0}
    decode = httpx.get(f"{cluster.decode.url}/metrics").text
    assert 'pdserve_request_success_total{finish_reason="abort"}' in decode
    assert _scrape(cluster.decode.url)["pdserve_request_success_total"] > aborted_before
    assert httpx.get(f"{cluster.pd_router.url}/health").status_code == 200


def test_router_metrics_count_requests(cluster):
    m = _scrape(cluster.pd_router.url)
    assert m["pdserve_router_requests_total"] > 0
    assert m["pdserve_time_to_first_token_seconds_count"] > 0 and m["pdserve_e2e_request_latency_seconds_count"] > 0
    text = httpx.get(f"{cluster.pd_router.url}/metrics").text
    assert not re.search(r'route="/v1[^"]*",status="5', text)  # (/health was 503 during startup)
    assert 'pdserve_router_worker_healthy{role="decode"' in text
    # every hand-off went from prefill's engine to decode's: none needed the router's POST
    assert m["pdserve_router_pd_handoffs_total"] > 0 and 'pdserve_router_pd_handoffs_total{via="router"}' not in text


def test_stop_string_spanning_the_handoff(cluster):
    """A stop string that starts in prefill's first token and ends in decode's second: the text the
    router streamed after prefill must not contain what the stop string later cuts."""
    for prompt in PROMPTS + [f"try {i}" for i in range(20)]:
        lp = _complete(cluster.colo_router, prompt, max_tokens=6, logprobs=0).logprobs
        t0, t1 = lp.tokens[0], lp.tokens[1]
        if t0.isascii() and t1.isascii() and t0.strip() and t1.strip():
            break
    else:
        pytest.fail("no prompt whose first two greedy tokens are plain ASCII")
    stop = t0[-1] + t1[0]
    text = _complete(cluster.colo_router, prompt, max_tokens=6).text
    expected = text[: text.index(stop)]
    for router in (cluster.pd_router, cluster.colo_router):
        whole = _complete(router, prompt, max_tokens=6, stop=[stop])
        assert (whole.text, whole.finish_reason) == (expected, "stop")
        streamed = _client(router).completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, stop=[stop], stream=True
        )
        assert "".join(ch.choices[0].text for ch in streamed) == expected
