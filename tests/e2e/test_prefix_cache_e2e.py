"""Prefix caching seen from outside, on a real tiny PD cluster (prefill + decode over NIXL) through
the official openai client: a second identical request reports usage.prompt_tokens_details.
cached_tokens (the prefill worker's number), streamed usage too, with the same tokens; the prefill
worker's /metrics and /health count the cache, and no block stays used. A conversation's next turn
reads over NIXL only the blocks the decode worker does not hold from the turn before (checked
against their checksums), with the offline engine's tokens; the decode worker's /metrics count the
hit and the bytes saved, its /health cached blocks apart from used ones."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, auth_headers, scrape, wait_blocks_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 16
PROMPT = [(37 * i) % 900 + 5 for i in range(100)]  # (100 - 1) // 16 = 6 blocks can hit
LONG = "Explain, step by step and at length, how a prefill worker hands its KV cache to a decode worker. " * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_cache")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.prefill = c.worker("prefill", "--kv-block-size", str(BS))
        c.decode = c.worker("decode", "--kv-block-size", str(BS), peers=[c.prefill])
        c.api = c.router(prefill=[c.prefill], decode=[c.decode])
        c.wait_healthy()
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.api.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_second_identical_completion_reports_cached_tokens(client, cluster):
    before = scrape(cluster.prefill.url)
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    second = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 6 * BS
    assert second.choices[0].text == first.choices[0].text
    after = scrape(cluster.prefill.url)
    queries = after["pdserve_prefix_cache_queries_total"] - before.get("pdserve_prefix_cache_queries_total", 0)
    hits = after["pdserve_prefix_cache_hits_total"] - before.get("pdserve_prefix_cache_hits_total", 0)
    assert (queries, hits) == (2 * len(PROMPT), 6 * BS)
    assert after["pdserve_kv_blocks_cached"] > 0
    used = wait_blocks_free([cluster.prefill, cluster.decode])
    assert not any(used.values()), used
    health = httpx.get(f"{cluster.prefill.url}/health", headers=auth_headers(cluster.prefill), timeout=10).json()
    assert health["kv_blocks_cached"] > 0 and health["kv_blocks_used"] == 0


def test_streamed_chat_usage_carries_cached_tokens(client):
    msgs = [{"role": "user", "content": LONG}]

    def usage_and_text():
        text, usage = "", None
        stream = client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
        return usage, text

    u1, t1 = usage_and_text()
    u2, t2 = usage_and_text()
    assert u1.prompt_tokens > BS and t1 == t2
    assert u2.prompt_tokens_details.cached_tokens == (u2.prompt_tokens - 1) // BS * BS > 0
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    assert whole.usage.prompt_tokens_details.cached_tokens == u2.prompt_tokens_details.cached_tokens


def test_next_turn_reads_only_the_blocks_decode_lacks(client, cluster):
    def turn(prompt: list[int]) -> tuple[list[int], dict[str, float]]:
        """The answer's tokens, and what the decode worker's (and the router's) counters gained."""
        before = {**scrape(cluster.api.url), **scrape(cluster.decode.url)}
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
        )
        assert not any(wait_blocks_free([cluster.prefill, cluster.decode]).values())  # done, metrics synced
        after = {**scrape(cluster.api.url), **scrape(cluster.decode.url)}
        return out.choices[0].token_ids, {k: v - before.get(k, 0.0) for k, v in after.items()}

    p1 = [(11 * i) % 900 + 5 for i in range(70)]  # 5 blocks (tiny V3: one token region, latent)
    a, first = turn(p1)
    p2 = p1 + a + [(7 * i) % 900 + 3 for i in range(20)]  # 96 tokens: 6 blocks
    b, second = turn(p2)
    block = first["pdserve_kv_transfer_bytes_total"] / 5  # one block's bytes, all layers
    held = (len(p1) + len(a) - 1) // BS  # turn 1's prompt and answer (its last token never computed)
    assert held == 4 and first["pdserve_kv_transfer_bytes_saved_total"] == 0
    assert second["pdserve_kv_transfer_bytes_saved_total"] == held * block
    assert second["pdserve_router_kv_transfer_bytes_saved_total"] == held * block  # from decode's timing
    assert second["pdserve_kv_transfer_bytes_total"] == (6 - held) * block
    assert second["pdserve_prefix_cache_hits_total"] == held * BS
    assert second["pdserve_kv_verify_failures_total"] == 0 and second["pdserve_kv_verified_loads_total"] == 1
    llm = LLM(cluster.model_dir, kv_block_size=BS, num_kv_blocks=64, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[p1, p2], sampling_params=greedy6())]
    assert [a, b] == want
    health = httpx.get(f"{cluster.decode.url}/health", headers=auth_headers(cluster.decode), timeout=10).json()
    assert health["kv_blocks_cached"] >= held and health["kv_blocks_used"] == 0


def greedy6() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6)
