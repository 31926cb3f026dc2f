"""n > 1 and best_of through a real PD cluster (tiny V4, prefill + decode, NIXL), with the
official openai client: one prefill (the prefill worker counts the prompt once), decode forks;
choice i of a seeded request is what a lone request seeded seed + i gets; greedy n = 2 answers
equal the n = 1 answer; streamed chunks carry their choice's index and reassemble into the whole
response; usage counts the prompt once; best_of returns the most likely; an n = 4 stream closed
mid-way leaves no KV block held on either worker."""

from __future__ import annotations

import openai
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, scrape, wait_blocks_free

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
PROMPT = [(i * 7 + 3) % 200 + 5 for i in range(45)]
SEED = 7


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tiny = make_tiny_model(tmp_path_factory.mktemp("n_v4") / "tiny", arch="deepseek_v4", seed=0)
    with Cluster(tiny, tmp_path_factory.mktemp("n_logs"), kv_blocks=256) as c:
        prefill = c.worker("prefill", "--kv-block-size", "16")
        decode = c.worker("decode", "--kv-block-size", "16", peers=[prefill])
        router = c.router(prefill=[prefill], decode=[decode])
        c.wait_healthy()
        client = openai.OpenAI(api_key="none", base_url=f"{router.url}/v1", max_retries=0, timeout=120)
        yield client, prefill, decode


def complete(client, **kw):
    return client.completions.create(model="tiny", prompt=PROMPT, extra_body={"ignore_eos": True}, **kw)


def test_each_choice_is_its_seeded_lone_request_and_the_prompt_is_prefilled_once(cluster):
    client, prefill, decode = cluster
    before = scrape(prefill.url)["pdserve_prompt_tokens_total"]
    resp = complete(client, n=3, max_tokens=12, temperature=1.0, seed=SEED)
    assert scrape(prefill.url)["pdserve_prompt_tokens_total"] - before == len(PROMPT)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.prompt_tokens == len(PROMPT)
    assert resp.usage.completion_tokens == 3 * 12
    lone = [complete(client, max_tokens=12, temperature=1.0, seed=SEED + i).choices[0].text for i in range(3)]
    assert [c.text for c in resp.choices] == lone
    assert len(set(lone)) == 3


def test_greedy_n_2_chat_equals_n_1(cluster):
    client, _, _ = cluster
    messages = [{"role": "user", "content": "Count to ten."}]
    kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    one = client.chat.completions.create(**kw).choices[0].message.content
    two = client.chat.completions.create(n=2, **kw)
    assert [c.message.content for c in two.choices] == [one, one]
    assert [c.index for c in two.choices] == [0, 1]


def test_stream_chunks_carry_their_index_and_reassemble(cluster):
    client, _, _ = cluster
    whole = complete(client, n=3, max_tokens=10, temperature=1.0, seed=SEED + 10)
    texts, reasons = ["", "", ""], [None] * 3
    for chunk in complete(client, n=3, max_tokens=10, temperature=1.0, seed=SEED + 10, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in whole.choices]
    assert reasons == ["length"] * 3


def test_best_of_and_its_limits(cluster):
    client, _, _ = cluster
    best = complete(client, n=1, best_of=4, max_tokens=8, temperature=1.0, seed=SEED, logprobs=0)
    assert len(best.choices) == 1
    lone = [complete(client, max_tokens=8, temperature=1.0, seed=SEED + i, logprobs=0).choices[0] for i in range(4)]
    top = max(lone, key=lambda c: sum(c.logprobs.token_logprobs))
    assert best.choices[0].text == top.text
    with pytest.raises(openai.BadRequestError, match="best_of"):
        complete(client, n=1, best_of=2, max_tokens=4, stream=True)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        complete(client, n=3, best_of=2, max_tokens=4)


def test_n_4_stream_closed_mid_way_frees_every_block(cluster):
    client, prefill, decode = cluster
    stream = complete(client, n=4, max_tokens=400, temperature=1.0, seed=SEED, stream=True)
    seen = 0
    for chunk in stream:
        seen += len(chunk.choices)
        if seen >= 12:
            break
    stream.close()
    assert wait_blocks_free([prefill, decode]) == {prefill.name: 0, decode.name: 0}
