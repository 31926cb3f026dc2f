"""What every connector does the same way: the prefill side's leases and failure bookkeeping.

Backends (nixl, fake) differ in how bytes and release messages travel, not in what a lease is, so
both derive from LeasingConnector and only say where their release messages come from.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NoReturn

from pdserve.disagg.base import KVConnector, KVHandle, TransferError, TransferStage
from pdserve.disagg.lease import LeaseTable, TransferStats, parse_release


class LeasingConnector(KVConnector):
    # set by the backend's __init__
    engine_id: str
    metadata_url: str
    compat_hash: str
    leases: LeaseTable
    stats: TransferStats

    def on_prefill_finished(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        lease_s = self.leases.add(request_id, block_ids)
        return KVHandle(
            request_id=request_id,
            engine_id=self.engine_id,
            metadata_url=self.metadata_url,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            compat_hash=self.compat_hash,
            lease_expires_at=time.time() + lease_s,
        )

    def release(self, request_id: str) -> None:
        if self.leases.release(request_id) is not None:
            self.stats.leases_released += 1

    def _released(self, messages: Iterable[bytes]) -> list[str]:
        """Leases ended by decode's release messages (other messages ignored), then by expiry."""
        released = []
        for msg in messages:
            rid = parse_release(msg)
            if rid is not None and self.leases.release(rid) is not None:
                self.stats.leases_released += 1
                released.append(rid)
        expired = self.leases.expired()
        self.stats.lease_expirations += len(expired)
        return released + expired

    def _fail_now(self, rid: str, stage: TransferStage, reason: str) -> NoReturn:
        self.stats.record_failed(stage.name)
        raise TransferError(rid, stage, reason)
