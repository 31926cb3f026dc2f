"""Random OpenAI tool sets from a seed (parameters: tests/helpers/schemas.py's nested, bounded
object schemas, some with every parameter optional), and the check that a parsed tool call is
one of them with arguments that validate (jsonschema)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import jsonschema
import openai

from tests.helpers.schemas import random_schema

NAMES = ["get_weather", "search", "book.flight", "send-mail", "lookup_user", "calc", "translate", "ping"]


def random_tools(rng: random.Random) -> list[dict[str, Any]]:
    """1-3 functions; a quarter of them with all parameters optional, one in eight with none."""
    tools = []
    for name in rng.sample(NAMES, rng.randint(1, 3)):
        params = random_schema(rng)
        if rng.random() < 0.25:
            params.pop("required")
        if rng.random() < 0.125:
            params = {"type": "object", "properties": {}}
        tools.append(
            {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": params}}
        )
    return tools


def random_tool_sets(n: int, seed: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    return [random_tools(rng) for _ in range(n)]


def assert_valid_call(name: str, arguments: str, tools: list[dict[str, Any]]) -> None:
    """`name` is one of `tools` and `arguments` (a JSON object's text) validates against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert name in schemas, name
    jsonschema.validate(json.loads(arguments), schemas[name])


async def ask_all(url: str, bodies: list[dict], messages: list[dict], concurrency: int) -> list:
    """Each body's chat completion (its first choice) through the official async openai client
    against the router at url, at most `concurrency` in flight, in the bodies' order."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def one(body):
        async with sem:
            return (await client.chat.completions.create(model="tiny", messages=messages, **body)).choices[0]

    try:
        return await asyncio.gather(*(one(b) for b in bodies))
    finally:
        await client.close()
