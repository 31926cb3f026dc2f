"""`pdserve restart NAME... | --all`: restart processes of a running `pdserve launch`, one at a time.

For each name the launcher is asked (a file <log_dir>/restart/NAME, which its supervisor takes
within a quarter second) to send the process SIGTERM and start it again once it exits: a worker
drains (new requests go to the others, open ones finish within its drain_timeout; the router
migrates what a drain cuts off), so a rolling restart of every worker of a role with two or more
workers loses no request. The command waits for each process to be healthy again (a new pid,
state healthy in status.json), then --settle seconds, before the next: the launcher's probe says
healthy before the routers' does (they probe a worker that is down every second), and a worker
drained before the routers have taken back the one restarted just now would leave its role with
none for them. `--all` restarts every worker, not the router, whose restart cuts its clients'
connections (name it to restart it anyway).

Exit codes: 0 every named process restarted and healthy, 1 one did not come back in time (the
rest are not touched), 2 no launch or an unknown name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdserve.health_cli import default_status_file

POLL_S = 0.25
SETTLE_S = 3.0  # > the routers' probe of a down worker (every second), under load


def add_restart_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME", help="processes as `pdserve health` names them (decode-0, ...)")
    p.add_argument("--all", action="store_true", help="every worker, one at a time (not the router)")
    p.add_argument("--status-file", default=None, help="the launch's status.json (default: the newest launch's)")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds each process has to drain and be healthy again"
    )
    p.add_argument("--settle", type=float, default=SETTLE_S, help="seconds from one healthy again to the next restart")


def _processes(status_file: Path) -> dict[str, dict]:
    return {p["name"]: p for p in json.loads(status_file.read_text())["processes"]}


def run_restart(args: argparse.Namespace, out=sys.stdout) -> int:
    status_file = Path(args.status_file or default_status_file())
    try:
        procs = _processes(status_file)
    except (OSError, ValueError, KeyError) as e:
        print(f"pdserve restart: no running launch found ({status_file}: {e})", file=sys.stderr)
        return 2
    names = [n for n, p in procs.items() if p["role"] != "router"] if args.all else list(args.names)
    unknown = [n for n in names if n not in procs]
    if not names or unknown:
        known = ", ".join(procs)
        print(f"pdserve restart: {'unknown ' + ', '.join(unknown) if unknown else 'name a process or --all'} (this launch has {known})", file=sys.stderr)  # fmt: skip
        return 2
    for i, name in enumerate(names):
        if i:
            time.sleep(args.settle)  # the routers take the last one back before this one drains
        t0 = time.monotonic()
        old = _processes(status_file)[name]["pid"]
        request = status_file.parent / "restart" / name
        request.parent.mkdir(exist_ok=True)
        request.touch()
        print(f"{name}: restart requested (pid {old})", file=out, flush=True)
        while True:
            p = _processes(status_file).get(name, {})
            if p.get("pid") != old and p.get("state") == "healthy":
                print(
                    f"{name}: healthy again as pid {p['pid']} after {time.monotonic() - t0:.1f} s", file=out, flush=True
                )
                break
            if time.monotonic() - t0 > args.timeout:
                request.unlink(missing_ok=True)
                print(f"pdserve restart: {name} not healthy again within {args.timeout:.0f} s (state {p.get('state')})", file=sys.stderr)  # fmt: skip
                return 1
            time.sleep(POLL_S)
    return 0
