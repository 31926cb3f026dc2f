"""KV transfer over NIXL (UCX backend): the decode worker READs the prefill worker's blocks.

    prefill NixlConnector                               decode NixlConnector
    register_kv_cache: register regions once            register_kv_cache: register regions once
    peer_metadata() -> NixlPeerInfo JSON  <--HTTP-->    peer_metadata() (each worker fetches the
                                                          other's: worker/peers.py)
    send_handoff: add_remote_agent once per decode
      instance, notif "handoff:<Handoff JSON>" ------>  poll_handoffs: get_new_notifs
                                                        start_load(handle, blocks, peer): the shared
                                                          checks (leasing_connector.py), then
                                                          add_remote_agent once per engine instance
    on_prefill_finished: lease(blocks),                   staged slab + landing room: 1 descriptor,
      gather into a slab of the staging arena             else one per (region, layer, run)
                                                          initialize_xfer(READ), transfer()
    poll_releases: get_new_notifs  <--"release:<id>"--  poll_loads: check_xfer_state until DONE
                   + expired leases (slabs freed)         (then send_notif the release), ERR, or the
                                                          transfer timeout; a slab is scattered
                                                          into the blocks, its room freed

Every NIXL failure becomes a TransferError naming the request, the stage and the reason. On CPU,
UCX picks cma for data and tcp for messages; no UCX variables are needed. Over cma a large READ
completes inside transfer() (seen from ~1 MiB up), so start_load then costs the copy itself.

A decode READ completes only while the prefill side's UCX progresses too, over cuda_ipc as over
cma. With the prefill side progressed only when its engine polls (every 20 ms while it holds KV,
never during a step), a 4.5 MiB VRAM read on an H200 took 20 ms with prefill idle and 120 ms
with it running 100 ms steps; progressed every 1 ms, 0.8 and 1.8 ms (docs/pd-gpu.md). So a
prefill connector runs a small thread (`progress_interval_ms`) that progresses UCX and collects
release messages for poll_releases; NIXL's own progress thread does the same, busy-polling a core.

A pool on the GPU gets UCX defaults before the agent (and UCX) is created: `UCX_GPU_DEFAULTS`
(cuda_ipc GET zero-copy: without it UCX reads VRAM over tcp at 0.5 GB/s) and `UCX_MODULE_DIR` set
to the UCX plugin folder of the installed NIXL wheel (`ucx_module_dir()`), each only where the
environment does not set it already (docs/pd-gpu.md has the measurements).

On one host (pools on GPUs, the same boot id) the decode side does not READ at all: it maps the
prefill pool through CUDA IPC once per peer instance and copies a request's blocks with one kernel
of its own (cuda_ipc.py); NIXL still carries the metadata, the hand-off and the release. The
prefill side then skips the staging gather for that decode worker (its metadata says it maps
same-host peers). A peer that cannot be mapped is read over NIXL, with a warning.
"""

from __future__ import annotations

import base64
import importlib.util
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.disagg.base import KVHandle, PeerMetadata, TransferError, TransferStage
from pdserve.disagg.cuda_ipc import CopyInFlight, CopyQueue, IpcRegion, copy_views, export_pool, host_id, open_pool
from pdserve.disagg.options import ConnectorRole, StagingOptions
from pdserve.disagg.staging import payload_bytes
from pdserve.disagg.layout import Descriptor, KVLayout, build_descriptors, device_id, region_addrs, region_runs
from pdserve.disagg.lease_table import DEFAULT_LEASE_S, release_message
from pdserve.disagg.leasing_connector import LeasingConnector
from pdserve.disagg.stats import LoadRecord
from pdserve.model.kv_cache import KVCache

log = logging.getLogger("pdserve.disagg.nixl")

PEER_INFO_VERSION = 4
COPY_SETTLE_S = 5.0  # a cancelled or failed same-host copy is waited for this long before prefill is told to free
HANDOFF_PREFIX = b"handoff:"  # prefill -> decode: a Handoff's JSON follows (release messages go the other way)

