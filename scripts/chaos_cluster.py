"""The chaos run's cluster (scripts/chaos.py): its config, the `pdserve launch` that runs it, and
where its processes are (the launcher's status.json, the router's /workers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from pdserve.config import load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = "chaos"


def cluster_yaml(args: argparse.Namespace, folder: Path) -> Path:
    """The config with --workers-per-role prefill and decode workers (copies of the config's first
    of each, on the next ports), decode at --decode-tp with --stall-timeout, the router's
    request_timeout, prefill's lease and a short restart backoff."""
    data = load_config(args.config).model_dump(mode="json")
    data.update(served_model_name=MODEL, log_dir=str(folder / "logs"), restart_backoff=0.5, startup_timeout=600)
    data["router"].update(request_timeout=args.request_timeout, health_interval=0.5)
    n = args.workers_per_role
    for role in ("prefill", "decode"):
        first = data[role][0]
        data[role] = [{**first, "port": first["port"] + 2 * i} for i in range(n)]
    if args.ports:
        if len(args.ports) != 1 + 2 * n:
            raise SystemExit(f"--ports: the router's, then {n} prefill and {n} decode ports ({1 + 2 * n} in all)")
        data["router"]["port"] = args.ports[0]
        for i in range(n):
            data["prefill"][i]["port"], data["decode"][i]["port"] = args.ports[1 + i], args.ports[1 + n + i]
    for w in data["prefill"]:
        w["lease_seconds"] = args.lease_seconds
    for w in data["decode"]:
        w.update(tp_size=args.decode_tp, stall_timeout=args.stall_timeout)
    parse_config(data, "the chaos cluster")  # refuse a bad one here, not in the launcher
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Launch:
    def __init__(self, config: Path, folder: Path) -> None:
        self.folder = folder
        self.status_file = folder / "logs" / "status.json"
        self.out = folder / "launch.out"
        with open(self.out, "wb") as f:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", "launch", "--config", str(config)],
                                         cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "pdserve is up" not in self.out.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start:\n{self.out.read_text()[-3000:]}")
            time.sleep(0.5)

    def processes(self) -> dict[str, dict]:
        """name -> {name, role, url, pid, state, restarts, exits}, as the launcher wrote them last."""
        try:
            procs = json.loads(self.status_file.read_text())["processes"]
        except (OSError, ValueError):
            return {}
        return {p["name"]: p for p in procs}

    def workers(self, role: str | None = None) -> list[str]:
        return sorted(n for n, p in self.processes().items() if p["role"] != "router" and role in (None, p["role"]))

    def router_url(self, timeout: float) -> str:
        """The router's URL from the launcher's status file (written beside "pdserve is up", not before it)."""
        deadline = time.monotonic() + timeout
        while "router" not in (procs := self.processes()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no router in {self.status_file} after {timeout:g} s")
            time.sleep(0.2)
        return procs["router"]["url"]

    def rank_pid(self, worker: str) -> int:
        """The pid of a TP worker's rank 1 (its only child process)."""
        pid = self.processes()[worker]["pid"]
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return int(f.read().split()[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def router_sees_all(client: httpx.AsyncClient, url: str) -> bool:
    """Does the router hold every worker healthy, breaker closed?"""
    try:
        resp = await client.get(url + "/workers", timeout=5)
        workers = resp.json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return resp.status_code == 200 and all(w["healthy"] and w["breaker"] == "closed" for w in workers)


async def blocks_left(launch: Launch, wait_s: float) -> dict[str, int]:
    """KV blocks each worker holds, once all are 0 or after wait_s (prefill's lease)."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        while True:
            used = {}
            for name, p in launch.processes().items():
                if name != "router":
                    used[name] = (await client.get(p["url"] + "/health")).json()["kv_blocks_used"]
            if not any(used.values()) or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.5)
