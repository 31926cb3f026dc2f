"""The PD hand-off's edges, with real processes and real NIXL: a slow prefill peer never stalls the
decode engine loop (its metadata is fetched before the request enters the engine), and a failed
KV load reaches the OpenAI client as a structured error that names the stage."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.cluster import SECRET, Cluster, wait_blocks_free

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
        c.r = c.router(prefill=[c.p], decode=[c.d])
        c.r_bad = c.router(prefill=[c.p], decode=[c.d_other])
        c.slow = slow
        try:
            c.wait_healthy()
            yield c
        finally:
            slow.close()


def _held_handle(prefill, rid: str) -> dict:
    body = {"request_id": rid, "prompt_token_ids": list(range(10, 40)), "params": {"max_tokens": 8, "ignore_eos": True}, "hold_kv": True}
    r = httpx.post(f"{prefill.url}/internal/generate", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    return [httpx.Response(200, content=line).json() for line in r.text.splitlines() if line.strip()][-1]


def test_a_slow_peer_does_not_stall_running_decodes(cluster):
    last = _held_handle(cluster.p, "needs-slow-peer")
    handle = {**last["kv_handle"], "engine_id": "slow-peer", "instance_id": "s1", "metadata_url": f"{cluster.slow.url}/internal/kv_metadata"}
    slow_body = {"request_id": "needs-slow-peer", "prompt_token_ids": list(range(10, 40)), "params": {"max_tokens": 8, "ignore_eos": True},
                 "kv_handle": handle, "first_token": {"token_id": last["token_ids"][0]}}  # fmt: skip
    slow_result: dict = {}

    def send_slow() -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{cluster.d.url}/internal/generate", json=slow_body, headers=H, timeout=60)
        slow_result["seconds"] = time.monotonic() - t0
        slow_result["chunks"] = [httpx.Response(200, content=line).json() for line in r.text.splitlines() if line.strip()]

    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    sender = threading.Thread(target=send_slow)
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{cluster.r.url}/v1/completions", json=body) as resp:
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