# set for a pool on the GPU unless the environment sets them (H200, 2026-12-03: 0.5 GB/s without)
UCX_GPU_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
NIXL_BACKEND_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")  # wheels that ship <name>.libs/ucx


def _cuda_major() -> int | None:
    try:  # the nixl meta package's own choice of backend wheel (a plain module: loads no UCX)
        from nixl_meta_utils import detect_cuda_major
    except ImportError:
        return None
    return detect_cuda_major()


def ucx_module_dir(cuda_major: int | None = None) -> str | None:
    """The UCX plugin folder (`<package>.libs/ucx`) of the NIXL backend wheel that `import nixl`
    loads: nixl_cu<major> for the CUDA major of this process (torch's), else the first installed
    of NIXL_BACKEND_PACKAGES. Found on disk, without importing nixl. None when there is none."""
    major = _cuda_major() if cuda_major is None else cuda_major
    names = ((f"nixl_cu{major}",) if major else ()) + NIXL_BACKEND_PACKAGES
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = Path(next(iter(spec.submodule_search_locations))).parent / f"{name}.libs" / "ucx"
        if folder.is_dir():
            return str(folder)
    return None


def apply_ucx_gpu_defaults(environ: dict | None = None) -> dict[str, str]:
    """Set UCX_GPU_DEFAULTS and UCX_MODULE_DIR in `environ` (os.environ) where unset, before UCX
    loads; returns what was set (the user's own values always win)."""
    env = os.environ if environ is None else environ
    wanted = dict(UCX_GPU_DEFAULTS)
    module_dir = ucx_module_dir()
    if module_dir is not None:
        wanted["UCX_MODULE_DIR"] = module_dir
    applied = {k: v for k, v in wanted.items() if k not in env}
    env.update(applied)
    return applied


class NixlOptions(BaseModel):
    """The nixl backend's own settings (ConnectorSettings.options; transfer.options in a cluster YAML)."""

    model_config = ConfigDict(extra="forbid")

    # NIXL's own UCX progress thread busy-polls (nixl's Python agent sets its delay to 0): ~90% of a
    # core per idle worker. Off (default), transfers advance when the engine loop polls them (a
    # decode engine with loads in flight: every 0.2 ms, during its steps too) and, on a prefill
    # worker, from progress_interval_ms. On, a 4.7 MB hand-off's read took 1.3-2.6 ms under load
    # against 1.4-3.7 (H200, README "Hand-offs taken while the GPU computes a step").
    progress_thread: bool = False
    # prefill workers without it: a thread progresses UCX (and collects release messages) this
    # often, so decode's READs complete during prefill's steps too; 0: only when the engine polls
    progress_interval_ms: float = Field(1.0, ge=0)
    # a pool on the GPU: set UCX_GPU_DEFAULTS and UCX_MODULE_DIR where the environment does not
    ucx_gpu_defaults: bool = True
    # pools on GPUs of one host: decode maps the prefill pool through CUDA IPC and copies a
    # request's blocks itself (cuda_ipc.py); off: every request is read over NIXL
    cuda_ipc: bool = True


class NixlPeerInfo(BaseModel):
    """What a prefill worker serves at its metadata URL (JSON)."""

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


def _path(load: "_Load") -> str:
    """How a finished load moved its bytes (TransferStats.paths)."""
    if load.copy is not None:
        return "cuda_ipc"
    if load.landing is not None:
        return "staged"
    return "blocks" if load.xfer is not None else "none"


def _nixl_reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _is_disconnect(e: Exception) -> bool:
    return type(e).__name__ == "nixlRemoteDisconnectError"


@dataclass
class _Peer:
    info: NixlPeerInfo
    agent_name: str  # str, although add_remote_agent returns bytes (notification dicts are keyed by str)
    mapped: dict | None = None  # its pool mapped through CUDA IPC: per region, a RegionCopy (cuda_ipc.CopyQueue.bind)


