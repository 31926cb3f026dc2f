"""Load test: N requests at concurrency C against a running pdserve router, then the leak checks.

    python scripts/load_test.py --base-url http://127.0.0.1:8000 --num-requests 1000 --concurrency 64 \
        --max-tokens 32 [--pids router=123,prefill=456] [--model NAME]

The requests mix /v1/completions and /v1/chat/completions, streamed and not, short and long
prompts (many over one KV block, a few long enough to be chunked by a worker with a small
max_num_batched_tokens), greedy, max_tokens drawn from 1..--max-tokens, with vLLM's
`return_token_ids` so that outputs can be compared token for token (tests/e2e/test_load.py compares
them with the offline engine). A 429 is retried after its Retry-After; any other failure (an HTTP
error, a cut stream, an error event) counts as failed and is never retried.

While it runs it samples the RSS of the router and of every worker the router lists (found by
their listening ports, or given with --pids); afterwards it reads pdserve_kv_blocks_used from each
worker. Exit status 0 only if every request completed and no KV block is left in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil

WORDS = (
    "prefill decode router worker block cache latent attention expert token stream batch sparse "
    "index queue lease transfer memory kernel model request layer rope shard chunk page tensor"
).split()
MIB = 1 << 20


# -- the workload --
@dataclass
class Job:
    index: int
    route: str  # "completions" | "chat"
    stream: bool
    max_tokens: int
    ignore_eos: bool
    prompt: str | None = None  # completions
    messages: list[dict[str, str]] | None = None  # chat

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": self.ignore_eos,
            "return_token_ids": True, "stream": self.stream,
        }  # fmt: skip
        if self.stream and self.index % 2:
            body["stream_options"] = {"include_usage": True}
        if self.route == "chat":
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body


def _text(rng: random.Random, index: int) -> str:
    """About 6-10 tokens (50%), 20-40 (40%), 55-110 (8%) or 140-250 (2%): within one 16-token KV
    block, over a few, over several, and over a 128-token prefill step (chunked). Kept short: the
    tiny model's CPU attention is quadratic in the prompt."""
    r = rng.random()
    lo, hi = (1, 2) if r < 0.5 else (5, 10) if r < 0.9 else (15, 30) if r < 0.98 else (40, 70)
    return f"#{index} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_jobs(n: int, max_tokens: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        route = "chat" if rng.random() < 0.4 else "completions"
        job = Job(i, route, rng.random() < 0.5, rng.randint(1, max_tokens), rng.random() < 0.5)
        if route == "chat":
            job.messages = [{"role": "user", "content": _text(rng, i)}]
            if rng.random() < 0.3:
                job.messages.insert(0, {"role": "system", "content": "Answer in one line."})
            if rng.random() < 0.2:
                job.messages[-1:-1] = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
        else:
            job.prompt = _text(rng, i)
        jobs.append(job)
    return jobs


# -- one request --
@dataclass
class Result:
    index: int
    ok: bool = False
    error: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    latency_s: float = 0.0  # first send -> last byte, retries included
    ttft_s: float | None = None  # streams: first send -> first token
    retries: int = 0  # 429s answered


class Retry(Exception):
    def __init__(self, after_s: float) -> None:
        self.after_s = after_s


async def send(client: httpx.AsyncClient, base_url: str, job: Job, model: str, deadline: float) -> Result:
    """One job to its end; a 429 is retried until `deadline` (monotonic); failures are values."""
    res = Result(job.index)
    url = f"{base_url}/v1/{'chat/completions' if job.route == 'chat' else 'completions'}"
    t0 = time.monotonic()
    while True:
        try:
            if job.stream:
                await _stream(client, url, job.body(model), res, t0)
            else:
                await _whole(client, url, job.body(model), res)
            res.ok = True
        except Retry as r:
            if time.monotonic() + r.after_s < deadline:
                res.retries += 1
                await asyncio.sleep(r.after_s)
                continue
            res.error = f"still 429 after {res.retries} retries"
        except Exception as e:  # a broken request fails itself, never the run
            res.error = f"{type(e).__name__}: {str(e) or repr(e)}"[:300]
        res.latency_s = time.monotonic() - t0
        return res


def _check_status(resp: httpx.Response, body: bytes) -> None:
    if resp.status_code == 429:
        raise Retry(min(float(resp.headers.get("retry-after", "1")), 5.0))
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {body[:300].decode(errors='replace')}")


