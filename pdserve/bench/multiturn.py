"""One level of the multi-turn and agentic benchmarks: conversations, each a chain of requests.

    conversation: turn 0 prompt = first
                  turn k+1 prompt = turn k prompt + turn k's answer (its token ids) + appended k
                  one turn at a time; the next is sent when the answer has streamed in full and
                  the conversation's think time for it has passed (agentic: the tool runs)

At most `concurrency` conversations are in flight (a thinking one holds its place, as a user
does), starting at Poisson arrivals of `request_rate` conversations/s (inf: all at once). The
answer's token ids come from the stream (vLLM's return_token_ids, which every payload asks for): a
server that sends none fails the later turns with that reason rather than sending prompts that
were never the conversation.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx

from pdserve.bench.client import RequestOutput, api_headers, build_payload, send_request
from pdserve.bench.dataset import BenchRequest, Conversation

NO_IDS = "an earlier turn's answer came without token ids (return_token_ids): nothing to append"
EARLIER_FAILED = "an earlier turn of this conversation failed"


async def run_conversations(
    base_url: str,
    endpoint: str,
    model: str,
    convs: list[Conversation],
    concurrency: int,
    request_rate: float,
    rng: random.Random,
    api_key: str | None = None,
    timeout: float = 600.0,
    on_done: Callable[[RequestOutput], None] | None = None,
) -> tuple[list[RequestOutput], float]:
    """Every turn's output, conversation by conversation in order, and the level's wall seconds."""
    url = base_url.rstrip("/") + endpoint
    headers = api_headers(api_key)
    gaps = [0.0 if request_rate == float("inf") else rng.expovariate(request_rate) for _ in convs]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()

        async def turns(conv: Conversation) -> list[RequestOutput]:
            async with semaphore:
                outs = []
                prompt = conv.first
                for k in range(conv.turns):
                    if k:
                        why = _why_not_next(outs[-1])
                        if why is not None:
                            for j in range(k, conv.turns):
                                outs.append(_failed(why, j))
                                if on_done is not None:
                                    on_done(outs[-1])
                            break
                        if conv.think(k):
                            await asyncio.sleep(conv.think(k))
                        prompt = prompt + outs[-1].output_ids + conv.appended[k - 1]
                    payload = build_payload(endpoint, model, BenchRequest(prompt, conv.output_lens[k]))
                    out = await send_request(client, url, payload, headers, t0)
                    out.turn = k
                    outs.append(out)
                    if on_done is not None:
                        on_done(out)
            return outs

        tasks = []
        for conv, gap in zip(convs, gaps):
            tasks.append(asyncio.create_task(turns(conv)))
            if gap:
                await asyncio.sleep(gap)
        per_conv = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return [o for outs in per_conv for o in outs], duration


def _why_not_next(last: RequestOutput) -> str | None:
    if not last.success:
        return EARLIER_FAILED
    if not last.output_ids:
        return NO_IDS
    return None


def _failed(error: str, turn: int) -> RequestOutput:
    out = RequestOutput(error=error)
    out.turn = turn
    return out
