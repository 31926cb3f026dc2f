"""How the router picks a worker among the healthy ones of a role. Chosen separately for prefill
and decode (`--prefill-policy`, `--decode-policy`).

- round_robin: each in turn.
- least_load: fewest requests the router has in flight on it; ties go round-robin.
- power_of_two: two at random, the less loaded of them (cheap, and avoids herding when
  several routers share the workers).
- cache_aware: the worker most likely to hold the prompt's prefix in its KV cache, unless the
  load is out of balance (below).
- auto (prefill's default): cache_aware when there are several workers and each keeps a prefix
  cache (`WorkerInfo.prefix_caching`), else round_robin: routing by prefix buys nothing where
  nothing is cached, and with a cache a round robin sends half of a conversation's turns away
  from the worker holding it.

A policy sees the prompt's token ids; only cache_aware reads them.

cache_aware in detail: send a request where its prefix most likely sits in a worker's KV cache, unless
that would pile requests on one worker (sgl-router's policy, over token ids rather than text).

    choose(workers, prompt)
      one worker                       -> it (nothing recorded: one worker has nothing to weigh)
      load out of balance              -> the least loaded           ("balance")
        max - min > balance_abs_threshold and max > balance_rel_threshold x min, in requests in flight
      best match / prompt > cache_threshold
                                       -> the best-matching worker, the less loaded of any tied  ("cache")
      else                             -> the worker with the smallest tree: the most cache room
                                          (then the less loaded)                                 ("cold")
      the prompt is then recorded in the chosen worker's tree

Matches come from PrefixTree (prefix_tree.py), one per worker URL, kept from what was routed
there: approximate, since a worker may have evicted what the router remembers, or hold what
another router process sent it (each process of --api-server-count keeps its own trees).
A hot prefix stays on its worker only until the imbalance rule sends one of its requests
elsewhere; that worker then holds the prefix too, and ties go to the less loaded, so the prefix's
traffic spreads instead of starving the other workers.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, get_args

from pdserve.config import CacheAwareSettings, PrefillPolicyName
from pdserve.router.prefix_tree import PrefixTree, chunk_names

POLICY_NAMES: tuple[str, ...] = get_args(PrefillPolicyName)


class Candidate(Protocol):
    url: str
    in_flight: int  # requests the router has on this worker now


W = TypeVar("W", bound=Candidate)


class Policy(ABC):
    name: str

    @abstractmethod
    def choose(self, workers: Sequence[W], prompt: Sequence[int] = ()) -> W:
        """One of `workers` (a non-empty list of healthy workers, in a stable order) for a request
        with these prompt token ids."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[W], prompt: Sequence[int] = ()) -> W:
        _need(workers)
        w = workers[self._next % len(workers)]
        self._next += 1
        return w


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[W], prompt: Sequence[int] = ()) -> W:
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

    def choose(self, workers: Sequence[W], prompt: Sequence[int] = ()) -> W:
        _need(workers)
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.in_flight <= b.in_flight else b


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings, observe: Callable[[str, int], None] | None = None) -> None:
        """observe(outcome, matched): told of every choice among several workers, with the prompt
        tokens the chosen worker is believed to hold (the router's metrics)."""
        self.s = settings
        self.trees: dict[str, PrefixTree] = {}
        self.observe = observe
        self._next = 0  # round-robin among workers tied on every count

    def choose(self, workers: Sequence[W], prompt: Sequence[int] = ()) -> W:
        _need(workers)
        if len(workers) == 1:
            return workers[0]
        names = chunk_names(prompt)
        w, outcome, matched = self._pick(workers, names, len(prompt))
        if self.observe is not None:
            self.observe(outcome, matched)
        tree = self.trees.get(w.url)
        if tree is None:
            tree = self.trees[w.url] = PrefixTree(self.s.max_tree_size)
        tree.insert(names)
        return w

    def _pick(self, workers: Sequence[W], names: list[int], prompt_len: int) -> tuple[W, str, int]:
        if self._imbalanced(workers):
            return self._least_loaded(workers), "balance", 0
        matches = [self._match(w, names) for w in workers]
        best = max(matches)
        if prompt_len and best / prompt_len > self.s.cache_threshold:
            tied = [w for w, m in zip(workers, matches) if m == best]
            return self._least_loaded(tied), "cache", best
        room = min(self._size(w) for w in workers)
        return self._least_loaded([w for w in workers if self._size(w) == room]), "cold", 0

    def _imbalanced(self, workers: Sequence[W]) -> bool:
        loads = [w.in_flight for w in workers]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.s.balance_abs_threshold and hi > self.s.balance_rel_threshold * lo

    def _least_loaded(self, workers: Sequence[W]) -> W:
        low = min(w.in_flight for w in workers)
        tied = [w for w in workers if w.in_flight == low]
        w = tied[self._next % len(tied)]
        self._next += 1
        return w

    def _match(self, w: W, names: list[int]) -> int:
        tree = self.trees.get(w.url)
        return 0 if tree is None else tree.match(names)

    def _size(self, w: W) -> int:
        tree = self.trees.get(w.url)
        return 0 if tree is None else tree.tokens


class Auto(Policy):
    """cache_aware among several workers that all keep a prefix cache, round_robin otherwise
    (a worker whose info the router has not read yet counts as keeping none)."""

    name = "auto"

    def __init__(self, cache: CacheAware) -> None:
        self.cache, self.plain = cache, RoundRobin()

    def choose(self, workers: Sequence[W], prompt: Sequence[int] = ()) -> W:
        _need(workers)
        if len(workers) > 1 and all(_caches(w) for w in workers):
            return self.cache.choose(workers, prompt)
        return self.plain.choose(workers, prompt)


def _caches(w: Candidate) -> bool:
    info = getattr(w, "info", None)
    return bool(info is not None and info.prefix_caching)


class PairPolicy:
    """Chooses a PD request's prefill and decode workers together, up front, so that a policy can
    weigh both (today: each role's own policy; a locality-aware pair policy goes here)."""

    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill = prefill
        self.decode = decode

    def choose(self, prefill: Sequence[W], decode: Sequence[W], prompt: Sequence[int] = ()) -> tuple[W, W]:
        return self.prefill.choose(prefill, prompt), self.decode.choose(decode, prompt)


def make_policy(
    name: str,
    seed: int | None = None,
    cache: CacheAwareSettings | None = None,
    observe: Callable[[str, int], None] | None = None,
) -> Policy:
    """cache: cache_aware's settings (default: the config's defaults); observe: its choices (CacheAware)."""
    if name == "cache_aware":
        return CacheAware(cache or CacheAwareSettings(), observe)
    if name == "auto":
        return Auto(CacheAware(cache or CacheAwareSettings(), observe))
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
