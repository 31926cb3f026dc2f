"""Serving one component's app: uvicorn with pdserve's settings (run_server), and the router as
several processes on one listening socket (serve_router_processes), each ending with its parent."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from pdserve.serve_config import RouterServeConfig

log = logging.getLogger("pdserve.serve")
STOP_GRACE_S = 15.0  # uvicorn's graceful shutdown (5 s) and the lifespan's, with room


def run_server(app: Any, host: str, port: int, sockets: list[Any] | None = None, announce: str | None = None) -> None:
    """uvicorn until a stop signal; on `sockets` already bound (router processes) if given."""
    # keep-alive longer than any client's idle expiry (the router's aiohttp: 30 s; httpx: 5 s): else
    # the server closes an idle connection just as the router reuses it, and the POST gets ReadError.
    # h11, not httptools where installed: httptools takes a header of any size (tests/e2e/test_fuzz.py)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http="h11",
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=75,
    )
    server = _Server(config, getattr(app.state, "on_exit", None), announce, getattr(app.state, "drain", None))
    app.state.request_stop = lambda: setattr(server, "should_exit", True)  # a worker whose engine failed
    server.run(sockets=sockets)


def serve_router_processes(cfg: RouterServeConfig) -> int:
    """The router as `api_server_count` processes on one listening socket (pre-fork, as uvicorn's
    --workers): the kernel gives each new connection to one of them. Python costs the router CPU
    on every streamed token (docs/pd-gpu.md), so one process is the ceiling
    of a busy cluster. Each process has its own view of the workers (probes, breakers, in-flight
    counts) and its own share of max_queued_requests; their metrics go to one Prometheus
    multiprocess folder, which /metrics on any of them reads whole. A process that dies stops the
    others and this one exits 1 (`pdserve launch` restarts the router by its policy)."""
    import multiprocessing
    import shutil
    import signal
    import socket
    import tempfile
    import threading

    from prometheus_client import multiprocess

    host, port, n = cfg.router.host, cfg.router.port, cfg.router.api_server_count
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        print(f"pdserve serve --role router: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 2
    _remove_orphaned_metrics_dirs()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by prometheus_client when each child imports it
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_router_process, args=(cfg.model_dump_json(), sock, i, os.getpid()), name=f"router-{i}")
        for i in range(n)
    ]
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    for p in procs:
        p.start()
    sock.close()  # the children hold it now
    log.info(
        "pdserve router listening on http://%s:%d with %d processes (pids %s)",
        host,
        port,
        n,
        ", ".join(str(p.pid) for p in procs),
    )
    died = None
    while not stop.wait(0.2):
        died = next((p for p in procs if not p.is_alive()), None)
        if died is not None:
            log.error(
                "router process %s (pid %d) exited with code %s: stopping the others",
                died.name,
                died.pid,
                died.exitcode,
            )
            break
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)  # each drains its streams (an error event each), as one router does
    for p in procs:
        p.join(timeout=STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
        multiprocess.mark_process_dead(p.pid)
    shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if died is not None else 0


METRICS_DIR_PREFIX = "pdserve-router-metrics-"  # + the router parent's pid + "-" + random


def _remove_orphaned_metrics_dirs() -> None:
    """Metrics folders of router parents that are gone (one SIGKILLed never removed its own)."""
    import shutil
    import tempfile

    from pdserve.lifetime import pid_alive

    for path in Path(tempfile.gettempdir()).glob(f"{METRICS_DIR_PREFIX}*-*"):
        pid = path.name[len(METRICS_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            shutil.rmtree(path)
            log.info("removed %s, left by router process %s", path, pid)
        except OSError as e:  # another user's, say: not ours to remove
            log.warning("cannot remove %s, left by router process %s: %s", path, pid, e)


def _router_process(cfg_json: str, sock: Any, index: int, parent: int) -> None:
    """One of serve_router_processes' children (spawned: a fresh interpreter). It ends with its
    parent, however that ends: an orphan would keep the port from the router a supervisor restarts."""
    import signal

    from pdserve.lifetime import die_with_parent

    die_with_parent(parent, signal.SIGTERM)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from pdserve.router.app import build_router_app

    cfg = RouterServeConfig.model_validate_json(cfg_json)
    app = build_router_app(cfg)
    run_server(app, cfg.router.host, cfg.router.port, sockets=[sock])


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when a stop signal arrives (the router then ends its open
    streams with an error event at once, rather than when the graceful-shutdown time runs out); a
    worker drains first (worker/drain.py), a second signal stops it at once."""

    def __init__(
        self, config: uvicorn.Config, on_exit: Callable[[], None] | None, announce: str | None = None, drain: Any = None
    ) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._drain = drain  # a worker's Drain (worker/drain.py); None: stop at once
        self._announce = announce

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._announce:  # said once the port is bound (a failed bind exits 3 with uvicorn's error)
            log.info(self._announce)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._on_exit is not None:
            self._on_exit()
        drain = self._drain
        if drain is not None and not drain.draining:  # a worker's first stop signal: drain, then stop
            drain.start()
            threading.Thread(target=self._stop_when_drained, name="drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _stop_when_drained(self) -> None:
        self._drain.wait()
        self.should_exit = True  # uvicorn's loop sees it within 0.1 s
