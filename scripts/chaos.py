"""Faults under load: SIGKILL, SIGSTOP and restart the workers, their tensor-parallel ranks and the
router at seeded random times while requests run, then check what every client saw.

    python scripts/chaos.py [--config tiny-cpu] [--workers-per-role 1] [--requests 1000] \
        [--concurrency 64] [--faults 5] [--targets ...] [--seed 0] [--out chaos.json]

It starts `pdserve launch` itself, on the given cluster config with a few keys set (--workers-per-role
prefill and decode workers; decode's tensor_parallel_size, so there is a rank to kill or stop, and
its stall_timeout; the router's request_timeout; prefill's lease; a short restart backoff), and
stops it at the end. The load (scripts/chaos_load.py) runs until --requests are done and every
fault has been made. The faults (scripts/chaos_faults.py) come one at a time, the next only once
the cluster serves again: with one worker a role SIGKILL of the decode worker, the prefill worker,
a decode TP rank and the router; with two, also SIGSTOP of a TP rank, `pdserve restart` of one
worker and `pdserve restart --all`.

Checks (exit 0 only if all hold; scripts/chaos_report.py):
- every request ends with a full answer (its prompt's uninterrupted greedy tokens: none duplicated,
  none missing) or an OpenAI error with a message; only a request open on the router when the
  router was killed may end with its connection lost;
- none takes longer than the router's request_timeout (plus a margin);
- after each fault the cluster serves again by itself within --serve-again seconds, with every
  worker healthy in the router's view and the greedy tokens of before;
- errors happen only while a fault is being repaired (from the fault to serving again, + 5 s);
- with two or more workers a role, no client-visible failure for any worker fault or restart;
- at the end every worker holds 0 KV blocks (within the prefill lease).
The report (stdout, and --out as JSON) gives each fault's target, time and cost (seconds to serve
again, requests that failed in its window, tokens duplicated or missing), and the totals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.chaos_cluster import Launch, blocks_left, cluster_yaml  # noqa: E402
from scripts.chaos_faults import ALL, Faults  # noqa: E402
from scripts.chaos_load import Load, probe  # noqa: E402
from scripts.chaos_report import report_text, verdict  # noqa: E402


async def chaos(args: argparse.Namespace, launch: Launch, url: str) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(trust_env=False, timeout=None, limits=limits) as client:
        want = await probe(client, url)
        load = Load(args, url)
        await load.take_references(client)
        t0 = time.monotonic()
        faults, _ = await asyncio.gather(Faults(args, launch, load, client, url).run(want), load.run(client))
        after = await probe(client, url)
        duration = time.monotonic() - t0
    blocks = await blocks_left(launch, args.lease_seconds + 5)
    return verdict(args, load, faults, blocks, want, after, duration)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", default="tiny-cpu", help="cluster config (a path or a name in configs/)")
    p.add_argument("--workers-per-role", type=int, default=1, help="prefill and decode workers (copies of the first)")
    p.add_argument("--requests", type=int, default=1000, help="at least this many requests (more while faults remain)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16, help="each prompt's max_tokens is drawn from 2..this")
    p.add_argument("--faults", type=int, default=5, help="faults made, cycling through --targets")
    p.add_argument("--targets", nargs="+", choices=ALL,
                   help="fault kinds (default: decode prefill tp_rank router; with 2+ workers a role, all)")  # fmt: skip
    p.add_argument("--min-gap", type=float, default=2.0, help="seconds from serving again to the next fault, at least")
    p.add_argument("--max-gap", type=float, default=8.0, help="... and at most")
    p.add_argument("--serve-again", type=float, default=60.0, help="seconds a fault may take to repair (a worker)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="the router's request_timeout")
    p.add_argument("--lease-seconds", type=float, default=10.0, help="prefill's KV lease")
    p.add_argument("--decode-tp", type=int, default=2, help="decode's tensor_parallel_size (a rank to kill)")
    p.add_argument("--stall-timeout", type=float, default=5.0, help="decode's stall_timeout (catches a stopped rank)")
    p.add_argument("--ports", type=lambda s: [int(x) for x in s.split(",")],
                   help="the router's port, then the prefill workers', then the decode workers'")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report here as JSON")
    p.add_argument("--work-dir", help="keep the cluster's config and logs here (default: a temporary folder, removed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        folder = Path(args.work_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        launch = Launch(cluster_yaml(args, folder), folder)
        try:
            launch.wait_up(600)
            url = launch.router_url(30)
            result = asyncio.run(chaos(args, launch, url))
        finally:
            launch.stop()
    print(report_text(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
