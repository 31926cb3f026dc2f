"""The PD hand-off's edges, with real processes and real NIXL: a slow prefill peer never stalls the
decode engine loop (its metadata is fetched before the request enters the engine), a failed
KV load reaches the OpenAI client as a structured error that names the stage, and a decode request
sent before its prefill is done waits for its hand-off only until it is aborted or times out. The
prefill worker here has no --peer, so the router posts every hand-off (tests/e2e/test_pd_e2e.py and
test_aborts.py run the direct one, prefill engine to decode engine)."""

from __future__ import annotations

import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import SECRET, Cluster, wait_blocks_free

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

H = {"x-pdserve-cluster-secret": SECRET}
SLOW_S = 3.0


class SlowPeer:
    """A 'prefill worker' whose metadata endpoint answers after SLOW_S seconds, with metadata no
    connector accepts (so the request that needed it fails at HANDSHAKE, cleanly)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                time.sleep(SLOW_S)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("handoff")
    model = make_tiny_model(root / "tiny")
    slow = SlowPeer()
    with Cluster(model, root / "logs") as c:
        c.p = c.worker("prefill")
        c.d = c.worker("decode", "--peer", slow.url, peers=[c.p])
        c.d_other = c.worker("decode", "--kv-block-size", "32", peers=[c.p])  # another KV layout: incompatible
        c.d_short = c.worker("decode", "--handoff-timeout", "1", peers=[c.p])
        c.r = c.router(prefill=[c.p], decode=[c.d])
        c.r_bad = c.router(prefill=[c.p], decode=[c.d_other])
        c.slow = slow
        try:
            c.wait_healthy()
            yield c
        finally:
            slow.close()


def _held_handle(prefill, rid: str) -> dict:
    body = {
        "request_id": rid,
        "prompt_token_ids": list(range(10, 40)),
        "params": {"max_tokens": 8, "ignore_eos": True},
        "hold_kv": True,
    }
    r = httpx.post(f"{prefill.url}/internal/generate", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    return [httpx.Response(200, content=line).json() for line in r.text.splitlines() if line.strip()][-1]


def test_a_slow_peer_does_not_stall_running_decodes(cluster):
    last = _held_handle(cluster.p, "needs-slow-peer")
    handle = {
        **last["kv_handle"],
        "engine_id": "slow-peer",
        "instance_id": "s1",
        "metadata_url": f"{cluster.slow.url}/internal/kv_metadata",
    }
    slow_body = {"request_id": "needs-slow-peer", "prompt_token_ids": list(range(10, 40)), "params": {"max_tokens": 8, "ignore_eos": True},
                 "kv_handle": handle, "first_token": {"token_id": last["token_ids"][0]}}  # fmt: skip
    slow_result: dict = {}

    def send_slow() -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{cluster.d.url}/internal/generate", json=slow_body, headers=H, timeout=60)
        slow_result["seconds"] = time.monotonic() - t0
        slow_result["chunks"] = [
            httpx.Response(200, content=line).json() for line in r.text.splitlines() if line.strip()
        ]

    body = {
        "model": "tiny",
        "prompt": "a long answer",
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    sender = threading.Thread(target=send_slow)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{cluster.r.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 5:  # decoding now: a new request arrives that needs the slow peer
                sender.start()
                started = arrivals[-1]
            if len(arrivals) > 5 and arrivals[-1] - started > SLOW_S + 1.0:
                break
    sender.join(30)
    window = [t for t in arrivals if started <= t <= started + SLOW_S]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= started]
    print(f"{len(window)} tokens streamed during the {SLOW_S} s metadata fetch; largest gap {max(gaps) * 1000:.0f} ms")
    assert len(window) >= 20 and max(gaps) < 1.0  # the engine kept stepping while the fetch waited
    # the request that needed the slow peer waited for it (not the engine), then failed cleanly
    assert slow_result["seconds"] >= SLOW_S
    end = slow_result["chunks"][-1]
    assert end["finish_reason"] == "error" and end["transfer_error"]["stage"] == "HANDSHAKE"
    assert end["transfer_error"]["request_id"] == "needs-slow-peer" and "slow-peer" in end["transfer_error"]["reason"]
    httpx.post(f"{cluster.p.url}/internal/abort", json={"request_id": "needs-slow-peer"}, headers=H, timeout=5)
    assert wait_blocks_free([cluster.p, cluster.d], 15) == {cluster.p.name: 0, cluster.d.name: 0}


def test_a_failed_transfer_reaches_the_client_naming_its_stage(cluster):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{cluster.r_bad.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed" and err["message"].startswith("KV transfer failed at stage HANDSHAKE:")
    assert "compatibility hash mismatch" in err["message"]
    events = []
    with httpx.stream("POST", f"{cluster.r_bad.url}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200  # the first token came from prefill: the stream had started
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert '"kv_transfer_failed"' in events[-2] and "HANDSHAKE" in events[-2] and events[-1] == "data: [DONE]"
    assert wait_blocks_free([cluster.p, cluster.d_other], 15) == {cluster.p.name: 0, cluster.d_other.name: 0}


def _waiting_body(cluster, rid: str) -> dict:
    """A decode request as the router sends it before prefill is done: no handle, kv_from instead."""
    kv_from = {"engine_id": cluster.p.name, "metadata_url": f"{cluster.p.url}/internal/kv_metadata"}
    return {"request_id": rid, "prompt_token_ids": list(range(10, 40)), "params": {"max_tokens": 8}, "kv_from": kv_from}


def _chunks(resp: httpx.Response) -> list[dict]:
    return [httpx.Response(200, content=line).json() for line in resp.iter_lines() if line.strip()]


def test_a_decode_request_waits_for_its_hand_off_until_aborted_or_timed_out(cluster):
    # no hand-off within --handoff-timeout (1 s): an error naming the stage, nothing held
    t0 = time.monotonic()
    with httpx.stream(
        "POST", f"{cluster.d_short.url}/internal/generate", json=_waiting_body(cluster, "never"), headers=H, timeout=30
    ) as r:
        assert r.status_code == 200
        end = _chunks(r)[-1]
    assert time.monotonic() - t0 >= 1.0
    assert end["finish_reason"] == "error" and end["token_ids"] == []
    assert (
        end["transfer_error"]["stage"] == "PENDING"
        and f"no hand-off from prefill engine {cluster.p.name} within 1 s" in end["transfer_error"]["reason"]
    )
    # waiting (no blocks), then aborted: the stream ends with "abort"
    result: dict = {}

    def wait() -> None:
        with httpx.stream(
            "POST", f"{cluster.d.url}/internal/generate", json=_waiting_body(cluster, "left"), headers=H, timeout=30
        ) as r:
            result["chunks"] = _chunks(r)

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 10
    while httpx.get(f"{cluster.d.url}/health", timeout=5).json()["num_requests_waiting"] != 1:
        assert time.monotonic() < deadline, "the decode request never waited"
        time.sleep(0.05)
    assert httpx.get(f"{cluster.d.url}/health", timeout=5).json()["kv_blocks_used"] == 0
    httpx.post(f"{cluster.d.url}/internal/abort", json={"request_id": "left"}, headers=H, timeout=5)
    waiter.join(10)
    assert result["chunks"][-1]["finish_reason"] == "abort"
    # a hand-off for no open request, or to a prefill worker, is refused
    last = _held_handle(cluster.p, "handed")
    handoff = {
        "request_id": "handed",
        "kv_handle": last["kv_handle"],
        "first_token": {"token_id": last["token_ids"][0]},
    }
    r = httpx.post(f"{cluster.d.url}/internal/handoff", json=handoff, headers=H, timeout=5)
    assert r.status_code == 404 and "no request 'handed' is open" in r.json()["error"]["message"]
    r = httpx.post(f"{cluster.p.url}/internal/handoff", json=handoff, headers=H, timeout=5)
    assert r.status_code == 400 and "takes no hand-offs" in r.json()["error"]["message"]
    httpx.post(f"{cluster.p.url}/internal/abort", json={"request_id": "handed"}, headers=H, timeout=5)
    assert wait_blocks_free([cluster.p, cluster.d, cluster.d_short], 15) == {
        w.name: 0 for w in (cluster.p, cluster.d, cluster.d_short)
    }


def test_without_prefill_peers_the_router_posts_the_hand_off(cluster):
    body = {"model": "tiny", "prompt": "hand it over", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{cluster.r.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    metrics = httpx.get(f"{cluster.r.url}/metrics", timeout=5).text
    assert re.search(r'^pdserve_router_pd_handoffs_total\{via="router"\} [1-9]', metrics, re.M)
    assert 'pdserve_router_pd_handoffs_total{via="prefill"}' not in metrics
