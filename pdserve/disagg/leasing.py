"""What every connector does the same way: the prefill side's leases and failure bookkeeping.

Backends (nixl, fake) differ in how bytes and release messages travel, not in what a lease is, so
both derive from LeasingConnector and only say where their release messages come from.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NoReturn

from pdserve import __version__
from pdserve.disagg.base import KVConnector, KVHandle, TransferError, TransferStage
from pdserve.disagg.lease import LeaseTable, TransferStats, parse_release
from pdserve.engine.kv_cache import KVCache


class LeasingConnector(KVConnector):
    def __init__(
        self,
        engine_id: str,
        *,
        model_id: str,
        metadata_url: str,
        lease_s: float,
        transfer_timeout_s: float,
        lease_margin_s: float,
        version: str | None,
    ) -> None:
        """metadata_url: where this worker serves its transfer metadata (goes into handles).
        lease_margin_s: a handle whose lease ends sooner than this is refused (clock skew, read time)."""
        self.engine_id = engine_id
        self.model_id = model_id
        self.metadata_url = metadata_url
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_margin_s = lease_margin_s
        self.version = version or __version__
        self.leases = LeaseTable(lease_s)
        self.stats = TransferStats()
        self.kv: KVCache | None = None
        self.compat_hash = ""  # set when the pool is registered
        self._failed: list[TransferError] = []

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
