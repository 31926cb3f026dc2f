"""What NIXL peers tell each other: the metadata a worker serves (JSON over HTTP) and the prefix of
the hand-off notification.

A worker's NixlPeerInfo is built once, at registration, and fetched by its peers (worker/peers.py)
once per engine instance: the pool's layout and addresses to READ from, the staging arena a
slab lies in, the NIXL agent to load, and for same-host peers the CUDA IPC description of the pool
(cuda_ipc.py). Notifications carry either a release message (lease_table.release_message: decode
-> prefill) or HANDOFF_PREFIX and a Handoff's JSON (prefill -> decode).
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from pdserve.disagg.cuda_ipc import IpcRegion
from pdserve.disagg.layout import KVLayout

PEER_INFO_VERSION = 4
HANDOFF_PREFIX = b"handoff:"  # prefill -> decode: a Handoff's JSON follows (release messages go the other way)


class NixlPeerInfo(BaseModel):
    """What a worker serves at its metadata URL (JSON)."""

    version: int = PEER_INFO_VERSION
    engine_id: str  # also the NIXL agent name
    instance_id: str  # this start of the engine (KVHandle.instance_id)
    compat_hash: str
    layout: KVLayout
    region_addrs: dict[str, int]  # region name -> base address in the peer's address space
    mem_type: str  # "DRAM" | "VRAM"
    dev_id: int
    staging_addr: int = 0  # its staging arena (KVHandle.staged offsets are into it); 0 bytes: none
    staging_bytes: int = 0
    host_id: str = ""  # cuda_ipc.host_id(): the same on one machine
    cuda_ipc: dict[str, IpcRegion] | None = None  # its pool's regions for a same-host decode worker to map
    maps_peers: bool = False  # a decode worker that copies from a same-host prefill pool itself
    agent_metadata: str  # base64 of nixl_agent.get_agent_metadata()

    @classmethod
    def read(cls, metadata: bytes) -> NixlPeerInfo:
        """Parse a peer's metadata; ValueError when it is not a NixlPeerInfo of this version."""
        try:
            info = cls.model_validate_json(metadata)
        except ValidationError as e:
            raise ValueError(f"peer metadata is not a NixlPeerInfo: {e.errors()[:2]}") from e
        if info.version != PEER_INFO_VERSION:
            raise ValueError(f"peer metadata version {info.version}, this worker reads {PEER_INFO_VERSION}")
        return info
