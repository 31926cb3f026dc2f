"""Backpressure and timeouts on a real PD cluster: bounded queues answer 429 with Retry-After (a
full worker is skipped for another first), and every wait has a timeout that fires as configured:

    wait                              option (who)                          seen by the client
    a KV transfer (handshake + read)  --transfer-timeout (decode worker)    error: failed at HANDSHAKE/READING
    prefill's first token + KV        --prefill-timeout (router)            504 prefill_timeout
    the first token                   --first-token-timeout (router)        504 first_token_timeout
    the whole request                 --request-timeout (router)            504 timeout (SSE error if streaming)
    open requests on a worker         --max-open-requests (worker)          retried elsewhere, else 429
    requests in the router            --max-queued-requests (router)        429 + Retry-After
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import SECRET, Cluster, scrape, wait_blocks_free

pytestmark = pytest.mark.timeout(300)

H = {"x-pdserve-cluster-secret": SECRET}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("backpressure")
    hole = socket.socket()  # a "prefill peer" whose connections the kernel accepts and nobody serves
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    with hole, Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.hole_url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        c.p = c.worker("prefill")
        c.d1 = c.worker(
            "decode", "--max-open-requests", "1", "--transfer-timeout", "1", "--peer", c.hole_url, peers=[c.p]
        )
        c.d2 = c.worker("decode", "--max-open-requests", "1", peers=[c.p])
        c.r = c.router("--decode-policy", "round_robin", prefill=[c.p], decode=[c.d1, c.d2])
        c.small = c.router("--max-queued-requests", "4", "--request-timeout", "2", prefill=[c.p], decode=[c.d1, c.d2])
        c.r_prefill = c.router("--prefill-timeout", "1", prefill=[c.p], decode=[c.d1, c.d2])
        c.r_first = c.router("--first-token-timeout", "1", prefill=[c.p], decode=[c.d1, c.d2])
        c.wait_healthy()
        c.workers = [c.p, c.d1, c.d2]
        yield c


def _complete(router, prompt="hello", **kw) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)


def _handle(prefill, rid: str) -> dict:
    body = {
        "request_id": rid,
        "prompt_token_ids": list(range(10, 60)),
        "params": {"max_tokens": 3000, "ignore_eos": True},
        "hold_kv": True,
    }
    r = httpx.post(f"{prefill.url}/internal/generate", json=body, headers=H, timeout=30)
    return json.loads(r.text.splitlines()[-1])


class _Occupy:
    """A long decode sent straight to a worker (not through the router), streaming until closed."""

    def __init__(self, cluster, decode, rid: str) -> None:
        last = _handle(cluster.p, rid)
        body = {
            "request_id": rid, "prompt_token_ids": list(range(10, 60)), "params": {"max_tokens": 3000, "ignore_eos": True},
            "kv_handle": last["kv_handle"], "first_token": {"token_id": last["token_ids"][0]},
        }  # fmt: skip
        self.client = httpx.Client(timeout=30)
        self.cm = self.client.stream("POST", f"{decode.url}/internal/generate", json=body, headers=H)
        resp = self.cm.__enter__()
        assert resp.status_code == 200
        self.lines = resp.iter_lines()
        next(self.lines)

    def close(self) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


def test_a_full_worker_is_skipped_then_429_with_retry_after(cluster):
    busy = _Occupy(cluster, cluster.d1, "occupy-1")
    try:
        assert [_complete(cluster.r, f"retry {i}").status_code for i in range(4)] == [200] * 4
        text = httpx.get(f"{cluster.r.url}/metrics").text
        assert 'pdserve_router_upstream_errors_total{kind="429",role="decode"}' in text, text  # d1 refused ...
        assert 'pdserve_router_retries_total{role="decode"}' in text  # ... and d2 served instead
        busy2 = _Occupy(cluster, cluster.d2, "occupy-2")
        try:
            r = _complete(cluster.r, "nobody free")
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        finally:
            busy2.close()
    finally:
        busy.close()
    assert wait_blocks_free(cluster.workers, 10) == {
        p.name: 0 for p in cluster.workers
    }  # incl. the refused request's prefill KV
    assert scrape(cluster.p.url)["pdserve_kv_lease_expirations_total"] == 0


def test_router_queue_is_bounded(cluster):
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(
                    client.post(f"{cluster.small.url}/v1/completions", json={**body, "prompt": f"flood {i}"})
                    for i in range(24)
                )
            )

    rs = asyncio.run(go())
    codes = [r.status_code for r in rs]
    assert set(codes) == {200, 429} and codes.count(429) >= 24 - 8, codes  # 4 in the router at once, never a 5xx
    refused = [r for r in rs if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    assert scrape(cluster.small.url)["pdserve_router_requests_in_flight"] == 0
    assert wait_blocks_free(cluster.workers, 10) == {p.name: 0 for p in cluster.workers}


def test_prefill_and_first_token_timeouts(cluster):
    """Prefill hangs (SIGSTOP): one router gives up on prefill after 1 s, another on the first token."""
    expirations = scrape(cluster.p.url)["pdserve_kv_lease_expirations_total"]

    async def go() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(timeout=30) as client:

            async def timed(router, stream: bool) -> tuple[httpx.Response, float]:
                t0 = time.monotonic()
                body = {"model": "tiny", "prompt": "stuck", "max_tokens": 4, "stream": stream}
                r = await client.post(f"{router.url}/v1/completions", json=body)
                return r, time.monotonic() - t0

            return await asyncio.gather(
                timed(cluster.r_prefill, False), timed(cluster.r_first, False), timed(cluster.r_first, True)
            )

    cluster.p.popen.send_signal(signal.SIGSTOP)
    try:
        results = asyncio.run(go())
    finally:
        cluster.p.popen.send_signal(signal.SIGCONT)
    (pre, pre_s), (first, first_s), (first_stream, _) = results
    assert pre.status_code == 504 and pre.json()["error"]["code"] == "prefill_timeout" and 1 <= pre_s < 3, (
        pre.text,
        pre_s,
    )
    message = pre.json()["error"]["message"]  # the role, not the worker's URL (that goes to the log)
    assert message.startswith("the prefill worker: no first token") and cluster.p.url not in message
    assert first.status_code == 504 and first.json()["error"]["code"] == "first_token_timeout" and 1 <= first_s < 3, (
        first.text,
        first_s,
    )
    assert first_stream.status_code == 504  # streaming too: nothing was sent yet, so it is a status
    assert wait_blocks_free(cluster.workers, 10) == {
        p.name: 0 for p in cluster.workers
    }  # the resumed prefill was told to abort
    assert scrape(cluster.p.url)["pdserve_kv_lease_expirations_total"] == expirations
    assert _complete(cluster.r_prefill).status_code == 200 and _complete(cluster.r_first).status_code == 200
    print(f"prefill timeout after {pre_s:.2f} s, first-token timeout after {first_s:.2f} s (both set to 1 s)")


def test_whole_request_timeout_non_streaming(cluster):
    t0 = time.monotonic()
    r = _complete(cluster.small, "too long", max_tokens=3000, ignore_eos=True)
    took = time.monotonic() - t0
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout" and 2 <= took < 4, (r.text, took)
    assert wait_blocks_free(cluster.workers, 10) == {p.name: 0 for p in cluster.workers}


def test_transfer_timeout(cluster):
    """The decode worker's handshake with a prefill peer that accepts connections and never
    answers ends after --transfer-timeout (1 s) with a TransferError naming the stage."""
    last = _handle(cluster.p, "to-the-hole")
    handle = {
        **last["kv_handle"],
        "engine_id": "silent-prefill",
        "metadata_url": f"{cluster.hole_url}/internal/kv_metadata",
    }
    body = {
        "request_id": "to-the-hole",
        "prompt_token_ids": list(range(10, 60)),
        "params": {"max_tokens": 8},
        "kv_handle": handle,
        "first_token": {"token_id": last["token_ids"][0]},
    }
    t0 = time.monotonic()
    r = httpx.post(f"{cluster.d1.url}/internal/generate", json=body, headers=H, timeout=30)
    took = time.monotonic() - t0
    end = json.loads(r.text.splitlines()[-1])
    assert end["finish_reason"] == "error" and "failed at HANDSHAKE" in end["error"] and "Timeout" in end["error"], end
    assert 1 <= took < 3, took
    httpx.post(
        f"{cluster.p.url}/internal/abort", json={"request_id": "to-the-hole"}, headers=H, timeout=5
    )  # as the router does
    assert wait_blocks_free(cluster.workers, 5) == {p.name: 0 for p in cluster.workers}
    print(f"transfer (handshake) timeout after {took:.2f} s (set to 1 s)")
