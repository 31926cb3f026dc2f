"""`pdserve health`: GET /health on the router and workers, print a table, exit 0 only if all are up.

Exit codes: 0 every URL healthy, 1 some unhealthy or unreachable, 2 usage error.
A router started with --api-key guards /health too: pass the key (--api-key, $PDSERVE_API_KEY or
$OPENAI_API_KEY); a 401 is reported as such ("401: wrong or missing API key"), not as a server down.
With the status file of a `pdserve launch` (default: the newest launch's, <cache>/logs/latest),
each process's restarts and its last exit are shown too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import httpx

DEFAULT_URLS = ("http://127.0.0.1:8000", "http://127.0.0.1:30000", "http://127.0.0.1:30001")
WRONG_KEY = "401: wrong or missing API key (--api-key, $PDSERVE_API_KEY or $OPENAI_API_KEY)"


@dataclass
class HealthResult:
    url: str
    healthy: bool
    status: str  # "200", "503", "unreachable", ...
    detail: str
    seconds: float


def health_url(url: str) -> str:
    """'host:port', 'http://host:port' or a full '/health' URL -> the /health URL."""
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url if url.endswith("/health") else url + "/health"


def check(url: str, timeout: float, client: httpx.Client) -> HealthResult:
    start = time.monotonic()
    try:
        resp = client.get(url, timeout=timeout)
    except httpx.HTTPError as err:
        return HealthResult(url, False, "unreachable", type(err).__name__, time.monotonic() - start)
    detail = WRONG_KEY if resp.status_code == 401 else resp.text.strip().replace("\n", " ")[:80]
    return HealthResult(url, resp.status_code == 200, str(resp.status_code), detail, time.monotonic() - start)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def default_status_file() -> str:
    cache = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return os.path.join(cache, "logs", "latest", "status.json")


def launch_restarts(status_file: str) -> dict[str, str]:
    """/health URL -> 'restarts N (last: why)' from a launcher's status.json; {} when there is none."""
    try:
        with open(status_file) as f:
            procs = json.load(f)["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {
        health_url(p["url"]): f"restarts {p['restarts']}"
        + (f" (last: {p['exits'][-1]})" if p.get("exits") else "")
        + f", {p['state']}"
        for p in procs
    }


def add_health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        action="append",
        metavar="URL",
        help=f"a server to check (repeatable; default: {', '.join(DEFAULT_URLS)})",
    )
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds per request (default 5)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        metavar="KEY",
        help="sent as Authorization: Bearer KEY (a router with --api-key needs it; default $PDSERVE_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--status",
        default=None,
        metavar="FILE",
        help="a pdserve launch's status.json, for restart counts (default: the newest launch's, if any)",
    )


def run_health(args: argparse.Namespace, out: TextIO | None = None) -> int:
    if args.timeout <= 0:
        print(f"pdserve health: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    urls = [health_url(u) for u in (args.url or DEFAULT_URLS)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    with httpx.Client(trust_env=False, headers=headers) as client:  # never route 127.0.0.1 through a proxy
        results = [check(u, args.timeout, client) for u in urls]
    launched = launch_restarts(args.status or default_status_file())
    rows = [
        [
            r.url,
            "ok" if r.healthy else "?" if r.status == "401" else "DOWN",
            r.status,
            f"{r.seconds * 1000:.0f} ms",
            r.detail,
            launched.get(r.url, "-"),
        ]
        for r in results
    ]
    print(format_table(["url", "health", "status", "time", "detail", "launch"], rows), file=out or sys.stdout)
    return 0 if all(r.healthy for r in results) else 1
