"""The chaos run's load (scripts/chaos.py): clients sending completions, streamed and not, greedy
with ignore_eos and return_token_ids, from a pool of seeded token-id prompts, and what each saw.

A client retries a refused connection (the router is restarting), a 429, and a 503 with
Retry-After while time remains (as the openai client does); nothing else. The uninterrupted
answer to each prompt is taken before the first fault (`references`), and every answer is compared
with it token by token (chaos_report.py counts duplicated and missing tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from scripts.chaos_cluster import MODEL

TIMEOUT_MARGIN_S = 15.0


@dataclass
class Outcome:
    index: int
    prompt: int
    stream: bool = False
    kind: str = "ok"  # ok | error | connection_lost | hang | short
    code: str | None = None
    message: str = ""
    start: float = 0.0
    end: float = 0.0
    retries: int = 0
    token_ids: list[int] = field(default_factory=list)


class Load:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        rng = random.Random(args.seed)
        self.args = args
        self.url = url + "/v1/completions"
        self.prompts = [[rng.randrange(10, 800) for _ in range(rng.randrange(4, 40))] for _ in range(16)]
        self.max_tokens = [rng.randrange(2, args.max_tokens + 1) for _ in self.prompts]
        self.rng = rng
        self.outcomes: list[Outcome] = []
        self.references: list[list[int]] = []
        self.faults_done = asyncio.Event()

    async def take_references(self, client: httpx.AsyncClient) -> None:
        """Each prompt's uninterrupted answer, before any fault."""
        outs = [Outcome(-1, i) for i in range(len(self.prompts))]
        await asyncio.gather(*(self.one(client, out, stream=False) for out in outs))
        for out in outs:
            if out.kind != "ok":
                raise RuntimeError(f"no reference answer for prompt {out.prompt}: {out.kind} {out.message}")
            self.references.append(out.token_ids)

    async def run(self, client: httpx.AsyncClient) -> None:
        async def worker() -> None:
            while len(self.outcomes) < self.args.requests or not self.faults_done.is_set():
                out = Outcome(len(self.outcomes), self.rng.randrange(len(self.prompts)), self.rng.random() < 0.5)
                self.outcomes.append(out)
                await self.one(client, out, stream=out.stream)

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    async def one(self, client: httpx.AsyncClient, out: Outcome, stream: bool) -> None:
        body = {"model": MODEL, "prompt": self.prompts[out.prompt], "max_tokens": self.max_tokens[out.prompt],
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}  # fmt: skip
        out.start = time.monotonic()
        deadline = out.start + self.args.request_timeout + TIMEOUT_MARGIN_S
        while True:
            out.token_ids = []  # a retried request starts over: only a refusal is retried, nothing streamed
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    retry = await (self._stream(client, body, out) if stream else self._whole(client, body, out))
                if not retry:
                    break
            except httpx.ConnectError:  # nothing listens: the router is restarting, as a client would, retry
                retry = True
            except TimeoutError:
                out.kind, out.message = "hang", f"no answer within {self.args.request_timeout + TIMEOUT_MARGIN_S:.0f} s"
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                out.kind, out.message = "connection_lost", type(e).__name__
                break
            except ValueError as e:  # not JSON: not an OpenAI answer
                out.kind, out.message = "short", f"not JSON: {e}"
                break
            out.retries += 1
            await asyncio.sleep(0.5)
        out.end = time.monotonic()
        if out.kind == "ok" and len(out.token_ids) != body["max_tokens"]:
            out.kind, out.message = "short", f"{len(out.token_ids)} of {body['max_tokens']} tokens"

    async def _whole(self, client: httpx.AsyncClient, body: dict, out: Outcome) -> bool:
        resp = await client.post(self.url, json=body)
        data = resp.json()
        if resp.status_code != 200:
            return self._refused(out, resp.status_code, resp.headers, data)
        out.token_ids = data["choices"][0]["token_ids"]
        return False

    async def _stream(self, client: httpx.AsyncClient, body: dict, out: Outcome) -> bool:
        async with client.stream("POST", self.url, json=body) as resp:
            if resp.status_code != 200:
                return self._refused(out, resp.status_code, resp.headers, json.loads(await resp.aread()))
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return _error(out, chunk)
                for choice in chunk.get("choices", []):
                    out.token_ids += choice.get("token_ids") or []
        return False

    def _refused(self, out: Outcome, status: int, headers: httpx.Headers, data: dict) -> bool:
        """Retry (True) a 429, or a 503 with Retry-After while time remains, as the openai client does."""
        deadline = out.start + self.args.request_timeout
        if status == 429 or (status == 503 and "retry-after" in headers and time.monotonic() + 1 < deadline):
            return True
        return _error(out, data)


def _error(out: Outcome, data: dict) -> bool:
    """An OpenAI error object: clear if it has a message (else it counts as a bad answer)."""
    err = data.get("error") or {}
    out.kind = "error" if err.get("message") else "short"
    out.code, out.message = err.get("code"), err.get("message", json.dumps(data)[:200])
    return False


async def probe(client: httpx.AsyncClient, url: str) -> list[int] | None:
    """A small greedy completion's token ids, None if it failed."""
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    try:
        resp = await client.post(url + "/v1/completions", json=body, timeout=30)
        return resp.json()["choices"][0]["token_ids"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None
