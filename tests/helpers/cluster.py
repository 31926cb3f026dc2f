"""A real tiny pdserve cluster for tests: workers and routers as `python -m pdserve serve ...`
subprocesses on free loopback ports, each in its own process group, logs in a folder.

    with Cluster(model_dir, log_dir) as c:
        p = c.worker("prefill"); d = c.worker("decode")
        r = c.router(prefill=[p], decode=[d])
        c.wait_healthy()                      # every process's /health is 200
        ... r.url ...
    # every process got SIGTERM (SIGKILL after a grace period) and was waited for

Workers started before wait_healthy() load their models in parallel.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SECRET = "test-cluster-secret"
STOP_GRACE_S = 10.0


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+), so that no listener a process opens on
    port 0 meanwhile (UCX's, for one) can take it between this check and the server's bind; and
    never one this test process handed out before: a cluster's servers get their ports seconds
    before they bind them, and a second draw of a port not yet bound (1 in 12,000 a pair) let a
    router bind the port its worker was given, answer that worker's health checks, and leave a
    router waiting for a worker that had exited."""
    while True:
        port = random.randrange(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


@dataclass
class Proc:
    name: str
    role: str
    url: str
    popen: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)  # `pdserve serve` arguments, for restart()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class Cluster:
    def __init__(
        self, model_dir: str | Path, log_dir: str | Path, *, kv_blocks: int = 256, max_num_seqs: int = 32
    ) -> None:
        self.model_dir = str(model_dir)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.kv_blocks = kv_blocks
        self.max_num_seqs = max_num_seqs
        self.procs: list[Proc] = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def worker(self, role: str, *extra: str, peers: list[Proc] = (), port: int | None = None) -> Proc:
        """peers: the workers whose transfer metadata it may fetch (prefill: given by URL in `extra`
        as --peer, with a port chosen up front, since its decode peer starts after it)."""
        port = port or free_port()
        args = [
            "--role", role, "--port", str(port), "--model", self.model_dir,
            "--num-kv-blocks", str(self.kv_blocks), "--max-num-seqs", str(self.max_num_seqs),
            "--engine-id", f"{role}-{port}", "--cluster-secret", SECRET, "--transfer-backend", "nixl",
            *[a for p in peers for a in ("--peer", p.url)], *extra,
        ]  # fmt: skip
        return self._start(f"{role}-{port}", role, port, args)

    def router(
        self, *extra: str, prefill: list[Proc] = (), decode: list[Proc] = (), colocated: list[Proc] = ()
    ) -> Proc:
        port = free_port()
        args = [
            "--role", "router", "--port", str(port), "--model", self.model_dir, "--served-model-name", "tiny",
            "--health-interval", "0.5", "--cluster-secret", SECRET,
            *[a for p in prefill for a in ("--prefill", p.url)],
            *[a for p in decode for a in ("--decode", p.url)],
            *[a for p in colocated for a in ("--colocated", p.url)], *extra,
        ]  # fmt: skip
        return self._start(f"router-{port}", "router", port, args)

    def _start(self, name: str, role: str, port: int, args: list[str]) -> Proc:
        proc = Proc(
            name,
            role,
            f"http://127.0.0.1:{port}",
            _spawn(args, self.log_dir / f"{name}.log"),
            self.log_dir / f"{name}.log",
            args,
        )
        self.procs.append(proc)
        return proc

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        """Send sig to proc's process group and reap it (a crash, for fault tests)."""
        _signal(proc, sig)
        proc.popen.wait()

    def restart(self, proc: Proc) -> None:
        """Start proc again with the same arguments (same port, same engine id), appending to its log."""
        if proc.popen.poll() is None:
            raise RuntimeError(f"{proc.name} is still running")
        proc.popen = _spawn(proc.args, proc.log, append=True)

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        """Until every process answers /health with 200; raises with the log of one that did not."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.procs)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for p in list(pending):
                    if p.popen.poll() is not None:
                        raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")
                    try:
                        if client.get(f"{p.url}/health", headers=auth_headers(p)).status_code == 200 and self._sees_all(
                            client, p
                        ):
                            pending.remove(p)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{pending[0].name} not healthy after {timeout_s} s:{self._why(client, pending[0])}\n{pending[0].log_tail()}"
                    )
                if pending:
                    time.sleep(0.25)

    def _sees_all(self, client: httpx.Client, p: Proc) -> bool:
        """A router is ready for a test once its own probes found every worker it was given
        healthy (its /health needs only one pair); other processes need nothing more."""
        if p.role != "router":
            return True
        rows = client.get(f"{p.url}/workers", headers=auth_headers(p)).json()["workers"]
        mine = {
            u
            for flag in ("--prefill", "--decode", "--colocated")
            for i, a in enumerate(p.args)
            if a == flag
            for u in [p.args[i + 1]]
        }
        return all(w["healthy"] for w in rows if w["url"] in mine)

    def _why(self, client: httpx.Client, p: Proc) -> str:
        """What a router that is not ready says of its workers (its log names only the healthy ones)."""
        if p.role != "router":
            return ""
        try:
            rows = client.get(f"{p.url}/workers", headers=auth_headers(p)).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return f" (its /workers: {type(e).__name__}: {e})"
        return "".join(f"\n  {w['url']} ({w['role']}): {w['reason']}" for w in rows if not w["healthy"])

    def stop(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace period, reap all."""
        for p in self.procs:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.popen.wait()
        self.procs.clear()


def scrape(url: str) -> dict[str, float]:
    """A process's /metrics, each sample name summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_blocks_free(workers: list[Proc], timeout_s: float = 15.0) -> dict[str, float]:
    """KV blocks in use per worker (token and sliding-window space), as soon as all are 0 (or
    whatever they are at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = {}
        for p in workers:
            m = scrape(p.url)
            used[p.name] = m["pdserve_kv_blocks_used"] + m["pdserve_kv_window_blocks_used"]
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def _spawn(args: list[str], log: Path, append: bool = False) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "ab" if append else "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve", "serve", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def auth_headers(p: Proc) -> dict[str, str]:
    """The API key a router was started with (--api-key guards its /health too), as a header."""
    if "--api-key" not in p.args:
        return {}
    return {"Authorization": f"Bearer {p.args[p.args.index('--api-key') + 1]}"}


def _signal(p: Proc, sig: int) -> None:
    if p.popen.poll() is not None:
        return
    try:
        os.killpg(p.popen.pid, sig)  # its own session: the group id is its pid
    except ProcessLookupError:
        pass
