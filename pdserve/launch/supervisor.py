"""The supervisor of a launch: starts the planned processes, waits for their /health, restarts
the ones that exit and stops them all; `pdserve restart` asks it to restart one (restart_cli.py).

Each child is `python -m pdserve serve --config <log_dir>/<name>.json` in its own process group
(so a stop reaches anything it spawned, such as a tensor-parallel worker's rank processes), logs
to <log_dir>/<name>.log, and gets SIGTERM from the kernel if the launcher dies.

Once the cluster is up, a child that exits is restarted by its `restart` policy (on-failure,
always, never) after a backoff that doubles with each restart in `restart_window`; the other
processes keep running (the router answers 503 while no pair can serve). More than
`max_restarts` in the window is a crash loop: launch says so and leaves that process down. Each
exit is reported with its cause and log tail, and <log_dir>/status.json (read by `pdserve health`)
and <log_dir>/metrics.prom (`pdserve_launch_restarts_total`, Prometheus text format) count them.
Stop: SIGTERM every group, wait stop_grace_seconds, SIGKILL what is left.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

from pdserve.config import ClusterConfig
from pdserve.health_cli import format_table
from pdserve.launch.planning import ProcSpec, write_serve_config
from pdserve.lifetime import die_with_parent
from pdserve.numa import PinPlan, format_cpulist, process_cpus

LOG_TAIL_LINES = 30


class LaunchError(RuntimeError):
    """The cluster could not start or stopped working; the message names the process and why."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as err:
        return f"(cannot read {path}: {err})"
    return "\n".join("    " + line for line in text[-lines:]) or "    (log is empty)"


def _group_alive(pgid: int) -> bool:
    """Does any process still belong to process group `pgid`? (/proc/<pid>/stat field 5.)"""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _child_setup(pin: PinPlan, parent: int):
    libc = ctypes.CDLL(None, use_errno=True)
    affinity = pin.preexec()

    def setup() -> None:  # runs in the child between fork and exec
        die_with_parent(parent, signal.SIGTERM, libc)  # launcher dies -> child gets SIGTERM
        if affinity is not None:
            affinity()

    return setup