async def _whole(client: httpx.AsyncClient, url: str, body: dict, res: Result) -> None:
    resp = await client.post(url, json=body)
    _check_status(resp, resp.content)
    data = resp.json()
    choice = data["choices"][0]
    res.token_ids = list(choice["token_ids"])
    res.prompt_token_ids = list(choice.get("prompt_token_ids") or data.get("prompt_token_ids") or [])
    res.finish_reason = choice["finish_reason"]


async def _stream(client: httpx.AsyncClient, url: str, body: dict, res: Result, t0: float) -> None:
    res.token_ids, res.finish_reason = [], None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            _check_status(resp, await resp.aread())
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:300]}")
            if chunk.get("prompt_token_ids"):  # chat: on the first chunk
                res.prompt_token_ids = list(chunk["prompt_token_ids"])
            for choice in chunk.get("choices") or []:  # none in the usage chunk
                if choice.get("prompt_token_ids"):  # completions: in the first choice
                    res.prompt_token_ids = list(choice["prompt_token_ids"])
                if choice.get("token_ids"):
                    if res.ttft_s is None:
                        res.ttft_s = time.monotonic() - t0
                    res.token_ids += choice["token_ids"]
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
    raise RuntimeError("stream ended before [DONE]")


# -- memory --
class ProcessSampler:
    """RSS of named processes: snapshots by label, and the peak of periodic samples; and the CPU
    seconds each used between the first snapshot and the last."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.snapshots: dict[str, dict[str, int]] = {}
        self.peak: dict[str, int] = {}
        self.cpu: dict[str, list[float]] = {}  # name -> [at the first snapshot, at the last]

    def rss(self) -> dict[str, int]:
        out = {name: p.memory_info().rss for name, p in self.procs.items()}
        for name, v in out.items():
            self.peak[name] = max(v, self.peak.get(name, 0))
        return out

    def snapshot(self, label: str) -> None:
        self.snapshots[label] = self.rss()
        for name, p in self.procs.items():
            t = p.cpu_times()
            self.cpu.setdefault(name, [t.user + t.system] * 2)[1] = t.user + t.system

    def cpu_seconds(self) -> dict[str, float]:
        return {name: end - start for name, (start, end) in self.cpu.items()}

    async def run(self, interval_s: float = 0.25) -> None:
        while True:
            self.rss()
            await asyncio.sleep(interval_s)


def listening_pids(urls: dict[str, str]) -> dict[str, int]:
    """name -> pid of the process listening on each URL's port (this user's processes)."""
    ports = {urlparse(u).port: name for name, u in urls.items()}
    found = {}
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports and c.pid:
            found[ports[c.laddr.port]] = c.pid
    return found


# -- the run --
@dataclass
class LoadReport:
    results: list[Result]
    duration_s: float
    concurrency: int
    rss: dict[str, dict[str, int]]  # label ("start", "after 200", "end") -> name -> bytes
    rss_peak: dict[str, int]
    cpu_s: dict[str, float]  # name -> CPU seconds used during the run
    blocks_used: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.results)


async def run_load(
    base_url: str,
    jobs: list[Job],
    concurrency: int,
    model: str,
    sampler: ProcessSampler | None = None,
    rss_at: tuple[int, ...] = (),
    timeout_s: float = 600.0,
    on_result: Callable[[Result], None] | None = None,
) -> LoadReport:
    """Every job, at most `concurrency` in flight; RSS snapshots at the start, when the number of
    finished jobs reaches each of `rss_at`, and at the end."""
    base_url = base_url.rstrip("/")
    # idle connections expire here before the server's keep-alive ends (uvicorn's default is 5 s)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0)
    semaphore = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + timeout_s
    finished = 0
    if sampler:
        sampler.snapshot("start")
    ticker = asyncio.create_task(sampler.run()) if sampler else None

    async def one(job: Job) -> Result:
        nonlocal finished
        async with semaphore:
            res = await send(client, base_url, job, model, deadline)
        finished += 1
        if sampler and finished in rss_at:
            sampler.snapshot(f"after {finished}")
        if on_result:
            on_result(res)
        return res

    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0), limits=limits) as client:
            t0 = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(one(j) for j in jobs)), max(1.0, deadline - time.monotonic())
            )
            duration = time.monotonic() - t0
    finally:
        if ticker:
            ticker.cancel()
    if sampler:
        sampler.snapshot("end")
    if not sampler:
        return LoadReport(list(results), duration, concurrency, {}, {}, {})
    return LoadReport(
        list(results), duration, concurrency, dict(sampler.snapshots), dict(sampler.peak), sampler.cpu_seconds()
    )


# -- the cluster around the router --
def worker_urls(base_url: str) -> dict[str, str]:
    """name ('prefill-30000', ...) -> URL of every worker the router lists."""
    workers = httpx.get(f"{base_url.rstrip('/')}/workers", timeout=10).json()["workers"]
    return {f"{w['role']}-{urlparse(w['url']).port}": w["url"] for w in workers}


def metric(url: str, name: str) -> float:
    """The sum of one metric's samples on a /metrics page."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_blocks_free(urls: dict[str, str], timeout_s: float = 15.0) -> dict[str, float]:
    """pdserve_kv_blocks_used per worker once all are 0, or as they stand at the timeout (the
    decode's release of a prefill lease arrives shortly after the last token)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {name: metric(u, "pdserve_kv_blocks_used") for name, u in urls.items()}
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


# -- the table --
def _pct(xs: list[float], q: float) -> float:
    return (
        statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))
    )


def format_report(r: LoadReport) -> str:
    ok = [x for x in r.results if x.ok]
    lat = [x.latency_s * 1e3 for x in ok]
    ttft = [x.ttft_s * 1e3 for x in ok if x.ttft_s is not None]
    out_tokens = sum(len(x.token_ids) for x in ok)
    rows = [
        ("requests sent", f"{len(r.results)} (concurrency {r.concurrency})"),
        ("completed", str(r.completed)),
        ("failed", str(len(r.failed))),
        (
            "retried (429s)",
            f"{sum(x.retries for x in r.results)} retries over {sum(x.retries > 0 for x in r.results)} requests",
        ),
        ("duration", f"{r.duration_s:.1f} s"),
        ("throughput", f"{len(ok) / r.duration_s:.1f} req/s, {out_tokens / r.duration_s:.0f} output tok/s"),
        ("latency p50 / p99", f"{_pct(lat, 50):.0f} / {_pct(lat, 99):.0f} ms"),
        ("TTFT p50 / p99 (streams)", f"{_pct(ttft, 50):.0f} / {_pct(ttft, 99):.0f} ms"),
    ]
    labels = list(r.rss)
    for name in r.rss_peak:
        figures = ", ".join(f"{label} {r.rss[label][name] / MIB:.1f}" for label in labels)
        rows.append((f"RSS {name} (MiB)", f"{figures}, peak {r.rss_peak[name] / MIB:.1f}"))
    for name, cpu in r.cpu_s.items():
        rows.append((f"CPU {name}", f"{cpu:.1f} s ({cpu / r.duration_s:.0%} of one core)"))
    for name, used in r.blocks_used.items():
        rows.append((f"KV blocks used after, {name}", f"{used:.0f}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'':<{width}} | value |", f"| {'-' * width} | ----- |"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    for x in r.failed[:10]:
        lines.append(f"failed #{x.index}: {x.error}")
    return "\n".join(lines)


def _parse_pids(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    pids = {}
    for i, part in enumerate(text.split(",")):
        name, _, pid = part.rpartition("=")
        pids[name or f"pid-{i}"] = int(pid)
    return pids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the router")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32, help="each request's max_tokens is drawn from 1..this")
    p.add_argument("--pids", help="processes to watch, name=pid,... (default: router and workers, by listening port)")
    p.add_argument("--model", help="model name to send (default: the router's first /v1/models entry)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--num-requests, --concurrency and --max-tokens must be >= 1")
    base = args.base_url.rstrip("/")
    model = args.model or httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    workers = worker_urls(base)
    pids = {**(_parse_pids(args.pids) or listening_pids({"router": base, **workers})), "client": os.getpid()}
    sampler = ProcessSampler(pids)
    marks = tuple(sorted({max(1, args.num_requests * k // 5) for k in range(1, 5)}))
    print(
        f"{args.num_requests} requests at concurrency {args.concurrency} to {base} ({model}); watching {pids}",
        file=sys.stderr,
    )
    jobs = make_jobs(args.num_requests, args.max_tokens, args.seed)
    report = asyncio.run(run_load(base, jobs, args.concurrency, model, sampler, rss_at=marks, timeout_s=args.timeout))
    report.blocks_used = wait_blocks_free(workers)
    print(format_report(report))
    return 0 if not report.failed and not any(report.blocks_used.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
