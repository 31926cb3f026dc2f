"""`pdserve launch`: plan the cluster, check its ports, start the workers, wait for their /health,
start the router, print the table, supervise until SIGINT / SIGTERM, stop everything.

The log folder is new for every launch (under <cache>/logs unless given) and kept;
<cache>/logs/latest points at the newest.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from pdserve.config import ClusterConfig, cache_dir, default_served_name, resolve_model
from pdserve.launch.planning import plan, port_free
from pdserve.launch.supervisor import Cluster, LaunchError, Restarts


def new_log_dir(given: str | None) -> Path:
    """The given folder, else a new one per launch under <cache>/logs; <cache>/logs/latest points at it."""
    if given:
        folder = Path(given).resolve()
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        folder = cache_dir() / "logs" / f"{stamp}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    latest = cache_dir() / "logs" / "latest"
    try:
        latest.parent.mkdir(parents=True, exist_ok=True)
        tmp = latest.with_name(f"latest.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder)
        tmp.replace(latest)
    except OSError:
        pass  # the link is a convenience for `pdserve health`
    return folder


def launch(cfg: ClusterConfig, model: str | None = None, log_dir: str | None = None, out: TextIO | None = None) -> int:
    """Run and supervise the cluster until SIGINT/SIGTERM (exit 0), or fail to start (exit 1)."""
    cluster = Cluster(new_log_dir(log_dir or cfg.log_dir), out or sys.stdout, Restarts.of(cfg))

    def on_signal(signum: int, _frame: object) -> None:
        cluster.stop_signal = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if cfg.served_model_name is None:  # tiny:<arch> is served as tiny-<arch>, whichever arch --model names
            cfg = cfg.model_copy(update={"served_model_name": default_served_name(model or cfg.model)})
        specs = plan(cfg, resolve_model(model or cfg.model))
        busy = [f"{s.name} ({s.host}:{s.port})" for s in specs if not port_free(s.host, s.port)]
        if busy:
            raise LaunchError(
                f"ports already in use: {', '.join(busy)} - is another pdserve running? (`pdserve health`)"
            )
        workers = [cluster.start(s) for s in specs[:-1]]
        if cluster.wait_healthy(workers, cfg.startup_timeout):
            router = cluster.start(specs[-1])
            if cluster.wait_healthy([router], cfg.startup_timeout):
                for c in cluster.children:
                    c.state = "healthy"
                cluster.say(cluster.table())
                cluster.say(
                    f"pdserve is up: OpenAI API on {router.spec.url}/v1 (Ctrl-C stops everything); logs in {cluster.log_dir}"
                )
                cluster.supervise()
        cluster.say(f"stopping on {signal.Signals(cluster.stop_signal).name}")
        return 0
    except (LaunchError, ValueError) as err:
        cluster.say(f"pdserve launch failed: {err}")
        if cluster.children:
            cluster.say(cluster.table())
        return 1
    finally:
        cluster.stop(cfg.stop_grace_seconds)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if cluster.children:
            for c in cluster.children:
                c.state = "stopped"
            cluster.write_status()
            cluster.say("all processes stopped")
