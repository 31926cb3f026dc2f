"""`pdserve launch` supervises: a killed worker or router is restarted while the rest keeps serving.

Real `pdserve launch`, real processes, real NIXL. Each test kills one process with SIGKILL and
checks what a client sees: an error (not a hang) for the request in flight, 503 with Retry-After
(not a refused connection) from the router while a role is missing, and the same greedy tokens
once the launcher has brought the process back, with every KV block returned.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.config import parse_config
from pdserve.launch import Child, Cluster, Restarts, new_log_dir, plan
from tests.helpers.launch import free_ports, start_launch, stop_group, wait_up, write_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SERVE_AGAIN_S = 60
PROMPT = "supervised restarts keep the router up"
MODEL = "tiny"  # served_model_name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("supervised")
    ports = free_ports(3)
    # no migration (test_migration.py has it): a kill's failure reaches the client, as it does at the limit
    router = {"port": ports[0], "health_interval": 0.5, "migration_limit": 0}
    config = write_config(tmp, ports, served_model_name=MODEL, restart_backoff=0.5, router=router)
    proc, out = start_launch(config, tmp)
    try:
        wait_up(proc, out)
        yield {"proc": proc, "ports": ports, "out": out, "logs": tmp / "logs"}
    finally:
        stop_group(proc)
        for pid in _pids(tmp / "logs").values():  # never leave a server behind, whatever the test did
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids(logs: Path) -> dict[str, int]:
    try:
        status = json.loads((logs / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return {p["name"]: p["pid"] for p in status["processes"]}


def _status(cluster, name: str) -> dict:
    return next(p for p in json.loads((cluster["logs"] / "status.json").read_text())["processes"] if p["name"] == name)


def _url(cluster, i: int) -> str:
    return f"http://127.0.0.1:{cluster['ports'][i]}"


def _complete(cluster, max_tokens: int = 8, timeout: float = 60) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    return httpx.post(_url(cluster, 0) + "/v1/completions", json=body, timeout=timeout, trust_env=False)


def _wait_serving(cluster, since: float) -> tuple[list[int], float]:
    """Poll the router until a request succeeds; (its token ids, seconds since `since`)."""
    while True:
        try:
            r = _complete(cluster, timeout=20)
            if r.status_code == 200:
                return r.json()["choices"][0]["token_ids"], time.monotonic() - since
        except httpx.HTTPError:
            pass  # the router itself may be restarting
        assert time.monotonic() - since < SERVE_AGAIN_S, cluster["out"].read_text()[-4000:]
        time.sleep(0.5)


def _wait_503(cluster, role: str) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        r = _complete(cluster)
        if r.status_code == 503:
            return r
        assert time.monotonic() < deadline, f"router never answered 503 while {role} was down: {r.status_code} {r.text}"
        time.sleep(0.1)


def _blocks_used(url: str, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while True:
        used = httpx.get(url + "/health", trust_env=False, timeout=5).json()["kv_blocks_used"]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def _restarted(cluster, name: str, old_pid: int) -> None:
    deadline = time.monotonic() + SERVE_AGAIN_S
    while _status(cluster, name)["pid"] == old_pid or _status(cluster, name)["state"] != "healthy":
        assert time.monotonic() < deadline, cluster["out"].read_text()[-4000:]
        time.sleep(0.2)


def _tokens(cluster) -> list[int]:
    r = _complete(cluster)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_decode_killed_mid_stream_is_restarted(cluster):
    want = _tokens(cluster)
    victim = _pids(cluster["logs"])["decode-0"]
    body = {
        "model": MODEL,
        "prompt": "a long answer",
        "max_tokens": 600,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30, trust_env=False) as client,
        client.stream("POST", _url(cluster, 0) + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert [next(lines) for _ in range(6)]  # decode is streaming now
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        error = next(
            (json.loads(line[6:])["error"] for line in lines if line.startswith("data: {") and '"error"' in line), None
        )
        error_s = time.monotonic() - t0
    assert error is not None and error_s < 10

    down = _wait_503(cluster, "decode")  # an OpenAI error with Retry-After, not a refused connection
    assert down.headers["Retry-After"] and down.json()["error"]["code"] == "no_healthy_workers"
    assert "decode" in down.json()["error"]["message"]
    health = httpx.get(_url(cluster, 0) + "/health", trust_env=False)
    assert health.status_code in (200, 503)
    if health.status_code == 503:  # it may already be back
        assert "decode" in health.json()["reason"]

    got, back_s = _wait_serving(cluster, t0)
    assert got == want
    _restarted(cluster, "decode-0", victim)
    status = _status(cluster, "decode-0")
    assert status["restarts"] == 1 and status["exits"] == ["killed by SIGKILL"]
    assert (
        'pdserve_launch_restarts_total{process="decode-0",role="decode"} 1'
        in (cluster["logs"] / "metrics.prom").read_text()
    )
    out = cluster["out"].read_text()
    assert f"decode-0 (pid {victim}) killed by SIGKILL; restarting in" in out and "last lines of" in out
    assert _blocks_used(_url(cluster, 1)) == 0 and _blocks_used(_url(cluster, 2)) == 0
    print(f"decode SIGKILL: error event after {error_s:.2f} s, serving again after {back_s:.1f} s")


def test_prefill_killed_is_restarted_and_read_from_at_once(cluster):
    """A restarted prefill keeps its engine id; decode sees the new instance in the handle and
    fetches its metadata anew, so the first request after the restart reads its KV (policy fail)."""
    want = _tokens(cluster)
    victim = _pids(cluster["logs"])["prefill-0"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert "prefill" in _wait_503(cluster, "prefill").json()["error"]["message"]
    got, back_s = _wait_serving(cluster, t0)
    assert got == want  # no failed read: with kv_load_failure_policy fail it would be an error
    metrics = httpx.get(_url(cluster, 2) + "/metrics", trust_env=False).text
    assert "pdserve_kv_transfer_failures_total 0.0" in metrics
    assert _blocks_used(_url(cluster, 1)) == 0 and _blocks_used(_url(cluster, 2)) == 0
    print(f"prefill SIGKILL: serving again after {back_s:.1f} s")


def test_router_killed_is_restarted(cluster):
    want = _tokens(cluster)
    victim = _pids(cluster["logs"])["router"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    got, back_s = _wait_serving(cluster, t0)
    assert got == want
    _restarted(cluster, "router", victim)
    assert _status(cluster, "prefill-0")["state"] == "healthy"  # the workers were not touched
    print(f"router SIGKILL: serving again after {back_s:.1f} s")


def test_health_cli_shows_restarts(cluster):
    env = {"PDSERVE_CACHE": str(cluster["logs"].parent / "cache")}
    args = [a for i in range(3) for a in ("--url", _url(cluster, i))]
    out = subprocess.run([sys.executable, "-m", "pdserve", "health", *args, "--status", str(cluster["logs"] / "status.json")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, **env})  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert "restarts 1 (last: killed by SIGKILL)" in rows[_url(cluster, 2) + "/health"]


def test_ctrl_c_stops_everything(cluster):
    pids = _pids(cluster["logs"])
    cluster["proc"].send_signal(signal.SIGINT)
    assert cluster["proc"].wait(timeout=30) == 0
    for name, pid in pids.items():
        assert not os.path.exists(f"/proc/{pid}"), f"{name} (pid {pid}) still exists"


def test_a_crash_loop_gives_up_and_says_so(tmp_path):
    """A worker that dies every time it starts is restarted max_restarts times, then left down."""
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "not-a-model"}')
    cfg = parse_config(
        {"model": str(model), "colocated": [{"port": free_ports(1)[0]}], "router": {"port": free_ports(1)[0]}}
    )
    spec = plan(cfg, str(model))[0]
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        cluster = Cluster(tmp_path, out, Restarts(max_restarts=2, window_s=120, backoff_s=0.1, max_backoff_s=0.2))
        child = cluster.start(spec)
        runner = threading.Thread(target=cluster.supervise, daemon=True)
        runner.start()
        try:
            deadline = time.monotonic() + 120
            while child.state != "gave up":
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        finally:
            cluster.stop_signal = signal.SIGTERM
            runner.join(10)
            cluster.stop(5)
    text = log.read_text()
    assert child.restarts == 2 and text.count("restarting in") == 2
    assert "crash loop: 2 restarts within 120 s (max_restarts 2), giving up - it stays down" in text
    assert "last lines of" in text and "not-a-model" in text


@pytest.mark.parametrize(
    "policy, rc, state",
    [
        ("never", 1, "stopped"),
        ("on-failure", 0, "stopped"),
        ("on-failure", 1, "waiting to restart"),
        ("on-failure", -9, "waiting to restart"),
        ("always", 0, "waiting to restart"),
    ],
)
def test_restart_policy_decides_what_an_exit_does(tmp_path, policy, rc, state):
    cfg = parse_config({"model": "tiny:deepseek_v3", "colocated": [{"port": 30002, "restart": policy}]})
    spec = plan(cfg, "/models/ckpt")[0]
    assert spec.restart == policy
    popen = subprocess.Popen(
        [sys.executable, "-c", f"import os, signal; os.kill(os.getpid(), {-rc}) if {rc} < 0 else exit({rc})"]
    )
    popen.wait(timeout=30)
    with open(tmp_path / "out.txt", "w") as out:
        cluster = Cluster(tmp_path, out, Restarts(backoff_s=0.5))
        child = Child(spec, popen, tmp_path / "colocated-0.log")
        cluster._exited(child)
    assert child.state == state
    assert (child.restart_at is not None) == (state == "waiting to restart")


def test_logs_go_to_a_new_folder_per_launch_under_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    made = new_log_dir(None)
    assert made.parent == tmp_path / "cache" / "logs" and made.is_dir()
    assert (tmp_path / "cache" / "logs" / "latest").resolve() == made
    given = new_log_dir(str(tmp_path / "mine"))
    assert given == tmp_path / "mine" and given.is_dir() and made.is_dir()  # the earlier launch's logs are kept
    assert (tmp_path / "cache" / "logs" / "latest").resolve() == given
