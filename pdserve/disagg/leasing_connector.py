"""What every connector does the same way: registration bookkeeping, the prefill side's leases, the
checks before a load starts, and failure bookkeeping.

Backends (nixl, the test fake) differ only in how they reach a peer, move bytes and carry release
messages, so both derive from LeasingConnector and fill in three hooks:

    _registered(kv_cache)              the pool is known: register it with the transport
    _connect(handle, peer) -> (remote, its KVLayout)   the prefill engine the handle names, ready to read from
    _post(handle, remote, local_block_ids, runs) -> load    start the read; kept in self._loads
                                       (runs: per region, over the blocks that region needs)
"""

from __future__ import annotations

import time
import uuid
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, NoReturn

from pdserve import __version__
from pdserve.disagg.base import KVConnector, KVHandle, PeerMetadata, TransferError, TransferStage
from pdserve.disagg.layout import KVLayout, Runs, check_block_ids, compat_hash, region_runs
from pdserve.disagg.lease_table import LeaseTable, parse_release
from pdserve.disagg.stats import TransferStats
from pdserve.model.kv_cache import KVCache


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
        self.instance_id = uuid.uuid4().hex[:16]  # tells a restarted engine of the same id apart
        self.model_id = model_id
        self.metadata_url = metadata_url
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_margin_s = lease_margin_s
        self.version = version or __version__
        self.leases = LeaseTable(lease_s)
        self.stats = TransferStats()
        self.kv: KVCache | None = None
        self.layout: KVLayout | None = None
        self.compat_hash = ""  # set when the pool is registered
        self._loads: dict[str, Any] = {}  # request id -> the backend's in-flight load
        self._failed: list[TransferError] = []

    # -- registration --
    def register_kv_cache(self, kv_cache: KVCache) -> None:
        if self.kv is not None:
            raise RuntimeError("register_kv_cache called twice; the pool is registered once")
        self.kv = kv_cache
        self.layout = KVLayout.from_kv_cache(kv_cache)
        self.compat_hash = compat_hash(self.model_id, kv_cache.dtype, self.layout, kv_cache.block_size, self.version)
        self._registered(kv_cache)

    # -- prefill side --
    def on_prefill_finished(
        self, request_id: str, block_ids: list[int], num_tokens: int, window_block_ids: list[int] | None = None, state_slot: int = -1
    ) -> KVHandle:
        window = list(window_block_ids or [])
        lease_s = self.leases.add(request_id, block_ids)
        return KVHandle(
            request_id=request_id,
            engine_id=self.engine_id,
            instance_id=self.instance_id,
            metadata_url=self.metadata_url,
            block_ids=list(block_ids),
            window_block_ids=window,
            state_slot=state_slot,
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

    # -- decode side --
    def start_load(
        self,
        handle: KVHandle,
        local_block_ids: list[int],
        peer: PeerMetadata | None = None,
        local_window_block_ids: list[int] | None = None,
        local_state_slot: int = -1,
    ) -> None:
        rid = handle.request_id
        if self.kv is None:
            raise RuntimeError("start_load() before register_kv_cache()")
        if rid in self._loads:
            raise TransferError(rid, TransferStage.PENDING, "a load for this request is already in flight")
        if handle.compat_hash != self.compat_hash:
            self._fail_now(rid, TransferStage.HANDSHAKE, self._mismatch(handle.engine_id, handle.compat_hash))
        left = handle.lease_expires_at - time.time()
        if left < self.lease_margin_s:
            self._fail_now(rid, TransferStage.PENDING, f"the prefill lease ends in {left:.1f} s (< margin)")
        remote, remote_layout = self._connect(handle, peer)
        local_window = list(local_window_block_ids or [])
        try:
            check_block_ids(handle.block_ids, remote_layout.num_blocks, "prefill")
            check_block_ids([b for b in handle.window_block_ids if b >= 0], remote_layout.num_window_blocks, "prefill window")
            check_block_ids(local_block_ids, self.layout.num_blocks, "decode")
            check_block_ids([b for b in local_window if b >= 0], self.layout.num_window_blocks, "decode window")
            check_block_ids([handle.state_slot] if handle.state_slot >= 0 else [], remote_layout.num_state_slots, "prefill state")
            check_block_ids([local_state_slot] if local_state_slot >= 0 else [], self.layout.num_state_slots, "decode state")
            runs = region_runs(
                self.layout, handle.block_ids, local_block_ids, handle.num_tokens, handle.window_block_ids, local_window,
                (handle.state_slot, local_state_slot),
            )
        except ValueError as e:
            self._fail_now(rid, TransferStage.PENDING, str(e))
        self._loads[rid] = self._post(handle, remote, list(local_block_ids), runs)

    # -- backend hooks --
    @abstractmethod
    def _registered(self, kv_cache: KVCache) -> None:
        """The pool, layout and compat hash are set: register the pool with the transport."""

    @abstractmethod
    def _connect(self, handle: KVHandle, peer: PeerMetadata | None) -> tuple[Any, KVLayout]:
        """(the remote engine, its pool's layout); raises TransferError (HANDSHAKE)."""

    @abstractmethod
    def _post(self, handle: KVHandle, remote: Any, local_block_ids: list[int], runs: Runs) -> Any:
        """Start reading `runs` (per region: remote start, local start, length) from remote; the load record."""

    # -- helpers --
    def _mismatch(self, engine_id: str, theirs: str) -> str:
        return (
            f"refused: KV compatibility hash mismatch: prefill engine {engine_id} has {theirs}, "
            f"this engine {self.engine_id} has {self.compat_hash} "
            "(model, dtype, KV layout, block size or pdserve version differ)"
        )

    def _fail_now(self, rid: str, stage: TransferStage, reason: str) -> NoReturn:
        self.stats.record_failed(stage.name)
        raise TransferError(rid, stage, reason)
