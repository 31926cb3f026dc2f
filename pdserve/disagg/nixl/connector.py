"""NixlConnector: KV transfer between workers over NIXL (the package docstring draws a request's
path through it). What every backend shares is in leasing_connector.py; here: the agent, the peers
and their metadata, the choice of a load's transport, and the release messages.
"""

from __future__ import annotations

import base64
import importlib.util
import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from pdserve.disagg.base import KVHandle, PeerMetadata, TransferError, TransferStage
from pdserve.disagg.cuda_ipc import CopyQueue, IpcRegion, copy_views, export_pool, host_id, open_pool
from pdserve.disagg.layout import Descriptor, KVLayout, build_descriptors, device_id, region_addrs, region_runs
from pdserve.disagg.lease_table import DEFAULT_LEASE_S, release_message
from pdserve.disagg.leasing_connector import LeasingConnector
from pdserve.disagg.nixl.agent import NIXL_MISSING, NixlAgent, is_disconnect, nixl_reason
from pdserve.disagg.nixl.loads import BlockRead, IpcCopy, Load, NothingToRead, StagedRead
from pdserve.disagg.nixl.metadata import HANDOFF_PREFIX, NixlPeerInfo
from pdserve.disagg.nixl.options import NixlOptions
from pdserve.disagg.options import ConnectorRole, StagingOptions
from pdserve.disagg.staging import payload_bytes
from pdserve.disagg.stats import LoadRecord
from pdserve.model.kv_cache import KVCache

__all__ = ["NixlConnector", "NixlOptions"]  # the backend, as disagg/factory.py builds it

log = logging.getLogger("pdserve.disagg.nixl")

COPY_SETTLE_S = 5.0  # a cancelled or failed same-host copy is waited for this long before prefill is told to free


@dataclass
class _Peer:
    info: NixlPeerInfo
    agent_name: str
    mapped: dict | None = None  # its pool mapped through CUDA IPC: per region, a RegionCopy (cuda_ipc.CopyQueue.bind)


