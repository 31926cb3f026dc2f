"""How the router picks a worker among the healthy ones of a role. Chosen separately for prefill
and decode (`--prefill-policy`, `--decode-policy`).

- round_robin: each in turn.
- least_load: fewest requests the router has in flight on it; ties go round-robin.
- power_of_two: two at random, the less loaded of them (cheap, and avoids herding when
  several routers share the workers).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, TypeVar, get_args

from pdserve.config import PolicyName

POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)


class Candidate(Protocol):
    url: str
    in_flight: int  # requests the router has on this worker now


W = TypeVar("W", bound=Candidate)


class Policy(ABC):
    name: str

    @abstractmethod
    def choose(self, workers: Sequence[W]) -> W:
        """One of `workers` (a non-empty list of healthy workers, in a stable order)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[W]) -> W:
        _need(workers)
        w = workers[self._next % len(workers)]
        self._next += 1
        return w


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[W]) -> W:
        _need(workers)
        low = min(w.in_flight for w in workers)
        tied = [w for w in workers if w.in_flight == low]
        w = tied[self._next % len(tied)]
        self._next += 1
        return w


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, workers: Sequence[W]) -> W:
        _need(workers)
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.in_flight <= b.in_flight else b


class PairPolicy:
    """Chooses a PD request's prefill and decode workers together, up front, so that a policy can
    weigh both (today: each role's own policy; a cache- or locality-aware pair policy goes here)."""

    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill = prefill
        self.decode = decode

    def choose(self, prefill: Sequence[W], decode: Sequence[W]) -> tuple[W, W]:
        return self.prefill.choose(prefill), self.decode.choose(decode)


def make_policy(name: str, seed: int | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def _need(workers: Sequence[Candidate]) -> None:
    if not workers:
        raise ValueError("no worker to choose from")
