"""A request whose decode worker dies mid-stream goes on on the other one (issue 43, item 1), and
a rolling restart of every worker under load loses no request (item 2).

Real `pdserve launch`: two prefill and two decode workers (tiny V3, CPU). A greedy stream of 300
tokens; after its first 40 the decode worker serving it is SIGKILLed. The client's stream goes on
with no error event: the same token ids and text as an uninterrupted run, usage counting what it
got; the router counts one migration; once the killed worker is back, every worker holds 0 KV
blocks. A second router over the same workers with `--migration-limit 0` gives the failure
instead, naming the limit; a router that knows only one decode worker keeps the stream waiting
until the launcher has restarted it, then finishes it. `pdserve restart --all` while 6 clients send greedy requests without
pause: every worker drains and comes back, one at a time; no request fails, every answer is its
prompt's greedy tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdserve.numa import numa_nodes
from tests.helpers.launch import free_ports, pdserve, start_launch, stop_group, wait_up, write_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
MODEL = "tiny"
PROMPT = [11, 22, 33, 44, 55, 66]
MAX_TOKENS = 300
SECRET = "migration-test-secret"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    ports = free_ports(6)
    cpus = sorted(set(numa_nodes()[0]) & os.sched_getaffinity(0))
    worker = {
        "numa_node": 0,
        "kv_block_size": 16,
        "num_kv_blocks": 64,
        "max_num_seqs": 4,
        "cpus": ",".join(map(str, cpus)),
    }
    config = write_config(  # the helper's router, model, log folder and timeouts; two workers a role
        tmp, ports, served_model_name=MODEL, restart_backoff=0.5,
        cluster_secret=SECRET,  # a second router (the limit and one-worker tests) talks to the same workers
        prefill=[{**worker, "port": ports[1]}, {**worker, "port": ports[5]}],
        decode=[{**worker, "port": ports[2]}, {**worker, "port": ports[3]}],
    )  # fmt: skip
    proc, out = start_launch(config, tmp)
    try:
        wait_up(proc, out)
        yield {"proc": proc, "ports": ports, "out": out, "logs": tmp / "logs", "tmp": tmp}
    finally:
        stop_group(proc)


def _url(cluster, i: int) -> str:
    return f"http://127.0.0.1:{cluster['ports'][i]}"


def _status(cluster) -> dict[str, dict]:
    return {p["name"]: p for p in json.loads((cluster["logs"] / "status.json").read_text())["processes"]}


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m[1]) if m else 0.0


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5, trust_env=False).text


def _body(**extra) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {**body, "return_token_ids": True, **extra}


def _stream_and_kill(router: str, cluster, kill_after: int) -> tuple[list[int], str, dict | None, dict | None, str]:
    """Stream the request; after kill_after tokens SIGKILL the decode worker running it. (token
    ids, text, usage, error event or None, the killed worker's name)."""
    tokens, text, usage, error, killed = [], "", None, None, ""
    body = _body(stream=True, stream_options={"include_usage": True})
    with (
        httpx.Client(timeout=60, trust_env=False) as client,
        client.stream("POST", router + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
                text += choice.get("text") or ""
            if not killed and len(tokens) >= kill_after:
                running = {
                    n: _gauge(_metrics(_url(cluster, 2 + i)), "pdserve_num_requests_running")
                    for i, n in enumerate(("decode-0", "decode-1"))
                }
                killed = max(running, key=running.get)
                assert running[killed] == 1, running
                os.kill(_status(cluster)[killed]["pid"], signal.SIGKILL)
    return tokens, text, usage, error, killed


def _wait_back(cluster, name: str, old_pid: int) -> None:
    deadline = time.monotonic() + 90
    while True:
        p = _status(cluster)[name]
        if p["pid"] != old_pid and p["state"] == "healthy":
            try:
                if (
                    httpx.get(_url(cluster, 2 + int(name[-1])) + "/health", timeout=2, trust_env=False).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, cluster["out"].read_text()[-3000:]
        time.sleep(0.3)


def test_a_killed_decode_worker_loses_the_client_nothing(cluster):
    router = _url(cluster, 0)
    r = httpx.post(router + "/v1/completions", json=_body(), timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]
    before = _status(cluster)
    tokens, text, usage, error, killed = _stream_and_kill(router, cluster, kill_after=40)
    assert error is None, error
    assert tokens == want["token_ids"] and text == want["text"]
    assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] == len(PROMPT)
    m = _metrics(router)
    assert _gauge(m, "pdserve_router_migrations_total") == 1, [x for x in m.splitlines() if "migration" in x]
    _wait_back(cluster, killed, before[killed]["pid"])
    deadline = time.monotonic() + 30
    while True:  # the prefill lease and the dead worker's requests are all given back
        used = {i: _gauge(_metrics(_url(cluster, i)), "pdserve_kv_blocks_used") for i in (1, 2, 3, 5)}
        if not any(used.values()):
            break
        assert time.monotonic() < deadline, used
        time.sleep(0.5)


def _router(cluster, *flags: str) -> tuple[subprocess.Popen, str]:
    """A second router over the same workers (the launch's cluster secret), healthy; (process, URL)."""
    port = free_ports(1)[0]
    args = ["--role", "router", "--port", str(port), "--served-model-name", MODEL, "--health-interval", "0.5",
            "--prefill", _url(cluster, 1), "--cluster-secret", SECRET, *flags]  # fmt: skip
    env = {"PDSERVE_CACHE": str(cluster["tmp"] / "cache")}
    proc = pdserve(
        "serve", "--model", "tiny:deepseek_v3", *args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.3)


def test_with_migration_limit_0_the_failure_names_the_limit(cluster):
    proc, router = _router(
        cluster, "--decode", _url(cluster, 2), "--decode", _url(cluster, 3), "--migration-limit", "0"
    )
    try:
        before = _status(cluster)
        _, _, _, error, killed = _stream_and_kill(router, cluster, kill_after=20)
        assert error is not None and error["message"].startswith("the decode worker failed mid-request"), error
        assert "migration_limit 0 reached" in error["message"], error
        _wait_back(cluster, killed, before[killed]["pid"])
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_with_one_decode_worker_the_stream_waits_for_its_restart(cluster):
    """A router that knows one decode worker: killed mid-stream, the launcher restarts it, and the
    migrated request goes on there once it is healthy: the client's stream pauses, nothing else."""
    r = httpx.post(_url(cluster, 0) + "/v1/completions", json=_body(), timeout=120, trust_env=False)
    want = r.json()["choices"][0]
    proc, router = _router(cluster, "--decode", _url(cluster, 2))
    try:
        before = _status(cluster)["decode-0"]["pid"]
        t0 = time.monotonic()
        tokens, text, usage, error, killed = _stream_and_kill(router, cluster, kill_after=30)
        took = time.monotonic() - t0
        assert killed == "decode-0" and error is None, error
        assert tokens == want["token_ids"] and text == want["text"] and usage["completion_tokens"] == MAX_TOKENS
        assert _status(cluster)["decode-0"]["pid"] != before
        print(f"stream paused for the restart and finished {took:.1f} s after it started")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_a_rolling_restart_under_load_loses_no_request(cluster):
    router = _url(cluster, 0)
    prompts = [[5 + i, 60 + 3 * i, 7, 200 + i] for i in range(6)]
    want = {}
    for p in prompts:
        r = httpx.post(
            router + "/v1/completions", json={**_body(max_tokens=40), "prompt": p}, timeout=60, trust_env=False
        )
        want[tuple(p)] = r.json()["choices"][0]["token_ids"]
    stop, failures, served = threading.Event(), [], [0]

    def client(p: list[int]) -> None:
        with httpx.Client(timeout=120, trust_env=False) as c:
            while not stop.is_set():
                try:
                    r = c.post(router + "/v1/completions", json={**_body(max_tokens=40), "prompt": p})
                    got = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
                    if got != want[tuple(p)]:
                        failures.append((r.status_code, r.text[:300]))
                    served[0] += 1
                except httpx.HTTPError as e:
                    failures.append(("connection", repr(e)))

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        before = _status(cluster)
        out = subprocess.run(
            [sys.executable, "-m", "pdserve", "restart", "--all", "--status-file", str(cluster["logs"] / "status.json"), "--timeout", "180"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    after = _status(cluster)
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        assert after[name]["pid"] != before[name]["pid"] and after[name]["state"] == "healthy", (name, after[name])
        assert f"{name}: healthy again as pid {after[name]['pid']}" in out.stdout
    assert after["router"]["pid"] == before["router"]["pid"]
    assert not failures, failures[:5]
    assert served[0] > 20, served
