"""Aborts on a real PD cluster (prefill + decode over NIXL, one router): whoever leaves, whenever,
no KV block stays in use and the cluster keeps serving correct output.

- a non-streaming client that disconnects cancels its decode at once
- a client that leaves before the first token (prefill stalled) never reaches the decode worker
- a request aborted while the decode is stalled (before it read the KV) is released by prefill
  at once; a handle nobody ever reads is released at lease expiry
- 50 random aborts (before the first token, mid-stream, streamed and not): blocks return to 0 on
  every worker, no lease had to expire, and greedy output is what it was before
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import SECRET, Cluster, free_port, scrape, wait_blocks_free

pytestmark = pytest.mark.timeout(300)

LEASE_S = 5.0
LONG = {"model": "tiny", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("aborts")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        dport = free_port()  # prefill hands off to decode directly (as under `pdserve launch`)
        c.prefill = c.worker("prefill", "--lease-seconds", str(LEASE_S), "--peer", f"http://127.0.0.1:{dport}")
        c.decode = c.worker("decode", peers=[c.prefill], port=dport)
        c.r = c.router(prefill=[c.prefill], decode=[c.decode])
        c.wait_healthy()
        c.workers = [c.prefill, c.decode]
        yield c


def _running(worker) -> int:
    return httpx.get(f"{worker.url}/health", timeout=5).json()["num_requests_running"]


def _until(pred, timeout_s: float, what: str) -> float:
    """Seconds until pred() held; fails after timeout_s."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _aborts(worker) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    line = [x for x in text.splitlines() if x.startswith('pdserve_request_success_total{finish_reason="abort"}')]
    return float(line[0].split()[-1]) if line else 0.0


async def _leave_after(coro, seconds: float) -> None:
    task = asyncio.create_task(coro)
    await asyncio.sleep(seconds)
    assert not task.done(), "the request ended before the client left"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_non_stream_client_disconnect_cancels_the_decode(cluster):
    aborts = _aborts(cluster.decode)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            post = client.post(f"{cluster.r.url}/v1/completions", json={**LONG, "prompt": "leave me"})
            task = asyncio.create_task(post)
            await asyncio.to_thread(_until, lambda: _running(cluster.decode) == 1, 20, "decode running")
            task.cancel()  # closes the connection: the client is gone
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    stopped = _until(
        lambda: _running(cluster.decode) == 0, 3, "decode stopped after the client left"
    )  # 4000 tokens take > 10 s
    assert wait_blocks_free(cluster.workers, 5) == {p.name: 0 for p in cluster.workers}
    assert _aborts(cluster.decode) == aborts + 1
    assert scrape(cluster.r.url)["pdserve_router_requests_in_flight"] == 0
    print(f"decode stopped {stopped:.2f} s after a non-streaming client left")


def test_leaving_before_the_first_token_never_reaches_decode(cluster):
    """Prefill is stalled (SIGSTOP) while two clients, one streaming, wait for the first token and
    leave; once prefill resumes, nothing of theirs may reach the decode worker or stay held."""
    before = scrape(cluster.decode.url)
    expirations = scrape(cluster.prefill.url)["pdserve_kv_lease_expirations_total"]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            url = f"{cluster.r.url}/v1/completions"
            non_stream = client.post(url, json={**LONG, "prompt": "never mind"})
            stream = client.post(url, json={**LONG, "prompt": "never mind either", "stream": True})
            await asyncio.gather(_leave_after(non_stream, 0.6), _leave_after(stream, 0.6))

    cluster.prefill.popen.send_signal(signal.SIGSTOP)
    try:
        asyncio.run(go())
        time.sleep(0.3)  # the router has given up on both
    finally:
        cluster.prefill.popen.send_signal(signal.SIGCONT)
    time.sleep(1.0)  # prefill works through what reached it
    assert wait_blocks_free(cluster.workers, 3) == {p.name: 0 for p in cluster.workers}
    after = scrape(cluster.decode.url)
    assert after.get("pdserve_request_success_total") == before.get(
        "pdserve_request_success_total"
    )  # decode never saw them
    assert after.get("pdserve_kv_transfer_seconds_count") == before.get("pdserve_kv_transfer_seconds_count")
    assert scrape(cluster.prefill.url)["pdserve_kv_lease_expirations_total"] == expirations
    assert scrape(cluster.r.url)["pdserve_router_requests_in_flight"] == 0


def test_abort_before_decode_read_releases_prefill_at_once(cluster):
    """Decode is stalled: the client got prefill's first token and leaves while the router waits
    on the decode worker. The router tells prefill at once (not LEASE_S later)."""
    expirations = scrape(cluster.prefill.url)["pdserve_kv_lease_expirations_total"]
    cluster.decode.popen.send_signal(signal.SIGSTOP)
    try:
        with httpx.Client(timeout=30) as client:
            with client.stream(
                "POST", f"{cluster.r.url}/v1/completions", json={**LONG, "prompt": "stalled decode", "stream": True}
            ) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()  # kept: a dropped line iterator closes the response
                assert next(lines).startswith("data: {")  # the first token, from prefill
                assert scrape(cluster.prefill.url)["pdserve_kv_blocks_used"] > 0  # held for the decode
            released = _until(
                lambda: scrape(cluster.prefill.url)["pdserve_kv_blocks_used"] == 0, LEASE_S / 2, "prefill released"
            )
    finally:
        cluster.decode.popen.send_signal(signal.SIGCONT)
    assert wait_blocks_free(cluster.workers, 5) == {p.name: 0 for p in cluster.workers}
    assert scrape(cluster.prefill.url)["pdserve_kv_lease_expirations_total"] == expirations
    print(f"prefill released the KV {released:.2f} s after the client left (lease {LEASE_S} s)")


