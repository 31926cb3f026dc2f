"""The processes of a tensor-parallel engine: rank 0 (the engine's own process) starts ranks
1..N-1, each `python -m pdserve.engine.tp_rank` (tp_rank.py), and stops them.

    rank 0: TCPStore on a free port -> spawn ranks -> wait for each "ready/<r>" key (a rank that
            dies first is reported at once) -> join the process groups -> load its shard
    rank r: die with rank 0 (PR_SET_PDEATHSIG) -> "ready/<r>" -> join -> load its shard ->
            ModelRunner.serve_forever() (FORWARD / SYNC_KV / STOP from rank 0) -> exit 0

A rank that dies takes its worker down: `exited()` is polled by the worker's watchdog (not only
before a step), so rank 0 never waits on it in a collective; the worker fails its requests and
exits for its supervisor to restart it (worker/failure.py).
No rank outlives rank 0: a clean stop sends STOP and waits; a rank still there after the grace
period is killed; if rank 0's process dies, the kernel kills the ranks (PDEATHSIG fires when the
thread that spawned them exits: build the engine on a thread that lives as long as it does, as
`pdserve serve` and `LLM` do). Ranks inherit rank 0's environment and CPU affinity; on CUDA all
of a worker's GPUs stay visible to every rank (see group.rank_device).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from pdserve.distributed.group import TPGroup, join, rank_device
from pdserve.engine.config import EngineConfig

RANK_START_TIMEOUT_S = 120.0  # from spawn to "ready" (imports; model loading comes after)
STOP_GRACE_S = 10.0


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, procs: list[subprocess.Popen], store: dist.Store) -> None:
        self.procs = procs  # procs[i] is rank i + 1
        self.store = store  # the rendezvous server lives as long as the group

    @classmethod
    def start(cls, config: EngineConfig) -> tuple[RankProcesses, TPGroup]:
        size = config.tensor_parallel_size
        timeout = timedelta(seconds=RANK_START_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        argv = [sys.executable, "-m", "pdserve.engine.tp_rank", "--size", str(size), "--store-port", str(store.port),
                "--parent-pid", str(os.getpid()), "--config", config.model_dump_json()]  # fmt: skip
        procs = [subprocess.Popen([*argv, "--rank", str(r)], stdin=subprocess.DEVNULL) for r in range(1, size)]
        ranks = cls(procs, store)
        try:
            ranks._wait_ready()
            tp = join(store, 0, size, rank_device(config.device, 0))
        except BaseException:
            ranks.kill()
            raise
        return ranks, tp

    def _wait_ready(self) -> None:
        keys = [f"ready/{r}" for r in range(1, len(self.procs) + 1)]
        deadline = time.monotonic() + RANK_START_TIMEOUT_S
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks not started after {RANK_START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def check_alive(self) -> None:
        """Raise if a rank has exited (the engine cannot step without it)."""
        exited = self.exited()
        if exited is not None:
            raise RuntimeError(exited)

    def exited(self) -> str | None:
        """Which rank has exited and how, or None while all live. Safe from any thread: the worker's
        watchdog asks it while rank 0's step may sit in a collective that rank will never join."""
        for r, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                return f"tensor-parallel rank {r} (pid {p.pid}) exited ({how})"
        return None

    def wait(self, grace_s: float = STOP_GRACE_S) -> None:
        """After STOP: wait for every rank to exit, kill those that do not within grace_s."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
