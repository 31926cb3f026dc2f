"""The prefill side's leases and the release messages that end them.

Plain Python, no torch. A lease pins a prefilled request's blocks until the decode side says it has
read them (a "release:<request_id>" notification) or until it expires, whichever comes first.
Expiry is measured on time.monotonic(); the KVHandle carries the wall-clock equivalent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

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

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)
