"""The engine's view of KV transfer between a prefill worker and a decode worker.

Life of a PD request (decode pulls, as vLLM's NixlConnector does):

    prefill worker                                   decode worker
    --------------                                   -------------
    run prompt, sample first token
    on_prefill_finished -> KVHandle (blocks pinned)
          |  handle travels router -> decode  |
                                                     check handle.compat_hash
                                                     allocate local blocks
                                                     start_load(handle, local blocks)  [READ]
                                                     poll_loads -> done | TransferError
          <----------- notify "release <request_id>" ---
    poll_releases -> free blocks
    (or lease expiry -> free blocks)

The engine calls these methods from its step loop; none of them blocks on the network for long.
Backends: `nixl` (real, pdserve.disagg.nixl_connector) and `fake` (in-process, for unit tests).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from pdserve.engine.kv_cache import KVCache

if TYPE_CHECKING:
    from pdserve.disagg.lease import TransferStats

KV_HANDLE_VERSION = 1


class KVHandle(BaseModel):
    """Where a prefilled request's KV lives. Crosses processes as JSON (router -> decode)."""

    model_config = ConfigDict(frozen=True)

    version: int = KV_HANDLE_VERSION
    request_id: str
    engine_id: str  # the prefill worker's engine id (its NIXL agent name)
    metadata_url: str  # where the decode side fetches the prefill agent's NIXL metadata
    block_ids: list[int]  # prefill-side block ids, in sequence order
    num_tokens: int  # tokens whose KV is in those blocks
    compat_hash: str  # hash over model, dtype, KV layout, block size, pdserve version
    lease_expires_at: float  # prefill's wall clock (time.time()) when it frees the blocks anyway


class TransferStage(enum.IntEnum):
    """Ordered: a transfer only moves forward."""

    PENDING = 0
    HANDSHAKE = 1  # fetching / adding the remote agent's metadata
    READING = 2
    NOTIFYING = 3
    DONE = 4
    FAILED = 5


class TransferError(Exception):
    """A failed KV transfer: which request, at which stage, and why."""

    def __init__(self, request_id: str, stage: TransferStage, reason: str) -> None:
        super().__init__(f"KV transfer for request {request_id} failed at {stage.name}: {reason}")
        self.request_id = request_id
        self.stage = stage
        self.reason = reason


class KVConnector(ABC):
    """Worker-side transfer duties. One instance per worker, owned by the engine."""

    stats: TransferStats  # counters the worker exports as metrics, updated from the step loop

    @abstractmethod
    def register_kv_cache(self, kv_cache: KVCache) -> None:
        """Register the worker's pool once (NIXL: DRAM on CPU, VRAM on CUDA)."""

    # -- prefill side --
    @abstractmethod
    def on_prefill_finished(self, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        """Pin the request's blocks under a lease and describe them for the decode side."""

    @abstractmethod
    def poll_releases(self) -> list[str]:
        """Request ids whose pinned blocks may be freed now (decode notified, or lease expired)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Drop a lease at once (the router says the request was aborted before decode read it)."""

    # -- decode side --
    @abstractmethod
    def start_load(self, handle: KVHandle, local_block_ids: list[int]) -> None:
        """Begin reading handle's blocks into local_block_ids (same order). Raises TransferError
        at once for a handle this worker cannot read (hash mismatch, unknown peer)."""

    @abstractmethod
    def poll_loads(self) -> tuple[list[str], list[TransferError]]:
        """(request ids whose KV has fully arrived, failures). A finished load has already
        notified the prefill side to release its blocks."""

    @abstractmethod
    def cancel_load(self, request_id: str) -> None:
        """Stop waiting for a load (request aborted); local blocks are then the engine's to free."""

    @abstractmethod
    def shutdown(self) -> None:
        """Deregister memory, drop remote agents."""
