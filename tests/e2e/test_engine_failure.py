"""A worker whose engine fails exits, and `pdserve launch` brings it back (issue 29, item 1).

Real `pdserve launch`, real processes. Two faults:
- an engine step that raises torch.OutOfMemoryError (the test-only hook PDSERVE_TEST_FAULT,
  worker/fault_hook.py: prefill's step of a prompt holding TRIGGER raises): the client gets an
  OpenAI error naming the role and the exception's type, /health is 503 with the reason while the
  worker is still up, the worker exits 3, the launcher restarts it, and the router serves the same
  greedy tokens again by itself within SERVE_AGAIN_S;
- SIGKILL of a tensor-parallel rank of the decode worker (TP2, gloo) mid-stream: the stream ends
  with an error naming the decode worker, the worker exits, and the same comes back;
- SIGSTOP of that rank mid-stream (rank 0 then waits in a collective that never returns): caught
  within the decode worker's stall_timeout (STALL_S), the same error, exit and return.
"""

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pdserve.numa import numa_nodes
from tests.helpers.launch import free_ports, start_launch, stop_group, wait_up

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SERVE_AGAIN_S = 60
STALL_S = 3.0  # the decode worker's stall_timeout: a hung rank is caught after it
TRIGGER = 777  # a token id of the tiny model (vocab 896) that PROMPT does not hold
PROMPT = [10, 20, 30, 40, 50]
MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine_failure")
    ports = free_ports(3)
    cpus = sorted(set(numa_nodes()[0]) & os.sched_getaffinity(0))
    worker = {"numa_node": 0, "kv_block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4}
    cfg = {
        "model": "tiny:deepseek_v3",
        "served_model_name": MODEL,
        # no migration (test_migration.py has it): these tests follow the failure to the client
        "router": {"port": ports[0], "health_interval": 0.5, "migration_limit": 0},
        "prefill": [{**worker, "port": ports[1], "cpus": str(cpus[0])}],
        "decode": [
            {**worker, "port": ports[2], "tp_size": 2, "cpus": ",".join(map(str, cpus)), "stall_timeout": STALL_S}
        ],
        "log_dir": str(tmp / "logs"),
        "startup_timeout": 240,
        "stop_grace_seconds": 5,
        "restart_backoff": 0.5,
    }
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc, out = start_launch(config, tmp, {"PDSERVE_TEST_FAULT": f"prefill:{TRIGGER}"})
    try:
        wait_up(proc, out)
        yield {"proc": proc, "ports": ports, "out": out, "logs": tmp / "logs"}
    finally:
        stop_group(proc)
        for p in _status(tmp / "logs"):
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def _status(logs: Path) -> list[dict]:
    try:
        return json.loads((logs / "status.json").read_text())["processes"]
    except (OSError, ValueError):
        return []


def _proc(cluster, name: str) -> dict:
    return next(p for p in _status(cluster["logs"]) if p["name"] == name)


def _url(cluster, i: int) -> str:
    return f"http://127.0.0.1:{cluster['ports'][i]}"


def _complete(cluster, prompt: list[int], max_tokens: int = 8, timeout: float = 60, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update({"return_token_ids": True, **extra})
    return httpx.post(_url(cluster, 0) + "/v1/completions", json=body, timeout=timeout, trust_env=False)


def _serving_again(cluster, name: str, old_pid: int, since: float) -> tuple[list[int], float]:
    """Poll the router until a request succeeds on a restarted `name`; (token ids, seconds since `since`)."""
    while True:
        assert time.monotonic() - since < SERVE_AGAIN_S, cluster["out"].read_text()[-4000:]
        if _proc(cluster, name)["pid"] != old_pid:
            try:
                r = _complete(cluster, PROMPT, timeout=20)
                if r.status_code == 200:
                    return r.json()["choices"][0]["token_ids"], time.monotonic() - since
            except httpx.HTTPError:
                pass
        time.sleep(0.3)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_step_that_raises_fails_its_request_and_the_worker_restarts(cluster):
    r = _complete(cluster, PROMPT)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["token_ids"]
    victim = _proc(cluster, "prefill-0")["pid"]

    t0 = time.monotonic()
    r = _complete(cluster, [10, 20, TRIGGER])
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["message"].startswith(
        "the prefill worker failed: engine step raised OutOfMemoryError (not migrated: migration_limit 0 reached)"
    ), error
    assert "http" not in error["message"]
    health = httpx.get(_url(cluster, 1) + "/health", trust_env=False, timeout=5)  # still up for EXIT_DELAY_S
    assert health.status_code == 503 and health.json()["reason"] == "engine step raised OutOfMemoryError"

    got, back_s = _serving_again(cluster, "prefill-0", victim, t0)
    assert got == want
    p = _proc(cluster, "prefill-0")
    assert p["restarts"] == 1 and p["exits"] == ["exited with code 3"], p
    log = (cluster["logs"] / "prefill-0.log").read_text()
    assert "engine loop died" in log and "torch.OutOfMemoryError: injected by PDSERVE_TEST_FAULT" in log
    print(f"prefill engine failure: serving again after {back_s:.1f} s")


def test_a_killed_tp_rank_takes_its_worker_down_and_back(cluster):
    r = _complete(cluster, PROMPT)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["token_ids"]
    worker = _proc(cluster, "decode-0")["pid"]
    (rank1,) = _children(worker)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30, trust_env=False) as client,
        client.stream("POST", _url(cluster, 0) + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert [next(lines) for _ in range(4)]  # decode is streaming now
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        error = next((json.loads(x[6:])["error"] for x in lines if x.startswith("data: {") and '"error"' in x), None)
        error_s = time.monotonic() - t0
    assert error is not None and error_s < 10, error
    assert error["message"].startswith("the decode worker failed"), error

    got, back_s = _serving_again(cluster, "decode-0", worker, t0)
    assert got == want
    p = _proc(cluster, "decode-0")
    assert p["restarts"] == 1 and p["exits"] == ["exited with code 3"], p
    log = (cluster["logs"] / "decode-0.log").read_text()
    assert f"tensor-parallel rank 1 (pid {rank1}) exited (killed by SIGKILL)" in log
    print(f"decode TP rank SIGKILL: error after {error_s:.2f} s, serving again after {back_s:.1f} s")


def test_a_stopped_tp_rank_is_caught_and_its_worker_restarts(cluster):
    r = _complete(cluster, PROMPT)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["token_ids"]
    worker = _proc(cluster, "decode-0")["pid"]
    (rank1,) = _children(worker)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with (
            httpx.Client(timeout=60, trust_env=False) as client,
            client.stream("POST", _url(cluster, 0) + "/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert [next(lines) for _ in range(4)]  # decode is streaming now
            t0 = time.monotonic()
            os.kill(rank1, signal.SIGSTOP)
            error = next(
                (json.loads(x[6:])["error"] for x in lines if x.startswith("data: {") and '"error"' in x), None
            )
            error_s = time.monotonic() - t0
    finally:
        try:
            os.kill(rank1, signal.SIGKILL)  # gone already, unless the watchdog missed it
        except ProcessLookupError:
            pass
    assert error is not None and STALL_S <= error_s < STALL_S + 5, (error, error_s)
    assert error["message"].startswith("the decode worker failed"), error

    got, back_s = _serving_again(cluster, "decode-0", worker, t0)
    assert got == want
    p = _proc(cluster, "decode-0")
    assert p["exits"][-1] == "exited with code 3", p
    log = (cluster["logs"] / "decode-0.log").read_text()
    assert "a tensor-parallel rank stopped answering: engine step not finished for" in log
    print(f"decode TP rank SIGSTOP: error after {error_s:.2f} s, serving again after {back_s:.1f} s")
