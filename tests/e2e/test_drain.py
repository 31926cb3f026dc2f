"""A worker that gets SIGTERM drains (issue 43, item 2): real processes, a tiny PD cluster.

- SIGTERM to the decode worker mid-stream: /health is 503 "draining", a new request is refused
  (the router has no other decode worker: its 503), the open stream runs to its last token with no
  error, and the worker then exits 0 by itself; the prefill worker ends with no block in use
- a drain that outlasts drain_timeout: the worker exits 0 once the timeout passes, cutting the
  stream (the client gets an error event, never a hung stream)
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, wait_blocks_free

pytestmark = pytest.mark.timeout(300)

TOKENS = 600  # a stream long enough to be mid-way when the signal comes
LONG = 3000  # one that outlasts a 1 s drain


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("drain")
    model = make_tiny_model(root / "tiny")
    with Cluster(model, root / "logs") as c:
        c.p = c.worker("prefill")
        c.d = c.worker("decode", peers=[c.p])
        c.d_short = c.worker("decode", "--drain-timeout", "1", peers=[c.p])
        c.r = c.router(prefill=[c.p], decode=[c.d])
        # no migration here (test_migration.py has it): the cut stream's error reaches the client
        c.r_short = c.router("--migration-limit", "0", prefill=[c.p], decode=[c.d_short])
        c.wait_healthy()
        yield c


def _stream(url: str, client: httpx.Client, tokens: int = TOKENS):
    body = {"model": "tiny", "prompt": [10, 20, 30], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    return client.stream("POST", url + "/v1/completions", json=body)


def _events(lines) -> list[dict]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def test_a_draining_decode_worker_finishes_its_streams_then_exits_0(cluster):
    with httpx.Client(timeout=60, trust_env=False) as client, _stream(cluster.r.url, client) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        head = _events(next(lines) for _ in range(6))  # decode is streaming now
        cluster.d.popen.send_signal(signal.SIGTERM)
        health = httpx.get(cluster.d.url + "/health", timeout=5, trust_env=False)
        assert health.status_code == 503 and health.json()["reason"].startswith("draining"), health.text
        time.sleep(1.0)  # the router's probe (every 0.5 s) sees it
        refused = httpx.post(cluster.r.url + "/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 2},
                             timeout=30, trust_env=False)  # fmt: skip
        assert refused.status_code == 503, refused.text
        rest = _events(lines)
    events = head + rest
    assert not [e for e in events if "error" in e], events[-1]
    tokens = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]
    assert len(tokens) == TOKENS and events[-1]["choices"][0]["finish_reason"] == "length"
    assert cluster.d.popen.wait(30) == 0
    assert "drained: stopping" in cluster.d.log.read_text()
    assert not any(wait_blocks_free([cluster.p]).values())


def test_a_drain_past_its_timeout_cuts_the_stream_and_exits_0(cluster):
    with httpx.Client(timeout=60, trust_env=False) as client, _stream(cluster.r_short.url, client, LONG) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert _events(next(lines) for _ in range(4))
        t0 = time.monotonic()
        cluster.d_short.popen.send_signal(signal.SIGTERM)
        assert cluster.d_short.popen.wait(30) == 0
        exit_s = time.monotonic() - t0
        events = _events(lines)  # the stream ends: an error event, not a hang
    assert 1.0 <= exit_s < 15, exit_s
    assert any("error" in e for e in events), events[-3:]
    assert "drain timeout (1 s) passed with" in cluster.d_short.log.read_text()