@dataclass
class _Load:
    handle: KVHandle
    agent_name: str
    xfer: object  # nixl_xfer_handle
    started: float  # monotonic
    deadline: float  # monotonic
    nbytes: int
    num_descs: int
    landing: int | None = None  # offset of the slab's room in the landing arena (a staged read)
    local_blocks: dict[str, list[int]] | None = None  # where a staged slab is scattered to
    copy: CopyInFlight | None = None  # a same-host copy from the mapped peer pool (no xfer)
    finished_at: float | None = None  # wall clock when the READ was seen complete
    seconds: float = 0.0  # post to completion

    def finish(self) -> None:
        self.finished_at = time.time()
        self.seconds = time.monotonic() - self.started


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
    ) -> None:
        """See LeasingConnector for the common arguments.
        progress_thread: NIXL's own UCX progress thread; without it transfers advance only inside
        poll_loads / poll_releases calls, so a peer must poll while it holds KV (as the engine
        loop does). Workers take NixlOptions' default (off); on here for a caller that never polls.
        progress_interval_ms: a prefill-role connector without the progress thread progresses UCX
        from a thread of its own this often (0: never).
        ucx_gpu_defaults: for a pool on the GPU, set the UCX defaults above (unless set already).
        cuda_ipc: for a pool on the GPU, export it to same-host decode workers (prefill role) and
        map same-host prefill pools to copy from (decode role).
        The NIXL agent is created by register_kv_cache, once the pool's device is known."""
        if importlib.util.find_spec("nixl") is None:
            raise RuntimeError("transfer backend 'nixl' needs the nixl package (pip install nixl==1.5.1)")
        super().__init__(
            engine_id, model_id=model_id, metadata_url=metadata_url, lease_s=lease_s,
            transfer_timeout_s=transfer_timeout_s, lease_margin_s=lease_margin_s, version=version,
            role=role, staging=staging,
        )  # fmt: skip
        self._progress_thread, self._ucx_gpu_defaults, self._cuda_ipc = progress_thread, ucx_gpu_defaults, cuda_ipc
        self.host_id = host_id()
        self._exported: dict[str, IpcRegion] | None = None  # prefill: this pool for same-host decode workers
        self._maps_peers = False  # decode: copies from same-host prefill pools it maps
        self._copies: CopyQueue | None = None  # decode: where those copies run (beside the engine's steps)
        self._decode_maps: dict[str, tuple[bytes, bool]] = {}  # decode engine id -> (its metadata, copies from us)
        self.agent = None
        self.ucx_env_applied: dict[str, str] = {}
        self._reg = None
        self._metadata = b""
        self._peers: dict[str, _Peer] = {}
        self._progress_interval_s = progress_interval_ms / 1000
        self._agent_lock = threading.Lock()  # the progress thread and poll_releases share the agent
        self._releases: list[bytes] = []  # notifications that arrived and were not hand-offs
        self._handoffs: list[tuple[str, bytes]] = []  # hand-offs that arrived: (sender agent, payload)
        self._handoff_peers: dict[str, bytes] = {}  # decode engine id -> the metadata its agent was added from
        self._stop = threading.Event()
        self._progress: threading.Thread | None = None
        self._zombies: list[tuple[object, int | None]] = []  # xfer handles NIXL could not cancel yet, their landing room

    # -- registration --
    def _make_agent(self) -> None:
        """One agent per worker; UCX needs tcp for its messages, so no transport is narrowed.
        UCX reads its variables when NIXL loads it, so the GPU defaults go in first."""
        if self.mem_type == "VRAM" and self._ucx_gpu_defaults:
            self.ucx_env_applied = apply_ucx_gpu_defaults()
            if self.ucx_env_applied:
                log.info("UCX defaults for a GPU pool: %s", self.ucx_env_applied)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(f"transfer backend 'nixl' needs the nixl package (pip install nixl==1.5.1): {e}") from e
        config = nixl_agent_config(enable_prog_thread=self._progress_thread, backends=["UCX"])
        self.agent = nixl_agent(self.engine_id, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL's UCX backend plugin is missing from this nixl install")

    def _registered(self, kv_cache: KVCache) -> None:
        self._addrs = region_addrs(kv_cache)
        self._dev_id = device_id(kv_cache)
        first = next(iter(kv_cache.regions.values()))
        self.mem_type = "DRAM" if first.device.type == "cpu" else "VRAM"
        self._make_agent()
        self._reg = self.agent.register_memory(list(kv_cache.regions.values()) + [a.buffer for a in self.arenas()])
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
            agent_metadata=base64.b64encode(self.agent.get_agent_metadata()).decode(),
        )
        # built once: the HTTP server thread serves these bytes without touching the agent
        self._metadata = info.model_dump_json().encode()
        if self.role == "prefill" and not self._progress_thread and self._progress_interval_s > 0:
            self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True)
            self._progress.start()

    def _set_up_cuda_ipc(self, kv_cache: KVCache) -> None:
        """Export the pool (prefill) and make the copy queue (decode), for pools on a GPU."""
        if self.mem_type != "VRAM" or not self._cuda_ipc:
            return
        if self.role != "decode":
            try:
                self._exported = export_pool(kv_cache.regions)
            except Exception as e:  # e.g. an allocator that cannot share: decode workers read over NIXL
                log.warning("the KV pool cannot be shared through CUDA IPC (same-host decode workers read it over NIXL): %s", _nixl_reason(e))
        if self.role != "prefill":
            self._maps_peers = True
            self._copies = CopyQueue(next(iter(kv_cache.regions.values())).device)

    def _progress_loop(self) -> None:
        """Prefill side: progress UCX (peers' READs of our memory) and keep what notifications arrive."""
        while not self._stop.wait(self._progress_interval_s):
            try:
                with self._agent_lock:
                    self._drain()
            except Exception as e:  # keep progressing: reads stall without it; poll_releases sees the error too
                self.stats.record_control_failure("progress")
                log.warning("NIXL progress: %s", _nixl_reason(e))
                self._stop.wait(1.0)

    def peer_metadata(self) -> bytes:
        """This worker's NixlPeerInfo as JSON bytes, for its HTTP server to serve at metadata_url."""
        if not self._metadata:
            raise RuntimeError("peer_metadata() before register_kv_cache()")
        return self._metadata

    def _drain(self) -> None:
        """Progress UCX and sort what notifications arrived (the caller holds _agent_lock)."""
        for agent, msgs in self.agent.get_new_notifs().items():
            for msg in msgs:
                if msg.startswith(HANDOFF_PREFIX):
                    self._handoffs.append((agent.decode() if isinstance(agent, bytes) else agent, msg[len(HANDOFF_PREFIX) :]))
                else:
                    self._releases.append(msg)

    # -- prefill side --
    def poll_releases(self) -> list[str]:
        if self.agent is None:
            return self._released([])
        with self._agent_lock:
            self._drain()
            releases, self._releases = self._releases, []
        return self._released(releases)

    def send_handoff(self, peer: PeerMetadata, payload: bytes) -> None:
        """Notify the decode engine `peer` describes (its agent added once per instance: the
        metadata's bytes change when it restarts)."""
        if self.agent is None:
            raise RuntimeError("send_handoff() before register_kv_cache()")
        if peer.data is None:
            raise ValueError(f"no metadata for decode engine {peer.engine_id}: {peer.error}")
        with self._agent_lock:
            if self._handoff_peers.get(peer.engine_id) != peer.data or peer.engine_id not in self._peers:
                self.add_peer(peer.data, peer.engine_id, peer.instance_id)
                self._handoff_peers[peer.engine_id] = peer.data
            self.agent.send_notif(self._peers[peer.engine_id].agent_name, HANDOFF_PREFIX + payload)

    # -- decode side --
    def poll_handoffs(self) -> list[tuple[str, bytes]]:
        if self.agent is None:
            return []
        with self._agent_lock:
            self._drain()
            handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def add_peer(self, metadata: bytes, engine_id: str | None = None, instance_id: str | None = None) -> NixlPeerInfo:
        """Load a peer's metadata (its peer_metadata() bytes) into the agent; kept by its engine id.
        Raises ValueError for metadata this worker refuses (wrong engine_id / instance_id when
        given, hash mismatch), NIXL errors when the agent it names is unreachable."""
        try:
            info = NixlPeerInfo.model_validate_json(metadata)
        except ValidationError as e:
            raise ValueError(f"peer metadata is not a NixlPeerInfo: {e.errors()[:2]}") from e
        if info.version != PEER_INFO_VERSION:
            raise ValueError(f"peer metadata version {info.version}, this worker reads {PEER_INFO_VERSION}")
        if engine_id is not None and info.engine_id != engine_id:
            raise ValueError(f"it describes engine {info.engine_id!r}, not {engine_id!r}")
        if instance_id is not None and info.instance_id != instance_id:
            raise ValueError(f"it describes instance {info.instance_id} of {info.engine_id}, not {instance_id} (restarted?)")
        if info.compat_hash != self.compat_hash:
            raise ValueError(self._mismatch(info.engine_id, info.compat_hash))
        self._drop_peer(info.engine_id)  # known already: it restarted, the new metadata wins
        name = self.agent.add_remote_agent(base64.b64decode(info.agent_metadata))
        name = name.decode() if isinstance(name, bytes) else name
        if name != info.engine_id:
            self.agent.remove_remote_agent(name)
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
                info.engine_id, _nixl_reason(e),
            )  # fmt: skip
            return None

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

    def _connect(self, handle: KVHandle, peer: PeerMetadata | None) -> tuple[_Peer, KVLayout]:
        rid = handle.request_id
        known = self._peers.get(handle.engine_id)
        if known is not None and known.info.instance_id == handle.instance_id:
            return known, known.info.layout
        if peer is None or peer.data is None:
            why = peer.error if peer is not None and peer.error else "no metadata was fetched for it"
            self._fail_now(rid, TransferStage.HANDSHAKE, f"prefill engine {handle.engine_id} ({handle.metadata_url}): {why}")
        try:
            self.add_peer(peer.data, handle.engine_id, handle.instance_id)
        except ValueError as e:
            self._fail_now(rid, TransferStage.HANDSHAKE, f"metadata of {handle.engine_id} from {handle.metadata_url}: {e}")
        except Exception as e:  # NIXL: the agent in the metadata cannot be reached
            self._fail_now(rid, TransferStage.HANDSHAKE, f"adding NIXL agent {handle.engine_id}: {_nixl_reason(e)}")
        peer_ = self._peers[handle.engine_id]
        return peer_, peer_.info.layout

    def _post(
        self, handle: KVHandle, peer: _Peer, local_block_ids: list[int], remote_blocks: dict[str, list[int]], local_blocks: dict[str, list[int]]
    ) -> _Load:
        """Build both descriptor lists and post the READ (poll_loads sends the release once it is
        DONE), or the copy from a mapped same-host pool."""
        rid, info = handle.request_id, peer.info
        if not any(remote_blocks.values()):  # nothing to read: let prefill free its lease now
            self._notify(peer.agent_name, rid)
            load = _Load(handle, peer.agent_name, None, time.monotonic(), 0.0, 0, 0)
            load.finish()
            return load
        if peer.mapped is not None:
            return self._post_copy(handle, peer, remote_blocks, local_blocks)
        slab = handle.staged
        landing = self._take_landing(handle, local_blocks, info.staging_bytes)
        if landing is not None:  # the slab, one descriptor each side
            remote: list[Descriptor] = [(info.staging_addr + slab.offset, slab.nbytes, info.dev_id)]
            local: list[Descriptor] = [(self.landing_arena.addr + landing, slab.nbytes, self._dev_id)]
        else:
            runs = region_runs(remote_blocks, local_blocks)
            remote = build_descriptors(info.layout, info.region_addrs, info.dev_id, runs, 0)
            local = build_descriptors(self.layout, self._addrs, self._dev_id, runs, 1)
        started = time.monotonic()
        xfer = None
        try:
            xfer = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local, self.mem_type),
                self.agent.get_xfer_descs(remote, info.mem_type),
                peer.agent_name,
            )  # no notification attached: the release is sent once DONE is seen (poll_loads)
            state = self.agent.transfer(xfer)
        except Exception as e:  # NIXL raises one unrelated class per status code
            self._release_xfer(xfer, landing)  # a handle made before transfer() raised is ours to free
            self._drop_peer_if_gone(peer, e)
            self._fail_now(rid, TransferStage.READING, f"posting the READ from {info.engine_id}: {_nixl_reason(e)}")
        if state == "ERR":
            self._release_xfer(xfer, landing)
            self._fail_now(rid, TransferStage.READING, f"NIXL refused the READ from {info.engine_id} (state ERR)")
        nbytes = payload_bytes(self.layout, local_blocks) if landing is not None else sum(d[1] for d in local)
        load = _Load(handle, peer.agent_name, xfer, started, started + self.transfer_timeout_s, nbytes, len(local), landing, local_blocks)
        if state == "DONE":  # large reads over cma complete inside transfer()
            load.finish()
        return load

    def _post_copy(self, handle: KVHandle, peer: _Peer, remote_blocks: dict[str, list[int]], local_blocks: dict[str, list[int]]) -> _Load:
        """Same host: copy the request's blocks out of the mapped peer pool on the copy stream."""
        started = time.monotonic()
        try:
            copy = self._copies.start(peer.mapped, remote_blocks, local_blocks)
        except Exception as e:
            self._fail_now(handle.request_id, TransferStage.READING, f"copying from {peer.info.engine_id}'s mapped pool: {_nixl_reason(e)}")
        nbytes = payload_bytes(self.layout, local_blocks)
        load = _Load(handle, peer.agent_name, None, started, started + self.transfer_timeout_s, nbytes, 0, local_blocks=local_blocks, copy=copy)
        if copy.query():
            load.finish()
        return load

    def poll_loads(self) -> tuple[list[str], list[TransferError]]:
        self._retry_zombies()
        done: list[str] = []
        for rid, load in list(self._loads.items()):
            if load.finished_at is None:
                reason = self._check(load)
                if reason is not None:
                    self._fail_load(rid, TransferStage.READING, reason)
                if load.finished_at is None:
                    continue
            if load.finished_at > load.handle.lease_expires_at:
                reason = "the prefill lease expired before the READ completed; its blocks may be reused"
                self._fail_load(rid, TransferStage.READING, reason)
                continue
            del self._loads[rid]
            self._release_xfer(load.xfer)
            if load.xfer is not None or load.copy is not None:  # the data is here: prefill may free its blocks (and slab)
                self._notify(load.agent_name, rid)
            if load.landing is not None:  # the slab has arrived: into the pool's blocks
                try:
                    self._land(load.landing, load.handle.staged.nbytes, load.local_blocks)
                except Exception as e:  # the blocks are not whole: fail the request, not the engine
                    self.stats.record_failed(TransferStage.READING.name)
                    self._failed.append(TransferError(rid, TransferStage.READING, f"scattering the slab: {_nixl_reason(e)}"))
                    continue
                load.seconds = time.monotonic() - load.started
            self.stats.record_done(LoadRecord(rid, load.nbytes, load.started, load.seconds, load.num_descs))
            self.stats.record_path(_path(load))
            done.append(rid)
        failed, self._failed = self._failed, []
        return done, failed

    def _check(self, load: _Load) -> str | None:
        """Advance one in-flight READ (or copy): marks it finished, or returns why it failed."""
        engine_id = load.handle.engine_id
        if load.copy is not None:
            if load.copy.query():
                load.finish()
            elif time.monotonic() > load.deadline:
                return f"the copy from {engine_id}'s mapped pool did not finish within {self.transfer_timeout_s} s"
            return None
        try:
            state = self.agent.check_xfer_state(load.xfer)
        except Exception as e:
            peer = self._peers.get(engine_id)
            if peer is not None:
                self._drop_peer_if_gone(peer, e)
            return f"reading from {engine_id}: {_nixl_reason(e)}"
        if state == "ERR":
            self._drop_peer(engine_id)
            return f"remote {engine_id} failed the READ (state ERR; disconnected?)"
        if state == "DONE":
            load.finish()
        elif time.monotonic() > load.deadline:
            return f"no completion within {self.transfer_timeout_s} s"
        return None

    def cancel_load(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None:
            self._release_xfer(load.xfer, load.landing)
            if self._copy_settled(load):
                self._notify(load.agent_name, request_id)

    def shutdown(self) -> None:
        if self.agent is None:  # never registered
            return
        self._stop.set()
        if self._progress is not None:
            self._progress.join()
            self._progress = None
        for rid in list(self._loads):
            self.cancel_load(rid)
        self._retry_zombies()
        for engine_id in list(self._peers):
            self._drop_peer(engine_id)
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None

    # -- helpers --
    def _fail_load(self, rid: str, stage: TransferStage, reason: str) -> None:
        load = self._loads.pop(rid)
        self._release_xfer(load.xfer, load.landing)
        if load.handle.engine_id in self._peers and self._copy_settled(load):
            self._notify(load.agent_name, rid)  # let prefill free its blocks now, not at lease expiry
        self.stats.record_failed(stage.name)
        self._failed.append(TransferError(rid, stage, reason))

    def _copy_settled(self, load: _Load) -> bool:
        """No copy of load's is still reading the peer's blocks (waits briefly for one that is):
        only then may prefill free them. A copy still running after that is left to the lease."""
        if load.copy is None or load.copy.wait(COPY_SETTLE_S):
            return True
        log.error("request %s: the copy from %s's pool is still running after %g s; its blocks are freed at lease expiry",
                  load.handle.request_id, load.handle.engine_id, COPY_SETTLE_S)
        return False

    def _notify(self, agent_name: str, rid: str) -> None:
        try:
            self.agent.send_notif(agent_name, release_message(rid))
        except Exception as e:  # the peer is gone: its lease expires on its own, but say so
            self.stats.record_control_failure("notify")
            log.warning("release notification for %s to %s failed: %s", rid, agent_name, _nixl_reason(e))

    def _release_xfer(self, xfer: object, landing: int | None = None) -> None:
        """Free a transfer handle, then its landing room (never while NIXL may still write into it)."""
        if xfer is not None:
            try:
                xfer.release()  # cancels the transfer if it is still active
            except Exception:
                self._zombies.append((xfer, landing))
                return
        self._drop_landing(landing)

    def _retry_zombies(self) -> None:
        zombies, self._zombies = self._zombies, []
        for xfer, landing in zombies:
            self._release_xfer(xfer, landing)

    def _drop_peer_if_gone(self, peer: _Peer, e: Exception) -> None:
        if _is_disconnect(e):
            self._drop_peer(peer.info.engine_id)

    def _drop_peer(self, engine_id: str) -> None:
        """Forget a peer, so the next handle from it fetches fresh metadata (it may have restarted)."""
        self._handoff_peers.pop(engine_id, None)
        peer = self._peers.pop(engine_id, None)
        if peer is not None:
            try:
                self.agent.remove_remote_agent(peer.agent_name)
            except Exception as e:  # already disconnected, most likely: counted and logged, not raised
                self.stats.record_control_failure("drop_peer")
                log.warning("removing NIXL agent %s failed: %s", peer.agent_name, _nixl_reason(e))
