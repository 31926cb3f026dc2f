"""Structured outputs end to end through a real PD cluster on CPU (prefill, decode, NIXL over UCX,
the router) and a colocated worker, with the official openai client and vLLM's request field
`structured_outputs`: 100 random JSON schemas (tests/helpers/schemas.py), every answer that
finishes with "stop" validates against its schema (jsonschema), PD's answers equal colocated's
(seeded sampling), a spec the grammar library rejects is a 400 naming the problem."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, free_port, wait_blocks_free
from tests.helpers.schemas import random_schemas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N = 100
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured_e2e")
    model = make_tiny_model(root / "tiny")
    with Cluster(model, root / "logs", kv_blocks=512, max_num_seqs=64) as c:
        dport = free_port()
        prefill = c.worker("prefill", "--peer", f"http://127.0.0.1:{dport}")
        decode = c.worker("decode", peers=[prefill], port=dport)
        both = c.worker("colocated")
        c.pd_router = c.router(prefill=[prefill], decode=[decode])
        c.colo_router = c.router(colocated=[both])
        c.wait_healthy()
        c.workers = [prefill, decode, both]
        yield c


def _client(router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=600)


async def _answers(router, schemas, endpoint: str) -> list[tuple[str, str]]:
    """(finish_reason, text) of each schema's answer; completions or chat completions."""
    client = _client(router)
    sem = asyncio.Semaphore(32)

    async def one(i, schema):
        kw = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i)
        kw["extra_body"] = {"structured_outputs": {"json": schema}}
        async with sem:
            if endpoint == "completions":
                c = (await client.completions.create(prompt=f"Answer {i} as JSON:", **kw)).choices[0]
                return c.finish_reason, c.text
            messages = [{"role": "user", "content": f"Answer {i} as JSON."}]
            c = (await client.chat.completions.create(messages=messages, **kw)).choices[0]
            return c.finish_reason, c.message.content

    try:
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
    finally:
        await client.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_random_schemas_through_pd_validate_and_equal_colocated(cluster, endpoint):
    schemas = random_schemas(N, seed=28)
    pd = asyncio.run(_answers(cluster.pd_router, schemas, endpoint))
    colo = asyncio.run(_answers(cluster.colo_router, schemas, endpoint))
    stopped = 0
    for (finish, text), schema in zip(pd, schemas):
        assert finish in ("stop", "length")
        if finish == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text), schema)
    assert stopped >= 0.95 * N
    assert pd == colo
    assert not any(wait_blocks_free(cluster.workers).values())


async def _one(router, endpoint: str, so: dict, max_tokens: int = 40) -> tuple[str, str]:
    client = _client(router)
    kw = dict(model="tiny", max_tokens=max_tokens, temperature=0, extra_body={"structured_outputs": so})
    try:
        if endpoint == "completions":
            c = (await client.completions.create(prompt="answer:", **kw)).choices[0]
            return c.finish_reason, c.text
        c = (await client.chat.completions.create(messages=[{"role": "user", "content": "answer"}], **kw)).choices[0]
        return c.finish_reason, c.message.content
    finally:
        await client.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_regex_and_choice_through_pd(cluster, endpoint):
    finish, text = asyncio.run(_one(cluster.pd_router, endpoint, {"regex": "[A-Z]{3}-[0-9]{2,4}"}))
    assert finish == "stop" and re.fullmatch("[A-Z]{3}-[0-9]{2,4}", text)
    finish, text = asyncio.run(_one(cluster.pd_router, endpoint, {"choice": ["left", "right"]}))
    assert finish == "stop" and text in ("left", "right")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_rejected_spec_is_a_400_naming_the_problem(cluster, endpoint):
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        asyncio.run(_one(cluster.pd_router, endpoint, {"regex": "a(b"}, max_tokens=4))
