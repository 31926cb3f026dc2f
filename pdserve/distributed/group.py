"""TPGroup: one worker's tensor-parallel ranks as the model sees them.

Two torch.distributed groups over the same ranks:
- `device` group (NCCL on CUDA, gloo on CPU): the model's all-reduces and the KV block copies,
  always issued right after a control message, so they never wait long.
- `control` group (gloo, CPU tensors, a very long timeout): rank 0's step messages. Ranks 1..N-1
  idle in a broadcast on it between requests; NCCL's watchdog would abort such a wait, gloo only
  fails when a peer's socket closes (that rank died).

A TPGroup of size 1 (`TPGroup.single()`) makes every collective a no-op, so TP1 runs the same
model code with no process group at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Device collectives happen inside a step: minutes mean a rank is stuck.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# Ranks wait on the control group for the next step however long the worker stays idle.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control: object | None = None  # gloo ProcessGroup for step messages (None: the default group)

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and talks to the outside world."""
        return self.rank == 0

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's contiguous 1/size share of n items."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {self.size}")
        per = n // self.size
        return self.rank * per, per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank gets the same bits)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's t into every rank's t (device group)."""
        if self.size > 1:
            dist.broadcast(t, src=0)

    def broadcast_control(self, t: torch.Tensor) -> None:
        """Rank 0's CPU tensor t into every rank's t (control group)."""
        if self.size > 1:
            dist.broadcast(t, src=0, group=self.control)

    def min_control(self, value: int) -> int:
        """The smallest value over the ranks (e.g. how many KV blocks fit on every GPU)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(base: str, rank: int) -> torch.device:
    """Rank r of a worker on "cuda:K" (or "cuda") uses cuda:K+r; every rank sees all of the
    worker's GPUs (one CUDA_VISIBLE_DEVICES per worker: NCCL needs its peers visible for CUDA IPC)."""
    d = torch.device(base)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def join(store: dist.Store, rank: int, size: int, device: torch.device) -> TPGroup:
    """Init this process as `rank` of the worker's TP group (every rank calls it, rank 0 first)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank=rank, size=size, device=device, control=control)
