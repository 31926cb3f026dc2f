"""What every connector does the same way: registration bookkeeping, the prefill side's leases, the
checks before a load starts, and failure bookkeeping.

Backends (nixl, the test fake) differ only in how they reach a peer, move bytes and carry release
messages, so both derive from LeasingConnector and fill in three hooks:

    _registered(kv_cache)              the pool is known: register it with the transport
    _connect(handle, peer) -> (remote, its KVLayout)   the prefill engine the handle names, ready to read from
    _post(handle, remote, local_block_ids, remote_blocks, local_blocks) -> load    start the read;
                                       kept in self._loads (remote_blocks, local_blocks: per region,
                                       the blocks that region needs on each side, paired in order)

Staged transfer (staging.py) is shared too: register_kv_cache makes the arenas its role needs,
on_prefill_finished gathers into a slab of the staging arena (freed with the lease: release,
decode's message or expiry), and a backend's _post asks _take_landing for room to READ the slab
into, then _land scatters it (or _drop_landing frees it on a failed or cancelled load). A backend
whose decode peers copy straight from this pool (nixl, same machine: cuda_ipc.py) says so in
_peer_copies, and no slab is gathered for them.

Verified hand-off (checksum.py, `verify`): on_prefill_finished puts the blocks' checksums in the
handle; once a load's bytes are in this pool, a backend's poll_loads asks _verified before it
tells prefill to free them: a mismatch posts the same read once more (the lease still holds the
blocks), a second one fails the load at stage VERIFY.

Decode-side prefix caching: start_load's first num_reused_blocks are here already; token regions
read only later ones (per block, not the slab), checked against their per-block checksums; the
bytes not moved are the load's LoadRecord.nbytes_saved.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from pdserve import __version__
from pdserve.disagg.base import KVConnector, KVHandle, PeerMetadata, StagedSlab, TransferError, TransferStage
from pdserve.disagg.checksum import expected_checksums, leased_checksums, mismatched, pool_checksums
from pdserve.disagg.layout import KVLayout, check_block_ids, check_load_ids, compat_hash, region_blocks, skip_reused
from pdserve.disagg.lease_table import LeaseTable, parse_release
from pdserve.disagg.options import ConnectorRole, StagingOptions
from pdserve.disagg.staging import MIB, StagingArena, gather, scatter, slab_parts, synchronize
from pdserve.disagg.stats import TransferStats
from pdserve.model.kv_cache import KVCache

log = logging.getLogger("pdserve.disagg")


@dataclass
class _ReadPlan:
    """What start_load posted for a verified load, kept to post it again after a mismatch."""

    remote: Any
    local_block_ids: list[int]
    src: dict[str, list[int]]
    dst: dict[str, list[int]]
    first: dict[str, int]  # per token region, blocks the load skips (held here): dst starts at this position
    reread: bool = False


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
        role: ConnectorRole = "both",
        staging: StagingOptions | None = None,
        verify: bool = True,
    ) -> None:
        """metadata_url: where this worker serves its transfer metadata (goes into handles).
        lease_margin_s: a handle whose lease ends sooner than this is refused (clock skew, read time).
        role, staging: which staged-transfer arenas register_kv_cache makes, and their sizes.
        verify: checksum what prefill leases and check what decode writes (checksum.py)."""
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
        self.role = role
        self.staging = staging or StagingOptions()
        self.staging_arena: StagingArena | None = None  # prefill: gathered slabs, read by decode
        self.landing_arena: StagingArena | None = None  # decode: slabs read from prefill, then scattered
        self._slabs: dict[str, int] = {}  # request id -> its slab's offset in the staging arena
        self.verify = verify
        self._plans: dict[str, _ReadPlan] = {}  # decode: verified loads in flight
        self._saved: dict[str, int] = {}  # decode: loads in flight -> bytes their reused blocks did not move

    # -- registration --
    def register_kv_cache(self, kv_cache: KVCache) -> None:
        if self.kv is not None:
            raise RuntimeError("register_kv_cache called twice; the pool is registered once")
        self.kv = kv_cache
        self.layout = KVLayout.from_kv_cache(kv_cache)
        self.compat_hash = compat_hash(self.model_id, kv_cache.dtype, self.layout, kv_cache.block_size, self.version)
        first = next(iter(kv_cache.regions.values()))
        staging_mib, landing_mib = self.staging.arenas_mib(self.role, first.is_cuda)
        if staging_mib:
            self.staging_arena = StagingArena(staging_mib * MIB, first.device)
        if landing_mib:
            self.landing_arena = StagingArena(landing_mib * MIB, first.device)
        if self.verify and first.is_cuda:  # the checksum kernel compiled for this pool now, not at a first lease
            pool_checksums(kv_cache.regions, self.layout, {r.name: [0] for r in self.layout.regions if r.num_blocks})
        self._registered(kv_cache)

    def arenas(self) -> list[StagingArena]:
        """The staging arenas this worker made (registered with the transport beside the pool)."""
        return [a for a in (self.staging_arena, self.landing_arena) if a is not None]

    # -- prefill side --
    def on_prefill_finished(
        self,
        request_id: str,
        block_ids: list[int],
        num_tokens: int,
        window_block_ids: list[int] | None = None,
        state_slot: int = -1,
        kv_to: PeerMetadata | None = None,
    ) -> KVHandle:
        window = list(window_block_ids or [])
        lease_s = self.leases.add(request_id, block_ids)
        if self.staging_arena is not None and self._peer_copies(kv_to):
            self.stats.record_staged("prefill", "peer_copies")  # the decode worker copies from the pool itself
            staged = None
        else:
            staged = self._stage(request_id, list(block_ids), num_tokens, window, state_slot)
        checksums, block_checksums = self._checksums(
            request_id, list(block_ids), num_tokens, window, state_slot, staged
        )
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
            staged=staged,
            checksums=checksums,
            block_checksums=block_checksums,
        )

    def _checksums(
        self,
        rid: str,
        block_ids: list[int],
        num_tokens: int,
        window: list[int],
        state_slot: int,
        staged: StagedSlab | None,
    ) -> tuple[dict[str, int] | None, dict[str, list[int]] | None]:
        """The leased blocks' checksums per region (over the slab, a copy of them, when staged),
        and the token regions' per block."""
        if not self.verify:
            return None, None
        try:
            blocks = region_blocks(self.layout, block_ids, num_tokens, window, state_slot)
            for r in self.layout.regions:
                check_block_ids(blocks[r.name], r.num_blocks, f"prefill {r.name}")
        except ValueError as e:  # the decode side names the same problem when it reads the blocks
            log.warning("request %s: no checksums: %s", rid, e)
            return None, None
        slab = self.staging_arena.slab(staged.offset, staged.nbytes) if staged is not None else None
        return leased_checksums(self.kv.regions, self.layout, blocks, slab)

    def _stage(
        self, rid: str, block_ids: list[int], num_tokens: int, window: list[int], state_slot: int
    ) -> StagedSlab | None:
        """Gather the request's needed blocks into a slab of the staging arena; None without room."""
        arena = self.staging_arena
        if arena is None:
            return None
        try:
            blocks = region_blocks(self.layout, block_ids, num_tokens, window, state_slot)
        except ValueError as e:  # the decode side names the same problem when it reads the blocks
            log.warning("request %s not staged: %s", rid, e)
            return None
        _, nbytes = slab_parts(self.layout, {k: len(v) for k, v in blocks.items()})
        offset = arena.alloc(nbytes) if nbytes > 0 else None
        if offset is None:
            self.stats.record_staged("prefill", "arena_full")
            return None
        t0 = time.monotonic()
        slab = arena.slab(offset, nbytes)
        gather(self.kv.regions, self.layout, blocks, slab)
        synchronize(slab)  # whole before the handle (and so a READ) can leave
        self._slabs[rid] = offset
        self.stats.record_staged("prefill", "staged", time.monotonic() - t0)
        return StagedSlab(offset=offset, nbytes=nbytes)

    def _free_slab(self, request_id: str) -> None:
        offset = self._slabs.pop(request_id, None)
        if offset is not None:
            self.staging_arena.free(offset)

    def release(self, request_id: str) -> None:
        self._free_slab(request_id)
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
        for rid in released + expired:
            self._free_slab(rid)
        return released + expired

    # -- decode side --
    def start_load(
        self,
        handle: KVHandle,
        local_block_ids: list[int],
        peer: PeerMetadata | None = None,
        local_window_block_ids: list[int] | None = None,
        local_state_slot: int = -1,
        num_reused_blocks: int = 0,
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
            check_load_ids(remote_layout, (handle.block_ids, handle.window_block_ids, handle.state_slot), "prefill")
            check_load_ids(self.layout, (local_block_ids, local_window, local_state_slot), "decode")
            if len(handle.block_ids) != len(local_block_ids):
                raise ValueError(f"{len(handle.block_ids)} source blocks but {len(local_block_ids)} destination blocks")
            src = region_blocks(
                self.layout, handle.block_ids, handle.num_tokens, handle.window_block_ids, handle.state_slot, "prefill"
            )
            dst = region_blocks(
                self.layout, list(local_block_ids), handle.num_tokens, local_window, local_state_slot, "decode"
            )
            first = skip_reused(self.layout, num_reused_blocks, src, dst)
        except ValueError as e:
            self._fail_now(rid, TransferStage.PENDING, str(e))
        verify = self.verify and handle.checksums is not None
        if verify and num_reused_blocks and handle.block_checksums is None:
            self._fail_now(rid, TransferStage.PENDING, "the handle has no per-block checksums for a partial read")
        self._saved[rid] = sum(r.block_bytes * r.num_layers * first.get(r.name, 0) for r in self.layout.regions)
        self._loads[rid] = self._post(handle, remote, list(local_block_ids), src, dst)  # a refusal: _prune_plans
        if verify:
            self._plans[rid] = _ReadPlan(remote, list(local_block_ids), src, dst, first)

    # -- decode side, verified --
    def _verified(self, handle: KVHandle) -> bool:
        """A load's bytes are in the pool: True when they match prefill's checksums (or are not
        checked). False after a mismatch: the first time the read is posted again (in self._loads),
        the second a TransferError (VERIFY) is queued. The backend tells prefill to free its blocks
        only once no read of them is in flight (rid not in self._loads)."""
        rid = handle.request_id
        plan = self._plans.pop(rid, None)
        if plan is None:
            return True
        t0 = time.monotonic()
        expected = expected_checksums(handle.checksums, handle.block_checksums, plan.first)
        bad = mismatched(expected, pool_checksums(self.kv.regions, self.layout, plan.dst, first=plan.first))
        self.stats.record_verify(not bad, time.monotonic() - t0)
        if not bad:
            return True
        what = f"the KV read from {handle.engine_id} does not match its checksums in region(s) {', '.join(bad)}"
        if plan.reread:
            self.stats.record_failed(TransferStage.VERIFY.name)
            self._failed.append(TransferError(rid, TransferStage.VERIFY, f"{what}, read twice"))
            return False
        log.warning("request %s: %s; reading it again", rid, what)
        try:
            self._loads[rid] = self._post(handle, plan.remote, plan.local_block_ids, plan.src, plan.dst)
        except TransferError as e:  # _fail_now counted it
            self._failed.append(e)
            return False
        plan.reread = True
        self._plans[rid] = plan
        return False

    def _prune_plans(self) -> None:
        """Forget the plans (and reuse counts) of loads no longer in flight (failed or cancelled)."""
        for rid in [rid for rid in self._plans if rid not in self._loads]:
            del self._plans[rid]
        for rid in [rid for rid in self._saved if rid not in self._loads]:
            del self._saved[rid]

    # -- decode side, staged --
    def _take_landing(
        self, handle: KVHandle, local_blocks: dict[str, list[int]], remote_arena_bytes: int
    ) -> int | None:
        """Room in the landing arena for handle's slab (in the peer's staging arena of
        remote_arena_bytes), or None: read the blocks one by one instead."""
        if self.landing_arena is None:
            return None
        slab = handle.staged
        if slab is None or slab.offset + slab.nbytes > remote_arena_bytes:
            self.stats.record_staged("decode", "not_staged")
            return None
        if self._saved.get(handle.request_id):  # the slab holds every block; these are read one by one
            self.stats.record_staged("decode", "partial")
            return None
        _, nbytes = slab_parts(self.layout, {k: len(v) for k, v in local_blocks.items()})
        if nbytes != handle.staged.nbytes:  # same layout signature, same counts: never expected
            log.warning(
                "request %s: slab of %d bytes, %d expected; reading its blocks",
                handle.request_id,
                handle.staged.nbytes,
                nbytes,
            )
            self.stats.record_staged("decode", "not_staged")
            return None
        offset = self.landing_arena.alloc(nbytes)
        if offset is None:
            self.stats.record_staged("decode", "arena_full")
        return offset

    def _land(self, offset: int, nbytes: int, local_blocks: dict[str, list[int]]) -> None:
        """Scatter a slab that has arrived into the pool's blocks, then free its landing room."""
        t0 = time.monotonic()
        slab = self.landing_arena.slab(offset, nbytes)
        try:
            scatter(slab, self.layout, local_blocks, self.kv.regions)
            synchronize(slab)  # the room may be read into again at once
        finally:
            self.landing_arena.free(offset)
        self.stats.record_staged("decode", "staged", time.monotonic() - t0)

    def _drop_landing(self, offset: int | None) -> None:
        if offset is not None:
            self.landing_arena.free(offset)

    # -- backend hooks --
    def _peer_copies(self, kv_to: PeerMetadata | None) -> bool:
        """Prefill: the decode worker kv_to describes copies a request's blocks straight from this
        pool (a backend with a same-host path says so), so no slab is gathered for it."""
        return False

    @abstractmethod
    def _registered(self, kv_cache: KVCache) -> None:
        """The pool, layout and compat hash are set: register the pool with the transport."""

    @abstractmethod
    def _connect(self, handle: KVHandle, peer: PeerMetadata | None) -> tuple[Any, KVLayout]:
        """(the remote engine, its pool's layout); raises TransferError (HANDSHAKE)."""

    @abstractmethod
    def _post(
        self,
        handle: KVHandle,
        remote: Any,
        local_block_ids: list[int],
        remote_blocks: dict[str, list[int]],
        local_blocks: dict[str, list[int]],
    ) -> Any:
        """Start reading remote_blocks (per region) from remote into local_blocks (region_runs pairs
        them into runs), or its staged slab into landing room (_take_landing) to be scattered into
        local_blocks; the load record."""

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
