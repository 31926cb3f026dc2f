"""Same-host KV transfer without a transport: the decode worker maps a prefill worker's pool through
CUDA IPC once and copies each request's blocks out of it with one kernel of its own.

    prefill (pool on a GPU)                        decode (pool on a GPU, same host_id)
    register: export_pool(regions) -> a CUDA IPC   add_peer: open_pool -> the peer's regions as
      handle per region, in its NixlPeerInfo          tensors on this GPU, once per peer instance
                                                      (another GPU of the host: peer access, lazily)
                                                      and CopyQueue.bind: a copy kernel bound to
                                                      each region pair
                                                   start_load: CopyQueue.start -> one launch per
                                                      region on a side stream, ids read from pinned
                                                      host memory (no descriptors, nothing for the
                                                      prefill side to progress)
                                                   poll_loads: the copy's event -> release (NIXL notif)

Why: over NIXL a request is one descriptor per (region, layer, run), each with a fixed cost, or a
gather into a slab, a READ that completes only when the prefill side progresses UCX, and a scatter
(docs/pd-gpu.md compares the paths). A copy kernel that reads the peer's blocks and writes ours
moves the bytes once. The prefill side keeps the blocks pinned by the same lease, freed by the same
release message, so nothing else changes; a peer that cannot be mapped (another host, another
container's IPC namespace, GPUs without peer access) is read over NIXL as before. torch's own CUDA IPC sharing (torch.multiprocessing.reductions) makes
and opens the handles; no handle is ever pickled: the fields travel as JSON.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field

from pdserve.disagg.layout import KVLayout
from pdserve.disagg.staging import region_words
from pdserve_kernels.ref import copy_blocks_ref

if TYPE_CHECKING:
    from pdserve_kernels.block_copy import BoundCopy


class IpcRegion(BaseModel):
    """One pool region as torch's CUDA IPC sharing describes it (reduce_tensor's fields)."""

    model_config = ConfigDict(frozen=True)

    handle: str  # base64: the cudaIpcMemHandle of the allocation holding the region
    storage_bytes: int = Field(gt=0)  # the shared storage's size
    storage_offset: int = Field(ge=0)  # the storage's offset in that allocation
    offset_bytes: int = Field(ge=0)  # the region's offset in the storage
    nbytes: int = Field(gt=0)  # the region's bytes
    ref_counter_handle: str  # base64: torch's cross-process reference counter (a shared-memory file)
    ref_counter_offset: int
    event_handle: str  # base64: an IPC event recorded at export ("" if none)
    event_sync_required: bool


def host_id() -> str:
    """What two processes on one machine share and two machines do not: the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _b64(b: bytes | None) -> str:
    return base64.b64encode(b or b"").decode()


def export_pool(regions: dict[str, torch.Tensor]) -> dict[str, IpcRegion]:
    """A CUDA IPC description of each region (raises where the allocator cannot share them)."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = {}
    for name, t in regions.items():
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"region {name!r} is not one contiguous CUDA tensor")
        _rebuild, a = reduce_tensor(t)
        # (cls, size, stride, offset, storage cls, dtype, device, handle, storage bytes, storage
        #  offset, requires_grad, ref counter handle, ref counter offset, event handle, event sync)
        out[name] = IpcRegion(
            handle=_b64(a[7]), storage_bytes=a[8], storage_offset=a[9], offset_bytes=a[3] * t.element_size(),
            nbytes=t.numel() * t.element_size(), ref_counter_handle=_b64(a[11]), ref_counter_offset=a[12],
            event_handle=_b64(a[13]), event_sync_required=bool(a[14]),
        )  # fmt: skip
    return out


def open_pool(exported: dict[str, IpcRegion], layout: KVLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """The peer's regions (uint8, flat) mapped on `device`, this process's GPU: opened in its
    context, so a peer pool on another GPU of the host is reached through peer access. Raises
    when a region is missing, of another size, or cannot be opened."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    for r in layout.regions:
        e = exported.get(r.name)
        if e is None or e.nbytes != r.bytes or e.offset_bytes + e.nbytes > e.storage_bytes:
            raise ValueError(f"region {r.name!r}: the exported pool does not match the peer's layout")
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw, out = base64.b64decode, {}
    for r in layout.regions:
        e = exported[r.name]
        out[r.name] = rebuild_cuda_tensor(
            torch.Tensor, (e.nbytes,), (1,), e.offset_bytes, torch.UntypedStorage, torch.uint8, index,
            raw(e.handle), e.storage_bytes, e.storage_offset, False, raw(e.ref_counter_handle), e.ref_counter_offset,
            raw(e.event_handle) or None, e.event_sync_required,
        )  # fmt: skip
    return out


