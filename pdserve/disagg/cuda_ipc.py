"""Same-host KV transfer without a transport: the decode worker maps a prefill worker's pool through
CUDA IPC once and copies each request's blocks out of it with one kernel of its own.

    prefill (pool on a GPU)                        decode (pool on a GPU, same host_id)
    register: export_pool(regions) -> a CUDA IPC   add_peer: open_pool -> the peer's regions as
      handle per region, in its NixlPeerInfo          tensors on this GPU, once per peer instance
                                                      (another GPU of the host: peer access, lazily)
                                                   start_load: start_copy -> copy_blocks per region
                                                      on a side stream (no descriptors, nothing for
                                                      the prefill side to progress)
                                                   poll_loads: the copy's event -> release (NIXL notif)

Why: over NIXL a request is one descriptor per (region, layer, run) at ~10 us each, or a gather
into a slab, a READ that completes only when the prefill side progresses UCX, and a scatter
(docs/pd-gpu.md: 0.12 of a device copy end to end for an 8K-token V3 request). A copy kernel that
reads the peer's blocks and writes ours moves the bytes once. The prefill side keeps the blocks
pinned by the same lease, freed by the same release message, so nothing else changes; a peer that
cannot be mapped (another host, another container's IPC namespace, GPUs without peer access) is
read over NIXL as before. torch's own CUDA IPC sharing (torch.multiprocessing.reductions) makes
and opens the handles; no handle is ever pickled: the fields travel as JSON.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import time
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from pdserve.disagg.layout import KVLayout
from pdserve.disagg.staging import region_words


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
    source: dict | None = None  # the mapped peer regions: kept open while it runs

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


def start_copy(
    views: dict[str, tuple[torch.Tensor, torch.Tensor]],
    src_blocks: dict[str, list[int]],
    dst_blocks: dict[str, list[int]],
    stream: torch.cuda.Stream | None,
) -> CopyInFlight:
    """Queue dst[:, dst_blocks] = src[:, src_blocks] for every region's (src, dst) of `views`
    (copy_views) on `stream` (None: the current one, synchronously on CPU). The stream does not
    wait for the current one, so the copy can run beside a step in flight: the destination blocks
    must have no work queued (the engine's are freshly allocated, every step before is complete)."""
    from pdserve.model import ops

    names = [name for name in views if src_blocks.get(name)]
    device = next(iter(views.values()))[1].device
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        # every region's source ids, then its destination ids, in one small synchronous upload on
        # this stream (measured on the H200: faster than pinning a new buffer for each request)
        ids = torch.tensor([b for name in names for b in (*src_blocks[name], *dst_blocks[name])], dtype=torch.int64, device=device)
        at = 0
        for name in names:
            n = len(src_blocks[name])
            s, d = views[name]
            ops.copy_blocks(s, d, ids[at : at + n], ids[at + n : at + 2 * n])
            at += 2 * n
        if device.type != "cuda":
            return CopyInFlight(None)
        event = torch.cuda.Event()
        event.record()
    return CopyInFlight(event, views)
