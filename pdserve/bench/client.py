"""Async streaming client: one level of the sweep at a fixed concurrency.

Each request streams from an OpenAI-compatible endpoint and records, on a
monotonic clock, its time to first token, every inter-token gap and its
end-to-end latency; token counts come from the final `usage` chunk
(`stream_options.include_usage`), the prompt tokens the server found in its
prefix cache from its `usage.prompt_tokens_details.cached_tokens` where it says
so. A failed request is a value with its error, never an exception out of the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.dataset import BenchRequest


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # perf_counter seconds, relative to the level's start
    ttft: float = 0.0  # s, request sent -> first token chunk
    itl: list[float] = field(default_factory=list)  # s, gaps between token chunks
    latency: float = 0.0  # s, request sent -> end of stream
    prompt_tokens: int = 0  # usage.prompt_tokens
    output_tokens: int = 0  # usage.completion_tokens
    usage_reported: bool = False  # False: counts were taken from the stream itself
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    output_ids: list[int] = field(default_factory=list)  # the answer's token ids, where chunks carry them
    turn: int = 0  # multi-turn: the turn this request was (0: the first, or not a conversation)


WRONG_KEY = "401: wrong or missing API key (--api-key, or $OPENAI_API_KEY)"


def api_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class WrongKey(ValueError):
    """The server answered 401: no request would get through."""

    def __init__(self) -> None:
        super().__init__(WRONG_KEY)


def build_payload(endpoint: str, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,  # vLLM/SGLang extension: the output length is exact
        "return_token_ids": True,  # vLLM extension: chunks say how many tokens they carry
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.endswith("/chat/completions"):
        if not isinstance(req.prompt, str):
            raise ValueError(f"{endpoint} takes text messages; random token-id prompts need /v1/completions")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """Tokens one streamed choice carries: its token ids where the server sends them (vLLM's
    return_token_ids); else one per chunk. A completions chunk with empty text and no
    finish_reason is still a token (a detokenizer holding back a partial UTF-8 sequence);
    a bare finish marker, or a chat delta without content (the role chunk), is none."""
    ids = choice.get("token_ids")
    if ids:
        return len(ids)
    if "delta" in choice:
        return 1 if (choice["delta"] or {}).get("content") else 0
    return 1 if choice.get("text") or choice.get("finish_reason") is None else 0


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str], t0: float
) -> RequestOutput:
    out = RequestOutput()
    start = time.perf_counter()
    out.start_time = start - t0
    last = start
    streamed_tokens = 0
    done = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                out.error = WRONG_KEY if resp.status_code == 401 else f"HTTP {resp.status_code}: {body[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return out
                now = time.perf_counter()
                choices = chunk.get("choices") or []
                n = sum(_chunk_tokens(c) for c in choices)
                finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
                if finish in ("error", "abort"):
                    out.error = f"finish_reason {finish}"
                    return out
                if n == 0 and finish and streamed_tokens == 0:
                    n = 1  # the server held every token's text back until the end
                for c in choices:
                    out.output_ids += c.get("token_ids") or []
                if n:
                    if streamed_tokens == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    streamed_tokens += n
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    out.usage_reported = True
                    out.cached_tokens = _cached_tokens(usage)
    except Exception as e:  # a broken server or stream fails this request, never the run
        out.error = f"{type(e).__name__}: {str(e) or repr(e)}"[:300]
        return out
    if not done:
        out.error = "stream ended before [DONE]"
        return out
    if streamed_tokens == 0:
        out.error = "stream finished without any token"
        return out
    out.latency = time.perf_counter() - start
    if not out.usage_reported:
        out.output_tokens = streamed_tokens
    out.success = True
    return out


async def fetch_models(base_url: str, api_key: str | None, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The server's /v1/models entries (id, root, max_model_len, ... as the server gives them)."""
    async with httpx.AsyncClient(timeout=timeout) as client:
        resp = await client.get(f"{base_url.rstrip('/')}/v1/models", headers=api_headers(api_key))
        if resp.status_code == 401:
            raise WrongKey()
        resp.raise_for_status()
        return list(resp.json().get("data") or [])


async def run_level(
    base_url: str,
    endpoint: str,
    model: str,
    requests: list[BenchRequest],
    concurrency: int,
    request_rate: float,
    rng: random.Random,
    api_key: str | None = None,
    timeout: float = 600.0,
    on_done: Callable[[RequestOutput], None] | None = None,
) -> tuple[list[RequestOutput], float]:
    """Send `requests` with at most `concurrency` in flight and Poisson arrivals at
    `request_rate` req/s (inf: all at once). Returns outputs in request order and
    the level's wall duration in seconds."""
    url = base_url.rstrip("/") + endpoint
    headers = api_headers(api_key)
    payloads = [build_payload(endpoint, model, r) for r in requests]
    gaps = [0.0 if request_rate == float("inf") else rng.expovariate(request_rate) for _ in payloads]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(payload: dict[str, Any]) -> RequestOutput:
            async with semaphore:
                out = await send_request(client, url, payload, headers, t0)
            if on_done is not None:
                on_done(out)
            return out

        tasks = []
        for payload, gap in zip(payloads, gaps):
            tasks.append(asyncio.create_task(one(payload)))
            if gap:
                await asyncio.sleep(gap)
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(outputs), duration
