"""`pdserve restart` against a fake launch (a status.json this test rewrites as the supervisor
would): one process at a time, and --settle seconds from one healthy again to the next request,
so routers (which probe a down worker every second) take a restarted worker back before the next
of its role drains. Without the settle, the chaos run's rolling restart left the router with no
prefill worker for 75 ms, and two requests failed (scripts/chaos.py, two workers a role)."""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from pathlib import Path

from pdserve.launch.restart_cli import run_restart


def _write(status: Path, pids: dict[str, int]) -> None:
    procs = [{"name": n, "role": n.split("-")[0], "pid": p, "state": "healthy"} for n, p in pids.items()]
    status.write_text(json.dumps({"processes": procs}))


def test_each_restart_waits_settle_seconds_after_the_last_is_healthy(tmp_path):
    status = tmp_path / "status.json"
    pids = {"prefill-0": 10, "prefill-1": 11, "router": 9}
    _write(status, pids)
    requested: list[tuple[str, float]] = []
    healthy: list[float] = []
    stop = threading.Event()

    def supervisor() -> None:  # takes each restart request and brings the process back at once
        while not stop.is_set():
            for name in ("prefill-0", "prefill-1"):
                request = tmp_path / "restart" / name
                if request.exists():
                    request.unlink()
                    requested.append((name, time.monotonic()))
                    pids[name] += 100
                    _write(status, pids)
                    healthy.append(time.monotonic())
            time.sleep(0.01)

    thread = threading.Thread(target=supervisor)
    thread.start()
    try:
        args = argparse.Namespace(names=[], all=True, status_file=str(status), timeout=10.0, settle=0.6)
        assert run_restart(args, out=io.StringIO()) == 0
    finally:
        stop.set()
        thread.join()
    assert [n for n, _ in requested] == ["prefill-0", "prefill-1"]  # never the router
    assert requested[1][1] - healthy[0] >= 0.6
