"""Worker faults on a real cluster (prefill and decode workers over NIXL, routers), never wrong tokens:

- prefill killed between prefill and the decode's read: the decode reports a transfer failure
  (TransferError text with its stage) under kv_load_failure_policy "fail", and recomputes the
  prompt under "recompute" - with exactly the colocated engine's greedy tokens
- decode SIGKILLed mid-stream: the client gets an SSE error event within 10 s, the router marks
  it down and routes elsewhere; a router that still thinks it healthy retries on another decode
  worker (connection refused, before the first token); restarted on the same port, it is taken back
- a decode worker that is up but fails every request (a wrong peer list: NIXL metadata refused)
  is cut off by its circuit breaker, which half-opens after the cool-down for one trial request
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pdserve.config import RouterConfig
from pdserve.router.breaker import BreakerState, CircuitBreaker
from pdserve.router.upstream import MAX_BACKOFF_S, backoff
from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import SECRET, Cluster, scrape, wait_blocks_free

pytestmark = pytest.mark.timeout(300)

H = {"x-pdserve-cluster-secret": SECRET}
PROMPT = list(range(40, 140))  # 100 tokens: two KV blocks of 64
PARAMS = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
BREAKER_COOLDOWN_S = 8.0  # long enough that the first phase (8 short requests) ends before it, even on a busy machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    with Cluster(make_tiny_model(root / "tiny"), root / "logs") as c:
        c.p = c.worker("prefill")
        c.p2 = c.worker("prefill")  # the one killed between prefill and read
        peers = [c.p, c.p2]
        c.d_fail = c.worker("decode", "--transfer-timeout", "3", peers=peers)
        c.d_recompute = c.worker(
            "decode", "--transfer-timeout", "3", "--kv-load-failure-policy", "recompute", peers=peers
        )
        c.d_bad = c.worker("decode", "--peer", "http://127.0.0.1:1")  # refuses every prefill's metadata
        c.both = c.worker("colocated")
        # no migration here (test_migration.py has it): a failure reaches the client, as it does at the limit
        c.r = c.router(
            "--decode-policy", "round_robin", "--migration-limit", "0", prefill=[c.p], decode=[c.d_fail, c.d_recompute]
        )
        c.rb = c.router(
            "--decode-policy", "round_robin", "--breaker-failures", "2", "--breaker-cooldown", str(BREAKER_COOLDOWN_S), prefill=[c.p], decode=[c.d_bad, c.d_recompute]
        )  # fmt: skip
        c.wait_healthy()
        # probes once, then not for a minute: it keeps believing in a worker that died
        c.r_stale = c.router(
            "--decode-policy", "round_robin", "--health-interval", "60", prefill=[c.p], decode=[c.d_fail, c.d_recompute]
        )
        c.wait_healthy()
        yield c


def test_breaker_states_with_a_fake_clock():
    now = [0.0]
    b = CircuitBreaker(threshold=3, cooldown_s=10.0, clock=lambda: now[0])
    b.record_failure(), b.record_failure(), b.record_success(), b.record_failure(), b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allows()  # a success in between resets the count
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allows() and b.opens == 1
    now[0] = 9.9
    assert not b.allows()
    now[0] = 10.0
    assert b.state is BreakerState.HALF_OPEN and b.allows()
    b.on_attempt()
    assert not b.allows()  # one trial at a time
    b.on_end()  # the trial's client left: no verdict, another request may be the trial
    b.on_attempt()
    b.record_failure()
    assert b.state is BreakerState.OPEN and b.opens == 2
    now[0] = 20.0
    b.on_attempt()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.failures == 0
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0)


def test_retry_backoff_doubles_and_is_capped():
    for attempt, top in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, MAX_BACKOFF_S), (9, MAX_BACKOFF_S)]:
        waits = [backoff(0.1, attempt) for _ in range(50)]
        assert all(top / 2 <= w <= top for w in waits)
    with pytest.raises(ValueError):
        RouterConfig(max_attempts=0)


def _generate(worker, body: dict) -> list[dict]:
    r = httpx.post(f"{worker.url}/internal/generate", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def _token_ids(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for t in c["token_ids"]]


def _colocated(cluster, prompt: list[int]) -> list[int]:
    return _token_ids(
        _generate(
            cluster.both, {"request_id": f"ref-{time.monotonic_ns()}", "prompt_token_ids": prompt, "params": PARAMS}
        )
    )


def _handoff(prefill, rid: str, prompt: list[int]) -> dict:
    """What the router does first: prefill with hold_kv; the last chunk has the first token and the KV handle."""
    last = _generate(prefill, {"request_id": rid, "prompt_token_ids": prompt, "params": PARAMS, "hold_kv": True})[-1]
    assert last["kv_handle"] is not None
    return last


def _continue(decode, rid: str, prompt: list[int], last: dict) -> list[dict]:
    """Then the decode worker, with the handle and the first token: the request's whole output,
    prefill's chunk then decode's (which continue after the first token)."""
    body = {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "params": PARAMS,
        "kv_handle": last["kv_handle"],
        "first_token": {"token_id": last["token_ids"][0]},
    }
    return [last, *_generate(decode, body)]


def _complete(router, prompt, max_tokens: int = 6, **kw) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **kw,
    }
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)


def _worker_row(router, worker) -> dict:
    rows = httpx.get(f"{router.url}/workers", timeout=5).json()["workers"]
    return next(w for w in rows if w["url"] == worker.url)


def test_prefill_killed_before_the_read_fails_or_recomputes_by_policy(cluster):
    want = _colocated(cluster, PROMPT)
    # both decode workers have read from p2 once: the NIXL connection exists when p2 dies
    for d in (cluster.d_fail, cluster.d_recompute):
        warm = _continue(d, f"warm-{d.name}", PROMPT, _handoff(cluster.p2, f"warm-{d.name}", PROMPT))
        assert _token_ids(warm) == want
    held = [_handoff(cluster.p2, f"held-{i}", PROMPT) for i in range(2)]
    cluster.kill(cluster.p2)

    t0 = time.monotonic()
    failed = _continue(cluster.d_fail, "held-0", PROMPT, held[0])
    fail_s = time.monotonic() - t0
    end = failed[-1]
    assert end["finish_reason"] == "error" and _token_ids(failed) == want[:1]  # only prefill's token, nothing made up
    assert "KV transfer for request held-0 failed at" in end["error"] and (
        "READING" in end["error"] or "HANDSHAKE" in end["error"]
    )
    assert end["transfer_error"]["request_id"] == "held-0" and end["transfer_error"]["stage"] in (
        "READING",
        "HANDSHAKE",
    )
    assert fail_s < 3 + 2  # the transfer timeout bounds it

    recomputed = _continue(cluster.d_recompute, "held-1", PROMPT, held[1])
    assert recomputed[-1]["finish_reason"] == "length" and _token_ids(recomputed) == want
    assert scrape(cluster.d_recompute.url)["pdserve_kv_load_recomputes_total"] == 1
    assert scrape(cluster.d_fail.url)["pdserve_kv_transfer_failures_total"] >= 1
    assert wait_blocks_free([cluster.d_fail, cluster.d_recompute], 5) == {
        cluster.d_fail.name: 0,
        cluster.d_recompute.name: 0,
    }
    print(f"transfer failure reported {fail_s:.2f} s after the handle was sent: {end['error']}")


def test_decode_killed_mid_stream(cluster):
    body = {
        "model": "tiny",
        "prompt": "a long answer",
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{cluster.r.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert [next(lines) for _ in range(6)]  # streaming from a decode worker now
        victim = next(
            d
            for d in (cluster.d_fail, cluster.d_recompute)
            if httpx.get(f"{d.url}/health").json()["num_requests_running"]
        )
        other = cluster.d_recompute if victim is cluster.d_fail else cluster.d_fail
        t0 = time.monotonic()
        cluster.kill(victim)
        error = None
        for line in lines:
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[len("data: ") :])["error"]
                break
        error_s = time.monotonic() - t0
    assert error is not None and error_s < 10
    assert error["code"] == "upstream_error" and error["message"].startswith("the decode worker failed mid-request")
    assert "(not migrated: migration_limit 0 reached)" in error["message"]
    row = _worker_row(cluster.r, victim)
    assert row["healthy"] is False and row["reason"]

    # the router stops routing to it: every request goes to the other decode worker
    tried = scrape(cluster.r.url).get("pdserve_router_upstream_errors_total", 0)
    for i in range(4):
        assert _complete(cluster.r, f"after the crash {i}").status_code == 200
    assert scrape(cluster.r.url).get("pdserve_router_upstream_errors_total", 0) == tried

    # a router whose last probe said "healthy" tries it, is refused, and retries on the other one
    for i in range(2):
        r = _complete(cluster.r_stale, f"stale view {i}")
        assert r.status_code == 200, r.text
    text = httpx.get(f"{cluster.r_stale.url}/metrics").text
    assert 'pdserve_router_upstream_errors_total{kind="unreachable",role="decode"} 1.0' in text
    assert 'pdserve_router_retries_total{role="decode"} 1.0' in text

    # back on the same port: the router takes it back and routes to it again
    cluster.restart(victim)
    t1 = time.monotonic()
    while not _worker_row(cluster.r, victim)["healthy"]:
        assert time.monotonic() - t1 < 120, victim.log_tail()
        time.sleep(0.2)
    back_s = time.monotonic() - t1
    want = _colocated(cluster, PROMPT)
    for i in range(4):
        r = _complete(cluster.r, PROMPT, max_tokens=PARAMS["max_tokens"], ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    assert scrape(victim.url).get("pdserve_request_success_total", 0) >= 1  # served requests again
    assert wait_blocks_free([cluster.p, victim, other], 10) == {cluster.p.name: 0, victim.name: 0, other.name: 0}
    print(f"error event {error_s:.2f} s after SIGKILL; restarted worker taken back {back_s:.1f} s after restart")


def test_circuit_breaker_cuts_off_a_failing_worker(cluster):
    rb = cluster.rb
    codes = []
    for i in range(8):
        r = _complete(rb, f"breaker {i}", max_tokens=4)
        codes.append(r.status_code)
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["code"] == "kv_transfer_failed" and "failed at stage HANDSHAKE" in err["message"], err
            assert "not from a configured peer" in err["message"], err
    assert codes.count(502) == 2 and codes[:4] == [502, 200, 502, 200] and set(codes[4:]) == {200}
    row = _worker_row(rb, cluster.d_bad)
    assert row["healthy"] is True and row["breaker"] == "open" and row["breaker_opens"] == 1
    assert _worker_row(rb, cluster.d_recompute)["breaker"] == "closed"
    text = httpx.get(f"{rb.url}/metrics").text
    assert f'pdserve_router_worker_breaker_state{{role="decode",worker="{cluster.d_bad.url[7:]}"}} 2.0' in text
    assert f'pdserve_router_breaker_opens_total{{role="decode",worker="{cluster.d_bad.url[7:]}"}} 1.0' in text

    time.sleep(
        BREAKER_COOLDOWN_S + 0.2
    )  # the cool-down: half-open, one trial request goes to it, fails, and it opens again
    assert _worker_row(rb, cluster.d_bad)["breaker"] == "half_open"
    trial = [_complete(rb, f"trial {i}", max_tokens=4).status_code for i in range(4)]
    assert trial.count(502) == 1
    row = _worker_row(rb, cluster.d_bad)
    assert row["breaker"] == "open" and row["breaker_opens"] == 2
    assert wait_blocks_free([cluster.p, cluster.d_bad, cluster.d_recompute], 10) == {
        cluster.p.name: 0, cluster.d_bad.name: 0, cluster.d_recompute.name: 0
    }  # fmt: skip