class NixlConnector(LeasingConnector):
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
        progress_thread: bool = True,
        progress_interval_ms: float = 1.0,
        ucx_gpu_defaults: bool = True,
        cuda_ipc: bool = True,
        role: ConnectorRole = "both",
        staging: StagingOptions | None = None,
        verify: bool = True,
    ) -> None:
        """See LeasingConnector for the common arguments, NixlOptions for the others.
        progress_thread: workers take NixlOptions' default (off); on here for a caller that never
        polls (without it, transfers advance only inside poll_loads / poll_releases calls).
        cuda_ipc: for a pool on the GPU, export it to same-host decode workers (prefill role) and
        map same-host prefill pools to copy from (decode role).
        The NIXL agent is made by register_kv_cache, once the pool's device is known."""
        if importlib.util.find_spec("nixl") is None:
            raise RuntimeError(NIXL_MISSING)
        super().__init__(
            engine_id, model_id=model_id, metadata_url=metadata_url, lease_s=lease_s,
            transfer_timeout_s=transfer_timeout_s, lease_margin_s=lease_margin_s, version=version,
            role=role, staging=staging, verify=verify,
        )  # fmt: skip
        self._progress_thread, self._ucx_gpu_defaults, self._cuda_ipc = progress_thread, ucx_gpu_defaults, cuda_ipc
        self._progress_interval_s = progress_interval_ms / 1000
        self.host_id = host_id()
        self._exported: dict[str, IpcRegion] | None = None  # prefill: this pool for same-host decode workers
        self._maps_peers = False  # decode: copies from same-host prefill pools it maps
        self._copies: CopyQueue | None = None  # decode: where those copies run (beside the engine's steps)
        self._decode_maps: dict[str, tuple[bytes, bool]] = {}  # decode engine id -> (its metadata, copies from us)
        self.agent: NixlAgent | None = None
        self._metadata = b""
        self._peers: dict[str, _Peer] = {}
        self._handoff_peers: dict[str, bytes] = {}  # decode engine id -> the metadata its agent was added from
        self._loads: dict[str, Load] = {}

    @property
    def ucx_env_applied(self) -> dict[str, str]:
        """The UCX variables this worker set (ucx_env.py): none for a pool in host memory."""
        return self.agent.ucx_env_applied if self.agent is not None else {}

    # -- registration --
    def _registered(self, kv_cache: KVCache) -> None:
        self._addrs = region_addrs(kv_cache)
        self._dev_id = device_id(kv_cache)
        first = next(iter(kv_cache.regions.values()))
        self.mem_type = "DRAM" if first.device.type == "cpu" else "VRAM"
        gpu_defaults = self.mem_type == "VRAM" and self._ucx_gpu_defaults
        self.agent = NixlAgent(
            self.engine_id, progress_thread=self._progress_thread, gpu_defaults=gpu_defaults, stats=self.stats
        )
        self.agent.register(list(kv_cache.regions.values()) + [a.buffer for a in self.arenas()])
        self._set_up_cuda_ipc(kv_cache)
        staging = self.staging_arena
        info = NixlPeerInfo(
            engine_id=self.engine_id,
            instance_id=self.instance_id,
            compat_hash=self.compat_hash,
            layout=self.layout,
            region_addrs=self._addrs,
            mem_type=self.mem_type,
            dev_id=self._dev_id,
            staging_addr=staging.addr if staging is not None else 0,
            staging_bytes=staging.capacity if staging is not None else 0,
            host_id=self.host_id,
            cuda_ipc=self._exported,
            maps_peers=self._maps_peers,
            agent_metadata=base64.b64encode(self.agent.metadata()).decode(),
        )
        # built once: the HTTP server thread serves these bytes without touching the agent
        self._metadata = info.model_dump_json().encode()
        if self.role == "prefill" and not self._progress_thread and self._progress_interval_s > 0:
            self.agent.start_progress(self._progress_interval_s)

    def _set_up_cuda_ipc(self, kv_cache: KVCache) -> None:
        """Export the pool (prefill) and make the copy queue (decode), for pools on a GPU."""
        if self.mem_type != "VRAM" or not self._cuda_ipc:
            return
        if self.role != "decode":
            try:
                self._exported = export_pool(kv_cache.regions)
            except Exception as e:  # e.g. an allocator that cannot share: decode workers read over NIXL
                log.warning(
                    "the KV pool cannot be shared through CUDA IPC (same-host decode workers read it over NIXL): %s",
                    nixl_reason(e),
                )
        if self.role != "prefill":
            self._maps_peers = True
            self._copies = CopyQueue(next(iter(kv_cache.regions.values())).device)

    def peer_metadata(self) -> bytes:
        """This worker's NixlPeerInfo as JSON bytes, for its HTTP server to serve at metadata_url."""
        if not self._metadata:
            raise RuntimeError("peer_metadata() before register_kv_cache()")
        return self._metadata

    # -- prefill side --
    def poll_releases(self) -> list[str]:
        if self.agent is None:
            return self._released([])
        return self._released(self.agent.take_releases())

    def send_handoff(self, peer: PeerMetadata, payload: bytes) -> None:
        """Notify the decode engine `peer` describes (its agent added once per instance: the
        metadata's bytes change when it restarts)."""
        if self.agent is None:
            raise RuntimeError("send_handoff() before register_kv_cache()")
        if peer.data is None:
            raise ValueError(f"no metadata for decode engine {peer.engine_id}: {peer.error}")
        with self.agent.lock:
            if self._handoff_peers.get(peer.engine_id) != peer.data or peer.engine_id not in self._peers:
                self.add_peer(peer.data, peer.engine_id, peer.instance_id)
                self._handoff_peers[peer.engine_id] = peer.data
            self.agent.notify(self._peers[peer.engine_id].agent_name, HANDOFF_PREFIX + payload)

    def _peer_copies(self, kv_to: PeerMetadata | None) -> bool:
        """Prefill: the decode worker kv_to describes maps this pool and copies from it itself."""
        if self._exported is None or kv_to is None or kv_to.data is None:
            return False
        known = self._decode_maps.get(kv_to.engine_id)
        if known is None or known[0] != kv_to.data:
            try:
                info = NixlPeerInfo.model_validate_json(kv_to.data)
                copies = info.maps_peers and info.host_id == self.host_id
            except ValidationError:
                copies = False  # send_handoff reports the bad metadata
            known = self._decode_maps[kv_to.engine_id] = (kv_to.data, copies)
        return known[1]

    # -- decode side --
    def poll_handoffs(self) -> list[tuple[str, bytes]]:
        if self.agent is None:
            return []
        return self.agent.take_handoffs()

    def add_peer(self, metadata: bytes, engine_id: str | None = None, instance_id: str | None = None) -> NixlPeerInfo:
        """Load a peer's metadata (its peer_metadata() bytes) into the agent; kept by its engine id.
        Raises ValueError for metadata this worker refuses (wrong engine_id / instance_id when
        given, hash mismatch), NIXL errors when the agent it names is unreachable."""
        info = NixlPeerInfo.read(metadata)
        if engine_id is not None and info.engine_id != engine_id:
            raise ValueError(f"it describes engine {info.engine_id!r}, not {engine_id!r}")
        if instance_id is not None and info.instance_id != instance_id:
            why = f"it describes instance {info.instance_id} of {info.engine_id}, not {instance_id} (restarted?)"
            raise ValueError(why)
        if info.compat_hash != self.compat_hash:
            raise ValueError(self._mismatch(info.engine_id, info.compat_hash))
        self._drop_peer(info.engine_id)  # known already: it restarted, the new metadata wins
        name = self.agent.add_remote(base64.b64decode(info.agent_metadata))
        if name != info.engine_id:
            self.agent.remove_remote(name)
            raise ValueError(f"peer metadata names engine {info.engine_id!r} but its NIXL agent is {name!r}")
        self._peers[info.engine_id] = _Peer(info, name, self._map_peer(info))
        return info

    def _map_peer(self, info: NixlPeerInfo) -> dict | None:
        """A same-host prefill pool mapped through CUDA IPC, or None: read it over NIXL."""
        if not self._maps_peers or info.cuda_ipc is None or info.host_id != self.host_id:
            return None
        try:
            mapped = open_pool(info.cuda_ipc, info.layout, next(iter(self.kv.regions.values())).device)
            return self._copies.bind(copy_views(mapped, info.layout, self.layout, self.kv.regions))
        except Exception as e:  # its requests still move, over NIXL (per block unless staged)
            self.stats.record_control_failure("cuda_ipc")
            log.warning(
                "cannot map prefill engine %s's KV pool through CUDA IPC (%s): its requests are read over NIXL; "
                "`transfer.options.cuda_ipc: false` on the prefill workers makes them stage every request",
                info.engine_id, nixl_reason(e),
            )  # fmt: skip
            return None

    def _connect(self, handle: KVHandle, peer: PeerMetadata | None) -> tuple[_Peer, KVLayout]:
        rid = handle.request_id
        known = self._peers.get(handle.engine_id)
        if known is not None and known.info.instance_id == handle.instance_id:
            return known, known.info.layout
        if peer is None or peer.data is None:
            why = peer.error if peer is not None and peer.error else "no metadata was fetched for it"
            why = f"prefill engine {handle.engine_id} ({handle.metadata_url}): {why}"
            self._fail_now(rid, TransferStage.HANDSHAKE, why)
        try:
            self.add_peer(peer.data, handle.engine_id, handle.instance_id)
        except ValueError as e:
            why = f"metadata of {handle.engine_id} from {handle.metadata_url}: {e}"
            self._fail_now(rid, TransferStage.HANDSHAKE, why)
        except Exception as e:  # NIXL: the agent in the metadata cannot be reached
            why = f"adding NIXL agent {handle.engine_id}: {nixl_reason(e)}"
            self._fail_now(rid, TransferStage.HANDSHAKE, why)
        peer_ = self._peers[handle.engine_id]
        return peer_, peer_.info.layout

    def _post(
        self,
        handle: KVHandle,
        peer: _Peer,
        local_block_ids: list[int],
        remote_blocks: dict[str, list[int]],
        local_blocks: dict[str, list[int]],
    ) -> Load:
        """The request's load: a copy from a mapped same-host pool, a READ of its staged slab into
        landing room, or a READ of its blocks (poll_loads sends the release once it is done)."""
        common = dict(handle=handle, agent_name=peer.agent_name, timeout_s=self.transfer_timeout_s)
        if not any(remote_blocks.values()):  # nothing to read: let prefill free its lease now
            self._notify(peer.agent_name, handle.request_id)
            return NothingToRead(**common, started=time.monotonic())
        if peer.mapped is not None:
            started = time.monotonic()
            try:
                copy = self._copies.start(peer.mapped, remote_blocks, local_blocks)
            except Exception as e:
                why = f"copying from {peer.info.engine_id}'s mapped pool: {nixl_reason(e)}"
                self._fail_now(handle.request_id, TransferStage.READING, why)
            nbytes = payload_bytes(self.layout, local_blocks)
            return IpcCopy(**common, started=started, nbytes=nbytes, copy=copy, settle_s=COPY_SETTLE_S)
        info = peer.info
        landing = self._take_landing(handle, local_blocks, info.staging_bytes)
        if landing is not None:  # the slab, one descriptor each side
            slab = handle.staged
            remote: list[Descriptor] = [(info.staging_addr + slab.offset, slab.nbytes, info.dev_id)]
            local: list[Descriptor] = [(self.landing_arena.addr + landing, slab.nbytes, self._dev_id)]
        else:
            runs = region_runs(remote_blocks, local_blocks)
            remote = build_descriptors(info.layout, info.region_addrs, info.dev_id, runs, 0)
            local = build_descriptors(self.layout, self._addrs, self._dev_id, runs, 1)
        started = time.monotonic()
        xfer, state = self._read(handle, peer, local, remote, landing)
        common.update(started=started, num_descs=len(local), agent=self.agent, xfer=xfer)
        if landing is not None:
            load: Load = StagedRead(
                **common, nbytes=payload_bytes(self.layout, local_blocks), landing=landing, local_blocks=local_blocks,
                scatter=self._land, free_room=self._drop_landing,
            )  # fmt: skip
        else:
            load = BlockRead(**common, nbytes=sum(d[1] for d in local))
        if state == "DONE":  # large reads over cma complete inside transfer()
            load.finish()
        return load

    def _read(
        self, handle: KVHandle, peer: _Peer, local: list[Descriptor], remote: list[Descriptor], landing: int | None
    ) -> tuple[object, str]:
        """Post the READ: (its handle, NIXL's first state); raises TransferError (READING)."""
        rid, info = handle.request_id, peer.info
        xfer = None
        try:
            xfer = self.agent.prepare_read(local, self.mem_type, remote, info.mem_type, peer.agent_name)
            state = self.agent.post(xfer)
        except Exception as e:  # NIXL raises one unrelated class per status code
            self._release_read(xfer, landing)  # a handle made before transfer() raised is ours to free
            if is_disconnect(e):
                self._drop_peer(info.engine_id)
            self._fail_now(rid, TransferStage.READING, f"posting the READ from {info.engine_id}: {nixl_reason(e)}")
        if state == "ERR":
            self._release_read(xfer, landing)
            self._fail_now(rid, TransferStage.READING, f"NIXL refused the READ from {info.engine_id} (state ERR)")
        return xfer, state

    def _release_read(self, xfer: object, landing: int | None) -> None:
        """Free a READ's handle, then its landing room (never while NIXL may still write into it)."""
        self.agent.release(xfer, (lambda: self._drop_landing(landing)) if landing is not None else None)

    def poll_loads(self) -> tuple[list[str], list[TransferError]]:
        if self.agent is not None:
            self.agent.retry_releases()
        done: list[str] = []
        for rid, load in list(self._loads.items()):
            if load.finished_at is None:
                reason = load.poll()
                if load.peer_gone:
                    self._drop_peer(load.handle.engine_id)
                if reason is not None:
                    self._fail_load(rid, TransferStage.READING, reason)
                if load.finished_at is None:
                    continue
            if load.finished_at > load.handle.lease_expires_at:
                reason = "the prefill lease expired before the READ completed; its blocks may be reused"
                self._fail_load(rid, TransferStage.READING, reason)
                continue
            del self._loads[rid]
            tell = load.done()  # the data is here: prefill may free its blocks (and slab) once checked
            try:
                load.land()
            except Exception as e:  # the blocks are not whole: fail the request, not the engine
                if tell:
                    self._notify(load.agent_name, rid)
                self.stats.record_failed(TransferStage.READING.name)
                why = f"scattering the slab: {nixl_reason(e)}"
                self._failed.append(TransferError(rid, TransferStage.READING, why))
                continue
            verified = self._verified(load.handle)  # False: read again (in self._loads) or failed
            if tell and rid not in self._loads:
                self._notify(load.agent_name, rid)
            if not verified:
                continue
            saved = self._saved.pop(rid, 0)
            self.stats.record_done(LoadRecord(rid, load.nbytes, load.started, load.seconds, load.num_descs, saved))
            self.stats.record_path(load.path)
            done.append(rid)
        self._prune_plans()
        failed, self._failed = self._failed, []
        return done, failed

    def cancel_load(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.cancel()
            if load.settled():
                self._notify(load.agent_name, request_id)

    def shutdown(self) -> None:
        if self.agent is None:  # never registered
            return
        self.agent.stop_progress()
        for rid in list(self._loads):
            self.cancel_load(rid)
        self.agent.retry_releases()
        for engine_id in list(self._peers):
            self._drop_peer(engine_id)
        self.agent.deregister()

    # -- helpers --
    def _fail_load(self, rid: str, stage: TransferStage, reason: str) -> None:
        load = self._loads.pop(rid)
        load.cancel()
        if load.handle.engine_id in self._peers and load.settled():
            self._notify(load.agent_name, rid)  # let prefill free its blocks now, not at lease expiry
        self.stats.record_failed(stage.name)
        self._failed.append(TransferError(rid, stage, reason))

    def _notify(self, agent_name: str, rid: str) -> None:
        try:
            self.agent.notify(agent_name, release_message(rid))
        except Exception as e:  # the peer is gone: its lease expires on its own, but say so
            self.stats.record_control_failure("notify")
            log.warning("release notification for %s to %s failed: %s", rid, agent_name, nixl_reason(e))

    def _drop_peer(self, engine_id: str) -> None:
        """Forget a peer, so the next handle from it fetches fresh metadata (it may have restarted)."""
        self._handoff_peers.pop(engine_id, None)
        peer = self._peers.pop(engine_id, None)
        if peer is not None:
            try:
                self.agent.remove_remote(peer.agent_name)
            except Exception as e:  # already disconnected, most likely: counted and logged, not raised
                self.stats.record_control_failure("drop_peer")
                log.warning("removing NIXL agent %s failed: %s", peer.agent_name, nixl_reason(e))