@dataclass
class Restarts:
    """How launch restarts a child that died (the cluster config's restart settings)."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    @classmethod
    def of(cls, cfg: ClusterConfig) -> Restarts:
        return cls(cfg.max_restarts, cfg.restart_window, cfg.restart_backoff, cfg.max_restart_backoff)


@dataclass
class Child:
    spec: ProcSpec
    popen: subprocess.Popen
    log: Path
    healthy: bool = False
    state: str = "starting"  # starting | healthy | waiting to restart | stopped | gave up
    restarts: int = 0
    recent: list[float] = field(default_factory=list)  # monotonic times of restarts in the window
    restart_at: float | None = None
    exits: list[str] = field(default_factory=list)  # why each earlier run ended
    draining: bool = False  # `pdserve restart` asked for it: SIGTERM sent, restarted once it exits


class Cluster:
    """Starts, watches, restarts and stops the child processes of one launch."""

    def __init__(self, log_dir: Path, out: TextIO, restarts: Restarts | None = None):
        self.log_dir, self.out = log_dir, out
        self.restarts = restarts or Restarts()
        self.children: list[Child] = []
        self.stop_signal: int | None = None

    def say(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def start(self, spec: ProcSpec) -> Child:
        child = Child(spec, self._spawn(spec), self.log_dir / f"{spec.name}.log")
        self.children.append(child)
        return child

    def _spawn(self, spec: ProcSpec, header: str = "") -> subprocess.Popen:
        log = self.log_dir / f"{spec.name}.log"
        argv = spec.pin.command_prefix() + [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "--config",
            str(write_serve_config(spec, self.log_dir)),
        ]
        with open(log, "ab") as f:  # a restart appends: the crashed run's log stays above it
            f.write(f"{header}# {' '.join(argv)}\n".encode())
            f.flush()
            popen = subprocess.Popen(
                argv, env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}, stdin=subprocess.DEVNULL,
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_child_setup(spec.pin, os.getpid()),
            )  # fmt: skip
        pinned = (
            f"{spec.pin.method} node {spec.pin.node}" if spec.pin.method != "none" else f"unpinned ({spec.pin.reason})"
        )
        self.say(f"started {spec.name} ({spec.role}) pid {popen.pid} on {spec.url}, {pinned}, log {log}")
        return popen

    def dead_child_error(self, c: Child, when: str) -> LaunchError:
        return LaunchError(
            f"{c.spec.name} (pid {c.popen.pid}) {_exit_text(c.popen.returncode)} {when}; "
            f"last lines of {c.log}:\n{log_tail(c.log)}"
        )

    def wait_healthy(self, children: list[Child], timeout: float) -> bool:
        """Poll /health of each until 200. False if a stop signal came; LaunchError on death/timeout."""
        deadline = time.monotonic() + timeout
        pending = list(children)
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while pending:
                for c in list(pending):
                    if c.popen.poll() is not None:
                        raise self.dead_child_error(c, "while starting")
                    try:
                        c.healthy = client.get(c.spec.url + "/health", headers=c.spec.headers).status_code == 200
                    except httpx.HTTPError:
                        c.healthy = False
                    if c.healthy:
                        pending.remove(c)
                        self.say(f"{c.spec.name} is healthy")
                if self.stop_signal is not None:
                    return False
                if pending and time.monotonic() > deadline:
                    tails = "\n".join(f"last lines of {c.log}:\n{log_tail(c.log)}" for c in pending)
                    names = ", ".join(c.spec.name for c in pending)
                    raise LaunchError(f"{names} not healthy after {timeout:.0f} s (startup_timeout)\n{tails}")
                if pending:
                    time.sleep(0.25)
        return True

    def table(self) -> str:
        rows = []
        for c in self.children:
            try:
                cpus = format_cpulist(process_cpus(c.popen.pid))
            except (OSError, RuntimeError):
                cpus = "-"
            pin = c.spec.pin
            node = str(pin.node) if pin.node is not None else "-"
            rc = c.popen.poll()
            health = _exit_text(rc) if rc is not None else ("healthy" if c.healthy else "starting")
            gpus = ",".join(map(str, c.spec.gpus)) or "-"
            rows.append([c.spec.name, c.spec.role, str(c.spec.port), str(c.popen.pid), gpus, node, cpus, health])
        return format_table(["process", "role", "port", "pid", "gpus", "numa", "cpus", "health"], rows)

    def supervise(self) -> None:
        """Until a stop signal: restart children that exit (by policy), take them back when healthy."""
        with httpx.Client(trust_env=False, timeout=1.0) as client:
            while self.stop_signal is None:
                for c in self.children:
                    self._take_restart_request(c)
                    self._tend(c, client)
                self.write_status()
                time.sleep(0.25)

    def _tend(self, c: Child, client: httpx.Client) -> None:
        if c.restart_at is not None:
            if time.monotonic() >= c.restart_at:
                self._restart(c)
        elif c.state in ("starting", "healthy") and c.popen.poll() is not None:
            self._exited(c)
        elif c.state == "starting" and self._probe(c, client):
            c.state = "healthy"
            self.say(f"{c.spec.name} is healthy again (restart {c.restarts})")

    def _take_restart_request(self, c: Child) -> None:
        """`pdserve restart NAME` leaves <log_dir>/restart/NAME: a healthy child gets SIGTERM (a
        worker drains: its open requests finish or are migrated by the router) and is started
        again as soon as it exits, whatever its exit code, outside the crash-loop count."""
        request = self.log_dir / "restart" / c.spec.name
        if c.draining or c.state != "healthy" or not request.exists():
            return
        request.unlink(missing_ok=True)
        c.draining = True
        self.say(f"{c.spec.name}: restart requested: SIGTERM to pid {c.popen.pid} (it drains, then starts again)")
        c.popen.send_signal(signal.SIGTERM)

    def _probe(self, c: Child, client: httpx.Client) -> bool:
        try:
            c.healthy = client.get(c.spec.url + "/health", headers=c.spec.headers).status_code == 200
        except httpx.HTTPError:
            c.healthy = False
        return c.healthy

    def _exited(self, c: Child) -> None:
        rc = c.popen.returncode
        _signal_group(c.popen.pid, signal.SIGKILL)  # what it spawned (TP ranks) goes with it
        c.healthy = False
        cause = f"{c.spec.name} (pid {c.popen.pid}) {_exit_text(rc)}"
        c.exits.append(_exit_text(rc))
        tail = f"last lines of {c.log}:\n{log_tail(c.log)}"
        if c.draining:  # a requested restart: at once, and not counted as a crash
            c.state, c.restart_at = "waiting to restart", time.monotonic()
            self.say(f"{cause}; restarting as requested")
            return
        if c.spec.restart == "never" or (c.spec.restart == "on-failure" and rc == 0):
            c.state = "stopped"
            self.say(f"{cause}; not restarted (restart: {c.spec.restart}); {tail}")
            return
        now = time.monotonic()
        c.recent = [t for t in c.recent if now - t < self.restarts.window_s]
        if len(c.recent) >= self.restarts.max_restarts:
            c.state = "gave up"
            self.say(
                f"{cause}; crash loop: {len(c.recent)} restarts within {self.restarts.window_s:.0f} s "
                f"(max_restarts {self.restarts.max_restarts}), giving up - it stays down; {tail}"
            )
            return
        delay = min(self.restarts.backoff_s * 2 ** len(c.recent), self.restarts.max_backoff_s)
        c.state, c.restart_at = "waiting to restart", now + delay
        self.say(f"{cause}; restarting in {delay:.1f} s (restart {c.restarts + 1}); {tail}")

    def _restart(self, c: Child) -> None:
        c.restarts += 1
        if not c.draining:
            c.recent.append(time.monotonic())
        c.restart_at, c.draining = None, False
        header = f"# ---- restart {c.restarts} after: {c.exits[-1]} ----\n"
        c.popen = self._spawn(c.spec, header)
        c.state = "starting"

    def write_status(self) -> None:
        """status.json (for `pdserve health`) and metrics.prom (Prometheus text format)."""
        procs = [
            {"name": c.spec.name, "role": c.spec.role, "url": c.spec.url, "pid": c.popen.pid, "state": c.state,
             "restarts": c.restarts, "exits": c.exits[-5:]}
            for c in self.children
        ]  # fmt: skip
        _write_atomic(
            self.log_dir / "status.json", json.dumps({"launcher_pid": os.getpid(), "processes": procs}, indent=1)
        )
        lines = [
            "# HELP pdserve_launch_restarts_total Restarts of each process by pdserve launch.",
            "# TYPE pdserve_launch_restarts_total counter",
        ]
        lines += [
            f'pdserve_launch_restarts_total{{process="{c.spec.name}",role="{c.spec.role}"}} {c.restarts}'
            for c in self.children
        ]
        _write_atomic(self.log_dir / "metrics.prom", "\n".join(lines) + "\n")

    def stop(self, grace: float) -> None:
        """SIGTERM every child's group (router first), SIGKILL what is left after `grace` seconds."""
        running = list(reversed(self.children))
        for c in running:
            if c.popen.poll() is None:
                _signal_group(c.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(c) for c in running):
            time.sleep(0.1)
        for c in running:
            if _alive(c):
                self.say(f"{c.spec.name} did not stop within {grace:.0f} s: SIGKILL")
                _signal_group(c.popen.pid, signal.SIGKILL)
        for c in running:
            c.popen.wait()
            c.healthy = False


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _exit_text(rc: int) -> str:
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"


def _alive(c: Child) -> bool:
    return c.popen.poll() is None or _group_alive(c.popen.pid)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
