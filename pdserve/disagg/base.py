"""The engine's view of KV transfer between a prefill worker and a decode worker.

Life of a PD request (decode pulls, as vLLM's NixlConnector does):

    prefill worker                                   decode worker
    --------------                                   -------------
    (each side fetched the other's peer_metadata() over HTTP once per engine instance, on its
     event loop, before the request entered its engine: worker/peers.py)
                                                     the request waits for its hand-off
    run prompt, sample first token
    on_prefill_finished -> KVHandle (blocks pinned;
      + gathered into one staged slab: staging.py)
    send_handoff(decode, Handoff JSON) ---notif----> poll_handoffs -> (prefill engine id, payload)
      (or the router posts the Handoff over HTTP,    check handle.compat_hash
       when prefill could not notify this decode)
                                                     allocate local blocks
                                                     start_load(handle, local blocks, peer) [same
                                                       machine: copy from the mapped pool (cuda_ipc.py);
                                                       else READ: the slab if both sides have room,
                                                       else blocks]
                                                     poll_loads -> verify the blocks written
                                                       against handle.checksums (a mismatch reads
                                                       once more) -> done | TransferError
          <----------- notify "release <request_id>" ---
    poll_releases -> free blocks
    (or lease expiry -> free blocks)

The engine calls these methods from its step loop; none of them waits on the network (the peer's
metadata is fetched by the worker, asynchronously, before the request reaches the engine). The
hand-off payload (the engine's `Handoff`: KV handle and first token) is opaque bytes here.
Backends: `nixl` (pdserve.disagg.nixl, the only one a config can name) and the
in-process fake (pdserve.disagg.fake_connector, built directly by unit tests).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # no torch at import: the router reads KVHandle too
    from pdserve.disagg.stats import TransferStats
    from pdserve.model.kv_cache import KVCache

KV_HANDLE_VERSION = 7


class StagedSlab(BaseModel):
    """Where the prefill side gathered a request's blocks (staging.py): bytes [offset, offset +
    nbytes) of its staging arena, the regions' needed blocks one after another."""

    model_config = ConfigDict(frozen=True)

    offset: int = Field(ge=0)
    nbytes: int = Field(gt=0)


class KVHandle(BaseModel):
    """Where a prefilled request's KV lives. Crosses processes as JSON (router -> decode)."""

    model_config = ConfigDict(frozen=True)

    version: int = KV_HANDLE_VERSION
    request_id: str
    engine_id: str  # the prefill worker's engine id (its NIXL agent name)
    instance_id: str  # new each time that engine starts: a restarted peer's metadata is fetched anew
    metadata_url: str  # where the decode side fetches the prefill agent's NIXL metadata
    block_ids: list[int]  # prefill-side block ids, in sequence order
    # prefill-side window-space block ids by token-block index, -1 where freed (models with a
    # sliding window: engine/block_manager.py); empty for pools without a window space
    window_block_ids: list[int] = []
    state_slot: int = -1  # prefill-side per-sequence state slot (-1: the pool has no state space)
    num_tokens: int  # tokens whose KV is in those blocks
    compat_hash: str  # hash over model, dtype, KV layout, block size, pdserve version
    lease_expires_at: float  # prefill's wall clock (time.time()) when it frees the blocks anyway
    # the same KV gathered into one slab (None: the arena had no room, or staging is off); the
    # blocks above stay pinned too, so a decode side without landing room reads them instead
    staged: StagedSlab | None = None
    # per region, the checksum (checksum.py) of the blocks above as prefill leased them; decode
    # verifies what it wrote against it (None: prefill does not verify)
    checksums: dict[str, int] | None = None
    # the token-space regions' checksums per block (checksum.py: they sum to `checksums`), so a
    # decode worker that reads only the blocks after those its prefix cache holds checks just those
    block_checksums: dict[str, list[int]] | None = None
    # MTP drafting (engine/spec_decode/mtp_handoff.py): the MTP layer's output g at the prompt's
    # last position (its row paired with the first token), the first draft's input: [hidden]
    # values (DeepSeek-V4: its residual streams, [hc_mult, hidden]) of the model's dtype, raw
    # bytes in base64; None when prefill ran without MTP
    mtp_hidden: str | None = None


