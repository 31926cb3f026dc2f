"""A stalled engine is not a healthy one: a worker whose step hangs says 503 on /health within its
stall timeout, and the router routes around it; at TP > 1 the stall is a hung rank, and the worker
fails and exits 3 for its supervisor to restart it (worker/failure.py).

The stall is real: a tensor-parallel (TP2, gloo) worker whose second rank process is stopped with
SIGSTOP; rank 0's step then waits in a collective that never completes, while the worker's HTTP
server, on another thread, still answers.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import SECRET, Cluster, scrape

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

H = {"x-pdserve-cluster-secret": SECRET}
STALL_S = 2.0


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _complete(router, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)


def test_a_stalled_engine_is_503_and_routed_around(tmp_path):
    with Cluster(make_tiny_model(tmp_path / "tiny"), tmp_path / "logs") as c:
        stuck = c.worker("colocated", "--tensor-parallel-size", "2", "--stall-timeout", str(STALL_S))
        good = c.worker("colocated", "--stall-timeout", str(STALL_S))
        router = c.router(colocated=[stuck, good])
        c.wait_healthy()
        assert httpx.get(f"{stuck.url}/health").json()["engine_heartbeat_age_s"] < STALL_S
        ranks = _children(stuck.popen.pid)
        assert len(ranks) == 1, ranks  # rank 1 of the TP2 worker
        os.kill(ranks[0], signal.SIGSTOP)
        hung: dict[str, object] = {}

        def send() -> None:  # the request whose step hangs
            body = {"request_id": "hangs", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 4, "temperature": 0}}
            try:
                hung["status"] = httpx.post(
                    f"{stuck.url}/internal/generate", json=body, headers=H, timeout=120
                ).status_code
            except httpx.HTTPError as e:
                hung["status"] = repr(e)

        sender = threading.Thread(target=send, daemon=True)
        try:
            t0 = time.monotonic()
            sender.start()
            while (h := httpx.get(f"{stuck.url}/health", timeout=5)).status_code == 200:
                assert time.monotonic() - t0 < STALL_S + 5, h.json()
                time.sleep(0.1)
            stalled_s = time.monotonic() - t0
            assert h.status_code == 503 and "engine step not finished" in h.json()["reason"], h.json()
            assert h.json()["engine_heartbeat_age_s"] > STALL_S

            while next(w for w in httpx.get(f"{router.url}/workers").json()["workers"] if w["url"] == stuck.url)[
                "healthy"
            ]:
                assert time.monotonic() - t0 < STALL_S + 10
                time.sleep(0.1)
            served = scrape(good.url).get("pdserve_request_success_total", 0)
            for i in range(4):
                r = _complete(router, f"around the stall {i}")
                assert r.status_code == 200, r.text
            assert scrape(good.url)["pdserve_request_success_total"] == served + 4  # every one went to the good worker
        finally:
            try:
                os.kill(ranks[0], signal.SIGCONT)  # gone already: the watchdog killed the hung rank
            except ProcessLookupError:
                pass
        assert stuck.popen.wait(30) == 3  # failed, for its supervisor to restart it
        sender.join(60)
        assert not sender.is_alive() and "status" in hung  # the hung request ended (an error), not hung
        assert "a tensor-parallel rank stopped answering" in stuck.log.read_text()
        print(f"stalled worker reported 503 {stalled_s:.1f} s after its step began (stall_timeout {STALL_S} s)")