def copy_views(
    mapped: dict[str, torch.Tensor], src_layout: KVLayout, layout: KVLayout, regions: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per region, (the mapped peer region, this pool's region) as block words [Lr, N, W] of one
    dtype: made once per peer, so a request's copy builds no views."""
    out = {}
    for r, rs in zip(layout.regions, src_layout.regions):
        s = region_words(mapped[r.name].view(rs.num_layers, rs.num_blocks, -1), r.block_bytes)
        d = region_words(regions[r.name], r.block_bytes)
        if s.dtype != d.dtype:  # an alignment the word view could not take on one side
            s, d = s.view(torch.uint8), d.view(torch.uint8)
        out[r.name] = (s, d)
    return out


@dataclass
class CopyInFlight:
    """A request's copy queued on the side stream: done once its event is."""

    event: torch.cuda.Event | None  # None: it ran synchronously (a pool in host memory)
    source: dict | None = None  # the mapped peer regions and the ids: kept alive while it runs

    def query(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self, timeout_s: float) -> bool:
        """Poll until done (True) or timeout_s passes (False): a copy of even GBs takes ms."""
        deadline = time.monotonic() + timeout_s
        while not self.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True


@dataclass(frozen=True)
class RegionCopy:
    """One region's copy from a mapped peer: (the peer's words, ours), and on a GPU the copy kernel
    bound to that pair and the copy stream (CopyQueue.bind)."""

    src: torch.Tensor
    dst: torch.Tensor
    launch: BoundCopy | None  # None: a pool in host memory (tests), copied by the reference


class IdRing:
    """Block ids for the copy kernel in pinned host memory, which the kernel reads directly: no
    upload to post (one CUDA call less, and no wait on it). The CPU writes a request's ids into the
    next free range; copies run in order on one stream, so ranges come free oldest first, once the
    copy that reads one is done (`until.query()`). A request that finds no free range gets a buffer
    of its own. Ranges start 16-byte aligned, so every copy launches the same compiled kernel."""

    def __init__(self, capacity: int, pin: bool) -> None:
        self.buf = torch.empty(capacity, dtype=torch.int64, pin_memory=pin)
        self.addr = device_address(self.buf) if pin else self.buf.data_ptr()  # where the kernel reads buf[0]
        self._np = self.buf.numpy()
        self._pin = pin
        self._held: deque[tuple[int, int, object]] = deque()  # (start, end, until), oldest first

    def put(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """ids written where no queued copy reads them: (the tensor, its start; -1: a buffer of its own)."""
        k = len(ids)
        while self._held and self._held[0][2].query():
            self._held.popleft()
        start = self._room(_even(k))
        if start < 0:
            own = torch.tensor(ids, dtype=torch.int64)
            return (own.pin_memory() if self._pin else own), -1
        self._np[start : start + k] = ids
        return self.buf[start : start + k], start

    def hold(self, start: int, k: int, until: object) -> None:
        """The range put() returned at start stays taken until `until.query()` is true."""
        if start >= 0:
            self._held.append((start, start + _even(k), until))

    def _room(self, k: int) -> int:
        cap = self.buf.numel()
        if not self._held:
            return 0 if k <= cap else -1
        head, end = self._held[0][0], self._held[-1][1]
        if self._held[-1][0] >= head:  # not wrapped: free are [end, cap) and [0, head)
            return end if end + k <= cap else 0 if k <= head else -1
        return end if end + k <= head else -1  # wrapped: free is [end, head)


def _even(k: int) -> int:
    return k + (k & 1)


def device_address(t: torch.Tensor) -> int:
    """The address a kernel reads tensor t at: its own for device memory; for pinned host memory
    CUDA's answer (under unified addressing, the host address), asked once per buffer here rather
    than by Triton for every pointer of every launch."""
    if t.is_cuda:
        return t.data_ptr()
    if not t.is_pinned():
        raise ValueError("device_address: a host tensor must be pinned for a kernel to read it")
    out = ctypes.c_uint64()
    status = _libcuda().cuPointerGetAttribute(
        ctypes.byref(out), 3, ctypes.c_uint64(t.data_ptr())
    )  # 3: CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    if status != 0:
        raise RuntimeError(f"cuPointerGetAttribute: CUDA error {status} for a pinned buffer")
    return out.value


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")  # the driver, which torch has loaded already


class CopyQueue:
    """Where a decode worker's same-host copies run: a high-priority side stream beside the engine's
    steps (a hand-off's copy is short and its request waits on it, so its blocks go ahead of a
    running step's queued ones) and the IdRing its kernels read their block ids from. On CPU (a
    pool in host memory: tests) the copies run at once."""

    def __init__(self, device: torch.device, ring_ids: int = 1 << 16) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.ring = IdRing(ring_ids, pin=self.cuda)

    def bind(self, views: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, RegionCopy]:
        """A peer's regions (copy_views), each with its copy kernel bound: once per peer, so that a
        request's post does no checks, compiles nothing and binds no arguments."""
        if not self.cuda:
            return {name: RegionCopy(s, d, None) for name, (s, d) in views.items()}
        from pdserve_kernels.block_copy import BoundCopy  # Triton: GPU installs only

        return {name: RegionCopy(s, d, BoundCopy(s, d, self.stream)) for name, (s, d) in views.items()}

    def start(
        self, regions: dict[str, RegionCopy], src_blocks: dict[str, list[int]], dst_blocks: dict[str, list[int]]
    ) -> CopyInFlight:
        """Queue dst[:, dst_blocks] = src[:, src_blocks] for every region of `regions` (bind). The
        stream does not wait for the current one, so the copy can run beside a step in flight: the
        destination blocks must have no work queued (the engine's are freshly allocated, every step
        before is complete)."""
        names = [name for name in regions if src_blocks.get(name)]
        ids: list[int] = []
        for name in names:  # per region: its source ids, then its destination ids, each range even (16-byte aligned)
            for part in (src_blocks[name], dst_blocks[name]):
                ids += part
                ids += [0] * (len(part) & 1)
        buf, at = self.ring.put(ids)
        if not self.cuda:
            pos = 0
            for name in names:
                n, r = len(src_blocks[name]), regions[name]
                copy_blocks_ref(r.src, r.dst, buf[pos : pos + n], buf[pos + _even(n) : pos + _even(n) + n])
                pos += 2 * _even(n)
            return CopyInFlight(None)
        addr = self.ring.addr + 8 * at if at >= 0 else device_address(buf)
        for name in names:
            n = len(src_blocks[name])
            regions[name].launch(addr, addr + 8 * _even(n), n)
            addr += 16 * _even(n)
        event = torch.cuda.Event()
        event.record(self.stream)
        copy = CopyInFlight(event, {"regions": regions, "ids": buf})
        self.ring.hold(at, len(ids), copy)
        return copy