class TransferStage(enum.IntEnum):
    """Ordered: a transfer only moves forward."""

    PENDING = 0
    HANDSHAKE = 1  # fetching / adding the remote agent's metadata
    READING = 2
    VERIFY = 3  # the blocks written here do not match prefill's checksums (read twice)
    DONE = 4
    FAILED = 5


class TransferFailure(BaseModel):
    """A failed KV transfer as data: it travels decode engine -> worker -> router -> client error."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    stage: str = Field(description="TransferStage name: where it failed")
    reason: str

    def __str__(self) -> str:
        return f"KV transfer for request {self.request_id} failed at {self.stage}: {self.reason}"


class TransferError(Exception):
    """A failed KV transfer: which request, at which stage, and why (raised inside the worker)."""

    def __init__(self, request_id: str, stage: TransferStage, reason: str) -> None:
        self.failure = TransferFailure(request_id=request_id, stage=stage.name, reason=reason)
        super().__init__(str(self.failure))
        self.request_id = request_id
        self.stage = stage
        self.reason = reason


class KVPeerRef(BaseModel):
    """The other worker of a PD pair, as the router names it to each side: the engine to hand the
    KV off to (prefill's Request.kv_to) or to expect it from (decode's Request.kv_from). The same
    fields as a KVHandle's, so either can be fetched by worker/peers.py."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_id: str
    metadata_url: str
    instance_id: str | None = None  # None: whichever instance answers at metadata_url


@dataclass(frozen=True)
class PeerMetadata:
    """What the decode worker fetched from handle.metadata_url before admitting a request: the
    prefill engine's transfer metadata (bytes a connector reads), or why it could not."""

    engine_id: str
    instance_id: str | None
    data: bytes | None = None
    error: str | None = None


class KVConnector(ABC):
    """Worker-side transfer duties. One instance per worker, owned by the engine."""

    stats: TransferStats  # counters the worker exports as metrics, updated from the step loop
    engine_id: str  # this engine's id (its transfer agent's name)
    instance_id: str  # new each time the engine starts
    metadata_url: str  # where this worker serves peer_metadata()

    @abstractmethod
    def register_kv_cache(self, kv_cache: KVCache) -> None:
        """Register the worker's pool once (NIXL: DRAM on CPU, VRAM on CUDA)."""

    @abstractmethod
    def peer_metadata(self) -> bytes:
        """This worker's transfer metadata, which its HTTP server serves at handle.metadata_url
        (built once at registration: serving it never touches the transfer agent)."""

    # -- prefill side --
    @abstractmethod
    def on_prefill_finished(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        window_block_ids: list[int] | None = None,
        state_slot: int = -1,
        kv_to: PeerMetadata | None = None,
    ) -> KVHandle:
        """Pin the request's blocks (and window blocks, state slot) under a lease and describe
        them for the decode side. kv_to: the decode engine's metadata, when the engine knows
        where the KV goes (a same-host decode worker that copies from this pool needs no slab)."""

    @abstractmethod
    def send_handoff(self, peer: PeerMetadata, payload: bytes) -> None:
        """Tell the decode engine `peer` describes that a request's KV is ready (payload: the
        engine's Handoff as JSON). Raises on failure (the router then posts the hand-off itself)."""

    @abstractmethod
    def poll_releases(self) -> list[str]:
        """Request ids whose pinned blocks may be freed now (decode notified, or lease expired)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Drop a lease at once (the request was aborted before decode read it)."""

    # -- decode side --
    @abstractmethod
    def start_load(
        self,
        handle: KVHandle,
        local_block_ids: list[int],
        peer: PeerMetadata | None = None,
        local_window_block_ids: list[int] | None = None,
        local_state_slot: int = -1,
        num_reused_blocks: int = 0,
    ) -> None:
        """Begin reading handle's blocks into local_block_ids (same order), its window-space
        blocks into local_window_block_ids (same token-block indices) and its state slot into
        local_state_slot. num_reused_blocks: the first this many of local_block_ids already hold
        the request's records (decode-side prefix caching): token-space regions read only the
        blocks after them (window and state regions read what they always do). peer: the prefill
        engine's metadata, needed unless this connector already knows that engine instance.
        Raises TransferError at once for a handle this worker cannot read (hash mismatch, unknown
        or unreachable peer)."""

    @abstractmethod
    def poll_handoffs(self) -> list[tuple[str, bytes]]:
        """Hand-offs prefill engines sent here since the last call: (sender engine id, payload)."""

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