def test_a_handle_nobody_reads_is_freed_at_lease_expiry(cluster):
    """The router dies between prefill and decode (here: nobody ever sends the handle on)."""
    expirations = scrape(cluster.prefill.url)["pdserve_kv_lease_expirations_total"]
    body = {
        "request_id": "orphan-1",
        "prompt_token_ids": list(range(5, 200)),
        "params": {"max_tokens": 8, "temperature": 0},
        "hold_kv": True,
    }
    headers = {"x-pdserve-cluster-secret": SECRET}
    t0 = time.monotonic()
    lines = httpx.post(
        f"{cluster.prefill.url}/internal/generate", json=body, headers=headers, timeout=30
    ).text.splitlines()
    assert '"kv_handle"' in lines[-1]
    assert scrape(cluster.prefill.url)["pdserve_kv_blocks_used"] > 0
    _until(lambda: scrape(cluster.prefill.url)["pdserve_kv_blocks_used"] == 0, LEASE_S + 3, "lease expiry")
    assert time.monotonic() - t0 >= LEASE_S - 0.5  # not before the lease ended
    assert scrape(cluster.prefill.url)["pdserve_kv_lease_expirations_total"] == expirations + 1


PROMPTS = [[5, 6, 7, 8], list(range(30, 130)), [9] * 40, list(range(200, 90, -1))]


def _greedy(cluster, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy token ids of each prompt through the PD router, all at once."""

    async def go() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "return_token_ids": True}
            rs = await asyncio.gather(
                *(client.post(f"{cluster.r.url}/v1/completions", json={**body, "prompt": p}) for p in prompts)
            )
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0]["token_ids"] for r in rs]

    return asyncio.run(go())


async def _one_abort(client: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> str:
    """One request that its client abandons at a random point; returns where it left ("completed"
    if the request ended first)."""
    stream = rng.random() < 0.5
    body = {
        **LONG,
        "prompt": f"abort {i}: " + "x" * rng.randint(1, 300),
        "max_tokens": rng.randint(300, 800),
        "stream": stream,
    }
    point = rng.choice(["before_first_token", "mid"])
    if stream and point == "mid":
        events = rng.randint(1, 30)
        async with client.stream("POST", url, json=body) as resp:
            n = 0
            async for line in resp.aiter_lines():
                n += line.startswith("data: {")
                if n >= events:
                    return "stream_mid"  # leaves: the response is closed mid-stream
        return "completed"
    task = asyncio.create_task(client.post(url, json=body))
    await asyncio.sleep(rng.uniform(0.0, 0.05) if point == "before_first_token" else rng.uniform(0.05, 0.5))
    if task.done():
        return "completed"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return f"{'stream' if stream else 'whole'}_{point}"


def test_fifty_random_aborts_leak_nothing_and_output_stays_correct(cluster):
    rng = random.Random(6)
    want = _greedy(cluster, PROMPTS)
    before = scrape(cluster.prefill.url)

    async def go() -> list[str]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            url = f"{cluster.r.url}/v1/completions"
            out: list[str] = []
            for wave in range(5):  # 10 at a time, so they overlap each other
                out += await asyncio.gather(*(_one_abort(client, url, rng, 10 * wave + k) for k in range(10)))
            return out

    t_storm = time.monotonic()
    points = asyncio.run(go())
    t_storm = time.monotonic() - t_storm
    assert len(points) == 50 and "completed" not in points
    t0 = time.monotonic()
    used = wait_blocks_free(cluster.workers, 10)
    freed_s = time.monotonic() - t0
    assert used == {p.name: 0 for p in cluster.workers}
    assert scrape(cluster.r.url)["pdserve_router_requests_in_flight"] == 0
    after = scrape(cluster.prefill.url)
    assert after["pdserve_num_requests_holding_kv"] == 0
    expired = after["pdserve_kv_lease_expirations_total"] - before["pdserve_kv_lease_expirations_total"]
    assert expired == 0  # the router could tell prefill every time
    counts = {p: points.count(p) for p in sorted(set(points))}
    print(
        f"50 aborts in {t_storm:.1f} s {counts}: blocks back to 0 {freed_s:.2f} s after the last, leases expired: {expired:.0f}"
    )

    # still serving, and correctly: the same greedy tokens as before the storm (blocks freed by aborts are reused)
    assert _greedy(cluster, PROMPTS) == want
    assert wait_blocks_free(cluster.workers, 5) == {p.name: 0 for p in cluster.workers}
