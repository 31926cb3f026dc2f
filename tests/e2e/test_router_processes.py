"""The router as several processes on one port (`--api-server-count`, serve.py): real processes,
a tiny PD cluster behind them. Every request is served whichever process accepts it, the
processes share the load, /metrics on any of them counts every process's requests, a process that
dies stops the router (exit 1, for `pdserve launch` to restart it), and SIGTERM ends them all."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI
from prometheus_client.mmap_dict import MmapedDict

from pdserve.tiny_model import make_tiny_model
from tests.helpers.cluster import Cluster, scrape

pytestmark = pytest.mark.timeout(300)
N = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    make_tiny_model(model_dir)
    with Cluster(model_dir, tmp_path_factory.mktemp("logs")) as c:
        p = c.worker("prefill")
        d = c.worker("decode", peers=[p])
        c.wait_healthy()  # the workers first: each router process then finds them in its first probe
        c.router("--api-server-count", str(N), prefill=[p], decode=[d])
        c.wait_healthy()
        yield c


def _router(c: Cluster):
    return next(p for p in c.procs if p.role == "router")


def _children(c: Cluster) -> list[psutil.Process]:
    return [
        ch for ch in psutil.Process(_router(c).popen.pid).children() if "resource_tracker" not in " ".join(ch.cmdline())
    ]


def _completions_by_process(metrics_dir: str) -> dict[int, float]:
    """Each process's count of answered completions, from its own file in the multiprocess folder."""
    out: dict[int, float] = {}
    for path in Path(metrics_dir).glob("counter_*.db"):
        pid = int(path.stem.split("_")[1])
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):
            name, sample, labels, _help = json.loads(key)
            if (
                sample == "pdserve_router_requests_total"
                and labels == {"route": "/v1/completions", "status": "200"}
                and value
            ):
                out[pid] = out.get(pid, 0.0) + value
    return out


def test_every_request_is_served_and_the_processes_share_them(cluster):
    router = _router(cluster)
    kids = _children(cluster)
    assert len(kids) == N, [k.cmdline() for k in kids]

    # one connection a request (a fresh client each), so the kernel hands them out among the processes
    def one(i: int) -> str:
        with OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0) as client:
            return (
                client.completions.create(model="tiny", prompt=f"request {i}:", max_tokens=8, temperature=0)
                .choices[0]
                .text
            )

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(one, range(36)))
    assert len(texts) == 36 and all(isinstance(t, str) for t in texts)
    greedy = {one(0) for _ in range(2)}
    assert greedy == {texts[0]}  # the same answer whichever process served it
    served_by = _completions_by_process(kids[0].environ()["PROMETHEUS_MULTIPROC_DIR"])
    assert sum(served_by.values()) == 38 and set(served_by) <= {k.pid for k in kids}
    assert len(served_by) >= 2, f"one process served everything: {served_by}"
    # /metrics is the whole router's, whichever process answers it
    for _ in range(4):
        m = httpx.get(f"{router.url}/metrics", timeout=10).text
        served = sum(
            float(line.rsplit(" ", 1)[1])
            for line in m.splitlines()
            if line.startswith('pdserve_router_requests_total{route="/v1/completions",status="200"}')
        )
        assert served == 38, m[:2000]
    assert scrape(router.url)["pdserve_router_requests_in_flight"] == 0.0


def test_a_router_process_probes_before_it_accepts(cluster):
    """A router started beside healthy workers serves its very first connection: every process
    probes once before accepting, so none answers 503 for workers it has not looked at yet."""
    prefill, decode = (next(p for p in cluster.procs if p.role == role) for role in ("prefill", "decode"))
    r = cluster.router("--api-server-count", "2", prefill=[prefill], decode=[decode])
    deadline = time.monotonic() + 120
    first = None
    while first is None:
        assert r.popen.poll() is None and time.monotonic() < deadline, r.log_tail()
        try:
            first = httpx.get(f"{r.url}/health", timeout=5)
        except httpx.TransportError:  # not accepting yet
            time.sleep(0.01)
    assert first.status_code == 200, first.text
    for _ in range(6):  # fresh connections, so both processes answer some
        assert httpx.get(f"{r.url}/health", timeout=5).status_code == 200


def test_a_process_that_dies_stops_the_router_and_sigterm_ends_them_all(tmp_path):
    model_dir = tmp_path / "model"
    make_tiny_model(model_dir)
    with Cluster(model_dir, tmp_path / "logs") as c:
        w = c.worker("colocated")
        r = c.router("--api-server-count", "2", colocated=[w])
        c.wait_healthy()
        kids = _children(c)
        assert len(kids) == 2
        kids[0].kill()
        assert r.popen.wait(timeout=30) == 1
        _gone([kids[1]])
        assert "exited with code -9: stopping the others" in r.log.read_text()

        c.restart(r)
        c.wait_healthy()
        kids = _children(c)
        assert len(kids) == 2
        r.popen.send_signal(signal.SIGTERM)  # the router's own process only, as a supervisor stops it
        assert r.popen.wait(timeout=30) == 0
        _gone(kids)

        c.restart(r)  # and if the parent is killed outright, its children do not outlive it
        c.wait_healthy()
        kids = _children(c)
        killed = r.popen.pid
        r.popen.kill()
        r.popen.wait()
        _gone(kids)
        left = list(Path(tempfile.gettempdir()).glob(f"pdserve-router-metrics-{killed}-*"))
        assert len(left) == 1  # its metrics folder, which only the parent removes
        c.restart(r)  # the port is free again, and the next router removes what the killed one left
        c.wait_healthy()
        assert not left[0].exists()
        assert f"removed {left[0]}, left by router process {killed}" in r.log.read_text()


def _gone(procs: list[psutil.Process], timeout_s: float = 20.0) -> None:
    def running(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def alive() -> list[int]:
        return [p.pid for p in procs if running(p)]

    deadline = time.monotonic() + timeout_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), f"still running: {alive()}"
