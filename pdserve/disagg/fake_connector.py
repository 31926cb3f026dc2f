"""An in-process KV connector for unit tests: connectors in one process find each other by engine id
in a FakeFabric and copy blocks with torch. Same contract as the NIXL connector (hash check, leases,
release notifications, timeouts, typed failures), plus knobs to inject failures:

    fail_next(stage, reason)   the next load fails at that stage (HANDSHAKE/PENDING at start_load,
                               READING at the next poll_loads)
    hold_loads = True          loads stay in flight (until released or the transfer timeout)
    corrupt_reads = n          the next n reads flip a byte of the first block they wrote here
    fabric.disconnect(id)      the prefill engine vanishes, as if killed
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from pdserve.disagg.base import KVHandle, PeerMetadata, TransferError, TransferStage
from pdserve.disagg.layout import KVLayout, Runs, region_runs
from pdserve.disagg.lease_table import DEFAULT_LEASE_S, release_message
from pdserve.disagg.leasing_connector import LeasingConnector
from pdserve.disagg.options import ConnectorRole, StagingOptions
from pdserve.disagg.staging import payload_bytes
from pdserve.disagg.stats import LoadRecord
from pdserve.model.kv_cache import KVCache


class FakeFabric:
    """The 'network': registered connectors by engine id."""

    def __init__(self) -> None:
        self.engines: dict[str, FakeConnector] = {}

    def attach(self, conn: FakeConnector) -> None:
        if conn.engine_id in self.engines:
            raise ValueError(f"engine id {conn.engine_id!r} is already on this fabric")
        self.engines[conn.engine_id] = conn

    def disconnect(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)


# connectors made without an explicit fabric meet here
DEFAULT_FABRIC = FakeFabric()


@dataclass
class _Load:
    handle: KVHandle
    local_block_ids: list[int]
    runs: Runs  # per region: (remote start, local start, count), as NIXL would read them
    num_descs: int  # what the NIXL connector would post: one per (region, layer, run), 1 for a slab
    started: float  # monotonic
    deadline: float  # monotonic
    landing: int | None = None  # a staged read: the slab's room in the landing arena
    local_blocks: dict[str, list[int]] | None = None


class FakeConnector(LeasingConnector):
    def __init__(
        self,
        engine_id: str,
        *,
        model_id: str,
        metadata_url: str = "",
        lease_s: float = DEFAULT_LEASE_S,
        transfer_timeout_s: float = 30.0,
        lease_margin_s: float = 1.0,
        version: str | None = None,
        fabric: FakeFabric | None = None,
        role: ConnectorRole = "both",
        staging: StagingOptions | None = None,
        verify: bool = True,
    ) -> None:
        super().__init__(
            engine_id, model_id=model_id, metadata_url=metadata_url, lease_s=lease_s,
            transfer_timeout_s=transfer_timeout_s, lease_margin_s=lease_margin_s, version=version,
            role=role, staging=staging, verify=verify,
        )  # fmt: skip
        self.fabric = DEFAULT_FABRIC if fabric is None else fabric
        self.hold_loads = False
        self.corrupt_reads = 0
        self._inject: tuple[TransferStage, str] | None = None
        self._inbox: list[bytes] = []  # notifications sent to this engine
        self._handoffs: list[tuple[str, bytes]] = []  # hand-offs sent to this engine: (sender, payload)

    def fail_next(self, stage: TransferStage, reason: str) -> None:
        self._inject = (stage, reason)

    def _registered(self, kv_cache: KVCache) -> None:
        self.fabric.attach(self)

    def peer_metadata(self) -> bytes:
        doc = {"engine_id": self.engine_id, "instance_id": self.instance_id, "compat_hash": self.compat_hash}
        return json.dumps(doc).encode()

    # -- prefill side --
    def poll_releases(self) -> list[str]:
        inbox, self._inbox = self._inbox, []
        return self._released(inbox)

    def send_handoff(self, peer: PeerMetadata, payload: bytes) -> None:
        dest = self.fabric.engines.get(peer.engine_id)
        if dest is None:
            raise RuntimeError(f"engine {peer.engine_id} is not reachable")
        dest._handoffs.append((self.engine_id, payload))

    # -- decode side --
    def poll_handoffs(self) -> list[tuple[str, bytes]]:
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def start_load(
        self,
        handle: KVHandle,
        local_block_ids: list[int],
        peer: PeerMetadata | None = None,
        local_window_block_ids: list[int] | None = None,
        local_state_slot: int = -1,
        num_reused_blocks: int = 0,
    ) -> None:
        if self._inject is not None and self._inject[0] < TransferStage.READING:
            (stage, reason), self._inject = self._inject, None
            self._fail_now(handle.request_id, stage, reason)
        super().start_load(handle, local_block_ids, peer, local_window_block_ids, local_state_slot, num_reused_blocks)

    def _connect(self, handle: KVHandle, peer: PeerMetadata | None) -> tuple[FakeConnector, KVLayout]:
        remote = self.fabric.engines.get(handle.engine_id)
        if remote is None:
            self._fail_now(handle.request_id, TransferStage.HANDSHAKE, f"engine {handle.engine_id} is not reachable")
        return remote, remote.layout

    def _post(
        self,
        handle: KVHandle,
        remote: FakeConnector,
        local_block_ids: list[int],
        remote_blocks: dict[str, list[int]],
        local_blocks: dict[str, list[int]],
    ) -> _Load:
        now = time.monotonic()
        runs = region_runs(remote_blocks, local_blocks)
        arena = remote.staging_arena
        landing = self._take_landing(handle, local_blocks, arena.capacity if arena is not None else 0)
        num_descs = 1 if landing is not None else sum(len(runs[r.name]) * r.num_layers for r in self.layout.regions)
        return _Load(
            handle, local_block_ids, runs, num_descs, now, now + self.transfer_timeout_s, landing, local_blocks
        )

    def poll_loads(self) -> tuple[list[str], list[TransferError]]:
        done = []
        for rid, load in list(self._loads.items()):
            if self._inject is not None:
                (stage, reason), self._inject = self._inject, None
                self._fail_load(rid, stage, reason)
                continue
            peer = self.fabric.engines.get(load.handle.engine_id)
            if peer is None:
                self._fail_load(rid, TransferStage.READING, f"remote {load.handle.engine_id} disconnected")
                continue
            if self.hold_loads:
                if time.monotonic() > load.deadline:
                    self._fail_load(rid, TransferStage.READING, f"no completion within {self.transfer_timeout_s} s")
                continue
            del self._loads[rid]
            try:
                nbytes = self._copy(peer, load)
            except Exception as e:  # as the NIXL connector: a failed scatter fails the request
                peer._inbox.append(release_message(rid))  # the read itself completed (NIXL notifies)
                self.stats.record_failed(TransferStage.READING.name)
                self._failed.append(
                    TransferError(rid, TransferStage.READING, f"scattering the slab: {type(e).__name__}: {e}")
                )
                continue
            if self.corrupt_reads > 0:
                self.corrupt_reads -= 1
                self._corrupt(load.local_blocks)
            if not self._verified(load.handle):  # read again, or failed at VERIFY
                if rid not in self._loads:
                    peer._inbox.append(release_message(rid))
                continue
            peer._inbox.append(release_message(rid))
            self.stats.record_done(
                LoadRecord(
                    rid, nbytes, load.started, time.monotonic() - load.started, load.num_descs, self._saved.pop(rid, 0)
                )
            )
            done.append(rid)
        self._prune_plans()
        failed, self._failed = self._failed, []
        return done, failed

    def cancel_load(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None:
            self._drop_landing(load.landing)
            self._notify(load.handle.engine_id, request_id)

    def shutdown(self) -> None:
        for rid in list(self._loads):
            self.cancel_load(rid)
        if self.fabric.engines.get(self.engine_id) is self:
            self.fabric.disconnect(self.engine_id)

    # -- helpers --
    def _copy(self, peer: FakeConnector, load: _Load) -> int:
        if load.landing is not None:  # the slab's bytes, as one descriptor would move them, then scattered
            slab = load.handle.staged
            room = self.landing_arena.slab(load.landing, slab.nbytes)
            try:
                room.copy_(peer.staging_arena.slab(slab.offset, slab.nbytes).to(room.device))
            except Exception:
                self._drop_landing(load.landing)
                raise
            self._land(load.landing, slab.nbytes, load.local_blocks)  # frees the room, scattered or not
            return payload_bytes(self.layout, load.local_blocks)
        # src/dst: [Lr, N, rpb, dim] per region; each run is a slice of the block axis on both sides
        nbytes = 0
        for r in self.layout.regions:
            src, dst = peer.kv.regions[r.name], self.kv.regions[r.name]
            for s, d, n in load.runs[r.name]:
                dst[:, d : d + n] = src[:, s : s + n].to(dst.device)
                nbytes += n * r.block_bytes * r.num_layers
        return nbytes

    def _corrupt(self, local_blocks: dict[str, list[int]]) -> None:
        """Flip the low bit of the first byte of the first block written here (layer 0)."""
        for name, ids in local_blocks.items():
            if ids:
                block = self.kv.regions[name][0, ids[0]].view(-1).view(torch.uint8)
                block[0] ^= 1
                return

    def _notify(self, engine_id: str, rid: str) -> None:
        peer = self.fabric.engines.get(engine_id)
        if peer is not None:
            peer._inbox.append(release_message(rid))

    def _fail_load(self, rid: str, stage: TransferStage, reason: str) -> None:
        load = self._loads.pop(rid)
        self._drop_landing(load.landing)
        self._notify(load.handle.engine_id, rid)
        self.stats.record_failed(stage.name)
        self._failed.append(TransferError(rid, stage, reason))
