"""Bookkeeping shared by the connectors: prefill-side leases, release messages, transfer counters.

Plain Python, no torch. A lease pins a prefilled request's blocks until the decode side says it has
read them (a "release:<request_id>" notification) or until it expires, whichever comes first.
Expiry is measured on time.monotonic(); the KVHandle carries the wall-clock equivalent.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_LEASE_S = 60.0
RELEASE_PREFIX = b"release:"


def release_message(request_id: str) -> bytes:
    return RELEASE_PREFIX + request_id.encode()


def parse_release(msg: bytes) -> str | None:
    """The request id of a release message, None for anything else."""
    if not msg.startswith(RELEASE_PREFIX):
        return None
    return msg[len(RELEASE_PREFIX) :].decode(errors="replace")


@dataclass
class Lease:
    block_ids: list[int]
    expires_at: float  # clock() value


class LeaseTable:
    def __init__(self, lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}

    def add(self, request_id: str, block_ids: list[int]) -> float:
        """Pin block_ids for request_id; returns the seconds until the lease expires."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id} already holds a KV lease")
        self._leases[request_id] = Lease(list(block_ids), self.clock() + self.lease_s)
        return self.lease_s

    def release(self, request_id: str) -> list[int] | None:
        """Drop the lease; its block ids, or None when there was none (already released or expired)."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease.block_ids

    def expired(self) -> list[str]:
        """Drop and return every lease whose time is up."""
        now = self.clock()
        ids = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
        for rid in ids:
            del self._leases[rid]
        return ids

    def blocks(self, request_id: str) -> list[int]:
        return self._leases[request_id].block_ids

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)


@dataclass
class TransferStats:
    """Counters a worker exports as metrics. Decode side: loads; prefill side: leases."""

    bytes_transferred: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    transfer_seconds_sum: float = 0.0
    recent_transfer_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    descriptors_sum: int = 0  # NIXL descriptors over all transfers (descriptors per request = this / done)
    failures_by_stage: dict[str, int] = field(default_factory=dict)
    leases_released: int = 0  # by a decode notification or an explicit release
    lease_expirations: int = 0

    def record_done(self, nbytes: int, seconds: float, descriptors: int) -> None:
        self.bytes_transferred += nbytes
        self.transfers_done += 1
        self.transfer_seconds_sum += seconds
        self.recent_transfer_seconds.append(seconds)
        self.descriptors_sum += descriptors

    def record_failed(self, stage_name: str) -> None:
        self.transfers_failed += 1
        self.failures_by_stage[stage_name] = self.failures_by_stage.get(stage_name, 0) + 1
