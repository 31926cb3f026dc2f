"""cache_aware routing on a real tiny PD cluster: two prefill workers and one decode worker behind
two routers, one with the default prefill policy (auto: cache_aware here, since both workers keep a
prefix cache) and one round_robin. A multi-turn chat workload (each turn resends
the conversation so far, the previous answer included) through the official openai client, one
request at a time; which prefill worker served each request is read from the workers' own
pdserve_prompt_tokens counters. With cache_aware every later turn goes to its conversation's first
worker and reports cached prompt tokens; with round_robin about half go there, and fewer tokens
are found cached."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, scrape

pytestmark = pytest.mark.timeout(600)

CONVERSATIONS = 4
TURNS = 5  # odd: round robin over two workers, one conversation at a time, sends half of the later turns home
WORDS = ("cache", "prefix", "token", "block", "decode", "prefill", "router", "worker", "tree", "turn")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_aware")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.prefills = [c.worker("prefill"), c.worker("prefill")]
        decode = c.worker("decode", peers=c.prefills)
        c.aware = c.router(prefill=c.prefills, decode=[decode])  # the default: auto
        c.rr = c.router("--prefill-policy", "round_robin", prefill=c.prefills, decode=[decode])
        c.wait_healthy()
        yield c


def _served_by(c: Cluster) -> list[float]:
    return [scrape(p.url)["pdserve_prompt_tokens_total"] for p in c.prefills]


def _run(c: Cluster, router_url: str, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each conversation's turns, one request at a time: the index of the prefill worker of each,
    and the prompt tokens each reported served from the prefix cache (usage.prompt_tokens_details)."""
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(seed)
    workers, cached = [], []
    for _ in range(CONVERSATIONS):
        messages = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(40))}]
        served, hits = [], []
        for _ in range(TURNS):
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(6))})
            before = _served_by(c)
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
            after = _served_by(c)
            grew = [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
            assert len(grew) == 1, (before, after)  # exactly one prefill worker ran this prompt
            served.append(grew[0])
            hits.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        workers.append(served)
        cached.append(hits)
    return workers, cached


def _outcomes(url: str) -> dict[str, float]:
    """The cache_aware router's prefill choices by outcome (cache, cold, balance)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.labels["outcome"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "pdserve_router_cache_aware_routes_total" and s.labels["role"] == "prefill" and s.value
    }


def _home_share(workers: list[list[int]]) -> float:
    later = [w == turns[0] for turns in workers for w in turns[1:]]
    return sum(later) / len(later)


def test_cache_aware_keeps_conversations_on_their_worker(cluster):
    aware, aware_cached = _run(cluster, cluster.aware.url, seed=1)
    assert _home_share(aware) == 1.0, aware
    assert all(n > 0 for turns in aware_cached for n in turns[1:]), aware_cached  # every later turn hits
    assert sorted(t[0] for t in aware) == [0, 0, 1, 1], aware  # new conversations spread: the emptier tree
    routes = _outcomes(cluster.aware.url)
    assert routes == {"cold": CONVERSATIONS, "cache": CONVERSATIONS * (TURNS - 1)}, routes
    assert scrape(cluster.aware.url)["pdserve_router_cache_aware_matched_tokens_total"] > 0

    rr, rr_cached = _run(cluster, cluster.rr.url, seed=2)
    assert 0.25 <= _home_share(rr) <= 0.75, rr
    # round robin finds less: a turn sent away from its last worker finds only an older turn's prefix
    assert sum(map(sum, rr_cached)) < sum(map(sum, aware_cached)), (rr_cached, aware_cached)
