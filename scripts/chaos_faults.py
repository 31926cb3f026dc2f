"""The chaos run's faults (scripts/chaos.py), one at a time, each the next only once the cluster
serves again:

    decode, prefill   SIGKILL of a worker of the role (drawn among its workers)
    tp_rank           SIGKILL of a decode worker's TP rank 1: the worker sees it and exits 3
    tp_stop           SIGSTOP of that rank: rank 0 hangs in a collective; the worker's watchdog sees
                      no step finish within stall_timeout, kills its ranks and exits 3
    restart           `pdserve restart NAME` of a worker: it drains, exits and starts again
    restart_all       `pdserve restart --all`: every worker in turn, the rolling restart
    router            SIGKILL of the router (the one fault that may cut clients' connections)

Serving again: every process the fault touched has a new pid and is healthy (the launcher's
status.json; for a restart, `pdserve restart` exited 0), the router holds every worker healthy,
and a greedy probe through it gives the tokens of before.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import httpx

from scripts.chaos_cluster import ROOT, Launch, router_sees_all
from scripts.chaos_load import Load, probe

KILLS = ("decode", "prefill", "tp_rank", "router")  # the run with one worker a role
ALL = ("decode", "prefill", "tp_rank", "tp_stop", "restart", "restart_all", "router")
HOW = {"decode": "SIGKILL", "prefill": "SIGKILL", "tp_rank": "SIGKILL rank 1 of", "tp_stop": "SIGSTOP rank 1 of",
       "restart": "pdserve restart", "restart_all": "pdserve restart --all", "router": "SIGKILL"}  # fmt: skip
POLL_S = 0.25


@dataclass
class Fault:
    target: str  # one of ALL
    victim: str  # the process it hits ("decode-1"), "every worker" for restart_all
    pid: int | None  # the process signalled (None for a restart)
    at: float  # monotonic
    serving_again_s: float | None = None
    failed: int = 0  # requests the client saw fail: errors, lost connections, hangs, wrong answers
    errors: int = 0
    connections_lost: int = 0
    duplicated_tokens: int = 0
    missing_tokens: int = 0
    retried: int = 0  # requests the client sent again (a 503 with Retry-After, a 429, a refused connection)
    note: str = ""

    @property
    def worker_fault(self) -> bool:
        return self.target != "router"

    def describe(self) -> str:
        return f"{HOW[self.target]} {self.victim}" + (f" (pid {self.pid})" if self.pid else "")


def plan(args: argparse.Namespace, rng: random.Random) -> list[str]:
    """--faults targets, cycling through --targets (or the mode's default), shuffled."""
    targets = args.targets or (ALL if args.workers_per_role > 1 else KILLS)
    targets = [t for t in targets if not t.startswith("tp_") or args.decode_tp > 1]
    order = [targets[i % len(targets)] for i in range(args.faults)]
    rng.shuffle(order)
    return order


class Faults:
    def __init__(self, args: argparse.Namespace, launch: Launch, load: Load, client: httpx.AsyncClient, url: str):
        self.args, self.launch, self.load, self.client, self.url = args, launch, load, client, url
        self.rng = random.Random(f"{args.seed}:faults")
        self.faults: list[Fault] = []

    async def run(self, want: list[int]) -> list[Fault]:
        try:
            for target in plan(self.args, self.rng):
                await asyncio.sleep(self.rng.uniform(self.args.min_gap, self.args.max_gap))
                fault = await self.one(target, want)
                print(f"fault {len(self.faults)}: {fault.describe()}: serving again after {fault.serving_again_s} s"
                      + (f" ({fault.note})" if fault.note else ""), flush=True)  # fmt: skip
                if fault.serving_again_s is None:
                    break
        finally:
            self.load.faults_done.set()
        return self.faults

    async def one(self, target: str, want: list[int]) -> Fault:
        before = {n: p["pid"] for n, p in self.launch.processes().items()}
        restart: asyncio.subprocess.Process | None = None
        if target in ("decode", "prefill"):
            victim = self.rng.choice(self.launch.workers(target))
            pid, sig, touched = before[victim], signal.SIGKILL, [victim]
        elif target in ("tp_rank", "tp_stop"):
            victim = self.rng.choice(self.launch.workers("decode"))
            pid, touched = self.launch.rank_pid(victim), [victim]
            sig = signal.SIGKILL if target == "tp_rank" else signal.SIGSTOP
        elif target == "router":
            victim, pid, sig, touched = "router", before["router"], signal.SIGKILL, ["router"]
        else:
            names = self.launch.workers() if target == "restart_all" else [self.rng.choice(self.launch.workers())]
            victim, pid, sig, touched = "every worker" if target == "restart_all" else names[0], None, None, names
            restart = await self._restart(names)
        fault = Fault(target, victim, pid, time.monotonic())
        self.faults.append(fault)
        if sig is not None:
            os.kill(pid, sig)
        try:
            await self._serving_again(fault, touched, before, restart, want)
        finally:
            if sig == signal.SIGSTOP:
                _kill_if_stopped(pid)  # the watchdog killed it, unless it missed it
        return fault

    async def _restart(self, names: list[str]) -> asyncio.subprocess.Process:
        flags = ["--all"] if len(names) > 1 else names
        argv = [sys.executable, "-m", "pdserve", "restart", *flags, "--status-file", str(self.launch.status_file),
                "--timeout", str(self.args.serve_again)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )

    async def _serving_again(self, fault: Fault, touched: list[str], before: dict[str, int], restart, want) -> None:
        limit = self.args.serve_again * (len(touched) if restart is not None else 1)
        while time.monotonic() - fault.at < limit:
            if restart is not None and restart.returncode is None:
                try:
                    await asyncio.wait_for(restart.wait(), POLL_S)
                except TimeoutError:
                    continue
            if restart is not None and restart.returncode != 0:
                fault.note = (
                    f"pdserve restart exited {restart.returncode}: {(await restart.stdout.read()).decode()[-300:]}"
                )
                return
            procs = self.launch.processes()
            back = all(procs.get(n, {}).get("pid") not in (None, before[n]) and procs[n]["state"] == "healthy"
                       for n in touched)  # fmt: skip
            if back and await router_sees_all(self.client, self.url) and await probe(self.client, self.url) == want:
                fault.serving_again_s = round(time.monotonic() - fault.at, 2)
                return
            await asyncio.sleep(POLL_S)
        if restart is not None and restart.returncode is None:
            restart.kill()
            await restart.wait()


def _kill_if_stopped(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == "T":
            os.kill(pid, signal.SIGKILL)
    except (OSError, IndexError):
        pass
